"""Pillow's resize of 8-bit images, bit for bit, in torch on any device.

The references' processors resize with PIL; running that on the host costs a six-crop page ~80 ms
of CPU (two bicubic resizes of a 1240x1754 page), which bounds end-to-end throughput when the
GPU is fast. Pillow's 8-bit resampling is integer arithmetic once its coefficients are made, so
the same bytes can come out of a GPU:

- per output column (row), taps from ``int(center -/+ support + 0.5)`` clipped to the image,
  weights ``filter((x - center + 0.5) / filterscale)`` normalized by their sum, in float64, then
  fixed point with 22 fractional bits (rounded away from zero);
- two passes, each output ``clip((2**21 + sum(pixel * weight)) >> 22, 0, 255)`` in int32 and
  stored as uint8 in between: horizontal first (over the rows the vertical pass reads), except
  that Pillow 13 runs the vertical pass first when the height shrinks by more than twice what
  the width does (``vertical_first``, by the installed Pillow's version, so the bytes match the
  PIL this process would use).

Only the polynomial filters are here (bilinear, bicubic): their weights are IEEE float64
arithmetic every machine rounds alike, while Lanczos' and Hamming's go through libm's sin/cos,
which need not match Pillow's build. The coefficients are made once per (in, out, filter) on the
host and uploaded once per device without a host sync (``device_taps``); the passes are
``ksize`` gathered multiply-adds per axis on the image's device.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass
from functools import lru_cache

import numpy as np
import torch

from ..transfer import upload

PRECISION_BITS = 32 - 8 - 2
ROUNDING = 1 << (PRECISION_BITS - 1)      # added before the shift: round half up


def _pillow_orders_passes() -> bool:
    try:
        import PIL
        return int(PIL.__version__.split(".")[0]) >= 13
    except (ImportError, ValueError):
        return True                       # no Pillow to match: the newest behaviour


#: whether Pillow picks the pass order by the shrink (13.0 on); before, horizontal always first
PILLOW_ORDERS_PASSES = _pillow_orders_passes()


def vertical_first(in_w: int, in_h: int, w: int, h: int, ordered: bool | None = None) -> bool:
    """Pillow 13's order: the vertical pass first when the height shrinks by more than twice as
    many pixels as the width (the horizontal pass then has fewer rows). ``ordered``: whether
    that rule applies (default: the installed Pillow's)."""
    if ordered is None:
        ordered = PILLOW_ORDERS_PASSES
    return ordered and in_h - h > 0 and in_h - h > (in_w - w) * 2


class Filter(enum.Enum):
    BILINEAR = "bilinear"
    BICUBIC = "bicubic"

    @property
    def support(self) -> float:
        return {Filter.BILINEAR: 1.0, Filter.BICUBIC: 2.0}[self]

    def weights(self, x: np.ndarray) -> np.ndarray:
        """The filter at x (float64), in Pillow's operation order."""
        x = np.abs(x)
        if self is Filter.BILINEAR:
            return np.where(x < 1.0, 1.0 - x, 0.0)
        a = -0.5
        near = ((a + 2.0) * x - (a + 3.0)) * x * x + 1
        far = (((x - 5) * x + 8) * x - 4) * a
        return np.where(x < 1.0, near, np.where(x < 2.0, far, 0.0))


@dataclass(frozen=True)
class Taps:
    """One axis of a resize: output i reads input ``first[i] + j`` with weight ``weight[i, j]``
    (fixed point) for j < ksize (weights past an output's own taps are 0, their index clipped)."""
    first: np.ndarray           # int64 [out]
    count: np.ndarray           # int64 [out]: taps inside the image
    weight: np.ndarray          # int32 [out, ksize]

    @property
    def ksize(self) -> int:
        return self.weight.shape[1]

    @property
    def span(self) -> tuple[int, int]:
        """The input range [lo, hi) any output reads."""
        return int(self.first[0]), int(self.first[-1] + self.count[-1])


@lru_cache(maxsize=64)
def taps(in_size: int, out_size: int, filt: Filter) -> Taps:
    """Pillow's precompute_coeffs + normalize_coeffs_8bpc for the box (0, in_size)."""
    if in_size < 1 or out_size < 1:
        raise ValueError(f"resize sizes must be positive, got {in_size} -> {out_size}")
    scale = float(in_size) / out_size
    filterscale = max(scale, 1.0)
    support = filt.support * filterscale
    ksize = int(np.ceil(support)) * 2 + 1
    center = (np.arange(out_size, dtype=np.float64) + 0.5) * scale
    # C's (int) truncates toward zero; a negative start is clipped to 0 right after
    first = np.maximum(np.trunc(center - support + 0.5), 0).astype(np.int64)
    last = np.minimum(np.trunc(center + support + 0.5).astype(np.int64), in_size)
    count = last - first
    ss = 1.0 / filterscale
    j = np.arange(ksize, dtype=np.int64)
    inside = j[None, :] < count[:, None]
    w = np.where(inside, filt.weights(((first[:, None] + j[None, :]).astype(np.float64) - center[:, None] + 0.5) * ss),
                 0.0)
    total = np.zeros(out_size, dtype=np.float64)
    for c in range(ksize):                     # Pillow's running sum, in its order
        total = total + w[:, c]
    w = np.where(total[:, None] != 0.0, w / np.where(total == 0.0, 1.0, total)[:, None], w)
    one = float(1 << PRECISION_BITS)
    fixed = np.where(w < 0, np.trunc(-0.5 + w * one), np.trunc(0.5 + w * one)).astype(np.int32)
    return Taps(first, count, fixed)


@lru_cache(maxsize=256)
def device_taps(in_size: int, out_size: int, filt: Filter, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """taps() on ``device``: ``first`` int64 [out] and ``weight`` int32 [out, ksize], uploaded once
    without a host sync and shared by every image of the same geometry. A blocking upload per
    pass would wait for all the work queued on the device first (a running engine's steps): on
    CUDA a copy from pageable memory synchronizes the stream."""
    t = taps(in_size, out_size, filt)
    return upload(torch.from_numpy(t.first), device), upload(torch.from_numpy(t.weight), device)


def _pass(x: torch.Tensor, axis: int, in_size: int, out_size: int, filt: Filter, offset: int) -> torch.Tensor:
    """One axis of int32 pixels [H, W, C] through the taps of ``in_size -> out_size`` (input
    index shifted by ``offset``: x holds the rows from there on)."""
    n = x.shape[axis]
    first, weight = device_taps(in_size, out_size, filt, x.device)
    if offset:
        first = first - offset
    shape = [1, 1, 1]
    shape[axis] = -1
    acc = torch.full([out_size if a == axis else s for a, s in enumerate(x.shape)],
                     ROUNDING, dtype=torch.int32, device=x.device)
    for j in range(weight.shape[1]):
        idx = (first + j).clamp_(max=n - 1)
        acc += x.index_select(axis, idx) * weight[:, j].view(shape)
    return (acc >> PRECISION_BITS).clamp_(0, 255)


def peak_bytes(in_w: int, in_h: int, w: int, h: int, channels: int = 3) -> int:
    """An upper bound of the device bytes resize() holds at once besides its uint8 input: the
    image as int32, and in each pass its running sum, a gathered tap and its product (int32 of the
    pass's output size), then the shifted sum; the uint8 result."""
    out = w * h * channels
    if (w, h) == (in_w, in_h):
        return out
    px = 4 * channels
    first = (in_w * h) if vertical_first(in_w, in_h, w, h) else (w * in_h)
    return max(px * (in_w * in_h + 4 * first), px * (first + 4 * w * h)) + out


def resize(image: torch.Tensor, size: tuple[int, int], filt: Filter = Filter.BICUBIC) -> torch.Tensor:
    """uint8 [H, W, C] -> uint8 [h, w, C] for ``size`` = (w, h): ``Image.resize(size, filt)`` of
    the same pixels, on the image's device."""
    if image.dtype != torch.uint8 or image.ndim != 3:
        raise ValueError(f"resize takes uint8 [H, W, C] pixels, got {image.dtype} {list(image.shape)}")
    w, h = size
    in_h, in_w = image.shape[0], image.shape[1]
    if (w, h) == (in_w, in_h):
        return image.clone()
    x = image.to(torch.int32)
    if vertical_first(in_w, in_h, w, h):
        x = _pass(x, 0, in_h, h, filt, 0)
        return (_pass(x, 1, in_w, w, filt, 0) if w != in_w else x).to(torch.uint8)
    offset = 0
    if w != in_w:
        offset, hi = taps(in_h, h, filt).span if h != in_h else (0, in_h)
        x = _pass(x[offset:hi], 1, in_w, w, filt, 0)
    if h != in_h:
        x = _pass(x, 0, in_h, h, filt, offset)
    return x.to(torch.uint8)
