"""The detector conformance checks fire when broken on purpose: a wrong deformable kernel fails
parity against the shipped transformers outputs, a fixture whose top-k is a coin toss fails the
margin, swapped reading order fails the goldens, and a sync injected into the detector's forward
fails the guard on the runner's meta twin (the suite's own passing run is the conformance legs')."""
from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from fastdeploy_ext.conformance.detector_checks import (check_detections, check_outputs, check_same_kept_set,
                                                        check_topk_margin)
from fastdeploy_ext.models.registry import get_family
from fastdeploy_ext.plan import PlanRequest
from fastdeploy_ext.runner import get_backend_class
from fastdeploy_ext.sync_guard import HostSyncError


@pytest.fixture(scope="module")
def case():
    return get_family("pp_doclayout_v3").conformance_fixture("").detect_case()


@pytest.fixture(scope="module")
def shipped():
    """The shipped transformers outputs only (the live ones are the conformance legs' business)."""
    from fastdeploy_ext.conformance.references import Manifest
    return Manifest.load().tensors("detector_outputs")[0]


@pytest.fixture(scope="module")
def runner(case):
    r = get_backend_class("cpu").create(PlanRequest(device="cpu", dtype="float32"))
    r.load_detector(str(case.model_dir))
    return r


def test_the_checks_pass_on_the_real_runner(runner, case, shipped):
    check_topk_margin(shipped["enc_outputs_class"], case.num_queries, case.topk_margin)
    check_outputs(runner.detect_device(case.pixels), shipped, case.tolerance)
    check_detections(runner.detect(case.pixels, case.sizes, threshold=case.threshold), case.golden)


def test_parity_fails_with_a_wrong_deformable_kernel(runner, case, shipped):
    from fastdeploy_ext.ops.attention.deformable import deformable_sample
    real = F.grid_sample

    def shifted(value, shapes, locations, weights):       # sampling points off by half a cell
        F.grid_sample = lambda *a, **kw: real(*a, **(kw | {"align_corners": True}))
        try:
            return deformable_sample(value, shapes, locations, weights)
        finally:
            F.grid_sample = real
    runner.detector.set_deformable_kernel(shifted)
    try:
        got = runner.detect_device(case.pixels)
    finally:
        runner.detector.set_deformable_kernel(deformable_sample)
    with pytest.raises(AssertionError, match="logits: max abs error"):
        check_outputs(got, shipped, case.tolerance)


def test_the_topk_margin_and_goldens_checks_fire():
    scores = torch.zeros(1, 5, 2)
    scores[0, :, 0] = torch.tensor([3.0, 2.0, 1.0, 0.9995, 0.0])
    assert check_topk_margin(scores, 2, 1e-3) == pytest.approx(1.0)
    with pytest.raises(AssertionError, match="3th and 4th scores differ by"):
        check_topk_margin(scores, 3, 1e-3)
    from fastdeploy_ext.models.pp_doclayout_v3.postprocess import Detection
    page = [Detection("text", 22, 0.9, (0, 0, 1, 1), 0), Detection("table", 21, 0.8, (0, 0, 2, 2), 1)]
    golden = [[{"label": d.label, "order": d.order, "score": d.score, "bbox": list(d.bbox)} for d in page]]
    check_detections([page], golden)
    with pytest.raises(AssertionError, match=r"page 0: \(label, order\)"):
        check_detections([page[::-1]], golden)
    with pytest.raises(AssertionError, match="bbox"):
        check_detections([[page[0], dataclasses.replace(page[1], bbox=(0, 0, 2, 3))]], golden)
    # transformers' kept set, in its own order: the same entries pass, a changed score does not
    ref = [{"labels": [21, 22], "scores": [0.8, 0.9], "boxes": [[0, 0, 2, 2], [0, 0, 1, 1]]}]
    check_same_kept_set([page], ref)
    with pytest.raises(AssertionError, match="!= transformers'"):
        check_same_kept_set([page], [ref[0] | {"scores": [0.8, 0.91]}])


@pytest.mark.parametrize("mutation", ["item", "cpu"])
def test_the_sync_guard_fires_on_the_detect_host_path(runner, case, monkeypatch, mutation):
    from fastdeploy_ext.models.pp_doclayout_v3 import model as mod
    real = mod.mask_boxes

    def syncing(mask, dtype):
        if mutation == "item":
            mask.any().item()
        else:
            mask.cpu()
        return real(mask, dtype)
    checked = runner.detector_sync_check_runner()
    with checked.sync_guard():
        checked.detect_device(case.pixels)                 # clean: passes
    monkeypatch.setattr(mod, "mask_boxes", syncing)
    with pytest.raises(HostSyncError), checked.sync_guard():
        checked.detect_device(case.pixels)


@pytest.mark.parametrize("family,expect,codes", [
    ("none", "not run on this leg (needs a detector family", (5,)),        # 5: every test deselected
    ("paddleocr_vl", "paddleocr_vl is no detector family with a detector conformance fixture", (1,)),
])
def test_the_detector_family_option_deselects_by_name_or_fails(family, expect, codes):
    import os
    import subprocess
    import sys
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--pyargs",
                        "fastdeploy_ext.conformance.test_detector", "--fdx-backend", "cpu", "-k", "plan_decides",
                        "--fdx-detector-family", family], capture_output=True, text=True, timeout=600,
                       env=dict(os.environ))
    assert expect in r.stdout, r.stdout[-3000:]
    assert r.returncode in codes, r.stdout[-2000:]
    assert f"detector={family}" in r.stdout
