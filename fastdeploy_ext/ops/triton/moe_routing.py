"""Triton softmax top-k routing of a mixture of experts, in one launch.

A greedy softmax router's tail is softmax over the E expert logits, the top k of those
probabilities (descending) and a scale; ATen runs it as four to five kernels (softmax, a sort
for topk and its gathers, the multiply), which at decode batch sizes cost more than the router's
GEMM. Here one program takes ``BT`` tokens' rows of logits into registers, softmaxes them and
picks the k largest by k rounds of max + first-index-of + knock-out: no sort, nothing read back
to the host (capturable in the decode graphs).

The softmax's exp is libdevice's (accurate expf, as ATen's), its sum a tree over the row: a
probability may differ from ATen's by an ulp of fp32 (tests/test_triton_moe_routing.py bounds
it); the ids equal ATen's unless two probabilities tie, where topk's order is unspecified too.
"""
from __future__ import annotations

import torch

from .runtime import KernelTable, tl, triton

#: tokens per program (a [BT, E_PAD] tile of logits in registers)
ROUTE_TOKENS = 16


if triton is not None:
    from triton.language.extra import libdevice

    # raw function, decorated on first use in the mode triton was imported in (jit_decorator)
    def _softmax_topk_kernel(LOGITS, W, IDS, T, s_lt, s_wt, s_it, SCALE, E: tl.constexpr,
                             E_PAD: tl.constexpr, K: tl.constexpr, BT: tl.constexpr,
                             ACCURATE_EXP: tl.constexpr):
        rows = tl.program_id(0) * BT + tl.arange(0, BT)
        cols = tl.arange(0, E_PAD)
        rmask = rows < T
        valid = rmask[:, None] & (cols[None, :] < E)
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


_KERNELS = KernelTable(lambda: {"softmax_topk": _softmax_topk_kernel})


def softmax_topk(logits: torch.Tensor, k: int, scale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [T, k] fp32 = the k largest softmax probabilities of each row, descending, times
    ``scale``; their expert ids [T, k] int64), as ``(logits.softmax(-1).topk(k) * scale)``.
    ``logits``: [T, E] fp32 with a unit last stride."""
    if triton is None:
        raise RuntimeError("softmax_topk needs triton")
    if logits.dim() != 2 or logits.dtype != torch.float32 or logits.stride(-1) != 1:
        raise ValueError(f"logits must be [T, E] fp32 with a unit last stride, got {tuple(logits.shape)} "
                         f"{logits.dtype} strides {logits.stride()}")
    t, e = logits.shape
    if not 0 < k <= e:
        raise ValueError(f"k={k} must be in 1..{e} (the number of experts)")
    w = torch.empty(t, k, dtype=torch.float32, device=logits.device)
    ids = torch.empty(t, k, dtype=torch.int64, device=logits.device)
    if t == 0:
        return w, ids
    e_pad = 16
    while e_pad < e:
        e_pad *= 2
    _KERNELS["softmax_topk"][(triton.cdiv(t, ROUTE_TOKENS),)](
        logits, w, ids, t, logits.stride(0), w.stride(0), ids.stride(0), float(scale),
        E=e, E_PAD=e_pad, K=k, BT=ROUTE_TOKENS, ACCURATE_EXP=not _interpreted())
    return w, ids


def _interpreted() -> bool:
    from .runtime import TRITON_INTERPRETED
    return bool(TRITON_INTERPRETED)


__all__ = ["ROUTE_TOKENS", "softmax_topk"]
