"""Activations, fused into the GEMM that feeds them where the library offers it. The engine's
SiLU-and-mul belongs here too."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ..fallbacks import GELU_UNFUSED_NOTE, log_once

__all__ = ["linear_gelu"]

def linear_gelu(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor, approx: str) -> torch.Tensor:
    """GELU(x @ w.T + b). On CUDA the tanh GELU is cuBLASLt's bias+GELU epilogue (one kernel, no
    round trip of the [N, intermediate] activation); elsewhere, and for exact GELU, ATen ops
    (torch's CPU _addmm_activation uses the erf GELU, not tanh)."""
    if approx == "tanh" and x.is_cuda:
        # private ATen op (torch 2.11-2.13 have it); without it the GELU runs as its own kernel
        addmm_activation = getattr(torch, "_addmm_activation", None)
        if addmm_activation is not None:
            return addmm_activation(b, x, w.t(), use_gelu=True)
        log_once(GELU_UNFUSED_NOTE)
    return F.gelu(F.linear(x, w, b), approximate=approx)
