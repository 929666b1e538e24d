"""Parallel Context Windows (arXiv 2212.10947): windows that attend within themselves and share positions."""

from dataclasses import dataclass

import torch

from .cache_sepformer import MitigationState
from .mitigation_base import CallContext, Mitigation
from .mitigation_options import ParallelContextWindows
from .spans import check_default_positions, check_spans_in_prompt, key_documents, key_positions, prompt_lengths


def window_positions(spans: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """PCW's positions for tokens at `positions` (b or 1, n), counted from each row's first real token: window `k`'s
    restart at `s_1`, the task's continue after the longest window (docs/design.md, Parallel Context Windows)."""
    starts, ends = spans[..., 0], spans[..., 1]  # (b, K)
    inside = key_documents(spans, positions)  # (b, n, K)
    shift = torch.einsum("bnk,bk->bn", inside, (starts - starts[:, :1]).float()).long()
    after = positions >= ends[:, -1:]
    return positions - shift - after * task_shift(spans)


def task_shift(spans: torch.Tensor) -> torch.Tensor:
    """(b, 1) how far the positions of tokens after the last window move back: `e_K - s_1 - n_max`."""
    starts, ends = spans[..., 0], spans[..., 1]  # (b, K)
    return ends[:, -1:] - starts[:, :1] - (ends - starts).amax(-1, keepdim=True)


@dataclass(eq=False)
class WindowsState(MitigationState):
    """What the windows keep on the cache: how many of its tokens (padding included) hold every row's windows, so that
    a call continuing it after a crop back into a window is refused without reading the device."""

    columns: int


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
        if call.continuing and call.sepformer_cache is not None:  # not cropped back into a window
            state, held = call.sepformer_cache.mitigation_state.get(options.name), call.sepformer_cache.get_seq_length()
            if isinstance(state, WindowsState) and held < state.columns:
                raise ValueError(
                    f"parallel_context_windows reads a call continuing a cache as task tokens after the windows, but "
                    f"the cache holds {held} tokens, short of the {state.columns} that hold every row's windows "
                    "(cropped back into a window?): run the prompt again on an empty cache."
                )
        layers = options.layer_set(call.model.config.num_hidden_layers)
        spans = torch.tensor(options.spans, device=call.model.device)
        return cls(options, layers, spans, call.continuing, task_shift(spans))

    @classmethod
    def check_assistant_model(cls, options: ParallelContextWindows, lengths: list[int]) -> None:
        # rows past the batch, and spans past a prompt, are the prefill's to refuse (`check_spans_in_prompt`)
        ends = [max(end for _, end in spans) for spans in options.spans]
        reaching = [row for row, (end, length) in enumerate(zip(ends, lengths, strict=False)) if end == length]
        if reaching:
            raise ValueError(
                f"parallel_context_windows reads the tokens of a call continuing a cache as task tokens, and the "
                f"windows of rows {reaching} end at the prompt's last token, which transformers feeds the assistant "
                "model again after each round: end the windows before the prompt's last token (the task after them), "
                "or generate without assistant_model (prompt_lookup_num_tokens drafts without a second cache)."
            )

    def prepare(self, call: CallContext, others) -> None:
        """At an eager prefill, the cache's tokens that hold every row's windows: its padding and its windows."""
        if call.continuing or call.sepformer_cache is None or torch.compiler.is_compiling():
            return
        lengths = prompt_lengths(call.attention_mask, call.batch, call.new_tokens)
        ends = [max(end for _, end in spans) for spans in self.options.spans]
        columns = max(call.new_tokens - length + end for end, length in zip(ends, lengths, strict=True))
        call.sepformer_cache.mitigation_state[self.options.name] = WindowsState(columns)

    def read_positions(self, position_ids: torch.Tensor) -> torch.Tensor:
        # Every token of a later call is a task token: the windows lie in the prefill's prompt, as `mask_function`
        # also assumes (a cache cropped back into a window is refused: `resolve`).
        if self.continuing:
            return position_ids - self.task_offset
        return window_positions(self.spans, position_ids)

    def mask_function(self, padding_mask: torch.Tensor | None, kv_length: int, device: torch.device):
        if self.continuing:  # task tokens (`read_positions`)
            return None
        inside = key_documents(self.spans, key_positions(padding_mask, kv_length, device))  # (b, kv, K) one-hot
        windows = torch.where(inside.any(-1), inside.argmax(-1), -1)  # (b, kv) each key's window, -1 outside them

        def within_window(batch_idx, head_idx, q_idx, kv_idx):
            query_window, key_window = windows[batch_idx, q_idx], windows[batch_idx, kv_idx]
            return (query_window < 0) | (key_window < 0) | (query_window == key_window)

        return within_window
