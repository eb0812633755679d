"""One-launch varlen (block-diagonal, non-causal) attention for the vision encoder, in Triton:
the kernel, its block table and its launcher.

All images of a batch are packed into one token sequence of N tokens; every token attends to
all tokens of its own image only.  One launch covers every image: the grid is
``(total query blocks over all sequences, heads)`` and a host-built block table maps the first
program id to ``(seq_start, seq_len, q_block_start)``, so nothing is read back from the device.

q, k, v are ``[N, H, D]`` tensors read through their strides (the usual case is the three
strided views of a packed ``qkv = x @ Wqkv.T`` buffer, strides ``(3*H*D, D, 1)``); the output
is written as a contiguous ``[N, H, D]`` tensor.  The head dim is split into a power-of-two main
chunk plus a masked remainder chunk (D=72 -> 64 + 16, i.e. effective 80, not 128).  Softmax is
the flash-attention-2 online softmax in fp32 with exp2 and the scale folded into log2(e).
q and k arrive rotated: the 2D rotary is the caller's (ops/rotary.py; the attention backend
``triton_rope_varlen`` rotates them in place with one Triton pass just before the launch).

Importing this module needs no triton (see ops/triton/runtime.py); kernels are decorated on
first use.
"""

from __future__ import annotations

import math

import torch

from .runtime import KernelTable, require_launchable, tl, triton

__all__ = [
    "BLOCK_M",
    "DEFAULT_BLOCK_N",
    "build_block_table",
    "head_dim_chunks",
    "noop_block_table",
    "varlen_attention",
]

# Query rows per program.  The block table depends on it, so it is a fixed module constant
# (pass ``block_m=`` to both build_block_table and varlen_attention to use another value).
BLOCK_M = 128
# Key/value rows per inner-loop step.
DEFAULT_BLOCK_N = 64
_MAX_HEAD_DIM = 256
_LOG2E = 1.4426950408889634
_SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


# --------------------------------------------------------------------------------------------
# host helpers (pure Python / CPU torch, no device access)
# --------------------------------------------------------------------------------------------


def build_block_table(seq_lens: list[int], block_m: int = BLOCK_M, sort: bool = True) -> torch.Tensor:
    """Block table for :func:`varlen_attention`, built on the host from Python ints.

    Returns a CPU int32 tensor ``[num_blocks, 3]``; row ``i`` = ``(seq_start, seq_len,
    q_block_start)`` for program ``i``: the sequence's first token in the packed buffer, its
    length, and the first query row (relative to seq_start) of the block.  Zero-length
    sequences get no block.  With ``sort`` (default) blocks of longer sequences come first
    (stable, longest-processing-time-first order): each program's work is proportional to its
    sequence length, so heavy programs start early and light ones fill the tail.
    """
    if isinstance(block_m, bool) or not isinstance(block_m, int) or block_m < 16 or block_m & (block_m - 1):
        raise ValueError(f"block_m must be a power of two >= 16, got {block_m!r}")
    rows: list[tuple[int, int, int]] = []
    start = 0
    for i, n in enumerate(seq_lens):
        if isinstance(n, torch.Tensor):
            if n.numel() != 1 or n.device.type != "cpu":
                raise ValueError("seq_lens must be Python ints (or CPU scalars); got a device tensor")
            n = int(n)
        if isinstance(n, bool) or not isinstance(n, int):
            try:
                n = int(n)  # numpy ints
            except (TypeError, ValueError) as e:
                raise ValueError(f"seq_lens[{i}] is not an int: {n!r}") from e
        if n < 0:
            raise ValueError(f"seq_lens[{i}] is negative: {n}")
        for qs in range(0, n, block_m):
            rows.append((start, n, qs))
        start += n
    if start >= 2**31:
        raise ValueError(f"total tokens {start} does not fit int32")
    if sort:
        rows.sort(key=lambda r: -r[1])  # stable: keeps block order within a sequence
    if not rows:
        return torch.zeros((0, 3), dtype=torch.int32)
    return torch.tensor(rows, dtype=torch.int32)


def noop_block_table(rows: int, device, block_m: int = BLOCK_M) -> torch.Tensor:
    """``rows`` block-table rows that make no program do anything: a 1-token sequence at offset 0
    whose query block starts past its end stores nothing (each still computes one masked tile).
    Pads the table of a graph captured over a fixed grid."""
    return torch.tensor([[0, 1, block_m]], device=device, dtype=torch.int32).repeat(rows, 1)


