"""The family matrix: every causal-LM family transformers ships (its own `MODEL_FOR_CAUSAL_LM_MAPPING_NAMES`), built
tiny and random, each mitigation checked against an oracle built from the model itself, or refused by name.

`tests/test_families.py` runs it; `python tests/family_matrix.py` writes the table of docs/families.md. A family a new
transformers release adds is in the matrix without anyone writing it in: built from its config class's defaults with
the sizes of `TINY` (the fields its config has), or reported with the reason it could not be built tiny.

Each check returns `"exact"` (the oracle holds) or `"refused: <message>"` (a `ValueError`/`TypeError` naming the
option before any work); anything else, a wrong number or an error from inside torch or transformers, fails.
"""

import contextlib
import copy
import functools
import sys
import warnings
from pathlib import Path

import torch
import transformers
from test_any_decoder import stepwise_logits
from test_any_decoder_positions import built_at_base
from test_buckets_and_windows import mixed_by_hand
from transformers import CONFIG_MAPPING, AutoModelForCausalLM
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
from transformers.utils import logging

import sepformer
from sepformer import (
    AttentionBuckets,
    AttentionCalibration,
    MSPoE,
    ParallelContextWindows,
    PositionalScaling,
    StableMask,
)

FAMILIES = tuple(sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES))
# The sizes of a tiny model, under every name a family's config may use; a config takes those among its fields.
TINY = dict(
    vocab_size=256,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    max_position_embeddings=64,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
    is_decoder=True,  # the encoder families' causal-LM heads (BERT, RoBERTa) attend causally only as decoders
    rotary_dim=4,  # partial rotary where the config counts it in dimensions (GPT-J, CodeGen)
    # GPT-2-like names
    n_embd=32,
    n_layer=2,
    n_head=4,
    n_positions=64,
    n_ctx=64,
    # mixtures of experts
    num_experts=4,
    num_local_experts=4,
    n_routed_experts=4,
    moe_num_experts=4,
    num_experts_per_tok=2,
    moe_k=2,
    moe_intermediate_size=16,
    shared_expert_intermediate_size=16,
    n_shared_experts=1,
    first_k_dense_replace=1,
    n_group=1,
    topk_group=1,
    # multi-head latent attention (DeepSeek): a head is [nope ‖ rope]
    q_lora_rank=16,
    kv_lora_rank=16,
    qk_rope_head_dim=4,
    qk_nope_head_dim=4,
    v_head_dim=8,
    # per-layer inputs (Gemma 3n, 4)
    vocab_size_per_layer_input=256,
    hidden_size_per_layer_input=8,
    # the state-space layers of the hybrids: Falcon-H1's defaults run 128 heads of state 256 in chunks of 256 tokens
    # (the other hybrids that take these fields, Bamba, GraniteMoeHybrid, Jamba, Zamba, are not built tiny either way)
    mamba_d_ssm=32,
    mamba_n_heads=4,
    mamba_d_head=8,
    mamba_d_state=16,
    mamba_chunk_size=16,
)
DOCUMENT = Path(__file__).parent.parent / "docs" / "families.md"  # the table `table()` writes
CHECKS = (
    "wraps",
    "ms_poe",
    "stable_mask",
    "positional_scaling",
    "parallel_context_windows",
    "attention_buckets_scales",
    "attention_buckets_bases",
    "attention_calibration",
    "left_padding",
)
TOLERANCE = 1e-5  # of the largest logit
MAX_PARAMETERS = 4_000_000
LENGTH, PREFILL = 12, 8  # tokens of each prompt; the cached checks prefill the first 8, then one token per step
PADDING = 3  # pad tokens before the first prompt of the left-padded batch
# The options of the left-padding check, each with its spans for one row (counted from the row's first real token).
PADDED_OPTIONS = {
    "ms_poe": MSPoE(1.2, 1.8, head_order=(3, 0, 2, 1)),
    "ms_poe ranked": MSPoE(),
    "stable_mask": StableMask(0.5),
    "positional_scaling": PositionalScaling(factor=-1.0, channels=tuple(range(8)), layers=(0, 1)),
    "parallel_context_windows": ParallelContextWindows(spans=(((0, 2), (2, 5)),)),
    "attention_buckets scales": AttentionBuckets(scales=(1.0, 0.5)),
    "attention_buckets bases": AttentionBuckets(bases=(500.0, 3e5)),
    "attention_calibration": AttentionCalibration(spans=(((1, 3), (3, 5)),)),
}


