"""Attention Buckets and Parallel Context Windows on Hugging Face models, for full-forward next-token evaluation.

SepFormer has both as `forward`/`generate` options. These functions give the same methods to an unmodified
Hugging Face causal LM, one forward of the whole prompt without a cache:

- `attention_buckets_logits(model, input_ids, attention_mask, bases)`: `LlamaForCausalLM` (rotary) run once per
  rotary base `θ_b` (the rotary module's `inv_freq` swapped for that base's during the run), the logits mixed by
  confidence, `Σ_b softmax_b(max_v logits_b) · logits_b`. Not defined for GPT-2: its learned absolute positions have
  no base (SepFormer reads a learned table at rescaled positions instead, its `scales`).
- `ms_poe_sdpa`, registered as the attention implementation `"ms_poe_sdpa"`: SDPA with MS-PoE on Llama when a
  forward call passes `ms_poe=` (plain SDPA otherwise).
- `parallel_context_windows_logits(model, input_ids, spans, attention_mask=None)`: position ids and a 4D attention
  mask, which any model that takes both runs as given (Llama, `GPT2LMHeadModel`): transformers returns a 4D mask
  unchanged (`masking_utils._preprocess_mask_arguments`), so it is built here with transformers' own
  `create_causal_mask` and PCW's window rule as an and-mask, in the form the model's attention implementation wants
  (additive for eager, boolean for sdpa).

The options' checks, the positions, the window rule and the mixing are SepFormer's own
(`sepformer.mitigation_options`, `sepformer.parallel_context_windows`, `sepformer.attention_buckets`), so both models
run exactly the same method. Rows may be left-padded: positions are counted from each row's first real token, and
spans too.
"""

import copy

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, create_causal_mask
from transformers.models.llama.modeling_llama import rotate_half

from sepformer.attention_buckets import mix_by_confidence
from sepformer.mitigation_base import CallContext
from sepformer.mitigation_options import AttentionBuckets, MSPoE, ParallelContextWindows
from sepformer.mitigations import head_ratios, position_awareness
from sepformer.parallel_context_windows import ParallelContextWindowsMitigation
from sepformer.positional_maps import positions_from_mask


def row_positions(input_ids: torch.Tensor, attention_mask: torch.Tensor | None) -> torch.Tensor:
    """(b or 1, n) each token's position counted from its row's first real token (0 on left padding)."""
    if attention_mask is None:
        return torch.arange(input_ids.shape[1], device=input_ids.device)[None]
    return positions_from_mask(attention_mask).clamp(min=0)


def rotary_inverse_frequencies(model, base: float) -> torch.Tensor:
    """The default rotary's `inv_freq` for another base, from transformers' own formula."""
    rotary = model.model.rotary_emb
    if rotary.rope_type != "default":
        raise ValueError(
            f"attention_buckets_logits swaps the rotary base of the default rotary; this model's rope_type is "
            f"{rotary.rope_type!r}."
        )
    config = copy.copy(rotary.config)
    config.rope_parameters = {**config.rope_parameters, "rope_theta": base}
    inv_freq, _ = rotary.compute_default_rope_parameters(config)
    return inv_freq.to(rotary.inv_freq.device)


@torch.no_grad()
def attention_buckets_logits(model, input_ids, attention_mask, bases) -> torch.Tensor:
    """(b, n, V) logits of Attention Buckets on a rotary HF model (`model.model.rotary_emb`): one forward per base."""
    bases = AttentionBuckets(bases=bases).bases  # checked: a non-empty sequence of positive finite numbers
    rotary = getattr(getattr(model, "model", None), "rotary_emb", None)
    if rotary is None:
        raise ValueError(
            f"attention_buckets_logits needs a rotary model (model.model.rotary_emb); {type(model).__name__} has none. "
            "Learned absolute positions (GPT-2) have no base: Attention Buckets is not defined there."
        )
    position_ids = None if attention_mask is None else row_positions(input_ids, attention_mask)
    own = rotary.inv_freq
    per_bucket = []
    try:
        for base in bases:
            rotary.inv_freq = rotary_inverse_frequencies(model, base)
            per_bucket.append(model(input_ids, attention_mask=attention_mask, position_ids=position_ids).logits)
    finally:
        rotary.inv_freq = own
    return mix_by_confidence(torch.stack(per_bucket))


