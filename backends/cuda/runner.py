"""NVIDIA runner: probes through NVML (probe.py), picks the row by compute capability. What the
framework asks of the device (memory, pinned staging, graphs, profiling, the CUDA-style sync
guard: torch.cuda.set_sync_debug_mode('error') + the op-level guard) is device_api.py's
CudaDeviceAPI, registered for torch's ``cuda`` device type when this module is imported."""
from __future__ import annotations

import torch

from fastdeploy_ext.plan import CapabilityRow
from fastdeploy_ext.torch_runner import TorchRunner

from . import device_api  # noqa: F401 - registers the CUDA device API
from .probe import nvml_utilization_reader, probe_nvidia


class CudaRunner(TorchRunner):
    name = "cuda"

    @classmethod
    def probe(cls):
        return probe_nvidia()

    @classmethod
    def row_matches(cls, row: CapabilityRow, probe) -> bool:
        cc = probe.devices[0].compute_capability if probe.devices else None
        need = tuple(row.match.get("min_compute_capability", (0, 0)))
        return cc is not None and tuple(cc) >= need

    @classmethod
    def torch_device(cls, probe) -> torch.device:
        if not torch.cuda.is_available():
            raise RuntimeError(f"cuda: NVML sees {len(probe.devices)} GPU(s) but this torch build cannot use CUDA "
                               f"(torch {torch.__version__}, torch.version.cuda={torch.version.cuda})")
        return torch.device("cuda", 0)

    def utilization_reader(self):
        return nvml_utilization_reader(self.device.index or 0)
