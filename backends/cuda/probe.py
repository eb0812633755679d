"""NVIDIA GPUs through NVML (``pynvml``, package ``nvidia-ml-py``), imported lazily.

``probe_nvidia(nvml_module=None, torch_module=None)`` calls ``nvmlInit``,
``nvmlSystemGetDriverVersion``, ``nvmlDeviceGetCount``, and per device
``nvmlDeviceGetHandleByIndex``, ``nvmlDeviceGetName`` (bytes or str),
``nvmlDeviceGetMemoryInfo(h).total``, ``nvmlDeviceGetCudaComputeCapability(h)`` -> (major, minor);
optionally ``nvmlSystemGetCudaDriverVersion`` (only if the module has it); finally
``nvmlShutdown``. ``present`` = NVML sees at least one NVIDIA GPU (MetaX's NVML shim lists its
cards under NVML too: those are left to the MetaX probe); ``usable`` = present and torch can use
CUDA. Family: ``cuda_sm<major><minor>`` (cc 9.0 -> ``cuda_sm90``). Never raises.
"""
# Probes must never raise, whatever a vendor library throws: blind excepts are the point here.
# ruff: noqa: BLE001, S110
from __future__ import annotations

from backends.torch_cuda import torch_cuda_view
from fastdeploy_ext.platforms import DeviceInfo, ProbeResult, c_text, devices_text, error_text, import_quietly

__all__ = ["cuda_family", "nvml_utilization_reader", "probe_nvidia"]


def cuda_family(cc: tuple[int, int] | None) -> str:
    return f"cuda_sm{cc[0]}{cc[1]}" if cc else "cuda"


def probe_nvidia(nvml_module=None, torch_module=None) -> ProbeResult:
    """NVIDIA GPUs through NVML. ``nvml_module``: a pynvml-like object (None: import pynvml)."""
    try:
        return _probe_nvidia(nvml_module, torch_module)
    except Exception as e:  # belt and braces: a probe never raises
        return ProbeResult("cuda", False, False, f"NVIDIA probe failed unexpectedly: {error_text(e)}")


def _probe_nvidia(nvml, torch_module) -> ProbeResult:
    if nvml is None:
        try:
            nvml = import_quietly("pynvml")
        except Exception as e:
            return ProbeResult("cuda", False, False,
                               f"pynvml not importable (pip install nvidia-ml-py): {error_text(e)}")
    try:
        nvml.nvmlInit()
    except Exception as e:
        return ProbeResult("cuda", False, False, f"NVML init failed (no NVIDIA driver?): {error_text(e)}")
    details: dict = {}
    notes: list[str] = []
    devices: list[DeviceInfo] = []
    driver = None
    try:
        try:
            driver = c_text(nvml.nvmlSystemGetDriverVersion())
        except Exception as e:
            notes.append(f"driver version unknown ({error_text(e)})")
        get_cuda_drv = getattr(nvml, "nvmlSystemGetCudaDriverVersion", None)
        if get_cuda_drv is not None:
            try:
                v = int(get_cuda_drv())
                details["cuda_driver_api_version"] = f"{v // 1000}.{(v % 1000) // 10}"
            except Exception:
                pass
        try:
            count = int(nvml.nvmlDeviceGetCount())
        except Exception as e:
            return ProbeResult("cuda", False, False, f"NVML initialised but device count failed: {error_text(e)}",
                               driver_version=driver, details=details)
        skipped = []
        for i in range(count):
            try:
                h = nvml.nvmlDeviceGetHandleByIndex(i)
                name = c_text(nvml.nvmlDeviceGetName(h))
            except Exception as e:
                notes.append(f"GPU {i} unreadable ({error_text(e)})")
                continue
            if name.lower().startswith("metax"):     # MACA's NVML shim: leave it to the metax probe
                skipped.append(name)
                continue
            try:
                mem = int(nvml.nvmlDeviceGetMemoryInfo(h).total)
            except Exception as e:
                mem = None
                notes.append(f"GPU {i} memory unknown ({error_text(e)})")
            try:
                major, minor = nvml.nvmlDeviceGetCudaComputeCapability(h)
                cc = (int(major), int(minor))
            except Exception as e:
                cc = None
                notes.append(f"GPU {i} compute capability unknown ({error_text(e)})")
            devices.append(DeviceInfo(i, name, mem, cc, cuda_family(cc)))
        if skipped:
            notes.append(f"NVML lists non-NVIDIA devices {skipped} (MetaX NVML shim): ignored here")
    finally:
        try:
            nvml.nvmlShutdown()
        except Exception:
            pass

    details["nvml_device_count"] = len(devices)
    tv = torch_cuda_view(torch_module)
    details.update(tv)
    drv = f"driver {driver}" if driver else "driver version unknown"
    note_txt = ("; " + "; ".join(notes)) if notes else ""
    if not devices:
        return ProbeResult("cuda", False, False, f"NVML initialised ({drv}) but reports no NVIDIA GPU{note_txt}",
                           driver_version=driver, details=details)
    head = f"{len(devices)} NVIDIA GPU(s): {devices_text(devices)}; {drv}"
    if tv["torch_cuda_available"]:
        usable = True
        why = f"torch {tv['torch_version']} (CUDA {tv['torch_cuda_version']}) sees {tv['torch_cuda_device_count']}"
    else:
        usable = False
        if "torch_error" in tv:
            why = f"but torch cannot use CUDA: {tv['torch_error']}"
        elif tv["torch_cuda_version"] is None:
            why = f"but torch {tv['torch_version']} cannot use CUDA (CPU-only build, torch.version.cuda=None)"
        else:
            why = (f"but torch {tv['torch_version']} (CUDA {tv['torch_cuda_version']}) cannot use CUDA "
                   "(torch.cuda.is_available() is False: driver too old for this build, or CUDA_VISIBLE_DEVICES "
                   "hides every GPU?)")
    return ProbeResult("cuda", True, usable, f"{head}; {why}{note_txt}", tuple(devices), driver, details,
                       notes=tuple(notes))


def nvml_utilization_reader(index: int, nvml_module=None):
    """A callable returning GPU ``index``'s utilization.gpu (%), or None with the reason logged
    when NVML cannot be used (benchmarks then report no busy %)."""
    import logging
    try:
        nvml = nvml_module if nvml_module is not None else import_quietly("pynvml")
        nvml.nvmlInit()
        handle = nvml.nvmlDeviceGetHandleByIndex(index)
    except Exception as e:
        logging.getLogger(__name__).info("GPU busy %%: NVML unavailable (%s)", error_text(e))
        return None
    return lambda: nvml.nvmlDeviceGetUtilizationRates(handle).gpu
