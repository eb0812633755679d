"""Image inputs, for every entry point (CLI, offline LLM API, engine, server): what an image may be
given as (a path, ``file://`` path, ``data:`` URL, encoded bytes, a PIL image), and reading it
safely: every failure (missing file, directory, empty or corrupt bytes, truncated data, a pixel
count above the decode cap, a malformed data URL) becomes an :class:`ImageInputError` naming the
source; no raw PIL/OSError escapes. The pixel cap is checked on the header size, before any pixel
is decoded (PIL's ``Image.open`` is lazy): decompression bombs are refused unread.

The model's own size rules (aspect ratio, resize limits) stay with its processor, which passes
them in as ``size_check`` (models/paddleocr_vl/processor.py); the pixel math is the processor's.
"""
from __future__ import annotations

import base64
import binascii
import io
import os
import threading
import warnings
from pathlib import Path
from typing import Any, Callable, Union

from PIL import Image, ImageOps

from .. import envs
from . import sources
from .sources import data_url_head, parse_source

#: Default decode cap: 64 Mi pixels (e.g. 8192 x 8192). Override with FD_MAX_IMAGE_PIXELS or
#: PreprocessorConfig(max_image_pixels=...).
DEFAULT_MAX_IMAGE_PIXELS = int(envs.FD_MAX_IMAGE_PIXELS.default)
MAX_IMAGE_PIXELS_ENV = envs.FD_MAX_IMAGE_PIXELS.name

ImageSource = Union[str, os.PathLike, bytes, bytearray, memoryview, Image.Image]
SizeCheck = Callable[[str, int, int], None]     # (label, width, height) -> raises ImageInputError


class ImageInputError(ValueError):
    """A bad image input. ``str(err)`` names the source, says what is wrong and what to do."""

    def __init__(self, source: str | None, problem: str, hint: str = ""):
        self.source = source
        self.problem = problem
        self.hint = hint
        msg = f"{source}: {problem}" if source else problem
        if hint:
            msg = f"{msg}. {hint}"
        super().__init__(msg)

    def __reduce__(self):  # picklable across process pools despite the custom __init__
        return (ImageInputError, (self.source, self.problem, self.hint))

    def with_source(self, source: str) -> "ImageInputError":
        return ImageInputError(source, self.problem, self.hint)


# --------------------------------------------------------------------------------------------
# what an image may be given as
# --------------------------------------------------------------------------------------------

def decode_data_url(url: str, label: str = "<data URL>") -> bytes:
    """``data:image/...;base64,<payload>`` -> the encoded image bytes (the scheme and the
    ``;base64`` marker in any case, as URLs allow)."""
    parsed = data_url_head(url)
    if parsed is None or ";base64" not in parsed[0]:
        raise ImageInputError(label, f"image data URL must be 'data:image/...;base64,...', got {url[:40]!r}...",
                              "Encode the image file's bytes in base64")
    try:
        payload = base64.b64decode(parsed[1], validate=True)
    except (binascii.Error, ValueError):
        raise ImageInputError(label, "image data URL has an invalid base64 payload",
                              "Encode the image file's bytes in base64") from None
    if not payload:
        raise ImageInputError(label, "image data URL is empty (0 bytes)", "Send the encoded image bytes")
    return payload


def resolve_source(obj: Any, label: str | None = None) -> ImageSource:
    """A user-facing image value -> what :func:`load_image` reads: ``data:`` URLs are decoded,
    ``file://`` becomes a path, http(s) URLs are refused (nothing is fetched), paths, bytes and
    PIL images pass through. Schemes are read by `inputs.sources.parse_source` (any case)."""
    if isinstance(obj, str):
        src = parse_source(obj)          # the server's media fetcher reads strings the same way
        if src.scheme == sources.DATA:
            return decode_data_url(obj, label or "<data URL>")
        if src.scheme in (sources.HTTP, sources.HTTPS):
            raise ImageInputError(label or obj[:60], "remote images are not fetched",
                                  "Send the bytes as a data URL or a local path")
        if src.scheme not in (sources.FILE, sources.PATH):
            raise ImageInputError(label or obj[:60], f"unsupported URL scheme {src.scheme!r}",
                                  "Pass a file path, a file:// or data: URL")
        return src.path
    if isinstance(obj, (bytes, bytearray, memoryview, os.PathLike, Image.Image)):
        return obj
    raise ImageInputError(label or f"<{type(obj).__name__}>", f"unsupported image input type {type(obj).__name__}",
                          "Pass a file path, a data: URL, encoded image bytes or a PIL.Image")


