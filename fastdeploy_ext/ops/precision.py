"""What an fp32 plan means on a device whose libraries trade precision by default: cuDNN runs
fp32 convolutions in TF32 unless told not to (torch's default), which a detector's conv backbone
would feel (errors ~1e-3 instead of ~1e-6 against an fp32 reference). An fp32 plan asks for
fp32."""
from __future__ import annotations

import contextlib

import torch


def fp32_convolutions(device: torch.device, dtype: torch.dtype) -> contextlib.AbstractContextManager:
    """Context running convolutions in full fp32 where the plan's dtype is float32 on CUDA (no
    TF32); a no-op elsewhere and for other dtypes."""
    if dtype is torch.float32 and device.type == "cuda":
        return torch.backends.cudnn.flags(enabled=torch.backends.cudnn.enabled,
                                          benchmark=torch.backends.cudnn.benchmark,
                                          deterministic=torch.backends.cudnn.deterministic, allow_tf32=False)
    return contextlib.nullcontext()
