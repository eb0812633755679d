"""Attention over equal-length sequences with a structured bias or mask: DeepSeek-OCR-2's SAM
layers (the decomposed relative-position bias, over 14x14 windows or the whole grid) and its
Qwen2 encoder (a bidirectional visual prefix, causal learned queries). One backend object per
kernel, as varlen.py and dense.py; a vendor contributes its own under the kind
(DeviceRunner.kernel_backends). Each owns its kernel facts: where it runs (``available``) and
whether it reads strided q/k/v (``reads_strides``: SAM's are views of its fused projection).

- rel-pos kinds (``relpos_window_attention``, ``relpos_global_attention``): a
  :class:`RelPosAttention` takes q, k, v ``[B, H, N, D]`` over a grid_h x grid_w grid and the
  per-query projections ``rel_h = q . Rh[qh - kh]`` ``[B, H, N, grid_h]`` and ``rel_w``
  ``[B, H, N, grid_w]`` (the model computes them, as the reference does with einsum); the logits
  are ``q.k / sqrt(D) + rel_h[q, kh] + rel_w[q, kw]``. ``sdpa_bias`` materializes that
  ``[N, N]`` bias and calls ATen's SDPA (every device); ``triton_relpos`` adds the two terms per
  tile inside a flash-attention kernel (ops/triton/biased_attention.py; CUDA).
- prefix-causal kind: a :class:`PrefixCausalAttention` takes q ``[B, Hq, N, D]`` and k, v
  ``[B, Hkv, N, D]`` (grouped-query heads) and the state its ``prepare(n_prefix, n, device)``
  made once per forward: ``sdpa_mask`` a boolean ``[N, N]`` mask (k/v repeated per query head),
  ``triton_prefix_causal`` just the prefix length (the mask is index arithmetic in the kernel).

Both take the softmax scale 1/sqrt(D) (SDPA's default; SAM's and Qwen2's).
"""
from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F


def prefix_mask(n_prefix: int, n_total: int, device) -> torch.Tensor:
    """bool [n, n], True where query i may attend key j: the prefix attends within itself in
    both directions, every later token (a query) causally, which covers the whole prefix."""
    i = torch.arange(n_total, device=device)
    causal = i[None, :] <= i[:, None]
    both_prefix = (i[:, None] < n_prefix) & (i[None, :] < n_prefix)
    return causal | both_prefix


class RelPosAttention:
    """One kernel for attention with SAM's decomposed relative-position bias."""
    name: str
    reads_strides: bool = True

    def available(self, device: torch.device) -> tuple[bool, str]:
        raise NotImplementedError

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rel_h: torch.Tensor,
                 rel_w: torch.Tensor) -> torch.Tensor:
        """q, k, v [B, H, N, D]; rel_h [B, H, N, grid_h]; rel_w [B, H, N, grid_w] -> [B, H, N, D]."""
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r})"


class SdpaRelPos(RelPosAttention):
    """ATen SDPA with the bias materialized ([B, H, N, N] in q's dtype: the reference's math).
    SDPA takes q/k/v of any strides (its fused kernels read them with the last dim contiguous,
    its math path copies where it must): views of a fused qkv need no copy by us."""
    name = "sdpa_bias"

    def available(self, device):
        return True, "ATen SDPA with an additive bias: every device"

    def __call__(self, q, k, v, rel_h, rel_w):
        b, h, n, _ = q.shape
        bias = (rel_h[..., :, None] + rel_w[..., None, :]).reshape(b, h, n, n)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=bias)


class TritonRelPos(RelPosAttention):
    """Our flash-attention kernel adding rel_h[q, key row] + rel_w[q, key col] per tile: no
    [N, N] bias is materialized (4096^2 x 12 heads per 1024 view in SAM's global layers)."""
    name = "triton_relpos"

    def available(self, device):
        from ..triton.runtime import available_on
        return available_on(device)

    def __call__(self, q, k, v, rel_h, rel_w):
        from ..triton.biased_attention import relpos_attention
        return relpos_attention(q, k, v, rel_h.contiguous(), rel_w.contiguous(), q.shape[-1] ** -0.5)


