"""Document-parsing jobs behind the job API (serving_jobs.py): accepted jobs on disk under
``--jobs-dir``, runner threads that parse them through the same pipeline as `parse`.

A job is a directory ``<jobs-dir>/<job id>/``: ``job.json`` (what was asked, its state, the
secret of its result URLs), ``input/`` (the document as received) and ``ws/``, the parse
workspace of that one document (the pipeline's exactly-once manifest). Accepting a job writes
its input and ``job.json`` durably before the job id is answered, so a restart (SIGTERM or
kill -9) finds every accepted job; a job that was not finished runs again on its workspace,
which skips the pages already done, so every page is done exactly once. A finished job's
``result.jsonl`` (one line per page) is written before its state turns done. Finished jobs
expire ``ttl_s`` after they end: their directory is removed and their URLs answer 404.

Up to ``max_running_jobs`` jobs run at once, started in the order accepted: each job is its own
pipeline run (its own pages in flight, sink and exactly-once workspace; the pages in flight of all
of them within one server-wide budget, ``pages_in_flight``) over one shared renderer,
layout model and the served engine, so pages of different jobs interleave in the render pool,
the layout model (its calls serialized: SerialLayout) and the engine's batches, and the engine
does not idle between one job's last pages and the next job's first. The blocks go to the served
engine at ``priority_offset`` below interactive chat (a larger priority value runs later)."""
from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import secrets
import shutil
import threading
import time
from collections import deque
from dataclasses import asdict, dataclass, replace
from enum import Enum
from pathlib import Path

from ...parsing.durable import fsync_dir, write_atomic
from ...parsing.pipeline import PageSlots

log = logging.getLogger("fastdeploy_ext.jobs")


class JobState(str, Enum):
    PENDING = "pending"
    RUNNING = "running"
    DONE = "done"
    FAILED = "failed"


@dataclass
class JobRecord:
    """``job.json``: what the client asked and where the job stands."""
    job_id: str
    model: str
    file_name: str                  # the input's name inside input/ (document.<suffix>)
    options: dict                   # ParseOptions field overrides (serving_jobs.job_options)
    secret: str                     # the unguessable part of the result URLs
    created: float
    page_ranges: str | None = None
    batch_id: str | None = None
    state: JobState = JobState.PENDING
    error_msg: str | None = None
    total_pages: int = 0
    extracted_pages: int = 0        # done or failed pages
    started: float | None = None
    finished: float | None = None

    def to_json(self) -> bytes:
        d = asdict(self)
        d["state"] = self.state.value
        return (json.dumps(d, ensure_ascii=False) + "\n").encode()

    @classmethod
    def from_json(cls, data: bytes) -> "JobRecord":
        d = json.loads(data)
        d["state"] = JobState(d["state"])
        return cls(**d)


#: --job-pages-in-flight's default, in jobs' worth of --max-pages-in-flight: as many pages as the
#: default --max-running-jobs (4) held when each job had its own
DEFAULT_PAGE_BUDGET_JOBS = 4


class QueueFull(Exception):
    """More unfinished jobs than the queue holds."""


@dataclass
class JobsConfig:
    jobs_dir: Path
    max_queued_jobs: int = 64           # pending + running; beyond: 429
    max_running_jobs: int = 4           # jobs whose pages are in the pipeline at once
    # pages in flight across every running job (None: DEFAULT_PAGE_BUDGET_JOBS x the per-job
    # --max-pages-in-flight), so more running jobs share the pages in flight rather than multiply them
    pages_in_flight: int | None = None
    max_upload_bytes: int = 200 << 20
    ttl_s: float = 86400.0
    priority_offset: int = 100          # added to every block's priority (chat's default is 0)


