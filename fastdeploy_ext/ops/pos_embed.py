"""Bilinear resampling (align_corners=False) of the learned square position-embedding grid to
each image's (h, w) patch grid, plus the LFU cache the host path keeps per (h, w).

The resample is written as 4 gather taps with separable weights (the same formulation as
transformers 5.24), evaluated tap by tap with elementwise ops so that the result for a patch does
not depend on how many other patches share the call (bitwise-stable across batch shapes).
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable, Generic, Hashable, TypeVar

import torch


def axis_taps(index: torch.Tensor, size: torch.Tensor | int, side: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Two source taps and their weights along one axis for target positions ``index`` on an axis
    of ``size`` cells resampled from ``side`` cells (half-pixel centres, border clamp)."""
    src = (index.to(torch.float32) + 0.5) * side / size - 0.5
    floor = torch.floor(src)
    lo = floor.long()
    frac = src - floor
    taps = torch.stack([lo, lo + 1], dim=-1).clamp(0, side - 1)
    weights = torch.stack([1 - frac, frac], dim=-1)
    return taps, weights


def taps_and_weights(rows: torch.Tensor, cols: torch.Tensor, heights, widths, side: int):
    """Per patch: 4 flat indices into the [side*side, D] table and their 4 weights (fp32)."""
    h_taps, h_w = axis_taps(rows, heights, side)
    w_taps, w_w = axis_taps(cols, widths, side)
    idx = (h_taps[:, :, None] * side + w_taps[:, None, :]).reshape(-1, 4)
    wts = (h_w[:, :, None] * w_w[:, None, :]).reshape(-1, 4)
    return idx, wts


def resample(table: torch.Tensor, idx: torch.Tensor, wts: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """sum_t table[idx[:, t]] * wts[:, t], accumulated in fp32 tap by tap, cast to out_dtype."""
    acc = table[idx[:, 0]] * wts[:, 0:1]
    for t in range(1, idx.shape[1]):
        acc = acc + table[idx[:, t]] * wts[:, t:t + 1]
    return acc.to(out_dtype)


K = TypeVar("K", bound=Hashable)
V = TypeVar("V")


@dataclass
class CacheStats:
    hits: int = 0
    misses: int = 0
    evictions: int = 0


class LFUCache(Generic[K, V]):
    """Least-frequently-used cache; ties broken by least recent use. Document pipelines see a
    handful of page sizes over and over, so frequency is the right signal."""

    def __init__(self, capacity: int):
        if capacity < 0:
            raise ValueError(f"cache capacity must be >= 0, got {capacity}")
        self.capacity = capacity
        self._data: OrderedDict[K, tuple[V, int]] = OrderedDict()
        self.stats = CacheStats()

    def get_or_create(self, key: K, create: Callable[[], V]) -> V:
        if key in self._data:
            value, freq = self._data.pop(key)
            self._data[key] = (value, freq + 1)
            self.stats.hits += 1
            return value
        self.stats.misses += 1
        value = create()
        if self.capacity == 0:
            return value
        if len(self._data) >= self.capacity:
            victim = min(self._data, key=lambda k: self._data[k][1])  # first = least recent among ties
            del self._data[victim]
            self.stats.evictions += 1
        self._data[key] = (value, 1)
        return value

    def __len__(self) -> int:
        return len(self._data)

    def __contains__(self, key: K) -> bool:
        return key in self._data
