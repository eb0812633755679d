"""encode numerics vs the transformers reference on tiny checkpoints in both weight layouts.

fp32: max abs error <= 1e-4. bf16: cosine similarity >= 0.999 per image (max abs error reported).
The reference is transformers' `model.model.get_image_features(...).pooler_output` in fp32 on the
CPU, fed the same pixel values."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from .tiny_model import reference_image_features

LAYOUTS = ("torch", "paddle")


@pytest.fixture(scope="module")
def references(tiny_models, batch_for):
    batch = batch_for(tiny_models["torch"])
    return batch, reference_image_features(tiny_models["torch"], batch.pixel_values, batch.grid_thw)


def _dtypes(backend_cls):
    from ..plan import load_table
    row, _ = backend_cls.select_row(backend_cls.probe(), load_table())
    return row.dtypes


@pytest.mark.parametrize("layout", LAYOUTS)
def test_fp32_matches_transformers(layout, tiny_models, references, make_runner, backend_cls, record_property):
    if "float32" not in _dtypes(backend_cls):
        pytest.fail(f"row of {backend_cls.name} lists no float32: the fp32 parity check cannot run")
    batch, ref = references
    runner = make_runner(tiny_models[layout], dtype="float32")
    assert runner.load_report.layout == layout
    ours = runner.encode_images(batch)
    assert len(ours) == len(ref)
    errs = []
    for i, (o, r) in enumerate(zip(ours, ref)):
        t, h, w = batch.grid_thw[i]
        assert o.dtype == torch.float32 and tuple(o.shape) == (t * h * w // 4, r.shape[-1])
        errs.append(float((o.float().cpu() - r).abs().max()))
    record_property("fp32_max_abs_err", max(errs))
    print(f"[{runner.plan.row}{' EMULATED' if runner.plan.emulated else ''}] fp32 {layout}: max abs err per image {errs}")
    assert max(errs) <= 1e-4, errs


@pytest.mark.parametrize("layout", LAYOUTS)
def test_bf16_cosine_vs_transformers(layout, tiny_models, references, make_runner, backend_cls, record_property):
    if "bfloat16" not in _dtypes(backend_cls):
        pytest.fail(f"row of {backend_cls.name} lists no bfloat16")
    batch, ref = references
    runner = make_runner(tiny_models[layout], dtype="bfloat16")
    ours = runner.encode_images(batch)
    cos, err = [], []
    for o, r in zip(ours, ref):
        assert o.dtype == torch.bfloat16
        o = o.float().cpu()
        cos.append(float(F.cosine_similarity(o.flatten(), r.flatten(), dim=0)))
        err.append(float((o - r).abs().max()))
    record_property("bf16_min_cosine", min(cos))
    record_property("bf16_max_abs_err", max(err))
    print(f"[{runner.plan.row}{' EMULATED' if runner.plan.emulated else ''}] bf16 {layout}: cosine {cos}, max abs err {err}")
    assert min(cos) >= 0.999, cos
