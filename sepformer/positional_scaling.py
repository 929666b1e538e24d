"""Positional-dimension scaling (arXiv 2406.02536): chosen channels of the attention input times `s`."""

import math
from dataclasses import dataclass

import torch
from transformers.models.llama.modeling_llama import repeat_kv

from .mitigation_base import AttentionFunction, CallContext, InputScale, LayerRun, Mitigation, QueryKeyProjection
from .mitigation_options import PositionalScaling


@dataclass(frozen=True, eq=False)
class PositionalScalingMitigation(Mitigation):
    """`f(h) = h` with channels `c` times `s`, in the chosen layers, as the authors' code computes it: at prefill the
    last `last_recompute_tokens` rows recomputed with `q̄ = W_Q f(h)` against `K̄ = W_K f(h)` (which go into the cache),
    each decoding step reading `f(h)`; values never scaled (docs/design.md, "Positional-dimension scaling")."""

    options_class = PositionalScaling
    reads_grouped_keys = True  # its base rows run the attention function, which expands grouped keys itself
    prefill_requirement = (
        "positional_scaling puts scaled keys into the cache at prefill: it must be on from the first (prefill) call "
        "of a cached generation."
    )
    hidden_size: int = 0
    channels: tuple[int, ...] = ()
    continuing: bool = False
    key_factors: torch.Tensor | None = None  # (b or 1, seq, d_model), or (d_model,) for every token: `s` on the
    # channels of scaled tokens, else 1
    query_factors: torch.Tensor | None = None  # the same on the rows whose queries are scaled, 1 on the others
    input_scale: InputScale | None = None  # a decoding step whose tokens are all scaled alike: (channels, s or 1)

    @classmethod
    def acts_on_last_rows(cls, options: PositionalScaling) -> bool:
        return True  # the prefill's last `last_recompute_tokens` rows are recomputed with scaled queries

    @classmethod
    def resolve(cls, options: PositionalScaling, call: CallContext) -> "PositionalScalingMitigation":
        config = call.model.config
        call.positions.check_query_key_inputs("positional_scaling", "a scaled input")
        channels = options.channels or call.positions.positional_channels(config)
        bad = [channel for channel in channels if not 0 <= channel < config.hidden_size]
        if bad:
            raise ValueError(
                f"positional_scaling channels {bad} are out of range: channels are 0..{config.hidden_size - 1}."
            )
        bound = math.sqrt(torch.finfo(call.model.dtype).max)
        if abs(options.factor) > bound:
            raise ValueError(
                f"positional_scaling factor={options.factor!r} overflows this model's {call.model.dtype}: the "
                f"attention scores carry factor² (queries and keys are both scaled), so |factor| must be at most "
                f"{bound:.4g}."
            )
        layers = options.layer_set(config.num_hidden_layers)
        return cls(options, layers, config.hidden_size, channels, call.continuing)

    def start(self, run: LayerRun) -> "PositionalScalingMitigation":
        factors = torch.ones(self.hidden_size, dtype=run.dtype, device=run.device)
        factors[list(self.channels)] = self.options.factor
        # at a decoding step, (channels, s) when every new token is scaled, (channels, 1) when none is
        input_scale = None
        if self.continuing:
            skip = self.options.skip_first
            first, last = torch.stack(run.position_ids.aminmax()).tolist() if skip else (0, 0)
            if first >= skip:
                input_scale = self.channels, self.options.factor
            elif last < skip:
                input_scale = self.channels, 1.0
        if input_scale is not None and input_scale[1] == self.options.factor:  # a step whose every token is scaled
            return self.replace(key_factors=factors, query_factors=factors, input_scale=input_scale)
        skipped = (run.position_ids < self.options.skip_first)[..., None]  # (b or 1, seq, 1)
        key_factors = torch.where(skipped, torch.ones_like(factors), factors)  # (b or 1, seq, d_model)
        query_factors = key_factors
        if not self.continuing:  # prefill: only the last rows' queries are scaled
            seq = key_factors.shape[1]
            recomputed = torch.arange(seq, device=run.device) >= seq - self.options.last_recompute_tokens
            query_factors = torch.where(recomputed[:, None], key_factors, torch.ones_like(factors))
        return self.replace(key_factors=key_factors, query_factors=query_factors, input_scale=input_scale)

    def decoding_input_scale(self, layer_idx):
        return self.input_scale

    def query_key_inputs(self, layer_idx, query_input, key_input):
        return query_input * self.query_factors, key_input * self.key_factors

    def wrap_attention(
        self, layer_idx: int, function: AttentionFunction, projection: QueryKeyProjection | None
    ) -> AttentionFunction:
        recomputed = self.options.last_recompute_tokens

        def scaled_attention(module, query, key, value, attention_mask, **kwargs):
            # `query`: scaled on the recomputed rows; `key`: the scaled keys (what the cache holds)
            output, weights = function(module, query, key, value, attention_mask, **kwargs)
            base_rows = query.shape[2] - recomputed
            if self.continuing or base_rows <= 0:
                return output, weights
            # Prefill: the rows before the last attend to the unscaled keys, as in the base model. A causal row reads
            # keys up to itself only, so the base rows of a full attention call with those keys are the base model's.
            base_key = projection.project_keys(projection.attention_input)  # (b, H or H_kv, seq, head_dim)
            base_key = repeat_kv(base_key, key.shape[1] // base_key.shape[1])
            base_output, base_weights = function(module, query, base_key, value, attention_mask, **kwargs)
            output = torch.cat((base_output[:, :base_rows], output[:, base_rows:]), 1)  # (b, seq, H, head_dim)
            if weights is not None:
                weights = torch.cat((base_weights[:, :, :base_rows], weights[:, :, base_rows:]), 2)
            return output, weights

        return scaled_attention
