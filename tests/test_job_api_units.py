"""The job service's guards without a server: the queue bound, resuming accepted jobs from
--jobs-dir, expiry, the result-file path check, optionalPayload's rules, the job priority on
the served engine, and no failure recorded for a page the stopping engine refused."""
from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import pytest

from fastdeploy_ext.engine.errors import EngineDead
from fastdeploy_ext.entrypoints.openai.jobs import (JobService, JobsConfig, JobState, QueueFull, ServedEngineDriver,
                                                    _JobSink)
from fastdeploy_ext.entrypoints.openai.serving_jobs import JobAPIError, check_model, job_options, served_version
from fastdeploy_ext.parsing.options import ParseOptions

PDF = b"%PDF-1.4 not parsed here"


def service(tmp_path, **cfg) -> JobService:
    return JobService(JobsConfig(jobs_dir=tmp_path / "jobs", **cfg), ParseOptions(stub_vlm=True, max_new_tokens=64),
                      engine=None)


def submit(svc, batch=None):
    return svc.submit(PDF, ".pdf", model="PaddleOCR-VL", options={}, page_ranges=None, batch_id=batch)


def test_the_queue_holds_max_queued_jobs_unfinished_and_refuses_the_next(tmp_path):
    svc = service(tmp_path, max_queued_jobs=2)
    a, b = submit(svc), submit(svc)
    with pytest.raises(QueueFull, match="2 jobs are queued or running"):
        submit(svc)
    a.state = JobState.DONE                      # a finished job frees its place
    submit(svc)
    assert len(svc.jobs) == 3 and b.job_id in svc.jobs


def test_a_restart_queues_every_unfinished_job_in_order_and_drops_an_unanswered_submit(tmp_path):
    svc = service(tmp_path)
    a, b, c = submit(svc, "b1"), submit(svc, "b1"), submit(svc)
    c.state = JobState.DONE
    svc._save(c)
    stray = tmp_path / "jobs" / "deadbeef"        # a submit that died before its job.json
    (stray / "input").mkdir(parents=True)
    again = service(tmp_path)
    assert again._queue == [a.job_id, b.job_id]
    assert again.jobs[c.job_id].state is JobState.DONE
    assert [r.job_id for r in again.batch("b1")] == [a.job_id, b.job_id]
    assert not stray.exists()
    assert (tmp_path / "jobs" / a.job_id / "input" / "document.pdf").read_bytes() == PDF


def test_finished_jobs_expire_after_the_ttl_with_their_files_and_unfinished_ones_never(tmp_path):
    svc = service(tmp_path, ttl_s=100)
    old, fresh, pending = submit(svc), submit(svc), submit(svc)
    now = time.time()
    old.state, old.finished = JobState.DONE, now - 101
    fresh.state, fresh.finished = JobState.FAILED, now - 99
    assert svc.expire(now) == 1
    assert old.job_id not in svc.jobs and not (tmp_path / "jobs" / old.job_id).exists()
    assert fresh.job_id in svc.jobs and pending.job_id in svc.jobs
    assert svc.expire(now + 10_000) == 1             # fresh goes; the pending job stays
    assert list(svc.jobs) == [pending.job_id]


def test_result_files_are_the_jsonl_and_crops_only(tmp_path):
    svc = service(tmp_path)
    rec = submit(svc)
    d = tmp_path / "jobs" / rec.job_id
    (d / "ws" / "imgs").mkdir(parents=True)
    (d / "ws" / "imgs" / "a.png").write_bytes(b"png")
    (d / "result.jsonl").write_text("{}\n")
    assert svc.result_path(rec, "result.jsonl") == d / "result.jsonl"
    assert svc.result_path(rec, "imgs/a.png") == d / "ws" / "imgs" / "a.png"
    for bad in ("job.json", "imgs/../../job.json", "input/document.pdf", "/etc/passwd", "imgs/missing.png"):
        assert svc.result_path(rec, bad) is None, bad