def source_name(src: Any, name: str | None) -> str:
    if name:
        return str(name)
    if isinstance(src, (str, os.PathLike)):
        return os.fspath(src)
    if isinstance(src, (bytes, bytearray, memoryview)):
        return "<bytes>"
    if isinstance(src, Image.Image):
        fn = getattr(src, "filename", None)
        return str(fn) if fn else "<PIL image>"
    return f"<{type(src).__name__}>"


def _fmt_pixels(n: int) -> str:
    return f"{n:,} pixels ({n / 1e6:.1f} MP)"


def _ensure_pil_bomb_limit(cap: int) -> None:
    """PIL's own bomb check (in Image.open) must not be stricter than our cap, or images we accept
    would fail inside PIL with its generic message. Only ever raises PIL's global limit, never
    lowers it; our header check enforces ``cap`` before decoding."""
    cur = Image.MAX_IMAGE_PIXELS
    if cur is not None and cur < cap:
        Image.MAX_IMAGE_PIXELS = cap


def _bomb_error(label: str, cap: int) -> ImageInputError:
    # PIL refuses above 2 * Image.MAX_IMAGE_PIXELS, and _ensure_pil_bomb_limit keeps that >= cap.
    limit = 2 * (Image.MAX_IMAGE_PIXELS or 0)
    return ImageInputError(
        label,
        f"image header claims more than {_fmt_pixels(limit)}, above the decode cap of {_fmt_pixels(cap)} "
        f"(refused before decoding as a possible decompression bomb)",
        f"Downscale it before sending, or raise {MAX_IMAGE_PIXELS_ENV} / max_image_pixels if it is legitimate")


# Modes whose samples do not fit 8 bits. PIL's own convert("RGB"/"L") clips them to 0..255 (a
# 16-bit page turns white), so they are rescaled here by their bit depth: the full scale of the
# format, never the image's own min/max (a faint page must stay faint, a dark one dark).
_SIXTEEN_BIT_MODES = frozenset({"I;16", "I;16L", "I;16B", "I;16N"})
_PIXELS_PER_CHUNK = 1 << 20     # rescale in row blocks of ~1 Mi pixels: the int64 temporaries stay ~8 MiB


def _tiff_tag(tags, tag: int):
    v = tags.get(tag)                             # PIL gives per-sample tags as tuples
    return v[0] if isinstance(v, tuple) and v else v


def _sample_range(img: Image.Image) -> tuple[float, float]:
    """(value shown black, value shown white) for a high-bit-depth mode.

    I;16*: 0..65535. I: PIL's 32-bit container; its real depth is the file's: TIFF BitsPerSample
    (SampleFormat 2 = signed, whose negatives show black), 16 bits otherwise (PNG and PNM are at
    most 16 bits deep, and an in-memory I image is, by PIL's convention, 16-bit samples such as
    ``convert("I")`` of an I;16 image). F: floats in 0..1 (TIFF's and numpy's convention)."""
    if img.mode == "F":
        return 0.0, 1.0
    if img.mode == "I":
        tags = getattr(img, "tag_v2", None) or {}
        bits, sample_format = _tiff_tag(tags, 258), _tiff_tag(tags, 339)
        signed = sample_format == 2
        if isinstance(bits, int) and 8 < bits <= 32:
            return 0, (1 << (bits - 1 if signed else bits)) - 1
    return 0, 65535


