"""The backend registry: built-ins come from entry points, a vendor's runner plugs in the same
way (here through register_backend, the in-process equivalent) without touching the framework."""
from __future__ import annotations

import pytest
import torch

from backends.cpu_amx import CpuAmxRunner
from fastdeploy_ext.plan import PlanRequest
from fastdeploy_ext.runner import ImageBatch, available_backends, create_runner, get_backend_class, register_backend


def test_builtins_are_registered_by_entry_point():
    from importlib.metadata import entry_points
    names = {ep.name for ep in entry_points(group="fastdeploy_ext.backends")}
    assert {"cuda", "metax", "cpu_amx", "cpu"} <= names
    assert get_backend_class("cpu_amx") is CpuAmxRunner


def test_unknown_device_lists_what_is_registered():
    with pytest.raises(ValueError, match="registered: .*cpu_amx"):
        get_backend_class("tpu9000")


def test_a_vendor_runner_plugs_in_without_framework_changes():
    class VendorRunner(CpuAmxRunner):      # a vendor's runner: its own probe/row hooks
        name = "myvendor"
        forced_row = "cpu"

    register_backend("myvendor", VendorRunner)
    assert "myvendor" in available_backends()
    runner = create_runner(PlanRequest(device="myvendor", dtype="float32"))
    assert isinstance(runner, VendorRunner) and runner.plan.row == "cpu"
    runner.load_model(None, load_format="dummy")
    assert runner.load_report.layout == "random"
    stats = runner.memory_stats()
    assert stats["peak_bytes"] > 0 and stats["device"] == "cpu"
    feats = runner.encode_images(ImageBatch(torch.randn(16, 3, 14, 14), [(1, 4, 4)]))
    assert feats[0].shape == (4, 1024) and torch.isfinite(feats[0]).all()
    assert "runner: myvendor" in runner.describe() and "dummy" in runner.describe()
