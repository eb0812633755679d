"""The device API (fastdeploy_ext/device_api.py) is what graphs, uploads, memory profiling and the
benchmarks' timers go through (runs on any CPU).

A recording fake API with a graph that "replays" by re-running the captured forward on the static
buffers stands in for a GPU: encoder and decode graphs then give the eager results through the
hooks alone, with every torch.cuda entry point they used to call made to fail. The CUDA API is
constructed and inspected here; its calls run on the GPU legs.
"""
from __future__ import annotations

import dataclasses
import logging
import types

import pytest
import torch

from backends.cuda.device_api import CudaDeviceAPI
from fastdeploy_ext import device_api as device_api_module
from fastdeploy_ext.device_api import DeviceAPI, device_api_for, register_device_api
from fastdeploy_ext.engine.step import SeqStep, StepBatch
from fastdeploy_ext.graphs import EncoderGraphs
from fastdeploy_ext.models.paddleocr_vl.config import TextConfig
from fastdeploy_ext.models.paddleocr_vl.text import ErnieTextModel
from fastdeploy_ext.ops.attention.paged import PAGED_ATTENTION_BACKENDS
from fastdeploy_ext.plan import EncoderGraphPath
from fastdeploy_ext.text_runner import DecodeGraphs, TextStepRunner
from fastdeploy_ext.transfer import upload

CUDA_ENTRY_POINTS = ("synchronize", "empty_cache", "memory_reserved", "memory_allocated", "max_memory_allocated",
                     "reset_peak_memory_stats", "graph_pool_handle", "Stream", "CUDAGraph", "graph", "stream",
                     "current_stream", "Event", "mem_get_info")


@pytest.fixture
def no_torch_cuda(monkeypatch):
    """Every torch.cuda entry point the graph / profiling / staging code once called, failing."""
    def refuse(name):
        def call(*a, **k):
            raise AssertionError(f"torch.cuda.{name} called outside the device API")
        return call
    for name in CUDA_ENTRY_POINTS:
        monkeypatch.setattr(torch.cuda, name, refuse(name))


class FakeGraph:
    def __init__(self, forward, out):
        self.forward, self.out, self.replays = forward, out, 0

    def replay(self):
        self.replays += 1
        res = self.forward()
        self.out.copy_(res)


class FakeEvent:
    def __init__(self, calls):
        self.calls = calls

    def record(self):
        self.calls.append("event.record")

    def synchronize(self):
        self.calls.append("event.synchronize")


class RecordingAPI(DeviceAPI):
    """A host device that claims graphs and allocator statistics, recording every hook call."""
    name = "recording"
    allocator_stats = True
    supports_graphs = True

    def __init__(self, device="cpu"):
        super().__init__(device)
        self.calls: list[str] = []
        self.captured: list[FakeGraph] = []
        self.pools: list[object] = []

    def _rec(self, name):
        self.calls.append(name)

    def synchronize(self):
        self._rec("synchronize")

    def empty_cache(self):
        self._rec("empty_cache")

    def allocated_bytes(self):
        self._rec("allocated_bytes")
        return 1000 + 10 * len(self.captured)

    def reserved_bytes(self):
        self._rec("reserved_bytes")
        return 5000 + 100 * len(self.captured)

    def peak_allocated_bytes(self):
        self._rec("peak_allocated_bytes")
        return 7000

    def reset_peak_allocated(self):
        self._rec("reset_peak_allocated")

    def pin(self, t):
        self._rec("pin")
        return t

    def transfer_event(self):
        self._rec("transfer_event")
        return FakeEvent(self.calls)

    def graph_pool(self):
        self._rec("graph_pool")
        pool = object()
        self.pools.append(pool)
        return pool

    def new_stream(self):
        self._rec("new_stream")
        return "side-stream"

    def capture_graph(self, forward, pool, stream=None, warmup=2):
        assert pool is self.pools[-1]
        self._rec(f"capture_graph(stream={stream})")
        for _ in range(warmup):
            forward()
        out = forward()
        g = FakeGraph(forward, out)
        self.captured.append(g)
        return g, out


# ------------------------------------------------------------------ decode graphs
def _text_runner(api):
    cfg = TextConfig(num_hidden_layers=1, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                     num_key_value_heads=2, head_dim=16, vocab_size=64, mrope_section=(2, 3, 3))
    torch.manual_seed(0)
    model = ErnieTextModel(cfg, tied=True).eval()
    r = TextStepRunner(model, PAGED_ATTENTION_BACKENDS["sdpa_paged"], block_size=16, device=torch.device("cpu"),
                       dtype=torch.float32, image_token_id=63, device_api=api)
    r.init_kv_cache(8)
    return r


