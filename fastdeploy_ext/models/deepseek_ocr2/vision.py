"""DeepSeek-OCR-2's vision tower: SAM ViT-B -> Qwen2 encoder with learned queries -> projector.

A packed batch holds each image's 16x16 patches (processor.py): its crops, then its global
view. The host metadata splits it into the batch's global views ([G, 64, 64] patches) and crops
([C, 48, 48]); each group runs through the tower as one batch (two shapes, two passes), and
the rows are put back per image in the token order: crops, global view, the view separator.

SAM (per view of S/16 patches a side):
- patch embedding (a stride-16 conv: one matmul over the packed patches) + absolute positions,
  trained at 64x64 and resized for a 48x48 crop (bicubic with antialias, in fp32);
- layers of pre-norm attention with a decomposed relative-position bias (q . R_h + q . R_w added
  to the logits); windowed layers cut the grid into 14x14 windows after padding it with zeros
  (the padding is not masked: its keys/values are the qkv bias, as in the trained model); the
  global layers attend over the whole grid, their bias tables resized linearly (127 -> 95 rows
  for 48x48);
- a neck (1x1 conv, LayerNorm over channels, 3x3 conv, LayerNorm) and two stride-2 3x3 convs
  to the encoder's width: 16x16 (global) / 12x12 (crop) tokens.

Qwen2 encoder: over [visual tokens, learned queries (256 global / 144 crop)] with 1D rope on
the index; visual tokens attend to each other bidirectionally, the queries causally (to all
visual tokens and the queries before them). The query outputs, after the final norm, go through
the projector Linear to the decoder's width.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ...device_api import device_api_for
from ...ops.activation import linear_gelu
from ...ops.attention.biased import (SDPA_BIAS, SDPA_MASK, PrefixCausalAttention, RelPosAttention,
                                     rel_pos_projections)
from .config import DeepseekOCR2Config, EncoderConfig, SamConfig
from .processor import num_crops, to_model_pixels


# ------------------------------------------------------------------ execution and metadata
@dataclass(frozen=True)
class VisionExecution:
    """What the tower takes from the plan: SAM's qkv layout (``strided_qkv``: views of the fused
    projection, else copied contiguous) and the backend objects the plan chose for its attention
    kinds (ops/attention/biased.py): SAM's windowed and global layers (``window_attention``,
    ``global_attention``: the rel-pos kinds) and the Qwen2 encoder's (``prefix_attention``).
    ATen's SDPA by default (a tower run outside a runner)."""
    attention: Any = None
    strided_qkv: bool = False
    fused_layers: bool = False
    window_attention: RelPosAttention = SDPA_BIAS
    global_attention: RelPosAttention = SDPA_BIAS
    prefix_attention: PrefixCausalAttention = SDPA_MASK


#: the execution of a tower called without one: strided qkv, ATen attention
DEFAULT_EXECUTION = VisionExecution(strided_qkv=True)


@dataclass
class VisionMetadata:
    num_tokens: int                          # input patches of the batch
    crops: list[int]                         # per image
    view_sizes: list[int]                    # patches of each view, in packed order
    view_is_global: list[bool]
    out_split_sizes: list[int]               # embedding rows per image
    grids: list[tuple[int, int, int]]
    source: str                              # "host" | "device"
    attention_state: Any = None
    extra: dict = field(default_factory=dict)


class VisionMetadataBuilder:
    """Per-batch metadata from the host grids (views = 1 + crops). The device path reads the grid
    tensor back once (the reference behaviour, as the other families' device paths)."""

    def __init__(self, cfg: DeepseekOCR2Config, *, device: torch.device):
        self.cfg, self.device = cfg, device

    def build_host(self, grids, source: str = "host") -> VisionMetadata:
        c = self.cfg
        grids = [tuple(int(x) for x in g) for g in grids]
        crops = [num_crops(g) for g in grids]
        sizes, is_global = [], []
        for n in crops:
            sizes += [c.patches(c.tile_size)] * n + [c.patches(c.base_size)]
            is_global += [False] * n + [True]
        return VisionMetadata(sum(sizes), crops, sizes, is_global, [c.image_rows(n) for n in crops], grids, source)

    def build_device(self, grid_thw: torch.Tensor) -> VisionMetadata:
        return self.build_host([tuple(g) for g in grid_thw.tolist()], "device")


