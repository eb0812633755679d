"""DeepSeek-OCR-2's views made on a device (``DeepseekOCR2ImageProcessor.on_device``): the same
bytes as the host's PIL path on real PDF pages and synthetic sizes, the fall-back to the host
when the device is full, and the engine's --preprocess-device decision."""
from __future__ import annotations

import logging
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from PIL import Image

from fastdeploy_ext.engine.config import EngineConfig
from fastdeploy_ext.inputs import resample
from fastdeploy_ext.models.deepseek_ocr2.processor import DeepseekOCR2ImageProcessor

PDFS = Path(__file__).resolve().parents[1].parent / "shared" / "pdfs"
if not PDFS.is_dir():
    PDFS = Path("/work/shared/pdfs")


def pdf_page(name: str, dpi: int = 150) -> Image.Image:
    pdfium = pytest.importorskip("pypdfium2")
    path = PDFS / name
    if not path.is_file():
        pytest.skip(f"{path} is not here")
    doc = pdfium.PdfDocument(str(path))
    try:
        return doc[0].render(scale=dpi / 72).to_pil().convert("RGB")
    finally:
        doc.close()


def noise(w: int, h: int, seed: int) -> Image.Image:
    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8))


def both(img: Image.Image, device: str = "cpu"):
    host = DeepseekOCR2ImageProcessor()
    views, grid = host.views(img)
    dev = host.on_device(device)
    dviews, dgrid = dev.views(img)
    return (host.pixel_values(views), grid), (dev.pixel_values(dviews), dgrid)


@pytest.mark.parametrize("name", ["edgar.pdf", "newspaper.pdf", "edgar-rotated90.pdf"])
def test_pdf_pages_give_the_hosts_bytes(name):
    img = pdf_page(name)
    (want, grid), (got, dgrid) = both(img)
    assert dgrid == grid and grid[0] > 1                  # a 150 dpi page is cut into crops
    assert got.dtype == torch.uint8 and torch.equal(got, want)


@pytest.mark.parametrize("w,h", [(1240, 1754), (1754, 1240), (700, 500), (3000, 800), (769, 770), (17, 900)])
def test_sizes_give_the_hosts_bytes(w, h):
    (want, grid), (got, dgrid) = both(noise(w, h, seed=w + h))
    assert dgrid == grid and torch.equal(got, want)


def test_preprocess_hands_out_pixels_on_the_device(tmp_path):
    path = tmp_path / "page.png"
    noise(1000, 1400, seed=2).save(path)
    host = DeepseekOCR2ImageProcessor().preprocess(str(path))
    dev = DeepseekOCR2ImageProcessor(device="cpu").preprocess(str(path))
    assert dev.pixel_values.device == torch.device("cpu") and dev.grid_thw == host.grid_thw
    assert torch.equal(dev.pixel_values, host.pixel_values)


def test_a_full_device_falls_back_to_the_host(tmp_path, monkeypatch, caplog):
    path = tmp_path / "page.png"
    noise(1240, 1754, seed=3).save(path)
    want = DeepseekOCR2ImageProcessor().preprocess(str(path))

    def full(*a, **kw):
        raise torch.OutOfMemoryError("CUDA out of memory (test)")
    monkeypatch.setattr(resample, "resize", full)
    with caplog.at_level(logging.WARNING):
        got = DeepseekOCR2ImageProcessor(device="cpu").preprocess(str(path), "page.png")
    assert torch.equal(got.pixel_values, want.pixel_values)
    assert "no device memory" in caplog.text and "page.png" in caplog.text


def test_a_host_processor_does_not_catch_out_of_memory(tmp_path, monkeypatch):
    path = tmp_path / "page.png"
    noise(900, 900, seed=4).save(path)

    def full(self, *a, **kw):
        raise torch.OutOfMemoryError("host (test)")
    monkeypatch.setattr(Image.Image, "resize", full)
    with pytest.raises(torch.OutOfMemoryError):
        DeepseekOCR2ImageProcessor().preprocess(str(path))


# ------------------------------------------------------------------ no host sync in the worker
def test_making_views_on_a_device_waits_for_nothing_queued_there():
    """The worker's device path (page upload, resizes, canvas, patches) runs on ``meta`` under
    the sync guard: no blocking upload (on CUDA one waits for the engine's queued steps) and no
    read-back. The taps go up once per geometry, not per page."""
    from fastdeploy_ext.sync_guard import HostSyncGuard
    proc = DeepseekOCR2ImageProcessor().on_device("meta")
    resample.device_taps.cache_clear()
    with HostSyncGuard(watch={"meta"}):
        for seed in (1, 2):
            views, grid = proc.views(noise(1240, 1754, seed))
            out = proc.pixel_values(views)
    assert grid == (7, 3, 2) and out.device.type == "meta" and out.dtype == torch.uint8
    info = resample.device_taps.cache_info()
    assert info.misses <= 4 and info.hits >= info.misses     # two resizes x two axes, once


@pytest.mark.parametrize("where", ["page", "taps"])
def test_a_blocking_upload_in_the_worker_path_is_caught(monkeypatch, where):
    from fastdeploy_ext.models.deepseek_ocr2 import processor as P
    from fastdeploy_ext.sync_guard import HostSyncError, HostSyncGuard

    def blocking(t, device):
        return t.to(device)
    monkeypatch.setattr(P if where == "page" else resample, "upload", blocking)
    resample.device_taps.cache_clear()
    proc = DeepseekOCR2ImageProcessor().on_device("meta")
    with HostSyncGuard(watch={"meta"}), pytest.raises(HostSyncError, match="blocking host->device copy"):
        proc.views(noise(1240, 1754, 3))
    resample.device_taps.cache_clear()        # no taps uploaded the blocking way stay cached


