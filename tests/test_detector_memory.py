"""The parsing pipeline's engine keeps the layout detector's memory out of its KV pool: the
coordinator measures one detector batch at the pipeline's layout batch size (the device API's
allocator statistics, faked here) before the engine reads free memory, and the engine's logged
Decision names the reservation. Nothing here is CUDA: the device API and memory query are fakes."""
from __future__ import annotations

import logging

import numpy as np
import pytest
import torch

from fastdeploy_ext.engine import llm_engine
from fastdeploy_ext.engine.config import EngineConfig
from fastdeploy_ext.memory_profile import detector_reservation
from fastdeploy_ext.parsing import coordinator
from fastdeploy_ext.parsing.options import ParseOptions
from fastdeploy_ext.plan import Decision

from .test_device_memory import MiB, MeasuredRunner, _engine


class CountingAPI:
    """A device API with allocator statistics: bytes the fake detector allocates are counted."""
    name = "counting"
    allocator_stats = True

    def __init__(self, weights: int):
        self.allocated = self.peak = weights
        self.calls: list[str] = []

    def allocated_bytes(self):
        return self.allocated

    def peak_allocated_bytes(self):
        return self.peak

    def reset_peak_allocated(self):
        self.calls.append("reset")
        self.peak = self.allocated

    def synchronize(self):
        pass

    def empty_cache(self):
        self.calls.append("empty")


class FakeLayout:
    """A loaded layout model whose pass allocates ``per_page`` bytes per page, then frees them."""

    def __init__(self, api, per_page: int):
        self.runner = type("R", (), {})()
        self.runner.device_api = api
        self.runner.detector = torch.nn.Linear(16, 16)        # 272 float32 parameters
        self.per_page, self.batches = per_page, []

    def detect(self, images, threshold):
        assert all(isinstance(i, np.ndarray) and i.shape[2] == 3 for i in images)
        self.batches.append((len(images), images[0].shape[:2]))
        api = self.runner.device_api
        api.peak = max(api.peak, api.allocated + self.per_page * len(images))
        return [[] for _ in images]


def test_reservation_is_one_measured_batch_at_the_layout_batch_size():
    api = CountingAPI(weights=5 * MiB)
    layout = FakeLayout(api, per_page=MiB)
    d = detector_reservation(layout, 6, (1684, 1191))
    assert d.value == 6 * MiB and layout.batches == [(6, (1684, 1191))]
    assert "batch of 6 pages 1191x1684" in d.reason and "already out of free memory" in d.reason
    assert api.calls[-1] == "empty"          # the pass's cache returned before the engine reads free


def test_no_allocator_statistics_reserves_nothing_and_says_why():
    api = CountingAPI(weights=0)
    api.allocator_stats = False
    api.name = "host"
    layout = FakeLayout(api, per_page=MiB)
    d = detector_reservation(layout, 8, (100, 100))
    assert d.value == 0 and layout.batches == [] and "host device API reports no allocator statistics" in d.reason


@pytest.fixture
def measured_engine(monkeypatch):
    """build_engine's LLMEngine on a fake backend answering free 60 / total 100 MiB, step peak 10."""
    runner = MeasuredRunner(free=60 * MiB, total=100 * MiB, peak=10 * MiB)

    def make(cfg, reserved_memory=None):          # the fake backend in place of the config's runner
        return _engine(runner, gpu_memory_utilization=0.9, reserved_memory=reserved_memory)
    monkeypatch.setattr(llm_engine, "LLMEngine", make)
    return runner


def _opts(**kw):
    return ParseOptions(load_format="dummy", engine=EngineConfig(max_model_len=64), **kw)


def test_pipeline_engine_kv_budget_shrinks_by_the_detector_batch(measured_engine, caplog):
    bpb = measured_engine.kv_cache_spec().bytes_per_block
    without = coordinator.build_engine(_opts(layout_batch=4))
    assert without.kv_decision.value == (60 - 10 - 10) * MiB // bpb
    layout = FakeLayout(CountingAPI(weights=3 * MiB), per_page=2 * MiB)
    with caplog.at_level(logging.INFO, logger="fastdeploy_ext"):
        eng = coordinator.build_engine(_opts(layout_batch=4, dpi=72), layout)
    h, w = coordinator.a4_page_hw(72)
    assert layout.batches == [(4, (h, w))] and (h, w) == (842, 595)
    assert eng.kv_decision.value == (60 - 10 - 10 - 8) * MiB // bpb
    assert "- reserved 0.01 GiB for the layout detector's pass over a batch of 4 pages 595x842" in eng.kv_decision.reason
    logged = [r.getMessage() for r in caplog.records if "memory reserved beside the engine" in r.getMessage()]
    assert logged and logged[0].startswith("memory reserved beside the engine: 8.0 MiB (the layout detector's pass")


