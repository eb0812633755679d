"""What the encoder layer hands the attention backend: with the strided plan, views of the
packed qkv buffer (one storage, row stride 3*hidden); with the dense plan, contiguous copies.
Same kernel, same rotary placement: bit-identical outputs."""
from __future__ import annotations

import pytest
import torch

from fastdeploy_ext.conformance.qkv_trace import QkvTrace, check_views_of_projection
from fastdeploy_ext.models.paddleocr_vl.config import VisionConfig
from fastdeploy_ext.models.paddleocr_vl.metadata import MetadataBuilder
from fastdeploy_ext.models.paddleocr_vl.vision import EncoderLayer, VisionExecution
from fastdeploy_ext.ops.attention.varlen import get_backend

CFG = VisionConfig(hidden_size=144, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=56)


class Recorder:
    """The sdpa backend, recording what it is handed (same facts, same arithmetic)."""

    def __init__(self, inner):
        self.inner, self.seen = inner, []

    def __getattr__(self, name):          # the backend's facts: applies_rotary, reads_strides, ...
        return getattr(self.inner, name)

    def __call__(self, q, k, v, meta, scale, cos=None, sin=None):
        self.seen.append({n: (t.untyped_storage().data_ptr(), t.stride(), t.is_contiguous(), t.storage_offset())
                          for n, t in (("q", q), ("k", k), ("v", v))})
        return self.inner(q, k, v, meta, scale)


@pytest.fixture(scope="module")
def setup():
    torch.manual_seed(0)
    layer = EncoderLayer(CFG).eval()
    grids = [(1, 4, 6), (1, 2, 2)]
    mb = MetadataBuilder(head_dim=CFG.head_dim, rope_theta=CFG.rope_theta, merge=2, side=CFG.num_grid_per_side,
                         pos_table=torch.randn(CFG.num_grid_per_side ** 2, CFG.hidden_size),
                         compute_dtype=torch.float32, device=torch.device("cpu"))
    meta = mb.build_host(grids)
    x = torch.randn(meta.num_tokens, CFG.hidden_size)
    return layer, meta, x


def run(layer, meta, x, strided):
    rec = Recorder(get_backend("sdpa"))
    with torch.inference_mode():
        out = layer(x, meta, VisionExecution(rec, strided))
    return out, rec.seen[0]


def test_strided_plan_hands_views_of_the_qkv_buffer(setup):
    layer, meta, x = setup
    _, seen = run(layer, meta, x, strided=True)
    d, hd = CFG.hidden_size, CFG.head_dim
    storages = {seen[n][0] for n in "qkv"}
    assert len(storages) == 1                                     # one buffer: no copies
    for i, n in enumerate("qkv"):
        ptr, stride, contiguous, offset = seen[n]
        assert stride == (3 * d, hd, 1) and not contiguous
        assert offset == i * d                                    # q | k | v thirds of each row


def _traced(layer, meta, x, strided):
    trace = QkvTrace([layer.qkv.weight])
    backend = trace.recording(get_backend("sdpa"))
    with torch.inference_mode(), trace:
        layer(x, meta, VisionExecution(backend, strided))
    return trace


def test_strided_views_are_of_the_projection_output_and_a_clone_is_caught(setup, monkeypatch):
    """The views must be of the buffer the qkv projection wrote (found through its weight, the
    layer calls it through a functional): `qkv = qkv.clone()` before the views keeps one
    buffer and the strides, and must still fail."""
    layer, meta, x = setup
    check_views_of_projection(_traced(layer, meta, x, True), CFG.hidden_size, CFG.head_dim)
    original = EncoderLayer.attention
    monkeypatch.setattr(EncoderLayer, "attention", lambda self, qkv, m, ex: original(self, qkv.clone(), m, ex))
    _, seen = run(layer, meta, x, strided=True)
    assert len({seen[n][0] for n in "qkv"}) == 1                   # the old storage-only check is fooled
    with pytest.raises(AssertionError, match="copied dense|not a view of the qkv projection"):
        check_views_of_projection(_traced(layer, meta, x, True), CFG.hidden_size, CFG.head_dim)


def test_dense_plan_hands_contiguous_copies(setup):
    layer, meta, x = setup
    _, seen = run(layer, meta, x, strided=False)
    assert len({seen[n][0] for n in "qkv"}) == 3
    for n in "qkv":
        assert seen[n][2] and seen[n][1] == (CFG.num_attention_heads * CFG.head_dim, CFG.head_dim, 1)


def test_strided_and_dense_outputs_are_bit_identical(setup):
    layer, meta, x = setup
    a, _ = run(layer, meta, x, strided=True)
    b, _ = run(layer, meta, x, strided=False)
    assert torch.equal(a, b)
