"""The detector's batch-size bucket graphs: the bucket and chunk arithmetic, capture and replay
through a device API whose graph re-runs the captured call into its static outputs (what a CUDA
graph does, on the CPU), padded batches giving each real page the eager outputs, the plan's
decisions per row; and on CUDA (skipped elsewhere; it runs in cuda/unit on the H200) replay ==
eager bitwise."""
from __future__ import annotations


import pytest
import torch

from fastdeploy_ext.capabilities import capability_table
from fastdeploy_ext.models.pp_doclayout_v3 import tiny as td
from fastdeploy_ext.detector_graphs import DetectorGraphs, bucket_for, plan_chunks
from fastdeploy_ext.models.pp_doclayout_v3.config import PPDocLayoutV3Config
from fastdeploy_ext.models.pp_doclayout_v3.loader import load_detector
from fastdeploy_ext.models.registry import get_family
from fastdeploy_ext.plan import (DEFAULT_DETECTOR_CAPTURE_SIZES, ComponentKind, GraphOptimizationConfig, PlanError,
                                 PlanRequest, resolve_for_components)

from .graph_fakes import HostGraphAPI

BUCKETS = (1, 2, 4)
OUTPUTS = ("logits", "pred_boxes", "order_logits", "enc_outputs_class", "enc_outputs_coord_logits")


def test_buckets_and_chunks():
    assert [bucket_for(n, DEFAULT_DETECTOR_CAPTURE_SIZES) for n in (1, 3, 5, 8, 9, 32, 33)] == [1, 4, 8, 8, 16, 32,
                                                                                                 None]
    assert plan_chunks(3, BUCKETS) == [(0, 3, 4)]
    assert plan_chunks(4, BUCKETS) == [(0, 4, 4)]
    assert plan_chunks(9, BUCKETS) == [(0, 4, 4), (4, 4, 4), (8, 1, 1)]
    assert plan_chunks(70, DEFAULT_DETECTOR_CAPTURE_SIZES) == [(0, 32, 32), (32, 32, 32), (64, 6, 8)]
    with pytest.raises(ValueError, match="at least one page"):
        plan_chunks(0, BUCKETS)
    with pytest.raises(ValueError, match="positive batch sizes"):
        plan_chunks(2, (0, 2))


@pytest.fixture(scope="module")
def tiny_model():
    cfg = PPDocLayoutV3Config.from_dict(dict(td.TINY) | {"backbone_config": td.BACKBONE, "num_queries": 20})
    model, _ = load_detector(None, dtype=torch.float32, device=torch.device("cpu"), cfg=cfg)
    return model


def _graphs(model):
    runner = type("R", (), {})()
    runner.device_api, runner.detector, runner.device, runner.dtype = (HostGraphAPI(torch.device("cpu")), model,
                                                                       torch.device("cpu"), torch.float32)
    g = DetectorGraphs(runner, BUCKETS, (td.IMAGE, td.IMAGE))
    report = g.capture()
    assert report.captured == 3 and report.paths == {"detector": [1, 2, 4]}
    return g


def test_a_padded_replay_gives_every_real_page_its_eager_outputs(tiny_model):
    g = _graphs(tiny_model)
    pixels = torch.rand(7, 3, td.IMAGE, td.IMAGE, generator=torch.Generator().manual_seed(2))
    with torch.inference_mode():
        got = g.run(pixels)                    # chunks: 4, then 3 padded to 4
        want = tiny_model(pixels)
        padded = g.graphs[4].eager()           # the last replay's buffer: 3 pages + a zero page
    assert g.stats.per_bucket == {4: 2} and g.stats.padded_pages == 1 and g.stats.real_pages == 7
    assert torch.equal(g.graphs[4].pixels[3], torch.zeros_like(pixels[0]))
    for k in OUTPUTS:
        assert getattr(got, k).shape[0] == 7, k
        a, b = getattr(got, k), getattr(want, k)
        fin = torch.isfinite(b)
        assert (a[fin] - b[fin]).abs().max().item() <= 1e-5, k
        assert torch.equal(getattr(got, k)[4:], getattr(padded, k)[:3]), k
    assert got.out_masks is None
    with pytest.raises(ValueError, match=r"captured for \[B, 3, 128, 128\]"):
        g.run(torch.zeros(1, 3, 64, 64))


