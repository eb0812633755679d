"""Memory-bound Triton passes around the encoder's GEMMs (the "fused layers" of the plan):
residual add + bias + LayerNorm in one pass, and the 2D rotary applied in place to q and k of the
packed qkv buffer in one launch.

Why these two: on the H200 an eager layer spends its non-GEMM time in separate elementwise
launches (bias add, residual add, LayerNorm, rotary of q, rotary of k), each reading and writing
the whole [N, 1152] activation.  Here the residual add, the GEMM's bias and the next LayerNorm
are one pass (x + delta + bias -> x, LayerNorm(x) -> y), and q and k are rotated together with
cos/sin read once per token instead of once per head.

These are the raw launchers: callers go through ops/norm.py and ops/rotary.py, which validate
the arguments and fall back to ATen (same arithmetic) where the kernels cannot run.  Under
TRITON_INTERPRET=1 the kernels also run on CPU tensors (tests).
"""
from __future__ import annotations

import torch

from .runtime import KernelTable, tl, triton

__all__ = ["add_layer_norm_triton", "rotary_qk_in_place_triton"]

_ROWS_PER_PROGRAM = 4          # rows of [N, hidden] per add+LN program (amortises the w/b loads)
_ADD_LN_WARPS = 8
_ROTARY_TOKENS = 32            # tokens per rotary program
_ROTARY_HEADS = 4              # heads per rotary program (cos/sin reloaded per group, from L2)

