"""Attention over equal-length sequences with an additive bias or a boolean mask: DeepSeek-OCR-2's
SAM layers (a decomposed relative-position bias, over 14x14 windows or the whole grid) and its
Qwen2 encoder (a bidirectional visual prefix, causal learned queries). One backend object per
kernel, as varlen.py and dense.py; a vendor contributes its own under the kind
(DeviceRunner.kernel_backends). ATen's SDPA is the one built-in: it takes a bias and a mask on
every device; fast kernels that fold the decomposed bias in are to come."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F


def sdpa_with_mask(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """[B, H, N, Dh] each, ``mask`` additive float or bool (True: attend) broadcastable to
    [B, H, N, N] -> [B, H, N, Dh]: ATen's scaled_dot_product_attention, its own kernel choice."""
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


@dataclass(frozen=True)
class MaskedAttentionBackend:
    name: str
    #: (q, k, v [B, H, N, Dh], mask) -> [B, H, N, Dh]
    attend: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
    available: Callable[[torch.device], tuple[bool, str]]
    #: takes q/k/v as strided views (of a fused qkv projection) without the caller copying them
    reads_strides: bool


def _aten(device: torch.device) -> tuple[bool, str]:
    return True, "ATen scaled_dot_product_attention with attn_mask: every device"


# ATen's SDPA takes q/k/v of any strides (its fused kernels read them with the last dim
# contiguous; its math path copies where it must): views of a fused qkv need no copy by us
SDPA_BIAS = MaskedAttentionBackend("sdpa_bias", sdpa_with_mask, _aten, reads_strides=True)
SDPA_MASK = MaskedAttentionBackend("sdpa_mask", sdpa_with_mask, _aten, reads_strides=True)

#: the built-in backends of the relative-position bias kinds (windowed and global) and of the
#: prefix-causal kind
BUILTIN_RELPOS_BACKENDS: tuple[MaskedAttentionBackend, ...] = (SDPA_BIAS,)
BUILTIN_PREFIX_BACKENDS: tuple[MaskedAttentionBackend, ...] = (SDPA_MASK,)
