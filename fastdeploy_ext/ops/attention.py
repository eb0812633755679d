"""Varlen (block-diagonal) attention backends for the packed vision sequence.

A backend takes q, k, v of shape [N, H, D] — views into the packed qkv buffer when the plan
chose the strided layout, contiguous tensors otherwise — plus the batch metadata, and returns
[N, H, D]. The table below is the one place that says what each kernel can do; the capability
table (capabilities.yaml) says which of them a device row prefers, and the plan picks.
"""
from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass
from typing import Callable, Protocol

import torch
import torch.nn.functional as F


class _Meta(Protocol):
    seq_lens: list[int]
    cu_seqlens: torch.Tensor
    max_seqlen: int
    extras: dict


AttentionFn = Callable[..., torch.Tensor]


@dataclass(frozen=True)
class AttentionBackend:
    name: str
    reads_strides: bool        # consumes strided q/k/v views without copying them
    fuses_rotary: bool         # applies the 2D rotary inside the kernel (takes cos/sin)
    fn: AttentionFn
    available: Callable[[torch.device], tuple[bool, str]]
    needs_block_table: bool = False


def _sdpa_context(kernel: str | None):
    if kernel is None:
        return nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel
    return sdpa_kernel([getattr(SDPBackend, kernel)])


def _sdpa_loop(kernel: str | None) -> AttentionFn:
    """One SDPA call per segment, split with host ints (no sync). On CUDA a specific SDPA
    kernel can be forced (cuDNN is the fastest torch kernel for head_dim 72 on Hopper)."""
    def run(q, k, v, meta: _Meta, scale: float, cos=None, sin=None):
        with _sdpa_context(kernel):
            if len(meta.seq_lens) == 1:
                o = F.scaled_dot_product_attention(
                    q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None], scale=scale)
                return o[0].transpose(0, 1)
            out = q.new_empty(q.shape)
            s = 0
            for n in meta.seq_lens:
                e = s + n
                o = F.scaled_dot_product_attention(
                    q[s:e].transpose(0, 1)[None], k[s:e].transpose(0, 1)[None], v[s:e].transpose(0, 1)[None],
                    scale=scale)
                out[s:e] = o[0].transpose(0, 1)
                s = e
            return out
    return run


def _always(device: torch.device) -> tuple[bool, str]:
    return True, "torch SDPA runs on every device"


def _cuda_only(device: torch.device) -> tuple[bool, str]:
    if device.type != "cuda":
        return False, f"needs a CUDA device, have {device.type}"
    return True, "CUDA device present"


def _triton_available(device: torch.device) -> tuple[bool, str]:
    from . import triton_attention
    if device.type != "cuda":
        return False, f"Triton kernels need a CUDA device, have {device.type}"
    return triton_attention.triton_available()


def _triton_fn(fused_rotary: bool) -> AttentionFn:
    def run(q, k, v, meta: _Meta, scale: float, cos=None, sin=None):
        from .triton_attention import varlen_attention
        # the encoder's q/k are scratch (views of its per-layer qkv buffer, or dense copies):
        # a rotary pre-pass may overwrite them instead of allocating rotated copies
        kw = dict(cos=cos, sin=sin, rotary_in_place=True) if fused_rotary else {}
        return varlen_attention(q, k, v, meta.extras["block_table"], meta.max_seqlen, scale, **kw)
    return run


def _fa3_dispatch(q, k, v, meta: _Meta, scale: float, cos=None, sin=None):
    """FlashAttention-3 for batches with long sequences, the Triton rope kernel for the others
    (ops/fa3_attention.py says why and where the threshold comes from)."""
    from .fa3_attention import LengthDispatch, fa3_min_seqlen, fa3_varlen
    from .triton_fused import rotary_q_and_k_in_place
    dispatch = LengthDispatch(
        long_fn=lambda q, k, v, meta, scale: fa3_varlen(q, k, v, meta.cu_seqlens, meta.max_seqlen, scale),
        short_fn=_triton_fn(True), rotate=rotary_q_and_k_in_place, min_seqlen=fa3_min_seqlen())
    return dispatch(q, k, v, meta, scale, cos=cos, sin=sin)


def _fa3_available(device: torch.device) -> tuple[bool, str]:
    from .fa3_attention import fa3_available
    return fa3_available(device)


ATTENTION_BACKENDS: dict[str, AttentionBackend] = {
    b.name: b for b in (
        AttentionBackend("triton_varlen", reads_strides=True, fuses_rotary=False,
                         fn=_triton_fn(False), available=_triton_available, needs_block_table=True),
        AttentionBackend("triton_varlen_rope", reads_strides=True, fuses_rotary=True,
                         fn=_triton_fn(True), available=_triton_available, needs_block_table=True),
        # per batch: FA3 (long sequences, rotary pre-pass) or triton_varlen_rope (short ones)
        AttentionBackend("fa3_varlen", reads_strides=True, fuses_rotary=True,
                         fn=_fa3_dispatch, available=_fa3_available, needs_block_table=True),
        AttentionBackend("sdpa_cudnn", reads_strides=True, fuses_rotary=False,
                         fn=_sdpa_loop("CUDNN_ATTENTION"), available=_cuda_only),
        AttentionBackend("sdpa_flash", reads_strides=True, fuses_rotary=False,
                         fn=_sdpa_loop("FLASH_ATTENTION"), available=_cuda_only),
        AttentionBackend("sdpa", reads_strides=True, fuses_rotary=False,
                         fn=_sdpa_loop(None), available=_always),
    )
}


def get_backend(name: str) -> AttentionBackend:
    try:
        return ATTENTION_BACKENDS[name]
    except KeyError:
        raise ValueError(f"unknown attention backend {name!r}; known: {', '.join(ATTENTION_BACKENDS)}") from None
