"""Host -> device copies on the step paths: never a sync.

A CUDA copy from pageable memory blocks the host until it is staged; from pinned memory it is
queued on the stream and the host goes on. Which it is, is the device API's
(``DeviceAPI.stage_and_upload``, device_api.py): pinned + non-blocking where the backend
registered one that needs it, a plain copy on the CPU and the ``meta`` twin the sync proofs run on.
"""
from __future__ import annotations

import torch

from .device_api import device_api_for


def upload(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``t`` (a host tensor) on ``device``, queued without blocking the host where the device can."""
    return device_api_for(device).stage_and_upload(t)
