"""Intel Xeon runner. The `cpu_amx` row (bf16, so oneDNN's AMX kernels do the matmuls) needs
the AMX flags AND oneDNN's evidence that the encoder's own bf16 matmuls ran on AMX kernels
(probe.py); otherwise the `cpu` row (fp32), with the reason in the plan."""
from __future__ import annotations

import logging
import os

import torch

from fastdeploy_ext.plan import CapabilityRow, Decision
from fastdeploy_ext.torch_runner import TorchRunner

from .probe import parse_onednn_verbose, probe_cpu, probe_cpu_amx
from .threads import configure_threads

log = logging.getLogger(__name__)


class CpuAmxRunner(TorchRunner):
    name = "cpu_amx"

    @classmethod
    def probe(cls):
        return probe_cpu_amx()

    @classmethod
    def matmul_kernel_evidence(cls, run):
        """oneDNN's verbose log (both spellings of its switch, for oneDNN 2.x and 3.x)."""
        ev = parse_onednn_verbose(run({"ONEDNN_VERBOSE": "1", "DNNL_VERBOSE": "1"}))
        return {"amx_used": ev.amx_used, "kernels": ev.kernels, "isa": ev.isa, "reason": ev.reason,
                "compute_primitives": ev.compute_primitives, "amx_primitives": ev.amx_primitives}

    @classmethod
    def row_matches(cls, row: CapabilityRow, probe) -> bool:
        flags = set(probe.details.get("flags", ()))
        if not set(row.match.get("cpu_flags", ())) <= flags:
            return False
        return not row.match.get("onednn_amx") or bool(probe.details.get("amx_proven"))

    @classmethod
    def select_row(cls, probe, table):
        row, reason = super().select_row(probe, table)
        if row.name != "cpu_amx" and not cls.forced_row:
            if probe.details.get("has_amx"):
                reason = f"{probe.details.get('amx_reason', 'AMX not proven by oneDNN')}: using the cpu row"
            else:
                reason = "this CPU has no AMX (amx_tile/amx_bf16 missing): using the cpu row"
        elif row.name == "cpu_amx":
            reason += f"; {probe.details.get('amx_reason', '')}"
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
    """`--device cpu`: the cpu_amx runner pinned to the plain `cpu` row (fp32), AMX or not (so
    it needs no oneDNN evidence)."""
    name = "cpu"
    forced_row = "cpu"

    @classmethod
    def probe(cls):
        return probe_cpu()
