"""DeepSeek-OCR-2's image preprocessor (host side): a global view and, for a large image, local crops.

- Global view: the image fit into ``base_size`` (1024) by its longer side (PIL bicubic, sizes
  rounded as Python's ``round``), padded to a square with (127, 127, 127), centred.
- Crops, only when max(h, w) > ``tile_size`` (768): the tiling of ``min_crops``..``max_crops``
  tiles (cols x rows) whose aspect ratio is closest to the image's (a tie goes to more tiles
  while the image's area exceeds half the tiles'), the image resized to it (bicubic) and cut in
  raster order.
- Every view: uint8 -> x / 255 (float64, then float32) -> (x - 0.5) / 0.5, as transformers' PIL
  processor does. The value depends on the byte alone, so the processor hands out the patches
  as bytes (``pixel_values`` uint8) and the tower maps them through a 256-entry table of that
  formula made on its device (``to_model_pixels``; bitwise transformers' on all 256 bytes,
  tested on CPU and CUDA): the host cuts and moves bytes, and a six-crop page uploads 4.4 MB
  instead of 17.6.

With a ``device`` (``on_device``), the same bytes are made there: the decoded page is uploaded
once and resized by ``inputs.resample`` (Pillow's integer arithmetic, bit for bit), cut and
padded on the device; the host only decodes (~20 ms of a six-crop page's ~110 ms of CPU).

The engine packs images by concatenating their ``pixel_values`` along dim 0, and views of two
sizes cannot be stacked, so each view is cut into its 16x16 patches (channel-major, raster
order): an image is ``[crops * (768/16)^2 + (1024/16)^2, 3, 16, 16]``, the crops first, then the
global view (the order of its embedding rows). SAM's patch embedding is a stride-16 conv, i.e.
one matmul over these patches.

An image's grid is ``(views, rows, cols)``: views = 1 + crops, and the tiling (1, 1) when there
are no crops. ``num_crops(grid)`` reads it back.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from functools import lru_cache

import numpy as np
import torch
from PIL import Image

from ...inputs import resample
from ...transfer import upload
from ...inputs.images import ImageInputError, load_image, source_name
from .config import DeepseekOCR2Config

log = logging.getLogger(__name__)

BACKGROUND = (127, 127, 127)
#: the page size the engine reserves device memory for per preprocessing worker (A4 at 200 dpi)
RESERVE_PAGE = (1654, 2339)
RESCALE = 1 / 255


def normalize_reference(u: np.ndarray) -> np.ndarray:
    """transformers' PIL processor on uint8: rescale in float64, cast, normalize in float32."""
    x = (u.astype(np.float64) * RESCALE).astype(np.float32)
    return (x - np.float32(0.5)) / np.float32(0.5)


