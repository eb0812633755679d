"""No silent fallbacks: each fallback a run can take is in the plan's notes before the first
batch and logged once per process, by the planner and by the op that takes it."""
from __future__ import annotations

import logging

import pytest
import torch

from fastdeploy_ext import fallbacks
from fastdeploy_ext.models.paddleocr_vl import vision
from fastdeploy_ext.models.paddleocr_vl.config import VisionConfig
from fastdeploy_ext.models.paddleocr_vl.metadata import MetadataBuilder
from fastdeploy_ext.ops.attention.varlen import get_backend


@pytest.fixture(autouse=True)
def fresh_log_once():
    fallbacks.log_once.cache_clear()
    yield
    fallbacks.log_once.cache_clear()


def _records(caplog, needle):
    return [r for r in caplog.records if needle in r.getMessage()]


def test_nothing_to_say_without_fused_layers():
    assert fallbacks.fallback_notes(torch.device("cpu"), fused_layers=False) == ()


def test_fused_layers_off_the_triton_device_note_the_aten_rotary_once(caplog):
    caplog.set_level(logging.WARNING, logger="fastdeploy_ext.fallbacks")
    notes = fallbacks.fallback_notes(torch.device("cpu"), fused_layers=True)
    assert len(notes) == 1 and "q/k rotary and residual+LayerNorm run as ATen ops" in notes[0]
    fallbacks.fallback_notes(torch.device("cpu"), fused_layers=True)
    assert len(_records(caplog, "run as ATen ops")) == 1


def test_missing_addmm_activation_is_noted_on_cuda(monkeypatch, caplog):
    """Mutation: a torch without _addmm_activation (the module-level lookup patched away)."""
    caplog.set_level(logging.WARNING, logger="fastdeploy_ext.fallbacks")
    monkeypatch.setattr(fallbacks, "triton_passes_usable", lambda device: (True, "ok"))
    cuda = torch.device("cuda")
    present = fallbacks.fallback_notes(cuda, fused_layers=True)
    assert (fallbacks.GELU_UNFUSED_NOTE in present) == (not fallbacks.addmm_activation_available())
    monkeypatch.delattr(torch, "_addmm_activation", raising=False)
    assert fallbacks.fallback_notes(cuda, fused_layers=True) == (fallbacks.GELU_UNFUSED_NOTE,)
    assert len(_records(caplog, "_addmm_activation")) == 1


def test_probe_notes_reach_the_plan_notes():
    class Probe:
        notes = ("driver version unknown (NVMLError: Unknown Error)",)
    assert fallbacks.fallback_notes(torch.device("cpu"), False, Probe()) == (
        "probe: driver version unknown (NVMLError: Unknown Error)",)


def test_the_op_taking_the_rotary_fallback_logs_it_once(caplog):
    """Fused layers asked of a layer whose tensors the Triton passes cannot take (CPU, not
    interpreted): the rotary runs in ATen and says so, once."""
    from fastdeploy_ext.ops.triton import runtime
    if runtime.TRITON_INTERPRETED:
        pytest.fail("run without TRITON_INTERPRET: interpreted Triton takes CPU tensors")
    caplog.set_level(logging.WARNING, logger="fastdeploy_ext.fallbacks")
    cfg = VisionConfig(hidden_size=144, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=56)
    torch.manual_seed(0)
    layer = vision.EncoderLayer(cfg).eval()
    mb = MetadataBuilder(head_dim=cfg.head_dim, rope_theta=cfg.rope_theta, merge=2, side=cfg.num_grid_per_side,
                         pos_table=torch.randn(cfg.num_grid_per_side ** 2, cfg.hidden_size),
                         compute_dtype=torch.float32, device=torch.device("cpu"))
    meta = mb.build_host([(1, 2, 4)])
    ex = vision.VisionExecution(get_backend("sdpa"), True, fused_layers=True)
    with torch.inference_mode():
        for _ in range(2):
            layer.attention(torch.randn(meta.num_tokens, 3 * cfg.hidden_size), meta, ex)
    assert len(_records(caplog, "run as ATen ops")) == 1


def test_nvml_driver_version_failure_is_a_plan_note_logged_once(caplog):
    """Mutation: NVML's driver-version query fails (the probe still finds the GPUs): the probe
    notes it, the plan's notes carry it, and it is logged once however many plans are made."""
    from backends.cuda.probe import probe_nvidia

    from .test_probe_cuda import FakeNVML, FakeNVMLError, fake_torch

    class NoDriverVersion(FakeNVML):
        def nvmlSystemGetDriverVersion(self):
            raise FakeNVMLError("Unknown Error")

    caplog.set_level(logging.WARNING, logger="fastdeploy_ext.fallbacks")
    healthy = probe_nvidia(nvml_module=FakeNVML(), torch_module=fake_torch(True))
    assert healthy.notes == () and fallbacks.fallback_notes(torch.device("cpu"), False, healthy) == ()
    probe = probe_nvidia(nvml_module=NoDriverVersion(), torch_module=fake_torch(True))
    assert probe.present and probe.driver_version is None
    expected = "probe: driver version unknown (FakeNVMLError: Unknown Error)"
    for _ in range(3):
        assert expected in fallbacks.fallback_notes(torch.device("cpu"), False, probe)
    assert len(_records(caplog, "driver version unknown")) == 1
