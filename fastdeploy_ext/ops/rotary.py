"""2D (row, col) rotary embedding of the vision encoder, always evaluated in fp32: the table,
the ATen appliers, and q and k rotated together in place (one Triton launch where our kernels
run, ATen ops with the same arithmetic elsewhere). The engine's 3D mrope belongs here too.

cos/sin are gathered from one per-position table instead of being evaluated per token: the
gather is exact, so the host and device metadata paths (which derive the same row/col ids in
different ways) produce bit-identical tables no matter how each batch is shaped.
"""
from __future__ import annotations

import torch

from .triton.layer_passes import rotary_qk_in_place_triton
from .triton.runtime import kernels_usable


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


# ------------------------------------------------------------------ q and k together, in place
def rotary_qk_in_place_torch(qk: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Reference of :func:`rotary_qk_in_place`: the same fp32 arithmetic in ATen ops."""
    qk.copy_(rotary_out_of_place(qk, cos, sin))
    return qk


def rotary_qk_in_place(qk: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                       tuning: tuple[int, int, int] | None = None) -> torch.Tensor:
    """Rotate every head of ``qk`` ([N, heads, D], e.g. the q and k heads of the packed qkv
    buffer viewed as ``qkv[:, :2*H*D].view(N, 2*H, D)``) in place, in one Triton launch
    (ops/triton/layer_passes.py); ATen ops where the kernels cannot run.

    cos, sin: fp32 [N, D] laid out as [h, w, h, w] frequencies (rotate_half pairs column j with
    j + D/2).  Returns qk.  ``tuning``: launch parameters for `bench layers --tune`.
    """
    if qk.dim() != 3 or qk.stride(-1) != 1:
        raise ValueError(f"qk must be [N, heads, D] with a contiguous last dim, got {tuple(qk.shape)} {qk.stride()}")
    n, heads, d = qk.shape
    if d % 2:
        raise ValueError(f"rotary needs an even head dim, got {d}")
    for name, t in (("cos", cos), ("sin", sin)):
        if tuple(t.shape) != (n, d) or t.dtype != torch.float32 or t.stride(-1) != 1 or t.device != qk.device:
            raise ValueError(f"{name} must be fp32 [N, D] = {(n, d)} with a contiguous last dim, "
                             f"got {t.dtype} {tuple(t.shape)}")
    if not kernels_usable(qk):
        return rotary_qk_in_place_torch(qk, cos, sin)
    return rotary_qk_in_place_triton(qk, cos, sin, tuning)


def _adjacent_heads(q: torch.Tensor, k: torch.Tensor) -> bool:
    """k's heads directly follow q's in every row of one buffer (q/k views of a packed qkv)."""
    h, d = q.shape[1], q.shape[2]
    return (q.stride() == k.stride() and q.stride(1) == d and q.untyped_storage().data_ptr() ==
            k.untyped_storage().data_ptr() and k.data_ptr() - q.data_ptr() == h * d * q.element_size()
            and q.stride(0) >= 2 * h * d)


def rotary_q_and_k_in_place(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """Rotate q and k ([N, H, D] each) in place: one launch over both when k's heads directly
    follow q's in one buffer (the packed qkv's views), else one launch each."""
    if _adjacent_heads(q, k):
        n, h, d = q.shape
        rotary_qk_in_place(q.as_strided((n, 2 * h, d), q.stride()), cos, sin)
    else:
        rotary_qk_in_place(q, cos, sin)
        rotary_qk_in_place(k, cos, sin)