def test_decode_graphs_stage_capture_and_replay_through_the_device_api(no_torch_cuda):
    api = RecordingAPI()
    r = _text_runner(api)
    assert r.upload == api.stage_and_upload          # the step's uploads: the API's bound method
    dg = DecodeGraphs(r, (1, 2, 4), max_model_len=64)
    assert api.calls.count("pin") == 3 and "transfer_event" in api.calls    # the three staging buffers
    api.calls.clear()
    info = dg.capture()
    assert api.calls[:2] == ["graph_pool", "allocated_bytes"]
    assert api.calls.count("capture_graph(stream=None)") == 3 and len(api.pools) == 1   # one pool, all buckets
    assert api.calls[-2:] == ["synchronize", "allocated_bytes"] and info["memory_bytes"] == 30
    assert set(dg.graphs) == {1, 2, 4} and all(isinstance(g, FakeGraph) for g in dg.graphs.values())

    step = StepBatch(False, [SeqStep(0, [5], 20, [3, 1], None, rope_delta=-2),
                             SeqStep(1, [9], 7, [2], None, rope_delta=0),
                             SeqStep(2, [11], 33, [4, 5, 0], None, rope_delta=1)])
    kv = (r.kv.k.clone(), r.kv.v.clone())
    eager = r.forward(r.build_inputs(step))
    r.kv.k.copy_(kv[0])
    r.kv.v.copy_(kv[1])
    api.calls.clear()
    replayed = dg.run(step)
    assert dg.graphs[4].replays == 1                  # batch 3 padded to the bucket of 4
    assert api.calls == ["event.synchronize", "event.record"]
    torch.testing.assert_close(replayed, eager)


def test_decode_graphs_on_the_host_api_refuse_to_capture_naming_it():
    r = _text_runner(None)
    assert type(r.device_api) is DeviceAPI
    dg = DecodeGraphs(r, (1, 2), max_model_len=32)     # staging still works (the host buffers)
    with pytest.raises(RuntimeError, match="the host device API has no graphs"):
        dg.capture()


# ------------------------------------------------------------------ encoder graphs
class _Buffers:
    def __init__(self, tokens, dim):
        self.pixels = torch.zeros(tokens, dim)
        self.meta = None

    def load(self, pixels, meta):
        self.pixels.zero_()
        self.pixels[:pixels.shape[0]].copy_(pixels)

    def outputs(self, n):
        return n


def _encoder_runner(api, dim=4):
    def model(pixels, meta, execution):
        return pixels * 2 + 1
    attention = types.SimpleNamespace(name="fake", graph_safe=True, graph_state=lambda *a: None)
    return types.SimpleNamespace(
        device=torch.device("cpu"), dtype=torch.float32, device_api=api, cfg=None, model=model,
        execution=types.SimpleNamespace(attention=attention),
        family=types.SimpleNamespace(graph_buffers=lambda cfg, tokens, state, device, dtype: _Buffers(tokens, dim)),
        meta_builder=types.SimpleNamespace(build_host=lambda grids: types.SimpleNamespace(
            num_tokens=sum(t * h * w for t, h, w in grids))))


def test_encoder_graphs_capture_on_one_pool_and_stream_and_replay_through_the_device_api(no_torch_cuda):
    api = RecordingAPI()
    runner = _encoder_runner(api)
    path = EncoderGraphPath("blocks", 8, 32, 32, 4)
    graphs = EncoderGraphs(runner, (path,))
    report = graphs.capture()
    assert api.calls[:4] == ["synchronize", "empty_cache", "reserved_bytes", "graph_pool"]
    assert api.calls.count("new_stream") == 1 and api.calls.count("capture_graph(stream=side-stream)") == 3
    assert api.calls[-3:] == ["synchronize", "empty_cache", "reserved_bytes"]
    assert report.captured == 3 and report.graph_memory_bytes == 300
    pixels = torch.randn(12, 4)
    with torch.inference_mode():                         # as TorchRunner.encode_uploaded runs it
        out = graphs.run(pixels, [(1, 2, 3), (1, 2, 3)])  # 12 patches: padded to the budget of 16
    torch.testing.assert_close(out, pixels * 2 + 1)
    assert graphs.stats.hits == 1 and graphs.stats.padded_tokens == 4