class NoOracle(Exception):
    """The option's oracle cannot be built from this model (the reason)."""


class NotBuilt(Exception):
    """The family could not be built tiny from its config's defaults (the reason), or is not one model."""


def tiny_config(family: str):
    config_class = CONFIG_MAPPING[family]
    default = config_class()
    if default.get_text_config() is not default:
        raise NotBuilt("a composite config (its text model is a family of its own)")
    sizes = {name: value for name, value in TINY.items() if hasattr(default, name)}
    if "qk_rope_head_dim" in sizes:  # latent attention: the rotary acts on qk_rope_head_dim of each head, and every
        sizes["head_dim"] = sizes["qk_rope_head_dim"]  # query head has its own key (as in the released configs)
        sizes["num_key_value_heads"] = sizes["num_attention_heads"]
    return config_class(**sizes)


@functools.cache
def tiny_model(family: str):
    """(model, None), or (None, why it could not be built): a random model of `family`, its query and key projections
    sharpened so that positions matter, in eval mode."""
    try:
        with warnings.catch_warnings(), quiet_transformers():
            warnings.simplefilter("ignore")
            config = tiny_config(family)
            with torch.device("meta"):  # sized before any memory is taken: a default TINY missed can be huge
                parameters = sum(parameter.numel() for parameter in from_config(config).parameters())
            if parameters > MAX_PARAMETERS:
                raise NotBuilt(f"{parameters:,} parameters from its defaults with the sizes of TINY")
            torch.manual_seed(0)
            model = from_config(config).eval()
            sharpen_queries_and_keys(model)
            with torch.no_grad():
                model(prompts())
    except NotBuilt as reason:
        return None, str(reason)
    except Exception as error:  # a config whose defaults do not shrink to TINY (a validator, a derived size)
        return None, f"not built tiny from its defaults ({type(error).__name__}: {first_line(error)})"
    return model, None


def from_config(config):
    """The family's causal LM with sdpa attention, or eager where it has no sdpa."""
    try:
        return AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    except ValueError as error:
        if "does not support an attention implementation" not in str(error):
            raise
        return AutoModelForCausalLM.from_config(config, attn_implementation="eager")


def sharpen_queries_and_keys(model) -> None:
    """Query and key weights (any projection of an attention module whose name says q, k or both) times 4."""
    with torch.no_grad():
        for module in model.modules():
            if not hasattr(module, "layer_idx"):
                continue
            for name, child in module.named_children():
                weight = getattr(child, "weight", None)
                if isinstance(weight, torch.Tensor) and weight.dim() == 2 and is_query_or_key(name):
                    weight.mul_(4)


def is_query_or_key(name: str) -> bool:
    name = name.lower()
    return name.startswith(("q", "k", "c_attn", "wqkv")) or name in ("query", "key") or "qkv" in name


def first_line(error: Exception) -> str:
    return str(error).strip().splitlines()[0][:160] if str(error).strip() else type(error).__name__


class quiet_transformers:
    def __enter__(self):
        self.level = logging.get_verbosity()
        logging.set_verbosity_error()

    def __exit__(self, *exc):
        logging.set_verbosity(self.level)


def prompts() -> torch.Tensor:
    return torch.randint(3, 256, (2, LENGTH), generator=torch.Generator().manual_seed(0))


def run(model, ids, **kwargs) -> torch.Tensor:
    with torch.no_grad():
        return model(ids, **kwargs).logits


def close(ours: torch.Tensor, reference: torch.Tensor, what: str) -> None:
    """Equal up to float32 rounding, relative to the size of the logits."""
    difference, scale = (ours - reference).abs().max().item(), max(1.0, reference.abs().max().item())
    assert difference <= TOLERANCE * scale, f"{what}: max difference {difference:.3g} (logits up to {scale:.3g})"


def acts(ours: torch.Tensor, plain: torch.Tensor, what: str) -> None:
    assert (ours - plain).abs().max() > 1e-4, f"{what}: the option changed nothing (the check would be empty)"


