"""The layout detector families on the backend under test (``--fdx-detector-family``, a comma
list, each a parameter; default the default VLM family's: pp_doclayout_v3, pp_doclayout_v2):
fp32 parity of the model outputs with transformers (shipped, and live where transformers
imports; computed on the device under test where the family's outputs depend on it), post-processed detections equal to the goldens, the plan's detector
decisions, no host sync on the host path of detect, and on CUDA graph replay == eager bitwise."""
from __future__ import annotations

import pytest
import torch

from ..plan import DEFAULT_DETECTOR_CAPTURE_SIZES, DETECTOR_GRAPH_KIND, ComponentKind, GraphOptimizationConfig
from .detector_checks import OUTPUTS, check_detections, check_outputs, check_same_kept_set, check_topk_margin

pytestmark = pytest.mark.fdx_detector


def pytest_generate_tests(metafunc):
    # every family of --fdx-detector-family (default: the default VLM family's detectors) is a
    # parameter of the tests reading its case
    if "detect_case" in metafunc.fixturenames:
        from .plugin import detector_families_option
        names = detector_families_option(metafunc.config) or ("none",)     # none: deselected by the plugin
        metafunc.parametrize("detect_case", names, indirect=True, scope="session")


@pytest.fixture(scope="module")
def runner(make_detector_runner, detect_case):
    return make_detector_runner(detect_case.model_dir, dtype="float32")


def test_detector_outputs_match_transformers_in_fp32(runner, detect_case):
    got = runner.detect_device(detect_case.pixels)
    expected = detect_case.expected(runner.device)
    # the shipped reference, the live one (where transformers imports), or both; never none
    assert expected and set(expected) <= {"shipped", "live"}
    for source, want in expected.items():
        check_topk_margin(want["enc_outputs_class"], detect_case.num_queries, detect_case.topk_margin)
        compared, note = detect_case.reconciled(runner, got, want)
        if note:
            print(f"{source}: {note}")
        errors = check_outputs(compared, want, detect_case.tolerance, source)
        print(f"{source}: " + ", ".join(f"{k} {v:.2e}" for k, v in errors.items()))
    assert got.out_masks is None            # masks off: the plan's default


def test_detections_equal_the_goldens(runner, detect_case):
    if detect_case.detections_for_goldens is None:
        got = runner.detect(detect_case.pixels, detect_case.sizes, threshold=detect_case.threshold)
    else:
        got, note = detect_case.detections_for_goldens(runner)
        if note:
            print(note)
    assert all(len(page) > 0 for page in got), "the goldens keep detections on every page"
    check_detections(got, detect_case.goldens(runner.device))
    if detect_case.reference_postprocess is not None:       # transformers' own post-processing, where recorded
        check_same_kept_set(got, detect_case.reference_postprocess)


def test_the_plan_decides_every_detector_component(runner):
    plan, row = runner.plan, runner.row
    assert plan.is_detector
    assert plan.kernel(ComponentKind.DEFORMABLE_ATTENTION).value in {e.backend for e in
                                                                     row.entries(ComponentKind.DEFORMABLE_ATTENTION)}
    assert plan.kernel(ComponentKind.DENSE_ATTENTION).value in {e.backend for e in
                                                                row.entries(ComponentKind.DENSE_ATTENTION)}
    assert plan.detector_masks.value is False and "off unless asked" in plan.detector_masks.reason
    if DETECTOR_GRAPH_KIND in row.graph_kinds and row.graphs_default:
        assert plan.detector_graphs.value == DEFAULT_DETECTOR_CAPTURE_SIZES
    else:
        assert plan.detector_graphs.value == () and plan.detector_graphs.reason.startswith("off: ")
    report = runner.describe()
    for key in ("deformable_attention", "aifi_attention", "detector_graphs", "masks"):
        assert key in report


def test_detector_host_path_makes_no_sync(runner, detect_case):
    checked = runner.detector_sync_check_runner()
    if runner.device.type == "cpu":
        assert checked.device.type == "meta"
        assert all(p.device.type == "meta" for p in checked.detector.parameters())
    else:
        assert checked is runner
    checked.detect_device(detect_case.pixels)            # warm
    with checked.sync_guard():
        out = checked.detect_device(detect_case.pixels)
    assert {getattr(out, k).device.type for k in OUTPUTS} == {checked.device.type}


@pytest.mark.fdx_device("cuda")
@pytest.mark.fdx_backend("cuda")        # the rows listing the detector graph kind (MetaX runs on the H200 too)
def test_detector_graph_replay_equals_eager_bitwise(make_detector_runner, detect_case):
    r = make_detector_runner(detect_case.model_dir, dtype="float32",
                             graph_config=GraphOptimizationConfig(use_detector_cudagraph=True,
                                                                  detector_capture_sizes=(1, 2, 4)))
    report = r.capture_detector_graphs()
    assert report.captured == 3
    pixels = torch.cat([detect_case.pixels, detect_case.pixels[:1]]).to(r.device)      # 3 pages -> bucket 4
    with torch.inference_mode():
        replayed = r.detect_uploaded(pixels)
        graph = r.detector_graphs.graphs[4]
        eager = graph.eager()                         # the same padded buffer, eager
        r.detector_graphs, graphs = None, r.detector_graphs
        unpadded = r.detect_uploaded(pixels)             # eager, unpadded
        r.detector_graphs = graphs
    # padded and unpadded batches run other kernels: a family with a step function of the boxes
    # (V2's integer grid) compares those outputs through its reconcile, reported
    compared, note = detect_case.reconciled(r, replayed, {k: getattr(unpadded, k) for k in OUTPUTS})
    if note:
        print(f"replay vs unpadded eager: {note}")
    for k in OUTPUTS:
        assert torch.equal(getattr(replayed, k), getattr(eager, k)[:3]), k
        assert (getattr(compared, k) - getattr(unpadded, k)).abs().nan_to_num().max().item() <= 1e-4, k
    assert r.detector_graphs.stats.per_bucket == {4: 1}
