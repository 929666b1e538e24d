"""Inference-time position-bias mitigations (SPEC §3): options of `forward` and `generate`, off by default.

| option                  | where it acts                                                                        |
|-------------------------|--------------------------------------------------------------------------------------|
| `stable_mask`           | one extra logit per query row (a sink with a zero value): rows sum to less than 1      |
| `ms_poe`                | head `h` of the chosen layers sees positions `m / r_h` (rotary and the positional block) |
| `attention_calibration` | re-weights the last query row's attention over given documents ("Found in the Middle") |
| `positional_scaling`    | scales positional channels of the attention input for the keys and the last query     |

Each option takes its dataclass below or the equivalent dict (`{"gamma": 0.05}`), validated on entry.
"""

import dataclasses
import functools
import math
from dataclasses import dataclass

import torch


def cached_constant(maxsize: int):
    """`functools.lru_cache` for functions that build constant tensors from hashable arguments.

    Built outside inference mode: a first call under `torch.inference_mode()` would otherwise cache inference tensors,
    which autograd refuses to save in a later training step. Under `torch.compile` the function is traced instead
    (dynamo does not go through an lru_cache).
    """

    def decorate(build):
        @functools.lru_cache(maxsize=maxsize)
        def cached(*args):
            with torch.inference_mode(False):
                return build(*args)

        @functools.wraps(build)
        def constant(*args):
            return build(*args) if torch.compiler.is_compiling() else cached(*args)

        return constant

    return decorate


def check_layers(name: str, layers, num_layers: int) -> None:
    if layers is None:
        return
    if len(layers) == 0 or len(set(layers)) != len(layers):
        raise ValueError(f"{name} layers={layers!r} must be a non-empty tuple of distinct layer indices.")
    bad = [layer for layer in layers if not isinstance(layer, int) or not 0 <= layer < num_layers]
    if bad:
        raise ValueError(f"{name} layers {bad} are out of range: this model has layers 0..{num_layers - 1}.")


def _as_int_tuple(name: str, field: str, value):
    if value is None:
        return None
    if isinstance(value, int | str) or not hasattr(value, "__iter__"):
        raise ValueError(f"{name} {field}={value!r} must be a sequence of integers.")
    items = tuple(value)  # a generator is read once, here
    if not all(isinstance(item, int) and not isinstance(item, bool) for item in items):
        raise ValueError(f"{name} {field}={items!r} must be a sequence of integers.")
    return items


def _check_number(name: str, field: str, value, low: float | None = None, strict: bool = True) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ValueError(f"{name} {field}={value!r} must be a finite number.")
    if low is not None and (value <= low if strict else value < low):
        raise ValueError(f"{name} {field}={value!r} must be {'>' if strict else '>='} {low}.")


class _Option:
    """`parse` accepts an instance (also one from another copy of this module: the installed package and the Hub
    custom code are two copies), a dict of the fields, or `None` (off)."""

    option_name: str

    @classmethod
    def parse(cls, value):
        if value is None or isinstance(value, cls):  # frozen and validated when made
            return value
        fields = [field.name for field in dataclasses.fields(cls)]
        if type(value).__name__ == cls.__name__ and all(hasattr(value, name) for name in fields):
            return cls(**{name: getattr(value, name) for name in fields})
        if isinstance(value, dict):
            unknown = set(value) - set(fields)
            if unknown:
                raise ValueError(
                    f"{cls.option_name} got unknown keys {sorted(unknown)}: allowed are {', '.join(map(repr, fields))}."
                )
            return cls(**value)
        raise ValueError(f"{cls.option_name} must be a {cls.__name__}, a dict of its fields or None; got {value!r}.")