def test_options_map_no_ops_pass_and_everything_else_is_a_400_naming_the_key():
    base = ParseOptions(stub_vlm=True, max_new_tokens=64, block_max_pixels=10000)
    assert job_options({"useChartRecognition": True, "layoutThreshold": 0.5, "maxNewTokens": 1000,
                        "maxPixels": 20000, "useDocUnwarping": False, "prettifyMarkdown": True,
                        "temperature": None}, base) == {
        "chart_recognition": True, "layout_threshold": 0.5, "max_new_tokens": 64, "block_max_pixels": 10000}
    for payload, msg in (({"bogus": 1}, "optionalPayload.bogus: unknown option"),
                         ({"useDocUnwarping": True}, "useDocUnwarping=true: document unwarping"),
                         ({"layoutThreshold": {"0": 0.3}}, "per-class layoutThreshold"),
                         ({"layoutThreshold": True}, "layoutThreshold=true"),
                         ({"restructurePages": True}, "restructuring pages"),
                         ({"maxNewTokens": 0}, "maxNewTokens must be an integer > 0")):
        with pytest.raises(JobAPIError, match=msg) as e:
            job_options(payload, base)
        assert e.value.status == 400
    with pytest.raises(JobAPIError, match="optionalPayload must be a JSON object"):
        job_options([1], base)
    assert check_model(None, None) == "PaddleOCR-VL-1.6"
    assert [served_version(d) for d in ("/m/PaddleOCR-VL-1.5", "/m/paddleocr-vl", "/m/PaddleOCR-VL-1.6-0.9B",
                                        "/m/tiny_vl", None)] == [
        "PaddleOCR-VL-1.5", "PaddleOCR-VL", "PaddleOCR-VL-1.6", None, None]
    with pytest.raises(JobAPIError, match="PP-StructureV3: not served here"):
        check_model("PP-StructureV3", None)


def test_blocks_go_to_the_served_engine_below_chat_by_the_priority_offset():
    seen = []

    class Engine:
        def submit(self, rid, prompt, params, priority, on_done):
            seen.append(priority)
            on_done(SimpleNamespace(text="x", finished=True), None)

    drv = ServedEngineDriver(Engine(), priority_offset=100)
    got = []
    drv.submit({"prompt": "p"}, None, 3, lambda out, err: got.append((out.text, err)))
    assert seen == [103] and got == [("x", None)] and not drv._active


def test_an_abandoned_run_aborts_its_blocks_in_the_served_engine():
    class Engine:
        def __init__(self):
            self.pending, self.aborted = {}, []

        def submit(self, rid, prompt, params, priority, on_done):
            self.pending[rid] = on_done                  # a long block: until aborted

        def abort_nowait(self, rid):
            self.aborted.append(rid)
            self.pending.pop(rid)(SimpleNamespace(text="", finished=True, finish_reason="abort"), "abort")

    eng = Engine()
    drv = ServedEngineDriver(eng, priority_offset=0)
    got = []
    drv.submit({"prompt": "p"}, None, 0, lambda out, err: got.append(err))
    assert len(drv._active) == 1
    drv.abort()
    assert got == ["abort"] and len(eng.aborted) == 1 and eng.aborted[0].startswith("job-") and not drv._active


def test_a_block_the_stopping_engine_refuses_fails_alone():
    class Engine:
        def submit(self, rid, prompt, params, priority, on_done):
            raise EngineDead("the engine is not running (not started or shutting down)")

    got = []
    drv = ServedEngineDriver(Engine(), priority_offset=0)
    drv.submit({"prompt": "p"}, None, 0, lambda out, err: got.append((out, err)))
    assert got == [(None, "EngineDead: the engine is not running (not started or shutting down)")] and not drv._active