def check_wraps(model, plain, ids):
    close(run(model, ids), run(plain, ids), "wrapped, without options, vs the plain model")


def check_ms_poe(model, plain, ids):
    """One ratio r in every layer = the plain model reading positions m / r."""
    ratio, layers = 1.5, tuple(range(model.config.num_hidden_layers))
    heads = tuple(range(model.config.num_attention_heads))  # a fixed order: one ratio, so the ranking is moot
    ours = run(model, ids, ms_poe=MSPoE(ratio, ratio, layers=layers, head_order=heads))
    positions = torch.arange(ids.shape[1]).expand_as(ids) / ratio
    reference = run(plain, ids, position_ids=positions)
    if torch.equal(reference, run(plain, ids)):
        raise NoOracle("the plain model's logits do not follow the position_ids it is given")
    close(ours, reference, "ms_poe with one ratio vs the plain model at positions m / r")


def check_stable_mask(model, plain, ids):
    """With a very large gamma every sink logit is far below the scores: the plain model, full and cached."""
    option = StableMask(60.0)
    reference = run(plain, ids)
    close(run(model, ids, stable_mask=option), reference, "stable_mask gamma=60, full pass, vs the plain model")
    close(
        stepwise_logits(model, ids, PREFILL, stable_mask=option),
        reference,
        "stable_mask gamma=60, cached, vs the plain model",
    )


def check_positional_scaling(model, plain, ids):
    """Every row but the last reads unscaled queries against unscaled keys: the plain model's rows."""
    layers = tuple(range(model.config.num_hidden_layers))
    option = PositionalScaling(factor=-1.0, channels=tuple(range(8)), layers=layers)
    ours, reference = run(model, ids, positional_scaling=option), run(plain, ids)
    close(ours[:, :-1], reference[:, :-1], "positional_scaling, rows before the last, vs the plain model")
    acts(ours[:, -1], reference[:, -1], "positional_scaling, last row")


def check_parallel_context_windows(model, plain, ids):
    """One window over the prompt's start = the plain model; two windows: cached = full."""
    one = ParallelContextWindows(spans=(((0, PREFILL),),) * len(ids))
    close(run(model, ids, parallel_context_windows=one), run(plain, ids), "one window vs the plain model")
    two = ParallelContextWindows(spans=(((0, 3), (3, PREFILL)),) * len(ids))
    full = run(model, ids, parallel_context_windows=two)
    acts(full, run(plain, ids), "two windows")
    close(stepwise_logits(model, ids, PREFILL, parallel_context_windows=two), full, "two windows, cached vs full")


def check_attention_buckets_scales(model, plain, ids):
    """Two buckets reading positions m and m · 0.5 = the plain model at each, mixed by confidence; cached = full."""
    option = AttentionBuckets(scales=(1.0, 0.5))
    ours, whole = run(model, ids, attention_buckets=option), run(plain, ids)
    half = run(plain, ids, position_ids=torch.arange(ids.shape[1]).expand_as(ids) * 0.5)
    if torch.equal(half, whole):
        raise NoOracle("the plain model's logits do not follow the position_ids it is given")
    close(ours, mixed_by_hand([whole, half]), "buckets at scales 1 and 0.5 vs the plain model at each")
    close(stepwise_logits(model, ids, PREFILL, attention_buckets=option), ours, "buckets, cached vs full")


def at_rotary_base(plain, base: float):
    """The plain model built with `rope_theta=base`, or `NoOracle` where its config has no such base."""
    parameters = getattr(plain.config, "rope_parameters", None)
    if not isinstance(parameters, dict) or "rope_theta" not in parameters:
        raise NoOracle("the config has no rope_parameters['rope_theta'] to build the plain model at another base")
    return built_at_base(plain, base)


def check_attention_buckets_bases(model, plain, ids):
    """Two buckets at rotary bases 500 and 300,000 = the plain model built with each, mixed by confidence; cached =
    full."""
    option = AttentionBuckets(bases=(500.0, 3e5))
    ours = run(model, ids, attention_buckets=option)
    per_base = [run(at_rotary_base(plain, base), ids) for base in (500.0, 3e5)]
    if (per_base[0] - per_base[1]).abs().max() <= 1e-4:
        raise NoOracle("the plain model built at bases 500 and 3e5 gives the same logits (within 1e-4)")
    close(ours, mixed_by_hand(per_base), "buckets at bases 500 and 3e5 vs the plain model built with each")
    close(stepwise_logits(model, ids, PREFILL, attention_buckets=option), ours, "buckets at two bases, cached vs full")