@dataclass(frozen=True)
class StableMask(_Option):
    """StableMask (arXiv 2402.04779): `softmax(A ⊙ C + P) ⊙ C` with pseudo-scores `P_ij = -γ(j-1)` for `j > i`.

    Computed in its exact sink form: one extra logit `τ_t = log Σ_{j=t+1..N} e^{-γ(j-1)}` per query row `t` (the
    1-indexed absolute position) with a zero value vector, so no `n × n` matrix is built.

    Args:
        gamma: `γ > 0`, the decay of the pseudo-scores; large `γ` is the base model.
        length: `N`, the column the pseudo-scores run to; `None` is the model's `max_position_embeddings`. Rows at
            `t >= N` get no sink.
    """

    gamma: float
    length: int | None = None
    option_name = "stable_mask"

    def __post_init__(self):
        _check_number(self.option_name, "gamma", self.gamma, low=0.0)
        if self.length is not None and (not isinstance(self.length, int) or self.length < 1):
            raise ValueError(f"stable_mask length={self.length!r} must be None or a positive integer.")

    def sink_logits(self, position_ids: torch.Tensor, default_length: int) -> torch.Tensor:
        """`τ_t = -γt + log(1 - e^{-γ(N-t)}) - log(1 - e^{-γ})` at `t = position + 1`, `-∞` for `t >= N`."""
        length = self.length if self.length is not None else default_length
        table = sink_logit_table(self.gamma, length, position_ids.device)  # (N + 1,): one lookup per decoding step
        return table[position_ids.clamp(max=length)]


@cached_constant(maxsize=16)
def sink_logit_table(gamma: float, length: int, device: torch.device) -> torch.Tensor:
    """`τ` at positions `0..N`, the last one (and every later position) `-∞`."""
    t = torch.arange(1, length + 2, dtype=torch.float64)
    remaining = (length - t).clamp(min=0)
    tau = -gamma * t + torch.log(-torch.expm1(-gamma * remaining)) - math.log(-math.expm1(-gamma))
    return tau.float().to(device)  # log(0) = -inf where t >= N


@dataclass(frozen=True)
class MSPoE(_Option):
    """MS-PoE (arXiv 2403.04797): head `h` sees positions `m / r_h`, ratios linear from `r_min` to `r_max`.

    Args:
        r_min, r_max: `1 <= r_min <= r_max`; the most position-aware head gets `r_min`.
        layers: layer indices; `None` is every layer but the first `min(2, num_layers // 2)` (the paper leaves the
            first two alone; a two-layer model keeps its first).
        head_order: heads from most to least position-aware (`head_order[0]` gets `r_min`). `None` ranks the heads of
            each layer and batch row at prefill by the position-awareness score `S_P` of the last query's attention
            row; the ranking is kept for every later decoding step.
    """

    r_min: float = 1.2
    r_max: float = 1.8
    layers: tuple[int, ...] | None = None
    head_order: tuple[int, ...] | None = None
    option_name = "ms_poe"

    def __post_init__(self):
        _check_number(self.option_name, "r_min", self.r_min, low=1.0, strict=False)
        _check_number(self.option_name, "r_max", self.r_max, low=1.0, strict=False)
        if self.r_max < self.r_min:
            raise ValueError(f"ms_poe r_max={self.r_max} must be >= r_min={self.r_min}.")
        object.__setattr__(self, "layers", _as_int_tuple(self.option_name, "layers", self.layers))
        object.__setattr__(self, "head_order", _as_int_tuple(self.option_name, "head_order", self.head_order))

    def ratios(self, num_heads: int) -> torch.Tensor:
        """`r_i = r_min + (i-1)(r_max - r_min)/(H-1)`, `i` the rank (1 = most position-aware)."""
        if num_heads == 1:
            return torch.tensor([self.r_min], dtype=torch.float64)
        return torch.linspace(self.r_min, self.r_max, num_heads, dtype=torch.float64)


@cached_constant(maxsize=16)
def rank_ratios(option: MSPoE, num_heads: int, device: torch.device) -> torch.Tensor:
    """(H, 1) float32 ratios by rank on `device`, made once per option rather than at every decoding step."""
    return option.ratios(num_heads).float().to(device)[:, None]


