"""Flash attention over equal-length sequences with DeepSeek-OCR-2's two structured biases, in
Triton: one kernel, two launchers.

- :func:`relpos_attention`: SAM's decomposed relative-position bias. The logits of query q
  (grid cell (qh, qw)) against key k (cell (kh, kw)) are ``scale * q.k + rel_h[q, kh] +
  rel_w[q, kw]``, where ``rel_h = q . Rh[qh - kh]`` ([B, H, N, grid_h]) and ``rel_w = q .
  Rw[qw - kw]`` ([B, H, N, grid_w]) are the small per-query projections the reference computes
  with einsum (:func:`relpos_projections` computes them reading q in place). The kernel adds
  the two terms per tile, so the [N, N] bias is never materialized; with a key block holding
  one whole grid row (ROW_PAD: SAM's 14-, 48- and 64-wide grids) that is one rel_h value per
  query and the query block's rel_w run, loaded once; otherwise they are gathered per key (its
  row and column are its index // and % the grid width). Windows and global grids are the same
  launch with another grid.
- :func:`prefix_causal_attention`: the Qwen2 encoder's mask as index arithmetic: key j is
  visible to query i when ``j <= max(i, n_prefix - 1)`` (the visual prefix bidirectional, the
  learned queries after it causal and seeing the whole prefix); grouped-query heads read their
  shared k/v head directly (no repeat), and a query block stops at the last key it can see.

q/k/v are ``[B, H, N, D]`` of any strides with a contiguous last dim (SAM's are views of its
fused qkv projection); the output is written ``[B, N, H, D]`` contiguous and returned as its
``[B, H, N, D]`` view, so the caller's ``transpose(1, 2).reshape`` to [B, N, H*D] is free.
Online softmax in fp32 (exp2, the scale folded into log2(e)); fp32 inputs use IEEE dots, half
precision accumulates in fp32. As in varlen_attention.py, loads carry no masks: rows past the
sequence are clamped onto its last row and head-dim columns past D onto valid columns, their
contributions neutralised exactly (q's padded columns zeroed, out-of-range keys at -inf, padded
rows/columns not stored). Importing this module needs no triton (ops/triton/runtime.py).
"""
from __future__ import annotations

import math

import torch

from .runtime import KernelTable, require_launchable, tl, triton

__all__ = ["BlockConfig", "default_config", "prefix_causal_attention", "relpos_attention", "relpos_projections"]

_LOG2E = 1.4426950408889634
_MAX_HEAD_DIM = 256
_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


