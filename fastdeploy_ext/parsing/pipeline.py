"""The document pipeline: pages in, committed (or failed) pages out, every stage busy at once.

    feeder --render futures--> layout thread --requests--> engine thread --finished blocks-->
    writer thread (assemble, commit / fail)

- The feeder takes a page only when fewer than ``max_pages_in_flight`` are open (a semaphore
  the writer releases), so host memory is bounded by pages in flight, never by the document.
- Rendering runs in the PageRenderer's processes; a finished render is handed to the layout
  thread through a queue (the future's callback), in completion order.
- The layout thread blocks for one rendered page, then takes whatever else is already there
  (up to ``layout_batch``) and runs the layout model once over them: batched across pages in
  flight without waiting for a batch to fill. Post-processing, block planning and crops follow;
  each VLM block is submitted to the engine at once with its ``priority``.
- The engine thread owns the step loop: it steps while anything is queued or running and
  otherwise sleeps on an event that a submission's preprocessing future sets; a block's result
  is delivered when its request finishes. No page group, no barrier: a page completes when its
  last block does, out of order with the others.
- The writer thread is the only one that touches the sink (the workspace is single-writer):
  it assembles a completed page and commits it, or records a failed one, then frees its slot.
End of input: the feeder marks the input closed; the writer, seeing no open page left after
that, stops the layout and engine threads (a sentinel and a closed flag, never a poll).
Every stage's failure is its page's failure (a PageError with that stage); the run goes on.
"""
from __future__ import annotations

import concurrent.futures as cf
import itertools
import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable, Protocol

import numpy as np

from .errors import PageError

log = logging.getLogger(__name__)

_END = object()     # end of input, through a stage's queue


# ------------------------------------------------------------------ what flows through
@dataclass
class PageJob:
    """One page to parse: the workspace's PageWork and the lease it is held under (None when
    parsing without a workspace)."""
    work: object                 # workspace.PageWork: key, path, page_index, page_count
    lease: object | None = None


@dataclass
class PageOutcome:
    """A page as it left the pipeline: ``result`` (assembled) or ``error``; ``committed``:
    the sink accepted it (False for a stale lease's commit)."""
    job: PageJob
    result: object | None = None       # assemble.PageResult
    error: PageError | None = None
    committed: bool = True
    blocks: int = 0
    output_tokens: int = 0

    @property
    def key(self) -> str:
        return self.job.work.key


class PageSink(Protocol):
    """Where the writer thread puts pages (the workspace, or a worker's link to its coordinator).
    ``commit`` returns False when the page was refused (a stale lease)."""

    def commit(self, job: PageJob, result) -> bool: ...

    def fail(self, job: PageJob, stage: str, message: str) -> None: ...


class NullSink:
    """Parsing without a workspace: pages are only yielded."""

    def commit(self, job: PageJob, result) -> bool:
        return True

    def fail(self, job: PageJob, stage: str, message: str) -> None:
        pass


class PlantedLayouts(Protocol):
    """Known boxes per page (benchmarks, tests): the layout model still runs for its cost, the
    detections it would give are replaced by these (page pixels, the model's reading order)."""

    def detections(self, path: str, page_index: int, width: int, height: int) -> list[dict]: ...


