"""Triton softmax top-k router of a mixture of experts, in one launch.

A greedy softmax router is an fp32 GEMM (tokens x the expert gate), softmax over the E expert
logits, the top k of those probabilities (descending) and a scale. ATen runs it as six to seven
kernels (the fp32 copy of x, the GEMM and its split-K reduce, softmax, a sort for topk and its
gathers, the multiply): at decode batch sizes each costs more in launch gaps than in work, and a
step has one router per MoE layer. Here one program takes ``BT`` tokens: their logits computed in
fp32 from x and the gate (FMA, no tensor cores: fp32 throughout, as ATen's), softmaxed and the k
largest picked by k rounds of max + first-index-of + knock-out; no sort, nothing read back to the
host (capturable in the decode graphs).

Past FUSED_ROUTER_MAX_TOKENS tokens every program re-reading the whole gate costs more than it
saves: the logits come from ATen's GEMM and the kernel runs the softmax top-k tail only (the same
kernel, FROM_X off). ``python3 -m fastdeploy_ext.bench.moe`` times the router three ways.

The GEMM's summation order is not cuBLAS's and the softmax's exp is libdevice's (accurate expf,
as ATen's) over a tree sum: logits and probabilities may differ from ATen's by a few ulps of fp32
(as cuBLAS's own differ between batch shapes, which choose different split-K), so an expert id
can differ only where two probabilities are that close (tests/test_triton_moe_routing.py).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .runtime import KernelTable, tl, triton

#: tokens per program of the softmax top-k tail alone (a [BT, E_PAD] tile of logits)
ROUTE_TOKENS = 16
#: tokens per program with the GEMM fused (each [E_PAD, BK] gate slice serves them all)
FUSED_ROUTE_TOKENS = 4
FUSED_ROUTE_BK = 64
#: at most this many tokens take the fused GEMM by default; more take ATen's GEMM + the tail
#: kernel. 0 until bench.moe's router columns show the fused launch ahead on a GPU: a first
#: version (a [4, 64, 32] product tile reduced on its last axis) took 89 us a call on the H200
#: at 64 tokens, against ~10 us for ATen's GEMM + the tail
FUSED_ROUTER_MAX_TOKENS = 0


if triton is not None:
    from triton.language.extra import libdevice

    # raw function, decorated on first use in the mode triton was imported in (jit_decorator)
    def _router_topk_kernel(LOGITS, X, G, W, IDS, T, H, s_lt, s_xt, s_ge, s_wt, s_it, SCALE,
                            E: tl.constexpr, E_PAD: tl.constexpr, K: tl.constexpr, BT: tl.constexpr,
                            BK: tl.constexpr, FROM_X: tl.constexpr, ACCURATE_EXP: tl.constexpr):
        rows = tl.program_id(0) * BT + tl.arange(0, BT)
        cols = tl.arange(0, E_PAD)
        rmask = rows < T
        cmask = cols < E
        valid = rmask[:, None] & cmask[None, :]
        if FROM_X:
            # logits[t, e] = sum_h x[t, h] * g[e, h] in fp32: each [E_PAD, BK] slice of the gate is
            # read once per program and used for its BT tokens (2D products, row by row)
            acc = tl.zeros([BT, E_PAD], dtype=tl.float32)
            slot = tl.arange(0, BT)
            for h0 in range(0, H, BK):
                hk = h0 + tl.arange(0, BK)
                hmask = hk < H
                gs = tl.load(G + cols[:, None] * s_ge + hk[None, :], mask=cmask[:, None] & hmask[None, :],
                             other=0.0).to(tl.float32)
                for r in tl.static_range(BT):
                    row = tl.program_id(0) * BT + r
                    xr = tl.load(X + row * s_xt + hk, mask=hmask & (row < T), other=0.0).to(tl.float32)
                    part = tl.sum(gs * xr[None, :], 1)
                    acc = tl.where(slot[:, None] == r, acc + part[None, :], acc)
            logit = tl.where(valid, acc, float("-inf"))
        else:
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


def _outputs(t: int, k: int, e: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    if not 0 < k <= e:
        raise ValueError(f"k={k} must be in 1..{e} (the number of experts)")
    return (torch.empty(t, k, dtype=torch.float32, device=device),
            torch.empty(t, k, dtype=torch.int64, device=device))


def _launch(t: int, e: int, k: int, scale: float, w, ids, *, logits=None, x=None, gate=None) -> None:
    if triton is None:
        raise RuntimeError("the Triton router needs triton")
    if t == 0:
        return
    e_pad = 16
    while e_pad < e:
        e_pad *= 2
    from_x = logits is None
    bt = FUSED_ROUTE_TOKENS if from_x else ROUTE_TOKENS
    dummy = w                      # the pointer the constexpr branch does not read
    _KERNELS["router_topk"][(triton.cdiv(t, bt),)](
        dummy if from_x else logits, x if from_x else dummy, gate if from_x else dummy, w, ids, t,
        x.shape[1] if from_x else 0, 0 if from_x else logits.stride(0), x.stride(0) if from_x else 0,
        gate.stride(0) if from_x else 0, w.stride(0), ids.stride(0), float(scale),
        E=e, E_PAD=e_pad, K=k, BT=bt, BK=FUSED_ROUTE_BK, FROM_X=from_x, ACCURATE_EXP=not _interpreted())


def softmax_topk(logits: torch.Tensor, k: int, scale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [T, k] fp32 = the k largest softmax probabilities of each row, descending, times
    ``scale``; their expert ids [T, k] int64), as ``(logits.softmax(-1).topk(k) * scale)``.
    ``logits``: [T, E] fp32 with a unit last stride."""
    if logits.dim() != 2 or logits.dtype != torch.float32 or logits.stride(-1) != 1:
        raise ValueError(f"logits must be [T, E] fp32 with a unit last stride, got {tuple(logits.shape)} "
                         f"{logits.dtype} strides {logits.stride()}")
    t, e = logits.shape
    w, ids = _outputs(t, k, e, logits.device)
    _launch(t, e, k, scale, w, ids, logits=logits)
    return w, ids


