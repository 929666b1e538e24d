"""The extension point of the position-bias mitigations: a `Mitigation` and the hooks the attention layers call.

A mitigation is resolved once per call against the model (`resolve`), started once per run of the layers with the
positions that run computes (`start`), and then acts only through the hooks its `uses` names (by default, the ones its
class overrides): per layer `query_key_inputs`, `decoding_input_scale`, `position_query_key` and `wrap_attention`;
once per run of the layers `read_positions`, `position_bases` and `mask_function`; and, where its options
`wraps_causal_lm`, the whole causal-LM forward (`run_causal_lm`). docs/design.md, "Extension points", tabulates what
each hook rewrites and which mitigations use it. `sepformer.mitigations` registers the mitigations and holds the rules
on which of them can be combined.
"""

import dataclasses
import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import nn
from transformers.cache_utils import Cache
from transformers.masking_utils import and_masks
from transformers.models.llama.modeling_llama import repeat_kv

from .cache_sepformer import SepFormerCache
from .mitigation_options import MitigationOptions
from .positional_options import PositionExtrapolation

AttentionFunction = Callable[..., tuple[torch.Tensor, torch.Tensor | None]]
InputScale = tuple[tuple[int, ...], float]  # (channels, factor) of the query and key inputs, as one linear map
UNSCALED: InputScale = ((), 1.0)


# The attention implementations registered to carry the mitigations (`any_decoder`), each the name of the one it wraps.
WRAPPED_IMPLEMENTATIONS: dict[str, str] = {}


def attention_implementation(config) -> str:
    """The attention implementation a model computes with (`"eager"`, `"sdpa"`, ...), also where `add_mitigations`
    registered a wrapper of it."""
    name = config._attn_implementation
    return WRAPPED_IMPLEMENTATIONS.get(name, name)


def checkpoints_activations(model) -> bool:
    """Whether transformers' activation checkpointing is on (`is_activation_checkpointing` from transformers 5.23, the
    deprecated `is_gradient_checkpointing` before)."""
    renamed = hasattr(type(model), "is_activation_checkpointing")
    return bool(getattr(model, "is_activation_checkpointing" if renamed else "is_gradient_checkpointing", False))


def cache_kind(cache) -> str:
    """The class of a cache a refusal names, and whether it is static."""
    return f"{type(cache).__name__}{' (a static cache)' if cache.is_compileable else ''}"


# Keywords of an attention call that change its scores beyond q·k and the mask, and what each adds.
SCORE_TERMS = {
    "s_aux": "attention sinks",
    "sinks": "attention sinks",
    "softcap": "soft-capping",
    "position_bias": "a position bias",
    "indices": "a sparse choice of keys (indices)",
}


def replaced(instance, **changes):
    """`dataclasses.replace(instance, **changes)` for a frozen dataclass, made without `__init__` where that gives the
    same: several times faster, for what is started at every decoding step. A class with `__post_init__` or slots, or
    a change of a field `__init__` does not take, goes through `dataclasses.replace`."""
    cls, fields = type(instance), instance.__dataclass_fields__
    plain = not hasattr(cls, "__post_init__") and not hasattr(cls, "__slots__")
    if not plain or not all(name in fields and fields[name].init for name in changes):
        return dataclasses.replace(instance, **changes)
    copy = object.__new__(cls)
    copy.__dict__.update(vars(instance), **changes)
    return copy


def refuse_under_compile(what: str) -> None:
    """Refuse `what` in a call `torch.compile` traces: without `fullgraph=True`, the frame then runs eagerly."""
    if torch.compiler.is_compiling():
        raise ValueError(
            f"{what}, which torch.compile cannot trace: compile without fullgraph=True (those layers then run "
            "eagerly), or call the model uncompiled."
        )


@dataclass(frozen=True, eq=False)
class RowBases:
    """One base per row of the batch (Attention Buckets' copies of the rows): row `r` reads positions with
    `values[bucket[r]]`. The values are plain floats, so a model that builds a rotary per base (a Hugging Face
    decoder's) finds them without reading the device at every step."""

    values: tuple[float, ...]
    bucket: torch.Tensor  # (b,) each row's index into `values`
    per_row: torch.Tensor  # (b, 1, 1) float32: each row's base, against (b, seq, frequencies) angles

    @classmethod
    def of(cls, values: tuple[float, ...], bucket: torch.Tensor) -> "RowBases":
        return cls(values, bucket, torch.tensor(values, device=bucket.device)[bucket, None, None])