# ------------------------------------------------------------------ the engine's decision
def runner(device: str):
    return SimpleNamespace(device=torch.device(device))


def test_the_decision_by_flag_and_device():
    proc = DeepseekOCR2ImageProcessor()
    auto = EngineConfig().preprocess_decision(runner("cuda"), proc)
    assert auto.value == "device" and auto.reason.startswith("auto: DeepseekOCR2ImageProcessor resizes and cuts on cuda")
    auto_cpu = EngineConfig().preprocess_decision(runner("cpu"), proc)
    assert auto_cpu.value == "host" and auto_cpu.reason.startswith("auto: the runner's device is the host CPU")
    dev = EngineConfig(preprocess_device="device").preprocess_decision(runner("cuda"), proc)
    assert dev.value == "device" and "cuda" in dev.reason
    cpu = EngineConfig(preprocess_device="device").preprocess_decision(runner("cpu"), proc)
    assert cpu.value == "host" and "host CPU" in cpu.reason
    host = EngineConfig(preprocess_device="host").preprocess_decision(runner("cuda"), proc)
    assert host.value == "host"


def test_a_processor_without_a_device_path_is_refused():
    from fastdeploy_ext.models.registry import get_family
    proc = get_family("paddleocr_vl").released_image_processor()
    with pytest.raises(ValueError, match="host only"):
        EngineConfig(preprocess_device="device").preprocess_decision(runner("cuda"), proc)
    auto = EngineConfig().preprocess_decision(runner("cuda"), proc)
    assert auto.value == "host" and "makes its views on the host only" in auto.reason


def test_views_on_the_device_reserve_each_workers_page_beside_the_kv_pool():
    """The engine keeps free, beside what its caller reserved, a page's working set per worker."""
    from fastdeploy_ext.engine.llm_engine import LLMEngine
    from fastdeploy_ext.plan import Decision
    proc = DeepseekOCR2ImageProcessor().on_device("cpu")
    per = proc.device_working_bytes()
    # an A4 page at 200 dpi: 6 crops; the bytes its two resizes and seven views take
    assert proc.grid_for(1654, 2339) == (7, 3, 2) and 200 * 2**20 < per < 300 * 2**20
    assert proc.device_working_bytes(600, 500) < per / 4          # no crops: one small resize

    def beside(reserved, views_on_device, workers=3):
        me = SimpleNamespace(reserved_memory=reserved, _views_on_device=views_on_device,
                             config=EngineConfig(preprocess_workers=workers))
        return LLMEngine._memory_beside_the_engine(me)
    got = beside(Decision(1000, "a layout detector"), proc)
    assert got.value == 1000 + 3 * per
    assert got.reason.startswith("a layout detector; 3 preprocessing workers making views on the device")
    assert beside(None, proc, workers=1).value == per
    assert beside(Decision(1000, "a layout detector"), None) == Decision(1000, "a layout detector")
    assert beside(None, None) is None


def test_a_bad_value_is_refused():
    with pytest.raises(ValueError, match="--preprocess-device must be one of auto, host, device"):
        EngineConfig(preprocess_device="gpu").validate()


def test_the_cli_flags_reach_the_config():
    import argparse

    from fastdeploy_ext.entrypoints.args import add_engine_args, engine_config_from_args
    from fastdeploy_ext.plan import PlanRequest
    from fastdeploy_ext.runner import ModelSource
    p = argparse.ArgumentParser()
    add_engine_args(p)
    ns = p.parse_args(["--preprocess-device", "device", "--preprocess-workers", "8"])
    cfg = engine_config_from_args(ns, ModelSource(None, "dummy", "auto", "deepseek_ocr2"), PlanRequest())
    assert (cfg.preprocess_device, cfg.preprocess_workers) == ("device", 8)
    with pytest.raises(SystemExit):
        p.parse_args(["--preprocess-device", "gpu"])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("w,h", [(1654, 2339), (1240, 1754), (2339, 1654), (600, 500)])
def test_cuda_working_set_stays_inside_the_reservation(w, h):
    proc = DeepseekOCR2ImageProcessor().on_device("cuda")
    img = noise(w, h, seed=5)
    proc.pixel_values(proc.views(img)[0])             # the taps' uploads and kernels made once
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    out = proc.pixel_values(proc.views(img)[0])
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    bound = proc.device_working_bytes(w, h)
    print(f"{w}x{h}: peak {peak / 2**20:.1f} MiB, reserved {bound / 2**20:.1f} MiB")
    assert out.is_cuda and 0.4 * bound < peak <= bound


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_views_give_the_hosts_bytes():
    (want, grid), (got, dgrid) = both(noise(1240, 1754, seed=5), "cuda")
    assert got.is_cuda and dgrid == grid and torch.equal(got.cpu(), want)


def test_preprocess_bench_reports_equal_bytes_per_column(tmp_path):
    """`bench.deepseek_preprocess` on the CPU: a row per column and worker count, each of ours
    checked byte for byte against the host path; a bad page size is one clear line."""
    import json

    from fastdeploy_ext.bench import deepseek_preprocess as bench
    out = tmp_path / "pre.json"
    assert bench.main(["--pages", "1", "--page-size", "800x1000", "--workers", "1,2", "--device", "cpu",
                       "--no-reference", "--json-out", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [(r["column"], r["workers"]) for r in rows] == [("ours host", 1), ("ours host x2", 2),
                                                           ("ours cpu", 1), ("ours cpu x2", 2)]
    assert all(r["bitwise_equal"] is True and r["pages_per_s"] > 0 for r in rows)
    with pytest.raises(SystemExit, match="--page-size sides must be within 16..10000"):
        bench.main(["--page-size", "8x8", "--no-reference"])
