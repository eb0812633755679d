"""Normalisation ops: the residual add + bias + LayerNorm pass of the fused encoder layers.

One entry point, :func:`add_layer_norm`: the Triton pass (ops/triton/layer_passes.py) where our
kernels can run, the same arithmetic in ATen ops elsewhere (and as the tests' reference). The
engine's RMSNorm belongs here too.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .triton.layer_passes import add_layer_norm_triton
from .triton.runtime import kernels_usable

__all__ = ["add_layer_norm", "add_layer_norm_torch"]


def add_layer_norm_torch(x, delta, bias, weight, ln_bias, eps: float, out: torch.Tensor | None = None,
                         rows_of_y: torch.Tensor | None = None, delta_rows: torch.Tensor | None = None):
    """Reference of :func:`add_layer_norm` in ATen ops (the unfused layer's arithmetic)."""
    r = x
    if delta is not None:
        r = r + (delta if delta_rows is None else delta.index_select(0, delta_rows))
    if bias is not None:
        r = r + bias
    if out is not None and r is not x:
        out.copy_(r)
        r = out
    y = F.layer_norm(r, (r.shape[-1],), weight, ln_bias, eps)
    if rows_of_y is not None:       # -1 picks the zero row appended at the end
        y = torch.cat([y, y.new_zeros(1, y.shape[1])]).index_select(0, torch.where(rows_of_y < 0, y.shape[0], rows_of_y))
    return r, y


def add_layer_norm(x: torch.Tensor, delta: torch.Tensor | None, bias: torch.Tensor | None,
                   weight: torch.Tensor, ln_bias: torch.Tensor, eps: float,
                   out: torch.Tensor | None = None,
                   tuning: tuple[int, int] | None = None, *, rows_of_y: torch.Tensor | None = None,
                   delta_rows: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(x + delta + bias, LayerNorm of that) in one pass over [N, hidden].

    The sum is rounded to x's dtype (it is the residual stream) and written to ``out`` (pass
    ``out=x`` to update the residual in place); with neither delta nor bias it is plain
    LayerNorm and x is returned as is.  Falls back to ATen where the Triton kernels cannot run.
    ``tuning``: launch parameters for `bench layers --tune` (see add_layer_norm_triton).

    Row maps (int32 on x's device; a layout change folded into the pass, SAM's windows):
    ``rows_of_y`` [M]: the normalized output has M rows, row r being x row rows_of_y[r], or
    zeros where that is -1 (every x row must appear exactly once); ``delta_rows`` [N]: x row i
    adds delta row delta_rows[i] (delta then has any number of rows).
    """
    if x.dim() != 2 or x.stride(-1) != 1:
        raise ValueError(f"x must be [N, hidden] with a contiguous last dim, got {tuple(x.shape)} {x.stride()}")
    n, hidden = x.shape
    for name, t, want_rows in (("delta", delta, n if delta_rows is None else None), ("out", out, n)):
        if t is not None and (t.dim() != 2 or t.shape[1] != hidden or want_rows not in (None, t.shape[0])
                              or t.stride(-1) != 1 or t.dtype != x.dtype):
            raise ValueError(f"{name} must match x ({tuple(x.shape)}, {x.dtype}), got {tuple(t.shape)} {t.dtype}")
    for name, t, length in (("rows_of_y", rows_of_y, None), ("delta_rows", delta_rows, n)):
        if t is not None and (t.dim() != 1 or t.dtype != torch.int32 or not t.is_contiguous()
                              or t.device != x.device or length not in (None, t.shape[0])):
            raise ValueError(f"{name} must be a contiguous int32 [{length or 'M'}] tensor on {x.device}, got "
                             f"{tuple(t.shape)} {t.dtype} on {t.device}")
    if delta_rows is not None and delta is None:
        raise ValueError("delta_rows given without a delta")
    for name, t in (("bias", bias), ("weight", weight), ("ln_bias", ln_bias)):
        # the kernel reads `hidden` contiguous values from each: anything else would be read
        # out of bounds
        if t is not None and (tuple(t.shape) != (hidden,) or not t.is_contiguous() or t.device != x.device):
            raise ValueError(f"{name} must be a contiguous [{hidden}] tensor on {x.device}, got "
                             f"{tuple(t.shape)} on {t.device}")
    if not kernels_usable(x):
        return add_layer_norm_torch(x, delta, bias, weight, ln_bias, eps, out, rows_of_y, delta_rows)
    return add_layer_norm_triton(x, delta, bias, weight, ln_bias, eps, out, tuning, rows_of_y, delta_rows)