@dataclass
class PipelineOptions:
    max_pages_in_flight: int = 16
    layout_batch: int = 8
    layout_threshold: float = 0.3          # the model's own cut; layout_post applies the config's
    dpi: int = 144
    render_timeout_s: float = 60.0
    max_new_tokens: int = 4096
    block_max_pixels: int | None = None    # caps each block's max_pixels (tiny test models)
    stub_vlm: bool = False                 # no engine: a block's text is a fixed stub (the CPU stages alone)
    # random VLM weights rarely emit EOS: every block would decode max_new_tokens (or stop where
    # the repetition guard sees a loop); benches fix each block's length by its kind instead
    # (synthetic.PLANTED_TOKENS), as bench generate plants its output lengths
    planted_decode: bool = False
    # keep each page's image until its write, to draw its layout picture (visualize.py)
    visualize: bool = False

    def validate(self) -> None:
        for name in ("max_pages_in_flight", "layout_batch", "dpi", "max_new_tokens"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {v!r}")
        if self.block_max_pixels is not None and self.block_max_pixels < 4:
            raise ValueError(f"block_max_pixels must be >= 4, got {self.block_max_pixels!r}")


@dataclass
class StageTimes:
    """Seconds spent per stage (summed where a stage runs several at once) and the counts."""
    render_s: float = 0.0          # submit -> rendered page, per page
    layout_s: float = 0.0          # the layout model's calls
    post_s: float = 0.0            # post-processing, block planning, crops
    prefill_s: float = 0.0         # engine steps that prefilled
    decode_s: float = 0.0          # engine steps that decoded
    idle_s: float = 0.0            # the engine thread with nothing to run
    assemble_s: float = 0.0
    write_s: float = 0.0
    pages_done: int = 0
    pages_failed: int = 0
    blocks: int = 0
    output_tokens: int = 0
    layout_calls: int = 0

    def as_dict(self) -> dict:
        return dict(self.__dict__)


# ------------------------------------------------------------------ page slots
class PageSlots:
    """How many pages may be open at once: a counting semaphore whose waiters an abort wakes.
    Each run has its own (``max_pages_in_flight``); several runs may also share one (the
    server's page budget across its running jobs), so more jobs spread the same pages in
    flight instead of adding to them. Waiters are woken all at once on every release: a woken
    waiter whose run was aborted leaves without taking the slot, and another takes it."""

    def __init__(self, n: int):
        if not isinstance(n, int) or n < 1:
            raise ValueError(f"page slots must be an integer >= 1, got {n!r}")
        self.size = n
        self._free = n
        self._cv = threading.Condition()

    def acquire(self, abort: threading.Event) -> bool:
        """One slot (True), or False once ``abort`` is set (``wake`` makes a waiter look)."""
        with self._cv:
            while self._free == 0 and not abort.is_set():
                self._cv.wait()
            if abort.is_set():
                return False
            self._free -= 1
            return True

    def release(self, n: int = 1) -> None:
        with self._cv:
            self._free += n
            if self._free > self.size:
                raise RuntimeError(f"page slots released more than taken ({self._free} free of {self.size})")
            self._cv.notify_all()

    def wake(self) -> None:
        with self._cv:
            self._cv.notify_all()

    def in_use(self) -> int:
        with self._cv:
            return self.size - self._free


# ------------------------------------------------------------------ the layout model
class LayoutModel:
    """A layout family's model on a device runner (what entrypoints.Detector wraps, without
    importing the entry points): ``detect(images) -> per image a list of detection dicts``."""

    def __init__(self, runner, model_dir: str | None, *, load_format: str = "auto", model_family: str | None = None):
        if not hasattr(runner, "load_detector"):
            raise ValueError(f"runner {runner.name} has no detector path (it does not build on TorchRunner)")
        if model_dir is None:
            load_format = "dummy"
        self.runner = runner
        self.load_report = runner.load_detector(model_dir, load_format=load_format, model_family=model_family)
        self.processor = runner.detector_family.image_processor(None if load_format == "dummy" else model_dir,
                                                                runner.detector_cfg)

    def detect(self, images: list[np.ndarray], threshold: float) -> list[list[dict]]:
        pixels, sizes = self.processor.preprocess(list(images))
        return [[d.to_json() for d in dets] for dets in self.runner.detect(pixels, sizes, threshold=threshold)]


# ------------------------------------------------------------------ the engine's thread
BlockDone = Callable[[object | None, str | None], None]   # (RequestOutput, error) -> None


class EngineDriver:
    """The engine's step loop in its own thread, fed while it runs: ``submit`` queues a request
    (preprocessed in the engine's pool) and ``on_done(output, error)`` is called from this thread
    when it finishes (error: why it failed, or was refused before it was queued). The loop steps
    while the engine has work and otherwise sleeps on an event (set by every submission and by
    ``close``), so an idle engine costs nothing and a new request starts at once."""

    def __init__(self, engine, times: StageTimes):
        self.engine = engine
        self.times = times
        self._wake = threading.Event()
        self._lock = threading.Lock()
        self._callbacks: dict[str, BlockDone] = {}
        self._closed = False
        self.error: str | None = None
        self._ids = itertools.count()
        self._thread = threading.Thread(target=self._run, name="fdx-parse-engine", daemon=True)
        self._thread.start()

    def submit(self, prompt: dict, params, priority: int, on_done: BlockDone) -> None:
        if self.error is not None:
            on_done(None, self.error)
            return
        rid = f"parse-{next(self._ids)}"
        with self._lock:
            self._callbacks[rid] = on_done
        fut = self.engine.submit(rid, prompt, params, priority=priority)
        fut.add_done_callback(lambda f, rid=rid: self._queued(rid, f))

    def _queued(self, rid: str, fut: cf.Future) -> None:
        err = None if fut.cancelled() else fut.exception()
        if fut.cancelled() or err is not None:            # refused by preprocessing: never queued
            with self._lock:
                cb = self._callbacks.pop(rid, None)
            if cb is not None:
                cb(None, f"refused: {err}" if err is not None else "cancelled")
        self._wake.set()

    def close(self) -> None:
        """No more submissions: the thread ends once the engine has nothing left."""
        self._closed = True
        self._wake.set()

    def abort(self) -> None:
        """The run was abandoned (the caller stopped reading, Ctrl-C): every request in flight
        ends at the next step (finish_reason "abort"), so the thread does not decode them out."""
        with self._lock:
            rids = list(self._callbacks)
        for rid in rids:
            self.engine.abort_request(rid)
        self.close()

    def join(self) -> None:
        self._thread.join()

    def _run(self) -> None:
        eng, t = self.engine, self.times
        try:
            while True:
                if eng.has_unfinished_in_engine():
                    prefills = eng.stats().num_prefill_steps
                    t0 = time.perf_counter()
                    outs = eng.step()
                    dt = time.perf_counter() - t0
                    if eng.stats().num_prefill_steps != prefills:
                        t.prefill_s += dt
                    else:
                        t.decode_s += dt
                    for out in outs:
                        if out.finished:
                            with self._lock:
                                cb = self._callbacks.pop(out.request_id, None)
                            if cb is not None:
                                err = ((out.error or out.finish_reason) if out.finish_reason in ("error", "abort")
                                       else None)
                                cb(out, err)
                    continue
                if self._closed and not eng.has_unfinished():
                    return
                t0 = time.perf_counter()
                self._wake.wait()
                self._wake.clear()
                t.idle_s += time.perf_counter() - t0
        except BaseException as e:   # noqa: BLE001 - what the batch shares failed: every block in flight fails
            self.error = f"the engine's step loop died: {type(e).__name__}: {e}"
            log.exception("parse: engine step loop died")
            with self._lock:
                cbs, self._callbacks = list(self._callbacks.values()), {}
            for cb in cbs:
                cb(None, self.error)


class StubEngineDriver:
    """No model: every block's text is a fixed stub at once (`bench parse --stub-vlm`, tests of
    the CPU stages)."""

    TEXT = "stub"

    def __init__(self, times: StageTimes):
        self.times = times
        self.error = None

    def submit(self, prompt: dict, params, priority: int, on_done: BlockDone) -> None:
        on_done(_StubOutput(self.TEXT), None)

    def close(self) -> None:
        pass

    def join(self) -> None:
        pass


@dataclass
class _StubOutput:
    text: str
    num_output_tokens: int = 0           # nothing was generated
    finish_reason: str = "stop"


# ------------------------------------------------------------------ one page in flight
@dataclass
class _Page:
    job: PageJob
    t_submit: float
    rendered: object | None = None           # render.RenderedPage (dropped after crops)
    image: np.ndarray | None = None          # the page's pixels, kept only for its layout picture
    meta: object | None = None                # assemble.PageMeta
    results: list = field(default_factory=list)
    crops: dict = field(default_factory=dict)
    remaining: int = 0
    error: PageError | None = None
    output_tokens: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)