def base_tensor(base: float | RowBases | None) -> float | torch.Tensor | None:
    """A base as SepFormer's rotary and sinusoidal map compute with it: one float, or (b, 1, 1) one per row."""
    return base.per_row if isinstance(base, RowBases) else base


@dataclass(frozen=True, eq=False)
class ModelPositions:
    """What the mitigations ask a model about its attention and positions, the same questions for every model, so that
    each method is written once: a SepFormer's answers are these defaults; a Hugging Face decoder's come from a probe
    run (`any_decoder.DecoderPositions`)."""

    model_name: str  # the causal LM's class name, for errors
    query_key_problem: str | None = None  # why the attention's query and key inputs cannot be rewritten, if so
    # the keywords of its attention calls that add to q·k and the mask (`SCORE_TERMS`: sinks, soft-capping, ...)
    score_keywords: frozenset[str] = frozenset()
    positions_problem: str | None = None  # why positions counted from 0 are not the model's own, if they are not
    rotary: nn.Module | None = None  # the rotary embedding (its `inv_freq`), None without rotary
    # the layer type of each layer, where the rotary keeps one frequency table per type (`{type}_inv_freq`, Gemma 3)
    layer_types: tuple[str, ...] | None = None
    positional_map: nn.Module | None = None  # SepFormer's map `p(·)` of its positional block, None without one
    # Whether the attention hands its queries and keys to a `position_query_key` hook, unrotated and before the cache
    # (SepFormer's); otherwise a mitigation first sees them in the attention function, rotated and after the cache.
    calls_position_hooks: bool = True
    # Whether its positions are in channels known by construction (SepFormer's positional block and rotary dims), so
    # that a method can zero or pick them without a search; and whether it reads positions past its training length
    # by an extrapolation of its own (SepFormer's `position_extrapolation`).
    knows_position_channels: bool = True
    extrapolates: bool = True

    @classmethod
    def of_sepformer(cls, base_model: nn.Module) -> "ModelPositions":
        """A `SepFormerModel`'s answers: the defaults, with its rotary and positional map."""
        return cls("SepFormerModel", rotary=base_model.rotary_emb, positional_map=base_model.embed_positions)

    def inverse_frequencies(self) -> dict[str | None, torch.Tensor]:
        """The rotary's frequency tables: one per layer type, or `{None: inv_freq}` where every layer shares one."""
        if self.layer_types is None:
            return {None: self.rotary.inv_freq}
        return {kind: getattr(self.rotary, f"{kind}_inv_freq") for kind in sorted(set(self.layer_types))}

    def table_of(self, layer: int) -> str | None:
        """The key of `inverse_frequencies` that layer `layer` rotates with."""
        return None if self.layer_types is None else self.layer_types[layer]

    @property
    def no_positional_block(self) -> str:
        """Why the model has no positional block (`positional_map` is None), for errors."""
        return "this model has position_size=0"

    def positional_channels(self, config) -> tuple[int, ...]:
        """The channels of the attention input that hold only positions (positional scaling's default): SepFormer's
        positional block `[0, d_pos)`."""
        if self.positional_map is None:
            raise ValueError(
                f"positional_scaling scales the positional block by default, but {self.no_positional_block}: give "
                "channels=(...) explicitly."
            )
        return tuple(range(config.position_size))

    def bucket_bases(self, options, config) -> tuple[tuple[float, ...] | None, tuple[float, ...] | None]:
        """`(rotary bases, sinusoidal map bases)` of the Attention Buckets (`None`: the model's own), refused where the
        model has no base to change or no positions to scale."""
        if options.bases is None:
            if options.scales is not None and self.rotary is None and self.positional_map is None:
                raise ValueError(
                    "attention_buckets scales rescale positions, but this model reads none (position_size=0, no "
                    "rotary)."
                )
            return None, None
        if self.rotary is not None:
            return options.bases, None
        if self.positional_map is not None and config.map_options().map == "sinusoidal":
            return None, options.bases
        raise ValueError(
            f"attention_buckets bases={list(options.bases)} mean nothing for this model: it has no rotary and its "
            f"positional map is {config.positional_map!r}"
            + (" (only the sinusoidal map has a base)" if self.positional_map is not None else " (position_size=0)")
            + "; give scales=[...] instead (bucket b reads positions m · scales[b])."
        )

    def check_head_turn(self, config) -> None:
        """Refuse MS-PoE, which turns each head's positions to `m / r_h`, where the model has no positions to turn."""
        if self.rotary is None and self.positional_map is None:
            raise ValueError("ms_poe rescales positions, but this model has none (position_size=0, rotary_dim=0).")

    def check_plain_scores(self, option: str, what: str, served: frozenset[str] = frozenset()) -> None:
        """Refuse `option`, which computes `what` from q·k and the mask (and the `served` keywords), on a model whose
        scores have more."""
        terms = sorted({SCORE_TERMS[name] for name in self.score_keywords - served})
        if terms:
            raise ValueError(
                f"{option} {what} from q·k and the mask, but {self.model_name}'s attention adds {' and '.join(terms)} "
                "to its scores, which it would leave out."
            )

    def check_query_key_inputs(self, option: str, rewritten: str) -> None:
        """Refuse `option`, which reads the queries and keys from a `rewritten` input, where the attention cannot."""
        if self.query_key_problem is not None:
            raise ValueError(
                f"{option} reads the queries and keys of {self.model_name} from {rewritten}, but "
                f"{self.query_key_problem}."
            )

    def check_positions(self, option: str) -> None:
        """Refuse `option`, which moves the positions where tokens are read, where those are not counted from 0."""
        if self.positions_problem is not None:
            raise ValueError(
                f"{option} moves the positions the model reads, counted from each row's first token at 0, but "
                f"{self.positions_problem}."
            )


