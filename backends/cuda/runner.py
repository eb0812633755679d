"""NVIDIA runner: probes through NVML, picks the row by compute capability, proves the host
path sync-free with torch.cuda.set_sync_debug_mode('error'), and captures encoder graphs."""
from __future__ import annotations

import torch

from fastdeploy_ext.platforms import probe_nvidia
from fastdeploy_ext.plan import CapabilityRow
from fastdeploy_ext.sync_guard import cuda_host_sync_guard
from fastdeploy_ext.torch_runner import TorchRunner


def cuda_memory_stats(device: torch.device) -> dict:
    free, total = torch.cuda.mem_get_info(device)
    return {"device": str(device), "allocated_bytes": torch.cuda.memory_allocated(device),
            "peak_bytes": torch.cuda.max_memory_allocated(device),
            "reserved_bytes": torch.cuda.memory_reserved(device), "free_bytes": free, "total_bytes": total,
            "kind": "torch caching allocator"}


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

    def sync_guard(self):
        """set_sync_debug_mode('error') (every synchronising CUDA call) plus the op-level guard,
        which names the op when it is one of the known ways to sync."""
        return cuda_host_sync_guard()

    def memory_stats(self) -> dict:
        return cuda_memory_stats(self.device)
