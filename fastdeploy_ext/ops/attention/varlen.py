"""Varlen (block-diagonal) attention backends for the packed vision sequence.

A backend takes q, k, v of shape [N, H, D] — views into the packed qkv buffer when the plan
chose the strided layout, contiguous tensors otherwise — plus the batch metadata, and returns
[N, H, D]. Each backend is one object that owns every fact about its kernel: whether it reads
strided q/k/v, whether a CUDA graph can replay it over a padded token budget, the head dims it
supports, whether it applies the 2D rotary itself, and the per-batch preparation it needs (the
Triton kernel's block table, built from host ints by :meth:`VarlenAttention.prepare`). The
capability table (capabilities.yaml) says which of them a device row prefers and in which
dtypes; the plan picks. A device backend may contribute objects of its own
(``DeviceRunner.kernel_backends``; ops/kernels.py composes each runner's table).
"""
from __future__ import annotations

from contextlib import nullcontext
from types import MappingProxyType
from typing import Any, Callable, Mapping, Protocol

import torch
import torch.nn.functional as F

from ...plan.table import KernelFacts
from ..rotary import rotary_q_and_k_in_place

Upload = Callable[[torch.Tensor], torch.Tensor]    # host tensor -> the same values on the device


class _Meta(Protocol):
    seq_lens: list[int]
    cu_seqlens: torch.Tensor
    max_seqlen: int
    attention_state: Any


class GraphState(Protocol):
    state: Any                            # what meta.attention_state holds inside the graph

    def load(self, batch_state: Any) -> None:
        """Copy a batch's prepared state in (device-to-device, no sync)."""


class VarlenAttention:
    """One attention kernel for the packed vision sequence and what the plan must know of it."""
    name: str
    reads_strides: bool = True           # consumes strided q/k/v views without copying them
    graph_safe: bool = False             # its launch can be replayed over a padded budget
    head_dims: tuple[int, int] = (1, 512)
    applies_rotary: bool = False         # takes cos/sin and rotates q and k itself

    def available(self, device: torch.device) -> tuple[bool, str]:
        """(present, reason) on this device."""
        raise NotImplementedError

    def facts(self, availability: tuple[bool, str]) -> KernelFacts:
        """What the plan reads, with this device's availability."""
        return KernelFacts(self.reads_strides, self.graph_safe, self.head_dims, *availability)

    def prepare(self, seq_lens: list[int], upload: Upload) -> Any:
        """Per-batch state the kernel needs, from host ints (no device sync), put on the device
        with ``upload``; stored as ``meta.attention_state``. None: nothing needed."""
        return None

    def graph_state(self, max_tokens: int, max_segments: int, device: torch.device) -> "GraphState":
        """The static state a captured graph reads (graph_safe backends only), sized for any
        batch of up to max_tokens tokens in max_segments segments."""
        raise NotImplementedError(f"{self.name} cannot be captured in a graph")

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: _Meta, scale: float,
                 cos: torch.Tensor | None = None, sin: torch.Tensor | None = None) -> torch.Tensor:
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r})"


class SdpaLoop(VarlenAttention):
    """One torch SDPA call per segment, split with host ints (no sync). On CUDA a specific SDPA
    kernel can be forced (cuDNN is the fastest torch kernel for head_dim 72 on Hopper). Its
    launches depend on the batch's segments, so no graph can replay it over padded budgets."""

    def __init__(self, name: str, kernel: str | None, head_dims: tuple[int, int], cuda_only: bool):
        self.name, self.kernel, self.head_dims, self.cuda_only = name, kernel, head_dims, cuda_only

    def available(self, device: torch.device) -> tuple[bool, str]:
        if not self.cuda_only:
            return True, "torch SDPA runs on every device"
        if device.type != "cuda":
            return False, f"needs a CUDA device, have {device.type}"
        return True, "CUDA device present"

    def _context(self):
        if self.kernel is None:
            return nullcontext()
        from torch.nn.attention import SDPBackend, sdpa_kernel
        return sdpa_kernel([getattr(SDPBackend, self.kernel)])

    def __call__(self, q, k, v, meta: _Meta, scale: float, cos=None, sin=None):
        with self._context():
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


