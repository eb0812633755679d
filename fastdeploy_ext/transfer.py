"""Host -> device copies on the step paths: never a sync.

A CUDA copy from pageable memory blocks the host until it is staged; from pinned memory it is
queued on the stream and the host goes on. Other devices (the CPU, the `meta` twin the sync
proofs run on) take a plain copy.
"""
from __future__ import annotations

import torch


def upload(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``t`` (a host tensor) on ``device``, queued without blocking the host on CUDA."""
    if device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)
