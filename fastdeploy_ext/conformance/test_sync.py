"""Zero host syncs on the host-metadata path: encoder + projector, metadata included.

On CUDA the proof is torch.cuda.set_sync_debug_mode('error'); elsewhere the recorder of explicit
read-backs. The guard itself is checked to fire on a deliberate sync, so a pass means something."""
from __future__ import annotations

import pytest
import torch

from ..sync_guard import HostSyncError


@pytest.fixture(scope="module")
def runner(tiny_models, make_runner):
    return make_runner(tiny_models["torch"], grid_thw="host")


def test_guard_detects_a_deliberate_sync(runner):
    x = torch.ones(4, device=runner.device)
    with pytest.raises((HostSyncError, RuntimeError)):
        with runner.sync_guard():
            x.sum().item()


def test_host_path_makes_no_sync(runner, tiny_models, batch_for):
    batch = batch_for(tiny_models["torch"])
    runner.encode_images(batch)                 # warm: kernels compiled, caches filled
    with runner.sync_guard():
        feats = runner.encode_images(batch)
    assert len(feats) == len(batch.grid_thw)


def test_host_path_cache_miss_makes_no_sync(runner, tiny_models, batch_for):
    """A new (h, w) uploads its tables from pinned memory without a sync too."""
    batch = batch_for(tiny_models["torch"], 1)
    runner.meta_builder.cache = type(runner.meta_builder.cache)(runner.meta_builder.cache.capacity)
    with runner.sync_guard():
        runner.encode_images(batch)
    assert runner.meta_builder.cache.stats.misses >= 1


def test_device_path_is_a_separate_path_that_does_sync(tiny_models, make_runner, batch_for):
    """The reference (device metadata) path reads sizes back; the guard must see it."""
    runner = make_runner(tiny_models["torch"], grid_thw="device")
    with pytest.raises((HostSyncError, RuntimeError)):
        with runner.sync_guard():
            runner.encode_images(batch_for(tiny_models["torch"], 1))
