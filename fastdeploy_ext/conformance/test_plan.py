"""The plan honours the capability row of the probed device."""
from __future__ import annotations

import pytest

from ..capabilities import capability_table
from ..ops.kernels import kernels_for
from ..plan import ComponentKind, GraphOptimizationConfig, GridSource, PlanError, PlanRequest, QkvLayout

VISION = ComponentKind.VISION_VARLEN_ATTENTION


@pytest.fixture(scope="module")
def vision_kernels(backend_cls):
    """The backend's vision attention backends: the built-ins + those it contributes."""
    return kernels_for(backend_cls).backends(VISION)


@pytest.fixture(scope="module")
def row(backend_cls):
    row, reason = backend_cls.select_row(backend_cls.probe(), capability_table())
    assert row.runner in (backend_cls.name, getattr(backend_cls, "name", None)) or backend_cls.forced_row
    assert reason
    return row


@pytest.fixture(scope="module")
def plan(backend_cls):
    return backend_cls.create(PlanRequest(device=backend_cls.name)).plan


def test_defaults_come_from_the_row(plan, row, emulated, vision_kernels):
    assert plan.row == row.name
    assert plan.emulated == emulated
    assert plan.dtype.value == row.default_dtype
    listed = [e.backend for e in row.attention]
    assert plan.attention.value in listed
    # the chosen backend is the first listed one that can run here; skipped ones carry a reason
    skipped = listed[:listed.index(plan.attention.value)]
    for name in skipped:
        assert any(name in n for n in plan.notes), (name, plan.notes)
    entry = {e.backend: e for e in row.attention}[plan.attention.value]
    # strided exactly when the kernel reads strides and the row does not narrow that
    assert plan.strided_qkv == (vision_kernels[entry.backend].reads_strides and entry.reads_strides is not False)
    assert plan.grid_thw.value is (GridSource.HOST if row.host_grid_thw else GridSource.DEVICE)
    if not row.graphs_default or "encoder" not in row.graph_kinds:
        assert plan.graphs.value == ()
    for d in plan.decisions().values():
        assert d.reason


def test_plan_is_printed_with_reasons(plan, row):
    text = plan.describe()
    assert f"row={row.name}" in text
    for key in ("dtype", "attention", "qkv_layout", "grid_thw", "graphs", "fused_layers"):
        assert key in text
    if plan.emulated:
        assert "EMULATED" in text


def test_forcing_an_unsupported_dtype_names_the_row(backend_cls, row):
    missing = [d for d in ("float32", "bfloat16", "float16") if d not in row.dtypes]
    if not missing:
        with pytest.raises(PlanError, match=row.name):
            backend_cls.create(PlanRequest(device=backend_cls.name, attention_backend="no_such_kernel"))
        return
    with pytest.raises(PlanError, match=row.name):
        backend_cls.create(PlanRequest(device=backend_cls.name, dtype=missing[0]))


def test_forcing_an_unlisted_backend_names_the_row(backend_cls, row, vision_kernels):
    unlisted = [n for n in vision_kernels if n not in {e.backend for e in row.attention}]
    assert unlisted
    with pytest.raises(PlanError, match=row.name):
        backend_cls.create(PlanRequest(device=backend_cls.name, attention_backend=unlisted[0]))


def test_forcing_graphs_picks_a_graph_safe_kernel_or_names_the_row(backend_cls, row, vision_kernels):
    req = PlanRequest(device=backend_cls.name, graph_config=GraphOptimizationConfig(use_encoder_cudagraph=True))
    device = backend_cls.torch_device(backend_cls.probe())
    usable_safe = [e for e in row.attention
                   if vision_kernels[e.backend].graph_safe and vision_kernels[e.backend].available(device)[0]]
    if "encoder" in row.graph_kinds and usable_safe:
        plan = backend_cls.create(req).plan
        assert plan.graphs.value and plan.attention.value == usable_safe[0].backend
        return
    with pytest.raises(PlanError, match=row.name):
        backend_cls.create(req)


def test_missing_kernel_falls_back_with_a_reason(backend_cls, row, vision_kernels):
    """Resolve the same row with its first backend reported missing."""
    from ..plan import resolve_plan
    first = row.attention[0].backend
    kernels = {n: b.facts((n != first, "ok" if n != first else "not built for this device"))
               for n, b in vision_kernels.items()}
    if len(row.attention) == 1:
        with pytest.raises(PlanError, match=row.name):
            resolve_plan(row, PlanRequest(), device="x", head_dim=72, kernels=kernels)
        return
    plan = resolve_plan(row, PlanRequest(), device="x", head_dim=72, kernels=kernels)
    assert plan.attention.value != first
    assert any(first in n and "not built" in n for n in plan.notes)


def test_consumer_needing_dense_forbids_strided(row, vision_kernels):
    from ..plan import resolve_plan
    kernels = {n: b.facts((True, "ok")) for n, b in vision_kernels.items()}
    plan = resolve_plan(row, PlanRequest(), device="x", head_dim=72, kernels=kernels,
                        consumers_needing_dense=("in-place q/k norm",))
    assert plan.qkv_layout.value is QkvLayout.DENSE and "q/k norm" in plan.qkv_layout.reason
    with pytest.raises(PlanError, match=row.name):
        resolve_plan(row, PlanRequest(qkv_layout="strided"), device="x", head_dim=72, kernels=kernels,
                     consumers_needing_dense=("in-place q/k norm",))
