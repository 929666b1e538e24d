"""The search of positional-dimension scaling (arXiv 2406.02536, Alg. 1): which channels to scale, and by how much.
`search_positional_scaling(model, batches)` evaluates every candidate (channel set, factor) as the model's
`positional_scaling` option and returns the one with the lowest validation loss averaged over gold positions; the
candidates and the loss: docs/design.md, "The search"."""

import contextlib
import itertools
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from numbers import Integral, Real

import torch
from torch import nn

from .mitigation_base import last_logits, model_positions
from .mitigation_options import PositionalScaling

DEFAULT_FACTORS = (0.5, 0.0, -0.5, -1.0)  # the paper's grid


class NoPositionalChannelError(ValueError):
    """The search has no candidate channel: the paper's filter keeps none of a model's attention input, or a SepFormer
    has no positional block. A property of the model (not a bad argument), which callers sweeping many models may
    report and go on."""


@dataclass(frozen=True)
class ScalingCandidate:
    """One evaluated setting: `loss` is the mean over gold positions of `position_losses` (gold position -> the mean
    loss of the examples with that gold position)."""

    channels: tuple[int, ...]
    layers: tuple[int, ...]
    factor: float
    loss: float
    position_losses: dict[int, float]


@dataclass(frozen=True)
class PositionalSearchResult:
    best: ScalingCandidate  # the lowest loss over the candidates (ties: the first, so the smallest channel set)
    base: ScalingCandidate  # the model unscaled (factor 1), for reference
    candidates: tuple[ScalingCandidate, ...]  # every candidate, in the order evaluated

    @property
    def improves(self) -> bool:
        """Whether the best candidate's loss is below the unscaled model's (or finite where the unscaled model's is
        NaN): the search returns a scaling in any case."""
        return not math.isnan(self.best.loss) and (math.isnan(self.base.loss) or self.best.loss < self.base.loss)

    @property
    def option(self) -> PositionalScaling:
        """The best setting as SepFormer's `positional_scaling` option (one recomputed prompt row, as in generation)."""
        return PositionalScaling(factor=self.best.factor, channels=self.best.channels, layers=self.best.layers)