class BlockConfig(tuple):
    """(block_m, block_n, num_warps, num_stages) of one launch."""
    __slots__ = ()

    def __new__(cls, block_m: int, block_n: int, num_warps: int, num_stages: int):
        for name, v in (("block_m", block_m), ("block_n", block_n)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 16 or v & (v - 1):
                raise ValueError(f"{name} must be a power of two >= 16, got {v!r}")
        if num_warps not in (1, 2, 4, 8, 16):
            raise ValueError(f"num_warps must be a power of two <= 16, got {num_warps}")
        if num_stages < 2:
            # num_stages=1 miscompiled on H200 with triton 3.6 in the varlen kernel: not offered
            raise ValueError(f"num_stages must be >= 2, got {num_stages}")
        return super().__new__(cls, (block_m, block_n, num_warps, num_stages))


def default_config(n_tokens: int, dtype: torch.dtype, grid_w: int | None = None) -> BlockConfig:
    """Hopper defaults (bf16 sweeps on the H200: ci/results/2026-12-02-h200-s11 and
    2026-12-03-h200-s16). ``grid_w``: the rel-pos grid's width (None: the prefix-causal encoder).
    - Rel-pos grids up to 64 wide (all of SAM's: 14x14 windows, 48x48 crops, 64x64 views): 64
      query rows against key blocks of one whole grid row (the kernel's ROW_PAD path: rel_w
      loaded once per query block, one rel_h value per key block, no gathers), 4 warps. 96
      crops' global layer 6.5 ms (16-key blocks in a row: 9.2), 16 views' 2.8 ms (128 x 64:
      3.8), 16 views' 400 windows 0.48 ms (per-key gathers: 0.71).
    - Wider grids: the widest key block dividing the width (one grid row a block, ROW_BLOCKS).
    - The encoder (288 / 512 tokens): 64 x 64, 4 warps.
    fp32 halves the key block (registers)."""
    if dtype == torch.float32:
        return BlockConfig(64, 32, 4, 2)
    if grid_w is None:
        return BlockConfig(64, 64, 4, 3)
    if grid_w <= 64:
        return BlockConfig(64, max(16, 1 << (grid_w - 1).bit_length()), 4, 3)
    bn = next((b for b in (64, 32, 16) if grid_w % b == 0), 16)
    return BlockConfig(64, bn, 4, 3)


if triton is not None:

    def _biased_attn_fwd(
        Q, K, V, O, RH, RW,
        stride_qb, stride_qh, stride_qn,
        stride_kb, stride_kh, stride_kn,
        stride_vb, stride_vh, stride_vn,
        stride_ob, stride_oh, stride_on,
        stride_rhb, stride_rhh, stride_rhn,
        stride_rwb, stride_rwh, stride_rwn,
        n_tokens, grid_w, n_prefix, qk_scale, inv_scale,
        HEADS: tl.constexpr,
        GROUP: tl.constexpr,
        HEAD_DIM: tl.constexpr,
        BLOCK_D: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        ALIGN: tl.constexpr,
        RELPOS: tl.constexpr,
        ROW_BLOCKS: tl.constexpr,
        ROW_PAD: tl.constexpr,
        PREFIX_CAUSAL: tl.constexpr,
        DOT_PREC: tl.constexpr,
    ):
        # one flat grid (a 2-D grid's second dimension stops at 65535: 400 crops' windows x 12
        # heads is past it); a (batch, head)'s query blocks are neighbours (its k/v stay in L2),
        # last block first: under the prefix-causal mask the last blocks see the most keys
        m_blocks = tl.cdiv(n_tokens, BLOCK_M)
        pid = tl.program_id(0)
        bh = pid // m_blocks
        pid_m = m_blocks - 1 - pid % m_blocks
        b = (bh // HEADS).to(tl.int64)
        h = bh % HEADS
        kvh = h // GROUP
        # strides arrive divided by ALIGN (elements per 16 bytes where every stride allows it):
        # multiplying back by the constexpr tells the compiler they are 16-byte multiples
        q_base = Q + b * (stride_qb * ALIGN) + h * (stride_qh * ALIGN)
        k_base = K + b * (stride_kb * ALIGN) + kvh * (stride_kh * ALIGN)
        v_base = V + b * (stride_vb * ALIGN) + kvh * (stride_vh * ALIGN)
        o_base = O + b * (stride_ob * ALIGN) + h * (stride_oh * ALIGN)
        s_qn = stride_qn * ALIGN
        s_kn = stride_kn * ALIGN
        s_vn = stride_vn * ALIGN
        s_on = stride_on * ALIGN

        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        q_rows = tl.minimum(offs_m, n_tokens - 1)        # clamp: rows past the end are not stored
        offs_d = tl.arange(0, BLOCK_D)
        if BLOCK_D > HEAD_DIM:
            cols = tl.minimum(offs_d, HEAD_DIM - 1)      # padded columns read a valid one
        else:
            cols = offs_d                                # contiguous: the loads vectorize
        q = tl.load(q_base + q_rows[:, None] * s_qn + cols[None, :])
        if BLOCK_D > HEAD_DIM:
            q = tl.where((offs_d < HEAD_DIM)[None, :], q, 0.0)
        if RELPOS:
            rh_base = RH + b * stride_rhb + h * stride_rhh + q_rows[:, None] * stride_rhn
            rw_base = RW + b * stride_rwb + h * stride_rwh + q_rows[:, None] * stride_rwn
        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)

        end = n_tokens
        if PREFIX_CAUSAL:
            # the last key any row of this block sees is max(last row, n_prefix - 1)
            end = tl.minimum(n_tokens, tl.maximum(pid_m * BLOCK_M + BLOCK_M, n_prefix))
            last_key = tl.maximum(offs_m, n_prefix - 1)
        if ROW_PAD:
            # a key block is one whole grid row (BLOCK_N >= grid_w, the columns past it masked):
            # the row's rel_w run is the same for every key block, loaded once
            n_iter = n_tokens // grid_w
            step = grid_w
            kw_ok = tl.arange(0, BLOCK_N) < grid_w
            kw_c = tl.minimum(tl.arange(0, BLOCK_N), grid_w - 1)
            rw_row = tl.load(rw_base + kw_c[None, :]).to(tl.float32)
        else:
            n_iter = tl.cdiv(end, BLOCK_N)
            step = BLOCK_N
        # key block 0 is always visible to every row (key 0), so m_i is finite after it and no
        # fully masked row ever computes -inf - -inf
        for it in range(0, n_iter):
            start_n = it * step
            if ROW_PAD:
                offs_n = start_n + kw_c
                visible = kw_ok[None, :]
            else:
                offs_n = start_n + tl.arange(0, BLOCK_N)
                visible = (offs_n < n_tokens)[None, :]
            k_rows = tl.minimum(offs_n, n_tokens - 1)
            k = tl.load(k_base + k_rows[:, None] * s_kn + cols[None, :])
            if RELPOS:
                # the bias of each (query, key): rel_h at the key's grid row, rel_w at its column;
                # it is the QK dot's accumulator, divided by the scale the sum is multiplied by
                # (bias added after the dot instead serializes Hopper's wgmma pipeline: ptxas C7515)
                if ROW_PAD:
                    bias = tl.load(rh_base + it).to(tl.float32) + rw_row
                elif ROW_BLOCKS:
                    # the key block lies in one grid row (grid_w is a multiple of BLOCK_N): one
                    # rel_h value per query and a contiguous run of rel_w, no per-key gathers
                    kh0 = start_n // grid_w
                    kw = start_n - kh0 * grid_w + tl.arange(0, BLOCK_N)
                    bias = tl.load(rh_base + kh0).to(tl.float32) + tl.load(rw_base + kw[None, :]).to(tl.float32)
                else:
                    # gathered from the query's rows (L1 hits: a key block spans few rows)
                    kh = k_rows // grid_w
                    kw = k_rows - kh * grid_w
                    bias = (tl.load(rh_base + kh[None, :]).to(tl.float32)
                            + tl.load(rw_base + kw[None, :]).to(tl.float32))
                qk = tl.dot(q, tl.trans(k), bias * inv_scale, input_precision=DOT_PREC) * qk_scale
            else:
                qk = tl.dot(q, tl.trans(k), input_precision=DOT_PREC) * qk_scale
            if PREFIX_CAUSAL:
                visible = visible & (offs_n[None, :] <= last_key[:, None])
            qk = tl.where(visible, qk, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(qk, 1))
            p = tl.math.exp2(qk - m_new[:, None])
            alpha = tl.math.exp2(m_i - m_new)
            l_i = l_i * alpha + tl.sum(p, 1)
            v = tl.load(v_base + k_rows[:, None] * s_vn + cols[None, :])
            acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=DOT_PREC)
            m_i = m_new

        out = (acc / l_i[:, None]).to(O.dtype.element_ty)
        store = (offs_m < n_tokens)[:, None] & (offs_d < HEAD_DIM)[None, :]
        tl.store(o_base + offs_m[:, None] * s_on + offs_d[None, :], out, mask=store)


    def _relpos_proj_kernel(
        Q, TH, TW, RH, RW,
        stride_qb, stride_qh, stride_qn,
        grid_h, grid_w, n_tokens,
        HEADS: tl.constexpr,
        HEAD_DIM: tl.constexpr,
        BLOCK_D: tl.constexpr,
        BLOCK_L: tl.constexpr,
        DOT_PREC: tl.constexpr,
    ):
        # program (b, h, i): grid row i's rel_h (its grid_w queries against the rows' table
        # Rh[i - kh + grid_h - 1]) and grid column i's rel_w (its grid_h queries against
        # Rw[i - kw + grid_w - 1]); each a [queries, D] x [D, keys] dot, q read in place
        lines = tl.maximum(grid_h, grid_w)
        pid = tl.program_id(0)
        bh = pid // lines
        i = pid % lines
        b = (bh // HEADS).to(tl.int64)
        h = bh % HEADS
        q_base = Q + b * stride_qb + h * stride_qh
        j = tl.arange(0, BLOCK_L)
        kk = tl.arange(0, BLOCK_L)
        d = tl.arange(0, BLOCK_D)
        dmask = d < HEAD_DIM
        bh64 = bh.to(tl.int64)
        if i < grid_h:
            tok = i * grid_w + j
            qm = j < grid_w
            qv = tl.load(q_base + tok[:, None] * stride_qn + d[None, :], mask=qm[:, None] & dmask[None, :], other=0.0)
            km = kk < grid_h
            t = tl.load(TH + (i - kk + grid_h - 1)[:, None] * HEAD_DIM + d[None, :],
                        mask=km[:, None] & dmask[None, :], other=0.0)
            r = tl.dot(qv, tl.trans(t), input_precision=DOT_PREC)
            tl.store(RH + bh64 * n_tokens * grid_h + tok[:, None] * grid_h + kk[None, :], r.to(RH.dtype.element_ty),
                     mask=qm[:, None] & km[None, :])
        if i < grid_w:
            tok = j * grid_w + i
            qm = j < grid_h
            qv = tl.load(q_base + tok[:, None] * stride_qn + d[None, :], mask=qm[:, None] & dmask[None, :], other=0.0)
            km = kk < grid_w
            t = tl.load(TW + (i - kk + grid_w - 1)[:, None] * HEAD_DIM + d[None, :],
                        mask=km[:, None] & dmask[None, :], other=0.0)
            r = tl.dot(qv, tl.trans(t), input_precision=DOT_PREC)
            tl.store(RW + bh64 * n_tokens * grid_w + tok[:, None] * grid_w + kk[None, :], r.to(RW.dtype.element_ty),
                     mask=qm[:, None] & km[None, :])


_KERNELS = KernelTable(lambda: {"fwd": _biased_attn_fwd, "relpos_proj": _relpos_proj_kernel})


def _check(name: str, t, ndim: int, dtype=None, device=None) -> None:
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")  # noqa: TRY004
    if t.dim() != ndim:
        raise ValueError(f"{name} must be {ndim}-D, got shape {tuple(t.shape)}")
    if t.stride(-1) != 1:
        raise ValueError(f"{name} must have a contiguous last dim (stride(-1) == 1), got strides {t.stride()}")
    if dtype is not None and t.dtype != dtype:
        raise ValueError(f"{name} dtype {t.dtype} does not match q's {dtype}")
    if device is not None and t.device != device:
        raise ValueError(f"{name} is on {t.device}, q on {device}")


def _aligned(ts, vec: int) -> bool:
    return all(t.data_ptr() % 16 == 0 and all(s % vec == 0 for s in t.stride()[:-1]) for t in ts)


def _launch(q, k, v, rel_h, rel_w, grid_w: int, n_prefix: int, scale: float, config: BlockConfig | None):
    _check("q", q, 4)
    if q.dtype not in _DTYPES:
        raise ValueError(f"q dtype {q.dtype} not supported (float16, bfloat16, float32)")
    _check("k", k, 4, q.dtype, q.device)
    _check("v", v, 4, q.dtype, q.device)
    b, heads, n, d = q.shape
    kv_heads = k.shape[1]
    if k.shape != (b, kv_heads, n, d) or v.shape != k.shape:
        raise ValueError(f"k {tuple(k.shape)} and v {tuple(v.shape)} must be [B={b}, kv_heads, N={n}, D={d}] "
                         "(self-attention: as many keys as queries)")
    if kv_heads < 1 or heads % kv_heads:
        raise ValueError(f"{heads} query heads are no multiple of {kv_heads} kv heads")
    if not 1 <= d <= _MAX_HEAD_DIM:
        raise ValueError(f"head_dim {d} not supported (1..{_MAX_HEAD_DIM})")
    scale = float(scale)
    if not (scale > 0.0 and math.isfinite(scale)):
        raise ValueError(f"scale must be a finite positive float, got {scale}")
    out = torch.empty((b, n, heads, d), dtype=q.dtype, device=q.device)
    if b * heads * n == 0:
        return out.transpose(1, 2)
    require_launchable("biased attention", q)
    relpos = rel_h is not None
    if relpos:
        rh_strides, rw_strides = rel_h.stride()[:3], rel_w.stride()[:3]
    else:
        rel_h = rel_w = q                               # not read (RELPOS is off)
        rh_strides = rw_strides = (0, 0, 0)
    vec = 16 // q.element_size()
    align = vec if _aligned((q, k, v, out), vec) else 1
    bm, bn, warps, stages = config or default_config(n, q.dtype, grid_w if relpos else None)
    grid = (triton.cdiv(n, bm) * b * heads,)
    _KERNELS["fwd"][grid](
        q, k, v, out, rel_h, rel_w,
        *(s // align for s in q.stride()[:3]), *(s // align for s in k.stride()[:3]),
        *(s // align for s in v.stride()[:3]),
        out.stride(0) // align, out.stride(2) // align, out.stride(1) // align,
        *rh_strides, *rw_strides,
        n, grid_w, n_prefix, scale * _LOG2E, 1.0 / scale,
        HEADS=heads, GROUP=heads // kv_heads, HEAD_DIM=d, BLOCK_D=max(16, triton.next_power_of_2(d)),
        BLOCK_M=bm, BLOCK_N=bn, ALIGN=align, RELPOS=relpos, ROW_BLOCKS=relpos and grid_w % bn == 0,
        ROW_PAD=relpos and bn >= grid_w,
        PREFIX_CAUSAL=not relpos,
        DOT_PREC="ieee" if q.dtype == torch.float32 else "tf32",
        num_warps=warps, num_stages=stages)
    return out.transpose(1, 2)


def relpos_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rel_h: torch.Tensor, rel_w: torch.Tensor,
                     scale: float, config: BlockConfig | None = None) -> torch.Tensor:
    """softmax(scale * q k^T + rel_h[:, :, :, key row] + rel_w[:, :, :, key col]) v over a
    grid_h x grid_w grid of N = grid_h * grid_w tokens (row-major), one launch.

    q, k, v: [B, H, N, D] (any strides, last dim contiguous); rel_h: [B, H, N, grid_h], rel_w:
    [B, H, N, grid_w] (last dim contiguous). Returns [B, H, N, D] (a view of a contiguous
    [B, N, H, D])."""
    _check("q", q, 4)
    _check("rel_h", rel_h, 4, q.dtype, q.device)
    _check("rel_w", rel_w, 4, q.dtype, q.device)
    b, heads, n, _ = q.shape
    gh, gw = rel_h.shape[-1], rel_w.shape[-1]
    if rel_h.shape[:3] != (b, heads, n) or rel_w.shape[:3] != (b, heads, n) or gh * gw != n:
        raise ValueError(f"rel_h {tuple(rel_h.shape)} / rel_w {tuple(rel_w.shape)} must be [B={b}, H={heads}, "
                         f"N={n}, grid_h] / [.., grid_w] with grid_h * grid_w == N")
    if k.shape[1] != heads:
        raise ValueError(f"relpos attention has as many k/v heads as q heads ({heads}), got {k.shape[1]}")
    return _launch(q, k, v, rel_h, rel_w, gw, 0, scale, config)


def prefix_causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, n_prefix: int, scale: float,
                            config: BlockConfig | None = None) -> torch.Tensor:
    """Attention where key j is visible to query i iff j <= max(i, n_prefix - 1): a
    bidirectional prefix of ``n_prefix`` tokens, causal after it. q: [B, Hq, N, D]; k, v:
    [B, Hkv, N, D] with Hq a multiple of Hkv (grouped-query heads share k/v head h // (Hq/Hkv)).
    Returns [B, Hq, N, D] (a view of a contiguous [B, N, Hq, D])."""
    if isinstance(n_prefix, bool) or not isinstance(n_prefix, int):
        raise ValueError(f"n_prefix must be a host int, got {type(n_prefix).__name__}")
    _check("q", q, 4)
    if not 0 <= n_prefix <= q.shape[2]:
        raise ValueError(f"n_prefix {n_prefix} out of range [0, N={q.shape[2]}]")
    return _launch(q, k, v, None, None, 1, n_prefix, scale, config)


def relpos_projections(q: torch.Tensor, table_h: torch.Tensor, table_w: torch.Tensor, grid_h: int, grid_w: int
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """SAM's per-query rel-pos projections in one launch, q read in place (no copy of a strided
    view): ``rel_h[b, h, t, kh] = q[b, h, t] . table_h[qh(t) - kh + grid_h - 1]`` and
    ``rel_w[.., kw] = q . table_w[qw(t) - kw + grid_w - 1]``, t = qh * grid_w + qw.

    q: [B, H, N, D] (any strides, last dim contiguous), N = grid_h * grid_w; table_h / table_w:
    contiguous [2 * grid_h - 1, D] / [2 * grid_w - 1, D] (already resized to the grid) in q's
    dtype. Returns rel_h [B, H, N, grid_h] and rel_w [B, H, N, grid_w], contiguous; the dots
    accumulate in fp32 (IEEE for fp32 inputs) and round once to q's dtype, as einsum's bmm."""
    _check("q", q, 4)
    if q.dtype not in _DTYPES:
        raise ValueError(f"q dtype {q.dtype} not supported (float16, bfloat16, float32)")
    b, heads, n, d = q.shape
    if grid_h * grid_w != n or grid_h < 1 or grid_w < 1:
        raise ValueError(f"a {grid_h}x{grid_w} grid does not hold N={n} queries")
    for name, t, g in (("table_h", table_h, grid_h), ("table_w", table_w, grid_w)):
        _check(name, t, 2, q.dtype, q.device)
        if tuple(t.shape) != (2 * g - 1, d) or not t.is_contiguous():
            raise ValueError(f"{name} must be a contiguous [{2 * g - 1}, {d}] table, got {tuple(t.shape)}")
    if not 1 <= d <= _MAX_HEAD_DIM:
        raise ValueError(f"head_dim {d} not supported (1..{_MAX_HEAD_DIM})")
    rel_h = torch.empty((b, heads, n, grid_h), dtype=q.dtype, device=q.device)
    rel_w = torch.empty((b, heads, n, grid_w), dtype=q.dtype, device=q.device)
    if b * heads * n == 0:
        return rel_h, rel_w
    require_launchable("rel-pos projections", q)
    grid = (b * heads * max(grid_h, grid_w),)
    _KERNELS["relpos_proj"][grid](
        q, table_h, table_w, rel_h, rel_w, *q.stride()[:3], grid_h, grid_w, n,
        HEADS=heads, HEAD_DIM=d, BLOCK_D=max(16, triton.next_power_of_2(d)),
        BLOCK_L=max(16, triton.next_power_of_2(max(grid_h, grid_w))),
        DOT_PREC="ieee" if q.dtype == torch.float32 else "tf32", num_warps=4)
    return rel_h, rel_w
