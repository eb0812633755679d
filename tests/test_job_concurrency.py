"""Several parsing jobs at once (JobService without a server): the jobs' pipelines share the
renderer, the layout model and the engine, up to max_running_jobs run together, and each job's
results stay its own.

The engine is a gate: it holds every block until blocks of two different jobs are waiting in it
at the same time, then answers them all (each block's text names its job). Jobs run one after
another would never get there: the gate gives up after a while, answers, and says so, and the
test fails on that rather than hanging."""
from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest

from fastdeploy_ext.entrypoints.openai.jobs import JobService, JobsConfig, JobState, SerialLayout
from fastdeploy_ext.parsing.options import ParseOptions

from . import pp_doclayout_fixture as fx

PDFS = Path(__file__).resolve().parents[1].parent / "shared" / "pdfs"
if not PDFS.is_dir():
    PDFS = Path("/work/shared/pdfs")
MIX = [{"label": "paragraph_title", "score": 0.9, "bbox": [0.1, 0.05, 0.9, 0.1]},
       {"label": "text", "score": 0.9, "bbox": [0.1, 0.15, 0.9, 0.4]}]
DOCS = {"lots_of_sci_tables.pdf": 6, "skinnypage.pdf": 2, "edgar.pdf": 1}


class Gate:
    """The engine of every job's pipeline (one GateDriver per pipeline, i.e. per job)."""

    def __init__(self, service, give_up_s: float = 120.0):
        self.service, self.give_up_s = service, give_up_s
        self.lock = threading.Lock()
        self.held: list = []                 # (driver, on_done) waiting for the gate
        self.open = False
        self.opened = threading.Event()
        self.timed_out = False
        self.peak_running = 0
        self.jobs_seen: list[str] = []
        threading.Thread(target=self._watchdog, daemon=True).start()

    def _watchdog(self):
        if not self.opened.wait(self.give_up_s):
            with self.lock:
                self.timed_out = True
            self._release()

    def submit(self, driver, on_done):
        with self.lock:
            self.peak_running = max(self.peak_running, self.service.running())
            if driver.job not in self.jobs_seen:
                self.jobs_seen.append(driver.job)
            held = not self.open
            if held:
                self.held.append((driver, on_done))
                if len({d.job for d, _ in self.held}) < 2:
                    return
        if held:
            self._release()
        else:
            on_done(_Out(f"from {driver.job}"), None)

    def _release(self):
        with self.lock:
            self.open = True
            held, self.held = self.held, []
        self.opened.set()
        for driver, on_done in held:
            on_done(_Out(f"from {driver.job}"), None)


class _Out:
    def __init__(self, text):
        self.text, self.num_output_tokens, self.finish_reason = text, 1, "stop"


class GateDriver:
    error = None

    def __init__(self, gate: Gate, job: str):
        self.gate, self.job = gate, job

    def submit(self, prompt, params, priority, on_done):
        self.gate.submit(self, on_done)

    def close(self):
        pass

    def join(self):
        pass


@pytest.fixture(scope="module")
def layout_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("conc_models")
    fx.write_model(root / "layout")
    (root / "planted.json").write_text(json.dumps({"mix": MIX}))
    return root


def make_service(tmp_path, layout_dir, max_running: int, give_up_s: float = 120.0,
                 pages_in_flight: int | None = None) -> tuple[JobService, Gate]:
    opts = ParseOptions(stub_vlm=True, layout_model=str(layout_dir / "layout"), planted_layouts=str(layout_dir /
                        "planted.json"), render_workers=1, max_pages_in_flight=4, device="cpu", dtype="float32")
    svc = JobService(JobsConfig(jobs_dir=tmp_path / "jobs", max_running_jobs=max_running,
                                pages_in_flight=pages_in_flight), opts, engine=None)
    gate = Gate(svc, give_up_s)
    # each job's pipeline gets its own driver on the one gate, made in the job's runner thread
    # (pipeline.run calls the factory there), which is named after the job
    svc._driver_factory = lambda: (lambda times: GateDriver(gate, threading.current_thread().name))
    return svc, gate


def label(job_id: str) -> str:
    return f"fdx-job-{job_id[:8]}"


def submit_all(svc) -> dict[str, tuple[str, int]]:
    ids = {}
    for name, pages in DOCS.items():
        rec = svc.submit((PDFS / name).read_bytes(), ".pdf", model="PaddleOCR-VL", options={}, page_ranges=None,
                         batch_id=None)
        ids[rec.job_id] = (name, pages)
    return ids


def run_all(svc) -> dict[str, tuple[str, int]]:
    """The service started, then every document submitted and waited for; the service closed."""
    svc.start(None)
    try:
        ids = submit_all(svc)
        wait_finished(svc, ids)
    finally:
        svc.close()
    return ids


def wait_finished(svc, ids, timeout=300.0):
    import time
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if all(svc.jobs[j].state in (JobState.DONE, JobState.FAILED) for j in ids):
            return
        time.sleep(0.05)
    raise AssertionError({j: svc.jobs[j].state for j in ids})


