"""HostSyncGuard on its own: every way to sync of the conformance mutation list fires on a
watched device with and without inference mode (the dispatcher sees composite ops before
decomposition in inference mode, their ATen parts otherwise), the same ops on host tensors do
not (the host metadata path computes on them by design), and the host cannot be watched."""
from __future__ import annotations

import pytest
import torch

from fastdeploy_ext.conformance.family_fixture import SyncTargets
from fastdeploy_ext.conformance.test_sync import MUTATIONS
from fastdeploy_ext.sync_guard import HostSyncError, HostSyncGuard


def _meta(device: str) -> SyncTargets:
    return SyncTargets(offsets=torch.tensor([0, 4, 10], dtype=torch.int32).to(device),
                       index=torch.arange(10).to(device), values=torch.rand(10, 4).to(device))


@pytest.mark.parametrize("inference", [True, False], ids=["inference_mode", "no_grad"])
@pytest.mark.parametrize("name", sorted(MUTATIONS))
def test_each_way_to_sync_fires_on_a_watched_device(name, inference):
    m = _meta("meta")
    with pytest.raises(HostSyncError, match=r"host sync in a path that must not sync: \S+ on meta"):
        with (torch.inference_mode() if inference else torch.no_grad()), HostSyncGuard({"meta"}):
            MUTATIONS[name](m)


@pytest.mark.parametrize("name", sorted(MUTATIONS))
def test_host_tensors_are_free(name):
    m = _meta("cpu")
    with HostSyncGuard({"meta"}) as guard:
        MUTATIONS[name](m)
    assert guard.events == []


def test_uploads_and_static_ops_pass():
    host = torch.arange(12)
    with torch.inference_mode(), HostSyncGuard({"meta"}) as guard:
        dev = host.to("meta", non_blocking=True)
        dev[:2] = 0                                              # a slice: fill_, no upload
        dev[torch.tensor([0, 3]).to("meta", non_blocking=True)]  # integer indexing: static size
        torch.repeat_interleave(dev, dev, output_size=66)       # output size given
        torch.nn.functional.one_hot(dev, num_classes=12)
        dev.view(3, 4).sum(0).max()
    assert guard.events == []


def test_record_mode_collects_events_instead_of_raising():
    x = torch.arange(3).to("meta", non_blocking=True)
    with HostSyncGuard({"meta"}, raise_on_sync=False) as guard:
        x[x > 0] = 0                     # runs on meta (no data needed), recorded
    assert [e.op for e in guard.events] == ["Tensor.__setitem__", "aten.index_put_.default"]


def test_the_host_cannot_be_watched():
    with pytest.raises(ValueError, match="meta"):
        HostSyncGuard({"cpu"})
