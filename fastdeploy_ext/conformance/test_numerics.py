"""encode numerics vs the transformers reference on tiny checkpoints in both weight layouts.

fp32: max abs error <= 1e-4. bf16: cosine similarity >= 0.999 per image (max abs error reported,
also as junit properties).
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


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_encode_matches_transformers(layout, dtype, tiny_models, references, make_runner, backend_cls,
                                     record_property):
    if dtype not in _dtypes(backend_cls):
        pytest.fail(f"the row of {backend_cls.name} lists no {dtype}: the parity check cannot run")
    batch, ref = references
    runner = make_runner(tiny_models[layout], dtype=dtype)
    assert runner.load_report.layout == layout
    ours = runner.encode_images(batch)
    assert len(ours) == len(ref)
    cos, err = [], []
    for i, (o, r) in enumerate(zip(ours, ref)):
        t, h, w = batch.grid_thw[i]
        assert o.dtype == getattr(torch, dtype) and tuple(o.shape) == (t * h * w // 4, r.shape[-1])
        o = o.float().cpu()
        cos.append(float(F.cosine_similarity(o.flatten(), r.flatten(), dim=0)))
        err.append(float((o - r).abs().max()))
    record_property(f"{dtype}_max_abs_err", max(err))
    record_property(f"{dtype}_min_cosine", min(cos))
    tag = f"[{runner.plan.row}{' EMULATED' if runner.plan.emulated else ''}]"
    print(f"{tag} {dtype} {layout}: max abs err per image {err}, cosine {cos}")
    if dtype == "float32":
        assert max(err) <= 1e-4, err
    else:
        assert min(cos) >= 0.999, cos
