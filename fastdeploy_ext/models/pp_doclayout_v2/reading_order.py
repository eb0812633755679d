"""PP-DocLayoutV2's reading-order network (transformers' ``PPDocLayoutV2ReadingOrder``): the
detector's kept boxes, in their [0, 1000] page grid and relabelled by the class order, as a
sequence [start, box_1 .. box_n, end, pad ...]; token, position, box-coordinate and label
embeddings; a post-norm encoder whose attention scores carry a pairwise box-relation bias (one
per head, the same in every layer); a GlobalPointer over the box tokens giving the pairwise
"i reads before j" logits.

Parameter names follow what ``save_pretrained`` writes under ``reading_order.``.
Everything is tensor arithmetic on the device (no read-back): the sequence length is fixed
(num_queries + 2), the number of kept boxes only moves masks and token ids."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..pp_doclayout_v3.model import GlobalPointer, activation
from .config import ReadingOrderConfig


class _Embeddings(nn.Module):
    def __init__(self, cfg: ReadingOrderConfig):
        super().__init__()
        d = cfg.hidden_size
        self.word_embeddings = nn.Embedding(cfg.vocab_size, d)
        self.token_type_embeddings = nn.Embedding(cfg.type_vocab_size, d)
        self.position_embeddings = nn.Embedding(cfg.max_position_embeddings, d)
        self.x_position_embeddings = nn.Embedding(cfg.max_2d_position_embeddings, cfg.coordinate_size)
        self.y_position_embeddings = nn.Embedding(cfg.max_2d_position_embeddings, cfg.coordinate_size)
        self.h_position_embeddings = nn.Embedding(cfg.max_2d_position_embeddings, cfg.shape_size)
        self.w_position_embeddings = nn.Embedding(cfg.max_2d_position_embeddings, cfg.shape_size)
        self.spatial_proj = nn.Linear(4 * cfg.coordinate_size + 2 * cfg.shape_size, d)
        self.norm = nn.LayerNorm(d, eps=cfg.layer_norm_eps)
        self.pad_id = cfg.pad_token_id
        self.max_2d = cfg.max_2d_position_embeddings

    def forward(self, ids: torch.Tensor, grid_boxes: torch.Tensor) -> torch.Tensor:
        """ids [B, L]; grid_boxes [B, L, 4] integer (x0, y0, x1, y1) on the 0..1000 grid. Position
        ids count the non-pad tokens from pad_id + 1 (pads sit at pad_id), as RoBERTa's do."""
        real = (ids != self.pad_id).long()
        positions = real.cumsum(1) * real + self.pad_id
        b = grid_boxes
        spatial = torch.cat([self.x_position_embeddings(b[..., 0]), self.y_position_embeddings(b[..., 1]),
                             self.x_position_embeddings(b[..., 2]), self.y_position_embeddings(b[..., 3]),
                             self.h_position_embeddings((b[..., 3] - b[..., 1]).clamp(0, self.max_2d - 1)),
                             self.w_position_embeddings((b[..., 2] - b[..., 0]).clamp(0, self.max_2d - 1))], -1)
        return (self.word_embeddings(ids) + self.token_type_embeddings(torch.zeros_like(ids))
                + self.position_embeddings(positions) + self.spatial_proj(spatial))


class _RelationBias(nn.Module):
    """Per pair of boxes (i, j): log-scaled centre distances over i's size and log size ratios,
    each expanded into sin/cos features, then a 1x1 conv to one bias per attention head."""

    def __init__(self, cfg: ReadingOrderConfig):
        super().__init__()
        dim = cfg.relation_bias_embed_dim
        self.scale = cfg.relation_bias_scale
        self.pos_proj = nn.Conv2d(4 * dim, cfg.num_attention_heads, 1)
        # frequencies theta^(-2k / (dim / 2)), k < dim / 2: the reference's (not the usual 2k / dim)
        inv_freq = 1.0 / cfg.relation_bias_theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / (dim // 2))
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, boxes: torch.Tensor, eps: float = 1e-5) -> torch.Tensor:
        """boxes [B, L, 4] (x0, y0, x1, y1) on the 0..1000 grid -> [B, heads, L, L]."""
        x0, y0, x1, y1 = boxes.unbind(-1)
        c = torch.stack([(x0 + x1) * 0.5, (y0 + y1) * 0.5], -1)
        wh = torch.stack([(x1 - x0).clamp(min=1e-3), (y1 - y0).clamp(min=1e-3)], -1)
        src_c, tgt_c, src_wh, tgt_wh = c[:, :, None], c[:, None], wh[:, :, None], wh[:, None]
        rel = torch.cat([torch.log((src_c - tgt_c).abs() / (src_wh + eps) + 1.0),
                         torch.log((src_wh + eps) / (tgt_wh + eps))], -1)             # [B, L, L, 4]
        angles = (rel * self.scale)[..., None] * self.inv_freq
        feats = torch.cat([angles.sin(), angles.cos()], -1).flatten(-2).to(boxes.dtype)
        return self.pos_proj(feats.permute(0, 3, 1, 2))


