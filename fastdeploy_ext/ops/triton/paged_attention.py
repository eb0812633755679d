"""Triton paged attention for the text decoder (GQA, head_dim up to 256, bf16/fp16/fp32).

Both kernels read K/V straight from the paged cache ([num_blocks, block_size, kv_heads, D] per
layer) through each sequence's block table; nothing is gathered.

- ``paged_decode``: one query token per sequence. Flash-decoding: the context is cut into
  partitions of ``part_tokens`` tokens processed in parallel (grid: sequences x KV heads x
  partitions; every query head of a KV group rides in the same program, so K/V are read once per
  group), each writing an unnormalized partial output with its running max and sum; a second
  kernel merges the partitions. The grid depends only on the batch size and
  ``max_context_len`` (a fixed max_model_len when captured): partitions past a sequence's
  length return at once, so the launch is CUDA-graph safe.
- ``paged_prefill``: varlen causal attention of each sequence's new tokens (back to back in q,
  ``cu_query`` offsets) over its cached + new tokens (context_lens = cached + new): query row r
  sits at position ctx - q_len + r and sees keys 0 .. that position.

fp32 inputs use exact fp32 dots ("ieee"); fp16/bf16 dots accumulate in fp32. Tested against
SDPA in the Triton interpreter on the CPU (tests/test_triton_paged_attention.py).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .runtime import KernelTable, interpreted, pow2, tl, triton

_LOG2E = 1.4426950408889634
DEFAULT_PART_TOKENS = 256
PREFILL_BLOCK_M = 64


@dataclass(frozen=True)
class DecodeTiles:
    """One decode launch's shape: context tokens per partition (program), warps and pipeline
    stages of the partial kernel. Timed side by side by ``python3 -m fastdeploy_ext.bench.paged_decode``."""
    part_tokens: int = DEFAULT_PART_TOKENS
    num_warps: int = 4
    num_stages: int = 3


DEFAULT_DECODE_TILES = DecodeTiles()


if triton is not None:
    # raw functions, decorated on first use in the mode triton was imported in (jit_decorator)
    def _decode_partial_kernel(Q, K, V, BT, LENS, OP, MP, LP, qk_scale,
                               s_qb, s_qh, s_kb, s_kt, s_kh, s_vb, s_vt, s_vh, s_bt,
                               s_ob, s_oh, s_op, s_mb, s_mh,
                               GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, D: tl.constexpr,
                               D_PAD: tl.constexpr, BS: tl.constexpr, PART_BLOCKS: tl.constexpr,
                               DOT_PREC: tl.constexpr):
        b = tl.program_id(0)
        kvh = tl.program_id(1)
        part = tl.program_id(2)
        ctx = tl.load(LENS + b)
        first = part * PART_BLOCKS
        if first * BS >= ctx:
            return
        g = tl.arange(0, GROUP_PAD)
        gmask = g < GROUP
        heads = kvh * GROUP + g
        d = tl.arange(0, D_PAD)
        dmask = d < D
        q = tl.load(Q + b * s_qb + heads[:, None] * s_qh + d[None, :], mask=gmask[:, None] & dmask[None, :], other=0.0)
        m = tl.full([GROUP_PAD], float("-inf"), tl.float32)
        l = tl.zeros([GROUP_PAD], tl.float32)
        acc = tl.zeros([GROUP_PAD, D_PAD], tl.float32)
        end = tl.minimum(ctx, (first + PART_BLOCKS) * BS)
        t = tl.arange(0, BS)
        for blk in range(first, tl.cdiv(end, BS)):
            phys = tl.load(BT + b * s_bt + blk).to(tl.int64)
            pos = blk * BS + t
            tmask = pos < ctx
            kv_mask = tmask[:, None] & dmask[None, :]
            k = tl.load(K + phys * s_kb + t[:, None] * s_kt + kvh * s_kh + d[None, :], mask=kv_mask, other=0.0)
            s = tl.dot(q, tl.trans(k), input_precision=DOT_PREC) * qk_scale
            s = tl.where(tmask[None, :], s, float("-inf"))
            m_new = tl.maximum(m, tl.max(s, 1))
            alpha = tl.exp2(m - m_new)
            p = tl.exp2(s - m_new[:, None])
            l = l * alpha + tl.sum(p, 1)
            v = tl.load(V + phys * s_vb + t[:, None] * s_vt + kvh * s_vh + d[None, :], mask=kv_mask, other=0.0)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PREC)
            m = m_new
        o_ptr = OP + b * s_ob + heads[:, None] * s_oh + part * s_op + d[None, :]
        tl.store(o_ptr, acc, mask=gmask[:, None] & dmask[None, :])
        tl.store(MP + b * s_mb + heads * s_mh + part, m, mask=gmask)
        tl.store(LP + b * s_mb + heads * s_mh + part, l, mask=gmask)

    def _decode_reduce_kernel(OP, MP, LP, LENS, O, s_ob, s_oh, s_op, s_mb, s_mh, s_xb, s_xh,
                              PART_TOKENS: tl.constexpr, P_PAD: tl.constexpr, D: tl.constexpr,
                              D_PAD: tl.constexpr):
        b = tl.program_id(0)
        h = tl.program_id(1)
        ctx = tl.load(LENS + b)
        nparts = tl.cdiv(ctx, PART_TOKENS)
        p = tl.arange(0, P_PAD)
        pmask = p < nparts
        d = tl.arange(0, D_PAD)
        dmask = d < D
        m = tl.load(MP + b * s_mb + h * s_mh + p, mask=pmask, other=float("-inf"))
        l = tl.load(LP + b * s_mb + h * s_mh + p, mask=pmask, other=0.0)
        gmax = tl.max(m, 0)
        w = tl.where(pmask, tl.exp2(m - gmax), 0.0)
        denom = tl.sum(w * l, 0)
        o = tl.load(OP + b * s_ob + h * s_oh + p[:, None] * s_op + d[None, :], mask=pmask[:, None] & dmask[None, :],
                    other=0.0)
        out = tl.sum(o * w[:, None], 0) / denom
        tl.store(O + b * s_xb + h * s_xh + d, out.to(O.dtype.element_ty), mask=dmask)

    def _prefill_kernel(Q, K, V, BT, CU, LENS, O, qk_scale,
                        s_qt, s_qh, s_kb, s_kt, s_kh, s_vb, s_vt, s_vh, s_bt, s_ot, s_oh,
                        GROUP: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr, BS: tl.constexpr,
                        BLOCK_M: tl.constexpr, DOT_PREC: tl.constexpr):
        mb = tl.program_id(0)
        b = tl.program_id(1)
        h = tl.program_id(2)
        kvh = h // GROUP
        q0 = tl.load(CU + b)
        q_len = tl.load(CU + b + 1) - q0
        if mb * BLOCK_M >= q_len:
            return
        ctx = tl.load(LENS + b)
        start = ctx - q_len
        r = mb * BLOCK_M + tl.arange(0, BLOCK_M)
        rmask = r < q_len
        d = tl.arange(0, D_PAD)
        dmask = d < D
        q_ptr = Q + (q0 + r)[:, None].to(tl.int64) * s_qt + h * s_qh + d[None, :]
        q = tl.load(q_ptr, mask=rmask[:, None] & dmask[None, :], other=0.0)
        qpos = start + r
        m = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, D_PAD], tl.float32)
        kv_end = tl.minimum(ctx, start + (mb + 1) * BLOCK_M)
        t = tl.arange(0, BS)
        for blk in range(0, tl.cdiv(kv_end, BS)):
            phys = tl.load(BT + b * s_bt + blk).to(tl.int64)
            pos = blk * BS + t
            tmask = pos < kv_end
            kv_mask = tmask[:, None] & dmask[None, :]
            k = tl.load(K + phys * s_kb + t[:, None] * s_kt + kvh * s_kh + d[None, :], mask=kv_mask, other=0.0)
            s = tl.dot(q, tl.trans(k), input_precision=DOT_PREC) * qk_scale
            s = tl.where((pos[None, :] <= qpos[:, None]) & tmask[None, :], s, float("-inf"))
            m_new = tl.maximum(m, tl.max(s, 1))
            alpha = tl.exp2(m - m_new)
            p = tl.exp2(s - m_new[:, None])
            l = l * alpha + tl.sum(p, 1)
            v = tl.load(V + phys * s_vb + t[:, None] * s_vt + kvh * s_vh + d[None, :], mask=kv_mask, other=0.0)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PREC)
            m = m_new
        out = acc / l[:, None]
        o_ptr = O + (q0 + r)[:, None].to(tl.int64) * s_ot + h * s_oh + d[None, :]
        tl.store(o_ptr, out.to(O.dtype.element_ty), mask=rmask[:, None] & dmask[None, :])


_KERNELS = KernelTable(lambda: {"decode": _decode_partial_kernel, "reduce": _decode_reduce_kernel, "prefill": _prefill_kernel})


def _check(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> tuple[int, int, int]:
    if triton is None:
        raise RuntimeError("triton is not importable")
    if k_cache.shape != v_cache.shape or k_cache.ndim != 4:
        raise ValueError(f"k/v caches must both be [num_blocks, block_size, kv_heads, D], got "
                         f"{list(k_cache.shape)} and {list(v_cache.shape)}")
    _, bs, hkv, d = k_cache.shape
    hq = q.shape[1]
    if q.shape[-1] != d or hq % hkv:
        raise ValueError(f"q [*, {hq}, {q.shape[-1]}] does not fit kv heads {hkv} x head_dim {d}")
    if bs < 16 or bs & (bs - 1):
        raise ValueError(f"block_size must be a power of two >= 16 (tl.dot), got {bs}")
    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must have a unit stride on head_dim")
    return bs, hkv, d


def paged_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                 context_lens: torch.Tensor, scale: float, *, max_context_len: int,
                 tiles: DecodeTiles = DEFAULT_DECODE_TILES) -> torch.Tensor:
    """q [B, Hq, D] (one token per sequence) -> [B, Hq, D]. ``max_context_len`` (a host int,
    fixed for graphs) bounds every context length and, with ``tiles.part_tokens``, sets the
    partition count."""
    bs, hkv, d = _check(q, k_cache, v_cache)
    b, hq = q.shape[0], q.shape[1]
    group = hq // hkv
    launch = {} if interpreted() else {"num_warps": tiles.num_warps, "num_stages": tiles.num_stages}
    part_blocks = max(1, tiles.part_tokens // bs)
    part_tokens = part_blocks * bs
    nparts = max(1, -(-max_context_len // part_tokens))
    op = torch.empty(b, hq, nparts, d, dtype=torch.float32, device=q.device)
    mp = torch.empty(b, hq, nparts, dtype=torch.float32, device=q.device)
    lp = torch.empty_like(mp)
    out = torch.empty_like(q)
    prec = "ieee" if q.dtype == torch.float32 else "tf32"
    _KERNELS["decode"][(b, hkv, nparts)](
        q, k_cache, v_cache, block_tables, context_lens, op, mp, lp, scale * _LOG2E,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), block_tables.stride(0),
        op.stride(0), op.stride(1), op.stride(2), mp.stride(0), mp.stride(1),
        GROUP=group, GROUP_PAD=pow2(group, 16), D=d, D_PAD=pow2(d, 16), BS=bs, PART_BLOCKS=part_blocks, DOT_PREC=prec,
        **launch)
    _KERNELS["reduce"][(b, hq)](
        op, mp, lp, context_lens, out, op.stride(0), op.stride(1), op.stride(2), mp.stride(0), mp.stride(1),
        out.stride(0), out.stride(1), PART_TOKENS=part_tokens, P_PAD=pow2(nparts, 2), D=d, D_PAD=pow2(d, 16))
    return out


def paged_prefill(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                  cu_query: torch.Tensor, context_lens: torch.Tensor, max_query_len: int, scale: float,
                  block_m: int = PREFILL_BLOCK_M) -> torch.Tensor:
    """q [T, Hq, D] (sequences' new tokens back to back, offsets ``cu_query`` [B+1]) -> [T, Hq, D],
    causal over each sequence's cached + new tokens (already written to the cache)."""
    bs, hkv, d = _check(q, k_cache, v_cache)
    b, hq = context_lens.shape[0], q.shape[1]
    out = torch.empty_like(q)
    prec = "ieee" if q.dtype == torch.float32 else "tf32"
    grid = (-(-max_query_len // block_m), b, hq)
    _KERNELS["prefill"][grid](
        q, k_cache, v_cache, block_tables, cu_query, context_lens, out, scale * _LOG2E,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), block_tables.stride(0), out.stride(0), out.stride(1),
        GROUP=hq // hkv, D=d, D_PAD=pow2(d, 16), BS=bs, BLOCK_M=block_m, DOT_PREC=prec)
    return out


__all__ = ["DEFAULT_DECODE_TILES", "DEFAULT_PART_TOKENS", "DecodeTiles", "paged_decode", "paged_prefill"]

