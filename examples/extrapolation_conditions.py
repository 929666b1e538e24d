"""The extrapolation experiment's contenders: SepFormer's positional maps and extrapolation methods, GPT-2, Llama
(rotary) and Bloom (ALiBi), all of one shape (`experiment_common.model_config`), and the flags that choose them.

The controls: SepFormer's rules past a learned table applied to GPT-2's additive table (`wpe`), and its `interpolate`
to Llama's rotary (linear position interpolation), so that what separating position does is measured against the
same rule on a model that adds its positions to the tokens."""

import contextlib
import copy
from dataclasses import dataclass, field

import torch
from cli_arguments import Distinct, positive_int
from experiment_common import build_model, chosen
from extrapolation_task import MULTIPLIERS
from torch import nn

import sepformer
from sepformer.positional_maps import (
    EXTRAPOLATIONS,
    compress_positions,
    interpolate_rows,
    randomized_positions,
    sinusoid,
)

NATIVE = "-"  # the method column of models that have no extrapolation method to choose
PEER_TOKENS = dict(pad_token_id=256, bos_token_id=257, eos_token_id=258, tie_word_embeddings=False)


@dataclass
class Contender:
    """One model to train: `family` (`experiment_common.model_config`) with `config`; `methods`: how it is evaluated."""

    name: str
    config: dict = field(default_factory=dict)
    family: str = "sepformer"
    methods: tuple[str, ...] = (NATIVE,)
    last_position_target: bool = True  # False: position L-1 has no target, as when training on blocks of L tokens
    width: float = 1.0  # d_model as a multiple of --hidden-size (rounded to a multiple of the heads)
    # GPT-2 trained on randomized positions from [0, 8L) as a SepFormer is: "fixed" or "per_sequence" (the range)
    randomized_range: str | None = None
    # GPT-2 with the fixed sinusoid as its table (added to the tokens), not learned rows, scaled to this per-coordinate
    # standard deviation (the sinusoid's own is 1/√2; GPT-2's token embeddings start at 0.02)
    sinusoid_std: float | None = None

    def build(self, args, vocab_size: int) -> torch.nn.Module:
        hidden_size = args.num_heads * max(1, round(args.hidden_size * self.width / args.num_heads))
        length = args.block_size * (MULTIPLIERS[-1] if self.randomized_range else 1)  # a table of 8L rows
        model = build_model(
            self.family, vocab_size, hidden_size, args.num_layers, args.num_heads, length, **self.config
        )
        if self.randomized_range:
            randomize_training_positions(model, length, self.randomized_range == "per_sequence")
        if self.sinusoid_std is not None:  # "Attention Is All You Need"'s positions, over the whole width
            table = model.transformer.wpe
            table.weight.data.copy_(sinusoid(torch.arange(length), hidden_size) * self.sinusoid_std * 2**0.5)
            table.weight.requires_grad_(False)
        return model

    @contextlib.contextmanager
    def reading(self, model, method: str, length: int, train_length: int):
        """The model set to read windows of `length` tokens by `method`; yields the forward's keywords. A SepFormer
        takes the method per call; a peer's positions are swapped for the evaluation (`peer_positions`)."""
        if method == NATIVE:
            yield {}
        elif self.family == "sepformer":
            yield {"position_extrapolation": method}
        else:
            with peer_positions(model, self.family, method, length, train_length):
                yield {}


def randomize_training_positions(model, position_range: int, per_sequence_range: bool) -> None:
    """GPT-2's positions in training drawn as a SepFormer's `randomized_positions` draws them (`[0, position_range)`,
    sorted, distinct; each sequence's own range with `per_sequence_range`), through a forward pre-hook on its
    `transformer`; in eval it reads `0..n-1`. With the positions goes a full attention mask: without a mask or a cache,
    transformers reads positions that do not count up by one as packed sequences and masks across them."""

    def draw(module, args, kwargs):
        if module.training:
            ids = args[0] if args else kwargs["input_ids"]  # (b, n)
            positions = torch.arange(ids.shape[1], device=ids.device).expand(ids.shape[0], -1)
            kwargs["position_ids"] = randomized_positions(positions, ids.shape[1], position_range, per_sequence_range)
            if kwargs.get("attention_mask") is None:
                kwargs["attention_mask"] = torch.ones_like(ids)
        return args, kwargs

    model.transformer.register_forward_pre_hook(draw, with_kwargs=True)