# ------------------------------------------------------------------ the served engine as a driver
class ServedEngineDriver:
    """The pipeline's engine driver over the server's AsyncLLMEngine: each block is one
    non-streaming ``submit`` at the job priority, so parsing and chat share one step loop and one
    KV pool, chat first. Blocks bypass the event loop (no coroutine per block, the callback runs
    on the step loop's thread), which keeps the GIL for the step loop and the HTTP side."""

    def __init__(self, engine, priority_offset: int, times=None):
        self.engine, self.offset, self.times = engine, priority_offset, times
        self.error = None
        self._ids = 0
        self._lock = threading.Lock()
        self._active: set[str] = set()

    def submit(self, prompt: dict, params, priority: int, on_done) -> None:
        with self._lock:
            self._ids += 1
            rid = f"job-{os.getpid()}-{id(self):x}-{self._ids}"
            self._active.add(rid)

        def done(out, err):
            with self._lock:
                self._active.discard(rid)
            on_done(out, err)
        try:
            self.engine.submit(rid, prompt, params, priority + self.offset, done)
        except Exception as e:  # noqa: BLE001 - refused (the engine stops): this block fails, the job goes on
            done(None, f"{type(e).__name__}: {e}")

    def abort(self) -> None:
        """The run was abandoned (the server stops): its blocks in the engine end now rather
        than decode on for pages that will be redone."""
        with self._lock:
            rids = list(self._active)
        for rid in rids:
            self.engine.abort_nowait(rid)

    def close(self) -> None:
        pass

    def join(self) -> None:
        pass


# ------------------------------------------------------------------ shared stages
class SerialLayout:
    """The layout model shared by the jobs' pipelines, one call at a time: the runner's detector
    replays CUDA graphs through static input buffers, so two layout threads must never be in it
    at once. Each pipeline still batches its own rendered pages into one call."""

    def __init__(self, layout):
        self.inner = layout
        self._lock = threading.Lock()

    def detect(self, images, threshold: float):
        with self._lock:
            return self.inner.detect(images, threshold)


class PageRate:
    """Pages settled per second over the last ``window_s`` (for /metrics): a window that starts no
    earlier than the current busy period, so the first seconds of a run are not diluted by the
    idle time before it."""

    def __init__(self, window_s: float = 30.0, clock=time.monotonic):
        self.window_s, self.clock = window_s, clock
        self._times: deque[float] = deque()
        self._since = clock()
        self._lock = threading.Lock()

    def busy(self) -> None:
        """A run starts after an idle time: the window starts here."""
        with self._lock:
            self._since = self.clock()
            self._times.clear()

    def add(self) -> None:
        with self._lock:
            self._times.append(self.clock())

    def rate(self) -> float:
        with self._lock:
            now = self.clock()
            while self._times and self._times[0] < now - self.window_s:
                self._times.popleft()
            span = now - max(now - self.window_s, self._since)
            return len(self._times) / span if self._times and span > 0 else 0.0


