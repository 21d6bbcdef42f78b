"""FP8 weight cache: quantise each weight once per optimizer step, not once per micro-batch.

With gradient accumulation the weights stay the same through all micro-batches of a step, yet
every FP8 GEMM would quantise its weight again (128x128 blocks; for the routed experts of the
DeepSeek-like model 1.66B parameters, forward and dgrad layouts: ~6 ms per micro-batch on an
H100). The cache keeps each layout's (q, scale) until the weights change.

Validity, without trusting object identity (compiled graphs may hand the ops aliases of a
parameter): `track(params)` registers the trainer's parameters; a tensor is cached only when it
has the data pointer and dtype of a live tracked parameter and either its shape and strides or,
both contiguous, its number of elements (then it is that parameter's storage, viewed the same
way or reshaped whole, as the experts' w13 [E, dim, 2, hidden] runs as [E, dim, 2 x hidden];
entries are per shape), and an entry is used only while that parameter's version counter is
unchanged. Writes through `.data` do not bump the counter, so the owner of the weight update
(data parallelism's `gather_params`) calls `clear()` after each one.

One cache per model (core.train.parallelize makes it when the precision plan keeps FP8
weights): its FP8 layers hold it and hand the FP8 custom ops its `handle`, the number
`cache_of` turns back into the cache inside the op.
"""

from __future__ import annotations

import itertools
import weakref
from typing import Callable, Iterable

import torch
from torch import Tensor

Quantiser = Callable[[Tensor, bool], tuple[Tensor, Tensor]]


# Custom ops take tensors and numbers, not Python objects: a cache reaches the ops as a number.
# This table holds no run's state, only which live cache a number names (weakly: a dropped
# model's cache goes with it); 0 names none.
_LIVE: weakref.WeakValueDictionary[int, "Fp8WeightCache"] = weakref.WeakValueDictionary()
_HANDLES = itertools.count(1)


def cache_of(handle: int) -> "Fp8WeightCache | None":
    """The live cache of `handle` (an `Fp8WeightCache.handle`), or None for 0 or a dropped one."""
    return _LIVE.get(handle) if handle else None


class Fp8WeightCache:
    """The quantised weights of one model's tracked parameters (module docstring)."""

    def __init__(self) -> None:
        self.handle = next(_HANDLES)
        _LIVE[self.handle] = self
        self._params: list[weakref.ref] = []
        self._by_ptr: dict[int, weakref.ref] = {}
        self._entries: dict[tuple[int, tuple[int, ...], bool], tuple[int, tuple[Tensor, Tensor]]] = {}
        self.stats = {"hits": 0, "misses": 0}

    @property
    def enabled(self) -> bool:
        return bool(self._params)

    def track(self, params: Iterable[Tensor]) -> None:
        """Cache these parameters' quantisations from now on (an empty list turns caching off)."""
        self._params = [weakref.ref(p) for p in params]
        self.clear()

    def clear(self) -> None:
        """Drop every entry: call after the weights were written in a way the version counter
        does not see (an optimizer step through `.data`, a checkpoint load)."""
        self._entries.clear()
        self._by_ptr = {p.data_ptr(): ref for ref in self._params if (p := ref()) is not None}

    def _owner(self, w: Tensor) -> Tensor | None:
        ref = self._by_ptr.get(w.data_ptr())
        param = ref() if ref is not None else None
        if param is None or param.data_ptr() != w.data_ptr() or param.dtype != w.dtype:
            return None
        same_view = param.shape == w.shape and param.stride() == w.stride()
        reshaped = param.is_contiguous() and w.is_contiguous() and param.numel() == w.numel()
        return param if same_view or reshaped else None

    def quantize(self, w: Tensor, transpose: bool, quantiser: Quantiser) -> tuple[Tensor, Tensor]:
        """quantiser(w, transpose), from the cache when w is a tracked parameter not written since."""
        param = self._owner(w) if self._by_ptr and not torch.compiler.is_compiling() else None
        if param is None:
            return quantiser(w, transpose)
        key = (w.data_ptr(), tuple(w.shape), transpose)
        entry = self._entries.get(key)
        if entry is not None and entry[0] == param._version:
            self.stats["hits"] += 1
            return entry[1]
        self.stats["misses"] += 1
        result = quantiser(w, transpose)
        self._entries[key] = (param._version, result)
        return result

    def cached_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for _, pair in self._entries.values() for t in pair)

    def __deepcopy__(self, memo) -> "Fp8WeightCache":
        # A copied model has parameters of its own: it starts with a cache of its own, empty.
        return Fp8WeightCache()