@dataclass(frozen=True)
class AttentionCalibration(_Option):
    """Attention calibration, "Found in the Middle" (arXiv 2406.16008).

    Args:
        spans: per batch row, the documents' `(start, end)` token spans (end exclusive), counted like positions: from
            the row's first real token, so the same spans serve a row alone and left-padded in a batch. Every row has
            the same number of documents; spans do not overlap and lie inside the prompt.
        temperature: `t` of `α = softmax(rel / t)` over documents (paper: 5e-5).
        layers: layer indices; `None` is the last half of the layers (the paper's choice).
        dummy_document: token ids of the dummy document that measures `bias(k)` when it replaces document `k`;
            `None` is `pad_token_id` repeated to document `k`'s length (a document with no content).
    """

    spans: tuple[tuple[tuple[int, int], ...], ...]
    temperature: float = 5e-5
    layers: tuple[int, ...] | None = None
    dummy_document: tuple[int, ...] | None = None
    option_name = "attention_calibration"

    def __post_init__(self):
        _check_number(self.option_name, "temperature", self.temperature, low=0.0)
        object.__setattr__(self, "layers", _as_int_tuple(self.option_name, "layers", self.layers))
        object.__setattr__(
            self, "dummy_document", _as_int_tuple(self.option_name, "dummy_document", self.dummy_document)
        )
        if self.dummy_document is not None and len(self.dummy_document) == 0:
            raise ValueError("attention_calibration dummy_document must have at least one token.")
        try:
            spans = tuple(tuple((int(start), int(end)) for start, end in row) for row in self.spans)
        except (TypeError, ValueError):
            raise ValueError(
                f"attention_calibration spans={self.spans!r} must be, per batch row, a sequence of (start, end)."
            ) from None
        if not spans or len({len(row) for row in spans}) != 1 or len(spans[0]) == 0:
            raise ValueError(
                "attention_calibration spans must give every batch row the same number (>= 1) of documents; got "
                f"{[len(row) for row in spans]}."
            )
        for row_index, row in enumerate(spans):
            ordered = sorted(row)
            for start, end in ordered:
                if not 0 <= start < end:
                    raise ValueError(
                        f"attention_calibration span ({start}, {end}) of row {row_index} is empty or negative: a span "
                        "is (start, end) with 0 <= start < end."
                    )
            for (_, end), (start, _) in zip(ordered, ordered[1:], strict=False):
                if start < end:
                    raise ValueError(f"attention_calibration spans of row {row_index} overlap: {ordered}.")
        object.__setattr__(self, "spans", spans)


@dataclass(frozen=True)
class PositionalScaling(_Option):
    """Positional-dimension scaling (arXiv 2406.02536): chosen channels of the attention input times `s`, for the
    keys (which go into the cache scaled) and for the last token's query.

    Args:
        factor: `s` (paper: 0.5, 0, -0.5, -1); 1 is the base model.
        channels: hidden-state channels; `None` is SepFormer's positional block `[0, d_pos)`, known by construction.
        layers: layer indices; `None` is the middle layers (all but the first and the last when there are >= 3).
    """

    factor: float
    channels: tuple[int, ...] | None = None
    layers: tuple[int, ...] | None = None
    option_name = "positional_scaling"

    def __post_init__(self):
        _check_number(self.option_name, "factor", self.factor)
        object.__setattr__(self, "channels", _as_int_tuple(self.option_name, "channels", self.channels))
        object.__setattr__(self, "layers", _as_int_tuple(self.option_name, "layers", self.layers))
        if self.channels is not None and (len(self.channels) == 0 or len(set(self.channels)) != len(self.channels)):
            raise ValueError(f"positional_scaling channels={self.channels!r} must be distinct and non-empty.")


