"""backends/cpu_amx/threads.py: physical core counting from a fake sysfs topology."""
from __future__ import annotations

import torch

from backends.cpu_amx.threads import configure_threads, physical_cores


def _fake_sysfs(tmp_path, layout):
    for cpu, (pkg, core) in layout.items():
        t = tmp_path / f"cpu{cpu}" / "topology"
        t.mkdir(parents=True)
        (t / "physical_package_id").write_text(f"{pkg}\n")
        (t / "core_id").write_text(f"{core}\n")
    return tmp_path


def test_hyperthread_siblings_count_once(tmp_path):
    # 2 packages x 2 cores x 2 threads
    layout = {i: (i // 4, (i // 2) % 2) for i in range(8)}
    sysfs = _fake_sysfs(tmp_path, layout)
    n, why = physical_cores(set(range(8)), sysfs)
    assert n == 4 and "4 physical cores among the 8 CPUs" in why
    assert physical_cores({0, 1}, sysfs)[0] == 1           # one core's two siblings
    assert physical_cores({0, 2, 4, 6}, sysfs)[0] == 4


def test_missing_topology_falls_back_to_cpu_count(tmp_path):
    n, why = physical_cores({0, 1, 2}, tmp_path)
    assert n == 3 and "siblings unknown" in why


def test_user_thread_setting_is_respected(monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    n0 = torch.get_num_threads()
    n, why = configure_threads()
    assert n == n0 and "set by the user" in why and torch.get_num_threads() == n0


def test_omp_proc_bind_means_the_main_thread_mask_is_not_the_process(monkeypatch):
    """Mutation-style guard for the H200 finding: under OMP_PROC_BIND the main thread's mask is
    one core; the count must come from the online CPUs instead."""
    import os

    from backends.cpu_amx import threads
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0})
    monkeypatch.setattr(os, "cpu_count", lambda: 16)
    monkeypatch.setenv("OMP_PROC_BIND", "close")
    cpus, why = threads.usable_cpus()
    assert cpus == set(range(16)) and "OMP_PROC_BIND" in why
    monkeypatch.delenv("OMP_PROC_BIND")
    assert threads.usable_cpus()[0] == {0}