def continues(past_key_values: Cache | None) -> bool:
    """Whether a call continues `past_key_values` (a decoding step) rather than starting it (a prefill). A compiled
    graph cannot branch on a static cache's length (a tensor): compiled, it continues, as in `generate`, which compiles
    only the decoding steps."""
    if past_key_values is None:
        return False
    length = past_key_values.get_seq_length()
    if isinstance(length, torch.Tensor) and torch.compiler.is_compiling():
        return True
    return bool(length > 0)


@dataclass(frozen=True, eq=False, kw_only=True)
class CallContext:
    """One call of the model, as the mitigations are resolved against it, before any layer runs."""

    model: nn.Module  # the SepFormerModel, or the Hugging Face causal LM that `add_mitigations` served
    input_ids: torch.LongTensor | None
    attention_mask: torch.Tensor | None  # the caller's mask: 2D padding mask (batch, past + seq), 4D, or None
    cache: Cache | None
    extrapolation: PositionExtrapolation | None = None  # SepFormer's reading past the table; None on other models
    batch: int
    new_tokens: int  # the call's tokens (its sequence length)
    continuing: bool  # the call continues a cache (a decoding step), rather than starting one (prefill)
    # The SepFormerCache that keeps what is fixed at prefill: the call's cache, a fresh one for a call without a cache
    # (set by `resolve_plan`), or None when the call's cache is of another kind.
    sepformer_cache: SepFormerCache | None = None
    positions: ModelPositions  # what the model answers about its attention and positions
    position_ids: torch.LongTensor | None = None  # the call's position_ids where given

    @classmethod
    def of(cls, model: nn.Module, tokens: torch.Tensor, **fields) -> "CallContext":
        """The call of `model` on `tokens` (its ids or embeddings, (b, seq, ...)); it continues its cache if that holds
        tokens (a cache made for the call holds none)."""
        cache = fields["cache"]
        sepformer_cache = cache if isinstance(cache, SepFormerCache) else None
        batch, new_tokens = tokens.shape[:2]
        derived = dict(batch=batch, new_tokens=new_tokens, continuing=continues(cache), sepformer_cache=sepformer_cache)
        return cls(model=model, positions=model.decoder_positions, **derived, **fields)