def test_encoder_graphs_need_a_device_api_with_graphs():
    with pytest.raises(RuntimeError, match="encoder graphs need a device with a graph API; the host device API"):
        EncoderGraphs(_encoder_runner(DeviceAPI(torch.device("cpu"))), (EncoderGraphPath("b", 8, 8, 8, 1),))


# ------------------------------------------------------------------ the registry, uploads, profiling, timing
def test_cuda_is_registered_by_the_cuda_backend_and_the_host_keeps_its_own():
    api = device_api_for("cuda:0")
    assert isinstance(api, CudaDeviceAPI) and api.device == torch.device("cuda", 0)
    assert api.allocator_stats and api.supports_graphs and api.memory_query().value
    assert device_api_for("cuda:0") is api                       # one instance per device
    assert type(device_api_for("cpu")) is DeviceAPI and type(device_api_for("meta")) is DeviceAPI
    assert not device_api_for("cpu").memory_query().value
    assert "--kv-cache-memory" in device_api_for("cpu").memory_query().reason


def test_an_unregistered_device_type_runs_on_the_host_api_and_says_so(monkeypatch, caplog):
    monkeypatch.setattr(device_api_module, "_BY_TYPE", dict(device_api_module._BY_TYPE))
    monkeypatch.setattr(device_api_module, "_INSTANCES", {})
    with caplog.at_level(logging.WARNING, logger="fastdeploy_ext.device_api"):
        api = device_api_for("xpu")
    assert type(api) is DeviceAPI
    assert "device type xpu: no backend registered a device API" in caplog.text
    register_device_api("xpu", RecordingAPI)                     # a backend registering later wins
    assert isinstance(device_api_for("xpu"), RecordingAPI)


def test_transfer_upload_asks_the_device_api(monkeypatch):
    monkeypatch.setattr(device_api_module, "_INSTANCES", {})
    seen = []
    monkeypatch.setattr(DeviceAPI, "stage_and_upload", lambda self, t: seen.append(self.device) or t.to(self.device))
    t = torch.arange(4)
    assert upload(t, torch.device("meta")).device.type == "meta" and seen == [torch.device("meta")]


def test_memory_profile_measures_through_the_device_api(monkeypatch, no_torch_cuda):
    """The measured path (allocator statistics) on a fake runner: the peak is read from the API."""
    from fastdeploy_ext import memory_profile
    api = RecordingAPI()
    text = types.SimpleNamespace(kv=None, block_size=16, execute=lambda step: None)

    def init_kv_cache(n):
        text.kv = types.SimpleNamespace(k=torch.zeros(2, 2), v=None)

    def free_kv_cache():
        text.kv = None
    text.init_kv_cache, text.free_kv_cache = init_kv_cache, free_kv_cache
    vision = types.SimpleNamespace(spatial_merge_size=2, num_channels=3, patch_size=2)
    from fastdeploy_ext.models.paddleocr_vl.family import PaddleOCRVLFamily
    runner = types.SimpleNamespace(device_api=api, device=torch.device("cpu"), _require_text=lambda: text,
                                   family=PaddleOCRVLFamily(), cfg=types.SimpleNamespace(vision=vision),
                                   encode_images=lambda batch: None)
    peak = memory_profile.profile_peak_memory(runner, 32, 16)
    assert peak == 7000 - 1000                      # peak_allocated_bytes - allocated_bytes at the reset
    assert api.calls.count("reset_peak_allocated") == 2 and api.calls[-1] == "empty_cache"


def test_the_host_api_estimates_memory_and_times_with_perf_counter(monkeypatch):
    from fastdeploy_ext.bench.timing import call_times_ms
    api = DeviceAPI(torch.device("cpu"))
    with pytest.raises(RuntimeError, match="no allocator statistics"):
        api.peak_allocated_bytes()
    assert api.memory() is None and api.memory_stats()["kind"] == "host RSS (peak)"
    calls = []
    times = call_times_ms(lambda: calls.append(1), 2, 3, api)
    assert len(calls) == 5 and len(times) == 3 and all(t >= 0 for t in times)


def test_benchmark_timers_come_from_the_device_api():
    from fastdeploy_ext.bench.timing import median_ms
    api = RecordingAPI()
    api.time_ms = lambda fn: (fn(), 4.0)[1]
    assert median_ms(lambda: None, 1, 3, api) == 4.0 and api.calls == ["synchronize"]


