"""`SepFormerCache`: the KV cache, plus what a generation fixes at prefill and reuses at every decoding step."""

from collections.abc import Callable
from typing import Any

import torch
from transformers.cache_utils import DynamicCache


class SepFormerCache(DynamicCache):
    """A `DynamicCache` that also holds the generation's mitigation state and fused decoding projections.

    `forward` makes one when `use_cache=True` and no cache is given, and so does `generate`. The per-row state follows
    the batch through `generate`'s batch operations (beam search reorders it, several return sequences repeat it),
    so each beam or sequence keeps the state of the row it came from.

    Fields:
        prefill_options: the options that fixed state at prefill, by keyword; a continued call must give the same.
        ms_poe_ranks: per MS-PoE layer, (b, H, 1, 1) head ranks from the prefill's last query (0 = most position-aware).
        calibration_bias: per calibrated layer, (b, H, K) `bias(k)`, the attention on a dummy document at slot `k`.
        calibration_spans: (b, K, 2) each row's document spans, counted from its first real token.
        fused_projections: per layer, the `FusedProjections` of its decoding steps (`None`: the layer runs its
            modules). Weights, not rows: batch operations leave them alone; the bucket caches share this one.
        ms_poe_weights: per MS-PoE layer, its `W_q`, `W_k` positional columns laid out per head (versions, tensor),
            likewise weights; remade when a weight changes in place or moves (not on writes through `.data`).
        buckets: the `attention_buckets` options of a generation with several buckets; this cache is bucket 0's.
        bucket_caches: the caches of buckets 1.., each a `SepFormerCache`; batch operations apply to them too.
        running_buckets: whether a forward with several buckets is running them (bucket 0's own pass then reads this
            cache with its one bucket, which a caller may not do).
    """

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.prefill_options: dict[str, Any] | None = None
        self.ms_poe_ranks: dict[int, torch.Tensor] = {}
        self.calibration_bias: dict[int, torch.Tensor] = {}
        self.calibration_spans: torch.Tensor | None = None
        self.fused_projections: dict[int, Any] = {}
        self.ms_poe_weights: dict[int, Any] = {}
        self.buckets: Any = None
        self.bucket_caches: list[SepFormerCache] = []
        self.running_buckets = False

    def map_rows(self, function: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """Apply a batch operation to every per-row tensor of the state."""
        for per_layer in (self.ms_poe_ranks, self.calibration_bias):
            for layer, tensor in per_layer.items():
                per_layer[layer] = function(tensor)
        if self.calibration_spans is not None:
            self.calibration_spans = function(self.calibration_spans)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        super().reorder_cache(beam_idx)
        self.map_rows(lambda tensor: tensor.index_select(0, beam_idx.to(tensor.device)))
        for bucket_cache in self.bucket_caches:
            bucket_cache.reorder_cache(beam_idx)

    def batch_repeat_interleave(self, repeats: int) -> None:
        super().batch_repeat_interleave(repeats)
        self.map_rows(lambda tensor: tensor.repeat_interleave(repeats, dim=0))
        for bucket_cache in self.bucket_caches:
            bucket_cache.batch_repeat_interleave(repeats)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        super().batch_select_indices(indices)
        self.map_rows(lambda tensor: tensor[indices])
        for bucket_cache in self.bucket_caches:
            bucket_cache.batch_select_indices(indices)

    def crop(self, tokens_to_remove: int) -> None:
        super().crop(tokens_to_remove)
        for bucket_cache in self.bucket_caches:
            bucket_cache.crop(tokens_to_remove)

    def reset(self) -> None:
        super().reset()
        for bucket_cache in self.bucket_caches:
            bucket_cache.reset()
