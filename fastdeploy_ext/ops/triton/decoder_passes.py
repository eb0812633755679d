"""Fused Triton passes of the text decoder layer (CUDA; CPU tests run them in the interpreter).

An ERNIE layer eager is ~40 small kernels (RMSNorm alone is 7 ATen ops); a decode step is
launch-bound even when graphed. These three passes cut a layer to ~10 kernels:

- ``add_rms_norm(delta, residual, w, eps)``: residual += delta (in place), returns
  RMSNorm(residual) — transformers' order: the sum rounded to the compute dtype, the norm in
  fp32, cast back, then times the weight.
- ``rope_and_cache(qkv, cos, sin, k_cache, v_cache, slots, ...)``: rotates q in place inside
  the packed qkv buffer (NeoX rotate_half, cos/sin [T, D] with equal halves as mrope builds
  them) and writes rotated k and v straight into the paged cache at each token's slot.
- ``silu_mul(gate_up)``: SiLU(gate) * up of the fused gate/up projection.

Each rounds once from fp32 where transformers rounds after every op: bf16 results differ from
transformers' by an ulp at most, fp32 ones agree within 1e-6.
"""
from __future__ import annotations

import torch

from .runtime import KernelTable, pow2, tl, triton, usable_on


if triton is not None:
    def _add_rms_norm_kernel(DELTA, RES, W, Y, eps, s_d, s_r, s_y, N: tl.constexpr, BLOCK: tl.constexpr,
                             HAS_DELTA: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        c = tl.arange(0, BLOCK)
        mask = c < N
        r = tl.load(RES + row * s_r + c, mask=mask, other=0.0)
        if HAS_DELTA:
            d = tl.load(DELTA + row * s_d + c, mask=mask, other=0.0)
            r = (r.to(tl.float32) + d.to(tl.float32)).to(r.dtype)
            tl.store(RES + row * s_r + c, r, mask=mask)
        x = r.to(tl.float32)
        inv = tl.rsqrt(tl.sum(x * x, 0) / N + eps)
        w = tl.load(W + c, mask=mask, other=0.0)
        y = (w.to(tl.float32) * (x * inv).to(r.dtype).to(tl.float32)).to(r.dtype)
        tl.store(Y + row * s_y + c, y, mask=mask)

    def _rope_cache_kernel(QKV, COS, SIN, KC, VC, SLOTS, s_t, s_ct, s_st, s_kb, s_kh, s_vb, s_vh,
                           HQ: tl.constexpr, HKV: tl.constexpr, HQ_PAD: tl.constexpr, HKV_PAD: tl.constexpr,
                           D: tl.constexpr, HALF: tl.constexpr, HALF_PAD: tl.constexpr):
        t = tl.program_id(0).to(tl.int64)
        j = tl.arange(0, HALF_PAD)
        jm = j < HALF
        c = tl.load(COS + t * s_ct + j, mask=jm, other=0.0).to(tl.float32)
        s = tl.load(SIN + t * s_st + j, mask=jm, other=0.0).to(tl.float32)
        base = QKV + t * s_t
        # q: rotate in place
        hq = tl.arange(0, HQ_PAD)
        qm = (hq < HQ)[:, None] & jm[None, :]
        p1 = base + hq[:, None] * D + j[None, :]
        x1 = tl.load(p1, mask=qm, other=0.0)
        x2 = tl.load(p1 + HALF, mask=qm, other=0.0)
        f1, f2 = x1.to(tl.float32), x2.to(tl.float32)
        tl.store(p1, (f1 * c[None, :] - f2 * s[None, :]).to(x1.dtype), mask=qm)
        tl.store(p1 + HALF, (f2 * c[None, :] + f1 * s[None, :]).to(x1.dtype), mask=qm)
        # k: rotate into the cache slot; v: copy into the cache slot
        slot = tl.load(SLOTS + t)
        hk = tl.arange(0, HKV_PAD)
        km = (hk < HKV)[:, None] & jm[None, :]
        pk = base + (HQ + hk)[:, None] * D + j[None, :]
        k1 = tl.load(pk, mask=km, other=0.0)
        k2 = tl.load(pk + HALF, mask=km, other=0.0)
        g1, g2 = k1.to(tl.float32), k2.to(tl.float32)
        kd = KC + slot * s_kb + hk[:, None] * s_kh + j[None, :]
        tl.store(kd, (g1 * c[None, :] - g2 * s[None, :]).to(KC.dtype.element_ty), mask=km)
        tl.store(kd + HALF, (g2 * c[None, :] + g1 * s[None, :]).to(KC.dtype.element_ty), mask=km)
        pv = base + (HQ + HKV + hk)[:, None] * D + j[None, :]
        vd = VC + slot * s_vb + hk[:, None] * s_vh + j[None, :]
        tl.store(vd, tl.load(pv, mask=km, other=0.0).to(VC.dtype.element_ty), mask=km)
        tl.store(vd + HALF, tl.load(pv + HALF, mask=km, other=0.0).to(VC.dtype.element_ty), mask=km)

    def _silu_mul_kernel(GU, Y, s_g, s_y, I: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = c < I
        g = tl.load(GU + row * s_g + c, mask=mask, other=0.0)
        u = tl.load(GU + row * s_g + I + c, mask=mask, other=0.0).to(tl.float32)
        gf = g.to(tl.float32)
        tl.store(Y + row * s_y + c, (gf / (1.0 + tl.exp(-gf)) * u).to(g.dtype), mask=mask)


_KERNELS = KernelTable(lambda: {"add_rms_norm": _add_rms_norm_kernel, "rope_cache": _rope_cache_kernel,
               "silu_mul": _silu_mul_kernel})


def usable(device: torch.device) -> bool:
    """The passes can run on ``device``: CUDA with compiled Triton, or the CPU under the interpreter."""
    return usable_on(device)


def add_rms_norm(delta: torch.Tensor | None, residual: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """residual += delta (in place; skipped when delta is None); returns RMSNorm(residual)."""
    n, h = residual.shape
    y = torch.empty_like(residual)
    _KERNELS["add_rms_norm"][(n,)](
        residual if delta is None else delta, residual, weight, y, eps,
        0 if delta is None else delta.stride(0), residual.stride(0), y.stride(0),
        N=h, BLOCK=pow2(h), HAS_DELTA=delta is not None)
    return y


def rope_and_cache(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor,
                   v_cache: torch.Tensor, slots: torch.Tensor, num_heads: int, num_kv_heads: int, head_dim: int) -> None:
    """qkv [T, (Hq + 2 Hkv) * D] (q, k, v heads packed, unit stride inside a row); caches
    [num_blocks, block_size, Hkv, D] viewed per slot; slots int64 [T]."""
    t = qkv.shape[0]
    if qkv.stride(1) != 1 or k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("rope_and_cache needs unit stride on the last dimension of qkv and the caches")
    if k_cache.stride(1) != num_kv_heads * head_dim or v_cache.stride(1) != num_kv_heads * head_dim:
        raise ValueError("rope_and_cache needs contiguous [block_size, Hkv, D] blocks")
    half = head_dim // 2
    _KERNELS["rope_cache"][(t,)](
        qkv, cos, sin, k_cache, v_cache, slots, qkv.stride(0), cos.stride(0), sin.stride(0),
        k_cache.stride(1), k_cache.stride(2), v_cache.stride(1), v_cache.stride(2),
        HQ=num_heads, HKV=num_kv_heads, HQ_PAD=pow2(num_heads), HKV_PAD=pow2(num_kv_heads), D=head_dim,
        HALF=half, HALF_PAD=pow2(half))


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """[T, 2I] (gate | up) -> SiLU(gate) * up, [T, I]."""
    t, two_i = gate_up.shape
    i = two_i // 2
    y = torch.empty(t, i, dtype=gate_up.dtype, device=gate_up.device)
    block = min(1024, pow2(i))
    _KERNELS["silu_mul"][(t, -(-i // block))](gate_up, y, gate_up.stride(0), y.stride(0), I=i, BLOCK=block)
    return y
