"""PaddleOCR-VL's plan on every shipped capability row is pinned: the resolved plans (several
device situations x requests) must equal tests/data/plan_snapshot.json, written from the plan
code before it was reorganised per component kind. A deliberate plan change rewrites it:
``PYTHONPATH=$PWD python3 tests/test_plan_snapshot.py --write``."""
from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

import pytest

SNAPSHOT = Path(__file__).resolve().parent / "data" / "plan_snapshot.json"

# (name, request kwargs); graph_config given as --graph-optimization-config JSON
REQUESTS = (
    ("default", {}),
    ("encoder_graphs", {"graph_config": '{"use_encoder_cudagraph": true}'}),
    ("decoder_graphs", {"graph_config": '{"use_cudagraph": true}'}),
    ("no_graphs", {"graph_config": '{"use_encoder_cudagraph": false, "use_cudagraph": false}'}),
    ("float32", {"dtype": "float32"}),
    ("dense_device_grid", {"qkv_layout": "dense", "grid_thw": "device"}),
    ("strided", {"qkv_layout": "strided"}),
    ("fused_on", {"fused_layers": "on"}),
    ("fused_off", {"fused_layers": "off"}),
    ("forced_sdpa", {"attention_backend": "sdpa", "text_attention_backend": "sdpa_paged"}),
)


def _situations():
    """Kernel facts + paged availability: a CUDA machine without fa3, with fa3, without Triton,
    and this CPU."""
    import torch

    from fastdeploy_ext.ops.attention.varlen import ATTENTION_BACKENDS
    from tests.plan_facts import ALL_PRESENT, WITH_FA3, absent
    cpu = torch.device("cpu")
    cpu_facts = {n: b.facts(b.available(cpu)) for n, b in ATTENTION_BACKENDS.items()}
    all_paged = {"triton_paged": (True, "ok"), "sdpa_paged": (True, "ok")}
    no_triton = {"triton_paged": (False, "triton not importable"), "sdpa_paged": (True, "ok")}
    return {
        "cuda": ("cuda:0", ALL_PRESENT, all_paged),
        "cuda_fa3": ("cuda:0", WITH_FA3, all_paged),
        "cuda_no_triton": ("cuda:0", absent("triton not importable", "triton_varlen", "triton_rope_varlen"),
                           no_triton),
        "cpu": ("cpu", cpu_facts, {"triton_paged": (False, "needs CUDA"), "sdpa_paged": (True, "ok")}),
    }


def current_plans() -> dict:
    from fastdeploy_ext.capabilities import capability_table
    from fastdeploy_ext.models.registry import get_family
    from fastdeploy_ext.plan import GraphOptimizationConfig, PlanError, PlanRequest, resolve_for_components
    family = get_family("paddleocr_vl")
    components = family.components(family.default_config())
    out = {}
    for row_name, row in capability_table(override="").items():
        for sit, (device, kernels, paged) in _situations().items():
            for req_name, kw in REQUESTS:
                kw = dict(kw)
                if "graph_config" in kw:
                    kw["graph_config"] = GraphOptimizationConfig.from_json(kw["graph_config"])
                try:
                    plan = resolve_for_components(row, PlanRequest(**kw), components, device=device,
                                                  kernels=kernels, text_available=paged)
                    got = json.loads(json.dumps(dataclasses.asdict(plan) | plan.to_dict(), default=str))
                    got.pop("components", None)        # the model's facts, not a decision
                    got.pop("component_kernels", None)     # derived from the decisions above
                    got["notes"] = sorted(got["notes"])    # remarks, in no meaningful order
                except PlanError as e:
                    got = {"error": str(e)}
                out[f"{row_name}/{sit}/{req_name}"] = got
    return out


def test_paddleocr_vl_plans_are_unchanged_on_every_shipped_row():
    want = {k: v | ({"notes": sorted(v["notes"])} if "notes" in v else {})
            for k, v in json.loads(SNAPSHOT.read_text()).items()}
    got = current_plans()
    assert sorted(got) == sorted(want)
    diff = [k for k in want if got[k] != want[k]]
    assert not diff, {k: (want[k], got[k]) for k in diff[:3]}


def test_the_snapshot_sees_a_changed_decision(monkeypatch):
    """The comparison can fail: a row whose default dtype changes shows up."""
    from fastdeploy_ext import capabilities
    real = capabilities.capability_table

    def changed(*a, **kw):
        t = real(*a, **kw)
        return {**t, "cpu": dataclasses.replace(t["cpu"], default_dtype="bfloat16")}
    monkeypatch.setattr(capabilities, "capability_table", changed)
    want = json.loads(SNAPSHOT.read_text())
    got = current_plans()
    assert got["cpu/cpu/default"] != want["cpu/cpu/default"]


if __name__ == "__main__":
    if sys.argv[1:] == ["--write"]:
        plans = current_plans()     # one situation per line: a changed decision is a one-line diff
        SNAPSHOT.write_text("{\n" + ",\n".join(f"{json.dumps(k)}: {json.dumps(plans[k], sort_keys=True)}"
                                                for k in sorted(plans)) + "\n}\n")
        print(f"wrote {SNAPSHOT}")
    else:
        sys.exit(pytest.main([__file__, "-q"]))
