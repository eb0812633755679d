"""Bad batches get clear errors and leave the runner healthy."""
from __future__ import annotations

import pytest
import torch

from ..models.interface import BatchError
from ..runner import ImageBatch
from .family_fixture import BAD_BATCH_KINDS


@pytest.fixture(scope="module")
def runner(tiny_models, make_runner):
    return make_runner(tiny_models["torch"])


@pytest.fixture(scope="module")
def bad(family_fixture):
    cases = family_fixture.bad_batches()
    assert set(cases) == set(BAD_BATCH_KINDS), f"the family's fixture must give every bad batch kind {BAD_BATCH_KINDS}"
    return cases


@pytest.mark.parametrize("case", sorted(BAD_BATCH_KINDS))
def test_bad_batch_is_a_clear_error(case, bad, runner):
    pv, grid, msg = bad[case]
    with pytest.raises(BatchError, match=msg):
        runner.encode_images(ImageBatch(pv, grid))


def test_the_runner_stays_healthy_after_every_bad_batch(bad, runner, tiny_models, batch_for):
    """Every kind of bad batch in a row, then a good image encodes (one good encode, not one per
    kind: a good pass of a large family's tiny model is the cost of this file)."""
    for case in sorted(BAD_BATCH_KINDS):
        pv, grid, msg = bad[case]
        with pytest.raises(BatchError, match=msg):
            runner.encode_images(ImageBatch(pv, grid))
    good = batch_for(tiny_models["torch"], 1)
    feats = runner.encode_images(good)
    assert [f.shape[0] for f in feats] == runner.family.output_sizes(runner.cfg, good.grid_thw)
    assert all(torch.isfinite(f.float()).all() for f in feats)


def test_encode_before_load_is_a_clear_error(backend_cls):
    from ..plan import PlanRequest
    r = backend_cls.create(PlanRequest(device=backend_cls.name))
    with pytest.raises(RuntimeError, match="load_model"):
        r.encode_images(ImageBatch(torch.randn(4, 3, 14, 14), [(1, 2, 2)]))
