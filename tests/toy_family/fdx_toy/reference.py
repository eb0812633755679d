"""toy_vlm's reference: a plain, slow, obviously correct float64 implementation straight from the
checkpoint's tensors, sharing no code with the modules the runner drives (vision.py, text.py).
One image at a time, one head at a time, full-prompt causal attention written out; greedy
generation recomputes the whole prompt for every new token. The conformance numbers compare
against it.
"""
from __future__ import annotations

import math
from pathlib import Path

import torch

from .config import ToyConfig
from .loader import read_tensors


def _ln(x, w, b, eps):
    mu = x.mean(-1, keepdim=True)
    var = ((x - mu) ** 2).mean(-1, keepdim=True)
    return (x - mu) / torch.sqrt(var + eps) * w + b


def _rms(x, w, eps):
    return x / torch.sqrt((x ** 2).mean(-1, keepdim=True) + eps) * w


def _gelu(x):
    return 0.5 * x * (1 + torch.erf(x / math.sqrt(2)))


def _softmax_attention(q, k, v, causal: bool):
    """q [n, d], k/v [m, d] -> [n, d] (one head)."""
    s = q @ k.t() / math.sqrt(q.shape[-1])
    if causal:
        n = q.shape[0]
        s = s.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
    return torch.softmax(s, -1) @ v


class ToyReference:
    def __init__(self, model_dir: str | Path):
        self.cfg = ToyConfig.from_model_dir(model_dir)
        self.v = {k: t.double() for k, t in read_tensors(model_dir, "vision").items()}
        self.t = {k: t.double() for k, t in read_tensors(model_dir, "text").items()}

    # ----------------------------------------------------------------- vision
    def image_features(self, patches: torch.Tensor) -> torch.Tensor:
        """One image's patches [patches_per_image, C, P, P] -> [embeddings_per_image, hidden]."""
        c, W = self.cfg, self.v
        x = patches.reshape(patches.shape[0], -1).double() @ W["patch_embed.weight"].t() + W["patch_embed.bias"]
        x = x + W["pos_embed"]
        d, nh = c.vision_hidden_size, c.vision_num_heads
        hd = d // nh
        for i in range(c.vision_num_layers):
            p = f"layers.{i}."
            h = _ln(x, W[p + "norm1.weight"], W[p + "norm1.bias"], c.layer_norm_eps)
            qkv = h @ W[p + "qkv.weight"].t() + W[p + "qkv.bias"]
            q, k, v = qkv[:, :d], qkv[:, d:2 * d], qkv[:, 2 * d:]
            heads = [_softmax_attention(q[:, j * hd:(j + 1) * hd], k[:, j * hd:(j + 1) * hd],
                                        v[:, j * hd:(j + 1) * hd], causal=False) for j in range(nh)]
            x = x + torch.cat(heads, -1) @ W[p + "out_proj.weight"].t() + W[p + "out_proj.bias"]
            h = _ln(x, W[p + "norm2.weight"], W[p + "norm2.bias"], c.layer_norm_eps)
            h = _gelu(h @ W[p + "fc1.weight"].t() + W[p + "fc1.bias"])
            x = x + h @ W[p + "fc2.weight"].t() + W[p + "fc2.bias"]
        x = _ln(x, W["post_norm.weight"], W["post_norm.bias"], c.layer_norm_eps)
        # merge: each m x m block of the patch grid, patches in raster order inside the block
        s, m = c.grid_side, c.merge
        rows = []
        for br in range(s // m):
            for bc in range(s // m):
                rows.append(torch.cat([x[(br * m + i) * s + bc * m + j] for i in range(m) for j in range(m)]))
        x = torch.stack(rows)
        x = _gelu(x @ W["proj1.weight"].t() + W["proj1.bias"])
        return (x @ W["proj2.weight"].t() + W["proj2.bias"]).float()

    # ----------------------------------------------------------------- text
    def _rotate(self, x: torch.Tensor, pos: int) -> torch.Tensor:
        """1D rope of one head's vector at position ``pos`` (NeoX halves: pair (i, i + d/2))."""
        d = x.shape[-1]
        out = x.clone()
        for i in range(d // 2):
            a = pos / self.cfg.rope_theta ** (2 * i / d)
            out[i] = x[i] * math.cos(a) - x[i + d // 2] * math.sin(a)
            out[i + d // 2] = x[i + d // 2] * math.cos(a) + x[i] * math.sin(a)
        return out

    def logits(self, token_ids: list[int], image_features: list[torch.Tensor] = ()) -> torch.Tensor:
        """float32 logits [n, vocab] of the full prompt; image features replace the image
        tokens' embeddings in order."""
        c, W = self.cfg, self.t
        x = W["embed_tokens.weight"][torch.tensor(token_ids)].clone()
        img_rows = [i for i, t in enumerate(token_ids) if t == c.image_token_id]
        feats = torch.cat([f.double() for f in image_features]) if len(image_features) else torch.zeros(0)
        if len(img_rows) != feats.shape[0]:
            raise ValueError(f"{len(img_rows)} image tokens but {feats.shape[0]} image feature rows")
        for r, f in zip(img_rows, feats):
            x[r] = f
        n, hd, nh, nkv = len(token_ids), c.head_dim, c.num_attention_heads, c.num_key_value_heads
        for li in range(c.num_hidden_layers):
            p = f"layers.{li}."
            h = _rms(x, W[p + "input_norm.weight"], c.rms_norm_eps)
            qkv = h @ W[p + "qkv.weight"].t()
            q, k, v = qkv[:, :nh * hd], qkv[:, nh * hd:(nh + nkv) * hd], qkv[:, (nh + nkv) * hd:]
            heads = []
            for j in range(nh):
                g = j // (nh // nkv)              # the KV head this query head reads (GQA)
                qj = torch.stack([self._rotate(q[t, j * hd:(j + 1) * hd], t) for t in range(n)])
                kj = torch.stack([self._rotate(k[t, g * hd:(g + 1) * hd], t) for t in range(n)])
                heads.append(_softmax_attention(qj, kj, v[:, g * hd:(g + 1) * hd], causal=True))
            x = x + torch.cat(heads, -1) @ W[p + "o_proj.weight"].t()
            h = _rms(x, W[p + "post_norm.weight"], c.rms_norm_eps)
            gate, up = (h @ W[p + "gate_up.weight"].t()).chunk(2, -1)
            x = x + (gate * torch.sigmoid(gate) * up) @ W[p + "down.weight"].t()
        return (_rms(x, W["norm.weight"], c.rms_norm_eps) @ W["lm_head.weight"].t()).float()

    def greedy(self, token_ids: list[int], image_features: list[torch.Tensor], max_tokens: int) -> list[int]:
        ids, out = list(token_ids), []
        for _ in range(max_tokens):
            nxt = int(self.logits(ids, image_features)[-1].argmax())
            out.append(nxt)
            ids.append(nxt)
        return out
