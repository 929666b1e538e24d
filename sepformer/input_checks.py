"""Checks of a call's inputs, before any work: what the layers would fail on deep inside torch, or silently ignore."""

import os

import torch
from safetensors import safe_open
from transformers.cache_utils import Cache
from transformers.utils import TransformersKwargs, logging

from .mitigations import MITIGATIONS
from .spans import check_mask_values

logger = logging.get_logger(__name__)


def check_inputs(model, input_ids, inputs_embeds, attention_mask, position_ids, past_key_values, kwargs) -> None:
    """Refuse, before any work, what the layers of `model` (a `SepFormerModel`) would fail on or ignore. The values of
    a prompt (ids in the vocabulary, a 0/1 padding mask, positions >= 0) are read when there is no cache yet: a decoding
    step's come from `generate`, and reading them would wait for the device at every step."""
    config = model.config
    tensors = dict(
        input_ids=input_ids, inputs_embeds=inputs_embeds, attention_mask=attention_mask, position_ids=position_ids
    )
    check_types(model, kwargs, tensors, past_key_values)
    check_token_inputs(model, input_ids, inputs_embeds)
    batch, seq = (input_ids if input_ids is not None else inputs_embeds).shape[:2]
    if batch == 0 or seq == 0:
        raise ValueError(f"the input has no tokens (shape {(batch, seq)}): give at least one row of one token or more.")
    past = past_key_values.get_seq_length() if past_key_values is not None else 0
    if input_ids is not None and past == 0:
        low, high = (value.item() for value in torch.aminmax(input_ids))
        if low < 0 or high >= config.vocab_size:
            raise ValueError(
                f"input_ids contains id {low if low < 0 else high}, outside the vocabulary 0..{config.vocab_size - 1}."
            )
    if attention_mask is not None:
        check_attention_mask(attention_mask, batch, config.num_attention_heads, seq, past, past_key_values)
    if past:
        check_cache_batch(past_key_values, batch)
    if position_ids is not None:
        check_position_ids(position_ids, batch, seq, past)


def check_types(model, kwargs: dict, tensors: dict, past_key_values) -> None:
    """Refuse keywords neither `forward`'s nor transformers', inputs not tensors of values, a cache not a `Cache`."""
    unknown = sorted(set(kwargs) - set(TransformersKwargs.__optional_keys__))
    if unknown:
        raise TypeError(
            f"SepFormer got unknown keyword arguments {unknown}. Besides the named arguments of `forward`, it takes "
            f"the mitigations {', '.join(map(repr, MITIGATIONS))} and transformers' "
            f"{', '.join(sorted(TransformersKwargs.__optional_keys__))}."
        )
    for name, value in tensors.items():
        if value is not None and not isinstance(value, torch.Tensor):
            raise TypeError(
                f"{name} must be a torch tensor; got a {type(value).__name__}. Convert it first, e.g. "
                f"torch.tensor(ids)[None] for one sequence (a list or a NumPy array), torch.tensor(batch) for a batch."
            )
    on_meta = [name for name, value in tensors.items() if value is not None and value.device.type == "meta"]
    if on_meta:
        raise ValueError(
            f"{', '.join(on_meta)} {'is' if len(on_meta) == 1 else 'are'} on the meta device, which holds shapes but "
            f"no values: give tensors holding the inputs, on the model's device ({model.embed_tokens.weight.device})."
        )
    if past_key_values is not None and not isinstance(past_key_values, Cache):
        raise TypeError(
            f"past_key_values must be a Cache; got a {type(past_key_values).__name__} (the legacy format, one "
            "(key, value) pair per layer, is gone from transformers, and with it DynamicCache.from_legacy_cache): "
            "convert it with SepFormerCache(past_key_values, config=model.config)."
        )


