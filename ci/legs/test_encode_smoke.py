"""End-to-end `fastdeploy-ext encode` on one device and plan variant of the matrix: the command
line (argument parsing, runner choice, plan, model loading, graphs, the output file) on the tiny
checkpoint the conformance suite ships, checked against the transformers features shipped with it
(reference_data/, computed once with transformers 5.24; no transformers needed here).

The CLI runs in this process (`cli.main`) so that the MetaX emulation the conformance plugin
installs for `--fdx-backend metax` applies to it; everything below `main` is the real path.
fp32: max abs error <= 1e-4; bf16/fp16: cosine >= 0.999 per image (as the conformance suite).
"""
from __future__ import annotations

import ast
import logging
import re

import pytest
import torch
import torch.nn.functional as F
from safetensors import safe_open

from fastdeploy_ext.conformance.references import Manifest
from fastdeploy_ext.entrypoints import cli
from fastdeploy_ext.models.paddleocr_vl.processor import ImageProcessor, PreprocessorConfig


@pytest.fixture(scope="module")
def shipped():
    """(model dir, image files, {image file name: expected fp32 features})."""
    refs = Manifest.load()
    model, images = refs.path("tiny_torch"), refs.files("images")
    tensors, info = refs.tensors("encoder_features")
    names = ast.literal_eval(info["images"])    # the list of file names make_references wrote
    expected = {name: tensors[f"image{i}"] for i, name in enumerate(names)}
    return model, [p for p in images if p.name in expected], expected


def test_encode_end_to_end(shipped, plan_variant, plan_flags, tmp_path, caplog, capsys, request):
    backend = request.config.getoption("--fdx-backend")
    assert backend, "the smoke leg needs --fdx-backend"
    model, images, expected = shipped
    out = tmp_path / "features.safetensors"
    argv = ["encode", "--model", str(model), "--device", backend, *plan_flags, "--output", str(out)]
    for p in images:
        argv += ["--image", str(p)]
    with caplog.at_level(logging.INFO, logger="fastdeploy_ext"):
        rc = cli.main(argv)
    assert rc == 0, capsys.readouterr().err
    log_text = caplog.text
    print(log_text)

    # the plan printed at start-up is the variant asked for
    for key in ("qkv_layout", "grid_thw", "dtype"):
        if key in plan_variant:
            assert any(line.split()[:3] == [key, "=", plan_variant[key]] for line in
                       (r.getMessage().strip() for r in caplog.records)), f"plan does not say {key}={plan_variant[key]}"
    captured = re.search(r"captured [1-9]\d* encoder graphs", log_text)
    if plan_variant.get("graphs") == "on":
        assert captured, "encoder graphs asked for but none captured"
    elif plan_variant.get("graphs") == "off":
        assert not captured and "encoder graphs: none" in log_text

    # the file: image_i [h*w/4, hidden] in the compute dtype, grid_thw int64 [n, 3], labelled
    proc = ImageProcessor(PreprocessorConfig.from_model_dir(model))
    processed = [proc.preprocess(p) for p in images]
    with safe_open(str(out), "pt") as f:
        meta = f.metadata()
        grid = f.get_tensor("grid_thw")
        feats = [f.get_tensor(f"image_{i}") for i in range(len(images))]
        assert set(f.keys()) == {"grid_thw", *(f"image_{i}" for i in range(len(images)))}
    assert meta["emulated"] == ("true" if backend == "metax" else "false")
    assert grid.dtype == torch.int64 and grid.tolist() == [list(p.grid_thw) for p in processed]
    dtype = getattr(torch, meta["dtype"])
    if "dtype" in plan_variant:
        assert meta["dtype"] == plan_variant["dtype"]

    for i, (ours, p) in enumerate(zip(feats, images)):
        r = expected[p.name]
        t, h, w = processed[i].grid_thw
        assert ours.dtype == dtype and tuple(ours.shape) == (t * h * w // 4, r.shape[-1])
        ours = ours.float()
        err = float((ours - r).abs().max())
        cos = float(F.cosine_similarity(ours.flatten(), r.flatten(), dim=0))
        print(f"[{meta['row']} {meta['device']} {meta['dtype']}] image_{i} ({p.name}): max abs err {err:.3g}, cosine {cos:.6f}")
        if dtype == torch.float32:
            assert err <= 1e-4
        else:
            assert cos >= 0.999
