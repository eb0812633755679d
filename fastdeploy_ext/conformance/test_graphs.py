"""Encoder graph capture: replay (padded to a budget) equals eager on the unpadded batch, and a
batch above the largest budget falls back to eager. Rows without graph capture must say so."""
from __future__ import annotations

import pytest
import torch

from ..capabilities import capability_table
from ..plan import EncoderGraphPath, GraphOptimizationConfig


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


def _graph_capable(row, device) -> bool:
    from ..ops.attention import ATTENTION_BACKENDS
    return "encoder" in row.graph_kinds and any(
        e.graph_safe and ATTENTION_BACKENDS[e.backend].available(device)[0] for e in row.attention)


def test_graph_replay_equals_eager_and_falls_back_above_budget(backend_cls, make_runner, tiny_models, batch_for):
    from ..plan import PlanError, PlanRequest
    row = _row(backend_cls)
    device = backend_cls.torch_device(backend_cls.probe())
    if not _graph_capable(row, device):
        # no capture kind, or no graph-safe kernel usable on this device: a clear plan error
        with pytest.raises(PlanError, match=row.name):
            backend_cls.create(PlanRequest(device=backend_cls.name,
                                           graph_config=GraphOptimizationConfig(use_encoder_cudagraph=True)))
        return
    dtype = "bfloat16" if "bfloat16" in row.dtypes else row.default_dtype
    paths = (EncoderGraphPath("small", min_tokens=16, max_tokens=64, max_image_tokens=48, max_segments=4),)
    gc = GraphOptimizationConfig(use_encoder_cudagraph=True, encoder_graph_paths=paths)
    graphed = make_runner(tiny_models["torch"], graph_config=gc, dtype=dtype)
    eager = make_runner(tiny_models["torch"], dtype=dtype, attention_backend=graphed.plan.attention.value)
    report = graphed.capture_graphs()
    assert report.captured == len(paths[0].budgets) == 3          # 16, 32, 64
    assert report.capture_seconds > 0

    def close(a, b):
        assert a.shape == b.shape
        rel = float((a.float() - b.float()).abs().max() / b.float().abs().max())
        assert rel <= 1e-2, rel

    batch = batch_for(tiny_models["torch"], 2)      # 32 + 24 patches -> padded to the 64 budget
    ref = eager.encode_images(batch)
    graphed.encode_images(batch)
    with graphed.sync_guard():
        out = graphed.encode_images(batch)
    assert graphed.graphs.stats.hits == 2 and graphed.graphs.stats.fallbacks == 0
    assert graphed.graphs.stats.per_budget == {("small", 64): 2}
    for a, b in zip(out, ref):
        close(a, b)
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
    for a, b in zip(out, eager.encode_images(big)):
        close(a, b)
