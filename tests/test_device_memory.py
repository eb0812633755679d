"""The KV pool is sized from the backend's free-memory hook (DeviceRunner.device_memory), not from
the torch device type: a backend that answers gets free - (1 - utilization) x total - the profiled
step peak; one that cannot gets --kv-cache-memory or the default, with the reason naming it."""
from __future__ import annotations

from fastdeploy_ext.engine.config import DEFAULT_CPU_KV_CACHE_BYTES, EngineConfig
from fastdeploy_ext.engine.input_processor import InputLimits, InputProcessor
from fastdeploy_ext.engine.llm_engine import LLMEngine
from fastdeploy_ext.models.paddleocr_vl.processor import ImageProcessor, PreprocessorConfig
from fastdeploy_ext.runner import DeviceRunner

from .engine_fakes import FakePromptBuilder, FakeRunner

MiB = 1 << 20


class MeasuredRunner(FakeRunner):
    """A fake backend that answers the memory query (a host-side device: nothing about it is CUDA)."""
    name = "measured"

    def __init__(self, free: int, total: int, peak: int):
        super().__init__()
        self.memory, self.peak, self.profiled = (free, total), peak, 0

    def device_memory(self):
        return self.memory

    def profile_peak_memory(self, *a):
        self.profiled += 1
        return self.peak


def _engine(runner, reserved_memory=None, **kw):
    cfg = EngineConfig(max_model_len=64, preprocess_workers=1, **kw)
    proc = InputProcessor(FakePromptBuilder(), ImageProcessor(PreprocessorConfig()),
                          InputLimits(1, cfg.max_encoder_patches, cfg.max_model_len))
    return LLMEngine(cfg, runner=runner, input_processor=proc, reserved_memory=reserved_memory)


def test_pool_follows_the_backends_memory_hook():
    runner = MeasuredRunner(free=60 * MiB, total=100 * MiB, peak=10 * MiB)
    eng = _engine(runner, gpu_memory_utilization=0.9)
    spec = runner.kv_cache_spec()
    assert runner.profiled == 1
    assert eng.kv_decision.value == (60 - 10 - 10) * MiB // spec.bytes_per_block
    assert "free 0.06 GiB - (1 - 0.9) x total 0.10 GiB - profiled step peak 0.01 GiB" in eng.kv_decision.reason


def test_a_backend_without_the_hook_gets_the_default_with_its_name():
    runner = FakeRunner()
    eng = _engine(runner)
    assert eng.kv_decision.value == DEFAULT_CPU_KV_CACHE_BYTES // runner.kv_cache_spec().bytes_per_block
    assert "(default: the FakeRunner backend has no free-memory query)" in eng.kv_decision.reason


def test_an_explicit_kv_budget_skips_the_query():
    runner = MeasuredRunner(free=60 * MiB, total=100 * MiB, peak=10 * MiB)
    eng = _engine(runner, kv_cache_memory=8 * MiB)
    assert runner.profiled == 0 and eng.kv_decision.value == 8 * MiB // runner.kv_cache_spec().bytes_per_block
    assert eng.kv_decision.reason.startswith("--kv-cache-memory 0.01 GiB")


def test_the_interface_default_is_no_query():
    assert DeviceRunner.device_memory(object()) is None      # the base hook: "cannot tell"
