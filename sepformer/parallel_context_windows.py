"""Parallel Context Windows (arXiv 2212.10947): windows that attend within themselves and share positions."""

from dataclasses import dataclass

import torch

from .mitigation_base import CallContext, Mitigation
from .mitigation_options import ParallelContextWindows
from .spans import check_default_positions, check_spans_in_prompt, key_documents, key_positions


def window_ids(spans: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """(b, n) the window each token at `positions` (b or 1, n) lies in, -1 outside every window; `spans` (b, K, 2)."""
    inside = key_documents(spans, positions)  # (b, n, K) one-hot
    return torch.where(inside.any(-1), inside.argmax(-1), -1)


def window_positions(spans: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """PCW's positions for tokens at `positions` (b or 1, n), counted from each row's first real token.

    With windows `[s_k, e_k)` following one another, `P = s_1` (tokens before it keep their positions) and `n_max` the
    longest window: a token of window `k` gets `P + (m - s_k)`, a token after the last window (the task, generated
    tokens) `m - (e_K - s_1) + n_max`, so the task continues from `P + n_max`.
    """
    starts, ends = spans[..., 0], spans[..., 1]  # (b, K)
    inside = key_documents(spans, positions)  # (b, n, K)
    shift = torch.einsum("bnk,bk->bn", inside, (starts - starts[:, :1]).float()).long()
    after = positions >= ends[:, -1:]
    return positions - shift - after * task_shift(spans)


def task_shift(spans: torch.Tensor) -> torch.Tensor:
    """(b, 1) how far the positions of tokens after the last window move back: `e_K - s_1 - n_max`."""
    starts, ends = spans[..., 0], spans[..., 1]  # (b, K)
    return ends[:, -1:] - starts[:, :1] - (ends - starts).amax(-1, keepdim=True)


def check_windows_held(options: ParallelContextWindows, call: CallContext) -> None:
    """Refuse a call that continues a cache holding less of a row's prompt than its windows (a cache cropped back into
    one): its tokens would be read as task tokens after the windows. Not read in a traced call (a guard on values)."""
    if torch.compiler.is_compiling():
        return
    held, mask = int(call.cache.get_seq_length()), call.attention_mask
    real = mask[:, :held].sum(-1).tolist() if mask is not None and mask.dim() == 2 else [held] * len(options.spans)
    for row, (spans, tokens) in enumerate(zip(options.spans, real, strict=True)):
        if tokens < spans[-1][1]:
            raise ValueError(
                f"parallel_context_windows reads a call continuing a cache as task tokens after the windows, but the "
                f"cache holds {tokens} tokens of row {row}, short of the end of its last window {spans[-1]} (cropped "
                "back into a window?): run the prompt again on an empty cache."
            )


@dataclass(frozen=True, eq=False)
class ParallelContextWindowsMitigation(Mitigation):
    """Rewrites the positions where the map and rotary are read (`read_positions`) and, through an and-mask on the
    causal mask (`mask_function`), keeps each window's queries off the other windows' keys. Acts on the whole
    model, not in layers; the spans are re-read at every call, so decoding steps continue with task positions."""

    options_class = ParallelContextWindows
    prefill_requirement = (
        "parallel_context_windows encodes the windows at prefill: it must be on from the first (prefill) call of a "
        "cached generation."
    )
    spans: torch.Tensor | None = None  # (b, K, 2)
    continuing: bool = False
    task_offset: torch.Tensor | None = None  # (b, 1): how far the task's positions move back (`task_shift`)

    @classmethod
    def resolve(cls, options: ParallelContextWindows, call: CallContext) -> "ParallelContextWindowsMitigation":
        call.positions.check_positions(options.name)
        check_spans_in_prompt(options, call, "windows")
        check_default_positions(call, "parallel_context_windows places its windows and the task")
        if call.continuing:
            check_windows_held(options, call)
        layers = options.layer_set(call.model.config.num_hidden_layers)
        spans = torch.tensor(options.spans, device=call.model.device)
        return cls(options, layers, spans, call.continuing, task_shift(spans))

    def read_positions(self, position_ids: torch.Tensor) -> torch.Tensor:
        # Every token of a later call is a task token: the windows lie in the prefill's prompt, as `mask_function`
        # also assumes (a cache cropped back into a window is not supported).
        if self.continuing:
            return position_ids - self.task_offset
        return window_positions(self.spans, position_ids)

    def mask_function(self, padding_mask: torch.Tensor | None, kv_length: int, device: torch.device):
        if self.continuing:  # the windows lie in the prefill's prompt (checked there): later tokens are task tokens
            return None
        windows = window_ids(self.spans, key_positions(padding_mask, kv_length, device))  # (b, kv)

        def within_window(batch_idx, head_idx, q_idx, kv_idx):
            query_window, key_window = windows[batch_idx, q_idx], windows[batch_idx, kv_idx]
            return (query_window < 0) | (key_window < 0) | (query_window == key_window)

        return within_window
