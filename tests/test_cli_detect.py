"""`fastdeploy-ext detect` (DESIGN.md section 5: per image a JSON object holding its detections,
each with label, score and bbox in the image's pixels, in reading order) and
`fastdeploy_ext.Detector`: on random weights from the built-in config (`--load-format dummy`)
and on the tiny transformers-written checkpoint, whose detections are checked against the
reference model's outputs on the same pixels."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from PIL import Image

from fastdeploy_ext.models.pp_doclayout_v3.config import RELEASED_LABELS
from fastdeploy_ext.models.pp_doclayout_v3.postprocess import detections

from . import pp_doclayout_fixture as fx
from .test_cli import cli

CPU = ["--device", "cpu", "--dtype", "float32"]


def run(capsys, *args):
    """The CLI in this process (the subprocess form is test_detect_dummy_on_the_cpu_prints_the_contract's):
    (exit status, stdout, stderr)."""
    from fastdeploy_ext.entrypoints.cli import main
    capsys.readouterr()
    rc = main([str(a) for a in args])
    out = capsys.readouterr()
    return rc, out.out, out.err


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("detector")
    ref = fx.write_model(path)
    return path, ref


@pytest.fixture(scope="module")
def pages(tmp_path_factory):
    d = tmp_path_factory.mktemp("pages")
    g = np.random.default_rng(11)
    out = []
    for i, (h, w) in enumerate([(300, 200), (90, 160)]):
        p = d / f"page{i}.png"
        Image.fromarray(g.integers(0, 256, (h, w, 3), dtype=np.uint8)).save(p)
        out.append(p)
    return out


def reference_detections(ref, paths, threshold):
    """What transformers' model yields on our preprocessing's pixels, post-processed by the rule
    test_pp_doclayout_v3.py checks by hand."""
    from fastdeploy_ext.models.pp_doclayout_v3.processor import DetectorImageProcessor, DetectorPreprocessorConfig
    proc = DetectorImageProcessor(DetectorPreprocessorConfig(fx.IMAGE, fx.IMAGE))
    pixels, sizes = proc.preprocess([str(p) for p in paths])
    with torch.no_grad():
        o = ref(pixel_values=pixels)
    return detections(o.logits, o.pred_boxes, o.order_logits, sizes, RELEASED_LABELS, threshold=threshold)


def test_detect_dummy_on_the_cpu_prints_the_contract(pages):
    r = cli("detect", "--load-format", "dummy", "--image", pages[0], *CPU, "--json")
    lines = r.stdout.strip().splitlines()
    assert len(lines) == 1
    obj = json.loads(lines[0])
    assert obj["image"] == str(pages[0])
    assert obj["detections"], "random weights still score above 0.5 somewhere"
    for d in obj["detections"]:
        assert set(d) == {"label", "score", "bbox"}
        assert d["label"] in RELEASED_LABELS and 0.5 <= d["score"] <= 1 and len(d["bbox"]) == 4
    assert "deformable_attention" in r.stderr and "aten_grid_sample" in r.stderr      # the plan, printed


def test_detect_on_the_tiny_checkpoint_matches_the_reference(tiny, pages, capsys):
    path, ref = tiny
    rc, out, _ = run(capsys, "detect", "--model", path, "--image", *pages, *CPU, "--json", "--threshold", "0.6")
    assert rc == 0
    got = [json.loads(line) for line in out.strip().splitlines()]
    want = reference_detections(ref, pages, 0.6)
    assert [g["image"] for g in got] == [str(p) for p in pages]
    for g, w in zip(got, want):
        assert w, "the fixture has detections above 0.6"
        assert [d["label"] for d in g["detections"]] == [d.label for d in w]     # labels, in reading order
        for gd, wd in zip(g["detections"], w):
            assert gd["score"] == pytest.approx(wd.score, abs=1e-5)
            assert gd["bbox"] == pytest.approx(list(wd.bbox), abs=1e-3)
    rc, text, _ = run(capsys, "detect", "--model", path, "--image", pages[1], *CPU)
    assert rc == 0 and text.startswith(f"{pages[1]}: ") and "detections" in text


def test_detect_bad_inputs_are_one_line_errors(tiny, tmp_path, capsys):
    path, _ = tiny
    bad = tmp_path / "not_an_image.png"
    bad.write_bytes(b"not a png")
    rc, _, err = run(capsys, "detect", "--model", path, "--image", bad, *CPU)
    assert rc == 2 and "fastdeploy-ext detect: error:" in err and "not_an_image.png" in err
    rc, _, err = run(capsys, "detect", "--model", path, "--image", bad, *CPU, "--threshold", "1.5")
    assert rc == 2 and "threshold must be a score in [0, 1]" in err
    rc, _, err = run(capsys, "detect", "--model", tmp_path / "nowhere", "--image", bad, *CPU)
    assert rc == 2 and "nowhere" in err


def test_the_detector_api(tiny, pages):
    from fastdeploy_ext import Detector
    path, ref = tiny
    det = Detector(str(path), device="cpu", threshold=0.6)
    assert det.labels == RELEASED_LABELS
    got = det.detect([str(p) for p in pages], batch_size=1)
    want = reference_detections(ref, pages, 0.6)
    assert [[d.label for d in page] for page in got] == [[d.label for d in page] for page in want]
    with pytest.raises(ValueError, match="threshold"):
        det.detect([str(pages[0])], threshold=-0.1)


def test_detect_on_the_emulated_metax_runner_equals_the_cpu_runner(tiny, pages):
    """The same runner classes on another backend: MetaX's own runner and row, in its emulation
    mode (tensors on the CPU here), fp32: the same detections as the cpu runner's."""
    from fastdeploy_ext import Detector
    from fastdeploy_ext.plan import ComponentKind, PlanRequest
    from fastdeploy_ext.runner import emulated_backends
    path, _ = tiny
    imgs = [str(p) for p in pages]
    cpu = Detector(str(path), device="cpu", dtype="float32").detect(imgs)
    with emulated_backends(["metax"]):
        det = Detector(str(path), request=PlanRequest(device="metax", dtype="float32"))
        assert det.runner.name == "metax" and det.runner.plan.emulated and det.runner.plan.row == "metax_c500"
        assert det.runner.plan.kernel(ComponentKind.DEFORMABLE_ATTENTION).value == "aten_grid_sample"
        got = det.detect(imgs)
    assert [[(d.label, d.order) for d in p] for p in got] == [[(d.label, d.order) for d in p] for p in cpu]
    for gp, cp in zip(got, cpu):
        for g, c in zip(gp, cp):
            assert g.score == pytest.approx(c.score, abs=1e-6) and g.bbox == pytest.approx(c.bbox, abs=1e-4)


def test_info_shows_the_detectors_plan_from_its_config(tiny, capsys):
    rc, out, _ = run(capsys, "info", "--model", tiny[0], "--device", "cpu", "--json")
    assert rc == 0
    info = json.loads(out)
    kernels = info["plan"]["component_kernels"]
    assert [(k["component"], k["kind"], k["backend"]) for k in kernels] == [
        ("decoder.cross_attention", "deformable_attention", "aten_grid_sample"),
        ("encoder.aifi_attention", "dense_attention", "sdpa")]
    plan = info["plan"]
    assert plan["detector_masks"]["value"] is False and "off unless asked" in plan["detector_masks"]["reason"]
    assert plan["detector_graphs"]["value"] == [] and plan["detector_graphs"]["reason"].startswith("off: row cpu")
    # the text report: the detector's decisions, each with its reason
    rc, out, _ = run(capsys, "info", "--model-family", "pp_doclayout_v3", "--device", "cpu")
    assert rc == 0
    lines = {ln.split("=")[0].strip(): ln for ln in out.splitlines() if " = " in ln}
    assert "float32" in lines["dtype"] and "default of row cpu" in lines["dtype"]
    assert "aten_grid_sample" in lines["deformable_attention"] and "sdpa" in lines["aifi_attention"]
    assert "off" in lines["masks"] and "boxes and reading order only" in lines["masks"]
    assert "off: row cpu has no detector graph capture" in lines["detector_graphs"]
    rc, _, err = run(capsys, "generate", "--model", tiny[0], "--image", __file__, "--prompt", "OCR:", *CPU)
    assert rc == 2 and "pp_doclayout_v3 is a detector family" in err
    rc, _, err = run(capsys, "encode", "--model", tiny[0], "--image", __file__, "--output", tiny[0] / "x.safetensors", *CPU)
    assert rc == 2 and "encode needs a vlm family" in err
