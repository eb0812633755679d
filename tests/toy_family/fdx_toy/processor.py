"""toy_vlm's image preprocessor: decode (fastdeploy_ext/inputs: the framework's input hygiene),
resize every image to image_size x image_size (PIL bilinear), scale to [-1, 1] and cut into
patches in raster order: [patches_per_image, C, P, P] float32, grid (1, side, side)."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from PIL import Image

from fastdeploy_ext.inputs.images import ImageInputError, load_image, source_name

from .config import ToyConfig


@dataclass
class ProcessedImage:
    pixel_values: torch.Tensor               # float32 [patches_per_image, C, P, P]
    grid_thw: tuple[int, int, int]
    source: str
    original_size: tuple[int, int]           # (height, width) decoded
    resized_size: tuple[int, int]

    @property
    def num_patches(self) -> int:
        return self.pixel_values.shape[0]


class ToyImageProcessor:
    def __init__(self, cfg: ToyConfig):
        self.cfg = cfg

    def preprocess(self, src, name: str | None = None, *, max_patches: int | None = None) -> ProcessedImage:
        """``max_patches``: refuse a request whose budget cannot hold even one image (every image
        has the same patch count)."""
        c = self.cfg
        label = source_name(src, name)
        if max_patches is not None and c.patches_per_image > max_patches:
            raise ImageInputError(f"{label}: a toy_vlm image has {c.patches_per_image} patches, more than the "
                                  f"limit of {max_patches}")
        img = load_image(src, name)
        size = (img.height, img.width)
        arr = np.asarray(img.resize((c.image_size, c.image_size), Image.BILINEAR), dtype=np.float32)
        x = torch.from_numpy((arr / 255.0 - 0.5) / 0.5)                      # [H, W, C]
        s, p = c.grid_side, c.patch_size
        patches = x.view(s, p, s, p, c.num_channels).permute(0, 2, 4, 1, 3).reshape(s * s, c.num_channels, p, p)
        return ProcessedImage(patches.contiguous(), c.grid, label, size, (c.image_size, c.image_size))