# ------------------------------------------------------------------ the store and runner
class JobService:
    """Accepts, persists, runs and expires jobs. ``base_opts`` are the server's ParseOptions
    (models, dpi, limits); a job's options override a few of their fields."""

    def __init__(self, config: JobsConfig, base_opts, engine, *, engine_ready=lambda: True):
        self.config = config
        if base_opts.load_format == "dummy" and base_opts.planted_layouts and not base_opts.planted_decode:
            # random VLM weights rarely stop: each block decodes its kind's planted length, as
            # bench parse does, so a served run decodes the same work as the in-process one
            log.info("jobs: random VLM weights with planted layouts: each block decodes its kind's planted "
                     "length (ignore_eos)")
            base_opts = replace(base_opts, planted_decode=True)
        self.base_opts = base_opts
        self.page_slots = PageSlots(config.pages_in_flight or DEFAULT_PAGE_BUDGET_JOBS * base_opts.max_pages_in_flight)
        self.engine = engine
        self.engine_ready = engine_ready
        self.jobs: dict[str, JobRecord] = {}
        self._queue: list[str] = []
        self._cv = threading.Condition()
        self._stopping = False
        self._thread: threading.Thread | None = None
        self._running: dict[str, threading.Thread] = {}     # job id -> its runner thread
        self._pipes: dict[str, object] = {}                 # job id -> its pipeline while it runs
        self._loop: asyncio.AbstractEventLoop | None = None
        self._models = None          # (renderer, layout), built by the first job that runs
        self._build_lock = threading.Lock()
        self._counts_lock = threading.Lock()
        self.counts = {"submitted": 0, "done": 0, "failed": 0, "pages": 0}
        self.rate = PageRate()
        config.jobs_dir.mkdir(parents=True, exist_ok=True)
        self._load()

    # ---------------------------------------------------------------- on disk
    def _dir(self, job_id: str) -> Path:
        return self.config.jobs_dir / job_id

    def _save(self, rec: JobRecord) -> None:
        write_atomic(str(self._dir(rec.job_id) / "job.json"), rec.to_json())

    def _load(self) -> None:
        """Every accepted job from disk: unfinished ones queued again (their workspace resumes)."""
        resumed = []
        for d in sorted(self.config.jobs_dir.iterdir()):
            f = d / "job.json"
            if not f.is_file():          # a submit that died before its record: never answered
                if d.is_dir():
                    shutil.rmtree(d, ignore_errors=True)
                continue
            try:
                rec = JobRecord.from_json(f.read_bytes())
            except (ValueError, TypeError, KeyError) as e:
                log.error("jobs: %s is unreadable (%s); left alone", f, e)
                continue
            self.jobs[rec.job_id] = rec
            if rec.state in (JobState.PENDING, JobState.RUNNING):
                resumed.append(rec)
        for rec in sorted(resumed, key=lambda r: r.created):
            self._queue.append(rec.job_id)
        if self.jobs:
            log.info("jobs: %d jobs in %s, %d unfinished resumed", len(self.jobs), self.config.jobs_dir,
                     len(resumed))

    # ---------------------------------------------------------------- accepting
    def unfinished(self) -> int:
        return sum(r.state in (JobState.PENDING, JobState.RUNNING) for r in self.jobs.values())

    def submit(self, data: bytes, suffix: str, *, model: str, options: dict, page_ranges: str | None,
               batch_id: str | None) -> JobRecord:
        """The input and job.json durably on disk, then queued: QueueFull past the bound."""
        with self._cv:
            if self._stopping:
                raise RuntimeError("the server is shutting down")
            if self.unfinished() >= self.config.max_queued_jobs:
                raise QueueFull(f"{self.unfinished()} jobs are queued or running (the queue holds "
                                f"{self.config.max_queued_jobs}); retry later")
            job_id = secrets.token_hex(16)
            rec = JobRecord(job_id=job_id, model=model, file_name=f"document{suffix}", options=options,
                            secret=secrets.token_urlsafe(24), created=time.time(), page_ranges=page_ranges,
                            batch_id=batch_id)
            d = self._dir(job_id)
            (d / "input").mkdir(parents=True)
            write_atomic(str(d / "input" / rec.file_name), data)
            fsync_dir(str(d / "input"))
            self._save(rec)
            fsync_dir(str(d))
            fsync_dir(str(self.config.jobs_dir))
            self.jobs[job_id] = rec
            self._queue.append(job_id)
            with self._counts_lock:
                self.counts["submitted"] += 1
            self._cv.notify_all()
        log.info("jobs: accepted %s (%s, %d bytes, model %s%s)", job_id, rec.file_name, len(data), model,
                 f", batch {batch_id}" if batch_id else "")
        return rec

    def batch(self, batch_id: str) -> list[JobRecord]:
        return sorted((r for r in self.jobs.values() if r.batch_id == batch_id), key=lambda r: r.created)

    def result_path(self, rec: JobRecord, rel: str) -> Path | None:
        """A file of a done job's results by its URL path (result.jsonl, or a crop under ws/);
        None for anything outside them."""
        d = self._dir(rec.job_id)
        if rel == "result.jsonl":
            p = d / "result.jsonl"
        else:
            parts = Path(rel).parts
            layout_picture = len(parts) == 1 and rel.endswith("_layout.png")     # visualize: beside the page
            if not (layout_picture or parts and parts[0] == "imgs") or ".." in parts or Path(rel).is_absolute():
                return None
            p = d / "ws" / rel
        return p if p.is_file() else None

    # ---------------------------------------------------------------- the runner
    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        log.info("jobs: up to %d jobs parse at once (--max-running-jobs), each its own pipeline of up to %d pages in "
                 "flight (--max-pages-in-flight), %d pages in flight across them (--job-pages-in-flight%s), on the "
                 "shared renderer, layout model and engine", self.config.max_running_jobs,
                 self.base_opts.max_pages_in_flight, self.page_slots.size,
                 "" if self.config.pages_in_flight else f": {DEFAULT_PAGE_BUDGET_JOBS} x --max-pages-in-flight")
        self._thread = threading.Thread(target=self._run, name="fdx-jobs", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """No new jobs; the jobs in flight stop recording page failures (their pages stay
        pending and run again on the next start)."""
        with self._cv:
            self._stopping = True
            self._cv.notify_all()

    @property
    def stopping(self) -> bool:
        return self._stopping

    def running(self) -> int:
        with self._cv:
            return len(self._running)

    def _next(self) -> JobRecord | None:
        """Starts the next accepted job's thread once a running place is free (and the engine is
        up) and returns its record; None when the service stops."""
        with self._cv:
            while True:
                if self._stopping:
                    return None
                if self._queue and self.engine_ready() and len(self._running) < self.config.max_running_jobs:
                    rec = self.jobs.get(self._queue.pop(0))
                    if rec is None:
                        continue
                    if not self._running:
                        self.rate.busy()
                    th = threading.Thread(target=self._job_thread, args=(rec,), name=f"fdx-job-{rec.job_id[:8]}",
                                          daemon=True)
                    self._running[rec.job_id] = th
                    th.start()
                    return rec
                self._cv.wait(0.2)

    def _run(self) -> None:
        """The dispatcher: starts each job in its own thread, up to max_running_jobs at once."""
        while True:
            if self._next() is None:
                return

    def _job_thread(self, rec: JobRecord) -> None:
        try:
            self._run_job(rec)
        except Exception as e:  # noqa: BLE001 - this job fails with the reason; the others go on
            if not self._stopping:
                log.exception("jobs: %s failed", rec.job_id)
                self._finish(rec, JobState.FAILED, f"{type(e).__name__}: {e}")
        finally:
            with self._cv:
                self._running.pop(rec.job_id, None)
                self._pipes.pop(rec.job_id, None)
                self._cv.notify_all()

    def depths(self) -> dict[str, int]:
        """The running jobs' pipeline stages, summed (Pipeline.depths)."""
        with self._cv:
            pipes = list(self._pipes.values())
        total = dict.fromkeys(("pages_in_flight", "rendering", "layout_queue", "blocks_in_flight", "write_queue"), 0)
        for p in pipes:
            for k, v in p.depths().items():
                total[k] = total.get(k, 0) + v
        return total

    def _build(self):
        with self._build_lock:          # the first jobs start together: one renderer, one layout model
            if self._models is None:
                from ...parsing import coordinator
                from ...parsing.render import PageRenderer
                self._models = (PageRenderer(workers=self.base_opts.render_workers),
                                SerialLayout(coordinator.build_layout(self.base_opts)))
            return self._models

    def layout_reservation(self):
        """Builds the renderer and layout model now (before the served engine sizes its KV pool)
        and measures one layout batch over A4 pages: the Decision the engine keeps free for it
        (memory_profile.detector_reservation), as `parse` does; None without a VLM engine."""
        if self.base_opts.stub_vlm:
            return None
        from ...memory_profile import detector_reservation
        from ...parsing.coordinator import a4_page_hw
        _, layout = self._build()
        return detector_reservation(layout.inner, self.base_opts.layout_batch, a4_page_hw(self.base_opts.dpi))

    def _driver_factory(self):
        if self.base_opts.stub_vlm:
            return None
        return lambda times: ServedEngineDriver(self.engine, self.config.priority_offset, times)

    def _run_job(self, rec: JobRecord) -> None:
        from ...parsing import coordinator
        d = self._dir(rec.job_id)
        opts = replace(self.base_opts, output=str(d / "ws"), pages=rec.page_ranges, formats=frozenset({"md", "json"}),
                       jsonl_shards=None, workers=1, retry_failed=False, **rec.options)
        rec.state, rec.started = JobState.RUNNING, rec.started or time.time()
        self._save(rec)
        ws, todo = coordinator.open_workspace(opts, [str(d / "input" / rec.file_name)])
        try:
            st = ws.status()
            rec.total_pages = st.done + st.failed + st.pending
            rec.extracted_pages = st.done + st.failed
            log.info("jobs: %s running: %d pages, %d to do", rec.job_id, rec.total_pages, todo)
            if st.input_errors:
                self._finish(rec, JobState.FAILED, _input_error(d / "ws"))
                return
            if todo:
                renderer, layout = self._build()
                sink = _JobSink(ws, self, rec)
                pipe = coordinator.build_pipeline(opts, renderer=renderer, layout=layout, engine=None, sink=sink,
                                                  driver_factory=self._driver_factory(), shared_slots=self.page_slots)
                with self._cv:
                    self._pipes[rec.job_id] = pipe
                for _ in pipe.run(coordinator.leased_jobs(ws, "server", opts.max_pages_in_flight, False)):
                    if self._stopping:
                        break
            if self._stopping:
                log.info("jobs: %s stopped with %d of %d pages; it resumes on the next start", rec.job_id,
                         rec.extracted_pages, rec.total_pages)
                return
            st = ws.status()
        finally:
            ws.close()
        lines, errors = _result_lines(d / "ws", Path(rec.file_name).stem, st, opts)
        write_atomic(str(d / "result.jsonl"), "".join(json.dumps(x, ensure_ascii=False) + "\n"
                                                      for x in lines).encode())
        if lines and len(errors) == len(lines):
            self._finish(rec, JobState.FAILED, f"every page failed; page 1: {errors[0]}")
        else:
            self._finish(rec, JobState.DONE, None)

    def page_settled(self, rec: JobRecord) -> None:
        rec.extracted_pages += 1          # only this job's writer thread counts its pages
        with self._counts_lock:
            self.counts["pages"] += 1
        self.rate.add()

    def _finish(self, rec: JobRecord, state: JobState, error: str | None) -> None:
        rec.state, rec.error_msg, rec.finished = state, error, time.time()
        self._save(rec)
        with self._counts_lock:
            self.counts["done" if state is JobState.DONE else "failed"] += 1
        log.info("jobs: %s %s after %.1f s%s", rec.job_id, state.value, rec.finished - (rec.started or rec.created),
                 f": {error}" if error else "")

    def remove(self, job_id: str) -> None:
        """A finished job gone at once (a synchronous /layout-parsing call's, once answered)."""
        with self._cv:
            rec = self.jobs.get(job_id)
            if rec is None or rec.state not in (JobState.DONE, JobState.FAILED):
                return
            del self.jobs[job_id]
        shutil.rmtree(self._dir(job_id), ignore_errors=True)

    # ---------------------------------------------------------------- expiry
    def expire(self, now: float | None = None) -> int:
        """Remove finished jobs older than the TTL (their files with them)."""
        now = time.time() if now is None else now
        gone = []
        with self._cv:
            for rec in list(self.jobs.values()):
                if rec.finished is not None and rec.state in (JobState.DONE, JobState.FAILED) \
                        and now - rec.finished > self.config.ttl_s:
                    del self.jobs[rec.job_id]
                    gone.append(rec.job_id)
        for job_id in gone:
            shutil.rmtree(self._dir(job_id), ignore_errors=True)
        if gone:
            log.info("jobs: %d finished jobs expired (--job-ttl %g s) and removed", len(gone), self.config.ttl_s)
        return len(gone)

    def close(self) -> None:
        self.stop()
        if self._thread is not None:
            self._thread.join(10)
        with self._cv:
            threads = list(self._running.values())
        for th in threads:
            th.join(10)
        if self._models is not None:
            self._models[0].close()


class _JobSink:
    """The workspace sink of a job, counting settled pages for the job's progress; while the
    server stops, a page's failure is not recorded (the engine refusing work because it shuts
    down is no fault of the page: it stays pending and runs on the next start)."""

    def __init__(self, ws, service: JobService, rec: JobRecord):
        from ...parsing.coordinator import WorkspaceSink
        self.inner, self.service, self.rec = WorkspaceSink(ws), service, rec

    def commit(self, job, result) -> bool:
        ok = self.inner.commit(job, result)
        if ok:
            self.service.page_settled(self.rec)
        return ok

    def fail(self, job, stage: str, message: str) -> None:
        if self.service.stopping:
            return
        self.inner.fail(job, stage, message)
        self.service.page_settled(self.rec)


# ------------------------------------------------------------------ results
def _errors(ws_dir: Path) -> list[dict]:
    """The workspace's error records, their messages without the server's own paths: a client
    sees its document named as the job's input (``input/document.pdf``), not where it lives."""
    f = ws_dir / "errors.jsonl"
    records = [json.loads(x) for x in f.read_text().splitlines() if x.strip()] if f.is_file() else []
    job_dir = str(ws_dir.parent.resolve()) + os.sep
    for r in records:
        r["message"] = str(r.get("message", "")).replace(job_dir, "").replace(str(ws_dir.parent) + os.sep, "")
    return records


def _input_error(ws_dir: Path) -> str:
    errs = _errors(ws_dir)
    return f"{errs[0]['stage']}: {errs[0]['message']}" if errs else "the document could not be opened"


def _result_lines(ws_dir: Path, stem: str, st, opts) -> tuple[list[dict], list[str]]:
    """One JSON Lines item per page, in page order: ``{"result": {"layoutParsingResults":
    [page], "dataInfo": ...}}``. Markdown images are keyed by their file name alone (the client
    saves them into one directory by that name) and the Markdown links to that name; their values
    are paths relative to the job's result URL, made absolute when served. A failed page is a
    valid item with empty Markdown and an ``error``."""
    from ...parsing.sources import count_pages, parse_page_ranges
    failed = {e["page"]: e for e in _errors(ws_dir)}
    pages = sorted(int(p.stem.rsplit("_", 1)[1]) for p in ws_dir.glob(f"{stem}_[0-9][0-9][0-9][0-9].json"))
    inputs = list((ws_dir.parent / "input").iterdir())
    n = count_pages(inputs[0]) if inputs else 0
    wanted = [i + 1 for i in parse_page_ranges(opts.pages).select(n)]
    is_pdf = inputs[0].suffix.lower() == ".pdf" if inputs else False
    lines, errors = [], []
    for page in wanted:
        if page in pages:
            tag = f"{stem}_{page:04d}"
            record = json.loads((ws_dir / f"{tag}.json").read_text(encoding="utf-8"))
            text = (ws_dir / f"{tag}.md").read_text(encoding="utf-8")
            images = {}
            for img in sorted((ws_dir / "imgs").glob(f"{tag}_*")) if (ws_dir / "imgs").is_dir() else []:
                rel = f"imgs/{img.name}"
                images[img.name] = rel
                text = text.replace(rel, img.name)
            shown = {"layout_det_res": f"{tag}_layout.png"} if (ws_dir / f"{tag}_layout.png").is_file() else {}
            item = {"prunedResult": record, "markdown": {"text": text, "images": images}, "outputImages": shown}
            size = {"width": record.get("width"), "height": record.get("height")}
        else:
            e = failed.get(page, {"stage": "unknown", "message": "the page has no result"})
            errors.append(f"{e['stage']}: {e['message']}")
            item = {"prunedResult": None, "markdown": {"text": "", "images": {}}, "outputImages": {},
                    "error": {"stage": e["stage"], "message": e["message"]}}
            size = {"width": None, "height": None}
        info = {"type": "pdf", "numPages": n, "pageIndex": page - 1, "pages": [size]} if is_pdf else \
            {"type": "image", **size}
        lines.append({"result": {"layoutParsingResults": [item], "dataInfo": info}})
    return lines, errors


__all__ = ["JobRecord", "JobService", "JobState", "JobsConfig", "QueueFull", "ServedEngineDriver"]


def jobs_config_from_args(ns: argparse.Namespace) -> JobsConfig | None:
    from ..args import CliError
    if ns.jobs_dir is None:
        return None
    for name in ("max_queued_jobs", "max_running_jobs", "max_upload_bytes"):
        if getattr(ns, name) < 1:
            raise CliError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(ns, name)}")
    if ns.job_pages_in_flight is not None and ns.job_pages_in_flight < 1:
        raise CliError(f"--job-pages-in-flight must be >= 1, got {ns.job_pages_in_flight}")
    if ns.job_ttl <= 0:
        raise CliError(f"--job-ttl must be > 0, got {ns.job_ttl}")
    return JobsConfig(jobs_dir=Path(ns.jobs_dir), max_queued_jobs=ns.max_queued_jobs,
                      max_running_jobs=ns.max_running_jobs, pages_in_flight=ns.job_pages_in_flight,
                      max_upload_bytes=ns.max_upload_bytes, ttl_s=ns.job_ttl, priority_offset=ns.job_priority)
