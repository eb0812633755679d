"""Intra-op thread count for the CPU rows: one thread per physical core this process may run on.

Hyperthread siblings share a core's AMX tile unit and its L1/L2; two GEMM threads on one core
contend rather than add throughput, so the count is the number of distinct (package, core)
pairs among the CPUs in our affinity mask (Linux sysfs topology). An explicit OMP_NUM_THREADS
(or a torch.set_num_threads made before) is respected. Pinning the threads to those cores needs
the OpenMP runtime's own settings before torch is imported (OMP_PLACES=cores OMP_PROC_BIND=close):
a running process cannot re-pin an existing pool. That also binds the main Python thread, and
every thread it starts later (e.g. a PreprocessPool), to one core, so it suits a process that
only runs the encoder; ci/gpu_leg.sh's amx step measures both (AMX_PIN).
"""
from __future__ import annotations

import logging
import os
from pathlib import Path

import torch

log = logging.getLogger(__name__)
_SYS_CPU = Path("/sys/devices/system/cpu")


def usable_cpus() -> tuple[set[int], str]:
    """The CPUs this process may use. With OMP_PROC_BIND set, the OpenMP runtime has already bound
    the main thread to its first place (one core), so the main thread's affinity mask says
    nothing about the process: then all online CPUs count (measured on the H200 host: reading
    the mask there gave 1 thread and a 9x slower encoder)."""
    if os.environ.get("OMP_PROC_BIND", "").lower() not in ("", "false"):
        return set(range(os.cpu_count() or 1)), "online CPUs (OMP_PROC_BIND bound the main thread)"
    try:
        return set(os.sched_getaffinity(0)), "CPUs in the affinity mask"
    except (AttributeError, OSError):
        return set(range(os.cpu_count() or 1)), "online CPUs"


def physical_cores(cpus: set[int] | None = None, sys_cpu: Path = _SYS_CPU) -> tuple[int, str]:
    """(number of physical cores among ``cpus`` (default: usable_cpus()), how it was found)."""
    where = "CPUs"
    if cpus is None:
        cpus, where = usable_cpus()
    cores = set()
    for c in cpus:
        topo = sys_cpu / f"cpu{c}" / "topology"
        try:
            cores.add((int((topo / "physical_package_id").read_text()), int((topo / "core_id").read_text())))
        except (OSError, ValueError):
            return len(cpus), f"{len(cpus)} {where} (no sysfs topology: siblings unknown)"
    return len(cores), f"{len(cores)} physical cores among the {len(cpus)} {where}"


def configure_threads() -> tuple[int, str]:
    """Set torch's intra-op threads to the physical core count unless the user chose; (threads, why)."""
    if os.environ.get("OMP_NUM_THREADS"):
        n = torch.get_num_threads()
        return n, f"OMP_NUM_THREADS={os.environ['OMP_NUM_THREADS']} set by the user"
    n, why = physical_cores()
    if torch.get_num_threads() != n:
        torch.set_num_threads(n)
    return n, f"one per physical core: {why}"
