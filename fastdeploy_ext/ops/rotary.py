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


def rotary_reference(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """transformers' formula, ``x*cos + rotate_half(x)*sin`` in fp32: the bitwise reference of
    the functions below (tests compare them)."""
    xf = x.float()
    c, s = cos.unsqueeze(-2), sin.unsqueeze(-2)
    return ((xf * c) + (rotate_half(xf) * s)).to(x.dtype)


def _halves(cos: torch.Tensor, sin: torch.Tensor, d: int):
    h = d // 2
    c, s = cos.unsqueeze(-2), sin.unsqueeze(-2)
    return c[..., :h], c[..., h:], s[..., :h], s[..., h:]


def _rotate_into(x1, x2, c1, c2, s1, s2, o1, o2) -> None:
    """o1 = x1*c1 - x2*s1, o2 = x2*c2 + x1*s2 in fp32. Bit-identical to the reference: its first
    half is x1*c1 + (-x2)*s1, and (-a)*b == -(a*b), p + (-q) == p - q exactly in IEEE arithmetic;
    no cat, no neg, half-width temporaries. o1 may not alias x1/x2; o2 may alias x2."""
    t = torch.mul(x2, s1)
    u = torch.mul(x1, s2)
    torch.mul(x1, c1, out=o1)
    o1.sub_(t)
    torch.mul(x2, c2, out=o2)
    o2.add_(u)


def rotary_out_of_place(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [N, H, D] in any dtype -> rotated copy in x's dtype (contiguous), computed in fp32."""
    d = x.shape[-1]
    xf = x.float()
    out = torch.empty(xf.shape, dtype=torch.float32, device=x.device)
    c1, c2, s1, s2 = _halves(cos, sin, d)
    _rotate_into(xf[..., : d // 2], xf[..., d // 2:], c1, c2, s1, s2, out[..., : d // 2], out[..., d // 2:])
    return out if x.dtype == torch.float32 else out.to(x.dtype)


def rotary_in_place(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate a strided view (e.g. q inside the packed qkv buffer) in place, so the attention
    kernel still receives a view of that buffer. Same arithmetic as rotary_out_of_place, so the
    values written are bit-identical to the dense path's. fp32 views are rotated where they are
    (one half-width temporary for the first half instead of a full rotated copy copied back)."""
    if x.dtype != torch.float32:
        x.copy_(rotary_out_of_place(x, cos, sin))
        return x
    d = x.shape[-1]
    x1, x2 = x[..., : d // 2], x[..., d // 2:]
    c1, c2, s1, s2 = _halves(cos, sin, d)
    o1 = torch.empty(x1.shape, dtype=torch.float32, device=x.device)
    _rotate_into(x1, x2, c1, c2, s1, s2, o1, x2)
    x1.copy_(o1)
    return x