@contextlib.contextmanager
def peer_positions(model, family: str, method: str, length: int, train_length: int):
    """For windows of `length` tokens, SepFormer's rule `method` past the training length `L` on a peer's positions:
    GPT-2's table `wpe` of `L` rows extended as a SepFormer's learned table is (`interpolate`: every window read at
    `i · (L-1)/(n-1)`, between rows; the others: rows `L..n-1` made by the method); Llama's rotary under `interpolate`
    reads those compressed positions (transformers' linear rope scaling, factor `(n-1)/(L-1)`). Restored after."""
    if length <= train_length:
        yield
        return
    if family == "gpt2" and method in (*EXTRAPOLATIONS, "interpolate"):
        table = model.transformer.wpe.weight.detach()  # (L, d)
        positions = torch.arange(length, device=table.device)
        if method == "interpolate":
            rows = interpolate_rows(table, compress_positions(positions, train_length, length))
        else:
            extrapolation = sepformer.PositionExtrapolation(method)
            rows = torch.cat((table, EXTRAPOLATIONS[method](table, positions[train_length:], extrapolation)))
        trained, model.transformer.wpe = model.transformer.wpe, nn.Embedding.from_pretrained(rows)  # (n, d)
        try:
            yield
        finally:
            model.transformer.wpe = trained
    elif family == "llama" and method == "interpolate":
        config = copy.deepcopy(model.config)
        factor = (length - 1) / (train_length - 1)
        config.rope_parameters = {**config.rope_parameters, "rope_type": "linear", "factor": factor}
        trained = model.model.rotary_emb
        model.model.rotary_emb = type(trained)(config).to(model.device)
        try:
            yield
        finally:
            model.model.rotary_emb = trained
    else:
        raise ValueError(
            f"its positions stop at L = {train_length} (a table of L rows, n_positions = L), and {method!r} reads none "
            "past them"
        )


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
        # As many parameters as the peers (block-diagonal values, outputs and MLPs, a narrower token embedding: a
        # SepFormer of the same width has about 30% fewer).
        Contender("SepFormer learned, 1.25x wide (the peers' parameters)", methods=args.methods, width=1.25),
        Contender("SepFormer learned, last row untrained", methods=("clamp",), last_position_target=False),
        # Half the training sequences shifted by a random offset: all 8L rows trained, no extrapolation up to 8L.
        Contender(
            "SepFormer learned, random offsets (8L table)",
            dict(position_table_size=longest, random_position_offsets=True),
        ),
        Contender("SepFormer learned, randomized positions (8L table)", randomized),
        Contender("SepFormer learned, randomized positions, range per sequence (8L table)", randomized | per_sequence),
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
        *peer_contenders(args),
    ]
    return chosen(every, args.models, lambda word, c: word.lower() in c.name.lower(), ", ".join(c.name for c in every))


def peer_contenders(args) -> list[Contender]:
    """GPT-2, Llama and Bloom, and the controls: SepFormer's rules past a learned table on GPT-2's additive table, its
    randomized positions and a fixed sinusoid on GPT-2, interpolation on Llama's rotary."""
    gpt2 = PEER_TOKENS | dict(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    return [
        Contender(
            "GPT-2 (learned, additive)",
            gpt2,
            "gpt2",
            methods=args.methods,
        ),
        # The control of randomized positions: the same training on an additive table.
        Contender(
            "GPT-2, randomized positions (8L table)",
            gpt2,
            "gpt2",
            randomized_range="fixed",
        ),
        Contender(
            "GPT-2, randomized positions, range per sequence (8L table)",
            gpt2,
            "gpt2",
            randomized_range="per_sequence",
        ),
        *(
            Contender(
                f"GPT-2 sinusoidal (fixed, added{scale}), randomized positions, range per sequence (8L)",
                gpt2,
                "gpt2",
                randomized_range="per_sequence",
                sinusoid_std=std,
            )
            for scale, std in (("", 2**-0.5), (", at the tokens' std 0.02", 0.02))
        ),
        Contender(
            "Llama (rotary)", PEER_TOKENS, "llama", methods=(NATIVE, *[m for m in args.methods if m == "interpolate"])
        ),
        Contender("Bloom (ALiBi)", PEER_TOKENS, "bloom"),
    ]


def check_models(args, vocab_size: int) -> None:
    """Every contender built once before any data is read: sizes that a model refuses stop the run now, not after the
    models before it have trained."""
    for contender in contenders(args):
        try:
            contender.build(args, vocab_size)
        except ValueError as error:
            raise SystemExit(f"{contender.name} cannot be built with these flags: {error}") from None
