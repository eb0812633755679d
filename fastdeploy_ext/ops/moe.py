"""Backends of a mixture of experts' routed expert GEMMs (kind ``moe_experts``).

A backend runs ``experts(x [T, H], weights [T, k] fp32, expert_ids [T, k], gate_up [E, 2I, H],
down [E, H, I], add=None) -> [T, H]``: the SwiGLU experts each token is routed to, weighted by
its routing weights as given, summed per token, plus ``add`` (the shared experts' output) where
given; and the greedy softmax router, ``route(x [T, H], gate [E, H],
k, scale) -> (weights [T, k] fp32, expert_ids [T, k])``: the logits in fp32, the k largest softmax
probabilities, descending, times the scale. The shared experts stay in the model (DeepSeek-OCR-2's
text.py MoE); the plan picks the backend per capability row.

- ``triton_moe``: the grouped-GEMM kernel (ops/triton/grouped_moe.py): the token x expert rows
  grouped by expert on the device (block-aligned, static shapes, no host sync: capturable in the
  decode graphs), one launch for gate/up with the SiLU product fused, one for down with the
  routing weights applied. Reads only the k experts' weights each token is routed to. Its router
  is one launch too (ops/triton/moe_routing.py: the fp32 GEMM, softmax, k rounds of max, the
  scale) in place of ATen's six to seven small kernels at decode sizes. CUDA.
- ``aten_moe``: eager ATen matmuls, every device (the documented fallback): every expert densely
  for a decode-sized batch (<= DENSE_EXPERT_TOKENS tokens: one einsum over all E experts'
  weights, cheaper there than gathering), otherwise each token's k experts' weights gathered and
  run as one batched matmul per chunk of GATHER_CHUNK tokens (memory bounded). Neither reads the
  device back.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

#: at most this many tokens run every expert densely (cheaper than gathering weights there)
DENSE_EXPERT_TOKENS = 8
#: tokens per chunk of the gathered path ([chunk * k, 2I, H] weights live at once)
GATHER_CHUNK = 64

ExpertsFn = Callable[..., torch.Tensor]     # (x, weights, expert_ids, gate_up, down, add=None)
RouteFn = Callable[[torch.Tensor, torch.Tensor, int, float], tuple[torch.Tensor, torch.Tensor]]


def aten_route(x: torch.Tensor, gate: torch.Tensor, k: int, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    w, idx = F.linear(x.float(), gate.float()).softmax(-1).topk(k, -1)
    return (w if scale == 1.0 else w * scale), idx       # x * 1.0 == x: no kernel for it


def triton_route(x: torch.Tensor, gate: torch.Tensor, k: int, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    from .triton.moe_routing import router_topk
    return router_topk(x, gate, k, scale)


def experts_dense(x, w, idx, gate_up, down) -> torch.Tensor:
    """Every expert on every token, weighted by the [T, E] combine matrix (zero where not routed)."""
    combine = torch.zeros(x.shape[0], gate_up.shape[0], device=x.device, dtype=torch.float32)
    combine.scatter_(1, idx, w)
    gu = torch.einsum("th,eih->eti", x, gate_up)              # [E, T, 2I]
    g, u = gu.chunk(2, -1)
    y = torch.einsum("eti,ehi->eth", F.silu(g) * u, down)     # [E, T, H]
    return (y * combine.t()[..., None].to(y.dtype)).sum(0)


def experts_gathered(x, w, idx, gate_up, down) -> torch.Tensor:
    """Each token's k experts' weights gathered, one batched matmul per chunk of tokens."""
    out = []
    k = idx.shape[1]
    for s in range(0, x.shape[0], GATHER_CHUNK):
        xs, ids, ws = x[s:s + GATHER_CHUNK], idx[s:s + GATHER_CHUNK].reshape(-1), w[s:s + GATHER_CHUNK]
        xr = xs.repeat_interleave(k, 0)[:, :, None]                 # [t*k, H, 1]
        g, u = torch.bmm(gate_up[ids], xr)[..., 0].chunk(2, -1)
        y = torch.bmm(down[ids], (F.silu(g) * u)[:, :, None])[..., 0]   # [t*k, H]
        out.append((y.view(-1, k, y.shape[-1]) * ws[..., None].to(y.dtype)).sum(1))
    return torch.cat(out)


def aten_experts(x, w, idx, gate_up, down, add=None) -> torch.Tensor:
    run = experts_dense if x.shape[0] <= DENSE_EXPERT_TOKENS else experts_gathered
    out = run(x, w, idx, gate_up, down).to(x.dtype)
    return out if add is None else out + add


def triton_experts(x, w, idx, gate_up, down, add=None) -> torch.Tensor:
    from .triton.grouped_moe import grouped_moe
    return grouped_moe(x, w, idx, gate_up, down, add=add)


def _triton_available(device: torch.device) -> tuple[bool, str]:
    from .triton.runtime import available_on
    return available_on(device)


@dataclass(frozen=True)
class MoEExpertsBackend:
    name: str
    available: Callable[[torch.device], tuple[bool, str]]
    what: str                                 # how it runs the experts, for the logs
    experts: ExpertsFn
    route: RouteFn = aten_route


BUILTIN_MOE_BACKENDS: tuple[MoEExpertsBackend, ...] = (
    MoEExpertsBackend("triton_moe", _triton_available,
                      "Triton grouped GEMMs over the rows grouped by expert on the device (gate/up + SiLU, down "
                      "+ routing weights; the router's GEMM and softmax top-k in one launch)", triton_experts, triton_route),
    MoEExpertsBackend("aten_moe", lambda device: (True, "ATen matmuls: every device"),
                      "dense over every expert for <= 8 tokens, gathered expert weights per chunk otherwise",
                      aten_experts),
)