def router_topk(x: torch.Tensor, gate: torch.Tensor, k: int, scale: float = 1.0,
                fused: bool | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The whole router: ``softmax_topk(F.linear(x.float(), gate.float()), k, scale)``; with the
    GEMM in the same launch where ``fused`` (None: up to FUSED_ROUTER_MAX_TOKENS tokens). ``x``
    [T, H], ``gate`` [E, H], any float dtypes (upcast to fp32 in registers), unit last strides."""
    if x.dim() != 2 or gate.dim() != 2 or x.shape[1] != gate.shape[1]:
        raise ValueError(f"x [T, H] and gate [E, H] must share H, got {tuple(x.shape)} and {tuple(gate.shape)}")
    if not (x.is_floating_point() and gate.is_floating_point()) or x.stride(-1) != 1 or gate.stride(-1) != 1:
        raise ValueError(f"x and gate must be floating point with unit last strides, got {x.dtype} "
                         f"{x.stride()} and {gate.dtype} {gate.stride()}")
    t, e = x.shape[0], gate.shape[0]
    if not (t <= FUSED_ROUTER_MAX_TOKENS if fused is None else fused):
        return softmax_topk(F.linear(x.float(), gate.float()), k, scale)
    w, ids = _outputs(t, k, e, x.device)
    _launch(t, e, k, scale, w, ids, x=x, gate=gate)
    return w, ids


def _interpreted() -> bool:
    from .runtime import TRITON_INTERPRETED
    return bool(TRITON_INTERPRETED)


__all__ = ["FUSED_ROUTER_MAX_TOKENS", "ROUTE_TOKENS", "router_topk", "softmax_topk"]