class _SelfAttention(nn.Module):
    def __init__(self, cfg: ReadingOrderConfig):
        super().__init__()
        d = cfg.hidden_size
        self.heads = cfg.num_attention_heads
        self.query, self.key, self.value = nn.Linear(d, d), nn.Linear(d, d), nn.Linear(d, d)

    def forward(self, x, bias):
        b, n, d = x.shape
        q, k, v = (proj(x).view(b, n, self.heads, d // self.heads).transpose(1, 2)
                   for proj in (self.query, self.key, self.value))
        # the bias (relation bias, the padding keys at the dtype's min) is added to the scaled scores
        return F.scaled_dot_product_attention(q, k, v, attn_mask=bias).transpose(1, 2).reshape(b, n, d)


class _DenseNorm(nn.Module):
    """dense -> residual add -> LayerNorm (post-norm)."""

    def __init__(self, din, dout, eps):
        super().__init__()
        self.dense = nn.Linear(din, dout)
        self.norm = nn.LayerNorm(dout, eps=eps)

    def forward(self, x, residual):
        return self.norm(self.dense(x) + residual)


class _Attention(nn.Module):
    def __init__(self, cfg: ReadingOrderConfig):
        super().__init__()
        self.self = _SelfAttention(cfg)
        self.output = _DenseNorm(cfg.hidden_size, cfg.hidden_size, cfg.layer_norm_eps)

    def forward(self, x, bias):
        return self.output(self.self(x, bias), x)


class _Intermediate(nn.Module):
    def __init__(self, cfg: ReadingOrderConfig):
        super().__init__()
        self.dense = nn.Linear(cfg.hidden_size, cfg.intermediate_size)
        self.act = activation(cfg.hidden_act)

    def forward(self, x):
        return self.act(self.dense(x))


class _Layer(nn.Module):
    def __init__(self, cfg: ReadingOrderConfig):
        super().__init__()
        self.attention = _Attention(cfg)
        self.intermediate = _Intermediate(cfg)
        self.output = _DenseNorm(cfg.intermediate_size, cfg.hidden_size, cfg.layer_norm_eps)

    def forward(self, x, bias):
        h = self.attention(x, bias)
        return self.output(self.intermediate(h), h)


class _Encoder(nn.Module):
    def __init__(self, cfg: ReadingOrderConfig):
        super().__init__()
        self.layer = nn.ModuleList(_Layer(cfg) for _ in range(cfg.num_hidden_layers))
        self.rel_bias_module = _RelationBias(cfg)


class ReadingOrder(nn.Module):
    """``forward(boxes [B, Q, 4] float on the 0..1000 grid, labels [B, Q] reading-order class ids,
    num_kept [B]) -> [B, Q, Q]`` pairwise logits; the first ``num_kept`` rows/entries are the kept
    boxes (padding after them is zero boxes of class_order[0], as the reference feeds it)."""

    def __init__(self, cfg: ReadingOrderConfig):
        super().__init__()
        self.cfg = cfg
        self.embeddings = _Embeddings(cfg)
        self.label_embeddings = nn.Embedding(cfg.num_classes, cfg.hidden_size)
        self.label_features_projection = nn.Linear(cfg.hidden_size, cfg.hidden_size)
        self.encoder = _Encoder(cfg)
        self.relative_head = GlobalPointer(cfg.hidden_size, cfg.global_pointer_head_size)

    def token_ids(self, num_kept: torch.Tensor, length: int) -> torch.Tensor:
        """[B, length]: start, pred for each kept box, end, then pads."""
        c = self.cfg
        col = torch.arange(length, device=num_kept.device)[None]
        n = num_kept[:, None]
        ids = torch.where(col <= n, c.pred_token_id, torch.where(col == n + 1, c.end_token_id, c.pad_token_id))
        return torch.where(col == 0, c.start_token_id, ids)

    def forward(self, boxes: torch.Tensor, labels: torch.Tensor, num_kept: torch.Tensor) -> torch.Tensor:
        b, q, _ = boxes.shape
        length = q + 2
        ids = self.token_ids(num_kept, length)
        edge = boxes.new_zeros(b, 1, 4)
        seq_boxes = torch.cat([edge, boxes, edge], 1)
        x = self.embeddings(ids, seq_boxes.long())          # the coordinate embeddings index the truncated grid
        lab = self.label_features_projection(self.label_embeddings(labels))
        edge = lab.new_zeros(b, 1, lab.shape[-1])
        x = self.embeddings.norm(x + torch.cat([edge, lab, edge], 1))
        # keys after the end token are masked; the relation bias is computed on the float boxes
        keys = torch.arange(length, device=boxes.device)[None] < (num_kept[:, None] + 2)
        bias = self.encoder.rel_bias_module(seq_boxes).to(x.dtype)
        bias = bias.masked_fill(~keys[:, None, None, :], torch.finfo(x.dtype).min)
        for layer in self.encoder.layer:
            x = layer(x, bias)
        return self.relative_head(x[:, 1:1 + q])
