"""Zero host syncs on the host-metadata path: encoder + projector, metadata included.

The proof is the backend's ``sync_guard()`` around ``encode_images`` on its
``sync_check_runner()`` (the runner itself on an accelerator; on a host device a twin whose
device tensors live on ``meta``, where a transfer to the host is visible). The guard fails on
data-dependent ops, read-backs and device->host transfers; on CUDA it adds
``set_sync_debug_mode('error')``. Every way to sync listed in DESIGN.md section 6 is injected
into the host metadata builder below and must make the guard fire, so a pass means something.
The injections read device tensors of the host metadata path that the family's fixture names
(``sync_targets``: PaddleOCR-VL's merge permutation, cu_seqlens and rotary tables; DeepSeek-OCR-2's
tensors made from its view sizes on the builder's device): those tests, and the device path's
syncs, are for families with FamilyFact.SYNC_INJECTION; the tests of PaddleOCR-VL's metadata
tables (the meta twin's tables, a cache miss) for FamilyFact.GRID_THW_LAYOUTS; the host path's
own no-sync proof runs on every family.
"""
from __future__ import annotations

import pytest
import torch

from ..sync_guard import HostSyncError
from .family_fixture import FamilyFact

GRID_LAYOUTS = pytest.mark.fdx_family_fact(FamilyFact.GRID_THW_LAYOUTS)
SYNC_INJECTION = pytest.mark.fdx_family_fact(FamilyFact.SYNC_INJECTION)


@pytest.fixture(scope="module")
def runner(tiny_models, make_runner):
    return make_runner(tiny_models["torch"], grid_thw="host")


@pytest.fixture(scope="module")
def checked(runner):
    return runner.sync_check_runner()


@GRID_LAYOUTS
def test_checked_runner_keeps_device_tensors_off_the_host(runner, checked):
    """On a host device the checked twin must really hold its device tensors on meta (else a
    transfer to the host would be invisible and the proof empty)."""
    assert checked.plan.row == runner.plan.row and type(checked) is type(runner)
    if runner.device.type == "cpu":
        assert checked.device.type == "meta"
        assert all(p.device.type == "meta" for p in checked.model.parameters())
        assert checked.meta_builder.pos_table.device.type == "meta"
        with pytest.raises(RuntimeError, match="sync_check_runner"):
            runner.sync_guard()
    else:
        assert checked is runner


def test_host_path_makes_no_sync(checked, tiny_models, batch_for):
    batch = batch_for(tiny_models["torch"])
    checked.encode_images(batch)                 # warm: kernels compiled, caches filled
    with checked.sync_guard():
        feats = checked.encode_images(batch)
    assert [f.shape[0] for f in feats] == checked.family.output_sizes(checked.cfg, batch.grid_thw)
    assert all(f.device.type == checked.device.type for f in feats)


@GRID_LAYOUTS
def test_host_path_cache_miss_makes_no_sync(checked, tiny_models, batch_for):
    """A new (h, w) uploads its tables from pinned memory without a sync too."""
    batch = batch_for(tiny_models["torch"], 1)
    checked.meta_builder.cache = type(checked.meta_builder.cache)(checked.meta_builder.cache.capacity)
    with checked.sync_guard():
        checked.encode_images(batch)
    assert checked.meta_builder.cache.stats.misses >= 1


def _host_buffer(t: torch.Tensor) -> torch.Tensor:
    return torch.empty(t.shape, dtype=t.dtype)


