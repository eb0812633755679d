"""Encoder graph capture. Replay of a padded budget equals eager on the same padded batch bit for
bit (the captured forward run without the graph on the same static buffers); against eager on
the unpadded batch it differs only by GEMM shapes, so that comparison reports max abs error and
cosine per image (bf16: cosine >= 0.9999; fp32: max abs <= 1e-4). A batch above the largest
budget falls back to eager. Rows without graph capture must say so.

Graphs run on CUDA only. Every leg still checks what padding to a budget relies on, without a
graph: an extra padding segment in the packed batch leaves the real images' features unchanged
(same tolerances). Those two need images of any grid packed together (FamilyFact.VARIABLE_GRIDS)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from ..capabilities import capability_table
from ..plan import EncoderGraphPath, GraphOptimizationConfig
from .family_fixture import FamilyFact

VARIABLE_GRIDS = pytest.mark.fdx_family_fact(FamilyFact.VARIABLE_GRIDS)


TOLERANCE = {"float32": ("max_abs", 1e-4), "bfloat16": ("cosine", 0.9999), "float16": ("cosine", 0.9999)}


def _compare(dtype: str, got: list[torch.Tensor], ref: list[torch.Tensor], what: str, record_property) -> None:
    """Per image max abs error and cosine, reported; the dtype's bound asserted."""
    assert len(got) == len(ref)
    err, cos = [], []
    for a, b in zip(got, ref):
        assert a.shape == b.shape
        a, b = a.float().cpu(), b.float().cpu()
        err.append(float((a - b).abs().max()))
        cos.append(float(F.cosine_similarity(a.flatten(), b.flatten(), dim=0)))
    record_property(f"{what}_{dtype}_max_abs_err", max(err))
    record_property(f"{what}_{dtype}_min_cosine", min(cos))
    print(f"{what} {dtype}: max abs err per image {err}, cosine {cos}")
    kind, bound = TOLERANCE[dtype]
    if kind == "max_abs":
        assert max(err) <= bound, (what, err)
    else:
        assert min(cos) >= bound, (what, cos)


def _row(backend_cls):
    return backend_cls.select_row(backend_cls.probe(), capability_table())[0]


def test_rows_without_graphs_report_none(backend_cls, make_runner, tiny_models):
    row = _row(backend_cls)
    runner = make_runner(tiny_models["torch"])
    report = runner.capture_graphs()
    if runner.plan.graphs.value:
        assert report.captured > 0
    else:
        assert report.captured == 0 and report.reason == runner.plan.graphs.reason
        assert "encoder" not in row.graph_kinds or not row.graphs_default or report.reason


def _graph_capable(backend_cls, row, device, dtype: str) -> bool:
    from ..ops.kernels import kernels_for
    from ..plan import ComponentKind
    kernels = kernels_for(backend_cls).backends(ComponentKind.VISION_VARLEN_ATTENTION)
    return "encoder" in row.graph_kinds and dtype in row.dtypes and any(
        kernels[e.backend].graph_safe and dtype in e.dtypes and kernels[e.backend].available(device)[0]
        for e in row.attention)


def _unsupported_dtype_is_a_plan_error(backend_cls, row, dtype: str) -> bool:
    """True (after checking forcing it is a PlanError naming the row) when the row lacks dtype."""
    from ..plan import PlanError, PlanRequest
    if dtype in row.dtypes:
        return False
    with pytest.raises(PlanError, match=row.name):
        backend_cls.create(PlanRequest(device=backend_cls.name, dtype=dtype))
    return True


