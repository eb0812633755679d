"""fc1 + GELU on the CPU in bf16: oneDNN's GEMM with a GELU post-op where this CPU runs it
(asserted through the profiler's op names), ATen's two ops with a logged note where it does
not; both against an fp64 reference."""
from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile

from fastdeploy_ext import fallbacks
from fastdeploy_ext.ops import activation
from fastdeploy_ext.ops.activation import linear_gelu

USABLE, WHY = fallbacks.onednn_linear_gelu_usable(torch.bfloat16)


@pytest.fixture(autouse=True)
def fresh_log_once():
    fallbacks.log_once.cache_clear()
    yield
    fallbacks.log_once.cache_clear()


def _problem(approx_rows=96):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(approx_rows, 64, generator=g)
    w = torch.randn(160, 64, generator=g) * 0.1
    b = torch.randn(160, generator=g) * 0.1
    return x.bfloat16(), w.bfloat16(), b.bfloat16()


def _ops(fn) -> set[str]:
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    return {e.name for e in prof.events()}


@pytest.mark.parametrize("approx", ["tanh", "none"])
def test_bf16_linear_gelu_matches_fp64(approx):
    x, w, b = _problem()
    ref = F.gelu(F.linear(x.double(), w.double(), b.double()), approximate=approx)
    got = linear_gelu(x, w, b, approx)
    assert got.dtype == torch.bfloat16 and got.shape == ref.shape
    # fused: one bf16 rounding of the output (the post-op sees the fp32 accumulator), <= 2^-8
    # relative; where this CPU has no post-op (e.g. AVX2-only), ATen rounds the linear's output to
    # bf16 before the GELU too: two roundings, <= 2^-7
    rel = 2 ** -8 if USABLE else 2 ** -7
    assert ((got.double() - ref).abs() <= rel * ref.abs() + 1e-3).all(), WHY


def test_the_fused_op_runs_where_this_cpu_has_it():
    x, w, b = _problem()
    ops = _ops(lambda: linear_gelu(x, w, b, "tanh"))
    if USABLE:
        assert "mkldnn::_linear_pointwise" in ops and "aten::gelu" not in ops
    else:                                    # e.g. an AVX2-only CPU without a bf16 primitive
        assert "aten::gelu" in ops, WHY


def test_without_the_fused_op_the_gelu_is_its_own_op_and_said_so(monkeypatch, caplog):
    """Mutation: oneDNN's post-op unavailable. The two-op path runs, equal to ATen's, and the
    fallback is logged once and reaches the plan's notes."""
    caplog.set_level(logging.WARNING, logger="fastdeploy_ext.fallbacks")
    monkeypatch.setattr(activation, "onednn_linear_gelu_usable", lambda dtype: (False, "mutated away"))
    monkeypatch.setattr(fallbacks, "onednn_linear_gelu_usable", lambda dtype: (False, "mutated away"))
    x, w, b = _problem()
    ops = _ops(lambda: linear_gelu(x, w, b, "tanh"))
    assert "aten::gelu" in ops and "mkldnn::_linear_pointwise" not in ops
    assert torch.equal(linear_gelu(x, w, b, "tanh"), F.gelu(F.linear(x, w, b), approximate="tanh"))
    notes = fallbacks.fallback_notes(torch.device("cpu"), False, dtype=torch.bfloat16)
    assert notes == (fallbacks.onednn_gelu_unfused_note("mutated away"),)
    assert len([r for r in caplog.records if "mutated away" in r.getMessage()]) == 1


def test_fp32_and_cuda_style_calls_keep_the_aten_ops():
    x, w, b = (t.float() for t in _problem())
    assert torch.equal(linear_gelu(x, w, b, "tanh"), F.gelu(F.linear(x, w, b), approximate="tanh"))
    assert fallbacks.fallback_notes(torch.device("cpu"), False, dtype=torch.float32) == ()


def test_the_encoder_layer_mlp_takes_it_in_bf16():
    """The unfused layer (every CPU plan) calls it: one fused op per layer where usable."""
    from fastdeploy_ext.models.paddleocr_vl.config import VisionConfig
    from fastdeploy_ext.models.paddleocr_vl.vision import EncoderLayer
    torch.manual_seed(0)
    layer = EncoderLayer(VisionConfig(hidden_size=64, intermediate_size=160, num_attention_heads=4)).bfloat16()
    x, attn = torch.randn(2, 40, 64).bfloat16().unbind(0)
    with torch.no_grad():
        ops = _ops(lambda: layer.attn_out_and_mlp(x, attn))
        got = layer.attn_out_and_mlp(x, attn)
        ref = layer.float().attn_out_and_mlp(x.float(), attn.float())
    assert ("mkldnn::_linear_pointwise" in ops) == USABLE and ("aten::gelu" in ops) == (not USABLE)
    assert F.cosine_similarity(got.float().flatten(), ref.flatten(), dim=0) > 0.999
