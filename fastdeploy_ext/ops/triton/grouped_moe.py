"""Triton grouped-GEMM mixture of experts: the routed experts of a SwiGLU MoE in two GEMM launches.

The token x expert assignments (T tokens x k experts each: M = T*k rows) are grouped by expert
on the device (:func:`align_by_expert`): the rows in expert order (stable), each expert's run
padded up to a multiple of the row block ``block_m``, so every block of ``block_m`` rows belongs
to one expert. One kernel of a program per expert does it for decode-sized batches, fixed-shape torch
ops (a count by scatter, cumulative sums, a sort, a searchsorted) for larger ones: no value is
read back to the host, so a decode step that runs it can be captured in a CUDA graph. The
buffer of grouped rows has a static capacity (each non-empty expert wastes at most
``block_m - 1`` padding rows); blocks past the used part carry the expert id E and return at
once.

Then two grouped GEMMs, each program one (row block, column block) of one expert:
- gate/up: h = silu(x @ gate_e^T) * (x @ up_e^T) with both halves of the stacked [E, 2I, H]
  weight read by the same program (the SiLU product is fused, h is written once, [M, I]);
- down: y = (h @ down_e^T) * routing weight of the row, [M, H]; the k rows of a token are then
  summed by a third small launch (deterministic, no atomics), in fp32 with the optional ``add``
  (the shared experts' output: one rounding, and no separate add kernel on the decode step).

fp32 inputs use exact fp32 dots ("ieee"); fp16/bf16 dots accumulate in fp32 and h is rounded to
the input dtype between the two GEMMs (as the ATen path rounds it). Tested against the ATen path
in the Triton interpreter on the CPU (tests/test_triton_moe.py) and on CUDA there.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .runtime import KernelTable, interpreted, pow2, tl, triton


@dataclass(frozen=True)
class MoEBlocks:
    """Tile sizes of one launch: rows per block (the grouping's padding unit), output columns
    and reduction step per program, warps and pipeline stages."""
    block_m: int
    block_n: int
    block_k: int
    num_warps: int = 4
    num_stages: int = 3


def pick_blocks(assignments: int, num_experts: int) -> MoEBlocks:
    """Tiles by the mean rows per expert: decode-sized batches (a few rows per expert) are bound
    by reading the experts' weights, so small row blocks (little padding) and narrow column
    blocks (more programs on the SMs); prefill-sized ones are bound by the GEMMs: larger tiles.
    Not tuned per GPU yet (one table; bench: python3 -m fastdeploy_ext.bench.moe)."""
    per_expert = assignments / max(1, num_experts)
    if per_expert <= 16:
        return MoEBlocks(16, 32, 128, num_warps=4, num_stages=3)
    if per_expert <= 64:
        return MoEBlocks(32, 64, 64, num_warps=4, num_stages=3)
    return MoEBlocks(64, 128, 64, num_warps=8, num_stages=3)


def grouped_capacity(assignments: int, num_experts: int, block_m: int) -> int:
    """Rows of the grouped buffer: every assignment plus at most ``block_m - 1`` padding rows per
    expert that receives any (at most min(E, M) of them), rounded up to whole blocks."""
    rows = assignments + min(num_experts, assignments) * (block_m - 1)
    return -(-rows // block_m) * block_m


#: batches of at most this many token x expert rows (170 tokens at top-6) are grouped by one
#: Triton kernel of E + 1 programs (decode: one launch instead of ~20 small torch ops per layer);
#: larger ones by torch ops (prefill: each op is wide there, while every program of the kernel
#: counts all rows). bench.moe times both ways per batch size
ALIGN_KERNEL_MAX_ROWS = 1024
ALIGN_CHUNK = 128


def align_by_expert(expert_ids: torch.Tensor, num_experts: int, block_m: int, *,
                    kernel: bool | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(sorted_rows int32 [capacity], block_expert int32 [capacity / block_m]) for ``expert_ids``
    [T, k]: sorted_rows lists the assignment rows (t * k + j) grouped by expert in row order,
    each expert's run starting on a block boundary, padding rows = M (past the last row);
    block_expert is the expert of each block, E for blocks past the used part. Nothing is read
    back to the host. ``kernel``: group with the Triton kernel (True), torch ops (False), or
    the kernel where Triton runs on the device and there are at most ALIGN_KERNEL_MAX_ROWS rows
    (None); both give the same tensors."""
    m = expert_ids.numel()
    if kernel is None:
        from .runtime import kernels_usable
        kernel = m <= ALIGN_KERNEL_MAX_ROWS and kernels_usable(expert_ids)
    return _align_kernel(expert_ids, num_experts, block_m) if kernel else _align_torch(expert_ids, num_experts, block_m)


def _align_torch(expert_ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """align_by_expert in torch ops of static shape (a count by scatter, cumulative sums, a
    stable sort, a searchsorted)."""
    flat = expert_ids.reshape(-1).to(torch.int64)
    m, dev = flat.numel(), flat.device
    counts = torch.zeros(num_experts, dtype=torch.int64, device=dev).scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + (block_m - 1)) // block_m * block_m
    padded_end = padded.cumsum(0)
    run_start = counts.cumsum(0) - counts                    # first sorted position of each expert
    order = torch.argsort(flat, stable=True)                 # assignment rows grouped by expert
    sorted_expert = flat[order]
    dest = (padded_end - padded)[sorted_expert] + torch.arange(m, device=dev) - run_start[sorted_expert]
    cap = grouped_capacity(m, num_experts, block_m)
    rows = torch.full((cap,), m, dtype=torch.int32, device=dev).scatter_(0, dest, order.to(torch.int32))
    block_start = torch.arange(0, cap, block_m, device=dev, dtype=torch.int64)
    # the block starting at s belongs to the first expert whose padded run ends past s (empty
    # experts end where the previous one does, so they own no block); E past the used part
    block_expert = torch.searchsorted(padded_end, block_start, right=True).to(torch.int32)
    return rows, block_expert


def _align_kernel(expert_ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """align_by_expert in one launch of E + 1 programs (:func:`_align_rows_kernel`)."""
    flat = expert_ids.reshape(-1).contiguous()
    m, dev = flat.numel(), flat.device
    cap = grouped_capacity(m, num_experts, block_m)
    rows = torch.empty(cap, dtype=torch.int32, device=dev)
    block_expert = torch.empty(cap // block_m, dtype=torch.int32, device=dev)
    e_pad = pow2(num_experts, 16)
    launch = {} if interpreted() else {"num_warps": 4}
    _KERNELS["align"][(num_experts + 1,)](flat, rows, block_expert, m, cap, E=num_experts, E_PAD=e_pad, BM=block_m,
                                          CHUNK=ALIGN_CHUNK, **launch)
    return rows, block_expert


if triton is not None:
    # raw functions, decorated on first use in the mode triton was imported in (jit_decorator)
    def _align_rows_kernel(IDS, ROWS, BLOCK_EXPERT, M, CAP, E: tl.constexpr, E_PAD: tl.constexpr,
                           BM: tl.constexpr, CHUNK: tl.constexpr):
        # program e < E writes expert e's padded run; program E the tail past the used part. The
        # programs share nothing but the ids: each counts every expert's rows itself (a
        # [CHUNK, E_PAD] one-hot over M <= ALIGN_KERNEL_MAX_ROWS ids, read from L2), so they run
        # at once instead of one program walking every run (latency-bound: ~12 us a decode layer)
        e = tl.program_id(0)
        ex = tl.arange(0, E_PAD)
        counts = tl.zeros([E_PAD], tl.int32)
        for c0 in range(0, M, CHUNK):
            r = c0 + tl.arange(0, CHUNK)
            ids = tl.load(IDS + r, mask=r < M, other=-1)
            counts += tl.sum((ids[:, None] == ex[None, :]).to(tl.int32), 0)
        padded = (counts + (BM - 1)) // BM * BM
        run_end = tl.cumsum(padded, 0)
        mine = ex == e
        start = tl.sum(tl.where(mine, run_end - padded, 0), 0)
        count = tl.sum(tl.where(mine, counts, 0), 0)
        size = tl.sum(tl.where(mine, padded, 0), 0)
        if e < E:
            # the expert's rows in row order (a stable sort), then its padding rows (M)
            seen = count * 0
            for c0 in range(0, M, CHUNK):
                r = c0 + tl.arange(0, CHUNK)
                ids = tl.load(IDS + r, mask=r < M, other=-1)
                hit = (ids == e).to(tl.int32)
                rank = seen + tl.cumsum(hit, 0) - hit
                tl.store(ROWS + start + rank, r, mask=hit != 0)
                seen += tl.sum(hit, 0)
            q = start + count + tl.arange(0, BM)
            tl.store(ROWS + q, tl.full([BM], 0, tl.int32) + M, mask=q < start + size)
            for b0 in range(0, size // BM, CHUNK):
                b = b0 + tl.arange(0, CHUNK)
                tl.store(BLOCK_EXPERT + start // BM + b, tl.full([CHUNK], 0, tl.int32) + e, mask=b < size // BM)
        else:
            used = tl.sum(padded, 0)
            for p0 in range(used, CAP, CHUNK):
                p = p0 + tl.arange(0, CHUNK)
                tl.store(ROWS + p, tl.full([CHUNK], 0, tl.int32) + M, mask=p < CAP)
            for b0 in range(used // BM, CAP // BM, CHUNK):
                b = b0 + tl.arange(0, CHUNK)
                tl.store(BLOCK_EXPERT + b, tl.full([CHUNK], 0, tl.int32) + E, mask=b < CAP // BM)

    def _expert_tile(ROWS, BLOCK_EXPERT, W, M, N, s_we, BM: tl.constexpr, BN: tl.constexpr):
        # both GEMMs' program: row block pid 0 (its expert, its grouped rows: padding rows hold
        # M), column block pid 1, and the expert's weight base; a block whose expert is E (past
        # the used part) has nothing to do, which the caller checks
        pid_m = tl.program_id(0)
        e = tl.load(BLOCK_EXPERT + pid_m)
        rows = tl.load(ROWS + pid_m * BM + tl.arange(0, BM))
        n = tl.program_id(1) * BN + tl.arange(0, BN)
        return e, rows, rows < M, n, n < N, W + e.to(tl.int64) * s_we

    def _gate_up_kernel(X, W, ROWS, BLOCK_EXPERT, H, M, K, N, E, TOPK,
                        s_xt, s_we, s_wn, s_wk, s_ht,
                        BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, DOT_PREC: tl.constexpr):
        e, rows, rmask, n, nmask, w_base = _expert_tile(ROWS, BLOCK_EXPERT, W, M, N, s_we, BM, BN)
        if e >= E:
            return
        tok = (rows // TOPK).to(tl.int64)
        acc_g = tl.zeros([BM, BN], tl.float32)
        acc_u = tl.zeros([BM, BN], tl.float32)
        for k0 in range(0, K, BK):
            kk = k0 + tl.arange(0, BK)
            kmask = kk < K
            a = tl.load(X + tok[:, None] * s_xt + kk[None, :], mask=rmask[:, None] & kmask[None, :], other=0.0)
            wmask = kmask[:, None] & nmask[None, :]
            wg = tl.load(w_base + n[None, :] * s_wn + kk[:, None] * s_wk, mask=wmask, other=0.0)
            wu = tl.load(w_base + (n + N)[None, :] * s_wn + kk[:, None] * s_wk, mask=wmask, other=0.0)
            acc_g = tl.dot(a, wg, acc_g, input_precision=DOT_PREC)
            acc_u = tl.dot(a, wu, acc_u, input_precision=DOT_PREC)
        h = acc_g / (1.0 + tl.exp(-acc_g)) * acc_u
        h_ptr = H + rows.to(tl.int64)[:, None] * s_ht + n[None, :]
        tl.store(h_ptr, h.to(H.dtype.element_ty), mask=rmask[:, None] & nmask[None, :])

    def _down_kernel(H, W, ROWS, BLOCK_EXPERT, RW, Y, M, K, N, E,
                     s_ht, s_we, s_wn, s_wk, s_yt,
                     BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, DOT_PREC: tl.constexpr):
        e, rows, rmask, n, nmask, w_base = _expert_tile(ROWS, BLOCK_EXPERT, W, M, N, s_we, BM, BN)
        if e >= E:
            return
        r64 = rows.to(tl.int64)
        acc = tl.zeros([BM, BN], tl.float32)
        for k0 in range(0, K, BK):
            kk = k0 + tl.arange(0, BK)
            kmask = kk < K
            a = tl.load(H + r64[:, None] * s_ht + kk[None, :], mask=rmask[:, None] & kmask[None, :], other=0.0)
            w = tl.load(w_base + n[None, :] * s_wn + kk[:, None] * s_wk, mask=kmask[:, None] & nmask[None, :],
                        other=0.0)
            acc = tl.dot(a, w, acc, input_precision=DOT_PREC)
        rw = tl.load(RW + rows, mask=rmask, other=0.0)
        acc = acc * rw[:, None]
        tl.store(Y + r64[:, None] * s_yt + n[None, :], acc.to(Y.dtype.element_ty),
                 mask=rmask[:, None] & nmask[None, :])


    def _combine_kernel(Y, ADD, OUT, N, s_yt, s_at, s_ot, K: tl.constexpr, BN: tl.constexpr,
                        HAS_ADD: tl.constexpr):
        # out[t] = sum_j y[t * K + j] (+ add[t]): fp32 in registers, rounded once
        t = tl.program_id(0).to(tl.int64)
        n = tl.program_id(1) * BN + tl.arange(0, BN)
        nmask = n < N
        acc = tl.zeros([BN], tl.float32)
        for j in tl.static_range(K):
            acc += tl.load(Y + (t * K + j) * s_yt + n, mask=nmask, other=0.0).to(tl.float32)
        if HAS_ADD:
            acc += tl.load(ADD + t * s_at + n, mask=nmask, other=0.0).to(tl.float32)
        tl.store(OUT + t * s_ot + n, acc.to(OUT.dtype.element_ty), mask=nmask)


#: output columns per program of the combine launch
COMBINE_BN = 256

_KERNELS = KernelTable(lambda: {"align": _align_rows_kernel, "gate_up": _gate_up_kernel, "down": _down_kernel,
                                "combine": _combine_kernel},
                       helpers=lambda: {"_expert_tile": _expert_tile})


def _check(x: torch.Tensor, weights: torch.Tensor, expert_ids: torch.Tensor, gate_up: torch.Tensor,
           down: torch.Tensor) -> tuple[int, int, int, int]:
    if triton is None:
        raise RuntimeError("triton is not importable")
    if x.ndim != 2 or gate_up.ndim != 3 or down.ndim != 3:
        raise ValueError(f"x must be [T, H], gate_up [E, 2I, H], down [E, H, I]; got {list(x.shape)}, "
                         f"{list(gate_up.shape)}, {list(down.shape)}")
    t, h = x.shape
    e, two_i, gh = gate_up.shape
    i = two_i // 2
    if gh != h or two_i % 2 or tuple(down.shape) != (e, h, i):
        raise ValueError(f"expert weights do not fit hidden {h}: gate_up {list(gate_up.shape)} must be [E, 2I, {h}] "
                         f"and down {list(down.shape)} [E, {h}, I]")
    if expert_ids.ndim != 2 or expert_ids.shape[0] != t or tuple(weights.shape) != tuple(expert_ids.shape):
        raise ValueError(f"routing weights {list(weights.shape)} and expert ids {list(expert_ids.shape)} must both "
                         f"be [T={t}, k]")
    if expert_ids.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"expert ids must be int32/int64, got {expert_ids.dtype}")
    if gate_up.dtype != x.dtype or down.dtype != x.dtype:
        raise ValueError(f"x ({x.dtype}) and the expert weights ({gate_up.dtype}, {down.dtype}) must share a dtype")
    for name, a in (("x", x), ("gate_up", gate_up), ("down", down)):
        if a.stride(-1) != 1:
            raise ValueError(f"{name} must have a unit stride on its last dimension")
    return t, h, e, i


def grouped_moe(x: torch.Tensor, weights: torch.Tensor, expert_ids: torch.Tensor, gate_up: torch.Tensor,
                down: torch.Tensor, blocks: MoEBlocks | None = None, add: torch.Tensor | None = None) -> torch.Tensor:
    """The routed experts' output [T, H] (x's dtype): sum over j of weights[t, j] *
    down_e(silu(gate_e x_t) * up_e x_t) for e = expert_ids[t, j], plus ``add`` [T, H] where
    given (summed in fp32). ``gate_up`` [E, 2I, H] (gate rows first), ``down`` [E, H, I];
    ``weights`` are applied as given (fp32 is kept)."""
    t, h, e, i = _check(x, weights, expert_ids, gate_up, down)
    if add is not None and (tuple(add.shape) != (t, h) or add.stride(-1) != 1):
        raise ValueError(f"add must be [T={t}, H={h}] with a unit last stride, got {list(add.shape)} {add.stride()}")
    k = expert_ids.shape[1]
    m = t * k
    if m == 0:
        return x.new_zeros(t, h) if add is None else add.to(x.dtype, copy=True)
    cfg = blocks or pick_blocks(m, e)
    rows, block_expert = align_by_expert(expert_ids, e, cfg.block_m)
    nblocks = block_expert.numel()
    prec = "ieee" if x.dtype == torch.float32 else "tf32"
    launch = {} if interpreted() else {"num_warps": cfg.num_warps, "num_stages": cfg.num_stages}
    hbuf = torch.empty(m, i, dtype=x.dtype, device=x.device)
    _KERNELS["gate_up"][(nblocks, triton.cdiv(i, cfg.block_n))](
        x, gate_up, rows, block_expert, hbuf, m, h, i, e, k,
        x.stride(0), gate_up.stride(0), gate_up.stride(1), gate_up.stride(2), hbuf.stride(0),
        BM=cfg.block_m, BN=cfg.block_n, BK=cfg.block_k, DOT_PREC=prec, **launch)
    y = torch.empty(m, h, dtype=x.dtype, device=x.device)
    rw = weights.reshape(-1).to(torch.float32).contiguous()
    _KERNELS["down"][(nblocks, triton.cdiv(h, cfg.block_n))](
        hbuf, down, rows, block_expert, rw, y, m, i, h, e,
        hbuf.stride(0), down.stride(0), down.stride(1), down.stride(2), y.stride(0),
        BM=cfg.block_m, BN=cfg.block_n, BK=cfg.block_k, DOT_PREC=prec, **launch)
    out = torch.empty(t, h, dtype=x.dtype, device=x.device)
    _KERNELS["combine"][(t, triton.cdiv(h, COMBINE_BN))](
        y, y if add is None else add, out, h, y.stride(0), 0 if add is None else add.stride(0), out.stride(0),
        K=k, BN=COMBINE_BN, HAS_ADD=add is not None)
    return out


__all__ = ["ALIGN_KERNEL_MAX_ROWS", "MoEBlocks", "align_by_expert", "grouped_capacity", "grouped_moe", "pick_blocks"]
