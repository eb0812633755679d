"""Memory-bound Triton kernels around the encoder's GEMMs: fused residual add + LayerNorm, and
the 2D rotary applied in place to q and k of the packed qkv buffer in one launch.

Why these two: on the H200 an eager layer spends its non-GEMM time in separate elementwise
launches (bias add, residual add, LayerNorm, rotary of q, rotary of k), each reading and writing
the whole [N, 1152] activation.  Here the residual add, the GEMM's bias and the next LayerNorm
are one pass (x + delta + bias -> x, LayerNorm(x) -> y), and q and k are rotated together with
cos/sin read once per token instead of once per head.

Both have a torch fallback with the same arithmetic (used off CUDA and by the tests as the
reference).  Under TRITON_INTERPRET=1 the kernels also run on CPU tensors (tests).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from . import triton_attention as _ta

__all__ = ["add_layer_norm", "add_layer_norm_torch", "rotary_q_and_k_in_place", "rotary_qk_in_place",
           "rotary_qk_in_place_torch", "kernels_usable"]

_ROWS_PER_PROGRAM = 4          # rows of [N, hidden] per add+LN program (amortises the w/b loads)
_ADD_LN_WARPS = 8
_ROTARY_TOKENS = 32            # tokens per rotary program
_ROTARY_HEADS = 4              # heads per rotary program (cos/sin reloaded per group, from L2)

if _ta.triton is not None:
    tl = _ta.tl

    def _add_ln_kernel(
        X, DELTA, BIAS, W, B, XOUT, Y, n_rows,
        stride_x, stride_d, stride_xo, stride_y, eps,
        HIDDEN: tl.constexpr, BLOCK: tl.constexpr, ROWS: tl.constexpr,
        HAS_DELTA: tl.constexpr, HAS_BIAS: tl.constexpr,
    ):
        """XOUT = X + DELTA + BIAS (rounded to X's dtype); Y = LayerNorm(XOUT) * W + B.
        XOUT may alias X: each element is read before it is written, by the same program."""
        pid = tl.program_id(0)
        cols = tl.arange(0, BLOCK)
        cmask = cols < HIDDEN
        rows = pid * ROWS + tl.arange(0, ROWS)
        rmask = rows < n_rows
        mask = rmask[:, None] & cmask[None, :]
        rows64 = rows.to(tl.int64)
        x = tl.load(X + rows64[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        if HAS_DELTA:
            x += tl.load(DELTA + rows64[:, None] * stride_d + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        if HAS_BIAS:
            x += tl.load(BIAS + cols, mask=cmask, other=0.0).to(tl.float32)[None, :]
        # the residual stream lives in the model dtype: normalise the rounded value, as the
        # unfused `x = x + linear(..)` followed by `layer_norm(x)` does
        xr = x.to(XOUT.dtype.element_ty)
        if HAS_DELTA or HAS_BIAS:
            tl.store(XOUT + rows64[:, None] * stride_xo + cols[None, :], xr, mask=mask)
        x = xr.to(tl.float32)
        mean = tl.sum(x, axis=1) / HIDDEN
        xc = tl.where(mask, x - mean[:, None], 0.0)
        var = tl.sum(xc * xc, axis=1) / HIDDEN
        rstd = 1.0 / tl.sqrt(var + eps)
        w = tl.load(W + cols, mask=cmask, other=0.0).to(tl.float32)
        b = tl.load(B + cols, mask=cmask, other=0.0).to(tl.float32)
        y = xc * rstd[:, None] * w[None, :] + b[None, :]
        tl.store(Y + rows64[:, None] * stride_y + cols[None, :], y.to(Y.dtype.element_ty), mask=mask)

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


_KERNELS: dict[str, object] = {}


def _kernel(name: str):
    if name not in _KERNELS:
        raw = {"add_ln": _add_ln_kernel, "rotary_qk": _rotary_qk_kernel}[name]
        _KERNELS[name] = _ta.jit_decorator()(raw)
    return _KERNELS[name]


def kernels_usable(t: torch.Tensor) -> bool:
    """The Triton kernels can run on t's device (CUDA, or CPU under the interpreter)."""
    if _ta.triton is None:
        return False
    if _ta._TRITON_INTERPRETED:
        return t.device.type == "cpu"
    return t.device.type == "cuda"


# ----------------------------------------------------------------------------- add + LayerNorm
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
    LayerNorm and x is returned as is.  Falls back to ATen off CUDA.  ``tuning``: (rows per
    program, warps) for `bench layers --tune`; the defaults are reasoned, not yet tuned.
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
    has_sum = delta is not None or bias is not None
    res = (out if out is not None else torch.empty_like(x)) if has_sum else x
    y = torch.empty_like(x)
    if n == 0:
        return res, y
    block = _ta.triton.next_power_of_2(hidden)
    rows, warps = tuning or (_ROWS_PER_PROGRAM, _ADD_LN_WARPS)
    _kernel("add_ln")[(_ta.triton.cdiv(n, rows),)](
        x, delta if delta is not None else x, bias if bias is not None else weight, weight, ln_bias, res, y, n,
        x.stride(0), delta.stride(0) if delta is not None else 0, res.stride(0), y.stride(0), float(eps),
        HIDDEN=hidden, BLOCK=block, ROWS=rows, HAS_DELTA=delta is not None, HAS_BIAS=bias is not None,
        num_warps=warps,
    )
    return res, y


# ----------------------------------------------------------------------------- rotary on q and k
def rotary_qk_in_place_torch(qk: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Reference of :func:`rotary_qk_in_place`: the same fp32 arithmetic in ATen ops."""
    from .rotary import rotary_out_of_place
    qk.copy_(rotary_out_of_place(qk, cos, sin))
    return qk


def rotary_qk_in_place(qk: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                       tuning: tuple[int, int, int] | None = None) -> torch.Tensor:
    """Rotate every head of ``qk`` ([N, heads, D], e.g. the q and k heads of the packed qkv
    buffer viewed as ``qkv[:, :2*H*D].view(N, 2*H, D)``) in place, in one launch.

    cos, sin: fp32 [N, D] laid out as [h, w, h, w] frequencies (rotate_half pairs column j with
    j + D/2).  Returns qk.  Falls back to ATen off CUDA.  ``tuning``: (tokens per program, heads
    per program, warps) for `bench layers --tune`; the defaults are reasoned, not yet tuned
    (four heads per program took the pass from 0.160 to 0.105 ms on a page, eager timing).
    """
    if qk.dim() != 3 or qk.stride(-1) != 1:
        raise ValueError(f"qk must be [N, heads, D] with a contiguous last dim, got {tuple(qk.shape)} {qk.stride()}")
    n, heads, d = qk.shape
    if d % 2:
        raise ValueError(f"rotary needs an even head dim, got {d}")
    for name, t in (("cos", cos), ("sin", sin)):
        if tuple(t.shape) != (n, d) or t.dtype != torch.float32 or t.stride(-1) != 1 or t.device != qk.device:
            raise ValueError(f"{name} must be fp32 [N, D] = {(n, d)} with a contiguous last dim, "
                             f"got {t.dtype} {tuple(t.shape)}")
    if not kernels_usable(qk):
        return rotary_qk_in_place_torch(qk, cos, sin)
    if n == 0:
        return qk
    half = d // 2
    block_t, group, warps = tuning or (_ROTARY_TOKENS, _ROTARY_HEADS, 4)
    group = max(g for g in range(1, min(group, heads) + 1) if heads % g == 0)   # a divisor of heads
    _kernel("rotary_qk")[(_ta.triton.cdiv(n, block_t), heads // group)](
        qk, cos, sin, n, qk.stride(0), qk.stride(1), cos.stride(0), sin.stride(0),
        HEADS_PER_PROGRAM=group, HALF=half, HALF_P=_ta.triton.next_power_of_2(half), BLOCK_T=block_t,
        num_warps=warps,
    )
    return qk


def _adjacent_heads(q: torch.Tensor, k: torch.Tensor) -> bool:
    """k's heads directly follow q's in every row of one buffer (q/k views of a packed qkv)."""
    h, d = q.shape[1], q.shape[2]
    return (q.stride() == k.stride() and q.stride(1) == d and q.untyped_storage().data_ptr() ==
            k.untyped_storage().data_ptr() and k.data_ptr() - q.data_ptr() == h * d * q.element_size()
            and q.stride(0) >= 2 * h * d)


def rotary_q_and_k_in_place(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """Rotate q and k ([N, H, D] each) in place: one launch over both when k's heads directly
    follow q's in one buffer (the packed qkv's views), else one launch each."""
    if _adjacent_heads(q, k):
        n, h, d = q.shape
        rotary_qk_in_place(q.as_strided((n, 2 * h, d), q.stride()), cos, sin)
    else:
        rotary_qk_in_place(q, cos, sin)
        rotary_qk_in_place(k, cos, sin)
