"""Bytes autograd saves for backward, live and at peak: the activation memory an update holds.

Counted through ``torch.autograd.graph.saved_tensors_hooks``: each distinct storage once, freed
when the graph that saved it is freed, parameters excluded (they are resident whatever the
method). Deterministic, unlike RSS on a shared machine, so the memory benchmarks and the tests
that bound an update's memory measure the update engine with it.
"""

from __future__ import annotations

from typing import Callable

import torch


class SavedTensorMeter:
    """Live and peak bytes of autograd-saved tensors (deduplicated by storage, params excluded)."""

    def __init__(self, params: list[torch.nn.Parameter]) -> None:
        self.skip = {p.untyped_storage().data_ptr() for p in params}
        self.refs: dict[int, int] = {}
        self.sizes: dict[int, int] = {}
        self.live = self.peak = 0

    def _release(self, key: int) -> None:
        self.refs[key] -= 1
        if self.refs[key] == 0:
            self.live -= self.sizes.pop(key)
            del self.refs[key]

    def pack(self, t: torch.Tensor):
        storage = t.untyped_storage()
        key = storage.data_ptr()
        if key in self.skip or storage.nbytes() == 0:
            return t
        if key not in self.refs:
            self.refs[key], self.sizes[key] = 0, storage.nbytes()
            self.live += storage.nbytes()
            self.peak = max(self.peak, self.live)
        self.refs[key] += 1
        # a detached alias: holding ``t`` itself would tie an op's saved output to its own grad_fn
        # (a reference cycle), so graphs that are never backpropagated would never be freed
        return _Saved(t.detach(), key, self)

    @staticmethod
    def unpack(obj):
        return obj.tensor if isinstance(obj, _Saved) else obj

    def measure(self, fn: Callable[[], object]) -> int:
        with torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack):
            fn()
        return self.peak


class _Saved:
    """What the graph holds instead of the tensor: releases its bytes when the graph lets go."""

    __slots__ = ("tensor", "key", "meter")

    def __init__(self, tensor: torch.Tensor, key: int, meter: SavedTensorMeter) -> None:
        self.tensor, self.key, self.meter = tensor, key, meter

    def __del__(self) -> None:
        self.meter._release(self.key)
