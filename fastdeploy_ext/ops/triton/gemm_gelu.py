"""Triton GEMM with a bias + exact (erf) GELU epilogue: y = GELU(x @ w.T + b).

cuBLASLt's GELU epilogue is the tanh approximation; a model trained with the erf GELU (SAM's
MLP in DeepSeek-OCR-2) would otherwise pay for the GELU as its own kernel, which reads and
writes the [tokens, 4d] hidden once more: on the H200 at 16 six-crop pages, 15 ms of a 250 ms
tower pass (12 layers x 287k tokens x 3072 columns). Here the GELU is applied to the fp32
accumulator before the one rounding to the output dtype (ATen rounds the GEMM's output first,
then the GELU's: ours is the more exact, and equal within a unit of the output's last place).

One program per (row block, column block), the row blocks grouped ``group_m`` at a time so the
column blocks of neighbouring rows share the weight tiles in L2. Rows and columns past the end
are wrapped (``% M``, ``% N``) for the loads, so the reduction loop runs without masks when K is
a multiple of the K tile; the store is masked. Tested against ATen's two ops in the Triton
interpreter on the CPU (tests/test_gemm_gelu.py) and on CUDA there.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .runtime import KernelTable, interpreted, tl, triton

__all__ = ["GemmTiles", "linear_gelu_erf", "pick_tiles"]


@dataclass(frozen=True)
class GemmTiles:
    """One launch's tiles: rows, columns and reduction step per program, row blocks per L2
    group, warps and pipeline stages."""
    block_m: int
    block_n: int
    block_k: int
    group_m: int = 8
    num_warps: int = 8
    num_stages: int = 3


def pick_tiles(m: int, n: int, k: int) -> GemmTiles:
    """Hopper-sized tiles (128 x 256 x 64, 8 warps: the wgmma shape Triton lowers to) for the
    long GEMMs this kernel is for (SAM's fc1: ~10^5 rows); narrower ones for small batches, where
    more programs than SMs matter more than tile efficiency. bench: python3 -m
    fastdeploy_ext.bench.gemm_gelu (ours vs ATen addmm + GELU per shape)."""
    if m >= 8192 and n >= 256:
        return GemmTiles(128, 256, 64, group_m=8, num_warps=8, num_stages=3)
    if m >= 1024:
        return GemmTiles(128, 128, 64, group_m=8, num_warps=8, num_stages=3)
    return GemmTiles(64, 64, 64, group_m=8, num_warps=4, num_stages=3)


def linear_gelu_erf(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, *,
                    tiles: GemmTiles | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """GELU(x @ w.T + b) with the erf GELU, x [M, K] (rows contiguous), w [N, K] (an
    nn.Linear's weight), b [N] or None; the output [M, N] in x's dtype (``out``: written into)."""
    from .runtime import require_launchable
    require_launchable("linear_gelu_erf", x)
    if x.dim() != 2 or w.dim() != 2 or x.shape[1] != w.shape[1]:
        raise ValueError(f"linear_gelu_erf: x {tuple(x.shape)} and w {tuple(w.shape)} do not multiply as x @ w.T")
    if x.stride(1) != 1 or w.stride(1) != 1:
        raise ValueError("linear_gelu_erf: x and w need contiguous rows (stride 1 along K)")
    m, k = x.shape
    n = w.shape[0]
    if out is None:
        out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    t = tiles or pick_tiles(m, n, k)
    grid = (triton.cdiv(m, t.block_m) * triton.cdiv(n, t.block_n),)
    launch = {} if interpreted() else {"num_warps": t.num_warps, "num_stages": t.num_stages}
    _KERNELS["linear_gelu"][grid](
        x, w, b if b is not None else x, out, m, n, k, x.stride(0), w.stride(0), out.stride(0),
        HAS_BIAS=b is not None, EVEN_K=k % t.block_k == 0, F32_IEEE=x.dtype == torch.float32,
        BM=t.block_m, BN=t.block_n, BK=t.block_k, GROUP_M=t.group_m, **launch)
    return out


if triton is not None:
    def _linear_gelu_kernel(X, W, B, Y, M, N, K, sxm, swn, sym, HAS_BIAS: tl.constexpr, EVEN_K: tl.constexpr,
                            F32_IEEE: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                            GROUP_M: tl.constexpr):
        pid = tl.program_id(0)
        blocks_m, blocks_n = tl.cdiv(M, BM), tl.cdiv(N, BN)
        per_group = GROUP_M * blocks_n
        first_m = (pid // per_group) * GROUP_M
        group_rows = tl.minimum(blocks_m - first_m, GROUP_M)
        pid_m = first_m + (pid % per_group) % group_rows
        pid_n = (pid % per_group) // group_rows
        rm = pid_m * BM + tl.arange(0, BM)
        rn = pid_n * BN + tl.arange(0, BN)
        am = tl.max_contiguous(tl.multiple_of(rm % M, BM), BM)        # wrapped: loads need no row mask
        wn = tl.max_contiguous(tl.multiple_of(rn % N, BN), BN)
        rk = tl.arange(0, BK)
        a_ptr = X + am[:, None].to(tl.int64) * sxm + rk[None, :]
        b_ptr = W + wn[None, :].to(tl.int64) * swn + rk[:, None]       # [BK, BN]: w read as w.T
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        for k0 in range(0, K, BK):
            if EVEN_K:
                a = tl.load(a_ptr)
                b = tl.load(b_ptr)
            else:
                a = tl.load(a_ptr, mask=rk[None, :] < K - k0, other=0.0)
                b = tl.load(b_ptr, mask=rk[:, None] < K - k0, other=0.0)
            if F32_IEEE:
                acc = tl.dot(a, b, acc, input_precision="ieee")
            else:
                acc = tl.dot(a, b, acc)
            a_ptr += BK
            b_ptr += BK
        if HAS_BIAS:
            acc += tl.load(B + wn).to(tl.float32)[None, :]
        y = 0.5 * acc * (1.0 + tl.math.erf(acc * 0.7071067811865476))
        mask = (rm[:, None] < M) & (rn[None, :] < N)
        tl.store(Y + rm[:, None].to(tl.int64) * sym + rn[None, :], y.to(Y.dtype.element_ty), mask=mask)

    def _raw_kernels():
        return {"linear_gelu": _linear_gelu_kernel}
else:  # pragma: no cover - no triton
    def _raw_kernels():
        return {}

_KERNELS = KernelTable(_raw_kernels)