# Each way to sync of DESIGN.md section 6, applied to the device-side tensors the host builder
# just made (SyncTargets: offsets int32 [k+1], index int64 [N], values fp32).
MUTATIONS = {
    "nonzero": lambda m: torch.nonzero(m.index),
    "argwhere": lambda m: torch.argwhere(m.index),
    "where_one_argument": lambda m: torch.where(m.index > 0),
    "boolean_mask_indexing": lambda m: m.index[m.index > 0],
    "boolean_mask_assignment": lambda m: m.index.clone().__setitem__(m.index < 0, 0),
    "masked_select": lambda m: torch.masked_select(m.index, m.index > 0),
    "repeat_interleave_tensor_repeats": lambda m: torch.repeat_interleave(
        m.offsets[:-1].long(), m.offsets.diff().long()),
    "repeat_interleave_repeats_only": lambda m: torch.repeat_interleave(m.offsets.diff().long()),
    "unique": lambda m: torch.unique(m.index),
    "unique_consecutive": lambda m: torch.unique_consecutive(m.index),
    "bincount": lambda m: torch.bincount(m.index),
    "one_hot_without_num_classes": lambda m: torch.nn.functional.one_hot(m.index),
    "size_from_tensor": lambda m: torch.zeros(m.offsets[-1], device=m.offsets.device),
    "int": lambda m: int(m.offsets[-1]),
    "bool": lambda m: bool(m.offsets[-1] > 0),
    "item": lambda m: m.offsets[-1].item(),
    "tolist": lambda m: m.offsets.tolist(),
    "numpy": lambda m: m.offsets.numpy(),
    "to_cpu": lambda m: m.offsets.to("cpu"),
    "cpu": lambda m: m.offsets.cpu(),
    "copy_into_host_tensor": lambda m: _host_buffer(m.offsets).copy_(m.offsets),
    "torch_equal": lambda m: torch.equal(m.offsets, m.offsets),
    "allclose": lambda m: torch.allclose(m.values, m.values),
    "blocking_upload": lambda m: torch.zeros(2, dtype=m.index.dtype).to(m.index.device),
    "scalar_through_tensor_index": lambda m: m.index.clone().__setitem__(m.index[:2], 0),
}


def _inject(monkeypatch, builder, mutation, fixture) -> None:
    """``mutation`` applied to the device tensors (the fixture's sync_targets) of what the
    runner's own metadata builder class returns."""
    cls = type(builder)
    original = cls.build_host

    def build_host(self, grids, *args, **kwargs):
        meta = original(self, grids, *args, **kwargs)
        mutation(fixture.sync_targets(self, meta))
        return meta
    monkeypatch.setattr(cls, "build_host", build_host)


@SYNC_INJECTION
@pytest.mark.parametrize("name", sorted(MUTATIONS))
def test_guard_fires_on_each_sync_injected_into_the_host_builder(name, checked, tiny_models, batch_for,
                                                                  monkeypatch, family_fixture):
    batch = batch_for(tiny_models["torch"], 2)
    _inject(monkeypatch, checked.meta_builder, MUTATIONS[name], family_fixture)
    with pytest.raises(HostSyncError, match="host sync"):
        with checked.sync_guard():
            checked.encode_images(batch)


@SYNC_INJECTION
def test_device_path_is_a_separate_path_that_does_sync(tiny_models, make_runner, batch_for):
    """The reference (device metadata) path reads sizes back; the guard must see it. On a CUDA
    device set_sync_debug_mode('error') may name the sync before the op-level guard does (seen on
    the H200 for metax emulated there): either one is the guard firing."""
    checked = make_runner(tiny_models["torch"], grid_thw="device").sync_check_runner()
    with pytest.raises((HostSyncError, RuntimeError), match="host sync|synchronizing CUDA operation"):
        with checked.sync_guard():
            checked.encode_images(batch_for(tiny_models["torch"], 1))


@SYNC_INJECTION
@pytest.mark.fdx_device("cuda")
@pytest.mark.parametrize("name", ["nonzero", "boolean_mask_indexing", "item", "to_cpu"])
def test_cuda_sync_debug_mode_fires_on_its_own(name, checked, tiny_models, batch_for, monkeypatch, family_fixture):
    """CUDA only: CUDA's sync debug mode ('error', set by sync_guard.cuda_sync_guard) alone — the op-level guard not
    installed — fails on an implicit sync injected into the host builder, and passes the
    unmodified path: the CUDA proof stands without the op list."""
    from ..sync_guard import cuda_sync_guard
    batch = batch_for(tiny_models["torch"], 2)
    checked.encode_images(batch)
    with cuda_sync_guard():
        checked.encode_images(batch)
    _inject(monkeypatch, checked.meta_builder, MUTATIONS[name], family_fixture)
    with pytest.raises(RuntimeError, match="synchroniz") as info:
        with cuda_sync_guard():
            checked.encode_images(batch)
    assert not isinstance(info.value, HostSyncError)
