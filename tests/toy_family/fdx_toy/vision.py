"""toy_vlm's vision path: a fixed-size patch encoder over one packed varlen batch.

All images of a batch are concatenated (16 patches each) and run through the encoder layers in
one pass; attention is block-diagonal per image through the plan's varlen attention backend
(ops/attention/varlen.py), exactly as the runner hands it. Position embeddings are learned, one
per patch of the fixed grid, so there is no rotary: a backend that applies a rotary itself gets
the identity tables (cos 1, sin 0). The projector merges each 2x2 block of patches (a fixed
permutation, the same for every image) and maps it to the decoder's hidden size.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from fastdeploy_ext.ops.attention.varlen import VarlenAttention
from fastdeploy_ext.transfer import upload

from .config import ToyConfig


@dataclass(frozen=True)
class ToyExecution:
    """What the encoder takes from the plan: the attention backend and the qkv layout (the toy
    has no fused passes, so the plan's fused_layers has nothing to switch here)."""
    attention: VarlenAttention
    strided_qkv: bool


@dataclass
class ToyMetadata:
    num_tokens: int
    seq_lens: list[int]                  # one segment of patches_per_image per image
    cu_seqlens: torch.Tensor             # int32 [images + 1] on the device
    max_seqlen: int
    cos: torch.Tensor                    # fp32 [N, head_dim] ones: identity rotary for backends that rotate
    sin: torch.Tensor                    # fp32 [N, head_dim] zeros
    out_split_sizes: list[int]
    grids: list[tuple[int, int, int]]
    source: str                          # "host" | "device" | "graph"
    attention_state: Any = None


def merge_order(side: int, merge: int) -> torch.Tensor:
    """Raster patch index of each row of the 2x2-merged order (block row, block col, i, j)."""
    return torch.arange(side * side).view(side // merge, merge, side // merge, merge).transpose(1, 2).flatten()


class ToyMetadataBuilder:
    """Per-batch metadata. Every image has the same grid, so the host path needs only the
    number of images; the device path derives the same values from a grid tensor with tensor
    ops (reading sizes back: the reference behaviour)."""

    def __init__(self, cfg: ToyConfig, *, device: torch.device, attention: VarlenAttention | None):
        self.cfg, self.device, self.attention = cfg, device, attention

    def _meta(self, n_images: int, cu: torch.Tensor, source: str) -> ToyMetadata:
        p, d = self.cfg.patches_per_image, self.cfg.vision_head_dim
        n = n_images * p
        meta = ToyMetadata(n, [p] * n_images, cu, p, torch.ones(n, d, device=self.device),
                           torch.zeros(n, d, device=self.device), [self.cfg.embeddings_per_image] * n_images,
                           [self.cfg.grid] * n_images, source)
        if self.attention is not None:
            meta.attention_state = self.attention.prepare(meta.seq_lens, lambda t: upload(t, self.device))
        return meta

    def build_host(self, grids) -> ToyMetadata:
        cu = torch.arange(len(grids) + 1, dtype=torch.int32) * self.cfg.patches_per_image
        return self._meta(len(grids), upload(cu, self.device), "host")

    def build_device(self, grid_thw: torch.Tensor) -> ToyMetadata:
        g = grid_thw.to(self.device, torch.int64)
        cu = F.pad(g.prod(-1).cumsum(0), (1, 0)).to(torch.int32)
        return self._meta(int(g.shape[0]), cu, "device")


class EncoderLayer(nn.Module):
    def __init__(self, cfg: ToyConfig):
        super().__init__()
        d = cfg.vision_hidden_size
        self.num_heads, self.head_dim = cfg.vision_num_heads, cfg.vision_head_dim
        self.norm1 = nn.LayerNorm(d, eps=cfg.layer_norm_eps)
        self.qkv = nn.Linear(d, 3 * d)
        self.out_proj = nn.Linear(d, d)
        self.norm2 = nn.LayerNorm(d, eps=cfg.layer_norm_eps)
        self.fc1 = nn.Linear(d, cfg.vision_intermediate_size)
        self.fc2 = nn.Linear(cfg.vision_intermediate_size, d)

    def forward(self, x: torch.Tensor, meta: ToyMetadata, ex: ToyExecution) -> torch.Tensor:
        n = x.shape[0]
        q, k, v = self.qkv(self.norm1(x)).view(n, 3, self.num_heads, self.head_dim).unbind(1)
        if not ex.strided_qkv:
            q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        kw = dict(cos=meta.cos, sin=meta.sin) if ex.attention.applies_rotary else {}
        o = ex.attention(q, k, v, meta, self.head_dim ** -0.5, **kw)
        x = x + self.out_proj(o.reshape(n, -1))
        return x + self.fc2(F.gelu(self.fc1(self.norm2(x))))


class ToyVision(nn.Module):
    """Packed patches [N, C*P*P] -> image embeddings [N / merge^2, text hidden]."""

    def __init__(self, cfg: ToyConfig):
        super().__init__()
        self.cfg = cfg
        d, m2 = cfg.vision_hidden_size, cfg.merge ** 2
        self.patch_embed = nn.Linear(cfg.patch_dim, d)
        self.pos_embed = nn.Parameter(torch.zeros(cfg.patches_per_image, d))
        self.layers = nn.ModuleList(EncoderLayer(cfg) for _ in range(cfg.vision_num_layers))
        self.post_norm = nn.LayerNorm(d, eps=cfg.layer_norm_eps)
        self.proj1 = nn.Linear(d * m2, d * m2)
        self.proj2 = nn.Linear(d * m2, cfg.hidden_size)
        self.register_buffer("order", merge_order(cfg.grid_side, cfg.merge), persistent=False)

    def forward(self, pixel_values: torch.Tensor, meta: ToyMetadata, ex: ToyExecution) -> torch.Tensor:
        n, p = pixel_values.shape[0], self.cfg.patches_per_image
        x = self.patch_embed(pixel_values.reshape(n, -1).to(self.patch_embed.weight.dtype))
        x = (x.view(-1, p, x.shape[-1]) + self.pos_embed).view(n, -1)
        for layer in self.layers:
            x = layer(x, meta, ex)
        x = self.post_norm(x).view(-1, p, x.shape[-1])[:, self.order]          # [images, p, d] merged order
        x = x.reshape(-1, x.shape[-1] * self.cfg.merge ** 2)
        return self.proj2(F.gelu(self.proj1(x)))


class ToyBudgetBuffers:
    """Static inputs of an encoder graph captured at ``tokens`` patches (whole images only:
    a budget of N patches holds N / patches_per_image images and yields N / merge^2 rows)."""

    def __init__(self, cfg: ToyConfig, tokens: int, attention_state, *, device, dtype):
        self.m2 = cfg.merge ** 2
        self.pixels = torch.zeros(tokens, cfg.patch_dim, device=device, dtype=dtype)
        self.attention_state = attention_state
        n_img = tokens // cfg.patches_per_image
        self.meta = ToyMetadata(tokens, [cfg.patches_per_image] * n_img,
                                torch.arange(n_img + 1, device=device, dtype=torch.int32) * cfg.patches_per_image,
                                cfg.patches_per_image, torch.ones(tokens, cfg.vision_head_dim, device=device),
                                torch.zeros(tokens, cfg.vision_head_dim, device=device),
                                [self.outputs(tokens)], [], "graph", attention_state.state)

    def outputs(self, num_tokens: int) -> int:
        return num_tokens // self.m2

    def load(self, pixels: torch.Tensor, meta: ToyMetadata) -> None:
        self.pixels[:meta.num_tokens].copy_(pixels)
        self.attention_state.load(meta.attention_state)