def check_token_inputs(model, input_ids, inputs_embeds) -> None:
    """Exactly one of `input_ids` (2-D integer ids) and `inputs_embeds` (the semantic block, in the embeddings'
    dtype)."""
    semantic_size = model.config.semantic_size
    if (input_ids is None) == (inputs_embeds is None):
        raise ValueError("You must specify exactly one of input_ids or inputs_embeds")
    if input_ids is not None and (input_ids.dim() != 2 or input_ids.dtype not in (torch.int64, torch.int32)):
        hint = {
            2: "integer token ids: input_ids.long()",
            1: "a batch dimension: input_ids[None]",
            0: "a batch and a sequence dimension: input_ids.view(1, 1)",
        }.get(input_ids.dim(), "one row of ids per sequence: input_ids.flatten(0, -2) merges the leading dimensions")
        if input_ids.dim() > 2 and input_ids.is_floating_point():
            hint = f"token ids; vectors go in inputs_embeds, (batch, sequence, semantic_size={semantic_size})"
        raise ValueError(
            f"input_ids must be a 2-D tensor of token ids (batch, sequence) of torch.int64 or torch.int32; got shape "
            f"{tuple(input_ids.shape)} of {input_ids.dtype} (give {hint})."
        )
    if inputs_embeds is None:
        return
    if inputs_embeds.dim() != 3 or inputs_embeds.shape[-1] != semantic_size:
        raise ValueError(
            f"inputs_embeds has shape {tuple(inputs_embeds.shape)}, but SepFormer's inputs_embeds is the semantic "
            f"block s(token): (batch, sequence, semantic_size={semantic_size})."
        )
    embeds_dtype = model.embed_tokens.weight.dtype  # what inputs_embeds stands in for
    # autocast casts each operation's inputs
    if inputs_embeds.dtype != embeds_dtype and not torch.is_autocast_enabled(inputs_embeds.device.type):
        raise ValueError(
            f"inputs_embeds has dtype {inputs_embeds.dtype}, but the model's embeddings are {embeds_dtype}: give "
            f"inputs_embeds.to({embeds_dtype})."
        )


def check_attention_mask(mask: torch.Tensor, batch: int, heads: int, seq: int, past: int, cache: Cache | None) -> None:
    """A 2-D padding mask (batch, past + new tokens) of 0s and 1s (read when there is no cache yet), or a 4-D mask, used
    as given: (batch or 1, 1 or heads, new tokens, keys), keys `past + new tokens` unless the cache has a fixed size."""
    if mask.dim() == 2 and mask.shape != (batch, past + seq):
        raise ValueError(
            f"attention_mask has shape {tuple(mask.shape)}; a 2-D padding mask must be (batch, past + new "
            f"tokens) = {(batch, past + seq)}."
        )
    if mask.dim() not in (2, 4):
        raise ValueError(
            f"attention_mask must be a 2-D padding mask (batch, past + new tokens) or a 4-D mask; got shape "
            f"{tuple(mask.shape)}."
        )
    keys = None if getattr(cache, "is_compileable", False) else past + seq  # a fixed-size cache: its own length
    shape = mask.shape
    if mask.dim() == 4 and (
        shape[0] not in (1, batch) or shape[1] not in (1, heads) or shape[2] != seq or keys not in (None, shape[3])
    ):
        raise ValueError(
            f"attention_mask has shape {tuple(shape)}; a 4-D mask must be (batch or 1, 1 or heads, new tokens, "
            f"{'keys' if keys is None else 'past + new tokens'}) = ({batch} or 1, 1 or {heads}, {seq}, "
            f"{'keys' if keys is None else keys})."
        )
    if mask.dim() == 2 and past == 0:
        check_mask_values(mask)


def check_position_ids(position_ids: torch.Tensor, batch: int, seq: int, past: int) -> None:
    """(batch or 1, new tokens) integer positions, none negative (read when there is no cache yet)."""
    if position_ids.dim() != 2 or position_ids.shape[0] not in (1, batch) or position_ids.shape[1] != seq:
        raise ValueError(
            f"position_ids has shape {tuple(position_ids.shape)}; it must be (batch or 1, new tokens) = "
            f"({batch} or 1, {seq})."
        )
    if position_ids.dtype not in (torch.int64, torch.int32):
        raise ValueError(
            f"position_ids must be integer positions of torch.int64 or torch.int32; got {position_ids.dtype}. "
            "(Fractional positions are the mitigations' own reading: ms_poe, attention_buckets' scales.)"
        )
    if past == 0 and (lowest := position_ids.min().item()) < 0:
        raise ValueError(f"position_ids: position {lowest} is negative: positions start at 0.")


def check_cache_batch(cache: Cache, batch: int) -> None:
    """A call continuing `cache` gives every cached row its new tokens."""
    keys = getattr(cache.layers[0], "keys", None) if getattr(cache, "layers", None) else None
    if isinstance(keys, torch.Tensor) and keys.shape[0] != batch:
        raise ValueError(
            f"the input's batch is {batch}, but past_key_values holds {keys.shape[0]} rows: a call continuing a cache "
            "gives every cached row its new tokens (keep some rows with past_key_values.batch_select_indices(indices), "
            "or start a new cache)."
        )


