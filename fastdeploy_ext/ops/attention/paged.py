"""Attention of the text decoder over the paged KV cache, as backends (like the vision ones).

The KV cache of one layer is [num_blocks, block_size, kv_heads, head_dim] for k and for v; a
sequence owns a list of blocks (its block table) and its token at position p lives in slot
block_table[p // block_size] * block_size + p % block_size. A step first writes the new tokens'
k/v at their slots (``slot_mapping``), then attends:

- prefill: each sequence's new tokens attend causally over [its cached tokens + the new ones];
- decode: one new token per sequence attends over its whole context (per-sequence lengths).

Backends (the capability table says which a device row prefers; the plan picks):
- ``sdpa_paged``: torch SDPA over blocks gathered into a dense [ctx, kv_heads, D] view, one call
  per sequence for prefill, one batched masked call for decode. Runs everywhere (CPU, MetaX).
- ``triton_paged``: Triton kernels reading the block table directly: a split-context decode
  (flash-decoding: partitions of the context in parallel, then a reduction) that is CUDA-graph
  safe (fixed grid), and a varlen causal prefill. CUDA only (tests run them in the interpreter).

All step metadata is built on the host from Python ints and uploaded (non-blocking from pinned
memory on CUDA): no device->host sync anywhere in a step.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Callable, Mapping

import torch
import torch.nn.functional as F


@dataclass
class PagedStepMeta:
    """Device tensors + host ints of one step (see engine/step.py for the host contract)."""
    is_prefill: bool
    slot_mapping: torch.Tensor        # int64 [T]: KV slot of every new token
    block_tables: torch.Tensor        # int32 [B, max_blocks] (rows padded with a valid block id)
    context_lens: torch.Tensor        # int32 [B]: tokens in the cache after this step's writes
    query_lens: list[int]             # host: new tokens per sequence
    start_pos: list[int]              # host: cached tokens before this step, per sequence
    block_size: int
    cu_query: torch.Tensor | None = None   # int32 [B+1] (prefill kernels)
    max_query_len: int = 1
    max_context_len: int = 1
    extras: dict = field(default_factory=dict)
    #: a mixed prefill step (decode rows first): (the decode rows' meta, the prefill chunks' meta),
    #: views of this step's tensors; the cache writes use this meta's slot_mapping for all tokens
    mixed: "tuple[PagedStepMeta, PagedStepMeta] | None" = None

    @property
    def num_seqs(self) -> int:
        return len(self.query_lens)


@dataclass
class KVCache:
    """k and v of every layer: [layers, num_blocks, block_size, kv_heads, head_dim]."""
    k: torch.Tensor
    v: torch.Tensor

    @classmethod
    def allocate(cls, num_layers: int, num_blocks: int, block_size: int, kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device) -> "KVCache":
        shape = (num_layers, num_blocks, block_size, kv_heads, head_dim)
        return cls(torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))

    @property
    def num_blocks(self) -> int:
        return self.k.shape[1]

    @property
    def block_size(self) -> int:
        return self.k.shape[2]

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        kc, vc = self.k[layer], self.v[layer]
        kc.view(-1, kc.shape[-2], kc.shape[-1]).index_copy_(0, slot_mapping, k.to(kc.dtype))
        vc.view(-1, vc.shape[-2], vc.shape[-1]).index_copy_(0, slot_mapping, v.to(vc.dtype))


# ------------------------------------------------------------------------------ SDPA
def _gather(cache: torch.Tensor, blocks: torch.Tensor, length: int) -> torch.Tensor:
    """[num_blocks, bs, H, D] at ``blocks`` -> [H, length, D]."""
    return cache.index_select(0, blocks).flatten(0, 1)[:length].transpose(0, 1)


def sdpa_prefill(q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, meta: PagedStepMeta, scale: float) -> torch.Tensor:
    """q [T, Hq, D] (sequences back to back) -> [T, Hq, D]; causal over cached + new tokens."""
    out = torch.empty_like(q)
    bs = meta.block_size
    s = 0
    for i, (n, start) in enumerate(zip(meta.query_lens, meta.start_pos)):
        ctx = start + n
        blocks = meta.block_tables[i, :(ctx + bs - 1) // bs]
        k, v = _gather(kc, blocks, ctx), _gather(vc, blocks, ctx)
        qi = q[s:s + n].transpose(0, 1)
        if start == 0:
            o = F.scaled_dot_product_attention(qi[None], k[None], v[None], is_causal=True, scale=scale,
                                               enable_gqa=True)
        else:   # query row r sits at position start + r: it sees keys 0 .. start + r
            mask = (torch.arange(ctx, device=q.device)[None, :]
                    <= torch.arange(start, ctx, device=q.device)[:, None])
            o = F.scaled_dot_product_attention(qi[None], k[None], v[None], attn_mask=mask, scale=scale,
                                               enable_gqa=True)
        out[s:s + n] = o[0].transpose(0, 1)
        s += n
    return out


def sdpa_decode(q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, meta: PagedStepMeta, scale: float) -> torch.Tensor:
    """q [B, Hq, D], one token per sequence -> [B, Hq, D]; keys masked past each context length."""
    b = q.shape[0]
    nblk = (meta.max_context_len + meta.block_size - 1) // meta.block_size
    bt = meta.block_tables[:, :nblk]
    k = kc.index_select(0, bt.reshape(-1)).view(b, -1, kc.shape[-2], kc.shape[-1]).transpose(1, 2)
    v = vc.index_select(0, bt.reshape(-1)).view(b, -1, vc.shape[-2], vc.shape[-1]).transpose(1, 2)
    mask = torch.arange(k.shape[2], device=q.device)[None, :] < meta.context_lens[:, None]
    o = F.scaled_dot_product_attention(q[:, :, None], k, v, attn_mask=mask[:, None, None, :], scale=scale,
                                       enable_gqa=True)
    return o[:, :, 0]


# ---------------------------------------------------------------------------- backends
PagedFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, PagedStepMeta, float], torch.Tensor]


@dataclass(frozen=True)
class PagedAttentionBackend:
    name: str
    prefill: PagedFn
    decode: PagedFn
    available: Callable[[torch.device], tuple[bool, str]]
    graph_safe_decode: bool      # decode reads only fixed-shape device tensors: capturable


def _always(device: torch.device) -> tuple[bool, str]:
    return True, "torch SDPA runs on every device"


def _triton_available(device: torch.device) -> tuple[bool, str]:
    from ..triton.runtime import available_on
    return available_on(device)


def _triton_prefill(q, kc, vc, meta, scale):
    from ..triton.paged_attention import paged_prefill
    return paged_prefill(q, kc, vc, meta.block_tables, meta.cu_query, meta.context_lens, meta.max_query_len, scale)


def _triton_decode(q, kc, vc, meta, scale):
    from ..triton.paged_attention import paged_decode
    return paged_decode(q, kc, vc, meta.block_tables, meta.context_lens, scale,
                        max_context_len=meta.extras.get("graph_max_context", meta.max_context_len))


#: the framework's own backends; a runner's table (ops/kernels.py) adds those its backend contributes
BUILTIN_PAGED_BACKENDS: tuple[PagedAttentionBackend, ...] = (
    PagedAttentionBackend("triton_paged", _triton_prefill, _triton_decode, _triton_available, graph_safe_decode=True),
    PagedAttentionBackend("sdpa_paged", sdpa_prefill, sdpa_decode, _always, graph_safe_decode=False),
)
#: the built-ins by name, read-only
PAGED_ATTENTION_BACKENDS: Mapping[str, PagedAttentionBackend] = MappingProxyType(
    {b.name: b for b in BUILTIN_PAGED_BACKENDS})


def get_paged_backend(name: str) -> PagedAttentionBackend:
    """A built-in backend by name (a runner resolves contributed ones through its own table)."""
    try:
        return PAGED_ATTENTION_BACKENDS[name]
    except KeyError:
        raise ValueError(f"unknown text attention backend {name!r}; known: {', '.join(PAGED_ATTENTION_BACKENDS)}") from None