def head_dim_chunks(head_dim: int) -> tuple[int, int]:
    """(D0, D1): power-of-two main chunk + power-of-two remainder chunk (0 if none).

    Both are >= 16 (tl.dot's minimum); columns at or past head_dim are padding (remapped onto
    valid columns on load, zeroed in q, not stored).
    72 -> (64, 16), 64 -> (64, 0), 80 -> (64, 16), 96 -> (64, 32), 8 -> (16, 0).
    """
    if head_dim <= 16:
        return 16, 0
    d0 = 1 << (head_dim.bit_length() - 1)
    rem = head_dim - d0
    if rem == 0:
        return d0, 0
    d1 = max(16, 1 << (rem - 1).bit_length())
    return d0, d1


def _default_config(head_dim: int, dtype: torch.dtype, block_m: int) -> tuple[int, int, int]:
    """(BLOCK_N, num_warps, num_stages) for Hopper; deterministic, keyed on head dim."""
    d0, d1 = head_dim_chunks(head_dim)
    eff = d0 + d1
    if dtype == torch.float32:
        return 32, 4, 2
    block_n = 64 if eff <= 128 else 32
    num_warps = 8 if block_m >= 128 else 4
    num_stages = 3 if eff <= 128 else 2
    return block_n, num_warps, num_stages


# --------------------------------------------------------------------------------------------
# kernels (raw functions; decorated on first use, see _KERNELS)
#
# Loads carry no masks at all: rows past the end of a sequence are clamped to its last row and
# head-dim columns past head_dim (in the padded remainder chunk) are mapped back onto valid
# columns.  Every address is therefore inside the sequence's own rows/head, the duplicated
# values are finite, and they are neutralised exactly: q's padded columns are zeroed (so k's
# duplicates add 0 to q.k), key columns past the sequence get -inf scores (p = 0, so v's
# duplicated rows add 0), and padded output rows/columns are not stored.  Besides saving the
# predicate work, this sidesteps Triton 3.6 miscompiles seen on H200 with 2-D masked loads of
# the 16-wide remainder chunk feeding the P@V dot (wrong dims 64..71 / out-of-range shared
# address in the row-sum reduction).
# --------------------------------------------------------------------------------------------

