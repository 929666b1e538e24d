"""Attention Buckets (arXiv 2312.04455): copies of the input reading positions with other bases, mixed by confidence."""

import dataclasses
import math
from dataclasses import dataclass

import torch
from transformers.modeling_outputs import CausalLMOutputWithPast

from .cache_sepformer import SepFormerCache
from .mitigation_base import CallContext, Mitigation, RowBases
from .mitigation_options import AttentionBuckets, BucketRows, MitigationOptions
from .positional_options import EXTRAPOLATION_METHODS, LEARNED_TABLE_METHODS


@dataclass(frozen=True, eq=False)
class AttentionBucketsMitigation(Mitigation):
    """The buckets' reading of positions: bucket `b` reads them at `m · scales[b]`, rotary with base `bases[b]` or the
    sinusoidal map with it (`which_base`; no base: the model's own). Several buckets wrap the causal LM
    (`run_causal_lm`): it runs once on a copy of every row per bucket (`BucketRows`), whose logits are mixed; each row
    then reads as its bucket, the scale and base one per row."""

    options_class = AttentionBuckets
    prefill_requirement = (
        "attention_buckets reads positions its own way from the prefill on (the cached keys were made with that "
        "reading): it must be on from the first (prefill) call of a cached generation."
    )
    scale: float | torch.Tensor = 1.0  # one, or (b, 1) one per row
    base: float | RowBases | None = None  # one, or one per row
    which_base: str = "rotary"  # the reading the base is of: "rotary", or "map" (the sinusoidal map's)
    table_rows: int | None = None  # the rows of a learned table whose extrapolation makes none past them, or None
    extrapolation: str = "none"  # the call's method

    @classmethod
    def resolve(cls, options: AttentionBuckets, call: CallContext) -> "AttentionBucketsMitigation":
        if options.scales is not None:
            call.positions.check_positions(options.name)
        several = isinstance(options, BucketRows)
        if options.num_buckets > 1 and not several:
            raise ValueError(
                f"attention_buckets with {options.num_buckets} buckets mixes the buckets' next-token logits: call it "
                "on SepFormerForCausalLM (forward or generate); the base model runs one bucket at a time."
            )
        config, extrapolation = call.model.config, call.extrapolation
        rotary_bases, map_bases = call.positions.bucket_bases(options, config)
        bases, scales = rotary_bases or map_bases, options.scales or (1.0,) * options.num_buckets
        scale, base = scales[0], None if bases is None else bases[0]
        if several:  # each row's bucket; the copies are side by side, and a batch made from them repeats each in place
            repeats, left = divmod(call.batch, options.rows)
            assert repeats and not left, f"{call.batch} rows are not copies of the buckets' {options.rows}"
            bucket = torch.arange(call.batch, device=call.model.device) // repeats % options.num_buckets
            # float32, as a Python float meets the positions
            scale = torch.tensor(scales, device=call.model.device)[bucket, None]
            base = None if bases is None else RowBases.of(bases, bucket)
        method = extrapolation.method if extrapolation is not None else "none"
        # a learned table that this call's extrapolation makes no row past
        learned = call.positions.positional_map is not None and config.has_positional_table
        rows = config.position_table_size if learned and method in LEARNED_TABLE_METHODS else None
        which = "rotary" if rotary_bases else "map"
        return cls(options, options.layer_set(config.num_hidden_layers), scale, base, which, rows, method)

    @classmethod
    def moves_positions(cls, options: AttentionBuckets) -> bool:
        return set(options.scales or (1.0,)) != {1.0}

    def read_positions(self, position_ids: torch.Tensor) -> torch.Tensor:
        if not self.moves_positions(self.options):
            return position_ids
        # the scaled positions stay on a learned table that this call's extrapolation does not extend
        if self.table_rows is not None and position_ids.numel() and not torch.compiler.is_compiling():
            rows, scale, highest = self.table_rows, max(self.options.scales), int(position_ids.max())
            read = highest * scale
            if math.ceil(read) >= rows:
                extending = [method for method in EXTRAPOLATION_METHODS if method not in LEARNED_TABLE_METHODS]
                raise ValueError(
                    f"attention_buckets scale {scale:g} reads position {highest} at {read:g}, past the learned "
                    f"positional table's {rows} rows, which position_extrapolation={self.extrapolation!r} does not "
                    f"extend: give scales <= {(rows - 1) / highest:g} for positions up to {highest}, or an "
                    f"extrapolation method that makes rows past the table ({', '.join(map(repr, extending))})."
                )
        return position_ids * self.scale

    def position_bases(self) -> tuple[float | RowBases | None, float | RowBases | None]:
        return (self.base, None) if self.which_base == "rotary" else (None, self.base)

    @classmethod
    def wraps_causal_lm(cls, options: AttentionBuckets) -> bool:
        return options.num_buckets > 1 and not isinstance(options, BucketRows)

    @classmethod
    def in_wrapped_call(cls, options: AttentionBuckets, call: CallContext) -> tuple[BucketRows, CallContext]:
        rows = call.batch * options.num_buckets
        return BucketRows(bases=options.bases, scales=options.scales, rows=rows), dataclasses.replace(call, batch=rows)

    @classmethod
    def check_continuation(cls, cache: SepFormerCache, options: AttentionBuckets | None) -> None:
        """A cache whose rows have a copy per bucket continues only with the buckets of its prefill, and several
        buckets continue only such a cache."""
        fixed = (cache.prefill_options or {}).get(cls.options_class.name)
        fixed = AttentionBuckets(bases=fixed.bases, scales=fixed.scales) if isinstance(fixed, BucketRows) else fixed
        copies = cache.row_copies > 1
        if isinstance(options, BucketRows) or (options == fixed and copies):
            return
        if options is not None and options.num_buckets > 1:
            raise ValueError(
                "attention_buckets keeps a copy of every row per bucket in the cache from the prefill on: continuing a "
                f"cache needs the same attention_buckets as its prefill ({fixed}); got {options}."
            )
        if copies:
            raise ValueError(
                f"this cache keeps a copy of every row per attention bucket from its prefill ({fixed}): continue it "
                f"with the same attention_buckets; got {options}."
            )

    @classmethod
    def run_causal_lm(cls, options: AttentionBuckets, model, inputs: dict, options_of_call: dict):
        """The causal LM run once on a copy of every row per bucket, side by side (row `r` of `b · B` a copy of row
        `r // B`, read as bucket `r % B`), with one cache of `b · B` rows; the buckets' logits are mixed."""
        if inputs.get("output_attentions") or inputs.get("output_hidden_states"):
            raise ValueError(
                "attention_buckets with several buckets returns mixed logits only: output_attentions and "
                "output_hidden_states would be one per bucket; run a bucket alone (bases=[one base]) to inspect it."
            )
        config, copies = model.config, options.num_buckets
        use_cache = inputs["use_cache"] if inputs["use_cache"] is not None else getattr(config, "use_cache", False)
        cache = inputs["past_key_values"]
        if cache is None and use_cache:
            cache = SepFormerCache(config=config)
        if cache is not None and not isinstance(cache, SepFormerCache):
            if cache.get_seq_length() > 0:
                raise cls.prefilled_without(cache)
            raise ValueError(
                "attention_buckets keeps a copy of every row per bucket on a SepFormerCache (what forward and "
                f"generate make with options); got {type(cache).__name__}."
            )
        labels = inputs.pop("labels")
        tokens = inputs["input_ids"] if inputs.get("input_ids") is not None else inputs.get("inputs_embeds")
        if tokens is None:
            raise ValueError("You must specify exactly one of input_ids or inputs_embeds.")
        batch = tokens.shape[0]
        rows = {
            name: value.repeat_interleave(copies, dim=0)
            for name, value in inputs.items()
            if isinstance(value, torch.Tensor) and value.dim() > 1 and value.shape[0] == batch
        }
        fixed = cache.prefill_options.get(options.name) if cache is not None and cache.get_seq_length() else None
        # the prefill's rows, or as many as the batch now has (the cache's batch operations change it)
        as_rows = fixed
        if fixed is None or fixed.rows != batch * copies:
            as_rows = BucketRows(bases=options.bases, scales=options.scales, rows=batch * copies)
        # per-row options repeated for each copy, and where equal the object the prefill kept, so that the decoding
        # steps keep their plan (matched by object)
        kept = cache.prefill_options if fixed else {}
        rows_of_options = {}
        for name, value in options_of_call.items():
            if isinstance(value, MitigationOptions):
                value = value.repeat_rows(copies)
                value = kept[name] if kept.get(name) == value else value
            rows_of_options[name] = value
        output = model(
            **{**inputs, **rows, "past_key_values": cache, "use_cache": use_cache},
            **{**rows_of_options, options.name: as_rows},
        )
        if cache is not None:  # once the call has run: a refused prefill leaves the cache as it was
            cache.row_copies = copies
            cache.prefill_options[options.name] = as_rows  # the next step's, which keeps its plan
        # the authors' mixing, `Σ_b w_b · logits_b` with `w = softmax_b(max_v logits_b)` per token
        logits = output.logits.unflatten(0, (batch, copies)).transpose(0, 1)  # (B, b, seq, V)
        logits = (logits.amax(-1, keepdim=True).softmax(0) * logits).sum(0)  # (b, seq, V)
        loss = None
        if labels is not None:
            loss_kwargs = {key: value for key, value in inputs.items() if key in model.loss_keywords}
            loss = model.loss_function(logits=logits, labels=labels, vocab_size=config.vocab_size, **loss_kwargs)
        return CausalLMOutputWithPast(loss=loss, logits=logits, past_key_values=cache)
