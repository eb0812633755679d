"""Backends of a mixture of experts' routed expert GEMMs (kind ``moe_experts``). The built-in is
the eager ATen path of the family that declares the kind (DeepSeek-OCR-2's text.py MoE: every
expert densely for a decode-sized batch, the k experts' weights gathered per chunk of tokens
otherwise; neither reads the device back); grouped-GEMM kernels are to come."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch


@dataclass(frozen=True)
class MoEExpertsBackend:
    name: str
    available: Callable[[torch.device], tuple[bool, str]]
    what: str                                 # how it runs the experts, for the logs


BUILTIN_MOE_BACKENDS: tuple[MoEExpertsBackend, ...] = (
    MoEExpertsBackend("aten_moe", lambda device: (True, "ATen matmuls: every device"),
                      "dense over every expert for <= 8 tokens, gathered expert weights per chunk otherwise"),
)
