"""Spans of tokens (calibration's documents, PCW's windows): per batch row, `(start, end)` counted from the row's first
real token, end exclusive."""

import torch

from .mitigation_base import CallContext
from .positional_maps import positions_from_mask


def check_spans_in_prompt(options, call: CallContext) -> None:
    """`options.spans`: one row of spans per batch row, each span inside its row's prompt (spans count from the row's
    first real token); the lengths are checked at prefill (a decoding step only adds tokens)."""
    if len(options.spans) != call.batch:
        raise ValueError(f"{options.name} has spans for {len(options.spans)} rows; the batch has {call.batch} rows.")
    if call.continuing:
        return
    mask = call.attention_mask
    lengths = mask.sum(-1).tolist() if mask is not None else [call.new_tokens] * call.batch
    check_spans_in_lengths(options.name, options.spans, lengths)


def check_spans_in_lengths(name: str, rows, lengths: list[int]) -> None:
    """Each row's spans end within its prompt's `lengths[row]` tokens; `name` begins the error."""
    for row, (spans, length) in enumerate(zip(rows, lengths, strict=True)):
        for start, end in spans:
            if end > length:
                raise ValueError(
                    f"{name} span ({start}, {end}) of row {row} is out of range: the prompt of that row has {length} "
                    "tokens (spans count from its first real token)."
                )


def key_positions(padding_mask: torch.Tensor | None, kv: int, device: torch.device) -> torch.Tensor:
    """(b or 1, kv) each key's position counted from its row's first real token, -1 on left padding."""
    if padding_mask is None:
        return torch.arange(kv, device=device)[None]
    return positions_from_mask(padding_mask).masked_fill(padding_mask == 0, -1)


def key_documents(spans: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """(b, kv, K) one-hot: which of the (b, K, 2) spans each key at `positions` (b or 1, kv) lies in."""
    starts, ends = spans[..., 0][:, None], spans[..., 1][:, None]  # (b, 1, K)
    inside = (positions[..., None] >= starts) & (positions[..., None] < ends)
    return inside.float()  # calibration re-weights rows of probabilities kept in float32
