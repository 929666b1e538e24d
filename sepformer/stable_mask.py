"""StableMask (arXiv 2402.04779) in its exact sink form: one extra logit per query row with a zero value."""

import functools
import math
from dataclasses import dataclass

import torch

from .mitigation_base import (
    AttentionFunction,
    CallContext,
    LayerRun,
    Mitigation,
    attention_implementation,
    last_row_output,
    last_row_scores,
)
from .mitigation_options import StableMask


def sink_logits(option: StableMask, position_ids: torch.Tensor, default_columns: int) -> torch.Tensor:
    """`τ_t = -γt + log(1 - e^{-γ(N-t)}) - log(1 - e^{-γ})` at `t = position + 1`, `-∞` for `t >= N`, in float64 at
    the run's positions only (`N` may be any size)."""
    columns = option.columns if option.columns is not None else default_columns
    t = position_ids.double() + 1
    remaining = (columns - t).clamp(min=0)
    tau = -option.gamma * t + torch.log(-torch.expm1(-option.gamma * remaining)) - math.log(-math.expm1(-option.gamma))
    return tau.float()  # log(0) = -inf where t >= N


def sink_attention(interface, module, query, key, value, attention_mask, sink_logits, scaling, write_out, **kwargs):
    """StableMask's sink form on an attention function that takes a boolean or additive mask (eager, sdpa): a sink key
    in front scoring `τ_t` through one extra head dimension (docs/design.md, StableMask). `sink_logits` is (b or 1,
    1, seq, 1). `write_out`: a decoding row may be written out (the scores are q·k and the mask alone)."""
    batch, heads, seq, dim = query.shape
    kv = key.shape[2]
    if seq == 1 and not module.training and write_out:
        # decoding: one row, written out (a softmax over the scores and the sink) costs fewer calls than the kernel,
        # against the cache's keys and values as they are
        scores = last_row_scores(query, key, attention_mask, scaling)  # (b, H, kv), float32
        sink = sink_logits.view(-1, 1, 1).expand(batch, heads, 1)
        probs = torch.cat((scores, sink), -1).softmax(-1)[..., :kv]  # rows sum to less than 1
        weights = probs.unsqueeze(2)  # (b, H, 1, kv)
        return last_row_output(probs, value), weights if weights.dtype == query.dtype else weights.to(query.dtype)
    tau = (sink_logits.clamp(min=-1e3) / scaling).to(query.dtype).expand(batch, heads, seq, 1)
    query = torch.cat((query, tau), -1)  # (b, H, seq, d + 1)
    sink_key = torch.nn.functional.pad(key, (0, 1, 1, 0))  # (b, H_kv, 1 + kv, d + 1): the sink first
    sink_key[:, :, 0, dim] = 1
    sink_value = torch.nn.functional.pad(value, (0, 0, 1, 0))  # a zero value for the sink
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


# What a model's attention may add to its scores around StableMask's sink key: its own sinks (more columns of the
# softmax). Soft-capping would cap the sink's logit τ too (to at least -cap); a position bias or a sparse choice of
# keys is laid out by key, which the sink key in front would shift.
SCORES_WITH_A_SINK = frozenset({"s_aux", "sinks"})


@dataclass(frozen=True, eq=False)
class StableMaskMitigation(Mitigation):
    """Every layer's attention gets the sink; `τ` depends on the absolute position only (left padding and the cache
    do not move it), so cached decoding is the full forward pass."""

    options_class = StableMask
    reads_grouped_keys = True  # the sink key and a written-out row read the cache's keys and values as they are
    columns: int = 0  # N: the option's, or the model's max_position_embeddings
    plain_scores: bool = True  # the attention's scores are q·k and the mask alone (a decoding row can be written out)
    sink_logits: torch.Tensor | None = None  # (b or 1, 1, seq, 1): τ of the run's new tokens

    @classmethod
    def default_options(cls, config) -> dict | None:
        # a training method in its paper: SepFormer's config turns it on for every call (other models have no field)
        return getattr(config, "stable_mask", None)

    @classmethod
    def resolve(cls, options: StableMask, call: CallContext) -> "StableMaskMitigation":
        implementation = attention_implementation(call.model.config)
        if implementation not in ("eager", "sdpa"):
            raise ValueError(
                f"stable_mask runs on the 'eager' and 'sdpa' attention implementations (its sink is an extra key); "
                f"this model uses {implementation!r}."
            )
        config, positions = call.model.config, call.positions
        if "softcap" in positions.score_keywords:
            raise ValueError(
                f"stable_mask's sink logit τ goes through the attention's scores, and {positions.model_name} soft-caps "
                "them: τ would be capped too (to no less than -cap), so the sink would not be StableMask's."
            )
        # the sink is one more key: the model's own sinks take it as one more column
        positions.check_plain_scores("stable_mask", "adds a sink key to the attention", SCORES_WITH_A_SINK)
        plain_scores = not positions.score_keywords
        return cls(options, frozenset(range(config.num_hidden_layers)), config.max_position_embeddings, plain_scores)

    def start(self, run: LayerRun) -> "StableMaskMitigation":
        tau = sink_logits(self.options, run.position_ids, self.columns)
        return self.replace(sink_logits=tau[:, None, :, None])

    def wrap_attention(self, layer_idx: int, function: AttentionFunction, projection) -> AttentionFunction:
        return functools.partial(sink_attention, function, sink_logits=self.sink_logits, write_out=self.plain_scores)
