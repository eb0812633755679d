"""Bad batches get clear errors and leave the runner healthy."""
from __future__ import annotations

import pytest
import torch

from ..models.paddleocr_vl.metadata import BatchError
from ..runner import ImageBatch


@pytest.fixture(scope="module")
def runner(tiny_models, make_runner):
    return make_runner(tiny_models["torch"])


BAD = {
    "empty": (torch.empty(0, 3, 14, 14), [], "empty batch"),
    "grid_mismatch": (torch.randn(8, 3, 14, 14), [(1, 2, 2)], "patches"),
    "odd_grid": (torch.randn(6, 3, 14, 14), [(1, 2, 3)], "divisible"),
    "zero_dim": (torch.randn(0, 3, 14, 14), [(1, 0, 2)], "non-positive"),
    "bad_rank": (torch.randn(4, 3, 14), [(1, 2, 2)], "pixel_values must be"),
    "bad_patch": (torch.randn(4, 3, 16, 16), [(1, 2, 2)], "pixel_values must be"),
    "not_thw": (torch.randn(4, 3, 14, 14), [(2, 2)], r"\(t, h, w\)"),
    "int_pixels": (torch.zeros(4, 3, 14, 14, dtype=torch.int64), [(1, 2, 2)], "floating point"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_batch_is_a_clear_error_and_runner_stays_healthy(case, runner, tiny_models, batch_for):
    pv, grid, msg = BAD[case]
    with pytest.raises(BatchError, match=msg):
        runner.encode_images(ImageBatch(pv, grid))
    good = batch_for(tiny_models["torch"], 2)
    feats = runner.encode_images(good)
    assert [f.shape[0] for f in feats] == [t * h * w // 4 for t, h, w in good.grid_thw]
    assert all(torch.isfinite(f.float()).all() for f in feats)


def test_encode_before_load_is_a_clear_error(backend_cls):
    from ..plan import PlanRequest
    r = backend_cls.create(PlanRequest(device=backend_cls.name))
    with pytest.raises(RuntimeError, match="load_model"):
        r.encode_images(ImageBatch(torch.randn(4, 3, 14, 14), [(1, 2, 2)]))
