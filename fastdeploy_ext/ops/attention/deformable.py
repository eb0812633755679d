"""Multi-scale deformable attention's sampling (a detector's cross-attention: Deformable DETR,
RT-DETR, PP-DocLayout): one backend object per kernel, like varlen.py and paged.py. The
portable backend is ATen's ``grid_sample``; a vendor contributes its own under the kind
``deformable_attention`` (DeviceRunner.kernel_backends)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F


def deformable_sample(value: torch.Tensor, shapes: list[tuple[int, int]], locations: torch.Tensor,
                      weights: torch.Tensor) -> torch.Tensor:
    """Multi-scale deformable attention's sampling, the portable ATen kernel: per level, bilinear
    ``grid_sample`` (zeros padding, align_corners=False) of each head's value map at its sampling
    locations, weighted and summed over levels x points.

    value [B, S, H, Dh] (S = sum of h*w), locations [B, Q, H, L, P, 2] in [0, 1] (x, y),
    weights [B, Q, H, L, P] -> [B, Q, H*Dh]."""
    b, _, heads, dh = value.shape
    _, q, _, levels, points, _ = locations.shape
    grids = 2 * locations - 1
    per_level = value.split([h * w for h, w in shapes], dim=1)
    sampled = []
    for lvl, (h, w) in enumerate(shapes):
        v = per_level[lvl].flatten(2).transpose(1, 2).reshape(b * heads, dh, h, w)
        g = grids[:, :, :, lvl].transpose(1, 2).flatten(0, 1)                    # [B*H, Q, P, 2]
        sampled.append(F.grid_sample(v, g, mode="bilinear", padding_mode="zeros", align_corners=False))
    stacked = torch.stack(sampled, dim=-2).flatten(-2)                           # [B*H, Dh, Q, L*P]
    wts = weights.transpose(1, 2).reshape(b * heads, 1, q, levels * points)
    return (stacked * wts).sum(-1).view(b, heads * dh, q).transpose(1, 2)


@dataclass(frozen=True)
class DeformableAttentionBackend:
    name: str
    #: (value [B, S, H, Dh], level shapes [(h, w)], locations [B, Q, H, L, P, 2], weights [B, Q, H, L, P]) -> [B, Q, H*Dh]
    sample: Callable[..., torch.Tensor]
    available: Callable[[torch.device], tuple[bool, str]]


BUILTIN_DEFORMABLE_BACKENDS: tuple[DeformableAttentionBackend, ...] = (
    DeformableAttentionBackend("aten_grid_sample", deformable_sample, lambda device: (True, "ATen grid_sample")),
)