def check_attention_calibration(model, plain, ids):
    """One document over every key: its share of the row is kept whatever bias(k) is, so the row is the plain model's
    (written out, after the dummy pass), full and cached."""
    option = AttentionCalibration(spans=(((1, PREFILL),),) * len(ids))
    reference = run(plain, ids)
    close(run(model, ids, attention_calibration=option), reference, "calibration, one document, vs the plain model")
    cached = stepwise_logits(model, ids, PREFILL, attention_calibration=option)
    close(cached, reference, "calibration, one document, cached vs the plain model")


def generated_logits(model, ids, attention_mask, **options) -> torch.Tensor:
    """(b, 4, vocab) the logits of 4 greedy steps of `generate`."""
    with torch.no_grad():
        output = model.generate(
            ids,
            attention_mask=attention_mask,
            max_new_tokens=4,
            min_new_tokens=4,
            do_sample=False,
            pad_token_id=0,
            output_logits=True,
            return_dict_in_generate=True,
            **options,
        )
    return torch.stack(output.logits, 1)


def check_left_padding(model, plain, ids):
    """Each option of `PADDED_OPTIONS` the family takes (the others are refused by name, unpadded too): a batch of a
    prompt left-padded by `PADDING` beside a full one = each prompt alone, full pass and `generate`'s steps."""
    batch, mask = ids.clone(), torch.ones_like(ids)
    batch[0, :PADDING], mask[0, :PADDING] = 0, 0
    alone, taken = (ids[:1, PADDING:], ids[1:]), 0
    for label, option in PADDED_OPTIONS.items():
        rows = {option.name: option.repeat_rows(2)}  # the spans of both rows
        try:
            padded = run(model, batch, attention_mask=mask, **rows)
        except (ValueError, TypeError) as error:
            if not str(error).startswith(option.name):
                raise
            with contextlib.suppress(ValueError, TypeError):  # refused unpadded too: its own refusal
                run(model, ids, **rows)
                raise AssertionError(f"{label} refuses the left-padded batch only: {first_line(error)}") from error
            continue
        taken += 1
        padded_steps = generated_logits(model, batch, mask, **rows)
        for row, prompt in enumerate(alone):
            real = slice(PADDING if row == 0 else 0, None)
            close(padded[row, real], run(model, prompt, **{option.name: option})[0], f"{label}, row {row}, full pass")
            steps = generated_logits(model, prompt, torch.ones_like(prompt), **{option.name: option})[0]
            close(padded_steps[row], steps, f"{label}, row {row}, generate")
    if not taken:
        raise NoOracle("no option to check: each is refused by name in its column")


def check(family: str, name: str) -> str:
    """`"exact"` or `"refused: ..."` for option `name` on `family`; an `AssertionError` where the option computes
    something else; `NotBuilt` where the family could not be built tiny."""
    plain, reason = tiny_model(family)
    if plain is None:
        raise NotBuilt(reason)
    try:
        model = sepformer.add_mitigations(copy.deepcopy(plain))
    except ValueError as error:  # the whole model, by name, with what it lacks
        if not str(error).startswith("add_mitigations"):
            raise
        return f"refused: {first_line(error)}"
    try:
        globals()[f"check_{name}"](model, plain, prompts())
    except NoOracle as reason:
        return f"no oracle: {reason}"
    except (ValueError, TypeError) as error:  # a refusal names the option first
        if name == "wraps" or not str(error).startswith(name.removesuffix("_scales").removesuffix("_bases")):
            raise
        return f"refused: {first_line(error)}"
    return "exact"