def test_a_detector_batch_too_big_for_the_pool_is_refused_naming_it(measured_engine):
    """Broken on purpose: a layout batch whose pass needs what the KV pool had left."""
    layout = FakeLayout(CountingAPI(weights=0), per_page=20 * MiB)
    with pytest.raises(ValueError, match=r"fewer than one sequence.*reserved 0\.04 GiB for the layout detector"):
        coordinator.build_engine(_opts(layout_batch=2), layout)


def test_reservation_ignored_with_an_explicit_kv_budget(caplog):
    runner = MeasuredRunner(free=60 * MiB, total=100 * MiB, peak=10 * MiB)
    with caplog.at_level(logging.INFO, logger="fastdeploy_ext"):
        eng = _engine(runner, kv_cache_memory=8 * MiB, reserved_memory=Decision(4 * MiB, "the layout detector's pass"))
    assert eng.kv_decision.value == 8 * MiB // runner.kv_cache_spec().bytes_per_block
    assert any("not applied: the KV pool is not sized from free memory" in r.getMessage() for r in caplog.records)


def _served_engine(runner, service=None):
    """The server's AsyncLLMEngine on the fake backend, with the job service's layout reservation
    wired as api_server does (``reserve_memory``), started and stopped: its LLMEngine."""
    import asyncio

    from fastdeploy_ext.engine.async_engine import AsyncLLMEngine
    from fastdeploy_ext.engine.input_processor import InputLimits, InputProcessor
    from fastdeploy_ext.models.paddleocr_vl.processor import ImageProcessor, PreprocessorConfig

    from .engine_fakes import FakePromptBuilder
    cfg = EngineConfig(max_model_len=64, preprocess_workers=1, gpu_memory_utilization=0.9)
    proc = InputProcessor(FakePromptBuilder(), ImageProcessor(PreprocessorConfig()),
                          InputLimits(1, cfg.max_encoder_patches, cfg.max_model_len))
    eng = AsyncLLMEngine(cfg, runner=runner, input_processor=proc)
    if service is not None:
        eng.reserve_memory = service.layout_reservation

    async def run():
        await eng.start()
        await eng.shutdown()
    asyncio.run(run())
    return eng.engine


def test_the_servers_kv_pool_leaves_the_job_layout_models_batch_free(tmp_path):
    """With the job API on, the layout model is built before the served engine sizes its pool and
    one layout batch over A4 pages is kept free, as in `parse`; without the service's reservation
    (the check can fail) the pool takes that memory too."""
    from fastdeploy_ext.entrypoints.openai.jobs import JobsConfig, JobService, SerialLayout
    runner = MeasuredRunner(free=60 * MiB, total=100 * MiB, peak=10 * MiB)
    bpb = runner.kv_cache_spec().bytes_per_block
    assert _served_engine(runner).kv_decision.value == (60 - 10 - 10) * MiB // bpb
    svc = JobService(JobsConfig(jobs_dir=tmp_path / "jobs"), ParseOptions(load_format="dummy", layout_batch=4, dpi=72),
                     engine=None)
    layout = FakeLayout(CountingAPI(weights=3 * MiB), per_page=2 * MiB)
    svc._models = ("renderer", SerialLayout(layout))        # what _build made (the first job reuses it)
    eng = _served_engine(runner, svc)
    assert layout.batches == [(4, coordinator.a4_page_hw(72))]
    assert eng.kv_decision.value == (60 - 10 - 10 - 8) * MiB // bpb
    assert "reserved 0.01 GiB for the layout detector's pass over a batch of 4 pages 595x842" in eng.kv_decision.reason
    assert svc._build() == ("renderer", svc._models[1])       # built once: jobs run on the same models


def test_a_service_without_a_vlm_reserves_nothing(tmp_path):
    from fastdeploy_ext.entrypoints.openai.jobs import JobsConfig, JobService
    svc = JobService(JobsConfig(jobs_dir=tmp_path / "jobs"), ParseOptions(stub_vlm=True), engine=None)
    assert svc.layout_reservation() is None and svc._models is None
