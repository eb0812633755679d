"""Activations, fused into the GEMM that feeds them where the library offers it. The engine's
SiLU-and-mul belongs here too."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ..fallbacks import GELU_UNFUSED_NOTE, log_once, onednn_gelu_unfused_note, onednn_linear_gelu_usable

__all__ = ["linear_gelu", "ERF_EPILOGUE_KERNEL"]

#: Whether CUDA's erf GELU runs in our Triton GEMM's epilogue (ops/triton/gemm_gelu.py) rather
#: than as cuBLAS's GEMM then ATen's GELU kernel. Off: on an H100 (bf16, 768 -> 3072, SAM's fc1)
#: cuBLAS's GEMM plus the separate GELU took 0.233 / 0.749 / 2.488 ms at 17,920 / 65,536 /
#: 221,184 rows and ours 0.294 / 0.890 / 3.053 ms (0.79-0.84x): the epilogue saves one pass over
#: the output, our GEMM loses more than that to cuBLAS's. `python3 -m fastdeploy_ext.bench.gemm_gelu`
#: re-measures it on a new card.
ERF_EPILOGUE_KERNEL = False


def linear_gelu(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor, approx: str, *,
                cuda_epilogue: bool = True) -> torch.Tensor:
    """GELU(x @ w.T + b), the GELU fused into the GEMM where a library does it:
    * CUDA (``cuda_epilogue``, the fused-layers plan), tanh GELU: cuBLASLt's bias+GELU epilogue;
    * CUDA (``cuda_epilogue``), erf GELU (``approx="none"``), when ``ERF_EPILOGUE_KERNEL``: our
      Triton GEMM with a bias+GELU epilogue (cuBLASLt only has the tanh one), rows contiguous;
    * CPU in bf16: oneDNN's linear with a GELU post-op, applied to the fp32 accumulator before the
      bf16 rounding (ATen's separate bf16 GELU costs as much as the GEMM at 1536 tokens: 8.5 vs
      8.5 ms on a 2-core Sapphire Rapids; fused 11 ms);
    otherwise ATen's two ops (torch's CPU _addmm_activation uses the erf GELU, not tanh)."""
    if x.is_cuda:
        if approx == "tanh" and cuda_epilogue:
            # private ATen op (torch 2.11-2.13 have it); without it the GELU runs as its own kernel
            addmm_activation = getattr(torch, "_addmm_activation", None)
            if addmm_activation is not None:
                return addmm_activation(b, x, w.t(), use_gelu=True)
            log_once(GELU_UNFUSED_NOTE)
        elif approx == "none" and cuda_epilogue and ERF_EPILOGUE_KERNEL and x.dim() == 2 and x.stride(1) == 1 and w.stride(1) == 1:
            from .triton.runtime import kernels_usable
            if kernels_usable(x):
                from .triton.gemm_gelu import linear_gelu_erf
                return linear_gelu_erf(x, w, b)
    elif x.device.type == "cpu" and x.dtype == torch.bfloat16:
        usable, why = onednn_linear_gelu_usable(x.dtype)
        if usable:
            return torch.ops.mkldnn._linear_pointwise(x, w, b, "gelu", [], approx)
        log_once(onednn_gelu_unfused_note(why))
    return F.gelu(F.linear(x, w, b), approximate=approx)
