"""uint8 RGB -> normalized float32 patches, bit-identical to transformers' rescale + normalize.

transformers computes, per channel ``c`` and uint8 value ``v``::

    x = float32(float64(v) * rescale_factor)      # rescale
    y = (x - float32(mean[c])) / float32(std[c])  # normalize, float32

The result depends only on ``(c, v)``: 768 possible values. ``reference_table`` evaluates them
with exactly those numpy operations and dtypes. The image itself is mapped with a cheaper
float32 recipe (fewer passes over memory than a gather, which numpy runs through a 64-bit index
copy). A recipe is used only if it reproduces all 768 table entries bit for bit, checked once
when the mapper is built; since every pixel takes one of those 768 (channel, value) inputs, the
check covers every image. If no recipe matches, the table gather is used (slower, still exact).

The first step reads the strided uint8 patch view directly (numpy casts on the fly), the others
run in place, in chunks of patch rows so a page's ~25 MB output is not streamed through memory
once per pass. numpy releases the GIL inside these loops, so threads map images in parallel.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np

logger = logging.getLogger(__name__)

#: float32 elements per chunk (4 MiB of output): bounds the working set of the in-place passes.
CHUNK_ELEMS = 1 << 20


def reference_table(rescale_factor: float | None, mean: tuple[float, ...] | None,
                    std: tuple[float, ...] | None) -> np.ndarray:
    """[3, 256] float32: transformers' result for every (channel, uint8 value).

    ``rescale_factor`` None skips the rescale, ``mean``/``std`` None skip the normalize."""
    v = np.arange(256, dtype=np.uint8)[None, :].repeat(3, axis=0)
    if rescale_factor is not None:
        x = (v.astype(np.float64) * rescale_factor).astype(np.float32)
    else:
        x = v.astype(np.float32)
    if mean is not None and std is not None:
        x = (x - np.array(mean, dtype=x.dtype)[:, None]) / np.array(std, dtype=x.dtype)[:, None]
    return np.ascontiguousarray(x, dtype=np.float32)


#: One elementwise float32 step: (ufunc, per-channel or scalar operand).
Step = tuple[np.ufunc, np.ndarray]


@dataclass(frozen=True)
class PixelMapper:
    """Maps a uint8 [H, W, 3] image to float32 patches [gh*gw, 3, p, p]; thread-safe (immutable)."""

    table: np.ndarray                 # [3, 256] reference values
    recipe_name: str                  # "exact3/div", "affine2", ... or "table"
    steps: tuple[Step, ...] | None    # None: gather from ``table``

    @classmethod
    def build(cls, rescale_factor: float | None, mean: tuple[float, ...] | None,
              std: tuple[float, ...] | None) -> "PixelMapper":
        table = reference_table(rescale_factor, mean, std)
        probe = np.arange(256, dtype=np.uint8)[None, None, :].repeat(3, axis=0)  # [3, 1, 256]
        for name, steps in _candidate_recipes(rescale_factor, mean, std):
            got = np.empty(probe.shape, dtype=np.float32)
            _apply(steps, probe, got)
            if np.array_equal(got[:, 0, :].view(np.uint32), table.view(np.uint32)):
                logger.debug("pixel mapping: recipe %s reproduces the reference table bit for bit", name)
                return cls(table, name, steps)
        logger.info("pixel mapping: no arithmetic recipe reproduces the reference table exactly; "
                    "using the table gather (exact, slower)")
        return cls(table, "table", None)

    def patchify(self, hwc: np.ndarray, patch: int) -> np.ndarray:
        """uint8 [gh*p, gw*p, 3] -> float32 [gh*gw, 3, p, p], raster order over the patch grid."""
        H, W, C = hwc.shape
        gh, gw = H // patch, W // patch
        src = hwc.reshape(gh, patch, gw, patch, C).transpose(0, 2, 4, 1, 3)  # [gh, gw, 3, p, p] view
        out = np.empty((gh, gw, C, patch, patch), dtype=np.float32)
        rows = max(1, CHUNK_ELEMS // max(1, gw * C * patch * patch))
        for r0 in range(0, gh, rows):
            o, s = out[r0:r0 + rows], src[r0:r0 + rows]
            if self.steps is None:
                for ch in range(C):
                    np.take(self.table[ch], s[:, :, ch], out=o[:, :, ch])
            else:
                _apply(self.steps, s, o)
        return out.reshape(gh * gw, C, patch, patch)


def _apply(steps: tuple[Step, ...], src_u8: np.ndarray, out: np.ndarray) -> None:
    """out = steps(src): the first step reads the uint8 source (numpy casts it to float32 on the
    fly, exactly: every uint8 is a float32), the rest run in place."""
    if not steps:
        np.copyto(out, src_u8, casting="unsafe")
        return
    (op, k), rest = steps[0], steps[1:]
    op(src_u8, k, out=out, dtype=np.float32, casting="unsafe")
    for op, k in rest:
        op(out, k, out=out)


def _per_channel(values) -> np.ndarray:
    # broadcasts over [..., 3, p, p] (channel on axis -3) and over the probe's [3, 1, 256]
    return np.asarray(values, dtype=np.float32).reshape(3, 1, 1)


def _candidate_recipes(rescale_factor, mean, std):
    """(name, steps), cheapest first. Each is checked against the reference table before use."""
    normalize = mean is not None and std is not None
    norm: tuple[Step, ...] = ((np.subtract, _per_channel(mean)), (np.divide, _per_channel(std))) if normalize else ()
    if rescale_factor is None:
        yield ("normalize" if normalize else "identity"), norm
        return
    divisor = np.float32(round(1.0 / rescale_factor))
    if normalize:
        # (v - mean*d) / (std*d): 2 passes instead of 3 where it happens to be exact.
        yield "affine2", ((np.subtract, _per_channel(np.float32(mean) * divisor)),
                          (np.divide, _per_channel(np.float32(std) * divisor)))
    # transformers' own order; the rescale as a float32 division or multiplication
    yield "exact3/div", ((np.divide, np.float32(divisor)),) + norm
    yield "exact3/mul", ((np.multiply, np.float32(rescale_factor)),) + norm
