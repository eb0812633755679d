"""Dense attention: every sequence of a batch the same length, no mask — a layout detector's
AIFI encoder layer (one stride-32 feature map per page: 625 tokens at 800x800). One backend
object per kernel, like varlen.py and deformable.py; a vendor contributes its own under the kind
``dense_attention`` (DeviceRunner.kernel_backends)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F


def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """[B, H, N, Dh] each -> [B, H, N, Dh]: ATen's scaled_dot_product_attention, its own kernel choice."""
    return F.scaled_dot_product_attention(q, k, v)


def sdpa_flash(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """The same through ATen's FlashAttention kernel only (CUDA, half precision): no silent
    fall back to the math path inside SDPA's dispatcher."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        return F.scaled_dot_product_attention(q, k, v)


def _flash_available(device: torch.device) -> tuple[bool, str]:
    if device.type != "cuda":
        return False, f"ATen's FlashAttention kernel needs CUDA (device {device.type})"
    if not torch.backends.cuda.is_flash_attention_available():
        return False, "this torch build has no FlashAttention kernel"
    return True, "ATen FlashAttention"


@dataclass(frozen=True)
class DenseAttentionBackend:
    name: str
    #: (q, k, v [B, H, N, Dh]) -> [B, H, N, Dh]
    attend: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
    available: Callable[[torch.device], tuple[bool, str]]


BUILTIN_DENSE_BACKENDS: tuple[DenseAttentionBackend, ...] = (
    DenseAttentionBackend("sdpa", sdpa, lambda device: (True, "ATen scaled_dot_product_attention")),
    DenseAttentionBackend("sdpa_flash", sdpa_flash, _flash_available),
)
