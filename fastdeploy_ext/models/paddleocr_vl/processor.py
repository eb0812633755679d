"""PaddleOCR-VL image preprocessor.

Matches transformers' ``PaddleOCRVLImageProcessorPil`` (transformers 5.24) bit for bit:

1. convert to RGB (images with an alpha band or a ``transparency`` entry are composited onto
   white first, exactly like transformers' ``convert_to_rgb``),
2. ``smart_resize`` to multiples of ``factor = patch_size * merge_size`` (28) with a PIL resize
   (BICUBIC by default) of the uint8 RGB image,
3. rescale: ``float32(float64(v) * rescale_factor)``,
4. normalize: ``(x - mean) / std`` in float32 (mean/std cast to float32 first),
5. patchify into ``[grid_h * grid_w, 3 * temporal_patch_size, patch, patch]`` in raster order
   (row-major over the patch grid), ``grid_thw = (1, grid_h, grid_w)``.

Steps 3 and 4 only ever see uint8 inputs: ``pixel_map.PixelMapper`` evaluates them once per
channel for the 256 possible values (the very same numpy operations and dtypes as transformers)
and maps the image with a cheaper float32 recipe that reproduces that table bit for bit (checked
when the processor is built), patch row by patch row so the work stays in cache. The image is
resized once and patchified through strided views; no per-pixel Python.

Thread safety: ``ImageProcessor`` holds no mutable state after construction; ``preprocess`` may
be called from several threads at once (PIL's resize and numpy's loops release the GIL), which
is what ``preprocess_pool.PreprocessPool`` does.

Input hygiene is fastdeploy_ext/inputs/images.py's (missing, empty, corrupt or truncated files,
the decode cap before decoding, data: URLs); this module adds the model's own size rule (an
absurd aspect ratio, via smart_resize) before decoding, and the pixel math.

This module does not import transformers (it is only a test-time reference).
"""
from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image

from ... import envs
from ...inputs.images import DEFAULT_MAX_IMAGE_PIXELS, MAX_IMAGE_PIXELS_ENV, ImageInputError, ImageSource
from ...inputs.images import load_image as _load_image
from ...inputs.images import source_name as _source_name
from .pixel_map import PixelMapper

logger = logging.getLogger(__name__)

OPENAI_CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
OPENAI_CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
DEFAULT_MIN_PIXELS = 384 * 384
DEFAULT_MAX_PIXELS = 1536 * 1536
MAX_ASPECT_RATIO = 200
PREPROCESSOR_CONFIG_NAME = "preprocessor_config.json"



# --------------------------------------------------------------------------------------------
# config
# --------------------------------------------------------------------------------------------

