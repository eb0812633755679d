"""The ERNIE-4.5-0.3B decoder of PaddleOCR-VL over a flat token batch.

Tokens of all sequences of a step are one [T, hidden] stream; everything but attention is
per-token, so the decoder never needs to know where sequences start. Attention is an object
handed in by the runner (`Attention` below): it writes k/v into the paged KV cache and attends
over it, which is how prefill, chunked prefill and decode share one model.

Two executions of the same weights: ATen ops (every device), and with ``fused`` the Triton
passes of ops/triton/decoder_passes.py (residual add + RMSNorm, rotary + KV-cache write, SiLU *
up) that cut a layer from ~40 kernels to ~10 (decode is launch-bound).

Numerics follow transformers' PaddleOCRTextModel: RMSNorm in fp32 then cast back before the
weight; rotary cos/sin evaluated in fp32 and applied in the compute dtype (NeoX rotate_half);
3D mrope picks, per frequency pair, the position of axis (temporal, height, width) by section.
q/k/v and gate/up are fused Linears (one GEMM each); the loader concatenates the checkpoint's.
"""
from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from .config import TextConfig


class Attention(Protocol):
    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Write the (rotated) k/v of this step's tokens into the cache, attend: [T, Hq, D]."""

    def write_rotated(self, layer: int, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
        """Fused path: rotate q in place in the packed qkv buffer, rotated k and v into the cache."""

    def attend_cached(self, layer: int, q: torch.Tensor) -> torch.Tensor:
        """Attend over the cache (k/v already written): [T, Hq, D]."""


class RMSNorm(nn.Module):
    def __init__(self, hidden: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(dtype)


class MRope(nn.Module):
    """cos/sin [T, head_dim] for 3D (temporal, height, width) positions [3, T].

    Frequency pair f takes its position from axis ``axis_of_pair[f]`` (sections [16, 24, 24] of
    the 64 pairs for the released model); the two halves of head_dim share the pairs (NeoX).
    """

    def __init__(self, head_dim: int, theta: float, sections: tuple[int, ...]):
        super().__init__()
        half = head_dim // 2
        if sum(sections) != half:
            raise ValueError(f"mrope_section {list(sections)} must sum to head_dim/2 = {half}")
        self.register_buffer("inv_freq", 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)),
                             persistent=False)
        axis = torch.cat([torch.full((n,), i % 3, dtype=torch.int64) for i, n in enumerate(sections)])
        self.register_buffer("axis_of_pair", axis, persistent=False)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions: int64 [3, T] (mrope) or [T] (all three axes equal: text, decode)."""
        if positions.ndim == 1:
            pos = positions[:, None].float()                                   # [T, 1]
        else:
            pos = positions.index_select(0, self.axis_of_pair).t().float()     # [T, half]
        freqs = pos * self.inv_freq
        cos, sin = freqs.cos(), freqs.sin()
        return torch.cat((cos, cos), -1).to(dtype), torch.cat((sin, sin), -1).to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, H, D] * cos + rotate_half(x) * sin, cos/sin [T, D] (transformers' order of ops)."""
    h = x.shape[-1] // 2
    rot = torch.cat((-x[..., h:], x[..., :h]), dim=-1)
    return x * cos[:, None, :] + rot * sin[:, None, :]


class DecoderLayer(nn.Module):
    def __init__(self, cfg: TextConfig):
        super().__init__()
        d, hd = cfg.hidden_size, cfg.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, hd
        self.q_size, self.kv_size = self.num_heads * hd, self.num_kv_heads * hd
        self.input_layernorm = RMSNorm(d, cfg.rms_norm_eps)
        self.qkv_proj = nn.Linear(d, self.q_size + 2 * self.kv_size, bias=False)
        self.o_proj = nn.Linear(self.q_size, d, bias=False)
        self.post_attention_layernorm = RMSNorm(d, cfg.rms_norm_eps)
        self.gate_up_proj = nn.Linear(d, 2 * cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, d, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, layer_idx: int,
                attend: Attention) -> torch.Tensor:
        n = x.shape[0]
        q, k, v = self.qkv_proj(self.input_layernorm(x)).split([self.q_size, self.kv_size, self.kv_size], -1)
        q = apply_rotary(q.view(n, self.num_heads, self.head_dim), cos, sin)
        k = apply_rotary(k.view(n, self.num_kv_heads, self.head_dim), cos, sin)
        o = attend(layer_idx, q, k, v.view(n, self.num_kv_heads, self.head_dim))
        x = x + self.o_proj(o.reshape(n, self.q_size))
        gate, up = self.gate_up_proj(self.post_attention_layernorm(x)).chunk(2, -1)
        return x + self.down_proj(F.silu(gate) * up)

    def forward_fused(self, h: torch.Tensor, residual: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                      layer_idx: int, attend: Attention) -> tuple[torch.Tensor, torch.Tensor]:
        """h = input_layernorm(residual) (made by the previous pass); returns (mlp output, residual),
        the residual add of the output deferred to the next layer's add+norm pass."""
        from ...ops.triton.decoder_passes import add_rms_norm, silu_mul
        n = h.shape[0]
        qkv = self.qkv_proj(h)
        attend.write_rotated(layer_idx, qkv, cos, sin)
        o = attend.attend_cached(layer_idx, qkv[:, :self.q_size].view(n, self.num_heads, self.head_dim))
        h = add_rms_norm(self.o_proj(o.reshape(n, self.q_size)), residual, self.post_attention_layernorm.weight,
                         self.post_attention_layernorm.eps)
        return self.down_proj(silu_mul(self.gate_up_proj(h))), residual


class ErnieTextModel(nn.Module):
    """Embeddings + decoder layers + final norm + LM head (tied: the embedding table)."""

    def __init__(self, cfg: TextConfig, tied: bool):
        super().__init__()
        self.cfg, self.tied = cfg, tied
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = None if tied else nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.rope = MRope(cfg.head_dim, cfg.rope_theta, tuple(cfg.mrope_section))
        self.fused = False          # set by the runner where the Triton passes run (plan: fused_layers)

    @property
    def lm_head_weight(self) -> torch.Tensor:
        return self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    def embed(self, token_ids: torch.Tensor, image_embeds: torch.Tensor | None = None,
              image_index: torch.Tensor | None = None) -> torch.Tensor:
        """Token embeddings with image features scattered at ``image_index`` (rows of the flat
        batch, built on the host from token ids: no device->host sync)."""
        x = self.embed_tokens(token_ids)
        if image_embeds is not None and image_index is not None and image_index.numel():
            x = x.index_copy(0, image_index, image_embeds.to(x.dtype))
        return x

    def forward(self, x: torch.Tensor, positions: torch.Tensor, attend: Attention) -> torch.Tensor:
        """x: input embeddings [T, hidden]; positions: [3, T] or [T]. Returns the final hidden
        states before the last norm (the runner norms only the rows it needs logits for)."""
        cos, sin = self.rope(positions, x.dtype)
        if self.fused:
            return self._forward_fused(x, cos, sin, attend)
        for i, layer in enumerate(self.layers):
            x = layer(x, cos, sin, i, attend)
        return x

    def _forward_fused(self, x, cos, sin, attend: Attention) -> torch.Tensor:
        from ..eager_decoder import run_fused_layers
        return run_fused_layers(x, self.layers, cos, sin, attend)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """float32 [rows, vocab] from un-normed hidden rows."""
        return F.linear(self.norm(hidden), self.lm_head_weight).float()
