"""One-launch varlen (block-diagonal, non-causal) attention for the vision encoder, in Triton.

All images of a batch are packed into one token sequence of N tokens; every token attends to
all tokens of its own image only.  One launch covers every image: the grid is
``(total query blocks over all sequences, heads)`` and a host-built block table maps the first
program id to ``(seq_start, seq_len, q_block_start)``, so nothing is read back from the device.

q, k, v are ``[N, H, D]`` tensors read through their strides (the usual case is the three
strided views of a packed ``qkv = x @ Wqkv.T`` buffer, strides ``(3*H*D, D, 1)``); the output
is written as a contiguous ``[N, H, D]`` tensor.  The head dim is split into a power-of-two main
chunk plus a masked remainder chunk (D=72 -> 64 + 16, i.e. effective 80, not 128).  Softmax is
the flash-attention-2 online softmax in fp32 with exp2 and the scale folded into log2(e).

Optionally the 2D rotary embedding (``x*cos + rotate_half(x)*sin`` in fp32, cast back to the
input dtype) is applied to q and k: to tiles right after they are loaded, or in an elementwise
pre-pass launch (see ``rotary_mode``).

Triton is imported guarded: this module imports fine without it; see :func:`triton_available`.
Kernels are decorated on first use.  On CPU tensors the kernel runs under the Triton
interpreter, which needs ``TRITON_INTERPRET=1`` set before triton is first imported.
"""

from __future__ import annotations

import functools
import math
import os

import torch

try:  # guarded: the module must import where triton is absent
    import triton
    import triton.language as tl

    _TRITON_IMPORT_ERROR: str | None = None
except Exception as _e:  # noqa: BLE001  # pragma: no cover - any import failure means "no triton"
    triton = None
    tl = None
    _TRITON_IMPORT_ERROR = f"{type(_e).__name__}: {_e}"

__all__ = [
    "BLOCK_M",
    "DEFAULT_BLOCK_N",
    "build_block_table",
    "head_dim_chunks",
    "triton_available",
    "varlen_attention",
]

# Query rows per program.  The block table depends on it, so it is a fixed module constant
# (pass ``block_m=`` to both build_block_table and varlen_attention to use another value).
BLOCK_M = 128
# Key/value rows per inner-loop step.
DEFAULT_BLOCK_N = 64
_MAX_HEAD_DIM = 256
# rotary_mode="auto": above this max_seqlen rotate q and k in a pre-pass (see varlen_attention)
_ROTARY_PREPASS_MIN_SEQLEN = 2048
_LOG2E = 1.4426950408889634
_SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


# --------------------------------------------------------------------------------------------
# host helpers (pure Python / CPU torch, no device access)
# --------------------------------------------------------------------------------------------


def _env_interpret() -> bool:
    """TRITON_INTERPRET as triton reads it (at call time)."""
    if triton is not None:
        knobs = getattr(triton, "knobs", None)
        if knobs is not None:
            return bool(knobs.runtime.interpret)
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "on", "yes")


def _detect_imported_mode() -> bool | None:
    """Was triton imported in interpreter mode?  (None if triton is absent.)

    triton decorates its own standard library (tl.zeros, tl.cdiv, ...) when ``triton`` is first
    imported, according to TRITON_INTERPRET at that moment; a kernel can only run in that same
    mode, so this, not the variable's current value, decides how our kernels are built.
    """
    if triton is None:
        return None
    try:
        from triton.runtime.interpreter import InterpretedFunction
        from triton.runtime.jit import JITFunction

        std = getattr(tl, "standard", None)
        fn = getattr(std, "zeros", None) or getattr(std, "cdiv", None)
        if isinstance(fn, InterpretedFunction):
            return True
        if isinstance(fn, JITFunction):
            return False
    except ImportError:  # pragma: no cover - layout of another triton version
        return _env_interpret()
    return _env_interpret()


_TRITON_INTERPRETED = _detect_imported_mode()


