"""encode numerics vs the family's reference on its tiny checkpoints, in each weight layout it has.

fp32: max abs error <= 1e-4. bf16: cosine similarity >= 0.999 per image (max abs error reported,
also as junit properties).
For PaddleOCR-VL the reference is transformers' `model.model.get_image_features(...).pooler_output`
in fp32 on the CPU, fed the same pixel values: the copy shipped with the suite (reference_data/,
computed once with transformers 5.24 by make_references) always, and, where transformers is
installed, the one it computes now as well. Another family's fixture names its own reference
(e.g. the toy family's float64 torch reference, computed live)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from .family_fixture import FamilyFact

LAYOUTS = ("torch", pytest.param("paddle", marks=pytest.mark.fdx_family_fact(FamilyFact.PADDLE_LAYOUT)))
SHIPPED_VS_LIVE_MAX_ABS = 1e-5      # the same fp32 CPU computation, another process or thread count


@pytest.fixture(scope="module")
def expected(encode_case, tiny_models, batch_for):
    """(batch, {source: per-image fp32 features}) of the family's fixture (PaddleOCR-VL:
    "shipped" always, "live" with transformers)."""
    batch = batch_for(tiny_models["torch"])
    refs = encode_case.expected()
    assert refs and all(len(r) == len(batch.grid_thw) for r in refs.values()), "one reference row set per image"
    return batch, refs


@pytest.mark.fdx_family_fact(FamilyFact.SHIPPED_REFERENCES)
def test_shipped_reference_is_transformers_output(expected, references):
    """The shipped features record their provenance; with transformers present they equal what
    it computes now (so a stale copy cannot hide)."""
    batch, refs = expected
    produced = references.entry("encoder_features").produced_with
    assert produced.get("transformers", "").startswith("5.24"), produced
    assert references.entry("encoder_features").inputs == ("tiny_torch", "images")
    for i, r in enumerate(refs["shipped"]):
        t, h, w = batch.grid_thw[i]
        assert r.dtype == torch.float32 and r.shape[0] == t * h * w // 4 and torch.isfinite(r).all()
    if "live" in refs:
        err = max(float((a - b).abs().max()) for a, b in zip(refs["shipped"], refs["live"]))
        print(f"shipped vs live transformers: max abs {err:.3g}")
        assert err <= SHIPPED_VS_LIVE_MAX_ABS, err


def _dtypes(backend_cls):
    from ..capabilities import capability_table
    row, _ = backend_cls.select_row(backend_cls.probe(), capability_table())
    return row.dtypes


# the core suite keeps fp32 parity; bf16's cosine is a variant (bf16 is checked there by the
# teacher-forced logits through vision and decoder: test_generate.py)
@pytest.mark.parametrize("dtype", ["float32", pytest.param("bfloat16", marks=pytest.mark.fdx_extended)])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_encode_matches_transformers(layout, dtype, tiny_models, expected, make_runner, backend_cls,
                                     record_property):
    if dtype not in _dtypes(backend_cls):
        pytest.fail(f"the row of {backend_cls.name} lists no {dtype}: the parity check cannot run")
    batch, refs = expected
    runner = make_runner(tiny_models[layout], dtype=dtype)
    assert runner.load_report.layout == layout
    ours = runner.encode_images(batch)
    sizes = runner.family.output_sizes(runner.cfg, batch.grid_thw)
    tag = f"[{runner.plan.row}{' EMULATED' if runner.plan.emulated else ''}]"
    record_property("attention_backend", runner.plan.attention.value)    # which kernel met the tolerance
    for source, ref in refs.items():
        assert len(ours) == len(ref)
        cos, err = [], []
        for i, (o, r) in enumerate(zip(ours, ref)):
            assert o.dtype == getattr(torch, dtype) and tuple(o.shape) == (sizes[i], r.shape[-1])
            o = o.float().cpu()
            cos.append(float(F.cosine_similarity(o.flatten(), r.flatten(), dim=0)))
            err.append(float((o - r).abs().max()))
        record_property(f"{dtype}_{source}_max_abs_err", max(err))
        record_property(f"{dtype}_{source}_min_cosine", min(cos))
        print(f"{tag} {dtype} {layout} vs {source} transformers: max abs err per image {err}, cosine {cos}")
        if dtype == "float32":
            assert max(err) <= 1e-4, (source, err)
        else:
            assert min(cos) >= 0.999, (source, cos)
