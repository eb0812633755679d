"""The row is earned, not assumed: on the cpu_amx backend the `cpu_amx` row (bf16 on AMX) needs
oneDNN's evidence that the encoder's own bf16 matmuls ran on AMX kernels (the probe records it),
and capping oneDNN below AMX must flip the plan to the `cpu` row with the reason. Asserts what
the CPU at hand can show: an AVX2-only or AVX-512 CPU gets `cpu` both times."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from ..plan import PlanRequest

pytestmark = pytest.mark.fdx_backend("cpu_amx")

PLAN_IN_CHILD = r"""
import json
from fastdeploy_ext.runner import get_backend_class
from fastdeploy_ext.plan import PlanRequest
cls = get_backend_class("cpu_amx")
probe = cls.probe()
plan = cls.create(PlanRequest(device="cpu_amx"), probe=probe).plan
print(json.dumps({"row": plan.row, "dtype": plan.dtype.value, "notes": plan.notes,
                  "has_amx": probe.details["has_amx"], "amx_proven": probe.details.get("amx_proven")}))
"""


def test_the_plans_row_matches_the_onednn_evidence(backend_cls):
    probe = backend_cls.probe()
    d = probe.details
    plan = backend_cls.create(PlanRequest(device=backend_cls.name), probe=probe).plan
    if not d["has_amx"]:
        assert plan.row == "cpu" and "amx_evidence" not in d
        return
    ev = d["amx_evidence"]
    assert ev is not None and d["amx_reason"]
    all_on_amx = bool(ev["problems"]) and all("amx" in impl for impl in ev["problems"].values())
    assert d["amx_proven"] == all_on_amx
    assert plan.row == ("cpu_amx" if d["amx_proven"] else "cpu")
    assert plan.dtype.value == ("bfloat16" if d["amx_proven"] else "float32")
    assert any(d["amx_reason"] in n for n in plan.notes), plan.notes


def test_capping_onednn_below_amx_flips_to_the_cpu_row():
    """The mutation: the same CPU with oneDNN capped at AVX512_CORE_BF16 (a subprocess, so this
    process's cached evidence is untouched) must lose the cpu_amx row."""
    env = dict(os.environ, ONEDNN_MAX_CPU_ISA="AVX512_CORE_BF16")
    out = subprocess.run([sys.executable, "-c", PLAN_IN_CHILD], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["row"] == "cpu" and got["dtype"] == "float32"
    note = next(n for n in got["notes"] if n.startswith("row cpu:"))
    if got["has_amx"]:
        assert got["amx_proven"] is False
        assert "oneDNN did not run the encoder's bf16 matmuls on AMX" in note
        assert "ONEDNN_MAX_CPU_ISA=AVX512_CORE_BF16" in note
    else:
        assert "has no AMX" in note