@torch.no_grad()
def parallel_context_windows_logits(model, input_ids, spans, attention_mask=None) -> torch.Tensor:
    """(b, n) logits of Parallel Context Windows in one forward of a HF model that takes position ids and 4D masks.

    `spans`: per row, the windows' `(start, end)`, counted from the row's first real token, without gaps (as
    SepFormer's `parallel_context_windows`): tokens before the first window are shared by all windows, tokens after
    the last are the task.
    """
    batch, length = input_ids.shape
    call = CallContext(model, input_ids, attention_mask, None, None, batch, length, continuing=False)
    windows = ParallelContextWindowsMitigation.resolve(ParallelContextWindows(spans=spans), call)  # spans checked
    positions = row_positions(input_ids, attention_mask)
    mask = create_causal_mask(
        config=model.config,
        inputs_embeds=torch.empty(batch, length, 0, dtype=model.dtype, device=input_ids.device),  # shape and dtype
        attention_mask=attention_mask,
        past_key_values=None,
        position_ids=positions,
        and_mask_function=windows.mask_function(attention_mask, length, input_ids.device),
    )
    return model(input_ids, attention_mask=mask, position_ids=windows.read_positions(positions)).logits


def ms_poe_sdpa(module, query, key, value, attention_mask, ms_poe=None, position_ids=None, **kwargs):
    """SDPA attention with MS-PoE (arXiv 2403.04797) on HF Llama: head `h` of the chosen layers sees positions `m/r_h`.

    `query`/`key` arrive rotated by the model's rotary at positions `m`. Rotations of the same planes compose, so
    rotating again by `angle(m/r_h) - angle(m)` gives exactly the rotation at `m/r_h`. The ratios come from the
    package's `position_awareness` and `head_ratios` (most position-aware head gets `r_min`), scored on the last
    query's attention row with the original positions. Full forward passes only (no cache): this example evaluates
    Llama at the answer position with one forward of the whole prompt, positions `arange` (no padding).
    """
    option = MSPoE.parse(ms_poe)
    num_layers = module.config.num_hidden_layers
    layers = option.layers if option is not None and option.layers is not None else range(min(2, num_layers // 2),
                                                                                          num_layers)
    if option is None or module.layer_idx not in layers:
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    if key.shape[2] != query.shape[2]:
        raise ValueError("ms_poe_sdpa handles full forward passes only (no cache)")
    if module.num_key_value_groups != 1:
        raise ValueError("ms_poe_sdpa: this example's Llama has as many key-value heads as heads (ratios are per head)")
    batch, heads, length, head_dim = query.shape
    scaling = kwargs.get("scaling") or module.scaling

    # the last query's attention row, as the model computes it
    valid = torch.ones(batch, 1, length, dtype=torch.bool, device=query.device)
    if attention_mask is not None:  # a bool mask (True = attend) or an additive one
        last = attention_mask[:, :, -1, -length:]
        valid = last if last.dtype == torch.bool else last > torch.finfo(last.dtype).min / 2
    scores = (query[:, :, -1:] @ key.transpose(-1, -2)).squeeze(2) * scaling
    probs = scores.masked_fill(~valid, float("-inf")).softmax(-1)
    ratios = head_ratios(option, position_awareness(probs, valid)).to(query.dtype)  # (b, H)

    if position_ids is None:
        position_ids = torch.arange(length, device=query.device).expand(batch, length)
    rope = module.config.rope_parameters
    exponents = torch.arange(0, head_dim, 2, dtype=torch.float, device=query.device) / head_dim
    inv_freq = 1.0 / (rope["rope_theta"] ** exponents)
    shift = position_ids[:, None, :, None].float() * (1 / ratios - 1)[:, :, None, None]  # m/r - m: (b, H, n, 1)
    angles = torch.cat([shift * inv_freq, shift * inv_freq], -1).to(query.dtype)  # Llama's layout: halves
    cos, sin = angles.cos(), angles.sin()
    query = query * cos + rotate_half(query) * sin
    key = key * cos + rotate_half(key) * sin
    return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)


AttentionInterface.register("ms_poe_sdpa", ms_poe_sdpa)
# the mask SDPA takes: an implementation that transformers does not know the mask of gets no mask at all
ALL_MASK_ATTENTION_FUNCTIONS.register("ms_poe_sdpa", ALL_MASK_ATTENTION_FUNCTIONS["sdpa"])
