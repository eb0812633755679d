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

from fastdeploy_ext.models.eager_decoder import EagerDecoder, apply_rotary

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


class ToyDecoder(EagerDecoder):
    """The DecoderModel the step runner drives (models/interface.py): the framework's plain-ATen
    decoder over this family's layers."""

    def __init__(self, cfg: ToyConfig):
        super().__init__(cfg, (DecoderLayer(cfg) for _ in range(cfg.num_hidden_layers)),
                         RMSNorm(cfg.hidden_size, cfg.rms_norm_eps), "toy_vlm")
