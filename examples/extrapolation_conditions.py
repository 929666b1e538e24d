"""The extrapolation experiment's contenders: SepFormer's positional maps and extrapolation methods, GPT-2, Llama
(rotary) and Bloom (ALiBi), all of one shape (`experiment_common.model_config`), and the flags that choose them."""

from dataclasses import dataclass, field

import torch
from cli_arguments import Distinct, positive_int
from experiment_common import build_model, chosen
from extrapolation_task import MULTIPLIERS

import sepformer

NATIVE = "-"  # the method column of models that have no extrapolation method to choose
PEER_TOKENS = dict(pad_token_id=256, bos_token_id=257, eos_token_id=258, tie_word_embeddings=False)


@dataclass
class Contender:
    """One model to train: `family` (`experiment_common.model_config`) with `config`; `methods`: how it is evaluated."""

    name: str
    config: dict = field(default_factory=dict)
    family: str = "sepformer"
    methods: tuple[str, ...] = (NATIVE,)
    max_length: int | None = None  # longer inputs are not even tried (GPT-2: an index error, a device assert on GPU)
    last_position_target: bool = True  # False: position L-1 has no target, as when training on blocks of L tokens

    def build(self, args, vocab_size: int) -> torch.nn.Module:
        shape = vocab_size, args.hidden_size, args.num_layers, args.num_heads, args.block_size
        return build_model(self.family, *shape, **self.config)


def add_model_arguments(parser) -> None:
    """The flags that choose the contenders and their B-spline maps' control points."""
    parser.add_argument("--models", nargs="+", help="substrings of model names to keep, e.g. sepformer llama")
    parser.add_argument(
        "--methods",
        nargs="+",
        choices=sepformer.EXTRAPOLATION_METHODS,
        action=Distinct,
        help="extrapolation methods for the learned SepFormer (default: all)",
    )
    parser.add_argument(
        "--spline-control-points", type=positive_int, default=16, help="control points of the B-spline map over [0, L)"
    )
    parser.add_argument(
        "--spline-randomized-control-points",
        type=positive_int,
        default=32,
        help="control points of the B-spline map over [0, 8L) trained with randomized positions",
    )


def contenders(args) -> list[Contender]:
    """The models that `--models` keeps, in run order; every one sees positions up to 8L in training or evaluation."""
    longest = MULTIPLIERS[-1] * args.block_size  # 8L: every position evaluated is trained by the 8L rows
    randomized = dict(position_table_size=longest, randomized_positions=True)
    sinusoid, per_sequence = dict(positional_map="sinusoidal"), dict(randomized_range="per_sequence")
    spline = dict(positional_map={"map": "bspline", "control_points": args.spline_control_points})
    n = args.spline_randomized_control_points
    randomized_spline = dict(positional_map={"map": "bspline", "control_points": n}, **randomized)
    every = [
        Contender("SepFormer learned", methods=args.methods),
        Contender("SepFormer learned, last row untrained", methods=("clamp",), last_position_target=False),
        # Half the training sequences shifted by a random offset: all 8L rows trained, no extrapolation up to 8L.
        Contender(
            "SepFormer learned, random offsets (8L table)",
            dict(position_table_size=longest, random_position_offsets=True),
        ),
        Contender("SepFormer learned, randomized positions (8L table)", randomized),
        Contender("SepFormer sinusoidal", sinusoid),
        Contender("SepFormer sinusoidal, randomized positions (8L)", sinusoid | randomized),
        Contender(f"SepFormer B-spline (n={args.spline_control_points})", spline),
        Contender(f"SepFormer B-spline (n={n}), randomized positions (8L)", randomized_spline),
        # Each sequence draws its own range first: gaps from none (as at inference) to 8L / L.
        Contender(
            "SepFormer sinusoidal, randomized positions, range per sequence (8L)", sinusoid | per_sequence | randomized
        ),
        Contender(
            f"SepFormer B-spline (n={n}), randomized positions, range per sequence (8L)",
            per_sequence | randomized_spline,
        ),
        Contender("SepFormer d_pos=0", dict(position_size=0)),
        Contender(
            "GPT-2 (learned, additive)",
            PEER_TOKENS | dict(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0),
            "gpt2",
            max_length=args.block_size,
        ),
        Contender("Llama (rotary)", PEER_TOKENS, "llama"),
        Contender("Bloom (ALiBi)", PEER_TOKENS, "bloom"),
    ]
    return chosen(every, args.models, lambda word, c: word.lower() in c.name.lower(), ", ".join(c.name for c in every))


def check_models(args, vocab_size: int) -> None:
    """Every contender built once before any data is read: sizes that a model refuses stop the run now, not after the
    models before it have trained."""
    for contender in contenders(args):
        try:
            contender.build(args, vocab_size)
        except ValueError as error:
            raise SystemExit(f"{contender.name} cannot be built with these flags: {error}") from None