def is_sepformer(model: nn.Module) -> bool:
    return getattr(model.config, "model_type", None) == "sepformer"


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The decoder blocks of a causal LM: `model.model.layers` (Llama, Mistral, Qwen, SepFormer) or
    `model.transformer.h` (GPT-2)."""
    for outer, inner in (("model", "layers"), ("transformer", "h")):
        module = getattr(getattr(model, outer, None), inner, None)
        if isinstance(module, nn.ModuleList):
            return module
    raise ValueError(
        f"{type(model).__name__} has neither model.layers nor transformer.h: positional scaling by hooks supports "
        "Llama-like models (self_attn.q_proj, self_attn.k_proj) and GPT-2 (attn.c_attn)."
    )


# ------------------------------------------------------------------------------------------- candidate channels


def attention_input_curves(model: nn.Module, input_ids: torch.Tensor, layers: Sequence[int]) -> torch.Tensor:
    """(n, d_model) the attention input (after the pre-attention norm) averaged over the batch and over `layers`, at
    each position of `input_ids` (b, n) (unpadded rows of one length)."""
    layer_modules = decoder_layers(model)
    captured = []

    def capture(module, args, kwargs):
        inputs = args[0] if args else kwargs["hidden_states"]
        captured.append(inputs.float().mean(0))  # (n, d_model)

    with contextlib.ExitStack() as hooks, torch.no_grad():
        for layer in layers:
            module = layer_modules[layer]
            attention = getattr(module, "self_attn", None) or getattr(module, "attn", None)
            if attention is None:
                raise ValueError(f"{type(module).__name__} has no self_attn or attn module to scale the input of.")
            hooks.enter_context(attention.register_forward_pre_hook(capture, with_kwargs=True))
        model(input_ids=input_ids, use_cache=False)
    return torch.stack(captured).mean(0)


def positional_channel_candidates(curves: torch.Tensor, top_k: int = 8, skip: int = 0, degree: int = 3) -> list[int]:
    """The paper's filter on (n, d) position curves, the first `skip` positions dropped: the channels whose fit of
    degree `degree` is monotone in position, smoothest first, at most `top_k` (the tests: docs/design.md, "The
    search"). Fitted on the CPU: a small problem, and the same channels whatever device the model runs on."""
    curves = curves[skip:].cpu().double()
    n = curves.shape[0]
    if n < degree + 2:
        raise ValueError(f"the filter needs at least {degree + 2} positions after skip={skip}; got {n}.")
    low, high = curves.amin(0), curves.amax(0)
    varying = (high - low) > 1e-8 * high.abs().clamp(min=1.0)
    rescaled = (curves - low) / (high - low).clamp(min=1e-30)  # (n, d)
    x = torch.linspace(-1, 1, n, dtype=torch.float64)
    basis = torch.stack([x**power for power in range(degree + 1)], -1)  # (n, degree + 1)
    fitted = basis @ torch.linalg.lstsq(basis, rescaled).solution  # (n, d)
    steps = fitted.diff(dim=0)
    monotone = (steps >= 0).all(0) | (steps <= 0).all(0)
    roughness = rescaled.diff(n=2, dim=0).square().mean(0)
    chosen = torch.nonzero(monotone & varying).flatten()
    return chosen[roughness[chosen].argsort()][:top_k].tolist()


def sepformer_channel_sets(position_size: int) -> list[tuple[int, ...]]:
    """Each positional channel, aligned contiguous groups of 2, 4, ... channels, and the whole block."""
    if position_size == 0:
        raise NoPositionalChannelError(
            "this SepFormer has no positional block (position_size=0): give channel_sets explicitly."
        )
    sets = [(channel,) for channel in range(position_size)]
    size = 2
    while size < position_size:
        sets += [tuple(range(start, start + size)) for start in range(0, position_size - size + 1, size)]
        size *= 2
    return sets if position_size == 1 else [*sets, tuple(range(position_size))]  # one channel is the whole block


# ----------------------------------------------------------------------------------------------------- the loss


def checked_batch(
    batch: Mapping, index: int, vocab_size: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, list[int], int]:
    """The batch's input_ids, labels, attention_mask and gold positions, checked, and its `answer_rows`."""
    missing = [key for key in ("input_ids", "labels", "gold_position") if key not in batch]
    if missing:
        raise ValueError(
            f"batch {index} lacks {missing}: each batch is a dict with input_ids (b, n), labels (b, n; -100 where "
            "no loss is taken) and gold_position (b,), optionally attention_mask (b, n)."
        )
    input_ids, labels = batch["input_ids"], batch["labels"]
    for name, ids, dtypes in (("input_ids", input_ids, (torch.int64, torch.int32)), ("labels", labels, (torch.int64,))):
        if not isinstance(ids, torch.Tensor):
            raise TypeError(f"batch {index}: {name} must be a torch tensor (b, n); got a {type(ids).__name__}.")
        if ids.dtype not in dtypes:
            raise ValueError(
                f"batch {index}: {name} must be token ids of {' or '.join(map(str, dtypes))}; got {ids.dtype}."
            )
    if input_ids.dim() != 2 or labels.shape != input_ids.shape:
        raise ValueError(
            f"batch {index}: input_ids {tuple(input_ids.shape)} and labels {tuple(labels.shape)} must both be (b, n)."
        )
    for name, ids in (("input_ids", input_ids), ("labels", labels[labels != -100])):
        outside = ids[(ids < 0) | (ids >= vocab_size)]
        if outside.numel():
            raise ValueError(
                f"batch {index}: {name} contains {outside[0].item()}, outside the vocabulary 0..{vocab_size - 1}"
                + (" (-100 where no loss is taken)." if name == "labels" else ".")
            )
    try:
        gold = torch.as_tensor(batch["gold_position"]).flatten().tolist()
    except (TypeError, ValueError, RuntimeError):
        gold = [batch["gold_position"]]  # not numbers: refused below with the value
    fractional = [position for position in gold if isinstance(position, bool) or not isinstance(position, int)]
    if fractional:
        raise ValueError(
            f"batch {index}: gold_position {fractional[0]!r} is no integer: a gold position is the slot (an int) of "
            "the evidence the answer needs."
        )
    if len(gold) != input_ids.shape[0]:
        raise ValueError(f"batch {index}: {len(gold)} gold positions for {input_ids.shape[0]} examples.")
    if not (labels[:, 1:] != -100).any(-1).all():
        raise ValueError(f"batch {index}: every example needs at least one labelled token after its first.")
    mask = batch.get("attention_mask")
    if mask is not None and (
        not isinstance(mask, torch.Tensor)
        or mask.shape != input_ids.shape
        or not bool(((mask == 0) | (mask == 1)).all())
    ):
        found = f"of shape {tuple(mask.shape)}" if isinstance(mask, torch.Tensor) else f"a {type(mask).__name__}"
        raise ValueError(
            f"batch {index}: attention_mask is {found}: a tensor of 0 (padding) and 1 of input_ids' shape "
            f"{tuple(input_ids.shape)}."
        )
    return input_ids, labels, mask, gold, answer_rows(labels, index)


def answer_rows(labels: torch.Tensor, index: int) -> int:
    """How many last rows predict the answer (from the row before its first labelled token to the end); the same in
    every example of a batch, so that one recomputation count serves them all."""
    first = (labels[:, 1:] != -100).long().argmax(-1) + 1  # (b,): each example's first labelled token after its
    # first token (a label there has no row before it to predict it, and no loss is taken on it)
    if (first != first[0]).any():
        raise ValueError(
            f"batch {index}: the answers start at different indices {sorted(set(first.tolist()))}; positional scaling "
            "recomputes the same last rows of every example: left-pad the prompts and give answers of one length."
        )
    return labels.shape[1] - int(first[0]) + 1


def evaluated(model: nn.Module, batches: Sequence[tuple], channels, layers, factor) -> ScalingCandidate:
    """`channels` scaled by `factor` in `layers` (no channels: the base model) on the `checked_batch`es: each example's
    mean cross-entropy over its labelled tokens, averaged over the examples of each gold position, then over those."""
    by_position = {}
    for input_ids, labels, attention_mask, golds, rows in batches:
        options = {}
        if channels:  # the last `rows` rows (the answer's) read scaled queries against scaled keys
            options["positional_scaling"] = PositionalScaling(
                factor, channels=channels, layers=layers, last_recompute_tokens=rows
            )
        options |= last_logits(model, rows)  # the head on the answer's rows only (a large vocabulary: most of a pass)
        with torch.no_grad():
            logits = model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False, **options).logits
        logits = logits[:, -rows:]
        targets = labels[:, 1 - rows :]  # what rows n - rows .. n - 2 predict: every labelled token
        token_losses = nn.functional.cross_entropy(
            logits[:, :-1].float().transpose(1, 2), targets, ignore_index=-100, reduction="none"
        )  # (b, rows - 1), 0 where no loss is taken
        for loss, gold in zip((token_losses.sum(-1) / (targets != -100).sum(-1)).tolist(), golds, strict=True):
            by_position.setdefault(gold, []).append(loss)
    position_losses = {gold: sum(values) / len(values) for gold, values in sorted(by_position.items())}
    mean = sum(position_losses.values()) / len(position_losses)
    return ScalingCandidate(tuple(channels), tuple(layers), float(factor), mean, position_losses)