def to_model_pixels(pixel_values: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Patches in the model's dtype, wherever they are: bytes (the processor's) through a
    256-entry table of transformers' formula made on the same device (float64 rescale, float32
    normalize: IEEE operations every device rounds alike; a float32 division by 255 would not
    be, CUDA's divides by a scalar as a multiplication by its reciprocal), floating-point pixels
    (already normalized: transformers' tensors) cast."""
    if pixel_values.dtype != torch.uint8:
        return pixel_values.to(dtype)
    table = torch.arange(256, dtype=torch.float64, device=pixel_values.device).mul_(RESCALE).to(torch.float32)
    table = table.sub_(0.5).div_(0.5).to(dtype)
    return table.index_select(0, pixel_values.reshape(-1).to(torch.int32)).view(pixel_values.shape)


def num_crops(grid) -> int:
    return int(grid[0]) - 1


@lru_cache(maxsize=16)
def tilings(min_crops: int, max_crops: int) -> tuple[tuple[int, int], ...]:
    """(cols, rows) with min <= cols*rows <= max, by tile count (cols-major within a count)."""
    out = [(c, r) for c in range(1, max_crops + 1) for r in range(1, max_crops + 1) if min_crops <= c * r <= max_crops]
    return tuple(sorted(out, key=lambda g: g[0] * g[1]))


def best_tiling(width: int, height: int, tile: int, min_crops: int, max_crops: int) -> tuple[int, int]:
    """(cols, rows) of the tiling closest to the image's aspect ratio."""
    ratio, area = width / height, width * height
    best, best_diff = (1, 1), float("inf")
    for cols, rows in tilings(min_crops, max_crops):
        diff = abs(ratio - cols / rows)
        if diff < best_diff:
            best, best_diff = (cols, rows), diff
        elif diff == best_diff and area > 0.5 * tile * tile * cols * rows:
            best = (cols, rows)
    return best


@dataclass
class ProcessedImage:
    pixel_values: torch.Tensor               # uint8 [patches, 3, 16, 16]: crops (raster), then the global view
    grid_thw: tuple[int, int, int]           # (1 + crops, rows, cols)
    source: str
    original_size: tuple[int, int]           # (height, width) decoded

    @property
    def num_crops(self) -> int:
        return num_crops(self.grid_thw)

    @property
    def num_patches(self) -> int:
        return self.pixel_values.shape[0]


class DeepseekOCR2ImageProcessor:
    """``device``: None makes the views on the host with PIL; a torch device makes the same
    bytes there (see the module docstring) and hands out pixel_values on it."""

    def __init__(self, cfg: DeepseekOCR2Config | None = None, device: torch.device | str | None = None):
        self.cfg = cfg or DeepseekOCR2Config()
        self.device = None if device is None else torch.device(device)

    def on_device(self, device: torch.device | str | None) -> "DeepseekOCR2ImageProcessor":
        """This processor making its views on ``device`` (None: on the host)."""
        return type(self)(self.cfg, device)

    # ---------------------------------------------------------------- geometry
    def grid_for(self, width: int, height: int) -> tuple[int, int, int]:
        """(1 + crops, rows, cols); (1, 1, 1) when the image needs no crops."""
        c = self.cfg
        if max(width, height) <= c.tile_size:
            return (1, 1, 1)
        cols, rows = best_tiling(width, height, c.tile_size, c.min_crops, c.max_crops)
        return (1 + cols * rows, rows, cols)

    def cost(self, grid) -> int:
        """Input patches of an image of this grid (the encoder budget's unit)."""
        return self.cfg.image_patches(num_crops(grid))

    def device_working_bytes(self, width: int = RESERVE_PAGE[0], height: int = RESERVE_PAGE[1]) -> int:
        """Device bytes one page of ``width`` x ``height`` takes while its views are made there:
        the uploaded page, the larger of its two resizes' working sets (``resample.peak_bytes``),
        its views and their packed patches. The default page is an A4 scan at 200 dpi: what the
        engine keeps free per preprocessing worker beside the KV pool (a larger page that finds
        no room is made on the host)."""
        c = self.cfg
        tiles, fit = self.resize_sizes(width, height)
        crops = num_crops(self.grid_for(width, height))
        views = 3 * (crops * c.tile_size ** 2 + c.base_size ** 2)
        resizing = max(resample.peak_bytes(width, height, w, h) for w, h in (tiles, fit) if w)
        return 3 * width * height + resizing + 2 * views

    def resize_sizes(self, width: int, height: int) -> tuple[tuple[int, int], tuple[int, int]]:
        """The two resizes a page's views come from, each (w, h): the crops' tiling ((0, 0)
        without crops) and the global view's fit into ``base_size`` (sizes rounded as Python's
        ``round``)."""
        c = self.cfg
        grid = self.grid_for(width, height)
        tiles = (c.tile_size * grid[2], c.tile_size * grid[1]) if num_crops(grid) else (0, 0)
        scale = c.base_size / max(width, height)
        return tiles, (round(width * scale), round(height * scale))

    # ---------------------------------------------------------------- pixels
    def views(self, img: Image.Image) -> tuple[list, tuple[int, int, int]]:
        """uint8 [H, W, 3] views, the crops in raster order then the padded global view: numpy
        arrays on the host, tensors on ``device``."""
        c = self.cfg
        w, h = img.size
        grid = self.grid_for(w, h)
        if self.device is None:
            def resized(size):
                return np.asarray(img.resize(size, Image.BICUBIC))

            def canvas(side):
                return np.full((side, side, 3), BACKGROUND, dtype=np.uint8)
        else:
            # queued without a host sync (pinned, then non-blocking): a blocking upload would wait
            # for everything already queued on the device, a running engine's steps included
            page = upload(torch.from_numpy(np.array(img)), self.device)

            def resized(size):
                return resample.resize(page, size, resample.Filter.BICUBIC)

            def canvas(side):
                out = torch.empty((side, side, 3), dtype=torch.uint8, device=self.device)
                for channel, v in enumerate(BACKGROUND):
                    out[..., channel] = v      # a fill, not an upload of the colour
                return out
        out = []
        tiles, (nw, nh) = self.resize_sizes(w, h)
        if num_crops(grid):
            rows, cols = grid[1], grid[2]
            t = c.tile_size
            big = resized(tiles)
            out.extend(big[r * t:(r + 1) * t, q * t:(q + 1) * t] for r in range(rows) for q in range(cols))
        small = resized((nw, nh))
        side = max(nw, nh)
        glob = canvas(side)
        if nw > nh:
            top = (side - nh) // 2
            glob[top:top + nh] = small
        else:
            left = (side - nw) // 2
            glob[:, left:left + nw] = small
        out.append(glob)
        return out, grid

    def patches(self, view) -> torch.Tensor:
        """uint8 [S, S, 3] -> uint8 [(S/16)^2, 3, 16, 16] (normalized by ``to_model_pixels``)."""
        return self.pixel_values([view])

    def pixel_values(self, views: list) -> torch.Tensor:
        """The views' patches as bytes, one view after another (cut and packed channel-major),
        where the views are (numpy: the host)."""
        p = self.cfg.sam.patch_size
        if views and isinstance(views[0], torch.Tensor):
            return torch.cat([v.reshape(v.shape[0] // p, p, v.shape[1] // p, p, 3).permute(0, 2, 4, 1, 3)
                              .reshape(-1, 3, p, p) for v in views])
        sizes = [(v.shape[0] // p) ** 2 for v in views]
        packed = np.empty((sum(sizes), 3, p, p), dtype=np.uint8)
        start = 0
        for v, n in zip(views, sizes):
            s = v.shape[0] // p
            packed[start:start + n].reshape(s, s, 3, p, p)[...] = v.reshape(s, p, s, p, 3).transpose(0, 2, 4, 1, 3)
            start += n
        return torch.from_numpy(packed)

    def preprocess(self, src, name: str | None = None, *, max_patches: int | None = None) -> ProcessedImage:
        """``max_patches``: refuse an image whose views hold more input patches than that (its
        size is known from the header, before it is decoded)."""
        label = source_name(src, name)

        def size_check(lb, w, h):
            if max_patches is not None:
                cost = self.cost(self.grid_for(w, h))
                if cost > max_patches:
                    raise ImageInputError(lb, f"{w}x{h} pixels make {cost} input patches (a global view and "
                                          f"{num_crops(self.grid_for(w, h))} crops), more than the limit of "
                                          f"{max_patches}", "send a smaller image")

        img = load_image(src, name, size_check=size_check)
        try:
            views, grid = self.views(img)
        except torch.OutOfMemoryError:
            if self.device is None:
                raise
            # the device is full (pages queued ahead of their vision pass hold their views
            # there): this page is made on the host, the same bytes, and uploaded at its pass
            log.warning("%s: no device memory for its views on %s; made on the host", label, self.device)
            views, grid = self.on_device(None).views(img)
        return ProcessedImage(self.pixel_values(views), grid, label, (img.height, img.width))

    def unpatch(self, pixel_values: torch.Tensor, grid) -> tuple[list[torch.Tensor], torch.Tensor]:
        """One image's patches back to normalized float32 views [3, S, S] (crops, global): what
        transformers' processor returns as pixel_values_local / pixel_values (tests compare)."""
        p = self.cfg.sam.patch_size
        n = num_crops(grid)
        sizes = [self.cfg.patches(self.cfg.tile_size)] * n + [self.cfg.patches(self.cfg.base_size)]
        pixel_values = to_model_pixels(pixel_values, torch.float32)

        def view(x):
            s = int(round(x.shape[0] ** 0.5))
            return x.view(s, s, 3, p, p).permute(2, 0, 3, 1, 4).reshape(3, s * p, s * p)
        parts = [view(x) for x in pixel_values.split(sizes)]
        return parts[:-1], parts[-1]
