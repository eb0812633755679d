"""The plain-ATen decoder a family without fused passes builds on (models/interface.py's
DecoderModel): token embeddings with the image rows spliced in, its layers over 1D rotary
positions (NeoX halves), the final norm and an untied head. DeepSeek-OCR-2's decoder and the
out-of-tree toy family use it; a family with its own kernels (PaddleOCR-VL) writes its own."""
from __future__ import annotations

import logging
from typing import Iterable

import torch
from torch import nn

log = logging.getLogger(__name__)


def rope_tables(positions: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype):
    """cos/sin [T, head_dim] for 1D positions ([1, T] or [T]): fp32 math, NeoX halves."""
    pos = positions.reshape(-1).float()
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=pos.device, dtype=torch.float32) / head_dim))
    f = pos[:, None] * inv
    f = torch.cat((f, f), -1)
    return f.cos().to(dtype), f.sin().to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, heads, head_dim] rotated by the tables of rope_tables (NeoX: the halves swap)."""
    h = x.shape[-1] // 2
    return x * cos[:, None] + torch.cat((-x[..., h:], x[..., :h]), -1) * sin[:, None]


def run_fused_layers(x: torch.Tensor, layers, cos: torch.Tensor, sin: torch.Tensor, attend,
                     final_norm: nn.Module | None = None) -> torch.Tensor:
    """The decoder layers through the fused Triton passes (ops/triton/decoder_passes.py): the
    residual stream is updated in place, each layer's output added to it by the next layer's
    add + RMSNorm pass. Each layer has ``input_layernorm`` (weight, eps) and
    ``forward_fused(h, residual, cos, sin, i, attend) -> (out, residual)`` taking h, its input
    norm, and returning its output before the residual add. ``final_norm`` (an RMSNorm's weight
    and eps): returned normed, the last add in the same pass; else the sum itself."""
    from ..ops.triton.decoder_passes import add_rms_norm
    residual = x.clone()
    out = None
    for i, layer in enumerate(layers):
        norm = layer.input_layernorm
        h = add_rms_norm(out, residual, norm.weight, norm.eps)
        out, residual = layer.forward_fused(h, residual, cos, sin, i, attend)
    if final_norm is not None:
        return add_rms_norm(out, residual, final_norm.weight, final_norm.eps)
    return residual + out


class EagerDecoder(nn.Module):
    """``cfg`` has vocab_size, hidden_size, head_dim and rope_theta; each of ``layers`` is called
    as ``layer(x, cos, sin, i, attend)``; ``norm`` is the family's final norm. ``name`` goes in
    the log line saying that the plan's fused layers do not apply."""

    def __init__(self, cfg, layers: Iterable[nn.Module], norm: nn.Module, name: str):
        super().__init__()
        self.cfg, self.name = cfg, name
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(layers)
        self.norm = norm
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)

    @property
    def fused(self) -> bool:
        return False

    @fused.setter
    def fused(self, on: bool) -> None:
        # the runner asks for fused passes where the plan and device have them; this decoder has
        # none, so its ATen layers run and the log says so (not a silent change of plan)
        if on:
            log.info("%s decoder: the plan's fused layers do not apply (it has no fused passes): ATen layers",
                     self.name)

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
