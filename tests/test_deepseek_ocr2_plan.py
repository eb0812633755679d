"""DeepSeek-OCR-2's plan: a kernel kind per component of its vision tower and MoE (SAM's windowed
and global attention with the decomposed rel-pos bias, the Qwen2 encoder's prefix-causal
attention, the routed experts), resolved on every shipped capability row to the ATen backends,
with SAM's qkv layout strided only where the chosen kernel reads strides and the row does not
narrow that (MetaX); `info --model-family deepseek_ocr2` prints the decisions."""
from __future__ import annotations

import dataclasses
import subprocess
import sys

import pytest

from fastdeploy_ext.capabilities import capability_table
from fastdeploy_ext.models.registry import get_family
from fastdeploy_ext.ops.kernels import builtin_kernels
from fastdeploy_ext.plan import (BUILTIN_TOWER, TOWER_KINDS, ComponentKind, PlanError, PlanRequest, QkvLayout,
                                 resolve_for_components)

FAMILY = get_family("deepseek_ocr2")
COMPONENTS = FAMILY.components(FAMILY.default_config())
ATEN = {ComponentKind.RELPOS_WINDOW_ATTENTION: "sdpa_bias", ComponentKind.RELPOS_GLOBAL_ATTENTION: "sdpa_bias",
        ComponentKind.PREFIX_CAUSAL_ATTENTION: "sdpa_mask", ComponentKind.MOE_EXPERTS: "aten_moe"}
ROWS = capability_table(override="")
PAGED = {"triton_paged": (False, "test: not here"), "sdpa_paged": (True, "ok")}


def plan_on(row_name: str, **request):
    return resolve_for_components(ROWS[row_name], PlanRequest(**request), COMPONENTS,
                                  device="cuda:0" if row_name.startswith("cuda") else "cpu", kernels={},
                                  text_available=PAGED)


def test_the_family_declares_one_component_per_tower_kind():
    kinds = {c.kind: c for c in COMPONENTS}
    assert set(TOWER_KINDS) <= set(kinds) and ComponentKind.PAGED_DECODER_ATTENTION in kinds
    sam, enc = kinds[ComponentKind.RELPOS_WINDOW_ATTENTION], kinds[ComponentKind.PREFIX_CAUSAL_ATTENTION]
    assert (sam.num_heads, sam.head_dim) == (12, 64)
    assert (enc.num_heads, enc.num_kv_heads, enc.head_dim) == (14, 2, 64)
    assert "64 experts of width 896, top-6" in kinds[ComponentKind.MOE_EXPERTS].detail


def test_builtin_table_matches_the_kernel_registry():
    """plan/tower_kinds.py's static table says what the registry's backend objects say on a CPU
    (names, presence, strided reads)."""
    import torch
    got = builtin_kernels().tower_availability(torch.device("cpu"))
    assert {k: {n: v[:2] for n, v in d.items()} for k, d in got.items()} == {
        k: {n: v[:2] for n, v in d.items()} for k, d in BUILTIN_TOWER.items()}


@pytest.mark.parametrize("row_name", sorted(ROWS))
def test_every_row_resolves_the_tower_kinds_to_aten(row_name):
    plan = plan_on(row_name)
    for kind, backend in ATEN.items():
        d = plan.kernel(kind)
        assert d.value == backend and f"row {row_name}" in d.reason
    assert plan.attention.value is None                       # no varlen kernel takes a bias or a prefix mask
    if row_name.startswith("metax"):
        assert plan.qkv_layout.value is QkvLayout.DENSE and "not verified on row metax" in plan.qkv_layout.reason
    else:
        assert plan.qkv_layout.value is QkvLayout.STRIDED
        assert "sdpa_bias reads strided q/k/v (ATen SDPA" in plan.qkv_layout.reason
    described = plan.describe()
    for kind, backend in ATEN.items():
        assert any(line.split()[:3] == [plan.KERNEL_FIELD[kind], "=", backend] for line in described.splitlines())
    assert "component text.moe.experts  moe_experts: 64 experts of width 896" in described


def test_strided_forced_where_the_row_narrows_it_is_a_plan_error():
    with pytest.raises(PlanError, match="strided qkv impossible: sdpa_bias's strided loads are not verified"):
        plan_on("metax_c500", qkv_layout="strided")
    assert plan_on("cpu", qkv_layout="dense").qkv_layout.value is QkvLayout.DENSE


def test_a_backend_that_reads_no_strides_gets_dense_qkv():
    tower = {k: dict(v) for k, v in BUILTIN_TOWER.items()}
    tower[ComponentKind.RELPOS_WINDOW_ATTENTION]["sdpa_bias"] = (True, False, "test: copies")
    plan = resolve_for_components(ROWS["cpu"], PlanRequest(), COMPONENTS, device="cpu", kernels={},
                                  text_available=PAGED, tower_available=tower)
    assert plan.qkv_layout.value is QkvLayout.DENSE and "does not read strided" in plan.qkv_layout.reason


def test_a_row_without_a_tower_kind_is_a_plan_error_naming_it():
    row = ROWS["cpu"]
    row = dataclasses.replace(row, kernels=tuple((k, e) for k, e in row.kernels if k is not ComponentKind.MOE_EXPERTS))
    with pytest.raises(PlanError, match="row cpu lists no backend for kernel kind moe_experts .*text.moe.experts"):
        resolve_for_components(row, PlanRequest(), COMPONENTS, device="cpu", kernels={}, text_available=PAGED)


def test_an_unavailable_backend_is_skipped_with_its_reason():
    tower = {k: dict(v) for k, v in BUILTIN_TOWER.items()}
    tower[ComponentKind.MOE_EXPERTS]["aten_moe"] = (False, False, "test: broken")
    with pytest.raises(PlanError, match="no MoE experts backend can run here .*aten_moe: kernel unavailable: test: broken"):
        resolve_for_components(ROWS["cpu"], PlanRequest(), COMPONENTS, device="cpu", kernels={},
                               text_available=PAGED, tower_available=tower)


def test_info_prints_the_tower_decisions():
    out = subprocess.run([sys.executable, "-m", "fastdeploy_ext.entrypoints.cli", "info", "--model-family",
                          "deepseek_ocr2", "--device", "cpu"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    for line in ("relpos_window_attention = sdpa_bias", "relpos_global_attention = sdpa_bias",
                 "prefix_causal_attention = sdpa_mask", "moe_experts             = aten_moe",
                 "qkv_layout              = strided",
                 "component vision.sam.window_attention relpos_window_attention: 12 heads of 64 -> sdpa_bias"):
        assert line in out.stdout, out.stdout


def test_the_first_plan_is_resolved_for_the_requested_family():
    # before load_model the runner's plan is judged on a family's built-in config: the request's
    # family, so a graph or kernel request in DeepSeek-OCR-2's form is not judged by PaddleOCR-VL's
    from fastdeploy_ext.entrypoints.args import plan_request_from_args
    from fastdeploy_ext.entrypoints.cli import build_parser
    from fastdeploy_ext.runner import get_backend_class
    cls = get_backend_class("cpu")
    default = cls.create(PlanRequest(device="cpu")).plan
    assert default.relpos_window_attention.value is None and default.attention.value is not None
    plan = cls.create(PlanRequest(device="cpu", model_family="deepseek_ocr2")).plan
    assert plan.relpos_window_attention.value == "sdpa_bias" and plan.attention.value is None
    ns = build_parser().parse_args(["encode", "--load-format", "dummy", "--model-family", "deepseek_ocr2",
                                    "--image", "x.png", "--output", "y"])
    assert plan_request_from_args(ns).model_family == "deepseek_ocr2"