def test_jobs_run_together_on_shared_stages_and_keep_their_own_results(tmp_path, layout_dir):
    svc, gate = make_service(tmp_path, layout_dir, max_running=2)
    # the service is started before the jobs come in: the first starts alone, the second joins it
    ids = run_all(svc)
    assert not gate.timed_out, "blocks of two jobs were never in the engine at once: the jobs ran one by one"
    assert gate.peak_running == 2                         # max_running_jobs=2 of the 3 jobs
    assert sorted(gate.jobs_seen) == sorted(label(j) for j in ids)
    assert isinstance(svc._models[1], SerialLayout)       # one layout model, its calls serialized
    for job_id, (name, pages) in ids.items():
        rec = svc.jobs[job_id]
        assert rec.state is JobState.DONE and (rec.total_pages, rec.extracted_pages) == (pages, pages), name
        lines = [json.loads(x) for x in (tmp_path / "jobs" / job_id / "result.jsonl").read_text().splitlines()]
        assert [ln["result"]["dataInfo"]["pageIndex"] for ln in lines] == list(range(pages))
        for ln in lines:
            (item,) = ln["result"]["layoutParsingResults"]
            # every block of this job's pages was answered for this job, none for another
            assert item["markdown"]["text"].count(f"from {label(job_id)}") == len(MIX), item["markdown"]["text"]
            assert "error" not in item
    assert svc.counts == {"submitted": 3, "done": 3, "failed": 0, "pages": sum(DOCS.values())}
    assert svc.depths() == dict.fromkeys(("pages_in_flight", "rendering", "layout_queue", "blocks_in_flight",
                                          "write_queue"), 0)


def test_with_one_running_job_the_gate_sees_one_job_at_a_time(tmp_path, layout_dir):
    """The check above fails where jobs run one by one: max_running_jobs=1 never has two jobs'
    blocks in the engine together (the gate times out, then every job still completes)."""
    svc, gate = make_service(tmp_path, layout_dir, max_running=1, give_up_s=3.0)
    ids = run_all(svc)
    assert gate.timed_out and gate.peak_running == 1
    assert all(svc.jobs[j].state is JobState.DONE for j in ids)


class Holder:
    """The engine of every job: holds each block until ``want`` pages are open across the running
    jobs (then answers everything held, and from then on at once), or ``give_up_s`` passed for
    that block. Records the most pages ever open across jobs, and the server budget's use."""

    def __init__(self, service, want: int, give_up_s: float):
        self.service, self.want, self.give_up_s = service, want, give_up_s
        self.lock = threading.Lock()
        self.held: list = []
        self.open = False
        self.peak_pages = 0
        self.peak_budget = 0

    def submit(self, on_done):
        on_done = _once(on_done)          # the timer and the release may both answer a block
        open_pages = self.service.depths()["pages_in_flight"]
        with self.lock:
            self.peak_pages = max(self.peak_pages, open_pages)
            self.peak_budget = max(self.peak_budget, self.service.page_slots.in_use())
            if not self.open and self.peak_pages < self.want:
                self.held.append(on_done)
                threading.Timer(self.give_up_s, on_done, args=(_Out("held"), None)).start()
                return
            self.open = True
            held, self.held = self.held, []
        for cb in held + [on_done]:
            cb(_Out("held"), None)


class HolderDriver:
    error = None

    def __init__(self, holder: Holder):
        self.holder = holder

    def submit(self, prompt, params, priority, on_done):
        self.holder.submit(on_done)

    def close(self):
        pass

    def join(self):
        pass


def _once(on_done):
    """A block's callback that runs once, whoever calls it first."""
    lock, done = threading.Lock(), []

    def cb(out, err):
        with lock:
            if done:
                return
            done.append(1)
        on_done(out, err)
    return cb


def run_with_holder(tmp_path, layout_dir, pages_in_flight: int | None,
                    give_up_s: float) -> tuple[JobService, Holder, dict]:
    svc, _ = make_service(tmp_path, layout_dir, max_running=3, pages_in_flight=pages_in_flight)
    holder = Holder(svc, want=3, give_up_s=give_up_s)
    svc._driver_factory = lambda: (lambda times: HolderDriver(holder))
    ids = run_all(svc)
    return svc, holder, ids


def test_running_jobs_share_the_servers_pages_in_flight(tmp_path, layout_dir):
    """Three jobs run at once, each allowed 4 pages in flight, within a server budget of 2: never
    more than 2 pages are open across them, every page is still done once, and the budget is
    whole again when the jobs end."""
    # within the budget 3 pages never open, so every block waits out its give-up time
    svc, holder, ids = run_with_holder(tmp_path, layout_dir, pages_in_flight=2, give_up_s=0.5)
    assert svc.page_slots.size == 2
    assert 1 <= holder.peak_pages <= 2 and holder.peak_budget <= 2, (holder.peak_pages, holder.peak_budget)
    for job_id, (name, pages) in ids.items():
        rec = svc.jobs[job_id]
        assert rec.state is JobState.DONE and (rec.total_pages, rec.extracted_pages) == (pages, pages), name
    assert svc.page_slots.in_use() == 0
    assert svc.counts["pages"] == sum(DOCS.values())


def test_without_the_budget_the_jobs_pages_add_up(tmp_path, layout_dir):
    """The check above can fail: with the default budget (4 x 4 pages) the same three jobs hold
    more than 2 pages open at once (the holder waits for 3)."""
    # blocks are held long enough that a loaded machine still opens the third page meanwhile
    # (once it opens, everything is answered at once: the long hold costs nothing then)
    svc, holder, ids = run_with_holder(tmp_path, layout_dir, pages_in_flight=None, give_up_s=10.0)
    assert svc.page_slots.size == 16
    assert holder.peak_pages >= 3, holder.peak_pages
    assert all(svc.jobs[j].state is JobState.DONE for j in ids)
    assert svc.page_slots.in_use() == 0
