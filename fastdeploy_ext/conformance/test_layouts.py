"""Plan variants that must not change results: strided == dense qkv bitwise (same kernel, same
rotary placement) and host == device metadata bitwise (two separate code paths). And what
strided means: the kernel reads views of the qkv projection's own output (qkv_trace.py, which
reads PaddleOCR-VL's encoder structure). For families with FamilyFact.QKV_STRIDED and
GRID_THW_LAYOUTS."""
from __future__ import annotations

import pytest
import torch

from ..capabilities import capability_table
from ..plan import PlanError, QkvLayout
from .family_fixture import FamilyFact
from .qkv_trace import check_views_of_projection, trace_encoder

QKV_STRIDED = pytest.mark.fdx_family_fact(FamilyFact.QKV_STRIDED)
GRID_LAYOUTS = pytest.mark.fdx_family_fact(FamilyFact.GRID_THW_LAYOUTS)


@pytest.fixture(scope="module")
def batch(tiny_models, batch_for):
    return batch_for(tiny_models["torch"])


@QKV_STRIDED
def test_strided_equals_dense_bitwise(tiny_models, batch, make_runner):
    dense = make_runner(tiny_models["torch"], qkv_layout="dense")
    backend = dense.plan.attention.value
    entry = {e.backend: e for e in capability_table()[dense.plan.row].attention}[backend]
    if not dense.execution.attention.reads_strides or entry.reads_strides is False:
        # the row forbids strided for its kernel: forcing it must be a clear error naming the row
        with pytest.raises(PlanError, match=dense.plan.row):
            make_runner(tiny_models["torch"], qkv_layout="strided", attention_backend=backend)
        assert dense.plan.qkv_layout.value is QkvLayout.DENSE
        return
    strided = make_runner(tiny_models["torch"], qkv_layout="strided", attention_backend=backend)
    assert strided.plan.strided_qkv and not dense.plan.strided_qkv
    a, b = strided.encode_images(batch), dense.encode_images(batch)
    for x, y in zip(a, b):
        assert torch.equal(x, y), float((x.float() - y.float()).abs().max())


@GRID_LAYOUTS
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
    # the attention backend's per-batch state (e.g. the Triton block table), from either path
    if mh.attention_state is not None or md.attention_state is not None:
        assert torch.equal(mh.attention_state, md.attention_state)
    for x, y in zip(host.encode_images(batch), dev.encode_images(batch)):
        assert torch.equal(x, y)


@GRID_LAYOUTS
def test_pos_embed_cache_hits_on_repeated_sizes(tiny_models, batch, make_runner):
    runner = make_runner(tiny_models["torch"], grid_thw="host")
    first = runner.encode_images(batch)
    stats = runner.meta_builder.cache.stats
    misses = stats.misses
    again = runner.encode_images(batch)
    assert stats.misses == misses and stats.hits >= len(batch.grid_thw)
    for x, y in zip(first, again):
        assert torch.equal(x, y)


def _strided_allowed(runner) -> bool:
    entry = {e.backend: e for e in capability_table()[runner.plan.row].attention}[runner.plan.attention.value]
    return entry.reads_strides


def _check(runner, batch) -> list[str]:
    vc = runner.cfg.vision
    return check_views_of_projection(trace_encoder(runner, batch), vc.hidden_size, vc.head_dim)


@QKV_STRIDED
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_strided_qkv_are_views_of_the_projection_output(dtype, tiny_models, batch, make_runner, backend_cls,
                                                        record_property):
    """On the row's default plan for each dtype it lists: strided -> the kernel reads views of
    the buffer the qkv projection wrote, nothing copies it dense; dense -> the check sees copies."""
    row = backend_cls.select_row(backend_cls.probe(), capability_table())[0]
    if dtype not in row.dtypes:
        with pytest.raises(PlanError, match=row.name):
            make_runner(tiny_models["torch"], dtype=dtype)
        return
    runner = make_runner(tiny_models["torch"], dtype=dtype)
    if runner.plan.strided_qkv:
        conversions = _check(runner, batch)
        record_property(f"qkv_{dtype}_conversions", conversions)
        print(f"[{runner.plan.row}] {dtype} strided, fused_layers={runner.plan.fused_layers.value}: views of the "
              f"projection output; conversions of the buffer for fp32 math: {conversions or 'none'}")
    else:
        with pytest.raises(AssertionError, match="copied dense|not a view of the qkv projection"):
            _check(runner, batch)


@QKV_STRIDED
def test_a_clone_before_the_views_fails_the_check(tiny_models, batch, make_runner, monkeypatch):
    """Mutation: `qkv = qkv.clone()` inserted before the layer takes its views. The kernel still
    gets q/k/v of one buffer with the strided layout's strides, but not the projection's."""
    dense = make_runner(tiny_models["torch"], qkv_layout="dense")
    if not _strided_allowed(dense):
        # this row never hands views: the check must reject its dense copies (the same property)
        with pytest.raises(AssertionError, match="copied dense|not a view of the qkv projection"):
            _check(dense, batch)
        return
    runner = make_runner(tiny_models["torch"], qkv_layout="strided", attention_backend=dense.plan.attention.value)
    _check(runner, batch)                                   # unmodified: passes
    layer_cls = type(runner.model.encoder.layers[0])       # the structure qkv_trace reads
    original = layer_cls.attention
    monkeypatch.setattr(layer_cls, "attention", lambda self, qkv, meta, ex: original(self, qkv.clone(), meta, ex))
    with pytest.raises(AssertionError, match="copied dense|not a view of the qkv projection"):
        _check(runner, batch)
