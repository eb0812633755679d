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


def add_layer_norm_torch(x, delta, bias, weight, ln_bias, eps: float, out: torch.Tensor | None = None):
    """Reference of :func:`add_layer_norm` in ATen ops (the unfused layer's arithmetic)."""
    r = x
    if delta is not None:
        r = r + delta
    if bias is not None:
        r = r + bias
    if out is not None and r is not x:
        out.copy_(r)
        r = out
    return r, F.layer_norm(r, (r.shape[-1],), weight, ln_bias, eps)


def add_layer_norm(x: torch.Tensor, delta: torch.Tensor | None, bias: torch.Tensor | None,
                   weight: torch.Tensor, ln_bias: torch.Tensor, eps: float,
                   out: torch.Tensor | None = None,
                   tuning: tuple[int, int] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(x + delta + bias, LayerNorm of that) in one pass over [N, hidden].

    The sum is rounded to x's dtype (it is the residual stream) and written to ``out`` (pass
    ``out=x`` to update the residual in place); with neither delta nor bias it is plain
    LayerNorm and x is returned as is.  Falls back to ATen where the Triton kernels cannot run.
    ``tuning``: launch parameters for `bench layers --tune` (see add_layer_norm_triton).
    """
    if x.dim() != 2 or x.stride(-1) != 1:
        raise ValueError(f"x must be [N, hidden] with a contiguous last dim, got {tuple(x.shape)} {x.stride()}")
    n, hidden = x.shape
    for name, t in (("delta", delta), ("out", out)):
        if t is not None and (tuple(t.shape) != (n, hidden) or t.stride(-1) != 1 or t.dtype != x.dtype):
            raise ValueError(f"{name} must match x ({tuple(x.shape)}, {x.dtype}), got {tuple(t.shape)} {t.dtype}")
    for name, t in (("bias", bias), ("weight", weight), ("ln_bias", ln_bias)):
        # the kernel reads `hidden` contiguous values from each: anything else would be read
        # out of bounds
        if t is not None and (tuple(t.shape) != (hidden,) or not t.is_contiguous() or t.device != x.device):
            raise ValueError(f"{name} must be a contiguous [{hidden}] tensor on {x.device}, got "
                             f"{tuple(t.shape)} on {t.device}")
    if not kernels_usable(x):
        return add_layer_norm_torch(x, delta, bias, weight, ln_bias, eps, out)
    return add_layer_norm_triton(x, delta, bias, weight, ln_bias, eps, out, tuning)