def test_the_cuda_api_keeps_the_fallback_note_and_the_sync_guard_choice(monkeypatch):
    api = CudaDeviceAPI(torch.device("cuda", 0))
    import fastdeploy_ext.fallbacks as fb
    monkeypatch.setattr(torch, "_addmm_activation", None, raising=False)
    assert api.fallback_notes(True) == (fb.GELU_UNFUSED_NOTE,) and api.fallback_notes(False) == ()
    # the sync guard: the CUDA API's is cuda_host_sync_guard, the host API's the op-level guard
    import fastdeploy_ext.sync_guard as sg
    monkeypatch.setattr(sg, "cuda_host_sync_guard", lambda: "cuda guard")
    assert api.sync_guard() == "cuda guard"
    assert isinstance(DeviceAPI(torch.device("meta")).sync_guard(), sg.HostSyncGuard)


def test_runner_hooks_are_the_device_apis_bound_methods():
    """TorchRunner's pin_host / upload / device_memory / memory_stats are the device API's."""
    from fastdeploy_ext.runner import get_backend_class
    cls = get_backend_class("cpu")
    runner = cls.create(dataclasses.replace(_request(), device="cpu"))
    assert runner.pin_host == runner.device_api.pin and runner.upload == runner.device_api.upload
    assert runner.device_memory() is None and runner.memory_stats()["kind"] == "host RSS (peak)"
    assert not runner.memory_query.value


def _request():
    from fastdeploy_ext.plan import PlanRequest
    return PlanRequest(device="cpu")


# ------------------------------------------------------------------ the CUDA API's call sequence
class _CudaRecorder:
    """torch.cuda's stream / graph entry points, recording the order the CUDA API calls them."""

    def __init__(self, monkeypatch):
        self.log: list[str] = []
        rec = self

        class Stream:
            def __init__(self, device=None):
                self.name = f"side{sum(e.startswith('Stream(') for e in rec.log)}"
                rec.log.append(f"Stream({device})")

            def wait_stream(self, other):
                rec.log.append(f"{self.name}.wait_stream({other.name})")

        class Current(Stream):
            def __init__(self):
                self.name = "current"

        class Graph:
            def replay(self):
                rec.log.append("replay")

        class _Ctx:
            def __init__(self, what):
                self.what = what

            def __enter__(self):
                rec.log.append(f"enter {self.what}")

            def __exit__(self, *exc):
                rec.log.append(f"exit {self.what}")

        monkeypatch.setattr(torch.cuda, "Stream", Stream)
        monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: Current())
        monkeypatch.setattr(torch.cuda, "stream", lambda s: _Ctx(f"stream {s.name}"))
        monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: rec.log.append("synchronize"))
        monkeypatch.setattr(torch.cuda, "CUDAGraph", Graph)
        monkeypatch.setattr(torch.cuda, "graph", lambda g, pool=None, stream=None: _Ctx(
            f"graph pool={pool} stream={getattr(stream, 'name', None)}"))


@pytest.mark.parametrize("given_stream", [False, True])
def test_cuda_capture_warms_up_on_the_side_stream_then_captures_into_the_pool(monkeypatch, given_stream):
    """Encoder graphs pass their one shared stream (warm-up and capture on it); decode graphs pass
    none (a fresh side stream for the warm-up, the graph's default capture stream)."""
    rec = _CudaRecorder(monkeypatch)
    api = CudaDeviceAPI(torch.device("cuda", 0))
    stream = api.new_stream() if given_stream else None
    rec.log.clear()
    calls = []
    graph, out = api.capture_graph(lambda: calls.append(len(rec.log)) or "out", pool="P", stream=stream)
    capture_on = "side0" if given_stream else None
    expect = ([] if given_stream else ["Stream(cuda:0)"]) + [
        "side0.wait_stream(current)", "enter stream side0", "exit stream side0", "current.wait_stream(side0)",
        "synchronize", f"enter graph pool=P stream={capture_on}", f"exit graph pool=P stream={capture_on}"]
    assert rec.log == expect
    # two warm-up calls inside the side stream's context, the captured one inside the graph's
    warm, cap = expect.index("enter stream side0") + 1, expect.index(f"enter graph pool=P stream={capture_on}") + 1
    assert calls == [warm, warm, cap] and out == "out" and isinstance(graph, torch.cuda.CUDAGraph)
