"""What torch says about CUDA-style devices (CUDA, and MACA builds that expose their card as
``cuda``), never raising. Not a vendor's: the one helper the NVIDIA and MetaX probes share, since
both vendors' torch builds answer through torch.cuda (backends import no other backend)."""
# Probes must never raise, whatever torch throws: the blind except is the point here.
# ruff: noqa: BLE001
from __future__ import annotations

from fastdeploy_ext.platforms import error_text, import_quietly

__all__ = ["torch_cuda_view"]


def torch_cuda_view(torch_module=None) -> dict:
    """What torch says about CUDA-style devices (CUDA, and MACA builds that expose ``cuda``);
    never raises: a failure is reported under ``torch_error``."""
    view: dict = {"torch_version": None, "torch_cuda_version": None, "torch_cuda_available": False,
                  "torch_cuda_device_count": 0}
    try:
        torch = torch_module if torch_module is not None else import_quietly("torch")
    except Exception as e:
        view["torch_error"] = f"torch not importable: {error_text(e)}"
        return view
    try:
        view["torch_version"] = str(getattr(torch, "__version__", "?"))
        view["torch_cuda_version"] = getattr(getattr(torch, "version", None), "cuda", None)
        view["torch_cuda_available"] = bool(torch.cuda.is_available())
        if view["torch_cuda_available"]:
            view["torch_cuda_device_count"] = int(torch.cuda.device_count())
    except Exception as e:
        view["torch_error"] = f"torch.cuda query failed: {error_text(e)}"
    return view
