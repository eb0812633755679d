"""Triton softmax top-k tail of a mixture of experts' router, in one launch.

A greedy softmax router is an fp32 GEMM (tokens x the expert gate), softmax over the E expert
logits, the top k of those probabilities (descending) and a scale. ATen runs the part after the
GEMM as four to five kernels (softmax, a sort for topk and its gathers, the multiply): at decode
batch sizes each costs more in launch gaps than in work, and a step has one router per MoE layer.
Here the logits come from ATen's GEMM and one program takes ``ROUTE_TOKENS`` tokens: softmaxed
and the k largest picked by k rounds of max + first-index-of + knock-out; no sort, nothing read
back to the host (capturable in the decode graphs). Fusing the GEMM into this launch as well was
measured slower at every batch size on the H200 (fp32 FMA products with the gate re-read per
program: 0.031-0.110 ms against 0.019-0.048 ms for cuBLAS + this tail; docs/PERFORMANCE.md).

The softmax's exp is libdevice's (accurate expf, as ATen's) over a tree sum: probabilities may
differ from ATen's by a few ulps of fp32, so an expert id can differ only where two
probabilities are that close (tests/test_triton_moe_routing.py).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .runtime import KernelTable, interpreted, pow2, tl, triton

#: tokens per program (a [ROUTE_TOKENS, E_PAD] tile of logits)
ROUTE_TOKENS = 16


if triton is not None:
    from triton.language.extra import libdevice

    # raw function, decorated on first use in the mode triton was imported in (jit_decorator)
    def _router_topk_kernel(LOGITS, W, IDS, T, s_lt, s_wt, s_it, SCALE, E: tl.constexpr, E_PAD: tl.constexpr,
                            K: tl.constexpr, BT: tl.constexpr, ACCURATE_EXP: tl.constexpr):
        rows = tl.program_id(0) * BT + tl.arange(0, BT)
        cols = tl.arange(0, E_PAD)
        rmask = rows < T
        cmask = cols < E
        valid = rmask[:, None] & cmask[None, :]
        logit = tl.load(LOGITS + rows[:, None] * s_lt + cols[None, :], mask=valid, other=float("-inf"))
        # rows past T hold -inf everywhere: a peak of 0 and a sum of 1 keep them free of NaN
        peak = tl.where(rmask, tl.max(logit, 1), 0.0)
        if ACCURATE_EXP:         # libdevice's expf (ATen's accuracy); tl.exp is ex2.approx on NVIDIA
            e = libdevice.exp(logit - peak[:, None])
        else:                    # the interpreter (numpy's exp)
            e = tl.exp(logit - peak[:, None])
        e = tl.where(valid, e, 0.0)
        total = tl.where(rmask, tl.sum(e, 1), 1.0)      # >= 1 on a real row (its peak's exp is 1)
        p = e / total[:, None]
        p = tl.where(valid, p, -1.0)                    # padding columns never win a round
        for j in tl.static_range(K):
            best = tl.max(p, 1)
            first = tl.min(tl.where(p == best[:, None], cols[None, :], E_PAD), 1)
            tl.store(W + rows * s_wt + j, best * SCALE, mask=rmask)
            tl.store(IDS + rows * s_it + j, first.to(tl.int64), mask=rmask)
            p = tl.where(cols[None, :] == first[:, None], -2.0, p)


_KERNELS = KernelTable(lambda: {"router_topk": _router_topk_kernel})


def softmax_topk(logits: torch.Tensor, k: int, scale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [T, k] fp32 = the k largest softmax probabilities of each row, descending, times
    ``scale``; their expert ids [T, k] int64), as ``(logits.softmax(-1).topk(k) * scale)``.
    ``logits``: [T, E] fp32 with a unit last stride."""
    if logits.dim() != 2 or logits.dtype != torch.float32 or logits.stride(-1) != 1:
        raise ValueError(f"logits must be [T, E] fp32 with a unit last stride, got {tuple(logits.shape)} "
                         f"{logits.dtype} strides {logits.stride()}")
    t, e = logits.shape
    if not 0 < k <= e:
        raise ValueError(f"k={k} must be in 1..{e} (the number of experts)")
    if triton is None:
        raise RuntimeError("the Triton router needs triton")
    w = torch.empty(t, k, dtype=torch.float32, device=logits.device)
    ids = torch.empty(t, k, dtype=torch.int64, device=logits.device)
    if t:
        _KERNELS["router_topk"][(triton.cdiv(t, ROUTE_TOKENS),)](
            logits, w, ids, t, logits.stride(0), w.stride(0), ids.stride(0), float(scale),
            E=e, E_PAD=pow2(e, 16), K=k, BT=ROUTE_TOKENS, ACCURATE_EXP=not interpreted())
    return w, ids


def router_topk(x: torch.Tensor, gate: torch.Tensor, k: int, scale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """The whole router: ``softmax_topk(F.linear(x.float(), gate.float()), k, scale)``. ``x``
    [T, H], ``gate`` [E, H], any float dtypes, unit last strides."""
    if x.dim() != 2 or gate.dim() != 2 or x.shape[1] != gate.shape[1]:
        raise ValueError(f"x [T, H] and gate [E, H] must share H, got {tuple(x.shape)} and {tuple(gate.shape)}")
    if not (x.is_floating_point() and gate.is_floating_point()) or x.stride(-1) != 1 or gate.stride(-1) != 1:
        raise ValueError(f"x and gate must be floating point with unit last strides, got {x.dtype} "
                         f"{x.stride()} and {gate.dtype} {gate.stride()}")
    return softmax_topk(F.linear(x.float(), gate.float()), k, scale)


__all__ = ["ROUTE_TOKENS", "router_topk", "softmax_topk"]
