"""Host and device metadata paths on awkward batches (multi-frame grids, 1-patch-wide merges,
many sizes), against each other bitwise and against transformers numerically."""
from __future__ import annotations

import pytest
import torch

from fastdeploy_ext.conformance.tiny_model import reference_image_features
from fastdeploy_ext.models.paddleocr_vl.loader import load_vision
from fastdeploy_ext.models.paddleocr_vl.metadata import BatchError, MetadataBuilder, validate_grids
from fastdeploy_ext.models.paddleocr_vl.vision import VisionExecution
from fastdeploy_ext.ops.attention.varlen import get_backend
from fastdeploy_ext.ops.pos_embed import LFUCache

CPU = torch.device("cpu")
GRIDS = [(2, 4, 6), (1, 2, 2), (1, 12, 2), (1, 2, 14), (3, 2, 4)]


@pytest.fixture(scope="module")
def model(tiny_dirs):
    return load_vision(tiny_dirs["torch"], dtype=torch.float32, device=CPU)


def builder(model, cfg, cache=64):
    vc = cfg.vision
    return MetadataBuilder(head_dim=vc.head_dim, rope_theta=vc.rope_theta, merge=vc.spatial_merge_size,
                           side=vc.num_grid_per_side, pos_table=model.encoder.position_embedding.detach(),
                           compute_dtype=torch.float32, device=CPU, cache_capacity=cache)


def test_host_equals_device_on_multi_frame_batches(model):
    m, cfg, _ = model
    host = builder(m, cfg).build_host(GRIDS)
    dev = builder(m, cfg).build_device(torch.tensor(GRIDS))
    assert host.seq_lens == dev.seq_lens == [24, 24, 4, 24, 28, 8, 8, 8]
    assert host.out_split_sizes == dev.out_split_sizes == [12, 1, 6, 7, 6]
    for f in ("cu_seqlens", "cos", "sin", "pos_embed", "merge_index"):
        assert torch.equal(getattr(host, f), getattr(dev, f)), f


def test_multi_frame_batch_matches_transformers(model, tiny_dirs):
    m, cfg, _ = model
    n = sum(t * h * w for t, h, w in GRIDS)
    px = torch.randn(n, 3, 14, 14, generator=torch.Generator().manual_seed(3))
    ref = reference_image_features(tiny_dirs["torch"], px, GRIDS)
    meta = builder(m, cfg).build_host(GRIDS)
    with torch.inference_mode():
        out = m(px.reshape(n, -1), meta, VisionExecution(get_backend("sdpa"), True)).split(meta.out_split_sizes)
    for o, r in zip(out, ref):
        assert o.shape == r.shape and float((o - r).abs().max()) <= 1e-4


def test_lfu_cache_evicts_the_least_used():
    c: LFUCache[str, int] = LFUCache(2)
    c.get_or_create("a", lambda: 1)
    c.get_or_create("a", lambda: 1)
    c.get_or_create("b", lambda: 2)
    c.get_or_create("c", lambda: 3)            # evicts b (used once) rather than a (twice)
    assert "a" in c and "c" in c and "b" not in c and c.stats.evictions == 1
    assert c.get_or_create("a", lambda: 99) == 1 and c.stats.hits == 2
    off = LFUCache(0)
    assert off.get_or_create("x", lambda: 5) == 5 and len(off) == 0


def test_cache_capacity_bounds_entries(model):
    m, cfg, _ = model
    b = builder(m, cfg, cache=2)
    b.build_host(GRIDS)
    assert len(b.cache) == 2 and b.cache.stats.evictions >= 3


@pytest.mark.parametrize("grids,msg", [([], "empty"), ([(1, 3, 4)], "divisible"), ([(0, 2, 2)], "non-positive"),
                                       ([(1, 2)], "t, h, w")])
def test_grid_validation(grids, msg):
    with pytest.raises(BatchError, match=msg):
        validate_grids(grids, 2)