class PrefixCausalAttention:
    """One kernel for attention over a bidirectional prefix and causal tokens after it."""
    name: str
    reads_strides: bool = True

    def available(self, device: torch.device) -> tuple[bool, str]:
        raise NotImplementedError

    def prepare(self, n_prefix: int, n_total: int, device: torch.device) -> Any:
        """What every layer's call takes (host ints in; built once per forward, no sync)."""
        raise NotImplementedError

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, state: Any) -> torch.Tensor:
        """q [B, Hq, N, D]; k, v [B, Hkv, N, D] (Hq a multiple of Hkv) -> [B, Hq, N, D]."""
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r})"


class SdpaPrefixMask(PrefixCausalAttention):
    """ATen SDPA with a boolean [N, N] mask, k/v repeated to the query heads."""
    name = "sdpa_mask"

    def available(self, device):
        return True, "ATen SDPA with a boolean mask: every device"

    def prepare(self, n_prefix, n_total, device):
        return prefix_mask(n_prefix, n_total, device)

    def __call__(self, q, k, v, state):
        rep = q.shape[1] // k.shape[1]
        if rep > 1:
            k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=state)


class TritonPrefixCausal(PrefixCausalAttention):
    """Our flash-attention kernel with the prefix length as an argument: no mask tensor, the
    grouped k/v heads read in place (no repeat), query blocks stop at their last visible key."""
    name = "triton_prefix_causal"

    def available(self, device):
        from ..triton.runtime import available_on
        return available_on(device)

    def prepare(self, n_prefix, n_total, device):
        return int(n_prefix)

    def __call__(self, q, k, v, state):
        from ..triton.biased_attention import prefix_causal_attention
        return prefix_causal_attention(q, k, v, state, q.shape[-1] ** -0.5)


SDPA_BIAS = SdpaRelPos()
SDPA_MASK = SdpaPrefixMask()
TRITON_RELPOS = TritonRelPos()
TRITON_PREFIX_CAUSAL = TritonPrefixCausal()

#: the built-in backends of the relative-position bias kinds (windowed and global) and of the
#: prefix-causal kind
BUILTIN_RELPOS_BACKENDS: tuple[RelPosAttention, ...] = (TRITON_RELPOS, SDPA_BIAS)
BUILTIN_PREFIX_BACKENDS: tuple[PrefixCausalAttention, ...] = (TRITON_PREFIX_CAUSAL, SDPA_MASK)


def rel_pos_rows(table: torch.Tensor, size: int) -> torch.Tensor:
    """The [2 * size - 1, head_dim] bias vectors of the offsets -(size-1)..size-1, the table
    resized linearly when it was trained for another size (SAM's global layers on a crop)."""
    n = 2 * size - 1
    if table.shape[0] != n:
        table = F.interpolate(table.t()[None].float(), size=n, mode="linear")[0].t().to(table.dtype)
    return table


def rel_pos_table(table: torch.Tensor, size: int) -> torch.Tensor:
    """[size, size, head_dim]: the bias vectors of query i against key j (offset i - j), the
    table resized linearly to 2 * size - 1 rows when it was trained for another size."""
    table = rel_pos_rows(table, size)
    idx = torch.arange(size, device=table.device)
    return table[idx[:, None] - idx[None, :] + size - 1]


def rel_pos_projections(q: torch.Tensor, rel_pos_h: torch.Tensor, rel_pos_w: torch.Tensor, grid_h: int,
                        grid_w: int, *, kernel: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """SAM's per-query projections ``rel_h = q . Rh[qh - kh]`` [B, H, N, grid_h] and ``rel_w``
    [B, H, N, grid_w] from q [B, H, N, D] (row-major over the grid). ``kernel``: our Triton
    launch, which reads a strided q in place (ops/triton/biased_attention.py); else einsum over
    the gathered tables, the reference's math (it copies q twice and its outputs once)."""
    b, h, n, d = q.shape
    if kernel:
        from ..triton.biased_attention import relpos_projections
        return relpos_projections(q, rel_pos_rows(rel_pos_h, grid_h).contiguous(),
                                  rel_pos_rows(rel_pos_w, grid_w).contiguous(), grid_h, grid_w)
    qg = q.reshape(b, h, grid_h, grid_w, d)
    rh = torch.einsum("bnhwc,hkc->bnhwk", qg, rel_pos_table(rel_pos_h, grid_h)).reshape(b, h, n, grid_h)
    rw = torch.einsum("bnhwc,wkc->bnhwk", qg, rel_pos_table(rel_pos_w, grid_w)).reshape(b, h, n, grid_w)
    return rh, rw