class Pipeline:
    """``run(jobs)`` yields a PageOutcome per page as each completes (committed to ``sink`` or
    recorded as failed there first). One run at a time; the renderer, layout model and engine are
    the caller's and outlive the run."""

    def __init__(self, renderer, layout: LayoutModel, engine, opts: PipelineOptions, *,
                 post_config=None, task_options=None, planted: PlantedLayouts | None = None,
                 sink: PageSink | None = None, image_prefix: Callable[[PageJob], str] | None = None,
                 driver_factory: Callable[[StageTimes], object] | None = None,
                 shared_slots: PageSlots | None = None):
        from .blocks import ParseTaskOptions
        from .layout_post import LayoutPostConfig
        opts.validate()
        self.renderer, self.layout, self.engine, self.opts = renderer, layout, engine, opts
        self.post_config = post_config or LayoutPostConfig()
        self.task_options = task_options or ParseTaskOptions()
        self.planted = planted
        self.sink = sink or NullSink()
        self.image_prefix = image_prefix or default_image_prefix
        self.driver_factory = driver_factory or self._default_driver
        self.shared_slots = shared_slots
        self.times = StageTimes()

    def _default_driver(self, times: StageTimes):
        """The engine's step loop (EngineDriver), or the stub without an engine."""
        if self.opts.stub_vlm or self.engine is None:
            return StubEngineDriver(times)
        return EngineDriver(self.engine, times)

    # ---------------------------------------------------------------- the run
    def run(self, jobs: Iterable[PageJob]) -> Iterable[PageOutcome]:
        opts = self.opts
        self._slots = PageSlots(opts.max_pages_in_flight)
        self._shared_held = 0        # slots of shared_slots this run holds (given back when it ends)
        self._rendered: queue.Queue = queue.Queue()      # bounded by the slots
        self._writes: queue.Queue = queue.Queue()        # bounded by the slots
        self._out: queue.Queue = queue.Queue()           # bounded by the slots (released when yielded)
        self._lock = threading.Lock()
        self._open = 0
        self._rendering = 0          # pages submitted to the renderer, not rendered yet
        self._blocks = 0             # VLM blocks submitted to the driver, not finished yet
        self._input_closed = False
        self.driver = self.driver_factory(self.times)
        self.abort = threading.Event()
        threads = [threading.Thread(target=self._guard(self._layout_loop), name="fdx-parse-layout", daemon=True),
                   threading.Thread(target=self._guard(self._writer_loop), name="fdx-parse-writer", daemon=True),
                   threading.Thread(target=self._guard(lambda: self._feed(jobs)), name="fdx-parse-feeder",
                                    daemon=True)]
        for th in threads:
            th.start()
        completed = False
        try:
            while True:
                item = self._out.get()
                if item is _END:
                    completed = True
                    break
                if isinstance(item, BaseException):
                    raise item
                self._release_slot()
                yield item
        finally:
            self.abort.set()
            self._slots.wake()              # a feeder blocked on a slot sees the abort
            if self.shared_slots is not None:
                self.shared_slots.wake()
            self._rendered.put(_END)
            self._writes.put(_END)
            if not completed and hasattr(self.driver, "abort"):
                self.driver.abort()
            self.driver.close()
            for th in threads:
                th.join(timeout=30)
            self.driver.join()
            with self._lock:
                held, self._shared_held = self._shared_held, 0
            if held and self.shared_slots is not None:      # pages never yielded: the budget is not ours
                self.shared_slots.release(held)

    def _take_slot(self) -> bool:
        """A slot of this run, then one of the shared budget; False once the run is aborted."""
        if not self._slots.acquire(self.abort):
            return False
        if self.shared_slots is not None:
            if not self.shared_slots.acquire(self.abort):
                self._slots.release()
                return False
            with self._lock:
                self._shared_held += 1
        return True

    def _release_slot(self) -> None:
        self._slots.release()
        if self.shared_slots is not None:
            with self._lock:
                self._shared_held -= 1
            self.shared_slots.release()

    def depths(self) -> dict[str, int]:
        """What is in each stage now (read by /metrics while a run goes on; zeros before one):
        pages in flight, pages rendering (submitted to the renderer), rendered pages waiting for
        the layout model, VLM blocks in the engine driver (queued or running there), pages
        waiting for the writer."""
        if not hasattr(self, "_lock"):
            return dict.fromkeys(("pages_in_flight", "rendering", "layout_queue", "blocks_in_flight", "write_queue"), 0)
        with self._lock:
            open_, rendering, blocks = self._open, self._rendering, self._blocks
        return {"pages_in_flight": open_, "rendering": rendering, "layout_queue": self._rendered.qsize(),
                "blocks_in_flight": blocks, "write_queue": self._writes.qsize()}

    def _guard(self, fn):
        """A stage thread's bug ends the run with its exception (raised from run()), never a hang."""
        def run():
            try:
                fn()
            except BaseException as e:   # noqa: BLE001 - handed to the consumer
                log.exception("parse: a pipeline thread failed")
                self._out.put(e)
        return run

    def _feed(self, jobs: Iterable[PageJob]) -> None:
        from .render import RenderTask
        for job in jobs:
            if not self._take_slot():
                return
            page = _Page(job, time.perf_counter())
            with self._lock:
                self._open += 1
            w = job.work
            try:
                fut = self.renderer.submit(RenderTask(str(w.path), w.page_index, dpi=self.opts.dpi,
                                                      timeout_s=self.opts.render_timeout_s))
            except Exception as e:  # noqa: BLE001 - the page fails, the run goes on
                self._fail(page, _as_page_error(e, "render"))
                continue
            with self._lock:
                self._rendering += 1
            fut.add_done_callback(lambda f, page=page: self._rendered_done(page, f))
        with self._lock:
            self._input_closed = True
            finished = self._open == 0
        if finished:
            self._writes.put(_END)

    def _rendered_done(self, page: _Page, fut: cf.Future) -> None:
        self.times.render_s += time.perf_counter() - page.t_submit
        with self._lock:
            self._rendering -= 1
        try:
            page.rendered = fut.result()
        except BaseException as e:   # noqa: BLE001 - a PageError("render", ...) or the pool's own failure
            self._fail(page, _as_page_error(e, "render"))
            return
        self._rendered.put(page)

    # ---------------------------------------------------------------- layout -> blocks
    def _layout_loop(self) -> None:
        while True:
            first = self._rendered.get()
            if first is _END:
                return
            batch = [first]
            while len(batch) < self.opts.layout_batch:       # what is there already, no waiting
                try:
                    nxt = self._rendered.get_nowait()
                except queue.Empty:
                    break
                if nxt is _END:
                    self._rendered.put(_END)
                    break
                batch.append(nxt)
            self._layout_batch(batch)

    def _layout_batch(self, batch: list[_Page]) -> None:
        t0 = time.perf_counter()
        try:
            found = self.layout.detect([p.rendered.image for p in batch], self.opts.layout_threshold)
        except Exception as e:  # noqa: BLE001 - the batch's pages fail, the run goes on
            log.error("parse: layout model failed on %d pages: %s", len(batch), e)
            for p in batch:
                self._fail(p, _as_page_error(e, "layout"))
            return
        finally:
            self.times.layout_s += time.perf_counter() - t0
            self.times.layout_calls += 1
        if len(found) != len(batch):          # a page without its result would never complete
            for p in batch:
                self._fail(p, PageError("layout", f"the layout model returned {len(found)} results for "
                                                  f"{len(batch)} pages"))
            return
        for page, dets in zip(batch, found):
            try:
                self._plan_page(page, dets)
            except Exception as e:  # noqa: BLE001
                self._fail(page, _as_page_error(e, "layout"))

    def _plan_page(self, page: _Page, dets: list[dict]) -> None:
        from .assemble import BlockResult, PageMeta
        from .blocks import BlockKind, crop_block, plan_blocks
        from .layout_post import postprocess
        t0 = time.perf_counter()
        r, w = page.rendered, page.job.work
        if self.planted is not None:
            dets = self.planted.detections(str(w.path), w.page_index, r.width, r.height)
        blocks = postprocess(dets, r.width, r.height, self.post_config)
        tasks = plan_blocks(blocks, self.task_options)
        page.meta = PageMeta(str(w.path), w.page_index, r.page_count, r.width, r.height)
        page.results = [None] * len(tasks)
        vlm = []
        for i, task in enumerate(tasks):
            if task.kind is BlockKind.VLM:
                vlm.append((i, task, crop_block(r.image, task)))
            else:
                if task.kind is BlockKind.IMAGE:
                    page.crops[task.block.order] = crop_block(r.image, task)
                page.results[i] = BlockResult(task, "")
        page.image = r.image if self.opts.visualize else None
        page.rendered = None           # the page image is not needed any more: only its crops
        page.remaining = len(vlm)
        self.times.post_s += time.perf_counter() - t0
        if not vlm:
            self._writes.put(page)
            return
        with self._lock:
            self._blocks += len(vlm)
        for i, task, crop in vlm:
            def done(out, err, page=page, i=i, task=task):
                self._block_done(page, i, task, out, err)
            try:
                self.driver.submit(self._request(task, crop), self._params(task), task.priority, done)
            except Exception as e:  # noqa: BLE001 - this block fails (its page with it); the blocks sent run on
                done(None, f"not submitted: {type(e).__name__}: {e}")

    def _request(self, task, crop: np.ndarray) -> dict:
        from PIL import Image
        max_pixels = task.max_pixels
        if self.opts.block_max_pixels is not None:
            max_pixels = min(max_pixels, self.opts.block_max_pixels)
        return {"prompt": task.prompt, "multi_modal_data": {"image": Image.fromarray(crop)},
                "mm_processor_kwargs": {"min_pixels": min(task.min_pixels, max_pixels), "max_pixels": max_pixels}}

    def _params(self, task):
        from ..engine.sampling_params import RepetitionGuard, SamplingParams
        if self.opts.planted_decode:
            from .synthetic import planted_tokens
            n = min(planted_tokens(task.block.label), self.opts.max_new_tokens)
            return SamplingParams(temperature=0.0, max_tokens=n, min_tokens=n, ignore_eos=True,
                                  repetition_guard=RepetitionGuard(enabled=False))
        # greedy, the repetition guard on (its default): a looping block ends early, marked "repetition"
        return SamplingParams(temperature=0.0, max_tokens=self.opts.max_new_tokens)

    def _block_done(self, page: _Page, i: int, task, out, err: str | None) -> None:
        from .assemble import BlockResult
        with self._lock:
            self._blocks -= 1
        with page.lock:
            if err is not None and page.error is None:
                page.error = PageError("vlm", f"block {task.block.order} ({task.block.label}): {err}")
            if out is not None:
                page.output_tokens += int(getattr(out, "num_output_tokens", 0) or 0)
                page.results[i] = BlockResult(task, out.text or "")
            page.remaining -= 1
            last = page.remaining == 0
        if last:
            self._writes.put(page)

    # ---------------------------------------------------------------- the single writer
    def _fail(self, page: _Page, error: PageError) -> None:
        page.error = error
        page.rendered = None
        self._writes.put(page)

    def _writer_loop(self) -> None:
        from .assemble import assemble_page
        t = self.times
        while True:
            page = self._writes.get()
            if page is _END:
                break
            job = page.job
            outcome = PageOutcome(job, blocks=len(page.results), output_tokens=page.output_tokens)
            if page.error is None:
                t0 = time.perf_counter()
                try:
                    outcome.result = assemble_page(page.meta, page.results, page.crops, self.image_prefix(job))
                    if page.image is not None:
                        from .visualize import add_layout_picture
                        add_layout_picture(outcome.result, page.image, [r.task.block for r in page.results],
                                           self.image_prefix(job))
                except Exception as e:  # noqa: BLE001
                    page.error = _as_page_error(e, "assemble")
                t.assemble_s += time.perf_counter() - t0
            t0 = time.perf_counter()
            if page.error is None:
                try:
                    outcome.committed = self.sink.commit(job, outcome.result)
                except Exception as e:  # noqa: BLE001 - a write error fails the page, the run goes on
                    page.error = _as_page_error(e, "write")
            if page.error is not None:
                outcome.error, outcome.result = page.error, None
                log.warning("parse: %s page %d failed: %s", job.work.path, job.work.page_index + 1, page.error)
                self.sink.fail(job, page.error.stage, page.error.message)
                t.pages_failed += 1
            else:
                t.pages_done += 1
                t.blocks += outcome.blocks
                t.output_tokens += outcome.output_tokens
            t.write_s += time.perf_counter() - t0
            page.crops, page.results, page.image = {}, [], None
            self._out.put(outcome)
            with self._lock:
                self._open -= 1
                finished = self._input_closed and self._open == 0
            if finished:
                break
        self._rendered.put(_END)
        self.driver.close()
        self.driver.join()
        self._out.put(_END)


def default_image_prefix(job: PageJob) -> str:
    """The workspace's name for the page's crops (unique per page), else the file's stem."""
    w = job.work
    prefix = getattr(w, "image_prefix", None)
    return prefix if prefix and getattr(w, "stem", "") else f"imgs/{Path(str(w.path)).stem}_{w.page_index + 1:04d}"


def _as_page_error(e: BaseException, stage: str) -> PageError:
    if isinstance(e, PageError):
        return e
    return PageError(stage, f"{type(e).__name__}: {e}")
