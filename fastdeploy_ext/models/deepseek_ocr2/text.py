"""DeepSeek-OCR-2's decoder (DeepSeek3B-MoE-A570M) over a flat token batch: eager ATen layers, the
routed experts through the plan's MoE backend.

Plain multi-head attention (no MLA) with 1D NeoX rope, pre-norm RMSNorm layers; the first
``first_k_dense`` layers have a dense SwiGLU MLP, the others a mixture of experts: a softmax
router in fp32, the top ``num_experts_per_tok`` experts weighted by their probabilities as they
are (no renormalisation, times ``routed_scaling_factor``), plus the shared experts (one SwiGLU of
``n_shared_experts`` x the expert width) on every token. Untied LM head.

Attention is the runner's paged attention (text_runner.PagedAttention: ``attend(layer, q, k,
v)``); positions are [1, T] in prefill (position_rows 1) and [T] in decode.

Where the plan's fused layers apply (Triton on CUDA) the decoder runs the fused passes of
ops/triton/decoder_passes.py, as PaddleOCR-VL's does: add + RMSNorm in one pass, q/k/v from one
GEMM over the packed [q|k|v] weight with q rotated in place and k/v rotated into the paged cache
by one pass, SiLU x up of one packed [gate|up] GEMM (the dense MLP and the shared experts). A
decode step is launch-bound (hundreds of small kernels a step even graphed); that cuts ~25 of
~45 kernels a layer. The packed weights are the checkpoint's parameters re-laid (views), not
copies.

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
from .vision import Projections, RMSNorm, SwiGLU, pack_rows

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
        # logits in fp32 (the loader keeps the gate fp32), as the reference's router
        return self.backend.route(x, self.gate.weight, self.c.num_experts_per_tok, self.c.routed_scaling_factor)

    def routed(self, x: torch.Tensor) -> torch.Tensor:
        """The routed experts' output, in x's dtype."""
        w, idx = self.route(x)
        return self.backend.experts(x, w, idx, self.gate_up, self.down)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.routed(x) + self.shared_experts(x)

    def pack(self) -> None:
        self.shared_experts.pack()

    def forward_fused(self, x: torch.Tensor) -> torch.Tensor:
        """The shared experts' output goes into the routed experts' final sum (the Triton
        backend adds it there in fp32: no separate add launch on the step)."""
        w, idx = self.route(x)
        return self.backend.experts(x, w, idx, self.gate_up, self.down, add=self.shared_experts.forward_fused(x))


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

    def pack(self) -> None:
        """The fused path's packed weights: [q|k|v] and the MLP's [gate|up] (views, no copies)."""
        if getattr(self, "qkv_weight", None) is None:
            a = self.self_attn
            self.qkv_weight = pack_rows(a.q_proj, a.k_proj, a.v_proj)
        self.mlp.pack()

    def forward_fused(self, h, residual, cos, sin, i: int, attend):
        """h = input_layernorm(residual), made by the previous pass; returns (the MLP's output,
        residual), the output's residual add deferred to the next layer's add + norm pass."""
        from ...ops.triton.decoder_passes import add_rms_norm
        n = h.shape[0]
        qkv = F.linear(h, self.qkv_weight)
        attend.write_rotated(i, qkv, cos, sin)
        o = attend.attend_cached(i, qkv[:, :self.nh * self.hd].view(n, self.nh, self.hd))
        norm = self.post_attention_layernorm
        h = add_rms_norm(self.self_attn.o_proj(o.reshape(n, -1)), residual, norm.weight, norm.eps)
        return self.mlp.forward_fused(h), residual


class DeepseekOCR2Decoder(EagerDecoder):
    """The DecoderModel the step runner drives (models/interface.py)."""

    def __init__(self, cfg: TextConfig):
        super().__init__(cfg, (DecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers)),
                         RMSNorm(cfg.hidden_size, cfg.rms_norm_eps), "deepseek_ocr2")
        self._fused = False

    @property
    def fused(self) -> bool:
        return self._fused

    @fused.setter
    def fused(self, on: bool) -> None:
        """Set by the runner where the plan's fused layers run (Triton on CUDA): the layers'
        weights are packed once, then every step takes the fused passes."""
        if on:
            for layer in self.layers:
                layer.pack()
        self._fused = bool(on)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, attend) -> torch.Tensor:
        if not self._fused:
            return super().forward(x, positions, attend)
        from ..eager_decoder import rope_tables, run_fused_layers
        cos, sin = rope_tables(positions, self.cfg.head_dim, self.cfg.rope_theta, x.dtype)
        return run_fused_layers(x, self.layers, cos, sin, attend)

    @property
    def moe_experts(self) -> MoEExpertsBackend:
        return next((m.mlp.backend for m in self.layers if isinstance(m.mlp, MoE)), ATEN_MOE)

    @moe_experts.setter
    def moe_experts(self, backend: MoEExpertsBackend) -> None:
        """Every MoE layer's routed experts through ``backend`` (the plan's moe_experts choice)."""
        for layer in self.layers:
            if isinstance(layer.mlp, MoE):
                layer.mlp.backend = backend