def search_positional_scaling(
    model: nn.Module,
    batches: Iterable[Mapping],
    factors: Sequence[float] = DEFAULT_FACTORS,
    layers: Sequence[int] | None = None,
    channel_sets: Sequence[Sequence[int]] | None = None,
    top_k: int | None = None,
    skip: int | None = None,
) -> PositionalSearchResult:
    """The channel set and factor `s < 1` with the lowest validation loss averaged over gold positions.

    Args:
        model: a `SepFormerForCausalLM`, or a Hugging Face decoder given `sepformer.add_mitigations` (Llama-like or
            GPT-2 attention), in eval mode.
        batches: dicts with `input_ids` (b, n), `labels` (b, n; -100 except on the answer, which ends each row),
            `gold_position` (b,): the slot of the evidence the answer needs, and optionally `attention_mask`. Prompts
            are left-padded and the answers of a batch have one length.
        factors: the grid of `s` (the paper's by default); each must be < 1 (1 is the base model, reported apart).
        layers: the scaled layers; `None` is the middle ones (`PositionalScaling`'s default).
        channel_sets: the candidate channel sets; `None` is SepFormer's positional channels, or for another model
            each channel the paper's filter keeps on the first batch (which must then be unpadded) and all of them
            together (docs/design.md, "The search"). `top_k` (8) and `skip` (0) tune that filter (see
            `positional_channel_candidates`) and are refused where none runs (given `channel_sets`, or a SepFormer).

    Returns the best candidate, the base model's losses and the table of every candidate. Raises
    `NoPositionalChannelError` (a `ValueError`) when `channel_sets` is `None` and there is no candidate. Every argument
    and batch is checked before the first forward pass.
    """
    batches, factors, layers, filter_options = checked_arguments(
        model, batches, factors, layers, channel_sets, top_k, skip
    )
    channel_sets = candidate_channel_sets(model, batches[0], layers, channel_sets, filter_options)
    base = evaluated(model, batches, (), layers, 1.0)
    candidates = tuple(
        evaluated(model, batches, channels, layers, factor)
        for channels, factor in itertools.product(channel_sets, factors)
    )
    best = min(candidates, key=lambda scored: math.inf if math.isnan(scored.loss) else scored.loss)  # NaN: never best
    return PositionalSearchResult(best, base, candidates)