def triton_available() -> tuple[bool, str]:
    """(usable, reason): triton importable and either a CUDA device or TRITON_INTERPRET=1.

    TRITON_INTERPRET=1 must be set before ``triton`` is first imported in the process.
    """
    if triton is None:
        return False, f"triton is not importable ({_TRITON_IMPORT_ERROR})"
    if _TRITON_INTERPRETED:
        return True, f"triton {triton.__version__} in interpreter mode (TRITON_INTERPRET=1)"
    if _env_interpret():
        return False, (
            "TRITON_INTERPRET=1 was set after triton had been imported in compiled mode; the "
            "interpreter needs it set before the first `import triton` (use a fresh process)"
        )
    if torch.cuda.is_available():
        return True, f"triton {triton.__version__} with CUDA device {torch.cuda.get_device_name()}"
    return False, (
        f"triton {triton.__version__} is importable but no CUDA device is present "
        "(set TRITON_INTERPRET=1 before importing triton to run on CPU tensors via the interpreter)"
    )


@functools.lru_cache(maxsize=1)
def _triton_available_cached() -> tuple[bool, str]:
    return triton_available()


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


def _default_config(head_dim: int, dtype: torch.dtype, block_m: int, rotary: bool) -> tuple[int, int, int]:
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
# kernels (raw functions; decorated on first use, see _get_kernel)
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

    def _load_tile(
        base,
        rows,
        stride_n,
        cos_base,
        sin_base,
        stride_cn,
        stride_sn,
        DSTART: tl.constexpr,
        DW: tl.constexpr,
        HEAD_DIM: tl.constexpr,
        ROTARY: tl.constexpr,
    ):
        """Unmasked [rows, chunk] tile load (rows must be valid); rotary applied if asked."""
        offs_d = _chunk_cols(DSTART, DW, HEAD_DIM)
        row_off = rows[:, None] * stride_n
        x = tl.load(base + row_off + offs_d[None, :])
        if ROTARY:
            HALF: tl.constexpr = HEAD_DIM // 2
            first = offs_d < HALF
            partner = tl.where(first, offs_d + HALF, offs_d - HALF)
            xp = tl.load(base + row_off + partner[None, :]).to(tl.float32)
            xp = tl.where(first[None, :], -xp, xp)  # rotate_half: [x1, x2] -> [-x2, x1]
            c = tl.load(cos_base + rows[:, None] * stride_cn + offs_d[None, :])
            s = tl.load(sin_base + rows[:, None] * stride_sn + offs_d[None, :])
            x = (x.to(tl.float32) * c + xp * s).to(x.dtype)
        return x

    def _attn_step(
        acc0,
        acc1,
        m_i,
        l_i,
        q0,
        q1,
        k_base,
        v_base,
        cos_base,
        sin_base,
        start_n,
        seq_len,
        stride_kn,
        stride_vn,
        stride_cn,
        stride_sn,
        qk_scale,
        BLOCK_N: tl.constexpr,
        HEAD_DIM: tl.constexpr,
        D0: tl.constexpr,
        D1: tl.constexpr,
        MASKED: tl.constexpr,
        ROTARY_K: tl.constexpr,
        DOT_PREC: tl.constexpr,
    ):
        """One key/value block of the online softmax (MASKED only for the sequence's last block)."""
        offs_n = start_n + tl.arange(0, BLOCK_N)
        if MASKED:
            rows = tl.minimum(offs_n, seq_len - 1)  # clamp: duplicates of the last row
        else:
            rows = offs_n
        k0 = _load_tile(k_base, rows, stride_kn, cos_base, sin_base, stride_cn, stride_sn,
                        0, D0, HEAD_DIM, ROTARY_K)
        qk = tl.dot(q0, tl.trans(k0), input_precision=DOT_PREC)
        if D1 > 0:
            k1 = _load_tile(k_base, rows, stride_kn, cos_base, sin_base, stride_cn, stride_sn,
                            D0, D1, HEAD_DIM, ROTARY_K)
            qk = tl.dot(q1, tl.trans(k1), qk, input_precision=DOT_PREC)
        if MASKED:
            qk = tl.where((offs_n < seq_len)[None, :], qk, float("-inf"))
        # online softmax in the log2 domain; qk_scale = softmax scale * log2(e)
        m_new = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)
        p = tl.math.exp2(qk * qk_scale - m_new[:, None])
        alpha = tl.math.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        p = p.to(q0.dtype)
        v0 = _load_tile(v_base, rows, stride_vn, cos_base, sin_base, stride_cn, stride_sn,
                        0, D0, HEAD_DIM, False)
        acc0 = tl.dot(p, v0, acc0 * alpha[:, None], input_precision=DOT_PREC)
        if D1 > 0:
            v1 = _load_tile(v_base, rows, stride_vn, cos_base, sin_base, stride_cn, stride_sn,
                            D0, D1, HEAD_DIM, False)
            acc1 = tl.dot(p, v1, acc1 * alpha[:, None], input_precision=DOT_PREC)
        return acc0, acc1, m_new, l_i

    def _varlen_attn_fwd(
        Q,
        K,
        V,
        O,
        BT,
        COS,
        SIN,
        stride_qn,
        stride_qh,
        stride_kn,
        stride_kh,
        stride_vn,
        stride_vh,
        stride_on,
        stride_oh,
        stride_cn,
        stride_sn,
        qk_scale,
        HEAD_DIM: tl.constexpr,
        D0: tl.constexpr,
        D1: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        ALIGN: tl.constexpr,
        CALIGN: tl.constexpr,
        ROTARY_Q: tl.constexpr,
        ROTARY_K: tl.constexpr,
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
        stride_cn = stride_cn * CALIGN
        stride_sn = stride_sn * CALIGN

        seq_start = tl.load(BT + pid * 3).to(tl.int64)
        seq_len = tl.load(BT + pid * 3 + 1)
        q_start = tl.load(BT + pid * 3 + 2)

        q_base = Q + seq_start * stride_qn + head * stride_qh
        k_base = K + seq_start * stride_kn + head * stride_kh
        v_base = V + seq_start * stride_vn + head * stride_vh
        o_base = O + seq_start * stride_on + head * stride_oh
        if ROTARY_Q or ROTARY_K:
            cos_base = COS + seq_start * stride_cn
            sin_base = SIN + seq_start * stride_sn
        else:
            cos_base = COS
            sin_base = SIN

        offs_m = q_start + tl.arange(0, BLOCK_M)
        m_mask = offs_m < seq_len
        q_rows = tl.minimum(offs_m, seq_len - 1)  # clamp: rows past the sequence are not stored
        offs_d0 = tl.arange(0, D0)
        q0 = _load_tile(q_base, q_rows, stride_qn, cos_base, sin_base, stride_cn, stride_sn,
                        0, D0, HEAD_DIM, ROTARY_Q)
        if D0 > HEAD_DIM:
            q0 = tl.where((offs_d0 < HEAD_DIM)[None, :], q0, 0.0)
        acc0 = tl.zeros([BLOCK_M, D0], dtype=tl.float32)
        if D1 > 0:
            offs_d1 = D0 + tl.arange(0, D1)
            q1 = _load_tile(q_base, q_rows, stride_qn, cos_base, sin_base, stride_cn, stride_sn,
                            D0, D1, HEAD_DIM, ROTARY_Q)
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
                acc0, acc1, m_i, l_i, q0, q1, k_base, v_base, cos_base, sin_base, start_n, seq_len,
                stride_kn, stride_vn, stride_cn, stride_sn, qk_scale,
                BLOCK_N, HEAD_DIM, D0, D1, False, ROTARY_K, DOT_PREC)
        for start_n in range(n_full, seq_len, BLOCK_N):
            acc0, acc1, m_i, l_i = _attn_step(
                acc0, acc1, m_i, l_i, q0, q1, k_base, v_base, cos_base, sin_base, start_n, seq_len,
                stride_kn, stride_vn, stride_cn, stride_sn, qk_scale,
                BLOCK_N, HEAD_DIM, D0, D1, True, ROTARY_K, DOT_PREC)

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

    def _rotary_kernel(
        X,
        Y,
        COS,
        SIN,
        n_tok,
        stride_xn,
        stride_xh,
        stride_yn,
        stride_yh,
        stride_cn,
        stride_sn,
        HEAD_DIM: tl.constexpr,
        DP: tl.constexpr,
        BLOCK_T: tl.constexpr,
    ):
        """Y[n, h] = rotary(X[n, h]) in fp32, cast to Y's dtype (memory-bound elementwise pass)."""
        pid = tl.program_id(0)
        head = tl.program_id(1)
        rows = pid * BLOCK_T + tl.arange(0, BLOCK_T)
        rows64 = rows.to(tl.int64)
        offs_d = tl.arange(0, DP)
        mask = (rows < n_tok)[:, None] & (offs_d < HEAD_DIM)[None, :]
        HALF: tl.constexpr = HEAD_DIM // 2
        first = offs_d < HALF
        partner = tl.where(first, offs_d + HALF, offs_d - HALF)
        x_rows = X + head * stride_xh + rows64[:, None] * stride_xn
        x = tl.load(x_rows + offs_d[None, :], mask=mask, other=0.0)
        xp = tl.load(x_rows + partner[None, :], mask=mask, other=0.0).to(tl.float32)
        xp = tl.where(first[None, :], -xp, xp)
        c = tl.load(COS + rows64[:, None] * stride_cn + offs_d[None, :], mask=mask, other=0.0)
        sn = tl.load(SIN + rows64[:, None] * stride_sn + offs_d[None, :], mask=mask, other=0.0)
        y = (x.to(tl.float32) * c + xp * sn).to(Y.dtype.element_ty)
        tl.store(Y + head * stride_yh + rows64[:, None] * stride_yn + offs_d[None, :], y, mask=mask)


