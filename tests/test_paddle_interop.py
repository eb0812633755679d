"""Paddle interop (fastdeploy_ext/interop/paddle.py) with the paddlepaddle CPU wheel (the `paddle`
extra): Paddle tensors in and out of a runner through DLPack without copies, the same features as
the torch path, and a Paddle-layout checkpoint written by Paddle itself (safetensors.paddle) read
by our loader. Runs in the matrix's cpu/paddle-interop leg, where a skip fails the leg."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest
import torch

paddle = pytest.importorskip("paddle", reason="needs paddlepaddle: pip install -e '.[paddle]'")

from fastdeploy_ext.conformance.references import Manifest  # noqa: E402
from fastdeploy_ext.conformance.tiny_model import _is_linear_weight  # noqa: E402
from fastdeploy_ext.interop.paddle import PaddleVisionAdapter, host_grids, to_paddle, to_torch  # noqa: E402
from fastdeploy_ext.models.paddleocr_vl.metadata import BatchError  # noqa: E402
from fastdeploy_ext.models.paddleocr_vl.processor import ImageProcessor, PreprocessorConfig  # noqa: E402
from fastdeploy_ext.plan import PlanRequest  # noqa: E402
from fastdeploy_ext.runner import ImageBatch, get_backend_class  # noqa: E402


@pytest.fixture(scope="module")
def shipped():
    refs = Manifest.load()
    model = refs.path("tiny_torch")
    proc = ImageProcessor(PreprocessorConfig.from_model_dir(model))
    batch = ImageBatch.from_images([proc.preprocess(p) for p in refs.files("images")])
    tensors, _ = refs.tensors("encoder_features")
    return refs, model, batch, [tensors[f"image{i}"] for i in range(len(batch.grid_thw))]


def make_runner(model_dir, dtype="float32"):
    runner = get_backend_class("cpu").create(PlanRequest(device="cpu", dtype=dtype))
    runner.load_model(str(model_dir))
    return runner


class Spy:
    """Records what the runner's hot path received and returned."""

    def __init__(self, runner):
        self.calls = []
        inner = runner.encode_uploaded

        def spy(pixels, grids):
            out = inner(pixels, grids)
            self.calls.append((pixels, out))
            return out
        runner.encode_uploaded = spy


def test_importing_fastdeploy_ext_does_not_import_paddle():
    code = ("import sys, fastdeploy_ext, fastdeploy_ext.interop.paddle, fastdeploy_ext.entrypoints.cli; "
            "assert 'paddle' not in sys.modules, 'paddle imported eagerly'")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_dlpack_shares_memory_both_ways():
    p = paddle.arange(12, dtype="float32").reshape([3, 4])
    t = to_torch(p)
    assert t.data_ptr() == p.data_ptr() and t.dtype == torch.float32 and list(t.shape) == [3, 4]
    t[1, 2] = -7.0                                   # a write through torch is seen by Paddle: one buffer
    assert float(p[1, 2]) == -7.0
    back = to_paddle(t[1:])                          # a view with an offset keeps its address too
    assert back.data_ptr() == t[1:].data_ptr() and back.dtype == paddle.float32 and back.shape == [2, 4]
    with pytest.raises(TypeError, match="expected a paddle.Tensor"):
        to_torch(t)
    with pytest.raises(TypeError, match="expected a torch.Tensor"):
        to_paddle(p)


@pytest.mark.parametrize("shape", ["flat", "patches"])
def test_adapter_is_zero_copy_and_equals_the_torch_path(shipped, shape):
    _, model, batch, expected = shipped
    runner = make_runner(model)
    ours_torch = runner.encode_images(batch)                      # the torch path
    pv = batch.pixel_values.reshape(batch.pixel_values.shape[0], -1) if shape == "flat" else batch.pixel_values
    pixels = paddle.to_tensor(pv.numpy())                          # what a FastDeploy worker holds
    spy = Spy(runner)
    feats = PaddleVisionAdapter(runner).encode_images(pixels, batch.grid_thw)
    (received, returned), = spy.calls
    # in: the runner reads Paddle's buffer (CPU, float32 = the runner's device and dtype)
    assert received.data_ptr() == pixels.data_ptr()
    # out: Paddle's tensors are the runner's output buffers
    assert [f.data_ptr() for f in feats] == [r.data_ptr() for r in returned]
    assert all(isinstance(f, paddle.Tensor) and f.dtype == paddle.float32 for f in feats)
    for f, t, ref in zip(feats, ours_torch, expected):
        f = to_torch(f)
        assert torch.equal(f, t)                                   # same features as the torch path
        assert float((f - ref).abs().max()) <= 1e-4                # and as transformers (shipped)