def test_the_runner_replays_when_graphs_are_captured(tiny_model, monkeypatch):
    """detect_uploaded routes through the graphs once captured (and not for another input size)."""
    from fastdeploy_ext.runner import get_backend_class
    runner = get_backend_class("cpu").create(PlanRequest(device="cpu", dtype="float32"))
    runner.load_detector(None, load_format="dummy")
    assert runner.capture_detector_graphs().captured == 0      # the cpu row: off, with the reason
    runner.detector = tiny_model
    runner.detector_graphs = _graphs(tiny_model)
    with torch.inference_mode():
        runner.detect_uploaded(torch.rand(3, 3, td.IMAGE, td.IMAGE))
        runner.detect_uploaded(torch.rand(1, 3, 96, 96))
    assert runner.detector_graphs.stats.replays == 1
    assert "replaying buckets [1, 2, 4]" in runner.describe()


def _plan(row_name, **req):
    family = get_family("pp_doclayout_v3")
    comps = family.components(family.default_config())
    dense = {"sdpa": (True, "ok"), "sdpa_flash": (True, "ok")}
    return resolve_for_components(capability_table()[row_name], PlanRequest(**req), comps, device="cuda:0",
                                  kernels={}, text_available={}, dense_available=dense)


def test_the_plan_decides_graphs_attention_and_masks_per_row():
    p = _plan("cuda_sm90")
    assert p.detector_graphs.value == DEFAULT_DETECTOR_CAPTURE_SIZES and "on by default" in p.detector_graphs.reason
    assert p.dtype.value == "bfloat16" and p.kernel(ComponentKind.DENSE_ATTENTION).value == "sdpa_flash"
    p32 = _plan("cuda_sm90", dtype="float32")
    assert p32.kernel(ComponentKind.DENSE_ATTENTION).value == "sdpa"
    assert "skipped sdpa_flash: dtype float32" in p32.dense_attention.reason
    off = _plan("cuda_sm90", graph_config=GraphOptimizationConfig(use_detector_cudagraph=False))
    assert off.detector_graphs == type(off.detector_graphs)((), "off: use_detector_cudagraph=false")
    for row in ("cuda", "metax_c500", "cpu", "cpu_amx"):
        p = _plan(row)
        assert p.detector_graphs.value == () and p.detector_graphs.reason.startswith("off: row "), row
        with pytest.raises(PlanError, match=f"row {row} supports no detector graph capture"):
            _plan(row, graph_config=GraphOptimizationConfig(use_detector_cudagraph=True))
    assert _plan("cpu").detector_masks.value is False
    assert _plan("cpu", detector_masks=True).detector_masks.reason == "requested"
    sizes = GraphOptimizationConfig.from_json('{"detector_capture_sizes": [4, 1, 2]}').detector_capture_sizes
    assert sizes == (1, 2, 4)
    with pytest.raises(ValueError, match="detector_capture_sizes must be a non-empty list"):
        GraphOptimizationConfig.from_json('{"detector_capture_sizes": []}')
    from fastdeploy_ext.ops.attention.varlen import ATTENTION_BACKENDS
    vlm, cpu = get_family("paddleocr_vl"), torch.device("cpu")
    plan = resolve_for_components(capability_table()["cpu"], PlanRequest(), vlm.components(vlm.default_config()),
                                  device="cpu", kernels={n: b.facts(b.available(cpu)) for n, b in
                                                         ATTENTION_BACKENDS.items()},
                                  text_available={"sdpa_paged": (True, "ok")})
    assert plan.detector_graphs.reason == "the model is no detector" and not plan.is_detector


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA device (cuda/unit on the H200)")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_cuda_graph_replay_equals_eager_bitwise(dtype):
    from fastdeploy_ext.conformance.references import Manifest
    from fastdeploy_ext.models.registry import detect_family
    from fastdeploy_ext.runner import get_backend_class
    path = str(Manifest.load().path("tiny_detector"))
    # the first plan is resolved for the checkpoint's detector family: forcing detector graphs on
    # a VLM's plan is a PlanError
    runner = get_backend_class("cuda").create(PlanRequest(
        device="cuda", dtype=dtype, model_family=detect_family(path).family.name,
        graph_config=GraphOptimizationConfig(use_detector_cudagraph=True, detector_capture_sizes=BUCKETS)))
    runner.load_detector(path)
    assert runner.capture_detector_graphs().captured == 3
    pixels = torch.rand(3, 3, td.IMAGE, td.IMAGE, device="cuda").to(runner.dtype)
    with torch.inference_mode():
        replayed = runner.detect_uploaded(pixels)
        eager = runner.detector_graphs.graphs[4].eager()
    for k in OUTPUTS:
        assert torch.equal(getattr(replayed, k), getattr(eager, k)[:3]), k