def model_positions(model: nn.Module) -> ModelPositions | None:
    """The `ModelPositions` of a causal LM that takes the mitigations (its `decoder_positions`; a SepFormer from
    another copy of this package, a Hub checkpoint's custom code, may have none), or None."""
    positions = getattr(model, "decoder_positions", None)
    if positions is None and getattr(getattr(model, "config", None), "model_type", None) == "sepformer":
        return ModelPositions.of_sepformer(model.model)
    return positions


@dataclass(frozen=True, eq=False)
class LayerCall:
    """One call of a SepFormer decoder layer: what the steps of its attention read besides the states they transform."""

    residual: torch.Tensor  # (b, seq, d_model): the layer's input, before its norm
    attention_mask: torch.Tensor | None  # as the attention function gets it
    position_embeddings: tuple[torch.Tensor, torch.Tensor] | None  # the rotary cos, sin; None without rotary
    past_key_values: Cache | None
    hooks: "LayerHooks"  # the layer's mitigation hooks


@dataclass(frozen=True, eq=False)
class QueryKeyProjection:
    """A layer's attention input and how the layer turns it into queries and keys, for the attention wrappers of a
    layer whose `query_key_inputs` a hook rewrites (positional scaling's base rows, calibration's dummy keys)."""

    attention: nn.Module  # the SepFormerAttention
    attention_input: torch.Tensor  # (b, seq, d_model): the layer's normed input, as the values read it
    layer_call: LayerCall

    def project_keys(self, key_input: torch.Tensor) -> torch.Tensor:
        """(b, seq, d_model) -> (b, H, seq, head_dim) keys, positions applied as the layer does (the keys stand in for
        the queries: a position hook's head ranks were fixed by the layer's own call)."""
        key = self.attention.by_head(self.attention.k_proj(key_input))
        return self.attention.apply_positions(key, key, self.layer_call)[1]