def test_dtype_mismatch_costs_one_cast_in_and_none_out(shipped):
    _, model, batch, _ = shipped
    runner = make_runner(model, dtype="bfloat16")
    ours_torch = runner.encode_images(batch)
    pixels = paddle.to_tensor(batch.pixel_values.numpy())          # float32: the runner computes in bf16
    spy = Spy(runner)
    feats = PaddleVisionAdapter(runner).encode_images(pixels, batch.grid_thw)
    (received, returned), = spy.calls
    assert received.data_ptr() != pixels.data_ptr() and received.dtype == torch.bfloat16
    assert [f.data_ptr() for f in feats] == [r.data_ptr() for r in returned]
    assert all(f.dtype == paddle.bfloat16 for f in feats)
    assert all(torch.equal(to_torch(f), t) for f, t in zip(feats, ours_torch))


def test_grid_thw_must_be_host_values(shipped):
    import numpy as np
    grids = [(1, 4, 8), (1, 6, 4)]
    for form in (grids, np.array(grids), paddle.to_tensor(grids), torch.tensor(grids)):
        assert host_grids(form) == grids
    with pytest.raises(BatchError, match="device->host sync"):
        host_grids(torch.tensor(grids, device="meta"))
    with pytest.raises(BatchError, match="integer triples"):
        host_grids([(1, 4), None])
    # a bad batch through the adapter is the runner's clear error, and the runner stays usable
    _, model, batch, _ = shipped
    runner = make_runner(model)
    adapter = PaddleVisionAdapter(runner)
    pixels = paddle.to_tensor(batch.pixel_values.numpy())
    with pytest.raises(BatchError):
        adapter.encode_images(pixels, [(1, 3, 3)])
    assert len(adapter.encode_images(pixels, batch.grid_thw)) == len(batch.grid_thw)


def test_checkpoint_written_by_paddle_is_detected_as_paddle_layout(shipped, tmp_path):
    """safetensors.paddle.save_file of Paddle tensors with Linear weights [in, out], as a
    PaddleX/FastDeploy export: our loader must see the layout from the shapes and compute the same
    features as from the torch-layout original."""
    from safetensors.paddle import save_file
    from safetensors.torch import load_file
    refs, model, batch, expected = shipped
    out = tmp_path / "paddle_written"
    out.mkdir()
    tensors = {}
    for f in sorted(model.glob("*.safetensors")):
        for name, t in load_file(str(f)).items():
            p = to_paddle(t.contiguous())
            tensors[name] = paddle.transpose(p, [1, 0]).contiguous() if _is_linear_weight(name, t) else p
    save_file(tensors, str(out / "model.safetensors"))
    shutil.copy(refs.path("tiny_paddle") / "preprocessor_config.json", out)
    shutil.copy(model / "config.json", out)
    fc1 = "visual.vision_model.encoder.layers.0.mlp.fc1.weight"
    cfg = json.loads((out / "config.json").read_text())
    assert tensors[fc1].shape == [cfg["vision_config"]["hidden_size"], cfg["vision_config"]["intermediate_size"]]

    runner = make_runner(out)
    assert runner.load_report.layout == "paddle", runner.load_report.layout_reason
    theirs = runner.encode_images(batch)
    ours = make_runner(model).encode_images(batch)
    assert make_runner(model).load_report.layout == "torch"
    for a, b, ref in zip(theirs, ours, expected):
        assert float((a - b).abs().max()) <= 1e-6
        assert float((a - ref).abs().max()) <= 1e-4
