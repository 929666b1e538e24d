"""Attention Buckets and Parallel Context Windows on Hugging Face models, for full-forward next-token evaluation.

SepFormer has both as `forward`/`generate` options. These functions give the same methods to an unmodified
Hugging Face causal LM, one forward of the whole prompt without a cache:

- `attention_buckets_logits(model, input_ids, attention_mask, bases)`: `LlamaForCausalLM` (rotary) run once per
  rotary base `θ_b` (the rotary module's `inv_freq` swapped for that base's during the run), the logits mixed by
  confidence, `Σ_b softmax_b(max_v logits_b) · logits_b`. Not defined for GPT-2: its learned absolute positions have
  no base (SepFormer reads a learned table at rescaled positions instead, its `scales`).
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
from transformers.masking_utils import create_causal_mask

from sepformer.attention_buckets import mix_by_confidence
from sepformer.mitigation_base import CallContext
from sepformer.mitigation_options import AttentionBuckets, ParallelContextWindows
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