def position_awareness(probs: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """MS-PoE's `S_P = (1/l) Σ_i 1(A_i >= 3 · mean(A))` per head.

    `probs`: (b, H, kv) the last query's attention row; `valid`: (b, 1 or H, kv) the keys it may attend (padding
    excluded), `l` their number. Returns (b, H).
    """
    count = valid.sum(-1, dtype=probs.dtype)  # (b, 1 or H): l
    mean = (probs * valid).sum(-1) / count  # (b, H)
    return ((probs >= 3 * mean[..., None]) & valid).sum(-1, dtype=probs.dtype) / count


def head_ranks(scores: torch.Tensor) -> torch.Tensor:
    """Each head's rank (0 = most position-aware) from its score (..., H), ties broken by head index."""
    order = torch.sort(-scores, dim=-1, stable=True).indices  # heads, most position-aware first
    ranks = torch.arange(scores.shape[-1], device=scores.device).expand_as(order)
    return torch.empty_like(order).scatter_(-1, order, ranks)  # the inverse permutation: ranks[order[i]] = i


def head_ratios(option: MSPoE, scores: torch.Tensor) -> torch.Tensor:
    """Each head's ratio from its score (b, H): the highest score gets `r_min`, ties broken by head index.

    This is the paper's stated semantics, `r_h = r[rank(h)]`: the ratios are scattered through the *inverse* of the
    sort permutation. The authors' code indexes with the sort permutation itself, which gives head `order[i]`'s ratio
    to head `i`; the two agree only when the permutation is its own inverse.
    """
    return option.ratios(scores.shape[-1]).to(scores.device)[head_ranks(scores)]


def fixed_head_ranks(option: MSPoE, num_heads: int) -> torch.Tensor:
    """(H,) ranks of a fixed `head_order` (its first head has rank 0)."""
    if sorted(option.head_order) != list(range(num_heads)):
        raise ValueError(
            f"ms_poe head_order={option.head_order} must be a permutation of the {num_heads} heads 0..{num_heads - 1}."
        )
    order = torch.tensor(option.head_order)
    return torch.empty(num_heads, dtype=torch.long).scatter_(0, order, torch.arange(num_heads))


def default_layers(option, num_layers: int) -> frozenset[int]:
    """The layers an option acts in: its own `layers`, or the paper's default for its kind."""
    if option.layers is not None:
        return frozenset(option.layers)
    if isinstance(option, MSPoE):
        return frozenset(range(min(2, num_layers // 2), num_layers))
    if isinstance(option, AttentionCalibration):
        return frozenset(range(num_layers // 2, num_layers))
    return frozenset(range(1, num_layers - 1) if num_layers >= 3 else range(num_layers))


def last_row_probs(
    query: torch.Tensor, key: torch.Tensor, attention_mask: torch.Tensor | None, scaling: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """The last query's attention row, written out: probs (b, H, kv) and the keys it may attend (b, 1, kv).

    `query` (b, H, seq, d), `key` (b, H, kv, d); `attention_mask` as the attention functions get it (`None`, boolean
    with True = attend, or additive float), already causal, so the last row's slice is all that matters.
    """
    kv = key.shape[2]
    scores = torch.matmul(query[:, :, -1:], key.transpose(2, 3)).squeeze(2).float() * scaling  # (b, H, kv)
    if attention_mask is None:
        valid = torch.ones(scores.shape[0], 1, kv, dtype=torch.bool, device=scores.device)
    elif attention_mask.dtype == torch.bool:
        valid = attention_mask[:, :, -1, :kv]
    else:
        valid = attention_mask[:, :, -1, :kv] > torch.finfo(attention_mask.dtype).min / 2
    return scores.masked_fill(~valid, float("-inf")).softmax(-1), valid


def sink_attention(interface, module, query, key, value, attention_mask, sink_logits, scaling, **kwargs):
    """StableMask's sink form on any attention function that takes a boolean or additive mask (eager, sdpa).

    One extra head dimension carries the sink: queries get `τ_t / scaling` there, real keys 0, and one sink key in
    front (1 there, 0 elsewhere, with a zero value) scores exactly `τ_t`. So the softmax runs over the real keys and
    the sink, and the sink's share is the mass StableMask's pseudo-columns take; no `n × n` matrix is built. A single
    query row at inference (decoding) is written out instead: one row of scores, the sink appended, a softmax.
    `sink_logits` is (b or 1, 1, seq, 1); -inf (rows past `N`) is clamped to a logit whose exponential is 0.
    """
    batch, heads, seq, dim = query.shape
    kv = key.shape[2]
    if seq == 1 and not module.training:
        # decoding: one row, written out (a softmax over the scores and the sink) costs fewer calls than the kernel
        scores = torch.matmul(query, key.transpose(2, 3)) * scaling  # (b, H, 1, kv)
        if attention_mask is not None:
            mask = attention_mask[..., :kv]
            scores = scores.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else scores + mask
        probs = torch.cat((scores, sink_logits.to(scores.dtype).expand(batch, heads, 1, 1)), -1).softmax(-1)[..., :kv]
        return torch.matmul(probs, value).transpose(1, 2), probs  # (b, 1, H, d); rows sum to less than 1
    tau = (sink_logits.clamp(min=-1e3) / scaling).to(query.dtype).expand(batch, heads, seq, 1)
    query = torch.cat((query, tau), -1)  # (b, H, seq, d + 1)
    sink_key = key.new_zeros(batch, heads, kv + 1, dim + 1)  # (b, H, 1 + kv, d + 1): the sink first
    sink_key[:, :, 0, dim] = 1
    sink_key[:, :, 1:, :dim] = key
    sink_value = value.new_zeros(batch, heads, kv + 1, value.shape[-1])
    sink_value[:, :, 1:] = value
    if attention_mask is None and seq > 1:
        # sdpa's causal path (q_len == kv, no padding) aligns the causal mask top-left: a dummy query row in front
        # makes it see the sink alone, and row t + 1 the sink and keys 0..t, as it should.
        query = torch.cat((query.new_zeros(batch, heads, 1, dim + 1), query), 2)
        output, _ = interface(module, query, sink_key, sink_value, None, scaling=scaling, **kwargs)
        return output[:, 1:], None  # (b, seq, H, d)
    if attention_mask is not None:
        attend = True if attention_mask.dtype == torch.bool else 0.0
        attention_mask = torch.nn.functional.pad(attention_mask[..., :kv], (1, 0), value=attend)
    output, weights = interface(module, query, sink_key, sink_value, attention_mask, scaling=scaling, **kwargs)
    return output, (weights[..., 1:] if weights is not None else None)  # weights on the real keys: rows sum < 1


def calibrate_row(
    probs: torch.Tensor, key_documents: torch.Tensor, bias: torch.Tensor, temperature: float
) -> torch.Tensor:
    """ "Found in the Middle": re-weight one attention row over `K` documents.

    `probs` (b, H, kv) the row; `key_documents` (b, kv, K) one-hot document membership of each key (all zero outside
    documents); `bias` (b, H, K) the attention a dummy document gets at slot `k`. Every token of document `k` is
    scaled by `α_k / Attn(doc_k) · C`, `α = softmax((Attn(doc) - bias) / t)`, `C` keeping the total attention on
    documents; other tokens are untouched, so the row still sums to 1.
    """
    sizes = key_documents.sum(1)[:, None]  # (b, 1, K)
    mass = torch.einsum("bhk,bkd->bhd", probs, key_documents)  # (b, H, K): attention on each document
    mean = mass / sizes  # Attn(doc_k)
    alpha = ((mean - bias) / temperature).softmax(-1)
    keep_total = mass.sum(-1, keepdim=True) / (alpha * sizes).sum(-1, keepdim=True)  # C
    factor = torch.where(mean > 0, alpha * keep_total / mean, 0.0)  # (b, H, K)
    outside = 1 - key_documents.sum(-1)[:, None]  # (b, 1, kv): 1 for keys in no document
    return probs * (torch.einsum("bhd,bkd->bhk", factor, key_documents) + outside)


@dataclass
class AttentionOptions:
    """The mitigations of one forward call, resolved against the model and the batch; read by every attention layer.

    `state` lives on the KV cache, so what is fixed at prefill (MS-PoE's ranks, calibration's `bias(k)`) serves
    every later decoding step of the same generation; `continuing` says the call continues a cache (not a prefill).
    """

    state: dict
    continuing: bool = False
    stable_mask: StableMask | None = None
    sink_logits: torch.Tensor | None = None  # (b or 1, 1, seq, 1): τ of the new tokens
    ms_poe: MSPoE | None = None
    ms_poe_layers: frozenset[int] = frozenset()
    # MS-PoE's `H` ratios are one set for every layer: what they do to positions is computed once per call, by rank
    rank_position_shift: torch.Tensor | None = None  # (b or 1, H, seq, d_pos): p(m / r_i) - p(m) for rank i
    rank_rotary: tuple[torch.Tensor, torch.Tensor] | None = None  # cos, sin (b or 1, H, seq, rotary_dim) of m / r_i
    calibration: AttentionCalibration | None = None
    calibration_layers: frozenset[int] = frozenset()
    key_documents: torch.Tensor | None = None  # (b, kv, K)
    probe: torch.Tensor | None = None  # (b, kv) boolean: measuring `bias(k)`, the dummy document's keys
    scaling: PositionalScaling | None = None
    scaling_layers: frozenset[int] = frozenset()
    scaling_factor: torch.Tensor | None = None  # (d_model,): `s` on the chosen channels, 1 elsewhere

    def ms_poe_ranks(self, layer_idx: int, ranking_row) -> torch.Tensor:
        """(b or 1, H) ranks of one layer's heads: a fixed order, the ranking kept from prefill, or a ranking made now
        from `ranking_row()` = (probs, valid) of the last query."""
        ranks = self.state.setdefault("ms_poe_ranks", {})
        if layer_idx not in ranks:
            if self.ms_poe.head_order is not None:
                ranks[layer_idx] = fixed_head_ranks(self.ms_poe, len(self.ms_poe.head_order))[None]
            elif self.continuing:
                raise ValueError(
                    "ms_poe ranks the heads at prefill: it must be on from the first (prefill) call of a cached "
                    "generation, or be given a fixed head_order."
                )
            else:
                ranks[layer_idx] = head_ranks(position_awareness(*ranking_row()))
        return ranks[layer_idx]

    def scaled_inputs(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(query input, key input): the chosen channels times `s`, for every key and for the last query only."""
        key_input = hidden_states * self.scaling_factor
        query_input = torch.cat((hidden_states[:, :-1], key_input[:, -1:]), 1)
        return query_input, key_input

    def calibrate(
        self, layer_idx: int, query, key, value, attention_mask, scaling: float, output, weights
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The attention output (b, seq, H, d) and weights with the last query's row calibrated. When measuring
        `bias(k)`, records that row's mean attention on the dummy document instead and changes nothing."""
        probs, _ = last_row_probs(query, key, attention_mask, scaling)  # (b, H, kv)
        if self.probe is not None:
            probe = self.probe[:, None].to(probs.dtype)  # (b, 1, kv)
            self.state.setdefault("probed", {})[layer_idx] = (probs * probe).sum(-1) / probe.sum(-1)  # (b, H)
            return output, weights
        probs = calibrate_row(
            probs, self.key_documents, self.state["calibration_bias"][layer_idx], self.calibration.temperature
        )
        last = torch.matmul(probs.to(value.dtype)[:, :, None], value).transpose(1, 2)  # (b, 1, H, d)
        output = torch.cat((output[:, :-1], last), 1)
        if weights is not None:
            weights = torch.cat((weights[:, :, :-1], probs[:, :, None].to(weights.dtype)), 2)
        return output, weights