# ------------------------------------------------------------------ SAM
class SamAttention(nn.Module):
    def __init__(self, c: SamConfig, window: int):
        super().__init__()
        self.nh, self.hd = c.num_attention_heads, c.head_dim
        self.qkv = nn.Linear(c.hidden_size, 3 * c.hidden_size)
        self.proj = nn.Linear(c.hidden_size, c.hidden_size)
        side = window or c.grid
        self.windowed = bool(window)
        self.rel_pos_h = nn.Parameter(torch.zeros(2 * side - 1, self.hd))
        self.rel_pos_w = nn.Parameter(torch.zeros(2 * side - 1, self.hd))

    def attend(self, x: torch.Tensor, ex: VisionExecution = DEFAULT_EXECUTION, fused: bool = False) -> torch.Tensor:
        """[b, h, w, d] (normed) -> [b, h*w, d]: the attention before its output projection.
        ``fused``: the rel-pos projections by our kernel (q read in place), else einsum."""
        b, h, w, d = x.shape
        q, k, v = self.qkv(x).view(b, h * w, 3, self.nh, self.hd).permute(2, 0, 3, 1, 4).unbind(0)
        if not ex.strided_qkv:       # the plan's dense qkv layout: the kernel gets contiguous q/k/v
            q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        # decomposed relative positions: bias[i, j] = q_i . Rh[row_i - row_j] + q_i . Rw[col_i - col_j];
        # the per-query projections are small ([.., N, h] and [.., N, w]): the backend applies them
        # (materialized for ATen's SDPA, per tile in our kernel)
        rh, rw = rel_pos_projections(q, self.rel_pos_h, self.rel_pos_w, h, w, kernel=fused)
        attend = ex.window_attention if self.windowed else ex.global_attention
        return attend(q, k, v, rh, rw).transpose(1, 2).reshape(b, h * w, d)

    def forward(self, x: torch.Tensor, ex: VisionExecution = DEFAULT_EXECUTION) -> torch.Tensor:
        b, h, w, d = x.shape
        return self.proj(self.attend(x, ex)).view(b, h, w, d)


class SamMLP(nn.Module):
    def __init__(self, c: SamConfig):
        super().__init__()
        self.lin1 = nn.Linear(c.hidden_size, c.mlp_dim)
        self.lin2 = nn.Linear(c.mlp_dim, c.hidden_size)

    def forward(self, x):
        return self.lin2(F.gelu(self.lin1(x)))