if triton is not None:

    def _add_ln_kernel(
        X, DELTA, BIAS, W, B, XOUT, Y, ROWS_OF_Y, DELTA_ROWS, n_rows,
        stride_x, stride_d, stride_xo, stride_y, eps,
        HIDDEN: tl.constexpr, BLOCK: tl.constexpr, ROWS: tl.constexpr,
        HAS_DELTA: tl.constexpr, HAS_BIAS: tl.constexpr, Y_GATHER: tl.constexpr, DELTA_GATHER: tl.constexpr,
    ):
        """XOUT = X + DELTA + BIAS (rounded to X's dtype); Y = LayerNorm(XOUT) * W + B.
        XOUT may alias X: each element is read before it is written, by the same program.

        The programs run over Y's ``n_rows`` rows. With Y_GATHER, Y row r is x row
        ROWS_OF_Y[r], or a zero row where that is -1 (SAM's windows: Y in window order with the
        padding, x in grid order); each x row must appear once. With DELTA_GATHER, x row i adds
        DELTA row DELTA_ROWS[i] (the window-ordered attention output back onto the grid)."""
        pid = tl.program_id(0)
        cols = tl.arange(0, BLOCK)
        cmask = cols < HIDDEN
        rows = pid * ROWS + tl.arange(0, ROWS)
        rmask = rows < n_rows
        if Y_GATHER:
            src = tl.load(ROWS_OF_Y + rows, mask=rmask, other=-1)
            rmask_x = src >= 0
            xrows = tl.maximum(src, 0).to(tl.int64)
        else:
            rmask_x = rmask
            xrows = rows.to(tl.int64)
        mask = rmask_x[:, None] & cmask[None, :]
        x = tl.load(X + xrows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        if HAS_DELTA:
            if DELTA_GATHER:
                drows = tl.load(DELTA_ROWS + xrows, mask=rmask_x, other=0).to(tl.int64)
            else:
                drows = xrows
            x += tl.load(DELTA + drows[:, None] * stride_d + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        if HAS_BIAS:
            x += tl.load(BIAS + cols, mask=cmask, other=0.0).to(tl.float32)[None, :]
        # the residual stream lives in the model dtype: normalise the rounded value, as the
        # unfused `x = x + linear(..)` followed by `layer_norm(x)` does
        xr = x.to(XOUT.dtype.element_ty)
        if HAS_DELTA or HAS_BIAS:
            tl.store(XOUT + xrows[:, None] * stride_xo + cols[None, :], xr, mask=mask)
        x = xr.to(tl.float32)
        mean = tl.sum(x, axis=1) / HIDDEN
        xc = tl.where(mask, x - mean[:, None], 0.0)
        var = tl.sum(xc * xc, axis=1) / HIDDEN
        rstd = 1.0 / tl.sqrt(var + eps)
        w = tl.load(W + cols, mask=cmask, other=0.0).to(tl.float32)
        b = tl.load(B + cols, mask=cmask, other=0.0).to(tl.float32)
        y = tl.where(mask, xc * rstd[:, None] * w[None, :] + b[None, :], 0.0)
        rows64 = rows.to(tl.int64)
        tl.store(Y + rows64[:, None] * stride_y + cols[None, :], y.to(Y.dtype.element_ty),
                 mask=rmask[:, None] & cmask[None, :])

    def _rotary_qk_kernel(
        QK, COS, SIN, n_tok, stride_n, stride_h, stride_cn, stride_sn,
        HEADS_PER_PROGRAM: tl.constexpr, HALF: tl.constexpr, HALF_P: tl.constexpr, BLOCK_T: tl.constexpr,
    ):
        """In place: x[:, h] = x*cos + rotate_half(x)*sin (fp32, cast back) for a group of
        heads of a [N, heads, 2*HALF] strided view. The head loop is unrolled so every load of
        the group is in flight at once (a rolled loop left this memory-bound pass latency-bound);
        cos/sin rows are loaded once per group."""
        pid_t = tl.program_id(0)
        head0 = tl.program_id(1) * HEADS_PER_PROGRAM
        rows = (pid_t * BLOCK_T + tl.arange(0, BLOCK_T)).to(tl.int64)
        j = tl.arange(0, HALF_P)
        mask = (rows < n_tok)[:, None] & (j < HALF)[None, :]
        c_rows = COS + rows[:, None] * stride_cn + j[None, :]
        s_rows = SIN + rows[:, None] * stride_sn + j[None, :]
        c1 = tl.load(c_rows, mask=mask, other=0.0)
        c2 = tl.load(c_rows + HALF, mask=mask, other=0.0)
        s1 = tl.load(s_rows, mask=mask, other=0.0)
        s2 = tl.load(s_rows + HALF, mask=mask, other=0.0)
        base = QK + rows[:, None] * stride_n + j[None, :]
        for h in tl.static_range(HEADS_PER_PROGRAM):
            p1 = base + (head0 + h) * stride_h
            x1 = tl.load(p1, mask=mask, other=0.0)
            x2 = tl.load(p1 + HALF, mask=mask, other=0.0)
            f1 = x1.to(tl.float32)
            f2 = x2.to(tl.float32)
            # rotate_half([x1, x2]) = [-x2, x1]
            tl.store(p1, (f1 * c1 - f2 * s1).to(x1.dtype), mask=mask)
            tl.store(p1 + HALF, (f2 * c2 + f1 * s2).to(x1.dtype), mask=mask)


_KERNELS = KernelTable(lambda: {"add_ln": _add_ln_kernel, "rotary_qk": _rotary_qk_kernel})


def add_layer_norm_triton(x: torch.Tensor, delta: torch.Tensor | None, bias: torch.Tensor | None,
                          weight: torch.Tensor, ln_bias: torch.Tensor, eps: float, out: torch.Tensor | None,
                          tuning: tuple[int, int] | None = None, rows_of_y: torch.Tensor | None = None,
                          delta_rows: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The launch behind ops.norm.add_layer_norm (arguments already validated there).
    ``tuning``: (rows per program, warps) for `bench layers --tune`; the defaults are reasoned,
    not yet tuned. ``rows_of_y`` / ``delta_rows``: int32 row maps (see the kernel)."""
    n, hidden = x.shape
    has_sum = delta is not None or bias is not None
    res = (out if out is not None else torch.empty_like(x)) if has_sum else x
    n_y = n if rows_of_y is None else rows_of_y.shape[0]
    y = torch.empty((n_y, hidden), dtype=x.dtype, device=x.device)
    if n_y == 0:
        return res, y
    block = triton.next_power_of_2(hidden)
    rows, warps = tuning or (_ROWS_PER_PROGRAM, _ADD_LN_WARPS)
    _KERNELS["add_ln"][(triton.cdiv(n_y, rows),)](
        x, delta if delta is not None else x, bias if bias is not None else weight, weight, ln_bias, res, y,
        rows_of_y if rows_of_y is not None else weight, delta_rows if delta_rows is not None else weight, n_y,
        x.stride(0), delta.stride(0) if delta is not None else 0, res.stride(0), y.stride(0), float(eps),
        HIDDEN=hidden, BLOCK=block, ROWS=rows, HAS_DELTA=delta is not None, HAS_BIAS=bias is not None,
        Y_GATHER=rows_of_y is not None, DELTA_GATHER=delta_rows is not None,
        num_warps=warps,
    )
    return res, y


def rotary_qk_in_place_triton(qk: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                              tuning: tuple[int, int, int] | None = None) -> torch.Tensor:
    """The launch behind ops.rotary.rotary_qk_in_place (arguments already validated there).
    ``tuning``: (tokens per program, heads per program, warps) for `bench layers --tune`; the
    defaults are reasoned, not yet tuned (four heads per program took the pass from 0.160 to
    0.105 ms on a page, eager timing)."""
    n, heads, d = qk.shape
    if n == 0:
        return qk
    half = d // 2
    block_t, group, warps = tuning or (_ROTARY_TOKENS, _ROTARY_HEADS, 4)
    group = max(g for g in range(1, min(group, heads) + 1) if heads % g == 0)   # a divisor of heads
    _KERNELS["rotary_qk"][(triton.cdiv(n, block_t), heads // group)](
        qk, cos, sin, n, qk.stride(0), qk.stride(1), cos.stride(0), sin.stride(0),
        HEADS_PER_PROGRAM=group, HALF=half, HALF_P=triton.next_power_of_2(half), BLOCK_T=block_t,
        num_warps=warps,
    )
    return qk
