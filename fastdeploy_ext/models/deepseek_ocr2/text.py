"""DeepSeek-OCR-2's decoder (DeepSeek3B-MoE-A570M) over a flat token batch: eager ATen layers, the
routed experts through the plan's MoE backend.

Plain multi-head attention (no MLA) with 1D NeoX rope, pre-norm RMSNorm layers; the first
``first_k_dense`` layers have a dense SwiGLU MLP, the others a mixture of experts: a softmax
router in fp32, the top ``num_experts_per_tok`` experts weighted by their probabilities as they
are (no renormalisation, times ``routed_scaling_factor``), plus the shared experts (one SwiGLU of
``n_shared_experts`` x the expert width) on every token. Untied LM head.

Attention is the runner's paged attention (text_runner.PagedAttention: ``attend(layer, q, k,
v)``); positions are [1, T] in prefill (position_rows 1) and [T] in decode.

The routed experts are stacked ([E, 2I, H] gate|up, [E, H, I] down) and run by the plan's
``moe_experts`` backend (ops/moe.py: the Triton grouped GEMM on CUDA, eager ATen elsewhere; the
runner sets it on the decoder, ATen until then); every backend is free of host syncs (the step
loop has none).
"""
from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import nn

from ...ops.moe import BUILTIN_MOE_BACKENDS, MoEExpertsBackend
from ..eager_decoder import EagerDecoder, apply_rotary
from .config import TextConfig
from .vision import Projections, RMSNorm, SwiGLU

log = logging.getLogger(__name__)


#: the routed experts' backend of a decoder no runner has configured (portable, every device)
ATEN_MOE = next(b for b in BUILTIN_MOE_BACKENDS if b.name == "aten_moe")


class MoE(nn.Module):
    def __init__(self, c: TextConfig):
        super().__init__()
        self.c = c
        e, h, i = c.n_routed_experts, c.hidden_size, c.moe_intermediate_size
        self.gate = nn.Linear(h, e, bias=False)                       # router, run in fp32
        self.gate_up = nn.Parameter(torch.zeros(e, 2 * i, h))
        self.down = nn.Parameter(torch.zeros(e, h, i))
        self.shared_experts = SwiGLU(h, i * c.n_shared_experts)
        self.backend: MoEExpertsBackend = ATEN_MOE            # the plan's choice, set by the runner

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights [T, k] fp32, expert ids [T, k]) of each token."""
        probs = F.linear(x.float(), self.gate.weight.float()).softmax(-1)     # the loader keeps it fp32
        w, idx = probs.topk(self.c.num_experts_per_tok, -1)
        return w * self.c.routed_scaling_factor, idx

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w, idx = self.route(x)
        routed = self.backend.experts(x, w, idx, self.gate_up, self.down)
        return routed.to(x.dtype) + self.shared_experts(x)


class DecoderLayer(nn.Module):
    def __init__(self, c: TextConfig, layer: int):
        super().__init__()
        d, hd = c.hidden_size, c.head_dim
        self.nh, self.nkv, self.hd = c.num_attention_heads, c.num_key_value_heads, hd
        self.input_layernorm = RMSNorm(d, c.rms_norm_eps)
        self.self_attn = Projections(d, self.nh, self.nkv, hd, qkv_bias=False)
        self.post_attention_layernorm = RMSNorm(d, c.rms_norm_eps)
        self.mlp = MoE(c) if c.is_sparse(layer) else SwiGLU(d, c.intermediate_size)

    def forward(self, x, cos, sin, i: int, attend) -> torch.Tensor:
        n = x.shape[0]
        y, a = self.input_layernorm(x), self.self_attn
        q = apply_rotary(a.q_proj(y).view(n, self.nh, self.hd), cos, sin)
        k = apply_rotary(a.k_proj(y).view(n, self.nkv, self.hd), cos, sin)
        v = a.v_proj(y).view(n, self.nkv, self.hd)
        x = x + a.o_proj(attend(i, q, k, v).reshape(n, -1))
        return x + self.mlp(self.post_attention_layernorm(x))


class DeepseekOCR2Decoder(EagerDecoder):
    """The DecoderModel the step runner drives (models/interface.py)."""

    def __init__(self, cfg: TextConfig):
        super().__init__(cfg, (DecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers)),
                         RMSNorm(cfg.hidden_size, cfg.rms_norm_eps), "deepseek_ocr2")

    @property
    def moe_experts(self) -> MoEExpertsBackend:
        return next((m.mlp.backend for m in self.layers if isinstance(m.mlp, MoE)), ATEN_MOE)

    @moe_experts.setter
    def moe_experts(self, backend: MoEExpertsBackend) -> None:
        """Every MoE layer's routed experts through ``backend`` (the plan's moe_experts choice)."""
        for layer in self.layers:
            if isinstance(layer.mlp, MoE):
                layer.mlp.backend = backend
