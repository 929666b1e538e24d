"""Attention Buckets (arXiv 2312.04455): copies of the input reading positions with other bases, mixed by confidence."""

import math
from dataclasses import dataclass

import torch
from transformers.modeling_outputs import CausalLMOutputWithPast

from .cache_sepformer import MitigationState, SepFormerCache
from .mitigation_base import CallContext, Mitigation
from .mitigation_options import AttentionBuckets
from .positional_options import EXTRAPOLATION_METHODS, LEARNED_TABLE_METHODS


def mix_by_confidence(logits: torch.Tensor) -> torch.Tensor:
    """`Σ_b w_b · logits_b` with `w = softmax_b(max_v logits_b)`, per token; `logits` (B, b, seq, V) -> (b, seq, V).

    The mixing of the authors' code: a bucket that is more confident of its best token weighs more.
    """
    weights = logits.amax(-1, keepdim=True).softmax(0)  # (B, b, seq, 1)
    return (weights * logits).sum(0)


def on_each_cache(operation: str):
    """The cache's batch operation `operation`, applied to each bucket's cache."""

    def apply(self, argument) -> None:
        for cache in self.caches:
            getattr(cache, operation)(argument)

    return apply


@dataclass(eq=False)
class BucketsState(MitigationState):
    """What several buckets keep on the cache (bucket 0's): their options, the caches of buckets 1.., to which the
    cache's batch operations apply too, and whether a forward is running the buckets (bucket 0's own pass then reads
    this cache with its one bucket, which a caller may not do)."""

    options: AttentionBuckets
    caches: list[SepFormerCache]
    running: bool = False

    reorder_cache = on_each_cache("reorder_cache")
    batch_repeat_interleave = on_each_cache("batch_repeat_interleave")
    batch_select_indices = on_each_cache("batch_select_indices")
    crop = on_each_cache("crop")