def _interpreter_numpy_compat() -> None:
    """Make triton's interpreter work with numpy >= 2.4 (interpret mode only).

    The interpreter keeps scalars as 1-element arrays and converts them with
    ``int(ndarray)`` for ``range(start, runtime_bound, step)``; numpy 2.4 made that a
    TypeError.  This wraps the interpreter's tensor patching so ``__index__`` takes the single
    element explicitly.  No-op where numpy still accepts it, or when already applied.
    """
    import numpy as np

    try:
        int(np.array([1]))
        return
    except TypeError:
        pass
    from triton.runtime import interpreter as _interp

    orig = getattr(_interp, "_patch_lang_tensor", None)
    if orig is None or getattr(orig, "_fdx_numpy_compat", False):
        return

    def _index(self):
        data = self.handle.data
        return int(data.reshape(-1)[0]) if getattr(data, "size", 0) == 1 else int(data)

    def patched(tensor, scope):
        orig(tensor, scope)
        scope.set_attr(tensor, "__index__", _index)

    patched._fdx_numpy_compat = True
    _interp._patch_lang_tensor = patched


def jit_decorator():
    """The triton decorator matching the mode triton was imported in (JIT compiled, or the
    interpreter under TRITON_INTERPRET=1); every Triton module of ours decorates through it."""
    if _TRITON_INTERPRETED:
        from triton.runtime.interpreter import InterpretedFunction

        _interpreter_numpy_compat()
        return InterpretedFunction
    from triton.runtime.jit import JITFunction
    return JITFunction