if triton is not None:

    def _chunk_cols(DSTART: tl.constexpr, DW: tl.constexpr, HEAD_DIM: tl.constexpr):
        """Column indices of chunk [DSTART, DSTART+DW), columns >= HEAD_DIM remapped inside."""
        offs_d = DSTART + tl.arange(0, DW)
        if DSTART + DW > HEAD_DIM:
            R: tl.constexpr = HEAD_DIM - DSTART  # valid columns in this chunk
            if DW <= 2 * R:
                # shift the padded tail back by R: keeps runs of R contiguous columns, so the
                # loads still vectorize (R = 8 for head_dim 72)
                offs_d = tl.where(offs_d < HEAD_DIM, offs_d, offs_d - R)
            else:
                offs_d = tl.minimum(offs_d, HEAD_DIM - 1)
        return offs_d

    def _load_tile(base, rows, stride_n, DSTART: tl.constexpr, DW: tl.constexpr, HEAD_DIM: tl.constexpr):
        """Unmasked [rows, chunk] tile load (rows must be valid)."""
        offs_d = _chunk_cols(DSTART, DW, HEAD_DIM)
        return tl.load(base + rows[:, None] * stride_n + offs_d[None, :])

    def _attn_step(
        acc0,
        acc1,
        m_i,
        l_i,
        q0,
        q1,
        k_base,
        v_base,
        start_n,
        seq_len,
        stride_kn,
        stride_vn,
        qk_scale,
        BLOCK_N: tl.constexpr,
        HEAD_DIM: tl.constexpr,
        D0: tl.constexpr,
        D1: tl.constexpr,
        MASKED: tl.constexpr,
        DOT_PREC: tl.constexpr,
    ):
        """One key/value block of the online softmax (MASKED only for the sequence's last block)."""
        offs_n = start_n + tl.arange(0, BLOCK_N)
        if MASKED:
            rows = tl.minimum(offs_n, seq_len - 1)  # clamp: duplicates of the last row
        else:
            rows = offs_n
        k0 = _load_tile(k_base, rows, stride_kn, 0, D0, HEAD_DIM)
        qk = tl.dot(q0, tl.trans(k0), input_precision=DOT_PREC)
        if D1 > 0:
            k1 = _load_tile(k_base, rows, stride_kn, D0, D1, HEAD_DIM)
            qk = tl.dot(q1, tl.trans(k1), qk, input_precision=DOT_PREC)
        if MASKED:
            qk = tl.where((offs_n < seq_len)[None, :], qk, float("-inf"))
        # online softmax in the log2 domain; qk_scale = softmax scale * log2(e)
        m_new = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)
        p = tl.math.exp2(qk * qk_scale - m_new[:, None])
        alpha = tl.math.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        p = p.to(q0.dtype)
        v0 = _load_tile(v_base, rows, stride_vn, 0, D0, HEAD_DIM)
        acc0 = tl.dot(p, v0, acc0 * alpha[:, None], input_precision=DOT_PREC)
        if D1 > 0:
            v1 = _load_tile(v_base, rows, stride_vn, D0, D1, HEAD_DIM)
            acc1 = tl.dot(p, v1, acc1 * alpha[:, None], input_precision=DOT_PREC)
        return acc0, acc1, m_new, l_i

    def _varlen_attn_fwd(
        Q,
        K,
        V,
        O,
        BT,
        stride_qn,
        stride_qh,
        stride_kn,
        stride_kh,
        stride_vn,
        stride_vh,
        stride_on,
        stride_oh,
        qk_scale,
        HEAD_DIM: tl.constexpr,
        D0: tl.constexpr,
        D1: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        ALIGN: tl.constexpr,
        DOT_PREC: tl.constexpr,
    ):
        pid = tl.program_id(0)
        head = tl.program_id(1)
        # strides arrive divided by ALIGN (elements per 16 bytes when every stride allows it,
        # else 1): multiplying back by the constexpr tells the compiler they are 16-byte
        # multiples, so row loads vectorize / use cp.async even for head stride 72.
        stride_qn = stride_qn * ALIGN
        stride_qh = stride_qh * ALIGN
        stride_kn = stride_kn * ALIGN
        stride_kh = stride_kh * ALIGN
        stride_vn = stride_vn * ALIGN
        stride_vh = stride_vh * ALIGN
        stride_on = stride_on * ALIGN
        stride_oh = stride_oh * ALIGN

        seq_start = tl.load(BT + pid * 3).to(tl.int64)
        seq_len = tl.load(BT + pid * 3 + 1)
        q_start = tl.load(BT + pid * 3 + 2)

        q_base = Q + seq_start * stride_qn + head * stride_qh
        k_base = K + seq_start * stride_kn + head * stride_kh
        v_base = V + seq_start * stride_vn + head * stride_vh
        o_base = O + seq_start * stride_on + head * stride_oh

        offs_m = q_start + tl.arange(0, BLOCK_M)
        m_mask = offs_m < seq_len
        q_rows = tl.minimum(offs_m, seq_len - 1)  # clamp: rows past the sequence are not stored
        offs_d0 = tl.arange(0, D0)
        q0 = _load_tile(q_base, q_rows, stride_qn, 0, D0, HEAD_DIM)
        if D0 > HEAD_DIM:
            q0 = tl.where((offs_d0 < HEAD_DIM)[None, :], q0, 0.0)
        acc0 = tl.zeros([BLOCK_M, D0], dtype=tl.float32)
        if D1 > 0:
            offs_d1 = D0 + tl.arange(0, D1)
            q1 = _load_tile(q_base, q_rows, stride_qn, D0, D1, HEAD_DIM)
            if D0 + D1 > HEAD_DIM:
                q1 = tl.where((offs_d1 < HEAD_DIM)[None, :], q1, 0.0)
            acc1 = tl.zeros([BLOCK_M, D1], dtype=tl.float32)
        else:
            q1 = q0
            acc1 = acc0
        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)

        # full key blocks without any masking, then the (at most one) partial block; both are
        # loops, like the two stages of Triton's fused-attention tutorial
        n_full = (seq_len // BLOCK_N) * BLOCK_N
        for start_n in range(0, n_full, BLOCK_N):
            acc0, acc1, m_i, l_i = _attn_step(
                acc0, acc1, m_i, l_i, q0, q1, k_base, v_base, start_n, seq_len,
                stride_kn, stride_vn, qk_scale, BLOCK_N, HEAD_DIM, D0, D1, False, DOT_PREC)
        for start_n in range(n_full, seq_len, BLOCK_N):
            acc0, acc1, m_i, l_i = _attn_step(
                acc0, acc1, m_i, l_i, q0, q1, k_base, v_base, start_n, seq_len,
                stride_kn, stride_vn, qk_scale, BLOCK_N, HEAD_DIM, D0, D1, True, DOT_PREC)

        inv_l = 1.0 / l_i
        o_rows = o_base + offs_m[:, None] * stride_on
        out0 = (acc0 * inv_l[:, None]).to(O.dtype.element_ty)
        if D0 > HEAD_DIM:
            tl.store(o_rows + offs_d0[None, :], out0, mask=m_mask[:, None] & (offs_d0[None, :] < HEAD_DIM))
        else:
            tl.store(o_rows + offs_d0[None, :], out0, mask=m_mask[:, None])
        if D1 > 0:
            out1 = (acc1 * inv_l[:, None]).to(O.dtype.element_ty)
            tl.store(o_rows + offs_d1[None, :], out1, mask=m_mask[:, None] & (offs_d1[None, :] < HEAD_DIM))


_KERNELS = KernelTable(lambda: {"fwd": _varlen_attn_fwd},
                       helpers=lambda: {"_chunk_cols": _chunk_cols, "_load_tile": _load_tile, "_attn_step": _attn_step})


# --------------------------------------------------------------------------------------------
# public entry point
# --------------------------------------------------------------------------------------------


def _is_aligned(x: torch.Tensor, vec: int) -> bool:
    """All non-unit strides but the last, and the base address, are 16-byte multiples."""
    return x.data_ptr() % 16 == 0 and all(
        st % vec == 0 or sz == 1 for st, sz in zip(x.stride()[:-1], x.shape[:-1]))


def _as_aligned(x: torch.Tensor, vec: int) -> torch.Tensor:
    """x itself when aligned, else a copy in a buffer whose last dim is padded to vec elements."""
    if _is_aligned(x, vec):
        return x
    d = x.shape[-1]
    buf = torch.empty((*x.shape[:-1], -(-d // vec) * vec), dtype=x.dtype, device=x.device)
    view = buf[..., :d]
    view.copy_(x)
    return view


def _check_3d(name: str, t, ref_shape=None, ref_dtype=None, ref_device=None) -> None:
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")  # noqa: TRY004
    if t.dim() != 3:
        raise ValueError(f"{name} must be [N, H, D] (3-D), got shape {tuple(t.shape)}")
    if t.stride(-1) != 1:
        raise ValueError(f"{name} must have stride(-1) == 1 (last dim contiguous), got strides {t.stride()}")
    if ref_shape is not None and tuple(t.shape) != tuple(ref_shape):
        raise ValueError(f"{name} shape {tuple(t.shape)} does not match q shape {tuple(ref_shape)} "
                         "(same number of tokens N, heads H and head dim D required)")
    if ref_dtype is not None and t.dtype != ref_dtype:
        raise ValueError(f"{name} dtype {t.dtype} does not match q dtype {ref_dtype}")
    if ref_device is not None and t.device != ref_device:
        raise ValueError(f"{name} is on {t.device}, q is on {ref_device}")


def varlen_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    block_table: torch.Tensor,
    max_seqlen: int,
    scale: float,
    out: torch.Tensor | None = None,
    *,
    block_m: int = BLOCK_M,
    block_n: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    maxnreg: int | None = None,
) -> torch.Tensor:
    """Block-diagonal (per-sequence, non-causal) attention over packed sequences, one launch.

    q, k, v: ``[N, H, D]`` fp16/bf16/fp32, any strides with ``stride(-1) == 1`` (e.g. views of a
    packed qkv buffer), q and k already rotated.  block_table: from :func:`build_block_table`
    (same ``block_m``), already on q's device.  max_seqlen: the longest sequence (host int;
    bounds int32 offset math).  scale: softmax scale (> 0).  out: optional contiguous
    ``[N, H, D]`` output of q's dtype.  block_m must match the table's; block_n / num_warps /
    num_stages override the defaults; maxnreg caps registers per thread (None or 0: no cap).
    Returns the contiguous ``[N, H, D]`` output.  Rows of tokens not covered by the block table
    are left untouched.  No host<->device synchronisation.
    """
    _check_3d("q", q)
    if q.dtype not in _SUPPORTED_DTYPES:
        raise ValueError(f"q dtype {q.dtype} not supported (float16, bfloat16, float32)")
    _check_3d("k", k, q.shape, q.dtype, q.device)
    _check_3d("v", v, q.shape, q.dtype, q.device)
    n_tok, n_heads, head_dim = q.shape
    if head_dim < 1 or head_dim > _MAX_HEAD_DIM:
        raise ValueError(f"head_dim {head_dim} not supported (1..{_MAX_HEAD_DIM})")
    if not isinstance(block_table, torch.Tensor):
        raise ValueError("block_table must be a torch.Tensor from build_block_table()")  # noqa: TRY004
    if block_table.device != q.device:
        raise ValueError(f"block_table is on {block_table.device} but q is on {q.device}; "
                         "move it once with block_table.to(q.device, non_blocking=True)")
    if block_table.dtype != torch.int32 or block_table.dim() != 2 or block_table.shape[1] != 3:
        raise ValueError(f"block_table must be int32 [num_blocks, 3], got {block_table.dtype} "
                         f"{tuple(block_table.shape)}")
    if not block_table.is_contiguous():
        raise ValueError("block_table must be contiguous")
    if isinstance(block_m, bool) or not isinstance(block_m, int) or block_m < 16 or block_m & (block_m - 1):
        raise ValueError(f"block_m must be a power of two >= 16, got {block_m!r}")
    try:
        max_seqlen = int(max_seqlen)
    except (TypeError, ValueError, RuntimeError) as e:
        raise ValueError(f"max_seqlen must be a host int, got {type(max_seqlen).__name__}") from e
    if max_seqlen < 0 or max_seqlen > n_tok:
        raise ValueError(f"max_seqlen {max_seqlen} out of range [0, N={n_tok}]")
    scale = float(scale)
    if not (scale > 0.0 and math.isfinite(scale)):
        raise ValueError(f"scale must be a finite positive float, got {scale}")

    if out is None:
        out = torch.empty((n_tok, n_heads, head_dim), dtype=q.dtype, device=q.device)
    else:
        _check_3d("out", out, q.shape, q.dtype, q.device)
        if not out.is_contiguous():
            raise ValueError(f"out must be contiguous [N, H, D], got strides {out.stride()}")

    d0, d1 = head_dim_chunks(head_dim)
    cfg_n, cfg_w, cfg_s = _default_config(head_dim, q.dtype, block_m)
    block_n = cfg_n if block_n is None else int(block_n)
    if block_n < 16 or block_n & (block_n - 1):
        raise ValueError(f"block_n must be a power of two >= 16, got {block_n}")
    num_warps = cfg_w if num_warps is None else int(num_warps)
    if num_warps not in (1, 2, 4, 8, 16):
        raise ValueError(f"num_warps must be a power of two <= 16, got {num_warps}")
    num_stages = cfg_s if num_stages is None else int(num_stages)
    if num_stages < 2:
        # num_stages=1 (no cp.async pipelining) miscompiled on H200 with triton 3.6 (illegal
        # shared-memory address for head_dim 72, BLOCK_N 64), so it is not offered
        raise ValueError(f"num_stages must be >= 2, got {num_stages}")

    num_blocks = block_table.shape[0]
    if num_blocks == 0 or n_tok == 0 or n_heads == 0:
        return out

    require_launchable("varlen_attention", q)

    # int32 in-sequence offsets: rows * stride must fit
    max_stride = max(q.stride(0), k.stride(0), v.stride(0), out.stride(0))
    if (max(max_seqlen, block_m) + 1) * max_stride >= 2**31:
        raise ValueError(f"max_seqlen {max_seqlen} x row stride {max_stride} overflows int32 offsets")

    # Every row/head stride and base pointer must be a 16-byte multiple: the kernel tells the
    # compiler so (vectorized loads, cp.async pipelining).  Packed-qkv views and contiguous
    # tensors always are (D=72: strides 3456/1152 and 72 elements); anything else (odd strides
    # or offsets) goes through an aligned copy here, because triton 3.6's code for unaligned
    # (non-cp.async) loads of this kernel was seen to fault on H200.
    vec = 16 // q.element_size()
    q, k, v = _as_aligned(q, vec), _as_aligned(k, vec), _as_aligned(v, vec)
    out_k = out if _is_aligned(out, vec) else _as_aligned(torch.empty_like(out), vec)

    launch_opts = {"maxnreg": int(maxnreg)} if maxnreg else {}
    _KERNELS["fwd"][(num_blocks, n_heads)](
        q, k, v, out_k, block_table,
        q.stride(0) // vec, q.stride(1) // vec,
        k.stride(0) // vec, k.stride(1) // vec,
        v.stride(0) // vec, v.stride(1) // vec,
        out_k.stride(0) // vec, out_k.stride(1) // vec,
        scale * _LOG2E,
        HEAD_DIM=head_dim,
        D0=d0,
        D1=d1,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        ALIGN=vec,
        DOT_PREC="ieee" if q.dtype == torch.float32 else "tf32",
        num_warps=num_warps,
        num_stages=num_stages,
        **launch_opts,
    )
    if out_k is not out:
        out.copy_(out_k)
    return out
