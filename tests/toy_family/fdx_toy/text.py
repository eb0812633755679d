"""toy_vlm's decoder over a flat token batch: embeddings, pre-norm layers with 1D rope (NeoX
halves) and GQA, SiLU MLP, final RMSNorm, an untied LM head.

Attention is the runner's paged attention object (text_runner.PagedAttention): ``attend(layer,
q, k, v)`` writes k/v into the KV cache and attends, which is how prefill, chunked prefill and
decode share one model. Positions are [1, T] in prefill (the family's position_rows is 1) and
[T] in decode.
"""
from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import nn

from .config import ToyConfig

log = logging.getLogger(__name__)


class RMSNorm(nn.Module):
    def __init__(self, hidden: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        return self.weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)


def rope_tables(positions: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype):
    """cos/sin [T, head_dim] for 1D positions ([1, T] or [T]), fp32 math, NeoX halves."""
    pos = positions.reshape(-1).float()
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=pos.device, dtype=torch.float32) / head_dim))
    f = pos[:, None] * inv
    return torch.cat((f.cos(), f.cos()), -1).to(dtype), torch.cat((f.sin(), f.sin()), -1).to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    h = x.shape[-1] // 2
    return x * cos[:, None] + torch.cat((-x[..., h:], x[..., :h]), -1) * sin[:, None]


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ToyConfig):
        super().__init__()
        d, hd = cfg.hidden_size, cfg.head_dim
        self.nh, self.nkv, self.hd = cfg.num_attention_heads, cfg.num_key_value_heads, hd
        self.sizes = [self.nh * hd, self.nkv * hd, self.nkv * hd]
        self.input_norm = RMSNorm(d, cfg.rms_norm_eps)
        self.qkv = nn.Linear(d, sum(self.sizes), bias=False)
        self.o_proj = nn.Linear(self.nh * hd, d, bias=False)
        self.post_norm = RMSNorm(d, cfg.rms_norm_eps)
        self.gate_up = nn.Linear(d, 2 * cfg.intermediate_size, bias=False)
        self.down = nn.Linear(cfg.intermediate_size, d, bias=False)

    def forward(self, x, cos, sin, i: int, attend) -> torch.Tensor:
        n = x.shape[0]
        q, k, v = self.qkv(self.input_norm(x)).split(self.sizes, -1)
        q = apply_rotary(q.view(n, self.nh, self.hd), cos, sin)
        k = apply_rotary(k.view(n, self.nkv, self.hd), cos, sin)
        x = x + self.o_proj(attend(i, q, k, v.view(n, self.nkv, self.hd)).reshape(n, -1))
        gate, up = self.gate_up(self.post_norm(x)).chunk(2, -1)
        return x + self.down(F.silu(gate) * up)


class ToyDecoder(nn.Module):
    """The DecoderModel the step runner drives (models/interface.py)."""

    def __init__(self, cfg: ToyConfig):
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)

    @property
    def fused(self) -> bool:
        return False

    @fused.setter
    def fused(self, on: bool) -> None:
        # the runner asks for fused passes where the plan and device have them; toy_vlm has none,
        # so its ATen layers run and the log says so (not a silent change of plan)
        if on:
            log.info("toy_vlm decoder: the plan's fused layers do not apply (it has no fused passes): ATen layers")

    def embed(self, token_ids, image_embeds=None, image_index=None) -> torch.Tensor:
        x = self.embed_tokens(token_ids)
        if image_embeds is not None and image_index is not None and image_index.numel():
            x = x.index_copy(0, image_index, image_embeds.to(x.dtype))
        return x

    def forward(self, x: torch.Tensor, positions: torch.Tensor, attend) -> torch.Tensor:
        cos, sin = rope_tables(positions, self.cfg.head_dim, self.cfg.rope_theta, x.dtype)
        for i, layer in enumerate(self.layers):
            x = layer(x, cos, sin, i, attend)
        return x

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.norm(hidden)).float()
