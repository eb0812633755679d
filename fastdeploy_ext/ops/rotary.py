"""2D (row, col) rotary embedding of the vision encoder, always evaluated in fp32.

cos/sin are gathered from one per-position table instead of being evaluated per token: the
gather is exact, so the host and device metadata paths (which derive the same row/col ids in
different ways) produce bit-identical tables no matter how each batch is shaped.
"""
from __future__ import annotations

import torch


class RotaryTable:
    """cos/sin of ``pos * inv_freq`` for positions 0..capacity-1, grown on demand.

    ``inv_freq`` follows transformers' axial rope: dim = head_dim // 2 split in half-steps,
    theta ** (-arange(0, dim, 2) / dim). Rows are padded to a multiple of 64 so that the
    elementwise cos/sin kernels never take a scalar tail path (bitwise reproducibility).
    """

    def __init__(self, head_dim: int, theta: float, device: torch.device):
        spatial_dim = head_dim // 2
        self.inv_freq = 1.0 / (theta ** (torch.arange(0, spatial_dim, 2, dtype=torch.float32) / spatial_dim))
        self.inv_freq = self.inv_freq.to(device)
        self.device = device
        self.capacity = 0
        self.cos = self.sin = torch.empty(0, self.inv_freq.numel(), device=device)

    def ensure(self, max_position: int) -> None:
        """Grow the table to cover positions < max_position. Needs a host int: call it where
        the size is known on the host (the host path) or after an explicit sync (device path)."""
        if max_position <= self.capacity:
            return
        cap = max(64, 1 << (int(max_position) - 1).bit_length())
        pos = torch.arange(cap, dtype=torch.float32, device=self.device)
        freqs = pos[:, None] * self.inv_freq[None, :]
        self.cos, self.sin, self.capacity = freqs.cos(), freqs.sin(), cap

    def lookup(self, rows: torch.Tensor, cols: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """[N] row ids and [N] col ids -> cos, sin of shape [N, head_dim] (fp32), laid out as
        transformers recomposes them: [h-freqs, w-freqs, h-freqs, w-freqs]."""
        def gather(table: torch.Tensor) -> torch.Tensor:
            hw = torch.cat([table[rows], table[cols]], dim=-1)
            return torch.cat([hw, hw], dim=-1)
        return gather(self.cos), gather(self.sin)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def rotary_out_of_place(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [N, H, D] in any dtype -> rotated copy in x's dtype (contiguous), computed in fp32."""
    xf = x.float()
    c, s = cos.unsqueeze(-2), sin.unsqueeze(-2)
    return ((xf * c) + (rotate_half(xf) * s)).to(x.dtype)


def rotary_in_place(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate a strided view (e.g. q inside the packed qkv buffer) in place, so the attention
    kernel still receives a view of that buffer. Same arithmetic as rotary_out_of_place, so the
    values written are bit-identical to the dense path's."""
    x.copy_(rotary_out_of_place(x, cos, sin))
    return x
