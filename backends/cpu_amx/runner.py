"""Intel Xeon runner. With AMX (amx_tile + amx_bf16) it runs bf16 so oneDNN's AMX kernels do
the matmuls; `info` shows oneDNN's verbose evidence that they ran. Without AMX it says so and
uses the `cpu` row (fp32)."""
from __future__ import annotations

import logging
import os

import torch

from fastdeploy_ext.platforms import probe_cpu
from fastdeploy_ext.plan import CapabilityRow, Decision
from fastdeploy_ext.torch_runner import TorchRunner

from .threads import configure_threads

log = logging.getLogger(__name__)


class CpuAmxRunner(TorchRunner):
    name = "cpu_amx"

    @classmethod
    def probe(cls):
        return probe_cpu()

    @classmethod
    def row_matches(cls, row: CapabilityRow, probe) -> bool:
        flags = set(probe.details.get("flags", ()))
        return set(row.match.get("cpu_flags", ())) <= flags

    @classmethod
    def select_row(cls, probe, table):
        row, reason = super().select_row(probe, table)
        if row.name != "cpu_amx" and not cls.forced_row:
            reason = "this CPU has no AMX (amx_tile/amx_bf16 missing): using the cpu row"
        return row, reason

    @classmethod
    def torch_device(cls, probe) -> torch.device:
        return torch.device("cpu")

    @classmethod
    def create(cls, request, probe=None, table=None):
        runner = super().create(request, probe=probe, table=table)
        n, why = configure_threads()
        runner.threads = Decision(n, why)
        log.info("cpu threads: %d (%s); pinning: OMP_PLACES=%s OMP_PROC_BIND=%s", n, why,
                 os.environ.get("OMP_PLACES", "unset"), os.environ.get("OMP_PROC_BIND", "unset"))
        return runner


class CpuRunner(CpuAmxRunner):
    """`--device cpu`: the cpu_amx runner pinned to the plain `cpu` row (fp32), AMX or not."""
    name = "cpu"
    forced_row = "cpu"