class TritonVarlen(VarlenAttention):
    """Our one-launch Triton kernel (ops/triton/varlen_attention.py): a fixed grid over a
    host-built block table, so a graph replays it over a budget whose table is padded with no-op
    rows. ``rotary``: the backend rotates q and k itself, in place (the encoder's q/k are scratch
    views of its qkv buffer, or dense copies) with the one-launch Triton pass, then runs the
    kernel; without it, q and k arrive rotated."""
    reads_strides = True
    graph_safe = True
    head_dims = (16, 256)

    def __init__(self, name: str, rotary: bool):
        self.name, self.applies_rotary = name, rotary

    def available(self, device: torch.device) -> tuple[bool, str]:
        from ..triton.runtime import available_on
        return available_on(device)

    def prepare(self, seq_lens: list[int], upload: Upload) -> torch.Tensor:
        from ..triton.varlen_attention import build_block_table
        return upload(build_block_table(seq_lens))

    def graph_state(self, max_tokens: int, max_segments: int, device: torch.device) -> "_GraphBlockTable":
        from ..triton.varlen_attention import BLOCK_M
        # the worst case: every segment adds at most one partial query block
        return _GraphBlockTable(max_tokens // BLOCK_M + max_segments, device)

    def __call__(self, q, k, v, meta: _Meta, scale: float, cos=None, sin=None):
        from ..triton.varlen_attention import varlen_attention
        if self.applies_rotary:
            rotary_q_and_k_in_place(q, k, cos, sin)
        return varlen_attention(q, k, v, meta.attention_state, meta.max_seqlen, scale)


class Fa3Varlen(TritonVarlen):
    """``fa3_varlen``: per batch, FlashAttention-3 (optional `fa3` extra, ops/attention/fa3.py)
    when the longest sequence has at least FD_FA3_MIN_SEQLEN tokens (q and k rotated in place
    first), else — and always under CUDA graph capture — the triton_rope_varlen path. FA3 is never
    captured, so the backend is graph safe with the Triton kernel's block table."""
    head_dims = (8, 256)

    def __init__(self, name: str, short: TritonVarlen):
        self.name, self.applies_rotary, self.short = name, True, short

    def available(self, device: torch.device) -> tuple[bool, str]:
        from .fa3 import fa3_available
        return fa3_available(device)

    def __call__(self, q, k, v, meta: _Meta, scale: float, cos=None, sin=None):
        from .fa3 import LengthDispatch, fa3_min_seqlen, fa3_varlen
        dispatch = LengthDispatch(
            long_fn=lambda q, k, v, meta, scale: fa3_varlen(q, k, v, meta.cu_seqlens, meta.max_seqlen, scale),
            short_fn=self.short, rotate=rotary_q_and_k_in_place, min_seqlen=fa3_min_seqlen())
        return dispatch(q, k, v, meta, scale, cos=cos, sin=sin)


class _GraphBlockTable:
    """A fixed-size block table for a captured grid: the batch's rows, then no-op rows (the
    grid is fixed, so every unused program must find a row that makes it store nothing)."""

    def __init__(self, rows: int, device: torch.device):
        from ..triton.varlen_attention import noop_block_table
        self.noop = noop_block_table(rows, device)
        self.state = self.noop.clone()

    def load(self, batch_state: torch.Tensor) -> None:
        self.state.copy_(self.noop)
        self.state[:batch_state.shape[0]].copy_(batch_state)


_TRITON_ROPE = TritonVarlen("triton_rope_varlen", rotary=True)
#: the framework's own backends; a runner's table (ops/kernels.py) adds those its backend contributes
BUILTIN_VARLEN_BACKENDS: tuple[VarlenAttention, ...] = (
    _TRITON_ROPE,
    TritonVarlen("triton_varlen", rotary=False),
    Fa3Varlen("fa3_varlen", short=_TRITON_ROPE),
    SdpaLoop("sdpa_cudnn", "CUDNN_ATTENTION", head_dims=(8, 128), cuda_only=True),
    SdpaLoop("sdpa_flash", "FLASH_ATTENTION", head_dims=(8, 256), cuda_only=True),
    SdpaLoop("sdpa", None, head_dims=(1, 512), cuda_only=False),
)
#: the built-ins by name, read-only
ATTENTION_BACKENDS: Mapping[str, VarlenAttention] = MappingProxyType({b.name: b for b in BUILTIN_VARLEN_BACKENDS})


def get_backend(name: str) -> VarlenAttention:
    """A built-in backend by name (a runner resolves contributed ones through its own table)."""
    try:
        return ATTENTION_BACKENDS[name]
    except KeyError:
        raise ValueError(f"unknown attention backend {name!r}; known: {', '.join(ATTENTION_BACKENDS)}") from None