class SamBlock(nn.Module):
    def __init__(self, c: SamConfig, window: int):
        super().__init__()
        self.window = window                 # 0: global attention
        self.norm1 = nn.LayerNorm(c.hidden_size, eps=c.layer_norm_eps)
        self.attn = SamAttention(c, window)
        self.norm2 = nn.LayerNorm(c.hidden_size, eps=c.layer_norm_eps)
        self.mlp = SamMLP(c)

    def forward(self, x: torch.Tensor, ex: VisionExecution = DEFAULT_EXECUTION) -> torch.Tensor:
        b, h, w, d = x.shape
        y = self.norm1(x)
        if self.window:
            s = self.window
            ph, pw = -h % s, -w % s
            # zero padding after the norm, not masked in the attention (as the model was trained)
            y = F.pad(y, (0, 0, 0, pw, 0, ph))
            hp, wp = h + ph, w + pw
            y = y.view(b, hp // s, s, wp // s, s, d).transpose(2, 3).reshape(-1, s, s, d)
            y = self.attn(y, ex)
            y = y.view(b, hp // s, wp // s, s, s, d).transpose(2, 3).reshape(b, hp, wp, d)[:, :h, :w]
        else:
            y = self.attn(y, ex)
        x = x + y
        return x + self.mlp(self.norm2(x))


class ChannelLayerNorm(nn.LayerNorm):
    """LayerNorm over the channels of [B, C, H, W]."""

    def forward(self, x):
        return super().forward(x.permute(0, 2, 3, 1)).permute(0, 3, 1, 2)


class PatchEmbed(nn.Module):
    def __init__(self, c: SamConfig):
        super().__init__()
        self.proj = nn.Conv2d(c.num_channels, c.hidden_size, c.patch_size, c.patch_size)

    def forward(self, patches: torch.Tensor) -> torch.Tensor:
        """[N, C*P*P] patches -> [N, hidden] (the stride-P conv on a patch is this matmul)."""
        return F.linear(patches, self.proj.weight.reshape(self.proj.out_channels, -1), self.proj.bias)


class Sam(nn.Module):
    def __init__(self, c: SamConfig):
        super().__init__()
        self.c = c
        self.patch_embed = PatchEmbed(c)
        self.pos_embed = nn.Parameter(torch.zeros(1, c.grid, c.grid, c.hidden_size))
        self.blocks = nn.ModuleList(SamBlock(c, 0 if i in c.global_attn_indexes else c.window_size)
                                    for i in range(c.num_hidden_layers))
        oc, (d1, d2) = c.output_channels, c.downsample_channels
        self.neck = nn.Sequential(nn.Conv2d(c.hidden_size, oc, 1, bias=False), ChannelLayerNorm(oc, eps=1e-6),
                                  nn.Conv2d(oc, oc, 3, padding=1, bias=False), ChannelLayerNorm(oc, eps=1e-6))
        self.net_2 = nn.Conv2d(oc, d1, 3, stride=2, padding=1, bias=False)
        self.net_3 = nn.Conv2d(d1, d2, 3, stride=2, padding=1, bias=False)
        self._window_maps: dict = {}

    def positions(self, side: int) -> torch.Tensor:
        if side == self.pos_embed.shape[1]:
            return self.pos_embed
        p = F.interpolate(self.pos_embed.permute(0, 3, 1, 2).float(), size=(side, side), mode="bicubic",
                          align_corners=False, antialias=True)
        return p.to(self.pos_embed.dtype).permute(0, 2, 3, 1)

    def forward(self, patches: torch.Tensor, views: int, ex: VisionExecution = DEFAULT_EXECUTION) -> torch.Tensor:
        """[views * side^2, C*P*P] -> [views, (side/4)^2, encoder width]; ``ex``: the plan's
        attention backends and qkv layout (strided: q/k/v reach the attention as views of the
        fused projection, else copied contiguous)."""
        side = int(round((patches.shape[0] // views) ** 0.5))
        x = self.patch_embed(patches).view(views, side, side, -1) + self.positions(side)
        if ex.fused_layers and passes_usable(x.device):
            x = self.blocks_fused(x.view(-1, x.shape[-1]), views, side, ex).view(views, side, side, -1)
        else:
            for blk in self.blocks:
                x = blk(x, ex)
        x = self.net_3(self.net_2(self.neck(x.permute(0, 3, 1, 2))))
        return x.flatten(2).transpose(1, 2)

    def blocks_fused(self, x: torch.Tensor, views: int, side: int, ex: VisionExecution) -> torch.Tensor:
        """The blocks over the residual stream x [views * side^2, d] (grid order, updated in
        place) with the memory-bound steps in Triton passes: each residual add + bias + the next
        LayerNorm is one pass (ops/norm.py), and a windowed block's padding and partition ride in
        its first norm's pass (the output rows gathered in window order, the padding zero) and its
        un-partition in the second's (the attention's window rows added back onto the grid): no
        copy of the activations for the windows, no strided add. The rel-pos projections read q
        in place (our kernel). The MLP's erf GELU rides in its fc1 GEMM's epilogue
        (ops/activation.linear_gelu: our Triton GEMM on CUDA, ATen's two ops elsewhere). Each other
        GEMM's bias is added in the next pass, except the last."""
        from ...ops.norm import add_layer_norm
        d = x.shape[1]
        delta = bias = h = None
        for blk in self.blocks:
            maps = self.window_maps(views, side, blk.window, x.device) if blk.window else None
            n1, n2 = blk.norm1, blk.norm2
            x, y = add_layer_norm(x, delta, bias, n1.weight, n1.bias, n1.eps, out=x,
                                  rows_of_y=maps.rows if maps else None)
            b, s = (maps.windows, blk.window) if maps else (views, side)
            a = torch.mm(blk.attn.attend(y.view(b, s, s, d), ex, fused=True).view(-1, d), blk.attn.proj.weight.t())
            x, y = add_layer_norm(x, a, blk.attn.proj.bias, n2.weight, n2.bias, n2.eps, out=x,
                                  delta_rows=maps.delta_rows if maps else None)
            h = linear_gelu(y, blk.mlp.lin1.weight, blk.mlp.lin1.bias, "none")
            delta, bias = torch.mm(h, blk.mlp.lin2.weight.t()), blk.mlp.lin2.bias
        return x + self.blocks[-1].mlp.lin2(h)

    def window_maps(self, views: int, side: int, window: int, device: torch.device) -> "WindowMaps":
        """The row maps of ``views`` side x side grids cut into window x window windows (cached
        per shape; made on the device, no host sync; not cached while a graph is being captured,
        whose kernels only run at replay)."""
        key = (views, side, window, str(device))
        maps = self._window_maps.get(key)
        if maps is None:
            maps = WindowMaps.build(views, side, window, device)
            if not device_api_for(device).is_capturing():
                self._window_maps[key] = maps
        return maps


@dataclass(frozen=True)
class WindowMaps:
    """SAM's window partition as row maps between the grid order of the residual stream
    ([views, side, side] rows) and the window order of the attention ([windows, s, s] rows,
    each grid padded with zeros to a multiple of s a side)."""
    windows: int
    rows: torch.Tensor              # int32 [windows * s * s]: the grid row of each window row, -1 padding
    delta_rows: torch.Tensor        # int32 [views * side * side]: the window row of each grid row

    @classmethod
    def build(cls, views: int, side: int, s: int, device) -> "WindowMaps":
        n = -(-side // s)                                   # windows a side
        v = torch.arange(views, device=device)[:, None, None]
        g = torch.arange(side, device=device)
        gi, gj = g[None, :, None], g[None, None, :]
        win_row = ((v * n + gi // s) * n + gj // s) * (s * s) + (gi % s) * s + gj % s
        delta_rows = win_row.reshape(-1)
        rows = torch.full((views * n * n * s * s,), -1, dtype=torch.int32, device=device)
        rows[delta_rows] = torch.arange(delta_rows.numel(), dtype=torch.int32, device=device)
        return cls(views * n * n, rows, delta_rows.to(torch.int32))


# ------------------------------------------------------------------ Qwen2 encoder
class RMSNorm(nn.Module):
    def __init__(self, hidden: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        return self.weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)


def rope_tables(n: int, head_dim: int, theta: float, device, dtype):
    """cos/sin [n, head_dim] over positions 0..n-1 (fp32 math, NeoX halves)."""
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim))
    f = torch.arange(n, device=device, dtype=torch.float32)[:, None] * inv
    f = torch.cat((f, f), -1)
    return f.cos().to(dtype), f.sin().to(dtype)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    h = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., h:], x[..., :h]), -1) * sin


class SwiGLU(nn.Module):
    def __init__(self, hidden: int, inter: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, inter, bias=False)
        self.up_proj = nn.Linear(hidden, inter, bias=False)
        self.down_proj = nn.Linear(inter, hidden, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))

    def pack(self) -> None:
        """gate and up as the two halves of one [2I, H] weight (the parameters become views of
        it, no second copy), for the fused path's one GEMM + silu_mul."""
        if getattr(self, "gate_up_weight", None) is None:
            self.gate_up_weight = pack_rows(self.gate_proj, self.up_proj)

    def forward_fused(self, x):
        from ...ops.triton.decoder_passes import silu_mul
        return self.down_proj(silu_mul(F.linear(x, self.gate_up_weight)))


def pack_rows(*linears: nn.Linear) -> torch.Tensor:
    """The weights of ``linears`` (same input width, no bias) stacked into one tensor, each
    Linear's weight then a view of its rows: one GEMM computes all their outputs side by side."""
    if any(lin.bias is not None for lin in linears):
        raise ValueError("pack_rows: a Linear with a bias cannot be packed (pack_linears packs both)")
    return _stack_into(linears, "weight")


def pack_linears(*linears: nn.Linear) -> tuple[torch.Tensor, torch.Tensor | None]:
    """pack_rows for Linears that may have biases (all or none): (weight, bias or None), each
    Linear's parameters then views of the packed ones."""
    with_bias = [lin.bias is not None for lin in linears]
    if any(with_bias) and not all(with_bias):
        raise ValueError("pack_linears: either every Linear has a bias or none has")
    return _stack_into(linears, "weight"), (_stack_into(linears, "bias") if all(with_bias) else None)


def _stack_into(linears, name: str) -> torch.Tensor:
    packed = torch.cat([getattr(lin, name).detach() for lin in linears])
    start = 0
    for lin in linears:
        n = getattr(lin, name).shape[0]
        setattr(lin, name, nn.Parameter(packed[start:start + n], requires_grad=False))
        start += n
    return packed


class Projections(nn.Module):
    """q/k/v/o projections of one attention (the checkpoints' ``self_attn.*``)."""

    def __init__(self, hidden: int, heads: int, kv_heads: int, head_dim: int, qkv_bias: bool):
        super().__init__()
        self.q_proj = nn.Linear(hidden, heads * head_dim, bias=qkv_bias)
        self.k_proj = nn.Linear(hidden, kv_heads * head_dim, bias=qkv_bias)
        self.v_proj = nn.Linear(hidden, kv_heads * head_dim, bias=qkv_bias)
        self.o_proj = nn.Linear(heads * head_dim, hidden, bias=False)


class EncoderLayer(nn.Module):
    def __init__(self, c: EncoderConfig):
        super().__init__()
        self.nh, self.nkv, self.hd = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.self_attn = Projections(c.hidden_size, self.nh, self.nkv, self.hd, qkv_bias=True)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.mlp = SwiGLU(c.hidden_size, c.intermediate_size)

    def forward(self, x, cos, sin, attend: PrefixCausalAttention, state):
        """``attend``: the plan's prefix-causal backend, ``state`` what its prepare() made for
        this sequence (grouped k/v heads go in unrepeated: the backend expands them if it must)."""
        b, n, _ = x.shape
        y, a = self.input_layernorm(x), self.self_attn
        q = rotate(a.q_proj(y).view(b, n, self.nh, self.hd).transpose(1, 2), cos, sin)
        k = rotate(a.k_proj(y).view(b, n, self.nkv, self.hd).transpose(1, 2), cos, sin)
        v = a.v_proj(y).view(b, n, self.nkv, self.hd).transpose(1, 2)
        o = attend(q, k, v, state)
        x = x + a.o_proj(o.transpose(1, 2).reshape(b, n, -1))
        return x + self.mlp(self.post_attention_layernorm(x))

    def pack(self) -> None:
        """The fused path's packed weights: [q|k|v] with its bias and the MLP's [gate|up] (views)."""
        if getattr(self, "qkv_weight", None) is None:
            a = self.self_attn
            self.qkv_weight, self.qkv_bias = pack_linears(a.q_proj, a.k_proj, a.v_proj)
        self.mlp.pack()

    def forward_fused(self, h, residual, cos, sin, i: int, attend: "FlatPrefixAttention"):
        """h = input_layernorm(residual) [B*N, d], made by the previous pass; returns (the MLP's
        output, residual), its residual add deferred to the next add + norm pass
        (eager_decoder.run_fused_layers drives it). q/k rotated in place in the packed qkv (one
        pass, fp32 tables [B*N, D]); the attention reads q/k/v as strided views of it."""
        from ...ops.rotary import rotary_qk_in_place
        from ...ops.triton.decoder_passes import add_rms_norm
        t, b = h.shape[0], attend.batch
        n, nh, nkv, hd = t // b, self.nh, self.nkv, self.hd
        qkv = F.linear(h, self.qkv_weight, self.qkv_bias)
        rotary_qk_in_place(qkv[:, :(nh + nkv) * hd].view(t, nh + nkv, hd), cos, sin)
        q = qkv[:, :nh * hd].view(b, n, nh, hd).transpose(1, 2)
        k = qkv[:, nh * hd:(nh + nkv) * hd].view(b, n, nkv, hd).transpose(1, 2)
        v = qkv[:, (nh + nkv) * hd:].view(b, n, nkv, hd).transpose(1, 2)
        o = attend.backend(q, k, v, attend.state).transpose(1, 2).reshape(t, nh * hd)
        norm = self.post_attention_layernorm
        h = add_rms_norm(self.self_attn.o_proj(o), residual, norm.weight, norm.eps)
        return self.mlp.forward_fused(h), residual


class QueryEncoder(nn.Module):
    def __init__(self, c: EncoderConfig):
        super().__init__()
        self.c = c
        self.layers = nn.ModuleList(EncoderLayer(c) for _ in range(c.num_hidden_layers))
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)

    def forward(self, visual: torch.Tensor, queries: torch.Tensor,
                ex: VisionExecution = DEFAULT_EXECUTION) -> torch.Tensor:
        """[B, V, d] visual tokens + [Q, d] queries -> [B, Q, d] query outputs; the visual
        tokens are the bidirectional prefix of ``ex.prefix_attention``."""
        b, nv, _ = visual.shape
        x = torch.cat([visual, queries.to(visual.dtype).expand(b, -1, -1)], 1)
        n = x.shape[1]
        attend = ex.prefix_attention
        state = attend.prepare(nv, n, x.device)
        if ex.fused_layers and passes_usable(x.device):
            return self.forward_fused(x, attend, state)[:, nv:]
        cos, sin = rope_tables(n, self.c.head_dim, self.c.rope_theta, x.device, x.dtype)
        for layer in self.layers:
            x = layer(x, cos, sin, attend, state)
        return self.norm(x)[:, nv:]

    def forward_fused(self, x: torch.Tensor, attend: PrefixCausalAttention, state) -> torch.Tensor:
        """The layers through the Triton passes the decoder uses (ops/triton/decoder_passes.py):
        add + RMSNorm in one pass (the residual stream updated in place), q/k/v from one GEMM
        with q/k rotated in place, SiLU x up of one [gate|up] GEMM. [B, N, d] -> [B, N, d]."""
        from ..eager_decoder import run_fused_layers
        b, n, d = x.shape
        for layer in self.layers:
            layer.pack()
        cos, sin = rope_tables(n, self.c.head_dim, self.c.rope_theta, x.device, torch.float32)
        cos, sin = cos.repeat(b, 1), sin.repeat(b, 1)          # a row per token of the flat batch
        return run_fused_layers(x.reshape(b * n, d), self.layers, cos, sin, FlatPrefixAttention(attend, state, b),
                                final_norm=self.norm).view(b, n, d)


@dataclass(frozen=True)
class FlatPrefixAttention:
    """The fused encoder layers' ``attend``: the plan's prefix-causal backend, what its
    prepare() made, and the number of equal sequences in the flat [B*N, d] batch."""
    backend: PrefixCausalAttention
    state: Any
    batch: int


def passes_usable(device: torch.device) -> bool:
    """The fused layers' Triton passes run on this device (else the ATen layers)."""
    from ...ops.triton.decoder_passes import usable
    return usable(device)


# ------------------------------------------------------------------ the tower
class DeepseekOCR2Vision(nn.Module):
    """Packed patches [N, C*P*P] (+ metadata) -> embedding rows [sum(out_split_sizes), text width]."""

    def __init__(self, cfg: DeepseekOCR2Config):
        super().__init__()
        self.cfg = cfg
        d = cfg.encoder.hidden_size
        self.sam = Sam(cfg.sam)
        self.encoder = QueryEncoder(cfg.encoder)
        self.query_1024 = nn.Embedding(cfg.global_queries, d)
        self.query_768 = nn.Embedding(cfg.crop_queries, d)
        self.projector = nn.Linear(d, cfg.text.hidden_size)
        self.view_separator = nn.Parameter(torch.zeros(cfg.text.hidden_size))

    def encode_views(self, patches: torch.Tensor, views: int, is_global: bool,
                     ex: VisionExecution = DEFAULT_EXECUTION) -> torch.Tensor:
        """One group of same-size views -> [views, queries, text width], with the plan's
        attention backends and qkv layout (``ex``)."""
        q = self.query_1024.weight if is_global else self.query_768.weight
        return self.projector(self.encoder(self.sam(patches, views, ex), q, ex))

    def split_views(self, pixel_values: torch.Tensor, meta: VisionMetadata
                    ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """The packed batch's global views and crops, each a [patches, C*P*P] view of it in the
        model dtype (the processor's bytes normalized here, on the device), in image order: the
        inputs of the two paths."""
        x = to_model_pixels(pixel_values.reshape(pixel_values.shape[0], -1), self.projector.weight.dtype)
        parts = x.split(meta.view_sizes)
        return ([p for p, g in zip(parts, meta.view_is_global) if g],
                [p for p, g in zip(parts, meta.view_is_global) if not g])

    def assemble(self, g_rows: torch.Tensor, c_rows: torch.Tensor | None, crops: list[int]) -> torch.Tensor:
        """Per image its crops' rows, its global view's, the view separator: [rows, text width]
        from the paths' outputs ([views, queries, text width] each, images in order)."""
        sep = self.view_separator.to(g_rows.dtype)[None]
        out, c0 = [], 0
        for i, n in enumerate(crops):
            if n:
                out.append(c_rows[c0:c0 + n].reshape(-1, g_rows.shape[-1]))
                c0 += n
            out += [g_rows[i], sep]
        return torch.cat(out)

    def forward(self, pixel_values: torch.Tensor, meta: VisionMetadata, ex: VisionExecution | None = None):
        glob, crops = self.split_views(pixel_values, meta)
        ex = ex or DEFAULT_EXECUTION
        g_rows = self.encode_views(torch.cat(glob), len(glob), True, ex)
        c_rows = self.encode_views(torch.cat(crops), len(crops), False, ex) if crops else None
        return self.assemble(g_rows, c_rows, meta.crops)
