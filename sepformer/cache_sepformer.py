"""`SepFormerCache`: the KV cache, plus what a generation fixes at prefill and reuses at every decoding step."""

from collections.abc import Callable, Hashable
from typing import Any

import torch
from transformers.cache_utils import DynamicCache, DynamicLayer


class GrowingLayer(DynamicLayer):
    """A `DynamicLayer` whose decoding steps write their keys and values in place, into buffers with room to grow
    (docs/design.md, "Decoding steps"), where `DynamicLayer.update` concatenates the whole cache at every step.

    A prefill stores its states as `DynamicLayer` does; a decoding step copies its new tokens only, the keys and values
    being the buffers' leading tokens (`appended_in_place`). Any other assignment of the keys or values drops the
    buffers, so a step never writes where a tensor handed out before can see it. With autograd on, under
    `torch.compile`, or for states of another dtype, device or shape, it concatenates as `DynamicLayer` does.
    """

    key_buffer: torch.Tensor | None = None
    value_buffer: torch.Tensor | None = None

    def __setattr__(self, name: str, value) -> None:
        """Assigning the keys or values drops the buffers (a step's own write goes past, through `__dict__`): reading
        them stays a plain attribute's, which transformers does a dozen times per layer and step."""
        if name in ("keys", "values"):
            self.__dict__.update(key_buffer=None, value_buffer=None)
        super().__setattr__(name, value)

    @classmethod
    def from_layer(cls, layer: DynamicLayer) -> "GrowingLayer":
        """A `GrowingLayer` with `layer`'s state (its keys and values, if any)."""
        grown = cls()
        for name, value in vars(layer).items():
            setattr(grown, name, value)
        return grown

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if (
            self.get_seq_length() == 0
            or torch.is_grad_enabled()
            or torch.compiler.is_compiling()
            or not (fits_in_place(self.keys, key_states) and fits_in_place(self.values, value_states))
        ):
            return super().update(key_states, value_states, *args, **kwargs)
        key_buffer, keys = appended_in_place(self.key_buffer, self.keys, key_states)
        value_buffer, values = appended_in_place(self.value_buffer, self.values, value_states)
        # past `__setattr__`: the keys and values are the buffers' leading tokens
        self.__dict__.update(key_buffer=key_buffer, value_buffer=value_buffer, keys=keys, values=values)
        return keys, values