def table() -> str:
    """The matrix as a Markdown table (docs/families.md), with its counts."""
    lines = ["| family | " + " | ".join(CHECKS) + " |", "|---" * (len(CHECKS) + 1) + "|"]
    counts = {"exact": 0, "refused": 0, "no oracle": 0, "fails": 0}
    not_built = []
    for family in FAMILIES:
        cells = []
        for name in CHECKS:
            try:
                outcome = check(family, name)
            except NotBuilt as reason:
                not_built.append(f"- `{family}`: {reason}")
                break
            except Exception as error:  # noqa: BLE001 - a failing cell is reported, the table goes on
                outcome = f"FAILS: {type(error).__name__}: {first_line(error)}"
            counts[outcome.split(":")[0].lower() if not outcome.startswith("FAILS") else "fails"] += 1
            cells.append("exact" if outcome == "exact" else outcome.replace("|", "/"))
        else:
            lines.append(f"| `{family}` | " + " | ".join(cells) + " |")
    summary = (
        f"With transformers {transformers.__version__}: {len(FAMILIES)} families; "
        f"{len(FAMILIES) - len(not_built)} built tiny: {counts['exact']} checks exact, "
        f"{counts['refused']} refused by name, {counts['no oracle']} without an oracle, {counts['fails']} failing."
    )
    return "\n".join([summary, "", *lines, "", "Not built tiny:", "", *not_built, ""])


def documented(path: Path = DOCUMENT) -> tuple[str, dict[tuple[str, str], str]]:
    """The transformers version `path` was generated with, and each (family, check) cell's kind there ("exact",
    "refused", "no oracle")."""
    text = path.read_text()
    version = text.split("With transformers ", 1)[1].split(":", 1)[0]
    cells = {}
    for line in text.splitlines():
        if line.startswith("| `"):
            family, *outcomes = (cell.strip() for cell in line.strip("|").split("|"))
            for name, outcome in zip(CHECKS, outcomes, strict=True):
                cells[family.strip("`"), name] = kind(outcome)
    return version, cells


def kind(outcome: str) -> str:
    return outcome.split(":", 1)[0].lower()


HEADER = """# Model families and the mitigations

Generated by `python tests/family_matrix.py docs/families.md` from the transformers installed (its own list of
causal-LM model types); `tests/test_families.py` runs the same checks in `make test`. Each family is built tiny and
random (2 layers, hidden size 32, queries and keys sharpened), wrapped by `sepformer.add_mitigations`, and each option
is checked against an oracle built from the plain model itself:

- **wraps**: without options, the wrapped model's logits are the plain model's;
- **ms_poe**: one ratio r in every layer (a fixed head order) = the plain model given positions m / r;
- **stable_mask**: gamma = 60 (every sink logit far below the scores) = the plain model, full pass and cached steps;
- **positional_scaling**: channels 0-7 times -1 in every layer: every row but the last = the plain model's, the last
  changes;
- **parallel_context_windows**: one window over the prompt's start = the plain model; two windows: cached steps = the
  full pass;
- **attention_buckets_scales**: buckets at scales 1 and 0.5 = the plain model given positions m and m · 0.5, mixed by
  confidence; cached steps = the full pass;
- **attention_buckets_bases**: buckets at rotary bases 500 and 300,000 = the plain model built with each
  `rope_theta`, mixed by confidence; cached steps = the full pass;
- **attention_calibration**: one document (tokens 1-7), whose share of the row calibration keeps whatever `bias(k)` the
  dummy pass measures = the plain model, full pass and cached steps: the last row written out is the model's own;
- **left_padding**: with each option the family takes (MS-PoE with a head order and ranked, StableMask, positional
  scaling, two windows, two bucket scales, two bucket bases, calibration over two documents), a batch of a prompt
  left-padded by 3 tokens beside an unpadded one = each prompt alone, full pass and 4 steps of `generate`.

Where the installed transformers is the one this table was generated with, `tests/test_families.py` also requires
each cell's outcome (exact, refused, no oracle) to be the table's.

`exact`: the oracle holds to 1e-5 of the largest logit. `refused`: a `ValueError` naming the option (or
`add_mitigations`, for a model it cannot wrap) and the reason, before any work. `no oracle`: the plain model's logits
do not follow the `position_ids` it is given, so "positions m / r" cannot be built, or (bases) do not change with its
rotary base at these sizes.

"""


if __name__ == "__main__":
    text = HEADER + table()
    if len(sys.argv) > 1:
        with open(sys.argv[1], "w") as file:
            file.write(text)
    print(text)
