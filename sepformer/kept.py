"""What is kept beyond one call, and for how long (docs/design.md, "What is kept, and for how long").

Tensors derived from the weights are kept on the cache of one generation only (`derived_store`, `kept_in`); constants
that depend on shapes and options only are made once per set of arguments and shared (`cached_constant`).
"""

import functools
from collections.abc import Callable, Hashable
from typing import Any

import torch

from .cache_sepformer import SepFormerCache


def derived_store(cache) -> dict | None:
    """Where a call may keep tensors derived from the weights (rows of a positional map, weights laid out for the
    decoding steps): the `SepFormerCache` of its generation, outside autograd and `torch.compile`; `None` otherwise.
    Nothing else is kept: fused optimizers and writes through `.data` change weights without moving their version
    counters or addresses, so nothing could tell whether a tensor kept across calls is still current."""
    if isinstance(cache, SepFormerCache) and not torch.is_grad_enabled() and not torch.compiler.is_compiling():
        return cache.derived
    return None


def kept_in(store: dict | None, key: Hashable, make: Callable, rows: int | None = None) -> Any:
    """`make()`, kept in `store[key]` when a store is given (`derived_store`): made once per generation.

    With `rows`, `make(rows)` makes rows `0 .. rows - 1` of something, and rows kept earlier serve while they are at
    least as many: a generation's decoding steps make them once per doubling."""
    made = make if rows is None else functools.partial(make, rows)
    if store is None:
        return made()
    if key not in store or (rows is not None and store[key].shape[0] < rows):
        store[key] = made()
    return store[key]


def cached_constant(maxsize: int):
    """`functools.lru_cache` for functions that build constant tensors from hashable arguments.

    Built outside inference mode: a first call under `torch.inference_mode()` would otherwise cache inference tensors,
    which autograd refuses to save in a later training step. Under `torch.compile` the function is traced instead
    (dynamo does not go through an lru_cache).
    """

    def decorate(build):
        @functools.lru_cache(maxsize=maxsize)
        def cached(*args):
            with torch.inference_mode(False):
                return build(*args)

        @functools.wraps(build)
        def constant(*args):
            return build(*args) if torch.compiler.is_compiling() else cached(*args)

        return constant

    return decorate