def checked_arguments(model, batches, factors, layers, channel_sets, top_k, skip):
    """`search_positional_scaling`'s batches (each a `checked_batch`), factors (floats), layers and channel filter
    options, once every argument but the channel sets' values (`candidate_channel_sets`) is checked."""
    batches = list(batches)
    if not batches:
        raise ValueError("search_positional_scaling needs at least one validation batch.")
    if isinstance(factors, str) or not isinstance(factors, Iterable):
        raise ValueError(f"factors={factors!r} must be a sequence of numbers < 1, e.g. (0.5, 0.0).")
    factors = tuple(factors)
    bad = [
        factor
        for factor in factors
        if isinstance(factor, bool) or not isinstance(factor, Real) or not -math.inf < factor < 1  # NaN: not
    ]
    if not factors or bad:
        raise ValueError(f"factors must be finite numbers < 1 (1 is the unscaled model); got {bad or 'none'}.")
    if model_positions(model) is None:  # neither a SepFormer nor given add_mitigations
        raise ValueError(
            f"search_positional_scaling evaluates each candidate as the model's positional_scaling option, which "
            f"{type(model).__name__} does not take: give sepformer.add_mitigations(model) (or a SepFormer)."
        )
    if model.training:
        raise ValueError("search_positional_scaling evaluates: put the model in eval mode (model.eval()).")
    num_layers = len(decoder_layers(model))
    layers = tuple(PositionalScaling().default_layers(num_layers) if layers is None else layers)
    PositionalScaling(layers=layers).layer_set(num_layers)  # range and duplicates checked, with the option's messages
    filter_options = {name: value for name, value in (("top_k", top_k), ("skip", skip)) if value is not None}
    for name, low in (("top_k", 1), ("skip", 0)):
        value = filter_options.get(name, low)
        if isinstance(value, bool) or not isinstance(value, Integral) or value < low:
            raise ValueError(f"{name}={value!r} must be an integer >= {low}.")
    if filter_options and (channel_sets is not None or model_positions(model).knows_position_channels):
        raise ValueError(
            f"{', '.join(f'{name}={value!r}' for name, value in filter_options.items())} would be ignored: top_k and "
            "skip tune the channel filter, which runs only without channel_sets on a model other than SepFormer."
        )
    batches = [checked_batch(batch, index, model.config.vocab_size) for index, batch in enumerate(batches)]
    return batches, tuple(float(factor) for factor in factors), layers, filter_options  # floats: numpy's too


def is_channel_set(channels, width: int) -> bool:
    """A non-empty tuple of distinct integer channels (not bools) in `0..width-1`."""
    return (
        isinstance(channels, tuple)
        and len(channels) > 0
        and all(isinstance(c, Integral) and not isinstance(c, bool) and 0 <= c < width for c in channels)
        and len(set(channels)) == len(channels)
    )


def candidate_channel_sets(model, first_batch, layers, channel_sets, filter_options) -> list[tuple[int, ...]]:
    """`channel_sets` checked, or the candidates `search_positional_scaling` describes."""
    if channel_sets is not None:
        width = model.config.hidden_size
        if isinstance(channel_sets, str) or not isinstance(channel_sets, Iterable):
            raise ValueError(f"channel_sets={channel_sets!r} must be a list of channel sets, e.g. [(3,), (3, 5)].")
        channel_sets = [tuple(channels) if isinstance(channels, Iterable) else channels for channels in channel_sets]
        bad = [channels for channels in channel_sets if not is_channel_set(channels, width)]
        if not channel_sets or bad:
            raise ValueError(
                f"channel_sets must be a list of non-empty sets of distinct channels in 0..{width - 1} (e.g. "
                f"[(3,), (3, 5)]); got {bad or 'no set'}."
            )
        return [tuple(int(channel) for channel in channels) for channels in channel_sets]
    if model_positions(model).knows_position_channels:
        return sepformer_channel_sets(model.config.position_size)
    first, _, mask, _, _ = first_batch
    if mask is not None and not bool(mask.all()):
        raise ValueError(
            "the channel filter reads the position curves of the first batch, which has padding: put an unpadded "
            "batch first, or give channel_sets."
        )
    chosen = positional_channel_candidates(attention_input_curves(model, first, layers), **filter_options)
    if not chosen:
        raise NoPositionalChannelError("no channel of the attention input is monotone in position: give channel_sets.")
    return [(channel,) for channel in chosen] + ([tuple(chosen)] if len(chosen) > 1 else [])


__all__ = [
    "NoPositionalChannelError",
    "PositionalSearchResult",
    "ScalingCandidate",
    "attention_input_curves",
    "positional_channel_candidates",
    "search_positional_scaling",
]