@VARIABLE_GRIDS
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_graph_replay_equals_eager_and_falls_back_above_budget(dtype, backend_cls, make_runner, tiny_models, batch_for,
                                                                record_property):
    from ..plan import PlanError, PlanRequest
    row = _row(backend_cls)
    device = backend_cls.torch_device(backend_cls.probe())
    if not _graph_capable(backend_cls, row, device, dtype):
        # no capture kind, no such dtype, or no graph-safe kernel usable on this device in this
        # dtype: a clear plan error naming the row
        with pytest.raises(PlanError, match=row.name):
            backend_cls.create(PlanRequest(device=backend_cls.name, dtype=dtype,
                                           graph_config=GraphOptimizationConfig(use_encoder_cudagraph=True)))
        return
    paths = (EncoderGraphPath("small", min_tokens=16, max_tokens=64, max_image_tokens=48, max_segments=4),)
    gc = GraphOptimizationConfig(use_encoder_cudagraph=True, encoder_graph_paths=paths)
    graphed = make_runner(tiny_models["torch"], graph_config=gc, dtype=dtype)
    eager = make_runner(tiny_models["torch"], dtype=dtype, attention_backend=graphed.plan.attention.value)
    report = graphed.capture_graphs()
    assert report.captured == len(paths[0].budgets) == 3          # 16, 32, 64
    assert report.capture_seconds > 0

    batch = batch_for(tiny_models["torch"], 2)      # 32 + 24 patches -> padded to the 64 budget
    n = sum(t * h * w for t, h, w in batch.grid_thw)
    ref = eager.encode_images(batch)
    graphed.encode_images(batch)
    with graphed.sync_guard():
        out = graphed.encode_images(batch)
    assert graphed.graphs.stats.hits == 2 and graphed.graphs.stats.fallbacks == 0
    assert graphed.graphs.stats.per_budget == {("small", 64): 2}
    # the same padded batch, eager: the captured forward on the static buffers the replay read
    budget = graphed.graphs.graphs[("small", 64)]
    with torch.inference_mode():
        padded_eager = budget.eager(n)
    replayed = torch.cat(out)
    assert torch.equal(replayed, padded_eager), float((replayed.float() - padded_eager.float()).abs().max())
    _compare(dtype, out, ref, "graph_replay_vs_unpadded_eager", record_property)
    # 120 patches exceed the largest budget (64): the whole batch runs eager, one packed pass
    big = batch_for(tiny_models["torch"], 4)
    out = graphed.encode_images(big)
    assert graphed.graphs.stats.fallbacks == 4 and graphed.graphs.stats.hits == 2
    for a, b in zip(out, eager.encode_images(big)):
        assert torch.equal(a, b)
    # with encoder_split_oversize_batches: 32 + 24 + 4 share one replay of 64, the 60-patch image
    # (above max_image_tokens) runs eager
    graphed.graphs.split_oversize = True
    out = graphed.encode_images(big)
    assert graphed.graphs.stats.fallbacks == 5 and graphed.graphs.stats.hits == 3
    _compare(dtype, out, eager.encode_images(big), "split_replay_vs_unpadded_eager", record_property)


@VARIABLE_GRIDS
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_padding_segment_leaves_real_outputs_unchanged(dtype, backend_cls, make_runner, tiny_models, batch_for,
                                                         record_property):
    """Eager, every leg: the batch padded to the next budget (64 patches) by a zero padding image
    of its own attention segment gives the real images the features of the unpadded batch."""
    from ..runner import ImageBatch
    if _unsupported_dtype_is_a_plan_error(backend_cls, _row(backend_cls), dtype):
        return
    runner = make_runner(tiny_models["torch"], dtype=dtype)
    batch = batch_for(tiny_models["torch"], 2)
    n = sum(t * h * w for t, h, w in batch.grid_thw)
    pad = 64 - n
    assert pad > 0 and pad % 4 == 0
    padded = ImageBatch(torch.cat([batch.pixel_values, batch.pixel_values.new_zeros(pad, *batch.pixel_values.shape[1:])]),
                        list(batch.grid_thw) + [(1, 2, pad // 2)])
    ref = runner.encode_images(batch)
    got = runner.encode_images(padded)
    assert len(got) == len(ref) + 1
    _compare(dtype, got[:-1], ref, "padded_vs_unpadded_eager", record_property)


@pytest.mark.fdx_extended          # a check of the comparison itself, not of the backend
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_replay_tolerances_can_fail(dtype, backend_cls, make_runner, tiny_models, batch_for, record_property):
    """Mutation of the compared features: noise of 3% of their mean magnitude must fail the
    comparison the graph tests use (bf16 bound: cosine 0.9999; fp32: max abs 1e-4)."""
    if _unsupported_dtype_is_a_plan_error(backend_cls, _row(backend_cls), dtype):
        return
    ref = make_runner(tiny_models["torch"], dtype=dtype).encode_images(batch_for(tiny_models["torch"], 2))
    g = torch.Generator().manual_seed(0)
    noisy = [r + 0.03 * r.float().abs().mean() * torch.randn(r.shape, generator=g).to(r.device, r.dtype) for r in ref]
    with pytest.raises(AssertionError):
        _compare(dtype, noisy, ref, "mutated", record_property)
    _compare(dtype, ref, ref, "identical", record_property)