def check_labels(config, input_ids, inputs_embeds, labels, logits_to_keep, kwargs) -> None:
    """Refuse `labels` (and transformers' `shift_labels`, among the loss keywords in `kwargs`) that the loss would fail
    on deep inside torch, before any work is done."""
    if isinstance(logits_to_keep, int) and logits_to_keep < 0:
        # Llama reads -n as `slice(n, None)`: every logit but the first n, which no caller means
        raise ValueError(
            f"logits_to_keep={logits_to_keep} is negative: give 0 (every position), n > 0 (the last n positions) or "
            "a tensor of the positions to keep."
        )
    inputs = input_ids if input_ids is not None else inputs_embeds
    if not isinstance(inputs, torch.Tensor):
        return  # `check_inputs` says what is wrong with the input
    if labels is not None and not (isinstance(logits_to_keep, int) and logits_to_keep == 0):
        raise ValueError(
            f"labels are scored at every position, but logits_to_keep={logits_to_keep!r} keeps fewer logits: give "
            "logits_to_keep=0 (all) with labels."
        )
    ignore_index = kwargs.get("ignore_index", -100)
    for name, value in (("labels", labels), ("shift_labels", kwargs.get("shift_labels"))):
        if value is None:
            continue
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"{name} must be a torch tensor of token ids; got a {type(value).__name__}.")
        if value.dtype != torch.int64 or value.shape != inputs.shape[:2]:
            raise ValueError(
                f"{name} must be token ids of torch.int64 shaped like the input (batch, sequence) = "
                f"{tuple(inputs.shape[:2])}; got shape {tuple(value.shape)} of {value.dtype}."
            )
        outside = value[(value != ignore_index) & ((value < 0) | (value >= config.vocab_size))]
        if outside.numel():
            raise ValueError(
                f"{name} contains {outside[0].item()}: a label is a token id 0..{config.vocab_size - 1} or "
                f"ignore_index={ignore_index} (not scored)."
            )
    scored = kwargs.get("shift_labels", labels[:, 1:] if labels is not None else None)  # the loss shifts `labels`
    if scored is not None and kwargs.get("num_items_in_batch") is None and bool((scored == ignore_index).all()):
        # a warning, not an error: `Trainer` evaluates batches whose labels may all be ignored (a long prompt)
        logger.warning(
            f"Every scored label is ignore_index={ignore_index} (the loss scores labels[:, 1:], or shift_labels): no "
            "token is scored, so the loss is NaN (0 / 0)."
        )


def check_checkpoint_folder(path, kwargs: dict) -> None:
    """Refuse what `from_pretrained` would read as a Hub repo id or a default config: a local path (a `Path`, an
    absolute or `./` path, or one with several `/`) that is no folder, or a folder without `config.json` (unless a
    config is given)."""
    text = os.fspath(path) if isinstance(path, (str, os.PathLike)) else None
    if text is None:
        return
    local = isinstance(path, os.PathLike) or os.path.isabs(text) or text.startswith((".", "~")) or text.count("/") > 1
    if local and not os.path.isdir(text):
        found = "is a file" if os.path.isfile(text) else "does not exist"
        raise OSError(
            f"from_pretrained: {text!r} {found}; give the folder save_pretrained wrote (config.json and the weights), "
            "or a Hub repo id (namespace/name)."
        )
    config_file = os.path.join(text, kwargs.get("subfolder") or "", "config.json")
    if os.path.isdir(text) and kwargs.get("config") is None and not os.path.isfile(config_file):
        raise OSError(
            f"from_pretrained: the folder {text!r} has no {os.path.relpath(config_file, text)}, so it is not a saved "
            f"model (save_pretrained writes config.json beside the weights); it holds {sorted(os.listdir(text))[:8]}."
        )


def unreadable_weights(path, error: Exception) -> OSError:
    """The error to raise when the safetensors of a checkpoint could not be read: it names the files that are not
    whole (a save or download cut short) in a local folder."""
    folder = os.fspath(path) if isinstance(path, (str, os.PathLike)) and os.path.isdir(path) else None
    broken = []
    for name in sorted(os.listdir(folder)) if folder else ():
        if name.endswith(".safetensors"):
            try:
                with safe_open(os.path.join(folder, name), "pt"):
                    pass
            except Exception:  # whatever stops safetensors reading it
                broken.append(os.path.join(folder, name))
    files = ", ".join(broken) if broken else "a weights file of the checkpoint"
    return OSError(
        f"from_pretrained: {files} is not a whole safetensors file ({error}): it was probably cut short by an "
        "interrupted save or download; save or download it again."
    )
