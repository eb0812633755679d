"""The PP-DocLayout detectors' modules: HGNetV2 backbone -> hybrid encoder (one AIFI attention
layer over the stride-32 map, FPN + PAN of CSP-RepVGG blocks, V3's mask-prototype branch) ->
two-stage query selection (top-k of the encoder's per-position class scores) -> a decoder whose
cross-attention is multi-scale deformable attention (``grid_sample``) -> class and box heads.
``DetectorCore`` is that shared detector (PP-DocLayoutV2 builds on it: models/pp_doclayout_v2/);
``PPDocLayoutV3`` adds V3's mask branch and its GlobalPointer reading-order head.

Parameter names follow the tensor names transformers' ``save_pretrained`` writes under its
``model.`` prefix (loader.py strips it), so loading is a name-for-name copy.

Runtime choices (DetectorExecution): the per-decoder-layer mask outputs are off by default
(parsing needs boxes and order only); the encoder's mask prototypes stay on whenever the
config's ``mask_enhanced`` is set, because they place the decoder's initial boxes.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from ...ops.attention.deformable import deformable_sample
from .config import BackboneConfig, DetectorConfig, PPDocLayoutV3Config

_ACT: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "relu": F.relu, "silu": F.silu, "gelu": F.gelu, "identity": lambda x: x}


def activation(name: str | None) -> Callable[[torch.Tensor], torch.Tensor]:
    if name is None:
        return _ACT["identity"]
    if name not in _ACT:
        raise ValueError(f"activation {name!r} is not supported (known: {', '.join(sorted(_ACT))})")
    return _ACT[name]


class BatchNorm(nn.Module):
    """Inference batch norm over stored statistics. ``folded``: the scale/shift form the
    reference's frozen backbone norms use (x * w/sqrt(var+eps) + (b - mean * scale)); otherwise
    F.batch_norm's form, as its other norms run."""

    def __init__(self, n: int, eps: float = 1e-5, folded: bool = False):
        super().__init__()
        self.eps, self.folded = eps, folded
        self.weight = nn.Parameter(torch.ones(n))
        self.bias = nn.Parameter(torch.zeros(n))
        self.register_buffer("running_mean", torch.zeros(n))
        self.register_buffer("running_var", torch.ones(n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.folded:
            scale = self.weight * (self.running_var + self.eps).rsqrt()
            shift = self.bias - self.running_mean * scale
            return x * scale[None, :, None, None] + shift[None, :, None, None]
        return F.batch_norm(x, self.running_mean, self.running_var, self.weight, self.bias, False, 0.0, self.eps)


class ConvBN(nn.Module):
    """conv (no bias) -> batch norm -> activation; attribute names as the checkpoint's
    (``convolution``/``normalization``, or ``conv``/``norm`` with ``short_names``)."""

    def __init__(self, cin: int, cout: int, k: int, stride: int = 1, *, groups: int = 1, act: str | None = None,
                 padding: int | None = None, eps: float = 1e-5, folded: bool = False, short_names: bool = False):
        super().__init__()
        conv = nn.Conv2d(cin, cout, k, stride, padding=(k - 1) // 2 if padding is None else padding, groups=groups,
                         bias=False)
        norm = BatchNorm(cout, eps, folded)
        self._names = ("conv", "norm") if short_names else ("convolution", "normalization")
        setattr(self, self._names[0], conv)
        setattr(self, self._names[1], norm)
        self.act = activation(act)

    def forward(self, x):
        return self.act(getattr(self, self._names[1])(getattr(self, self._names[0])(x)))


# ---------------------------------------------------------------------------------- backbone
class _LightConv(nn.Module):
    """1x1 conv (no activation) then a depthwise k x k conv."""

    def __init__(self, cin, cout, k, act):
        super().__init__()
        self.conv1 = ConvBN(cin, cout, 1, folded=True)
        self.conv2 = ConvBN(cout, cout, k, groups=cout, act=act, folded=True)

    def forward(self, x):
        return self.conv2(self.conv1(x))


class _HGBlock(nn.Module):
    """``num_layers`` chained convs, every intermediate concatenated with the input, squeezed to
    out/2 and excited to out channels (1x1 each); residual on all blocks but a stage's first."""

    def __init__(self, cin, mid, cout, num_layers, k, light, residual, act):
        super().__init__()
        self.residual = residual
        self.layers = nn.ModuleList(
            _LightConv(cin if i == 0 else mid, mid, k, act) if light
            else ConvBN(cin if i == 0 else mid, mid, k, act=act, folded=True) for i in range(num_layers))
        total = cin + num_layers * mid
        self.aggregation = nn.Sequential(ConvBN(total, cout // 2, 1, act=act, folded=True),
                                         ConvBN(cout // 2, cout, 1, act=act, folded=True))

    def forward(self, x):
        outs = [x]
        h = x
        for layer in self.layers:
            h = layer(h)
            outs.append(h)
        h = self.aggregation(torch.cat(outs, 1))
        return h + x if self.residual else h


class _Stage(nn.Module):
    def __init__(self, b: BackboneConfig, i: int):
        super().__init__()
        cin, mid, cout = b.stage_in_channels[i], b.stage_mid_channels[i], b.stage_out_channels[i]
        self.downsample = (ConvBN(cin, cin, 3, b.stage_downsample_strides[i], groups=cin, folded=True)
                           if b.stage_downsample[i] else nn.Identity())
        self.blocks = nn.ModuleList(
            _HGBlock(cin if j == 0 else cout, mid, cout, b.stage_numb_of_layers[i], b.stage_kernel_size[i],
                     b.stage_light_block[i], j != 0, b.hidden_act) for j in range(b.stage_num_blocks[i]))

    def forward(self, x):
        x = self.downsample(x)
        for block in self.blocks:
            x = block(x)
        return x


class _Stem(nn.Module):
    def __init__(self, b: BackboneConfig):
        super().__init__()
        c0, c1, c2 = b.stem_channels
        s, act = b.stem_strides, b.hidden_act
        self.stem1 = ConvBN(c0, c1, 3, s[0], act=act, folded=True)
        self.stem2a = ConvBN(c1, c1 // 2, 2, s[1], act=act, folded=True)
        self.stem2b = ConvBN(c1 // 2, c1, 2, s[2], act=act, folded=True)
        self.stem3 = ConvBN(c1 * 2, c1, 3, s[3], act=act, folded=True)
        self.stem4 = ConvBN(c1, c2, 1, s[4], act=act, folded=True)

    def forward(self, x):
        x = F.pad(self.stem1(x), (0, 1, 0, 1))          # the 2x2 convs keep the size: pad right/bottom
        a = self.stem2b(F.pad(self.stem2a(x), (0, 1, 0, 1)))
        pooled = F.max_pool2d(x, kernel_size=2, stride=1, ceil_mode=True)
        return self.stem4(self.stem3(torch.cat([pooled, a], 1)))


class _Stages(nn.Module):
    def __init__(self, b: BackboneConfig):
        super().__init__()
        self.stages = nn.ModuleList(_Stage(b, i) for i in range(len(b.stage_in_channels)))


class HGNetV2(nn.Module):
    """Returns the 4 stage outputs (strides 4, 8, 16, 32)."""

    def __init__(self, b: BackboneConfig):
        super().__init__()
        self.embedder = _Stem(b)
        self.encoder = _Stages(b)

    def forward(self, x) -> list[torch.Tensor]:
        h = self.embedder(x)
        outs = []
        for stage in self.encoder.stages:
            h = stage(h)
            outs.append(h)
        return outs


class _BackboneHolder(nn.Module):
    def __init__(self, b: BackboneConfig):
        super().__init__()
        self.model = HGNetV2(b)


# ---------------------------------------------------------------------------------- encoder
class SelfAttention(nn.Module):
    """Multi-head attention with the position embedding added to queries and keys only."""

    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads, self.head_dim = heads, dim // heads
        self.q_proj, self.k_proj = nn.Linear(dim, dim), nn.Linear(dim, dim)
        self.v_proj, self.out_proj = nn.Linear(dim, dim), nn.Linear(dim, dim)
        self.attend: Callable = F.scaled_dot_product_attention      # the plan's dense attention kernel

    def forward(self, x, pos):
        b, n, d = x.shape
        qk_in = x if pos is None else x + pos
        q = self.q_proj(qk_in).view(b, n, self.heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(qk_in).view(b, n, self.heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, n, self.heads, self.head_dim).transpose(1, 2)
        o = self.attend(q, k, v)
        return self.out_proj(o.transpose(1, 2).reshape(b, n, d))


class TransformerLayer(nn.Module):
    """Post-norm attention + FFN (the AIFI layer; the decoder layer adds cross-attention)."""

    def __init__(self, dim, heads, ffn, act, eps):
        super().__init__()
        self.self_attn = SelfAttention(dim, heads)
        self.self_attn_layer_norm = nn.LayerNorm(dim, eps=eps)
        self.fc1, self.fc2 = nn.Linear(dim, ffn), nn.Linear(ffn, dim)
        self.final_layer_norm = nn.LayerNorm(dim, eps=eps)
        self.act = activation(act)

    def ffn(self, x):
        return self.final_layer_norm(x + self.fc2(self.act(self.fc1(x))))

    def forward(self, x, pos):
        return self.ffn(self.self_attn_layer_norm(x + self.self_attn(x, pos)))


def sine_position_embedding(h: int, w: int, dim: int, temperature: float, *, device, dtype) -> torch.Tensor:
    """[1, h*w, dim]: per position (row-major) [sin(y w_i) | cos(y w_i) | sin(x w_i) | cos(x w_i)],
    w_i = temperature^(-i / (dim/4)), computed in float64."""
    quarter = dim // 4
    omega = 1.0 / temperature ** (torch.arange(quarter, dtype=torch.float64, device=device) / quarter)
    ys, xs = torch.meshgrid(torch.arange(h, dtype=torch.float64, device=device),
                            torch.arange(w, dtype=torch.float64, device=device), indexing="ij")
    ey, ex = ys.flatten()[:, None] * omega, xs.flatten()[:, None] * omega
    return torch.cat([ey.sin(), ey.cos(), ex.sin(), ex.cos()], 1).to(dtype)[None]


class _AIFI(nn.Module):
    def __init__(self, cfg: DetectorConfig):
        super().__init__()
        self.dim, self.temperature = cfg.encoder_hidden_dim, cfg.positional_encoding_temperature
        self.layers = nn.ModuleList(
            TransformerLayer(cfg.encoder_hidden_dim, cfg.encoder_attention_heads, cfg.encoder_ffn_dim,
                             cfg.encoder_activation_function, cfg.layer_norm_eps) for _ in range(cfg.encoder_layers))

    def forward(self, x):
        b, c, h, w = x.shape
        seq = x.flatten(2).transpose(1, 2)
        pos = sine_position_embedding(h, w, self.dim, self.temperature, device=x.device, dtype=x.dtype)
        for layer in self.layers:
            seq = layer(seq, pos)
        return seq.transpose(1, 2).reshape(b, c, h, w).contiguous()


class _RepVGG(nn.Module):
    def __init__(self, ch, act, eps):
        super().__init__()
        self.conv1 = ConvBN(ch, ch, 3, padding=1, eps=eps, short_names=True)
        self.conv2 = ConvBN(ch, ch, 1, padding=0, eps=eps, short_names=True)
        self.act = activation(act)

    def forward(self, x):
        return self.act(self.conv1(x) + self.conv2(x))


class _CSPRep(nn.Module):
    def __init__(self, cfg: DetectorConfig):
        super().__init__()
        cin, cout, act, eps = 2 * cfg.encoder_hidden_dim, cfg.encoder_hidden_dim, cfg.activation_function, cfg.batch_norm_eps
        hidden = int(cout * cfg.hidden_expansion)
        self.conv1 = ConvBN(cin, hidden, 1, act=act, eps=eps, short_names=True)
        self.conv2 = ConvBN(cin, hidden, 1, act=act, eps=eps, short_names=True)
        self.bottlenecks = nn.Sequential(*[_RepVGG(hidden, act, eps) for _ in range(3)])
        self.conv3 = (ConvBN(hidden, cout, 1, act=act, eps=eps, short_names=True) if hidden != cout
                      else nn.Identity())

    def forward(self, x):
        return self.conv3(self.bottlenecks(self.conv1(x)) + self.conv2(x))


class _ScaleHead(nn.Module):
    """Convs (SiLU) each followed by a 2x bilinear upsample, from ``stride`` down to ``base``."""

    def __init__(self, cin, ch, stride, base):
        super().__init__()
        n = max(1, int(math.log2(stride) - math.log2(base)))
        layers: list[nn.Module] = []
        for k in range(n):
            layers.append(ConvBN(cin if k == 0 else ch, ch, 3, act="silu"))
            if stride != base:
                layers.append(nn.Upsample(scale_factor=2, mode="bilinear", align_corners=False))
        self.layers = nn.ModuleList(layers)

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


class _MaskFPN(nn.Module):
    def __init__(self, cfg: PPDocLayoutV3Config):
        super().__init__()
        strides = list(cfg.feat_strides)
        self.order = sorted(range(len(strides)), key=lambda i: strides[i])
        ch, out = cfg.mask_feature_channels
        base = strides[self.order[0]]
        self.scale_heads = nn.ModuleList(_ScaleHead(cfg.encoder_hidden_dim, ch, strides[i], base) for i in self.order)
        self.output_conv = ConvBN(ch, out, 3, act="silu")

    def forward(self, maps):
        xs = [maps[i] for i in self.order]
        out = self.scale_heads[0](xs[0])
        for head, x in zip(self.scale_heads[1:], xs[1:]):
            out = out + F.interpolate(head(x), size=out.shape[2:], mode="bilinear", align_corners=False)
        return self.output_conv(out)


class _MaskOutput(nn.Module):
    def __init__(self, ch, prototypes):
        super().__init__()
        self.base_conv = ConvBN(ch, ch, 3, act="silu")
        self.conv = nn.Conv2d(ch, prototypes, 1)

    def forward(self, x):
        return self.conv(self.base_conv(x))


class HybridEncoder(nn.Module):
    """AIFI on the listed levels, a top-down FPN and a bottom-up PAN (CSP-RepVGG fusion), and
    with ``mask_branch`` (V3) the mask prototypes (stride 4) from the PAN maps plus the
    backbone's stride-4 map."""

    def __init__(self, cfg: DetectorConfig, mask_branch: bool):
        super().__init__()
        self.cfg, self.mask_branch = cfg, mask_branch
        d, act, eps = cfg.encoder_hidden_dim, cfg.activation_function, cfg.batch_norm_eps
        n = len(cfg.encoder_in_channels) - 1
        # named "encoder" in the checkpoint (transformers' converted name for its AIFI list)
        self.encoder = nn.ModuleList(_AIFI(cfg) for _ in cfg.encode_proj_layers)
        self.lateral_convs = nn.ModuleList(ConvBN(d, d, 1, act=act, eps=eps, short_names=True) for _ in range(n))
        self.fpn_blocks = nn.ModuleList(_CSPRep(cfg) for _ in range(n))
        self.downsample_convs = nn.ModuleList(ConvBN(d, d, 3, 2, act=act, eps=eps, short_names=True) for _ in range(n))
        self.pan_blocks = nn.ModuleList(_CSPRep(cfg) for _ in range(n))
        if mask_branch:
            self.mask_feature_head = _MaskFPN(cfg)
            self.encoder_mask_lateral = ConvBN(cfg.x4_feat_dim, cfg.mask_feature_channels[1], 3, act="silu")
            self.encoder_mask_output = _MaskOutput(cfg.mask_feature_channels[1], cfg.num_prototypes)

    def forward(self, maps: list[torch.Tensor], x4: torch.Tensor | None, with_mask_feat: bool):
        maps = list(maps)
        if self.cfg.encoder_layers > 0:
            for aifi, level in zip(self.encoder, self.cfg.encode_proj_layers):
                maps[level] = aifi(maps[level])
        n = len(maps) - 1
        fpn = [maps[-1]]
        for idx, (lateral, block) in enumerate(zip(self.lateral_convs, self.fpn_blocks)):
            top = lateral(fpn[-1])
            fpn[-1] = top
            up = F.interpolate(top, scale_factor=2.0, mode="nearest")
            fpn.append(block(torch.cat([up, maps[n - idx - 1]], 1)))
        fpn.reverse()
        pan = [fpn[0]]
        for idx, (down, block) in enumerate(zip(self.downsample_convs, self.pan_blocks)):
            pan.append(block(torch.cat([down(pan[-1]), fpn[idx + 1]], 1)))
        if not with_mask_feat:
            return pan, None
        if not self.mask_branch:
            raise ValueError("this detector has no mask branch")
        mask_feat = F.interpolate(self.mask_feature_head(pan), scale_factor=2, mode="bilinear", align_corners=False)
        mask_feat = self.encoder_mask_output(mask_feat + self.encoder_mask_lateral(x4))
        return pan, mask_feat


# ---------------------------------------------------------------------------------- decoder
class DeformableAttention(nn.Module):
    def __init__(self, cfg: DetectorConfig):
        super().__init__()
        d, self.heads = cfg.d_model, cfg.decoder_attention_heads
        self.levels, self.points = cfg.num_feature_levels, cfg.decoder_n_points
        self.sampling_offsets = nn.Linear(d, self.heads * self.levels * self.points * 2)
        self.attention_weights = nn.Linear(d, self.heads * self.levels * self.points)
        self.value_proj, self.output_proj = nn.Linear(d, d), nn.Linear(d, d)
        self.kernel: Callable = deformable_sample

    def forward(self, x, pos, memory, ref_boxes, shapes):
        """ref_boxes [B, Q, 4] (cx, cy, w, h in [0, 1]): offsets are scaled by half the box / points."""
        b, q, d = x.shape
        x = x + pos
        value = self.value_proj(memory).view(b, memory.shape[1], self.heads, d // self.heads)
        off = self.sampling_offsets(x).view(b, q, self.heads, self.levels, self.points, 2)
        w = F.softmax(self.attention_weights(x).view(b, q, self.heads, self.levels * self.points), -1)
        w = w.view(b, q, self.heads, self.levels, self.points)
        ref = ref_boxes[:, :, None, None, None, :]
        loc = ref[..., :2] + off / self.points * ref[..., 2:] * 0.5
        return self.output_proj(self.kernel(value, shapes, loc, w))


class DecoderLayer(TransformerLayer):
    def __init__(self, cfg: DetectorConfig):
        super().__init__(cfg.d_model, cfg.decoder_attention_heads, cfg.decoder_ffn_dim,
                         cfg.decoder_activation_function, cfg.layer_norm_eps)
        self.encoder_attn = DeformableAttention(cfg)
        self.encoder_attn_layer_norm = nn.LayerNorm(cfg.d_model, eps=cfg.layer_norm_eps)

    def forward(self, x, pos, memory, ref_boxes, shapes):
        x = self.self_attn_layer_norm(x + self.self_attn(x, pos))
        x = self.encoder_attn_layer_norm(x + self.encoder_attn(x, pos, memory, ref_boxes, shapes))
        return self.ffn(x)


class MLP(nn.Module):
    """Linear layers with ReLU between them (the box, query-position and mask-query heads)."""

    def __init__(self, din, hidden, dout, n):
        super().__init__()
        dims = [din] + [hidden] * (n - 1)
        self.layers = nn.ModuleList(nn.Linear(a, c) for a, c in zip(dims, dims[1:] + [dout]))

    def forward(self, x):
        for i, layer in enumerate(self.layers):
            x = layer(x)
            if i < len(self.layers) - 1:
                x = F.relu(x)
        return x


class Decoder(nn.Module):
    """The decoder layers and the query-position head; with ``per_layer_heads`` (V2, RT-DETR's
    layout) also a class and a box head per layer (``class_embed``, ``bbox_embed``), where V3
    ties every layer to the encoder's heads."""

    def __init__(self, cfg: DetectorConfig, per_layer_heads: bool):
        super().__init__()
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.decoder_layers))
        self.query_pos_head = MLP(4, 2 * cfg.d_model, cfg.d_model, 2)
        if per_layer_heads:
            self.class_embed = nn.ModuleList(nn.Linear(cfg.d_model, cfg.num_labels) for _ in self.layers)
            self.bbox_embed = nn.ModuleList(MLP(cfg.d_model, cfg.d_model, 4, 3) for _ in self.layers)


class GlobalPointer(nn.Module):
    """Pairwise reading-order logits: (q_i . k_j) / sqrt(head) for i < j, -1e4 on and below the
    diagonal (V3's decoder head; V2's reading-order network ends in one too)."""

    def __init__(self, dim: int, head_size: int):
        super().__init__()
        self.head = head_size
        self.dense = nn.Linear(dim, 2 * self.head)

    def forward(self, x):
        b, n, _ = x.shape
        q, k = self.dense(x).view(b, n, 2, self.head).unbind(2)
        logits = (q @ k.transpose(-2, -1)) / self.head ** 0.5
        lower = torch.ones(n, n, dtype=torch.bool, device=x.device).tril()
        return logits.masked_fill(lower, -1e4)


def inverse_sigmoid(x: torch.Tensor, eps: float = 1e-5) -> torch.Tensor:
    x = x.clamp(0, 1)
    return torch.log(x.clamp(min=eps) / (1 - x).clamp(min=eps))


def mask_boxes(mask: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The normalized (cx, cy, w, h) bounding box of each boolean mask [..., H, W] (all zero for
    an empty mask), in ``dtype`` (the compute dtype, as the reference): pixels x0..x1 inclusive
    span [x0, x1 + 1)."""
    h, w = mask.shape[-2:]
    ys = torch.arange(h, device=mask.device, dtype=dtype)[:, None].expand(h, w)
    xs = torch.arange(w, device=mask.device, dtype=dtype)[None, :].expand(h, w)
    big = torch.finfo(dtype).max
    fm = mask.to(dtype)

    def extent(c):
        hi = (c * fm).flatten(-2).amax(-1) + 1
        lo = torch.where(mask, c, torch.full((), big, device=mask.device, dtype=dtype)).flatten(-2).amin(-1)
        return lo, hi
    x0, x1 = extent(xs)
    y0, y1 = extent(ys)
    nonempty = mask.flatten(-2).any(-1).to(dtype)
    x0, x1, y0, y1 = x0 * nonempty / w, x1 * nonempty / w, y0 * nonempty / h, y1 * nonempty / h
    return torch.stack([(x0 + x1) / 2, (y0 + y1) / 2, x1 - x0, y1 - y0], -1)


@dataclass
class DetectorOutputs:
    logits: torch.Tensor                    # [B, Q, C] the last decoder layer's class logits
    pred_boxes: torch.Tensor                # [B, Q, 4] (cx, cy, w, h) in [0, 1]
    order_logits: torch.Tensor              # [B, Q, Q] the reading-order pointer's pairwise logits
    enc_outputs_class: torch.Tensor         # [B, S, C] the encoder's per-position scores (before top-k)
    enc_outputs_coord_logits: torch.Tensor  # [B, S, 4]
    out_masks: torch.Tensor | None = None   # [B, Q, h/4, w/4] only when masks are asked for


@dataclass
class DecoderState:
    """What the shared detector hands its family's heads: the last decoder layer's hidden states
    and boxes, the encoder's scores before the top-k, and the mask features (V3, when computed)."""
    hidden: torch.Tensor                    # [B, Q, d] the last decoder layer's output
    boxes: torch.Tensor                     # [B, Q, 4] (cx, cy, w, h) in [0, 1] after the last refinement
    enc_outputs_class: torch.Tensor
    enc_outputs_coord_logits: torch.Tensor
    mask_feat: torch.Tensor | None


class DetectorCore(nn.Module):
    """The RT-DETR-shaped detector both PP-DocLayout families share: backbone, encoder
    projections, hybrid encoder, two-stage query selection, the deformable decoder with its box
    refinement. ``mask_branch``: the encoder's mask prototypes (V3). ``per_layer_heads``: the
    decoder's own heads per layer (V2) instead of the encoder's heads tied (V3). A family's
    module subclasses it and adds its heads (``run`` -> DecoderState)."""

    def __init__(self, cfg: DetectorConfig, *, mask_branch: bool, per_layer_heads: bool):
        super().__init__()
        self.cfg = cfg
        d, eps = cfg.d_model, cfg.layer_norm_eps
        self.backbone = _BackboneHolder(cfg.backbone)
        outs = cfg.backbone.stage_out_channels
        # the encoder gets the last len(feat_strides) stages (strides 8/16/32); V3's mask branch
        # also takes the stride-4 stage
        self.encoder_input_proj = nn.ModuleList(
            nn.Sequential(nn.Conv2d(c, cfg.encoder_hidden_dim, 1, bias=False), BatchNorm(cfg.encoder_hidden_dim))
            for c in outs[-len(cfg.feat_strides):])
        self.encoder = HybridEncoder(cfg, mask_branch)
        self.enc_output = nn.Sequential(nn.Linear(d, d), nn.LayerNorm(d, eps=eps))
        self.enc_score_head = nn.Linear(d, cfg.num_labels)
        self.enc_bbox_head = MLP(d, d, 4, 3)
        self.decoder_input_proj = nn.ModuleList(
            nn.Sequential(nn.Conv2d(c, d, 1, bias=False), BatchNorm(d, cfg.batch_norm_eps))
            for c in cfg.decoder_in_channels)
        self.decoder = Decoder(cfg, per_layer_heads)
        self.per_layer_heads = per_layer_heads

    def set_deformable_kernel(self, kernel: Callable) -> None:
        for layer in self.decoder.layers:
            layer.encoder_attn.kernel = kernel

    def set_aifi_attention(self, attend: Callable) -> None:
        """The dense attention kernel of the hybrid encoder's AIFI layers ((q, k, v) -> out)."""
        for aifi in self.encoder.encoder:
            for layer in aifi.layers:
                layer.self_attn.attend = attend

    def box_head(self, layer: int) -> nn.Module:
        """The head that refines the boxes after decoder layer ``layer``."""
        return self.decoder.bbox_embed[layer] if self.per_layer_heads else self.enc_bbox_head

    @staticmethod
    def anchors(shapes: list[tuple[int, int]], *, device, dtype, grid: float = 0.05):
        """Per encoder position, the logit of its anchor box (cell centre, size grid * 2^level) and
        whether it lies inside (0.01, 0.99) on every coordinate (outside: the dtype's max)."""
        out = []
        for lvl, (h, w) in enumerate(shapes):
            ys, xs = torch.meshgrid(torch.arange(h, device=device, dtype=dtype),
                                    torch.arange(w, device=device, dtype=dtype), indexing="ij")
            cxcy = torch.stack([(xs + 0.5) / w, (ys + 0.5) / h], -1)
            wh = torch.full_like(cxcy, grid * 2.0 ** lvl)
            out.append(torch.cat([cxcy, wh], -1).reshape(1, h * w, 4))
        a = torch.cat(out, 1)
        valid = ((a > 0.01) & (a < 0.99)).all(-1, keepdim=True)
        logit = torch.where(valid, torch.log(a / (1 - a)), torch.full((), torch.finfo(dtype).max, device=device,
                                                                      dtype=dtype))
        return logit, valid

    def initial_reference(self, target: torch.Tensor, enc_coord: torch.Tensor, topk: torch.Tensor,
                          mask_feat: torch.Tensor | None) -> torch.Tensor:
        """The decoder's initial boxes (as logits): the top-k positions' encoder boxes."""
        return enc_coord.gather(1, topk[..., None].expand(-1, -1, 4))

    def run(self, pixels: torch.Tensor, with_mask_feat: bool = False) -> DecoderState:
        cfg = self.cfg
        feats = self.backbone.model(pixels)
        x4, rest = feats[0], feats[-len(cfg.feat_strides):]
        proj = [p(f) for p, f in zip(self.encoder_input_proj, rest)]
        pan, mask_feat = self.encoder(proj, x4, with_mask_feat)
        sources = [p(m) for p, m in zip(self.decoder_input_proj, pan)]
        shapes = [tuple(s.shape[-2:]) for s in sources]
        memory = torch.cat([s.flatten(2).transpose(1, 2) for s in sources], 1)
        if cfg.anchor_image_size is not None:
            ah, aw = cfg.anchor_image_size
            anchor_shapes = [(int(ah / s), int(aw / s)) for s in cfg.feat_strides]
        else:
            anchor_shapes = shapes
        anchors, valid = self.anchors(anchor_shapes, device=memory.device, dtype=memory.dtype)
        out_mem = self.enc_output(valid.to(memory.dtype) * memory)
        enc_class = self.enc_score_head(out_mem)
        enc_coord = self.enc_bbox_head(out_mem) + anchors
        topk = torch.topk(enc_class.max(-1).values, cfg.num_queries, dim=1).indices
        target = out_mem.gather(1, topk[..., None].expand(-1, -1, out_mem.shape[-1]))
        ref = self.initial_reference(target, enc_coord, topk, mask_feat).sigmoid()
        h = target
        for i, layer in enumerate(self.decoder.layers):
            pos = self.decoder.query_pos_head(ref)
            h = layer(h, pos, memory, ref, shapes)
            ref = (self.box_head(i)(h) + inverse_sigmoid(ref)).sigmoid()
        return DecoderState(h, ref, enc_class, enc_coord, mask_feat)


class PPDocLayoutV3(DetectorCore):
    """The detector. ``forward(pixels [B, 3, H, W] in [0, 1]) -> DetectorOutputs``: the shared
    detector with the encoder's heads tied to every decoder layer, the mask branch, and the
    GlobalPointer reading-order head on the last layer."""

    def __init__(self, cfg: PPDocLayoutV3Config):
        super().__init__(cfg, mask_branch=True, per_layer_heads=False)
        d, eps = cfg.d_model, cfg.layer_norm_eps
        self.decoder_order_head = nn.ModuleList(nn.Linear(d, d) for _ in range(cfg.decoder_layers))
        self.decoder_global_pointer = GlobalPointer(d, cfg.global_pointer_head_size)
        self.decoder_norm = nn.LayerNorm(d, eps=eps)
        self.mask_query_head = MLP(d, d, cfg.num_prototypes, 3)
        #: compute the last layer's mask outputs (``out_masks``): off unless asked (the plan's decision)
        self.with_masks = False

    def initial_reference(self, target, enc_coord, topk, mask_feat):
        if not self.cfg.mask_enhanced:
            return super().initial_reference(target, enc_coord, topk, mask_feat)
        # the initial boxes are the top-k queries' encoder masks' bounding boxes
        mq = self.mask_query_head(self.decoder_norm(target))
        masks = torch.bmm(mq, mask_feat.flatten(2)).view(*mq.shape[:2], *mask_feat.shape[-2:])
        return inverse_sigmoid(mask_boxes(masks > 0, masks.dtype))

    def forward(self, pixels: torch.Tensor) -> DetectorOutputs:
        # the mask prototypes are needed whenever mask_enhanced places the initial boxes
        st = self.run(pixels, with_mask_feat=self.cfg.mask_enhanced or self.with_masks)
        out = self.decoder_norm(st.hidden)
        logits = self.enc_score_head(out)                                    # the class head is tied too
        order = self.decoder_global_pointer(self.decoder_order_head[len(self.decoder.layers) - 1](out))
        out_masks = None
        if self.with_masks:
            mq = self.mask_query_head(out)
            out_masks = torch.bmm(mq, st.mask_feat.flatten(2)).view(*mq.shape[:2], *st.mask_feat.shape[-2:])
        return DetectorOutputs(logits, st.boxes, order, st.enc_outputs_class, st.enc_outputs_coord_logits, out_masks)