def appended_in_place(buffer: torch.Tensor | None, held: torch.Tensor, new: torch.Tensor):
    """`(buffer, its leading tokens)`: `held` (b, heads, n, head_dim), the leading tokens of `buffer` where it is one,
    followed by `new` (b, heads, m, head_dim) written in place after them. A buffer that cannot take them (none, too
    small, or made under `torch.inference_mode` and written outside it, as `DynamicLayer` then makes new tensors) is
    replaced by one with room for `max(128, (n + m) / 8)` more tokens, `held` copied in: the caller's states grow by
    copying their new tokens only."""
    seen, needed = held.shape[2], held.shape[2] + new.shape[2]
    if buffer is None or buffer.shape[2] < needed or (buffer.is_inference() and not torch.is_inference_mode_enabled()):
        buffer = held.new_empty(*held.shape[:2], needed + max(128, needed // 8), held.shape[3])
        buffer[:, :, :seen] = held
    buffer[:, :, seen:needed] = new
    return buffer, buffer[:, :, :needed]


def fits_in_place(cached: torch.Tensor, states: torch.Tensor) -> bool:
    """Whether `states` can be written into the cache's buffers as they are: same dtype, device, batch, heads and
    width."""
    return (
        cached.dtype == states.dtype
        and cached.device == states.device
        and cached.shape[:2] == states.shape[:2]
        and cached.shape[3] == states.shape[3]
    )


class MitigationState:
    """What one mitigation fixed at prefill for the decoding steps, kept on the `SepFormerCache` under its option's name
    (`SepFormerCache.mitigation_state`), with the batch operations the cache applies to it.

    By default every tensor attribute, and every tensor in a dict attribute, is per row and follows the rows along dim
    0 (beam search reorders them, several return sequences repeat them); a crop keeps them (they are per row, not per
    token). A `reset` of the cache drops the state. State of another shape (caches of its own) overrides the operations.
    """

    def map_rows(self, function: Callable[[torch.Tensor], torch.Tensor]) -> None:
        for name, value in vars(self).items():
            if isinstance(value, torch.Tensor):
                setattr(self, name, function(value))
            elif isinstance(value, dict):
                value.update({key: function(item) for key, item in value.items() if isinstance(item, torch.Tensor)})

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self.map_rows(lambda tensor: tensor.index_select(0, beam_idx.to(tensor.device)))

    def batch_repeat_interleave(self, repeats: int) -> None:
        self.map_rows(lambda tensor: tensor.repeat_interleave(repeats, dim=0))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self.map_rows(lambda tensor: tensor[indices])

    def crop(self, tokens_to_remove: int) -> None:
        """Per-row state stays."""


class SepFormerCache(DynamicCache):
    """A `DynamicCache` that also holds what a generation fixes at prefill and reuses at every decoding step.

    `forward` makes one when `use_cache=True` and no cache is given, and so does `generate`. The mitigations' state
    follows `generate`'s batch operations, so each beam or sequence keeps the state of the row it came from; a `reset`
    (or a crop of every token) drops it, for the next call is a prefill. What the decoding steps make from the weights
    (`derived`) is used until the cache is emptied or a new `generate` call continues it (`start_generation`); after
    the weights change otherwise, continue with a new cache or a `reset` one (docs/design.md, "What is kept").

    Fields:
        prefill_options: the options that fixed state at prefill, by keyword; a continued call must give the same.
        mitigation_state: what each mitigation fixed at prefill, by option name (a `MitigationState` each, made and read
            by its mitigation: MS-PoE's head ranks, calibration's `bias(k)` and spans).
        derived: tensors derived from the weights for this generation only (`derived_store`), by key: each layer's
            `FusedLayer` for decoding steps, MS-PoE's per-head weight layouts, a positional map's rows. Weights,
            not rows of the batch: batch operations leave them alone.
        row_copies: how many copies of each batch row the cache holds, side by side: several attention buckets keep
            one per bucket (batch operations act on the copies of the rows they name).
    """

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.layers = [
            GrowingLayer.from_layer(layer) if type(layer) is DynamicLayer else layer for layer in self.layers
        ]
        if self.layer_class_to_replicate is DynamicLayer:
            self.layer_class_to_replicate = GrowingLayer
        self.drop_prefill_state()

    def drop_prefill_state(self) -> None:
        """Forget what a prefill fixed and what the generation made from the weights: the next call on an empty cache is
        a prefill, which starts a new generation."""
        self.prefill_options: dict[str, Any] | None = None
        self.mitigation_state: dict[str, MitigationState] = {}
        self.derived: dict[Hashable, Any] = {}
        self.row_copies = 1

    def start_generation(self) -> None:
        """Drop what an earlier generation made from the weights, which may have changed since (or be another model's),
        keeping the keys, values and prefill state: a `generate` call that continues this cache starts here."""
        self.derived.clear()

    def rows_of(self, index: torch.Tensor) -> torch.Tensor:
        """The cache's rows of the batch rows `index`: each row's `row_copies` copies, which lie side by side."""
        copies = self.row_copies
        if copies == 1:
            return index
        index = torch.as_tensor(index)
        return (index[:, None] * copies + torch.arange(copies, device=index.device)).flatten()

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        beam_idx = self.rows_of(beam_idx)
        super().reorder_cache(beam_idx)
        for state in self.mitigation_state.values():
            state.reorder_cache(beam_idx)

    def batch_repeat_interleave(self, repeats: int) -> None:
        if self.row_copies > 1:  # each row's copies repeated together
            rows = self.layers[0].keys.shape[0] // self.row_copies
            return self.batch_select_indices(torch.arange(rows).repeat_interleave(repeats))
        super().batch_repeat_interleave(repeats)
        for state in self.mitigation_state.values():
            state.batch_repeat_interleave(repeats)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        indices = self.rows_of(indices)
        super().batch_select_indices(indices)
        for state in self.mitigation_state.values():
            state.batch_select_indices(indices)

    def crop(self, tokens_to_remove: int) -> None:
        """Drop the last tokens (the mitigations' state applies the crop its way). A crop that leaves no token is a
        `reset`."""
        super().crop(tokens_to_remove)
        for state in self.mitigation_state.values():
            state.crop(tokens_to_remove)
        if self.get_seq_length() == 0:
            self.reset()

    def reset(self) -> None:
        """Empty the cache and drop the state its prefill fixed (every mitigation's state, the row copies)."""
        super().reset()
        self.drop_prefill_state()
