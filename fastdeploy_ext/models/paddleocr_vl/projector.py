"""The PaddleOCR-VL projector (`mlp_AR` in checkpoints): vision tokens -> LLM embedding space."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .metadata import VisionMetadata


class Projector(nn.Module):
    """LayerNorm -> 2x2 spatial merge -> Linear -> GELU (exact) -> Linear, one call per batch."""

    def __init__(self, vision_hidden: int, text_hidden: int, merge: int, eps: float):
        super().__init__()
        self.merge = merge
        d = vision_hidden * merge * merge
        self.pre_norm = nn.LayerNorm(vision_hidden, eps=eps)
        self.linear_1 = nn.Linear(d, d)
        self.linear_2 = nn.Linear(d, text_hidden)

    def forward(self, x: torch.Tensor, meta: VisionMetadata) -> torch.Tensor:
        x = self.pre_norm(x)
        x = x.index_select(0, meta.merge_index).view(-1, x.shape[-1] * self.merge * self.merge)
        return self.linear_2(F.gelu(self.linear_1(x)))