@dataclass(frozen=True, eq=False)
class AttentionBucketsMitigation(Mitigation):
    """One bucket: the model reads positions at `m · scale`, rotary with base `rotary_base` and the sinusoidal map
    with base `map_base` (`None`: the model's own). Several buckets wrap the causal LM (`run_causal_lm`): each runs
    the whole model as one bucket, with its own cache, and their logits are mixed."""

    options_class = AttentionBuckets
    prefill_requirement = (
        "attention_buckets reads positions its own way from the prefill on (the cached keys were made with that "
        "reading): it must be on from the first (prefill) call of a cached generation."
    )
    rotary_base: float | None = None
    map_base: float | None = None
    scale: float = 1.0
    table_rows: int | None = None  # the rows of a learned table whose extrapolation makes none past them, or None
    extrapolation: str = "none"  # the call's method

    @classmethod
    def resolve(cls, options: AttentionBuckets, call: CallContext) -> "AttentionBucketsMitigation":
        if options.num_buckets > 1:
            raise ValueError(
                f"attention_buckets with {options.num_buckets} buckets mixes the buckets' next-token logits: call it "
                "on SepFormerForCausalLM (forward or generate); the base model runs one bucket at a time."
            )
        config, extrapolation = call.model.config, call.extrapolation
        rotary_base, map_base = call.positions.bucket_bases(options, config)
        scale = options.scales[0] if options.scales is not None else 1.0
        method = extrapolation.method if extrapolation is not None else "none"
        # a learned table that this call's extrapolation makes no row past
        learned = call.positions.positional_map is not None and config.has_positional_table
        rows = config.position_table_size if learned and method in LEARNED_TABLE_METHODS else None
        return cls(options, options.layer_set(config.num_hidden_layers), rotary_base, map_base, scale, rows, method)

    @classmethod
    def fixes_state_at_prefill(cls, options: AttentionBuckets) -> bool:
        return True  # the cached keys were read with the bucket's positions: later calls need the same reading

    def read_positions(self, position_ids: torch.Tensor) -> torch.Tensor:
        if self.scale == 1.0:
            return position_ids
        if self.table_rows is not None and position_ids.numel() and not torch.compiler.is_compiling():
            self.check_inside_table(int(position_ids.max()))
        return position_ids * self.scale

    def check_inside_table(self, highest: int) -> None:
        """The scaled positions stay on the learned table, which this call's extrapolation does not extend."""
        rows, read = self.table_rows, highest * self.scale
        if math.ceil(read) >= rows:
            extending = [method for method in EXTRAPOLATION_METHODS if method not in LEARNED_TABLE_METHODS]
            raise ValueError(
                f"attention_buckets scale {self.scale:g} reads position {highest} at {read:g}, past the learned "
                f"positional table's {rows} rows, which position_extrapolation={self.extrapolation!r} does not "
                f"extend: give scales <= {(rows - 1) / highest:g} for positions up to {highest}, or an extrapolation "
                f"method that makes rows past the table ({', '.join(map(repr, extending))})."
            )

    def position_bases(self) -> tuple[float | None, float | None]:
        return self.rotary_base, self.map_base

    @classmethod
    def wraps_causal_lm(cls, options: AttentionBuckets) -> bool:
        return options.num_buckets > 1

    @classmethod
    def check_continuation(cls, cache: SepFormerCache, options: AttentionBuckets | None) -> None:
        """Several buckets continue only a cache that keeps their caches, and such a cache only with them (bucket 0's
        own pass, while the buckets run, reads it with its one bucket)."""
        state = cache.mitigation_state.get(cls.options_class.name)
        if state is not None and state.running:
            return
        prefill = state.options if state is not None else None
        if options is not None and options.num_buckets > 1 and options != prefill:
            raise ValueError(
                "attention_buckets keeps a cache per bucket from the prefill on: continuing a cache needs the same "
                f"attention_buckets as its prefill ({prefill}); got {options}."
            )
        if state is not None and options != state.options:
            raise ValueError(
                f"this cache keeps one cache per attention bucket from its prefill ({state.options}): continue it with "
                f"the same attention_buckets; got {options}."
            )

    @classmethod
    def run_causal_lm(cls, options: AttentionBuckets, model, inputs: dict, options_of_call: dict):
        """Each bucket runs the whole causal LM with its own cache: bucket 0 the call's cache itself, bucket `b > 0`
        the sub-cache `caches[b - 1]` of the `BucketsState` that the cache keeps (made at prefill). Their logits are
        mixed."""
        if inputs.get("output_attentions") or inputs.get("output_hidden_states"):
            raise ValueError(
                "attention_buckets with several buckets returns mixed logits only: output_attentions and "
                "output_hidden_states would be one per bucket; run a bucket alone (bases=[one base]) to inspect it."
            )
        config = model.config
        use_cache = inputs["use_cache"] if inputs["use_cache"] is not None else config.use_cache
        cache = inputs["past_key_values"]
        if cache is None and use_cache:
            cache = SepFormerCache(config=config)
        caches = [None] * options.num_buckets
        if cache is not None:
            if not isinstance(cache, SepFormerCache):
                raise ValueError(
                    f"attention_buckets keeps one cache per bucket on a SepFormerCache (what forward and generate make "
                    f"by default); got {type(cache).__name__}."
                )
            if cache.get_seq_length() == 0:
                bucket_caches = [SepFormerCache(config=config) for _ in range(options.num_buckets - 1)]
                for bucket_cache in bucket_caches:  # the same weights: one fused copy serves every bucket
                    bucket_cache.derived = cache.derived
                cache.mitigation_state[options.name] = BucketsState(options, bucket_caches)
            state = cache.mitigation_state[options.name]  # other buckets were refused (`check_continuation`)
            caches = [cache, *state.caches]
        labels = inputs.pop("labels")
        inputs = {key: value for key, value in inputs.items() if key not in ("past_key_values", "use_cache")}
        if cache is not None:
            state.running = True
        # The bucket reading the farthest positions first: refused past the table, it is so before any bucket's cache
        # holds keys.
        scales = options.scales or (1.0,) * options.num_buckets
        order = sorted(range(options.num_buckets), key=lambda index: -scales[index])
        try:
            by_bucket = {
                index: model(
                    **inputs,
                    **{**options_of_call, options.name: options.bucket(index)},
                    past_key_values=caches[index],
                    use_cache=use_cache,
                ).logits
                for index in order
            }
            logits = torch.stack([by_bucket[index] for index in range(options.num_buckets)])  # (B, b, seq, V)
        finally:
            if cache is not None:
                state.running = False
        logits = mix_by_confidence(logits)
        loss = None
        if labels is not None:
            loss_kwargs = {key: value for key, value in inputs.items() if key in model.loss_keywords}
            loss = model.loss_function(logits=logits, labels=labels, vocab_size=config.vocab_size, **loss_kwargs)
        return CausalLMOutputWithPast(loss=loss, logits=logits, past_key_values=cache)
