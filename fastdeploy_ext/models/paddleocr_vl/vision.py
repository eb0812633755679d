"""PaddleOCR-VL vision encoder (SigLIP/NaViT) over one packed varlen sequence.

All images of a batch are concatenated into N patches and run through the 27 layers in a single
pass; attention is block-diagonal per image (per frame). The q/k/v projection is one fused
Linear [3*hidden, hidden]. What varies by device is decided by the RunPlan, passed in as a small
`VisionExecution` so that this module never looks at devices itself.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ...fallbacks import fused_passes_usable
from ...ops.activation import linear_gelu
from ...ops.attention.varlen import VarlenAttention
from ...ops.norm import add_layer_norm
from ...ops.rotary import rotary_in_place, rotary_out_of_place, rotary_q_and_k_in_place
from .config import VisionConfig
from .metadata import VisionMetadata
from .projector import Projector


@dataclass(frozen=True)
class VisionExecution:
    """The parts of the plan the encoder needs at run time."""
    attention: VarlenAttention
    strided_qkv: bool          # hand the kernel views of the qkv buffer (no dense copies)
    fused_layers: bool = False  # Triton residual+bias+LayerNorm and q/k rotary passes, GELU in the fc1 GEMM


class EncoderLayer(nn.Module):
    def __init__(self, cfg: VisionConfig):
        super().__init__()
        d = cfg.hidden_size
        self.num_heads, self.head_dim = cfg.num_attention_heads, cfg.head_dim
        self.scale = self.head_dim ** -0.5
        self.gelu_approx = "tanh" if cfg.hidden_act == "gelu_pytorch_tanh" else "none"
        self.layer_norm1 = nn.LayerNorm(d, eps=cfg.layer_norm_eps)
        self.qkv = nn.Linear(d, 3 * d)
        self.out_proj = nn.Linear(d, d)
        self.layer_norm2 = nn.LayerNorm(d, eps=cfg.layer_norm_eps)
        self.fc1 = nn.Linear(d, cfg.intermediate_size)
        self.fc2 = nn.Linear(cfg.intermediate_size, d)

    def qkv_proj(self, x: torch.Tensor) -> torch.Tensor:
        """LayerNorm -> fused qkv projection."""
        ln = self.layer_norm1
        return F.linear(F.layer_norm(x, (x.shape[-1],), ln.weight, ln.bias, ln.eps), self.qkv.weight, self.qkv.bias)

    def attn_out_and_mlp(self, x: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        """out_proj + residual -> LayerNorm -> fc1 + GELU -> fc2 + residual."""
        ln = self.layer_norm2
        x = x + F.linear(attn, self.out_proj.weight, self.out_proj.bias)
        # the unfused plan keeps CUDA's GELU a kernel of its own; a CPU fuses it in oneDNN (bf16)
        h = linear_gelu(F.layer_norm(x, (x.shape[-1],), ln.weight, ln.bias, ln.eps), self.fc1.weight,
                        self.fc1.bias, self.gelu_approx, cuda_epilogue=False)
        return x + F.linear(h, self.fc2.weight, self.fc2.bias)

    def attention(self, qkv: torch.Tensor, meta: VisionMetadata, ex: VisionExecution) -> torch.Tensor:
        n = qkv.shape[0]
        q, k, v = qkv.view(n, 3, self.num_heads, self.head_dim).unbind(1)   # strided views
        backend = ex.attention
        if backend.applies_rotary:
            if not ex.strided_qkv:
                q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
            out = backend(q, k, v, meta, self.scale, cos=meta.cos, sin=meta.sin)
        else:
            q, k, v = self._rotated(q, k, v, meta, ex.strided_qkv, ex.fused_layers and fused_passes_usable(qkv))
            out = backend(q, k, v, meta, self.scale)
        return out.reshape(n, self.num_heads * self.head_dim)

    def _rotated(self, q, k, v, meta: VisionMetadata, strided: bool, triton: bool):
        """q and k with the 2D rotary applied: in place in the qkv buffer (strided) or on dense
        copies. Both layouts use the same arithmetic (the Triton kernel with fused layers, ATen
        otherwise), so their outputs stay bit-identical."""
        if triton:   # strided: q and k are adjacent in each row, both rotated in one launch
            if not strided:
                q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
            rotary_q_and_k_in_place(q, k, meta.cos, meta.sin)
            return q, k, v
        if strided:
            return rotary_in_place(q, meta.cos, meta.sin), rotary_in_place(k, meta.cos, meta.sin), v
        return rotary_out_of_place(q, meta.cos, meta.sin), rotary_out_of_place(k, meta.cos, meta.sin), v.contiguous()

    def forward(self, x: torch.Tensor, meta: VisionMetadata, ex: VisionExecution) -> torch.Tensor:
        return self.attn_out_and_mlp(x, self.attention(self.qkv_proj(x), meta, ex))

    def forward_fused(self, x: torch.Tensor, h: torch.Tensor, next_norm: nn.LayerNorm, meta: VisionMetadata,
                      ex: VisionExecution) -> tuple[torch.Tensor, torch.Tensor]:
        """x: residual stream, h: LayerNorm1(x) (made by the previous fused pass). Updates x in
        place and returns (x, next_norm(x)): the GEMMs run without their bias, which rides along
        in the fused residual+LayerNorm pass; fc1's bias and GELU are the GEMM's epilogue."""
        attn = self.attention(self.qkv(h), meta, ex)
        x, h = add_layer_norm(x, torch.mm(attn, self.out_proj.weight.t()), self.out_proj.bias,
                              self.layer_norm2.weight, self.layer_norm2.bias, self.layer_norm2.eps, out=x)
        m = linear_gelu(h, self.fc1.weight, self.fc1.bias, self.gelu_approx)
        return add_layer_norm(x, torch.mm(m, self.fc2.weight.t()), self.fc2.bias,
                              next_norm.weight, next_norm.bias, next_norm.eps, out=x)


class VisionEncoder(nn.Module):
    """Patch embedding + position embedding + layers + post LayerNorm."""

    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.cfg = cfg
        patch_dim = cfg.num_channels * cfg.patch_size * cfg.patch_size
        # The checkpoint's Conv2d(kernel=stride=patch) is a Linear over flattened patches.
        self.patch_embedding = nn.Linear(patch_dim, cfg.hidden_size)
        self.position_embedding = nn.Parameter(torch.empty(cfg.num_grid_per_side ** 2, cfg.hidden_size))
        self.layers = nn.ModuleList(EncoderLayer(cfg) for _ in range(cfg.num_hidden_layers))
        self.post_layernorm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)

    def forward(self, pixel_values: torch.Tensor, meta: VisionMetadata, ex: VisionExecution) -> torch.Tensor:
        x = self.patch_embedding(pixel_values.reshape(pixel_values.shape[0], -1).to(self.patch_embedding.weight.dtype))
        if ex.fused_layers:
            return self._forward_fused(x, meta, ex)
        x = x + meta.pos_embed
        for layer in self.layers:
            x = layer(x, meta, ex)
        return self.post_layernorm(x)

    def _forward_fused(self, x: torch.Tensor, meta: VisionMetadata, ex: VisionExecution) -> torch.Tensor:
        """Each residual add, the bias before it and the LayerNorm after it are one pass; the
        position embedding add is the first one."""
        first = self.layers[0].layer_norm1
        x, h = add_layer_norm(x, meta.pos_embed, None, first.weight, first.bias, first.eps, out=x)
        norms = [layer.layer_norm1 for layer in self.layers[1:]] + [self.post_layernorm]
        for layer, next_norm in zip(self.layers, norms):
            x, h = layer.forward_fused(x, h, next_norm, meta, ex)
        return h


class PaddleOCRVLVision(nn.Module):
    """Encoder + projector: packed pixel patches -> projector tokens [sum(h*w/4), text_hidden]."""

    def __init__(self, vision: VisionConfig, text_hidden: int, projector_eps: float):
        super().__init__()
        self.encoder = VisionEncoder(vision)
        self.projector = Projector(vision.hidden_size, text_hidden, vision.spatial_merge_size, projector_eps)

    def forward(self, pixel_values, meta: VisionMetadata, ex: VisionExecution) -> torch.Tensor:
        return self.projector(self.encoder(pixel_values, meta, ex), meta)