@dataclass(frozen=True, eq=False)
class Mitigation:
    """One mitigation of one call: its options, the layers it acts in, and whatever it fixed for the call. Subclasses
    are frozen dataclasses: `start` returns a copy holding the tensors of one run of the layers."""

    options: MitigationOptions
    layers: frozenset[int]
    options_class: ClassVar[type[MitigationOptions]]
    prefill_requirement: ClassVar[str] = ""  # the error when a state fixed at prefill is missing
    # Whether `wrap_attention` turns the queries and keys it is given (MS-PoE on a Hugging Face decoder). Such a
    # wrapper is its layer's outermost, so the others read the turned queries and keys; it takes the cache's
    # grouped-query keys and values as they are and expands them itself (expanding them first would be a wasted copy).
    turns_queries_keys: ClassVar[bool] = False
    # Whether `wrap_attention` reads grouped-query keys and values (b, H_kv, kv, d) as the cache holds them, query head
    # `h` against key-value head `h // (H / H_kv)`: where every wrapper of a layer does, none is expanded.
    reads_grouped_keys: ClassVar[bool] = False

    @classmethod
    def default_options(cls, config) -> MitigationOptions | None:
        """The options of a call that does not give this mitigation's keyword (`False` switches them off), from the
        model's config; `None`: off."""
        return None

    @classmethod
    def fixes_state_at_prefill(cls, options: MitigationOptions) -> bool:
        """Whether these options fix, at prefill, state that decoding steps reuse (kept in
        `cache.mitigation_state[options.name]`). By default, those of a mitigation with a `prefill_requirement`."""
        return bool(cls.prefill_requirement)

    @classmethod
    def prefilled_without(cls, cache) -> ValueError:
        """The error for continuing `cache`, of another class than `SepFormerCache`, which holds a prefill made without
        this mitigation (e.g. a generation's without options, which keeps transformers' own cache)."""
        return ValueError(f"{cls.prefill_requirement} This cache, a {cache_kind(cache)}, was prefilled without it.")

    @classmethod
    def check_continuation(cls, cache, options: MitigationOptions | None) -> None:
        """Refuse (a `ValueError`) continuing `cache`, a `SepFormerCache` holding tokens, with `options` for this
        mitigation (`None`: off), where its state cannot be continued so; called before any work."""

    @classmethod
    def check_assistant_model(cls, options: MitigationOptions, lengths: list[int]) -> None:
        """Refuse (a `ValueError`) these options with an assistant model, on prompts of `lengths` real tokens per row:
        after each round transformers crops the assistant's cache before its last token and feeds that token again."""

    @classmethod
    def acts_on_last_rows(cls, options: MitigationOptions) -> bool:
        """Whether these options treat the last query rows of a prefill (the prompt's last tokens) unlike the others:
        right padding puts pads there, and assisted decoding drafted tokens, so both are refused."""
        return False

    @classmethod
    def resolve(cls, options: MitigationOptions, call: CallContext) -> "Mitigation":
        """Check `options` against the model and the call (a `ValueError` naming what is wrong), doing no work yet.
        Read only the options, the model and the form of the call, not what changes from step to step: within
        `generate`, later decoding steps reuse what the first one resolved (`mitigations.KeptPlan`)."""
        return cls(options, options.layer_set(call.model.config.num_hidden_layers))

    def prepare(self, call: CallContext, others: tuple["Mitigation", ...]) -> None:
        """Work on the call before its layers run, once every mitigation of the call is resolved (or reused at a
        decoding step): `others` are the rest of them (calibration's dummy passes run with them on)."""

    def start(self, run: "LayerRun") -> "Mitigation":
        """The per-run tensors (from positions, the padding mask, the dtype), computed once for every layer."""
        return self

    def query_key_inputs(
        self, layer_idx: int, query_input: torch.Tensor, key_input: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(b, seq, d_model) inputs of `q_proj` and `k_proj` (values read the layer's own normed input); the keys
        projected from `key_input` are written to the cache."""
        return query_input, key_input

    def decoding_input_scale(self, layer_idx: int) -> InputScale | None:
        """`(channels, factor)` when `query_key_inputs` only multiplies those channels of every token's query and key
        inputs by `factor`: the fused decoding projections then carry the factor, and the hook is not called. `None`:
        the layer runs its modules with the hook."""
        return None

    def position_query_key(
        self, attention: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, layer_call: LayerCall
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Positions into the projected (b, H, seq, head_dim) queries and keys, in place of the layer's rotary
        (`layer_call.position_embeddings`); `layer_call.residual` is the layer's input before its norm."""
        raise NotImplementedError  # only called on subclasses that override it

    def wrap_attention(
        self, layer_idx: int, function: AttentionFunction, projection: QueryKeyProjection | None
    ) -> AttentionFunction:
        """The attention function of the layer: `(module, query, key, value, mask, **kwargs) -> (output, weights)`.
        `projection`: the layer's input and query/key pipeline where a hook rewrites its query and key inputs."""
        return function

    @classmethod
    def moves_positions(cls, options: MitigationOptions) -> bool:
        """Whether these options move the positions the model reads (`read_positions`): `generate` then leaves the
        check of the last position it reaches to the steps, which read them."""
        return cls.read_positions is not Mitigation.read_positions

    def read_positions(self, position_ids: torch.Tensor) -> torch.Tensor:
        """Where the positional map and rotary read the call's new tokens: (b or 1, seq) -> (b or 1, seq), integer or
        fractional. Receives the positions counted from each row's first real token (or the caller's)."""
        return position_ids

    def position_bases(self) -> tuple[float | RowBases | None, float | RowBases | None]:
        """`(rotary base, sinusoidal map base)` to read positions with: one, or one per row (`RowBases`); `None` keeps
        the model's own."""
        return None, None

    def mask_function(self, padding_mask: torch.Tensor | None, kv_length: int, device: torch.device):
        """An and-mask `(batch_idx, head_idx, q_idx, kv_idx) -> bool` on the causal mask (transformers' mask
        functions: `q_idx` and `kv_idx` index the keys, cached and new), or `None`. `padding_mask` (b, kv_length)."""
        return None

    @classmethod
    def wraps_causal_lm(cls, options: MitigationOptions) -> bool:
        """Whether these options replace the whole forward of the causal LM (`run_causal_lm`)."""
        return False

    @classmethod
    def run_causal_lm(cls, options: MitigationOptions, model, inputs: dict, options_of_call: dict):
        """The causal LM's output for `inputs` (the keywords of its forward) with these options, where they
        `wraps_causal_lm`; `options_of_call`: the call's mitigation keywords (parsed where on), these included."""
        raise NotImplementedError

    @classmethod
    def in_wrapped_call(cls, options: MitigationOptions, call: CallContext) -> tuple[MitigationOptions, CallContext]:
        """These options and `call` as the forward that `run_causal_lm` runs resolves them (where they
        `wraps_causal_lm`)."""
        raise NotImplementedError

    def replace(self, **changes) -> "Mitigation":
        return replaced(self, **changes)

    def uses(self, hook: str) -> bool:
        """Whether the layers call this mitigation's `hook` (`query_key_inputs`, `position_query_key`,
        `wrap_attention`): by default, the hooks its class overrides."""
        return getattr(type(self), hook) is not getattr(Mitigation, hook)


def last_logits(model, rows: int) -> dict:
    """`{"logits_to_keep": rows}` where the causal LM's `forward` takes it, `{}` otherwise. Read from its class's
    `forward`: the instance's may be a compiled wrapper, whose signature a trace cannot read."""
    return {"logits_to_keep": rows} if "logits_to_keep" in inspect.signature(type(model).forward).parameters else {}


def last_row_scores(
    query: torch.Tensor, key: torch.Tensor, attention_mask: torch.Tensor | None, scaling: float
) -> torch.Tensor:
    """The last query's attention logits in float32, written out: (b, H, kv), with the mask's last row applied as the
    attention functions apply it (-inf where a boolean mask is False, an additive mask added: its minimum where the row
    may not attend, and whatever bias it adds elsewhere).

    `query` (b, H, seq, d), `key` (b, H_kv, kv, d) with H_kv dividing H (grouped-query keys, or one per query head);
    `attention_mask` as the attention functions get it (`None`, boolean with True = attend, or additive float), already
    causal, so the last row's slice is all that matters.
    """
    batch, heads, seq, head_dim = query.shape
    key_heads, kv = key.shape[1:3]
    # (b · H_kv, H / H_kv, d): the query heads each key-value head serves
    last_query = (query if seq == 1 else query[:, :, -1:]).reshape(batch * key_heads, heads // key_heads, head_dim)
    # the query times the transposed keys, a view of the cache's: (b · H_kv, H / H_kv, kv). A matrix times one column
    # (keys times the query) runs several times slower on CPUs.
    scores = torch.bmm(last_query, key.flatten(0, 1).mT).view(batch, heads, kv)
    scores = (scores if scores.dtype == torch.float32 else scores.float()) * scaling
    if attention_mask is None:
        return scores
    mask = attention_mask[:, :, -1, :kv]
    return scores.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else scores + mask


def last_row_output(probs: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """(b, 1, H, d): the attention output of one written-out row `probs` (b, H, kv) over `value` (b, H_kv, kv, d), the
    cache's values as they are (grouped-query ones too)."""
    batch, heads, kv = probs.shape
    key_heads, head_dim = value.shape[1], value.shape[-1]
    probs = probs if probs.dtype == value.dtype else probs.to(value.dtype)
    # (b · H_kv, H / H_kv, kv) @ (b · H_kv, kv, d): each key-value head's values for the query heads it serves
    output = torch.bmm(probs.view(batch * key_heads, heads // key_heads, kv), value.flatten(0, 1))
    return output.view(batch, 1, heads, head_dim)


@dataclass(frozen=True, eq=False)
class LayerHooks:
    """The hooks of one layer, in the order of the plan's mitigations; no hook is a no-op."""

    input_hooks: tuple[Mitigation, ...] = ()
    position_hook: Mitigation | None = None
    attention_wrappers: tuple[Mitigation, ...] = ()

    def started(self, started: dict[int, Mitigation]) -> "LayerHooks":
        """The same hooks, each mitigation replaced by its started self, `started[id(mitigation)]`."""
        return LayerHooks(
            tuple(started[id(mitigation)] for mitigation in self.input_hooks),
            None if self.position_hook is None else started[id(self.position_hook)],
            tuple(started[id(mitigation)] for mitigation in self.attention_wrappers),
        )

    def decoding_input_scale(self, layer_idx: int) -> InputScale | None:
        """What the input hooks do, as one `InputScale` the fused decoding projections can carry, or `None`."""
        if not self.input_hooks:
            return UNSCALED
        if len(self.input_hooks) > 1:
            return None
        return self.input_hooks[0].decoding_input_scale(layer_idx)

    def query_key_inputs(self, layer_idx: int, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        query_input = key_input = hidden_states
        for mitigation in self.input_hooks:
            query_input, key_input = mitigation.query_key_inputs(layer_idx, query_input, key_input)
        return query_input, key_input

    def attend(self, function: AttentionFunction, module, query, key, value, attention_mask, projection, **kwargs):
        """`function(module, query, key, value, attention_mask, **kwargs)` wrapped by the layer's attention wrappers,
        innermost first, for SepFormer's attention and a Hugging Face decoder's. The wrappers act per query head:
        grouped-query keys and values are expanded first (by the outermost wrapper where it turns the keys), unless
        every wrapper reads them grouped."""
        if self.attention_wrappers:
            groups = query.shape[1] // key.shape[1]
            grouped = all(mitigation.reads_grouped_keys for mitigation in self.attention_wrappers)
            # (b, H_kv, kv, d) -> (b, H, kv, d): key-value head j serves query heads j·groups..
            if groups > 1 and not grouped:
                if not self.attention_wrappers[-1].turns_queries_keys:  # which expands them itself
                    key, value = repeat_kv(key, groups), repeat_kv(value, groups)
                module = ExpandedHeads(module)
            for mitigation in self.attention_wrappers:
                function = mitigation.wrap_attention(module.layer_idx, function, projection)
        return function(module, query, key, value, attention_mask, **kwargs)


class ExpandedHeads:
    """An attention module seen with one key-value head per query head, its keys and values already expanded: the
    wrapped function must not repeat them again."""

    num_key_value_groups = 1

    def __init__(self, module: nn.Module):
        self.module = module

    def __getattr__(self, name: str):
        return getattr(self.module, name)


NO_HOOKS = LayerHooks()


@dataclass(frozen=True, eq=False)
class MitigationPlan:
    """The mitigations of one call, and for each layer the hooks its attention calls: layers with the same
    mitigations share one `LayerHooks`, `shared[hooks_of_layer[layer]]`."""

    mitigations: tuple[Mitigation, ...]
    shared: tuple[LayerHooks, ...]
    hooks_of_layer: tuple[int, ...]
    layers: tuple[LayerHooks, ...] = dataclasses.field(init=False)  # by layer

    def __post_init__(self):
        object.__setattr__(self, "layers", tuple(map(self.shared.__getitem__, self.hooks_of_layer)))

    @classmethod
    def of(cls, mitigations: tuple[Mitigation, ...], num_layers: int) -> "MitigationPlan":
        """The plan of `mitigations`."""
        index_of: dict[tuple[bool, ...], int] = {}  # by which mitigations act in a layer
        shared, hooks_of_layer = [], []
        for layer in range(num_layers):
            members = tuple(layer in mitigation.layers for mitigation in mitigations)
            if members not in index_of:
                here = [mitigation for mitigation, member in zip(mitigations, members, strict=True) if member]
                position_hooks = [mitigation for mitigation in here if mitigation.uses("position_query_key")]
                if len(position_hooks) > 1:
                    names = " and ".join(hook.options.name for hook in position_hooks)
                    raise ValueError(
                        f"{names} both rewrite how positions enter the queries and keys of layer {layer}: give them "
                        "disjoint `layers`."
                    )
                wrappers = [mitigation for mitigation in here if mitigation.uses("wrap_attention")]
                index_of[members] = len(shared)
                shared.append(
                    LayerHooks(
                        tuple(mitigation for mitigation in here if mitigation.uses("query_key_inputs")),
                        position_hooks[0] if position_hooks else None,
                        # innermost first; a wrapper that turns the queries and keys outermost
                        tuple(sorted(wrappers, key=lambda mitigation: mitigation.turns_queries_keys)),
                    )
                )
            hooks_of_layer.append(index_of[members])
        return cls(mitigations, tuple(shared), tuple(hooks_of_layer))

    def start(self, run: "LayerRun") -> "MitigationPlan":
        """The plan for one run of the layers: each mitigation with its per-run tensors, in the same layers' hooks."""
        started = {id(mitigation): mitigation.start(run) for mitigation in self.mitigations}
        shared = tuple(hooks.started(started) for hooks in self.shared)
        return MitigationPlan(tuple(started.values()), shared, self.hooks_of_layer)

    def read_positions(self, position_ids: torch.Tensor) -> torch.Tensor:
        for mitigation in self.mitigations:
            position_ids = mitigation.read_positions(position_ids)
        return position_ids

    def position_bases(self) -> tuple[float | RowBases | None, float | RowBases | None]:
        """`(rotary base, sinusoidal map base)`: the last mitigation that sets each one, else `None` (the model's)."""
        bases = [None, None]
        for mitigation in self.mitigations:
            for index, base in enumerate(mitigation.position_bases()):
                bases[index] = base if base is not None else bases[index]
        return bases[0], bases[1]

    def mask_function(self, padding_mask: torch.Tensor | None, kv_length: int, device: torch.device):
        """The and-mask of the plan's mitigations, or `None`."""
        functions = [mitigation.mask_function(padding_mask, kv_length, device) for mitigation in self.mitigations]
        functions = [function for function in functions if function is not None]
        return and_masks(*functions) if functions else None


@dataclass(frozen=True, eq=False)
class LayerRun:
    """One run of the layers as its plan reads it before they run, for SepFormer and a Hugging Face decoder alike;
    started (`start`), what each mitigation computes its per-run tensors from. A position-dependent rule (StableMask's
    `τ`, rotary angles, which tokens to skip) reads `position_ids`; only what reads the positional map reads
    `table_positions`."""

    plan: MitigationPlan | None
    position_ids: torch.LongTensor  # (b or 1, seq): the tokens' own positions (the caller's, or from each row's first)
    cache: Cache | None
    padding_mask: torch.Tensor | None  # (b, past + seq) 2D padding mask, or None
    device: torch.device  # the run's
    read_positions: torch.LongTensor  # (b or 1, seq)
    # past + seq (a tensor for a static cache, compiled); None without a plan
    kv_length: int | torch.Tensor | None = None
    mask_function: Callable | None = None
    rotary_base: float | RowBases | None = None  # one, or one per row
    map_base: float | RowBases | None = None
    # set by `start`: the run's dtype; where the positional map was read (shifted in training with
    # `random_position_offsets`; the read positions otherwise), and its rows there (b or 1, seq, d_pos), None without
    # a positional block
    dtype: torch.dtype | None = None
    table_positions: torch.LongTensor | None = None
    position_rows: torch.Tensor | None = None

    @classmethod
    def of(cls, plan: MitigationPlan | None, position_ids, attention_mask, cache, new_tokens: int, device):
        """Read `plan` (or no plan: the tokens' own positions, no and-mask) for `new_tokens` at `position_ids`."""
        padding_mask = attention_mask if attention_mask is not None and attention_mask.dim() == 2 else None
        if plan is None:
            return cls(plan, position_ids, cache, padding_mask, device, read_positions=position_ids)
        kv_length = (cache.get_seq_length() if cache is not None else 0) + new_tokens
        rotary_base, map_base = plan.position_bases()
        return cls(
            plan,
            position_ids,
            cache,
            padding_mask,
            device,
            read_positions=plan.read_positions(position_ids),
            kv_length=kv_length,
            mask_function=plan.mask_function(padding_mask, kv_length, device),
            rotary_base=rotary_base,
            map_base=map_base,
        )

    def start(self, dtype: torch.dtype, table_positions=None, position_rows=None) -> MitigationPlan | None:
        """The plan started on this run (`None` without one): `table_positions` where a positional map was read (the
        read positions when `None`) and `position_rows` its rows."""
        if self.plan is None:
            return None
        positions = self.read_positions if table_positions is None else table_positions
        return self.plan.start(replaced(self, dtype=dtype, table_positions=positions, position_rows=position_rows))