_KERNEL = None
_ROTARY_KERNEL = None


def _get_kernel():
    """Decorate the raw kernel functions once, in the mode triton was imported in.

    Done on first use (not at import) so importing this module costs nothing; the helpers
    replace their raw module-level functions so the kernel's calls resolve to decorated ones.
    """
    global _KERNEL, _ROTARY_KERNEL, _chunk_cols, _load_tile, _attn_step
    if _KERNEL is None:
        deco = jit_decorator()
        _chunk_cols = deco(_chunk_cols)
        _load_tile = deco(_load_tile)
        _attn_step = deco(_attn_step)
        _ROTARY_KERNEL = deco(_rotary_kernel)
        _KERNEL = deco(_varlen_attn_fwd)
    return _KERNEL


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
    cos: torch.Tensor | None = None,
    sin: torch.Tensor | None = None,
    *,
    block_m: int = BLOCK_M,
    block_n: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    rotary_mode: str = "auto",
    maxnreg: int | None = None,
    rotary_in_place: bool = False,
) -> torch.Tensor:
    """Block-diagonal (per-sequence, non-causal) attention over packed sequences, one launch.

    q, k, v: ``[N, H, D]`` fp16/bf16/fp32, any strides with ``stride(-1) == 1`` (e.g. views of a
    packed qkv buffer).  block_table: from :func:`build_block_table` (same ``block_m``), already
    on q's device.  max_seqlen: the longest sequence (host int; bounds int32 offset math).
    scale: softmax scale (> 0).  out: optional contiguous ``[N, H, D]`` output of q's dtype.
    cos, sin: optional ``[N, D]`` fp32 per-token rotary tables; when given, rotary
    ``x*cos + rotate_half(x)*sin`` (fp32, cast back to q's dtype) is applied to q and k first;
    ``rotary_mode`` picks where: "q_fused" rotates q tiles inside the attention kernel (each is
    loaded once) and k in one extra elementwise launch into a scratch [N, H, D] buffer;
    "prepass" rotates both q and k in that elementwise launch, then runs the plain kernel;
    "fused" rotates k tiles inside the attention loop too (single launch, but every query
    block re-rotates every k tile).  "auto" (default) = "prepass" when max_seqlen > 2048 else
    "q_fused".  H200, bf16, H=16, D=72: page of 10764 tokens: prepass 1.72 ms, q_fused 1.98,
    fused 4.73 (no rotary 1.60); 64 small images: q_fused 0.29, prepass 0.33, fused 0.39
    (copying pre-pass; with rotary_in_place "auto" always takes the in-place pre-pass).
    block_m must match the table's; block_n / num_warps / num_stages override the defaults;
    maxnreg caps registers per thread (None: automatic, 0: no cap).
    rotary_in_place: the caller allows q and k to be overwritten with their rotated values (the
    encoder's qkv buffer is scratch): the pre-pass then rotates them in place, q and k together
    in one launch when they are adjacent heads of one buffer (ops/triton_fused.py), instead of
    into new buffers.
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

    rotary = cos is not None or sin is not None
    if rotary:
        if cos is None or sin is None:
            raise ValueError("cos and sin must be given together")
        for name, t in (("cos", cos), ("sin", sin)):
            if not isinstance(t, torch.Tensor) or t.dim() != 2 or tuple(t.shape) != (n_tok, head_dim):
                raise ValueError(f"{name} must be [N, D] = {(n_tok, head_dim)}, got "
                                 f"{tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__}")
            if t.dtype != torch.float32:
                raise ValueError(f"{name} must be float32, got {t.dtype}")
            if t.device != q.device:
                raise ValueError(f"{name} is on {t.device}, q is on {q.device}")
            if t.stride(-1) != 1:
                raise ValueError(f"{name} must have stride(-1) == 1, got strides {t.stride()}")
        if head_dim % 2:
            raise ValueError(f"rotary needs an even head_dim, got {head_dim}")
    if rotary_mode not in ("auto", "q_fused", "fused", "prepass"):
        raise ValueError(f"rotary_mode must be 'auto', 'q_fused', 'fused' or 'prepass', got {rotary_mode!r}")
    if rotary_mode == "auto":
        # the in-place one-launch pass (q and k together, ~0.07 ms per layer on a page on the
        # H200) beat rotating q inside the kernel on every workload; the copying pre-pass only
        # pays above _ROTARY_PREPASS_MIN_SEQLEN
        rotary_mode = "prepass" if (rotary_in_place or max_seqlen > _ROTARY_PREPASS_MIN_SEQLEN) else "q_fused"

    if out is None:
        out = torch.empty((n_tok, n_heads, head_dim), dtype=q.dtype, device=q.device)
    else:
        _check_3d("out", out, q.shape, q.dtype, q.device)
        if not out.is_contiguous():
            raise ValueError(f"out must be contiguous [N, H, D], got strides {out.stride()}")

    d0, d1 = head_dim_chunks(head_dim)
    cfg_n, cfg_w, cfg_s = _default_config(head_dim, q.dtype, block_m, rotary)
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

    ok, why = _triton_available_cached()
    if not ok:
        raise RuntimeError(f"varlen_attention needs triton: {why}")
    if q.device.type != "cuda" and not _TRITON_INTERPRETED:
        raise ValueError(f"q is on {q.device}: the compiled kernel needs CUDA tensors "
                         "(or set TRITON_INTERPRET=1 for CPU tensors)")

    # int32 in-sequence offsets: rows * stride must fit
    max_stride = max(q.stride(0), k.stride(0), v.stride(0), out.stride(0),
                     cos.stride(0) if rotary else 0, sin.stride(0) if rotary else 0)
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
    if rotary:
        cos_arg, sin_arg = _as_aligned(cos, 4), _as_aligned(sin, 4)
        scn, ssn = cos_arg.stride(0) // 4, sin_arg.stride(0) // 4
    else:
        cos_arg, sin_arg = q, q  # unused placeholders (no rotary)
        scn = ssn = 0

    kernel = _get_kernel()
    rot_q = rotary and rotary_mode != "prepass"
    rot_k = rotary and rotary_mode == "fused"

    def _prepass(x):  # rotated copy of x (fp32 math, cast), one elementwise launch
        y = _as_aligned(torch.empty_like(x, memory_format=torch.contiguous_format), vec)
        block_t = 32 if head_dim <= 128 else 16
        _ROTARY_KERNEL[(triton.cdiv(n_tok, block_t), n_heads)](
            x, y, cos_arg, sin_arg, n_tok,
            x.stride(0), x.stride(1), y.stride(0), y.stride(1),
            cos_arg.stride(0), sin_arg.stride(0),
            HEAD_DIM=head_dim,
            DP=triton.next_power_of_2(head_dim),
            BLOCK_T=block_t,
            num_warps=4,
        )
        return y

    if rotary and rotary_in_place and not rot_k:
        from .triton_fused import rotary_q_and_k_in_place, rotary_qk_in_place
        if rot_q:
            rotary_qk_in_place(k, cos_arg, sin_arg)
        else:
            rotary_q_and_k_in_place(q, k, cos_arg, sin_arg)
    else:
        if rotary and not rot_k:
            k = _prepass(k)
        if rotary and not rot_q:
            q = _prepass(q)
    if maxnreg is None:
        # q rotation in the prologue lifts the peak to ~190 registers at 8 warps (1 CTA/SM);
        # capping at 128 keeps 2 CTAs/SM like the plain kernel (spills only in the prologue)
        maxnreg = 128 if (rot_q and not rot_k and num_warps == 8 and q.dtype != torch.float32) else 0
    launch_opts = {"maxnreg": int(maxnreg)} if maxnreg else {}
    grid = (num_blocks, n_heads)
    kernel[grid](
        q, k, v, out_k, block_table, cos_arg, sin_arg,
        q.stride(0) // vec, q.stride(1) // vec,
        k.stride(0) // vec, k.stride(1) // vec,
        v.stride(0) // vec, v.stride(1) // vec,
        out_k.stride(0) // vec, out_k.stride(1) // vec,
        scn, ssn,
        scale * _LOG2E,
        HEAD_DIM=head_dim,
        D0=d0,
        D1=d1,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        ALIGN=vec,
        CALIGN=4,
        ROTARY_Q=rot_q,
        ROTARY_K=rot_k,
        DOT_PREC="ieee" if q.dtype == torch.float32 else "tf32",
        num_warps=num_warps,
        num_stages=num_stages,
        **launch_opts,
    )
    if out_k is not out:
        out.copy_(out_k)
    return out
