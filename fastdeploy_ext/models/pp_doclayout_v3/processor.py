"""Host-side preprocessing for PP-DocLayoutV3: every page resized to one fixed size (800x800 by
default) the way transformers' processor does through torchvision's uint8 path: the uint8
image as float32, ``F.interpolate`` bicubic (align_corners=False, antialias=False), rounded and
clamped to [0, 255], then /255 (mean 0, std 1: no normalization)."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np
import torch
import torch.nn.functional as F

from ..interface import CheckpointError


@dataclass(frozen=True)
class DetectorPreprocessorConfig:
    height: int = 800
    width: int = 800
    rescale_factor: float = 1 / 255
    source: str = "built-in"

    @classmethod
    def from_model_dir(cls, model_dir: str | None) -> "DetectorPreprocessorConfig":
        if model_dir is None:
            return cls()
        path = Path(model_dir) / "preprocessor_config.json"
        if not path.exists():
            return cls(source=f"built-in ({path.name} absent)")
        try:
            d = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise CheckpointError(f"{path}: not valid JSON ({e})") from None
        size = d.get("size") or {}
        try:
            h, w = int(size.get("height", 800)), int(size.get("width", 800))
        except (TypeError, ValueError):
            raise CheckpointError(f"{path}: size.height/size.width must be integers") from None
        mean, std = d.get("image_mean", [0, 0, 0]), d.get("image_std", [1, 1, 1])
        if any(float(m) != 0 for m in mean) or any(float(s) != 1 for s in std):
            raise CheckpointError(f"{path}: image_mean/image_std other than 0/1 are not supported")
        return cls(h, w, float(d.get("rescale_factor", 1 / 255)), source=str(path))


def resize_uint8(image: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """[3, h, w] or [B, 3, h, w] uint8 -> float32 in [0, 255], integer-valued: bicubic without
    antialias, rounded and clamped (what torchvision's uint8 resize returns, as float)."""
    if image.dtype != torch.uint8:
        raise ValueError(f"expected a uint8 image, got {image.dtype}")
    x = image[None] if image.ndim == 3 else image
    if tuple(x.shape[-2:]) != (height, width):
        x = F.interpolate(x.float(), size=(height, width), mode="bicubic", align_corners=False, antialias=False)
        x = x.round().clamp(0, 255)
    else:
        x = x.float()
    return x if image.ndim == 4 else x[0]


class DetectorImageProcessor:
    def __init__(self, cfg: DetectorPreprocessorConfig):
        self.cfg = cfg

    def to_uint8(self, src) -> torch.Tensor:
        """An image path, encoded bytes, PIL image, HWC uint8 array or CHW uint8 tensor -> [3, h, w]
        uint8 RGB."""
        if isinstance(src, torch.Tensor):
            t = src
        elif isinstance(src, np.ndarray):
            if src.ndim != 3 or src.shape[2] != 3:
                raise ValueError(f"an image array must be [h, w, 3], got {list(src.shape)}")
            t = torch.from_numpy(np.ascontiguousarray(src)).permute(2, 0, 1)
        else:
            from ...inputs.images import load_image
            img = load_image(src)       # input hygiene (decode caps, EXIF) shared with the VLM path
            t = torch.from_numpy(np.asarray(img.convert("RGB"), dtype=np.uint8).copy()).permute(2, 0, 1)
        if t.dtype != torch.uint8 or t.ndim != 3 or t.shape[0] != 3:
            raise ValueError(f"an image tensor must be uint8 [3, h, w], got {t.dtype} {list(t.shape)}")
        return t

    def preprocess(self, images: Sequence) -> tuple[torch.Tensor, list[tuple[int, int]]]:
        """(pixel_values [B, 3, H, W] float32 in [0, 1], each page's (height, width))."""
        if not images:
            raise ValueError("no images to preprocess")
        c = self.cfg
        sizes, out = [], []
        for src in images:
            t = self.to_uint8(src)
            sizes.append((int(t.shape[1]), int(t.shape[2])))
            out.append(resize_uint8(t, c.height, c.width) * c.rescale_factor)
        return torch.stack(out), sizes
