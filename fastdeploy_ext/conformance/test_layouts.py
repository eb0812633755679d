"""Plan variants that must not change results: strided == dense qkv bitwise (same kernel, same
rotary placement) and host == device metadata bitwise (two separate code paths)."""
from __future__ import annotations

import pytest
import torch

from ..capabilities import capability_table
from ..plan import PlanError


@pytest.fixture(scope="module")
def batch(tiny_models, batch_for):
    return batch_for(tiny_models["torch"])


def test_strided_equals_dense_bitwise(tiny_models, batch, make_runner):
    dense = make_runner(tiny_models["torch"], qkv_layout="dense")
    backend = dense.plan.attention.value
    entry = {e.backend: e for e in capability_table()[dense.plan.row].attention}[backend]
    if not entry.reads_strides:
        # the row forbids strided for its kernel: forcing it must be a clear error naming the row
        with pytest.raises(PlanError, match=dense.plan.row):
            make_runner(tiny_models["torch"], qkv_layout="strided", attention_backend=backend)
        assert dense.plan.qkv_layout.value == "dense"
        return
    strided = make_runner(tiny_models["torch"], qkv_layout="strided", attention_backend=backend)
    assert strided.plan.strided_qkv and not dense.plan.strided_qkv
    a, b = strided.encode_images(batch), dense.encode_images(batch)
    for x, y in zip(a, b):
        assert torch.equal(x, y), float((x.float() - y.float()).abs().max())


def test_host_metadata_equals_device_metadata_bitwise(tiny_models, batch, make_runner):
    host = make_runner(tiny_models["torch"], grid_thw="host")
    dev = make_runner(tiny_models["torch"], grid_thw="device")
    mh = host.build_metadata(batch.grid_thw, "host")
    md = dev.build_metadata(batch.grid_thw, "device")
    assert (mh.source, md.source) == ("host", "device")
    assert mh.num_tokens == md.num_tokens and mh.seq_lens == md.seq_lens and mh.max_seqlen == md.max_seqlen
    assert mh.out_split_sizes == md.out_split_sizes and mh.grids == md.grids
    for field in ("cu_seqlens", "cos", "sin", "pos_embed", "merge_index"):
        a, b = getattr(mh, field), getattr(md, field)
        assert a.dtype == b.dtype and a.shape == b.shape, field
        assert torch.equal(a, b), field
    for k in mh.extras:
        assert torch.equal(mh.extras[k], md.extras[k]), k
    for x, y in zip(host.encode_images(batch), dev.encode_images(batch)):
        assert torch.equal(x, y)


def test_pos_embed_cache_hits_on_repeated_sizes(tiny_models, batch, make_runner):
    runner = make_runner(tiny_models["torch"], grid_thw="host")
    first = runner.encode_images(batch)
    stats = runner.meta_builder.cache.stats
    misses = stats.misses
    again = runner.encode_images(batch)
    assert stats.misses == misses and stats.hits >= len(batch.grid_thw)
    for x, y in zip(first, again):
        assert torch.equal(x, y)