def _positive_int(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != int(value) or value <= 0:
        raise ValueError(f"preprocessor config: {name} must be a positive integer, got {value!r}")
    return int(value)


def _triple(name: str, value: Any) -> tuple[float, float, float]:
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        value = [value] * 3
    try:
        vals = tuple(float(v) for v in value)
    except (TypeError, ValueError):
        raise ValueError(f"preprocessor config: {name} must be 3 numbers (one per RGB channel), got {value!r}") from None
    if len(vals) != 3:
        raise ValueError(f"preprocessor config: {name} must have 3 values (one per RGB channel), got {len(vals)}: {value!r}")
    if not all(math.isfinite(v) for v in vals):
        raise ValueError(f"preprocessor config: {name} must be finite, got {value!r}")
    return vals  # type: ignore[return-value]


@dataclass(frozen=True)
class PreprocessorConfig:
    min_pixels: int = DEFAULT_MIN_PIXELS
    max_pixels: int = DEFAULT_MAX_PIXELS
    patch_size: int = 14
    merge_size: int = 2
    temporal_patch_size: int = 1
    image_mean: tuple[float, float, float] = OPENAI_CLIP_MEAN
    image_std: tuple[float, float, float] = OPENAI_CLIP_STD
    rescale_factor: float = 1 / 255
    do_rescale: bool = True
    do_normalize: bool = True
    do_convert_rgb: bool = True
    resample: int = int(Image.Resampling.BICUBIC)
    #: decode cap on width*height read from the header; default from FD_MAX_IMAGE_PIXELS.
    max_image_pixels: int = field(default_factory=envs.FD_MAX_IMAGE_PIXELS.get)
    #: where the values came from: a preprocessor_config.json path, "dict" or "defaults".
    source: str = field(default="defaults", compare=False)

    def __post_init__(self) -> None:
        for name in ("min_pixels", "max_pixels", "patch_size", "merge_size", "temporal_patch_size",
                     "max_image_pixels"):
            object.__setattr__(self, name, _positive_int(name, getattr(self, name)))
        if self.min_pixels > self.max_pixels:
            raise ValueError(
                f"preprocessor config: min_pixels ({self.min_pixels}) must be <= max_pixels ({self.max_pixels})")
        object.__setattr__(self, "image_mean", _triple("image_mean", self.image_mean))
        object.__setattr__(self, "image_std", _triple("image_std", self.image_std))
        if any(s == 0 for s in self.image_std):
            raise ValueError(f"preprocessor config: image_std must be non-zero, got {self.image_std}")
        rf = self.rescale_factor
        if isinstance(rf, bool) or not isinstance(rf, (int, float)) or not math.isfinite(rf) or rf <= 0:
            raise ValueError(f"preprocessor config: rescale_factor must be a positive number, got {rf!r}")
        object.__setattr__(self, "rescale_factor", float(rf))
        try:
            resample = int(self.resample)
            Image.Resampling(resample)
        except (TypeError, ValueError):
            raise ValueError(
                f"preprocessor config: resample must be a PIL resampling filter id (0-5, 3 = BICUBIC), "
                f"got {self.resample!r}") from None
        object.__setattr__(self, "resample", resample)

    @property
    def factor(self) -> int:
        return self.patch_size * self.merge_size

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], *, source: str = "dict", **overrides: Any) -> "PreprocessorConfig":
        """Build from a preprocessor_config.json dict.

        Accepts ``min_pixels``/``max_pixels`` at the top level, ``size: {shortest_edge,
        longest_edge}`` (transformers 5) and ``size: {min_pixels, max_pixels}`` (older dumps);
        top-level keys win, as in transformers. Unknown keys are ignored. ``overrides`` (e.g.
        ``max_image_pixels=...``) replace values from ``d``.
        """
        if not isinstance(d, Mapping):
            raise ValueError(f"preprocessor config must be a JSON object, got {type(d).__name__}")
        kw: dict[str, Any] = {}
        size = d.get("size")
        if size is not None:
            if not isinstance(size, Mapping):
                raise ValueError(
                    f"preprocessor config: size must be an object with shortest_edge/longest_edge "
                    f"(or min_pixels/max_pixels), got {size!r}")
            for key, dst in (("shortest_edge", "min_pixels"), ("min_pixels", "min_pixels"),
                             ("longest_edge", "max_pixels"), ("max_pixels", "max_pixels")):
                if size.get(key) is not None:
                    kw[dst] = size[key]
        for key in ("min_pixels", "max_pixels"):
            if d.get(key) is not None:
                kw[key] = d[key]
        for key in ("patch_size", "merge_size", "temporal_patch_size", "image_mean", "image_std",
                    "rescale_factor", "do_rescale", "do_normalize", "do_convert_rgb", "resample",
                    "max_image_pixels"):
            if d.get(key) is not None:
                kw[key] = d[key]
        if d.get("do_resize") is False:
            raise ValueError("preprocessor config: do_resize=false is not supported (PaddleOCR-VL needs "
                             "images resized to multiples of patch_size*merge_size)")
        kw.update(overrides)
        for flag in ("do_rescale", "do_normalize", "do_convert_rgb"):
            if flag in kw and not isinstance(kw[flag], bool):
                raise ValueError(f"preprocessor config: {flag} must be true/false, got {kw[flag]!r}")
        if kw.get("do_convert_rgb") is False:
            logger.warning("preprocessor config sets do_convert_rgb=false; images are converted to RGB "
                           "anyway (the vision encoder takes 3 channels)")
        return cls(source=source, **kw)

    @classmethod
    def from_model_dir(cls, path: str | os.PathLike, **overrides: Any) -> "PreprocessorConfig":
        """Read ``<path>/preprocessor_config.json`` if present, else use the built-in defaults.

        ``cfg.source`` says which was used (the JSON path or ``"defaults"``)."""
        p = Path(path)
        f = p / PREPROCESSOR_CONFIG_NAME if p.is_dir() or not p.suffix else p
        if not f.is_file():
            logger.info("no %s in %s; using default preprocessor settings", PREPROCESSOR_CONFIG_NAME, p)
            return cls(source="defaults", **overrides)
        try:
            d = json.loads(f.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ValueError(f"{f}: cannot read preprocessor config: {e}") from None
        try:
            cfg = cls.from_dict(d, source=str(f), **overrides)
        except ValueError as e:
            raise ValueError(f"{f}: {e}") from None
        logger.info("preprocessor settings from %s: min_pixels=%d max_pixels=%d factor=%d",
                    f, cfg.min_pixels, cfg.max_pixels, cfg.factor)
        return cfg


# --------------------------------------------------------------------------------------------
# sizing
# --------------------------------------------------------------------------------------------

def smart_resize(height: int, width: int, factor: int = 28, min_pixels: int = DEFAULT_MIN_PIXELS,
                 max_pixels: int = DEFAULT_MAX_PIXELS) -> tuple[int, int]:
    """Target (height, width), multiples of ``factor``; same arithmetic as transformers.

    Images thinner than ``factor`` are first stretched to ``factor`` (keeping the aspect ratio,
    Python's round-half-even). Raises ``ImageInputError`` (a ValueError) above aspect ratio 200."""
    if height <= 0 or width <= 0:
        raise ImageInputError(None, f"image has an empty size {width}x{height}",
                              "Provide an image with at least one pixel")
    if height < factor:
        width = round((width * factor) / height)
        height = factor
    if width < factor:
        height = round((height * factor) / width)
        width = factor
    if max(height, width) / min(height, width) > MAX_ASPECT_RATIO:
        raise ImageInputError(
            None,
            f"aspect ratio {max(height, width) / min(height, width):.1f} is above the supported maximum "
            f"of {MAX_ASPECT_RATIO}",
            "Crop or split the image into less elongated pieces")
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt((height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


# --------------------------------------------------------------------------------------------
# loading
# --------------------------------------------------------------------------------------------

def _check_size(label: str, w: int, h: int, cfg: PreprocessorConfig, max_patches: int | None = None) -> None:
    """The model's size rules, on the header size before decoding: smart_resize must accept it
    (aspect ratio at most 200, as transformers) and, with ``max_patches``, the resized image
    must not have more patches (so an upscale that would be refused anyway never runs)."""
    try:
        rh, rw = smart_resize(h, w, cfg.factor, cfg.min_pixels, cfg.max_pixels)
    except ImageInputError as e:
        raise e.with_source(label) from None
    patches = (rh // cfg.patch_size) * (rw // cfg.patch_size)
    if max_patches is not None and patches > max_patches:
        raise ImageInputError(label, f"resized to {rw}x{rh} it has {patches} patches, above --max-encoder-patches "
                                     f"{max_patches}", "Send a smaller image or lower max_pixels")


def load_image(src: ImageSource, cfg: PreprocessorConfig | None = None, name: str | None = None, *,
               exif_transpose: bool = True, max_patches: int | None = None) -> Image.Image:
    """inputs.images.load_image with this config's decode cap and size rules."""
    cfg = cfg or PreprocessorConfig()
    return _load_image(src, name, max_image_pixels=cfg.max_image_pixels, exif_transpose=exif_transpose,
                       size_check=lambda label, w, h: _check_size(label, w, h, cfg, max_patches))


#: vLLM's per-request processor overrides (``mm_processor_kwargs``) this processor honours
REQUEST_PIXEL_KWARGS = ("min_pixels", "max_pixels")


def request_config(cfg: PreprocessorConfig, kwargs: Mapping[str, Any], max_pixels_cap: int) -> PreprocessorConfig:
    """``cfg`` with a request's ``min_pixels`` / ``max_pixels``, checked BEFORE any image is
    touched: each a positive integer at most ``max_pixels_cap`` (the largest resized image the
    server can take: its encoder-patch and context limits), min <= max. Without this bound a
    client's ``min_pixels`` makes every image upscale to that size before any later check (5e7
    pixels cost a gigabyte, 4e8 a MemoryError). Raises ValueError naming the key."""
    bad = sorted(set(kwargs) - set(REQUEST_PIXEL_KWARGS))
    if bad:
        raise ValueError(f"mm_processor_kwargs: unsupported {bad!r} (supported: {', '.join(REQUEST_PIXEL_KWARGS)})")
    for k, v in kwargs.items():
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"mm_processor_kwargs.{k} must be a positive integer, got {v!r}")
        if v > max_pixels_cap:
            raise ValueError(f"mm_processor_kwargs.{k} = {v} is above this server's limit of {max_pixels_cap} "
                             f"pixels (the largest image its --max-encoder-patches and --max-model-len can take)")
    lo, hi = kwargs.get("min_pixels", cfg.min_pixels), kwargs.get("max_pixels", cfg.max_pixels)
    if "min_pixels" in kwargs and "max_pixels" not in kwargs:
        hi = max(hi, lo)          # raising only the floor lifts the ceiling with it, as a client means
    if "max_pixels" in kwargs and "min_pixels" not in kwargs:
        lo = min(lo, hi)
    if lo > hi:
        raise ValueError(f"mm_processor_kwargs: min_pixels ({lo}) must be <= max_pixels ({hi})")
    return dataclasses.replace(cfg, min_pixels=lo, max_pixels=hi)


# --------------------------------------------------------------------------------------------
# processing
# --------------------------------------------------------------------------------------------

@dataclass
class ProcessedImage:
    #: float32, [grid_h*grid_w, 3*temporal_patch_size, patch, patch], contiguous, raster order
    pixel_values: torch.Tensor
    #: (1, grid_h, grid_w) as Python ints
    grid_thw: tuple[int, int, int]
    source: str
    #: (height, width) of the decoded image (after EXIF orientation)
    original_size: tuple[int, int]
    #: (height, width) after smart_resize
    resized_size: tuple[int, int]

    @property
    def num_patches(self) -> int:
        return self.grid_thw[0] * self.grid_thw[1] * self.grid_thw[2]


class ImageProcessor:
    """PaddleOCR-VL preprocessing; outputs equal transformers' PaddleOCRVLImageProcessorPil."""

    def __init__(self, cfg: PreprocessorConfig | None = None):
        self.cfg = cfg or PreprocessorConfig()
        c = self.cfg
        # Immutable after construction: one processor may serve many threads (see PreprocessPool).
        self._mapper = PixelMapper.build(c.rescale_factor if c.do_rescale else None,
                                         c.image_mean if c.do_normalize else None,
                                         c.image_std if c.do_normalize else None)
        logger.debug("image processor: pixel mapping recipe %s", self._mapper.recipe_name)

    @property
    def pixel_recipe(self) -> str:
        """How uint8 values become normalized floats (a verified arithmetic recipe, or "table")."""
        return self._mapper.recipe_name

    def resized_size(self, height: int, width: int) -> tuple[int, int]:
        c = self.cfg
        return smart_resize(height, width, c.factor, c.min_pixels, c.max_pixels)

    def num_patches(self, height: int, width: int) -> int:
        """Number of patches (rows of pixel_values) for an image of this size; before merging."""
        h, w = self.resized_size(height, width)
        return (h // self.cfg.patch_size) * (w // self.cfg.patch_size)

    def load(self, src: ImageSource, name: str | None = None) -> Image.Image:
        return load_image(src, self.cfg, name)

    # ---------------------------------------------------------- per-request overrides
    def request_pixel_cap(self, max_patches: int, max_model_len: int) -> int:
        """The largest resized image a request may ask for: one whose patches fit
        --max-encoder-patches and whose tokens fit --max-model-len."""
        c = self.cfg
        return min(max_patches * c.patch_size ** 2, max_model_len * c.factor ** 2)

    def request_config(self, kwargs: Mapping[str, Any], *, max_cost: int, max_model_len: int) -> PreprocessorConfig:
        """The config a request's ``mm_processor_kwargs`` ask for (the engine's hook: checked,
        nothing built; ValueError naming the key). ``max_cost``: --max-encoder-patches."""
        return request_config(self.cfg, kwargs, self.request_pixel_cap(max_cost, max_model_len))

    def preprocess(self, src: ImageSource, name: str | None = None, *,
                   max_patches: int | None = None) -> ProcessedImage:
        """``max_patches``: refuse (from the header, before decoding) an image whose resized
        form would have more patches."""
        label = _source_name(src, name)
        img = load_image(src, self.cfg, label, max_patches=max_patches)
        try:
            return self._process_rgb(img, label)
        finally:
            if img is not src:
                img.close()

    def __call__(self, images: Iterable[ImageSource] | ImageSource,
                 names: Iterable[str | None] | None = None) -> list[ProcessedImage]:
        if isinstance(images, (str, os.PathLike, bytes, bytearray, memoryview, Image.Image)):
            images = [images]
        images = list(images)
        names = list(names) if names is not None else [None] * len(images)
        if len(names) != len(images):
            raise ValueError(f"got {len(names)} names for {len(images)} images")
        out = []
        for i, (src, nm) in enumerate(zip(images, names)):
            if nm is None:
                nm = _source_name(src, None)
                if nm.startswith("<"):
                    nm = f"<image {i}>"
            out.append(self.preprocess(src, nm))
        return out

    def _process_rgb(self, img: Image.Image, label: str) -> ProcessedImage:
        c = self.cfg
        w0, h0 = img.size
        try:
            rh, rw = self.resized_size(h0, w0)
        except ImageInputError as e:
            raise e.with_source(label) from None
        # transformers: np.array(rgb) -> CHW -> PIL.fromarray(HWC uint8) -> resize -> np.array.
        # Resizing the RGB PIL image directly is the same operation on the same bytes.
        resized = img.resize((rw, rh), resample=c.resample)
        arr = np.asarray(resized, dtype=np.uint8)  # [H, W, 3]
        if arr.ndim != 3 or arr.shape[2] != 3:
            raise ImageInputError(label, f"unexpected decoded shape {arr.shape}", "Send an RGB-convertible image")
        p = c.patch_size
        gh, gw = rh // p, rw // p
        out = self._mapper.patchify(arr, p)  # [gh*gw, 3, p, p] float32, exact
        if c.temporal_patch_size > 1:  # transformers broadcasts each channel T times (c-major)
            out = np.repeat(out, c.temporal_patch_size, axis=1)
        pv = torch.from_numpy(np.ascontiguousarray(out))
        return ProcessedImage(pixel_values=pv, grid_thw=(1, int(gh), int(gw)), source=label,
                              original_size=(int(h0), int(w0)), resized_size=(int(rh), int(rw)))


__all__ = [
    "ImageInputError", "PreprocessorConfig", "ProcessedImage", "ImageProcessor", "smart_resize",
    "load_image", "DEFAULT_MAX_IMAGE_PIXELS", "MAX_IMAGE_PIXELS_ENV",
]