def _rescale_to_l(img: Image.Image, sample_range: tuple[float, float]) -> Image.Image:
    """A high-bit-depth single-channel image -> mode L, value v -> round(255 * (v - lo) / (hi - lo)),
    clipped to 0..255."""
    import numpy as np

    lo, hi = sample_range
    arr = np.asarray(img)
    out = np.empty(arr.shape, dtype=np.uint8)
    rows = max(1, _PIXELS_PER_CHUNK // max(1, arr.shape[1]))
    for r in range(0, arr.shape[0], rows):
        block = arr[r:r + rows]
        if img.mode == "F":
            v = np.nan_to_num(block.astype(np.float64), nan=0.0)
            out[r:r + rows] = np.rint(np.clip((v - lo) / (hi - lo), 0.0, 1.0) * 255)
        else:
            # integer arithmetic: exact round-to-nearest (hi - lo is odd, so never a tie)
            span = int(hi) - int(lo)
            v = np.clip(block.astype(np.int64) - int(lo), 0, span)
            out[r:r + rows] = (v * 255 + span // 2) // span
    return Image.fromarray(out)                    # uint8, 2-D: mode L


def _convert_rgb(img: Image.Image, sample_range: tuple[float, float] | None = None) -> Image.Image:
    """transformers' convert_to_rgb for PIL images: transparency composited onto white; high
    bit depths (I;16*, I, F) scaled to 8 bits by their depth first (``sample_range``, default
    `_sample_range(img)`: pass the opened file's, since a transposed copy loses its TIFF tags)."""
    if img.mode in _SIXTEEN_BIT_MODES or img.mode in ("I", "F"):
        gray = _rescale_to_l(img, sample_range or _sample_range(img))
        key = img.info.get("transparency")        # a 16-bit PNG's tRNS: one gray value
        if isinstance(key, (int, float)) and not isinstance(key, bool):
            import numpy as np
            alpha = Image.fromarray(np.where(np.asarray(img) == key, 0, 255).astype(np.uint8))
            white = Image.new("L", gray.size, 255)
            gray = Image.composite(gray, white, alpha)
        return gray.convert("RGB")
    has_alpha = "A" in img.getbands() or img.info.get("transparency") is not None
    if has_alpha:
        rgba = img.convert("RGBA")
        background = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(background, rgba).convert("RGB")
    if img.mode == "RGB":
        return img
    return img.convert("RGB")


def load_image(src: ImageSource, name: str | None = None, *, max_image_pixels: int = DEFAULT_MAX_IMAGE_PIXELS,
               size_check: SizeCheck | None = None, exif_transpose: bool = True) -> Image.Image:
    """Open, validate, fully decode and convert an image to RGB.

    ``src``: a path (str / PathLike), encoded bytes, or a PIL image (see :func:`resolve_source`
    for data: URLs). ``name`` overrides the name used in error messages (e.g. ``"<image 3>"``).
    ``max_image_pixels``: the decode cap, checked on the header. ``size_check(label, w, h)``: the
    model's own size rules (e.g. the processor's aspect-ratio limit), also before decoding. Paths and bytes get their EXIF orientation applied
    (as transformers' ``load_image`` does for paths); PIL images are taken as they are (as the
    transformers processor does). Every failure raises ``ImageInputError`` naming the source.
    """
    label = source_name(src, name)
    cap = max_image_pixels

    def _check_size(label: str, w: int, h: int) -> None:
        check_size(label, w, h, cap)
        if size_check is not None:
            size_check(label, w, h)

    if isinstance(src, Image.Image):
        img = src
        w, h = img.size
        _check_size(label, w, h)
        try:
            # one caller's image may be shared by several prompts preprocessed in parallel
            # threads; PIL's lazy decode is not thread-safe, so the first thread decodes it
            # and the others wait (per image: distinct images still decode in parallel)
            with img.__dict__.setdefault("_fdx_load_lock", threading.Lock()):
                img.load()
            return _convert_rgb(img)
        except ImageInputError:
            raise
        except Exception as e:  # noqa: BLE001 - never leak a raw PIL error
            raise ImageInputError(label, f"cannot decode the image ({type(e).__name__}: {e})",
                                  "Check that the image data is complete and valid") from None

    if isinstance(src, (bytes, bytearray, memoryview)):
        data = bytes(src)
        if not data:
            raise ImageInputError(label, "image data is empty (0 bytes)", "Send the encoded image bytes")
        fp: Any = io.BytesIO(data)
    elif isinstance(src, (str, os.PathLike)):
        path = Path(os.fspath(src))
        if not path.exists():
            raise ImageInputError(label, "file not found", "Check the path")
        if path.is_dir():
            raise ImageInputError(label, "is a directory, not an image file", "Pass the path of an image file")
        try:
            size = path.stat().st_size
        except OSError as e:
            raise ImageInputError(label, f"cannot stat file ({e.strerror or e})", "Check the path and permissions") from None
        if size == 0:
            raise ImageInputError(label, "file is empty (0 bytes)", "Re-export or re-download the image")
        if not os.access(path, os.R_OK):
            raise ImageInputError(label, "file is not readable (permission denied)", "Check the file permissions")
        fp = path
    else:
        raise ImageInputError(label, f"unsupported image input type {type(src).__name__}",
                              "Pass a file path, encoded image bytes or a PIL.Image")

    _ensure_pil_bomb_limit(cap)
    # PIL warns (and some plugins re-check on load) for sizes above Image.MAX_IMAGE_PIXELS >= cap:
    # such images are refused by our own cap anyway, so the warning is silenced here instead of
    # leaking to the log (or raising as a bare warning under `-W error`). catch_warnings is
    # process-global state in Python 3.11; the only thing it touches is this one warning class.
    try:
        with warnings.catch_warnings():
            # We apply our own (<= PIL's) cap right below, before decoding; PIL's warning is noise.
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            img = Image.open(fp)  # lazy: reads the header only
    except Image.DecompressionBombError:
        raise _bomb_error(label, cap) from None
    except Image.UnidentifiedImageError:
        raise ImageInputError(label, "not a recognised image format (corrupt or not an image)",
                              "Send a PNG, JPEG, WebP, BMP, GIF or TIFF image") from None
    except Exception as e:  # noqa: BLE001 - OSError (permissions, I/O), SyntaxError, ...
        raise ImageInputError(label, f"cannot open image ({type(e).__name__}: {e})",
                              "Check that the file is a valid image") from None

    opened = img
    rgb = None
    w, h = img.size
    try:
        _check_size(label, w, h)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            img.load()  # force the full decode here so truncation/corruption surfaces now
            if img.size != (w, h):  # a few formats (ICO, EPS, ...) settle their size on load
                _check_size(label, *img.size)
            depth = _sample_range(img)          # from the file's tags, which a transposed copy lacks
            if exif_transpose:
                img = ImageOps.exif_transpose(img)
            rgb = _convert_rgb(img, depth)
            rgb.load()
    except ImageInputError:
        raise
    except Image.DecompressionBombError:
        raise _bomb_error(label, cap) from None
    except MemoryError:
        raise ImageInputError(label, f"out of memory decoding a {w}x{h} image",
                              f"Downscale it or lower {MAX_IMAGE_PIXELS_ENV}") from None
    except Exception as e:  # noqa: BLE001 - OSError, SyntaxError, struct.error, ValueError, ...
        what = "truncated" if "truncat" in str(e).lower() else "corrupt"
        raise ImageInputError(label, f"image data is {what} and cannot be decoded ({type(e).__name__}: {e})",
                              "Re-export or re-download the image") from None
    finally:
        if rgb is not opened:
            opened.close()  # releases the file handle (multi-frame formats keep it open)
    return rgb


def check_size(label: str, w: int, h: int, max_image_pixels: int) -> None:
    """Header-level checks, before any pixel is decoded: a non-empty size under the decode cap."""
    if w <= 0 or h <= 0:
        raise ImageInputError(label, f"image has an empty size {w}x{h}", "Provide an image with at least one pixel")
    if w * h > max_image_pixels:
        raise ImageInputError(
            label,
            f"image is {w}x{h} = {_fmt_pixels(w * h)}, above the decode cap of {_fmt_pixels(max_image_pixels)} "
            f"(refused before decoding as a possible decompression bomb)",
            f"Downscale it before sending, or raise {MAX_IMAGE_PIXELS_ENV} / max_image_pixels if it is legitimate")


__all__ = ["DEFAULT_MAX_IMAGE_PIXELS", "ImageInputError", "ImageSource", "MAX_IMAGE_PIXELS_ENV", "check_size",
           "decode_data_url", "load_image", "resolve_source", "source_name"]