def test_a_page_refused_while_the_server_stops_is_not_recorded_as_failed(tmp_path):
    recorded = []

    class Ws:
        def fail(self, lease, key, stage, message):
            recorded.append(key)

    svc = service(tmp_path)
    rec = submit(svc)
    sink = _JobSink(Ws(), svc, rec)
    job = SimpleNamespace(lease=None, work=SimpleNamespace(key="k1"))
    sink.fail(job, "vlm", "EngineDead")
    assert recorded == ["k1"] and rec.extracted_pages == 1
    svc.stop()
    sink.fail(SimpleNamespace(lease=None, work=SimpleNamespace(key="k2")), "vlm", "EngineDead")
    assert recorded == ["k1"] and rec.extracted_pages == 1      # k2 stays pending: redone on the next start


def test_max_running_jobs_is_checked_and_reaches_the_config(tmp_path):
    import argparse

    from fastdeploy_ext.entrypoints.args import CliError
    from fastdeploy_ext.entrypoints.openai.cli_args import add_job_arguments
    from fastdeploy_ext.entrypoints.openai.jobs import jobs_config_from_args
    p = argparse.ArgumentParser()
    add_job_arguments(p)
    ns = p.parse_args(["--jobs-dir", str(tmp_path)])
    assert jobs_config_from_args(ns).max_running_jobs == 4          # the documented default
    assert jobs_config_from_args(p.parse_args(["--jobs-dir", str(tmp_path), "--max-running-jobs", "2"])
                                 ).max_running_jobs == 2
    with pytest.raises(CliError, match="--max-running-jobs must be >= 1, got 0"):
        jobs_config_from_args(p.parse_args(["--jobs-dir", str(tmp_path), "--max-running-jobs", "0"]))
    assert jobs_config_from_args(ns).pages_in_flight is None          # 4 x --max-pages-in-flight
    assert jobs_config_from_args(p.parse_args(["--jobs-dir", str(tmp_path), "--job-pages-in-flight", "48"])
                                 ).pages_in_flight == 48
    with pytest.raises(CliError, match="--job-pages-in-flight must be >= 1, got 0"):
        jobs_config_from_args(p.parse_args(["--jobs-dir", str(tmp_path), "--job-pages-in-flight", "0"]))


def test_the_layout_model_shared_by_the_jobs_runs_one_call_at_a_time():
    from fastdeploy_ext.entrypoints.openai.jobs import SerialLayout

    class Layout:
        def __init__(self):
            self.inside, self.peak, self.lock = 0, 0, threading.Lock()

        def detect(self, images, threshold):
            with self.lock:
                self.inside += 1
                self.peak = max(self.peak, self.inside)
            time.sleep(0.02)
            with self.lock:
                self.inside -= 1
            return [[] for _ in images]

    def hammer(layout):
        ts = [threading.Thread(target=lambda: [layout.detect([0], 0.3) for _ in range(5)]) for _ in range(4)]
        for t in ts:
            t.start()
        for t in ts:
            t.join()
    bare = Layout()
    hammer(bare)
    assert bare.peak > 1                   # without the wrapper, the jobs' layout threads overlap
    inner = Layout()
    hammer(SerialLayout(inner))
    assert inner.peak == 1


def test_the_page_rate_counts_the_window_from_the_busy_start():
    from fastdeploy_ext.entrypoints.openai.jobs import PageRate
    now = [100.0]
    rate = PageRate(window_s=30.0, clock=lambda: now[0])
    assert rate.rate() == 0.0
    now[0] = 200.0
    rate.busy()                            # a run starts after 100 s idle: not diluted by them
    for t in (201.0, 202.0, 204.0):
        now[0] = t
        rate.add()
    now[0] = 205.0
    assert rate.rate() == pytest.approx(3 / 5.0)
    now[0] = 260.0                         # 30 s window: pages older than 230 are gone
    assert rate.rate() == 0.0
    for _ in range(6):
        rate.add()
    assert rate.rate() == pytest.approx(6 / 30.0)
