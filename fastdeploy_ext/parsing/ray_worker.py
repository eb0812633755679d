"""`parse --ray`: what runs on the cluster. One ``ParseWorker`` actor per device holds the layout
model, the engine and the same in-process pipeline as one machine (continuous block feeding, no
barriers); its pages are rendered by ``RayRenderer`` as CPU tasks anywhere in the cluster (or by
the actor's own render processes with ``--ray-render actor``).

The actor decides nothing about what is done: it runs the pages the driver leases to it and hands
every page's outcome back; the driver commits (or refuses) it through the workspace. Calls, from
the driver (the actor is threaded, so they run beside the pipeline):

    info()                 -> pid, node, device: once, when the models are loaded
    begin(run)             a pipeline for the driver's run ``run`` (models kept between runs)
    feed(run, lease, works) the pages of a lease, queued for the pipeline's feeder
    take(run, timeout_s)   -> {"run", "results", "want", "busy", "finished", "error"}: blocks until
                              there is something to say or ``timeout_s`` passed (the heartbeat that
                              renews the actor's leases)
    stop()                 the run is over: the pipeline takes no more pages

Backpressure: the pipeline's feeder pulls a page only when a slot is free (``max_pages_in_flight``);
when it pulls and nothing is queued, ``take`` answers ``want`` and the driver grants one lease.
"""
from __future__ import annotations

import logging
import os
import threading
import time
from collections import deque
from concurrent.futures import Future

log = logging.getLogger(__name__)

#: fault injection for tests, read in the actor's environment (the job's runtime_env, or the
#: cluster's): "<file name>:<1-based page>": the actor's process exits when it is fed that page,
#: as a worker that a page crashes (OOM, a device fault) would
DIE_ON_PAGE_ENV = "FDX_PARSE_TEST_RAY_DIE_ON_PAGE"


# ------------------------------------------------------------------ rendering as Ray tasks
def _render_task(task):
    """A Ray task: one page -> ("ok", RenderedPage) or ("err", stage, message). Errors travel as
    values: a PageError raised through Ray would come back wrapped in a RayTaskError."""
    from .errors import PageError
    from .render import render_page
    try:
        return ("ok", render_page(task))
    except PageError as e:
        return ("err", e.stage, e.message)
    except Exception as e:  # noqa: BLE001 - the page's error, the task's worker lives on
        return ("err", "render", f"{task.path}: page {task.page_index + 1} failed to render ({type(e).__name__}: {e})")


class RayRenderer:
    """The pipeline's renderer (``submit(RenderTask) -> Future[RenderedPage]``) over Ray tasks of
    one CPU each, scheduled anywhere in the cluster (the input path must be readable there: the
    shared path). A task past its ``timeout_s`` is cancelled (its worker process killed) and the
    page fails with PageError('render'); a task whose worker dies is retried by Ray."""

    def __init__(self, num_cpus: float = 1.0, max_retries: int = 2):
        import ray
        self._remote = ray.remote(num_cpus=num_cpus, max_retries=max_retries)(_render_task)
        self._closed = False

    def submit(self, task) -> Future:
        from .errors import PageError
        if self._closed:
            raise RuntimeError("RayRenderer is closed")
        ref = self._remote.remote(task)
        out: Future = Future()
        timer = threading.Timer(task.timeout_s, lambda: _cancel(ref, out, task))
        timer.daemon = True

        def done(f: Future) -> None:
            timer.cancel()
            if out.done():
                return
            try:
                value = f.result()
            except BaseException as e:  # noqa: BLE001 - the task died past its retries, or was cancelled
                _set(out, exc=PageError("render", f"{task.path}: page {task.page_index + 1}: the render task failed "
                                                  f"({type(e).__name__}: {e})"))
                return
            if value[0] == "ok":
                page = value[1]
                import numpy as np
                # the object store hands out read-only arrays; the pipeline owns its page image
                page.image = np.array(page.image)
                _set(out, result=page)
            else:
                _set(out, exc=PageError(value[1], value[2]))
        timer.start()
        ray_future = ref.future()
        ray_future.add_done_callback(done)
        return out

    def close(self) -> None:
        self._closed = True


def _set(fut: Future, result=None, exc: BaseException | None = None) -> None:
    try:
        if exc is not None:
            fut.set_exception(exc)
        else:
            fut.set_result(result)
    except Exception:  # noqa: BLE001 - already set (the timeout and the result raced)
        pass


def _cancel(ref, out: Future, task) -> None:
    import ray

    from .errors import PageError
    _set(out, exc=PageError("render", f"{task.path}: page {task.page_index + 1} did not render within "
                                      f"{task.timeout_s:g} s (its Ray task was cancelled)"))
    try:
        ray.cancel(ref, force=True)
    except Exception:  # noqa: BLE001 - it finished meanwhile
        pass


# ------------------------------------------------------------------ the worker actor
class ParseWorker:
    """Decorated with ``ray.remote`` by the driver (ray_cluster.py), so this module imports
    without Ray. One per device: ``num_gpus`` of the actor's options gives it its GPUs (Ray sets
    CUDA_VISIBLE_DEVICES)."""

    def __init__(self, name: str, opts, render_mode: str, log_level: int):
        import sys
        # Ray copies an actor's stdout to the driver's stdout, which is --json-progress's stream
        sys.stdout = sys.stderr
        logging.basicConfig(level=log_level,
                            format=f"%(asctime)s [fastdeploy_ext {name}] %(levelname)s %(message)s")
        from .coordinator import build_engine, build_layout, build_pipeline
        from .pipeline import NullSink
        from .render import PageRenderer
        self.name = name
        self.renderer = RayRenderer() if render_mode == "tasks" else PageRenderer(workers=opts.render_workers)
        layout = build_layout(opts)
        self.engine = build_engine(opts, layout)       # after the layout model: its memory is kept out of the KV pool
        # the pipeline's outcomes go to the driver, which commits them: the actor writes nothing
        self.pipe = build_pipeline(opts, renderer=self.renderer, layout=layout, engine=self.engine, sink=NullSink())
        make = getattr(getattr(self.engine, "runner", None), "utilization_reader", None)
        self._busy = make() if callable(make) else None
        self._die_on = os.environ.get(DIE_ON_PAGE_ENV)
        self._cond = threading.Condition()
        self._run_id = 0                       # the driver's run this actor works for (0: none yet)
        self._thread: threading.Thread | None = None
        self._reset()

    def _reset(self) -> None:
        self._queued: deque = deque()          # PageJobs fed, not pulled by the pipeline yet
        self._results: list[tuple] = []        # messages for the driver (workers.py's commit / fail forms)
        self._want = False                     # the feeder is waiting for pages and the driver was not told yet
        self._finished = False
        self._error: str | None = None

    def info(self) -> dict:
        import ray
        ctx = ray.get_runtime_context()
        return {"pid": os.getpid(), "node": ray.util.get_node_ip_address(), "node_id": ctx.get_node_id(),
                "gpus": [str(g) for g in ray.get_gpu_ids()],
                "device": getattr(getattr(getattr(self.engine, "runner", None), "plan", None), "row", "stub")}

    def begin(self, run_id: int) -> None:
        """Start a pipeline for the driver's run ``run_id`` (the models stay loaded between runs);
        the previous run's pipeline was told to stop and ends first. Results, feeds and takes of
        another run are told apart by the id, so nothing of one run is taken for the next."""
        thread = self._thread
        if thread is not None:
            self.stop()
            thread.join()
        with self._cond:
            self._reset()
            self._run_id = run_id
            self._thread = threading.Thread(target=self._run, args=(run_id,), name="fdx-ray-pipeline", daemon=True)
            self._thread.start()
            self._cond.notify_all()

    def feed(self, run_id: int, lease, works) -> None:
        from pathlib import Path

        from .pipeline import PageJob
        if self._die_on is not None and any(f"{Path(str(w.path)).name}:{w.page_index + 1}" == self._die_on for w in works):
            log.warning("%s (pid %d): exiting on page %s (%s)", self.name, os.getpid(), self._die_on, DIE_ON_PAGE_ENV)
            logging.shutdown()
            os._exit(1)
        with self._cond:
            if run_id != self._run_id:         # a feed of an ended run: its pages are the driver's again
                return
            self._queued.extend(PageJob(w, lease) for w in works)
            self._cond.notify_all()

    def take(self, run_id: int, timeout_s: float) -> dict:
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while self._run_id != run_id or not (self._results or self._want or self._finished):
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._cond.wait(left)
            if self._run_id != run_id:         # a call of another run: nothing for it
                return {"run": run_id if self._run_id < run_id else -1, "results": [], "want": False, "busy": None, "finished": False,
                        "error": None}
            results, self._results = self._results, []
            want, self._want = self._want, False
            finished, error = self._finished, self._error
        busy = None
        if self._busy is not None:
            try:
                busy = float(self._busy())
            except Exception:  # noqa: BLE001 - a management library hiccup: no sample
                busy = None
        return {"run": run_id, "results": results, "want": want, "busy": busy, "finished": finished, "error": error}

    def stop(self) -> None:
        """End this run's pipeline: its feeder takes no more pages."""
        with self._cond:
            self._finished = True
            self._cond.notify_all()

    # ---------------------------------------------------------------- the pipeline's thread
    def _jobs(self):
        while True:
            with self._cond:
                while not self._queued and not self._finished:
                    if not self._want:
                        self._want = True
                        self._cond.notify_all()
                    self._cond.wait()
                if not self._queued:
                    return
                job = self._queued.popleft()
            yield job

    def _run(self, run_id: int) -> None:
        error = None
        try:
            for outcome in self.pipe.run(self._jobs()):
                w, lease = outcome.job.work, outcome.job.lease
                if outcome.error is None:
                    msg = ("commit", lease, w, outcome.result, outcome.output_tokens)
                else:
                    msg = ("fail", lease, w, outcome.error.stage, outcome.error.message)
                with self._cond:
                    if self._run_id == run_id:
                        self._results.append(msg)
                        self._cond.notify_all()
        except BaseException as e:  # noqa: BLE001 - the driver sees it and replaces this worker
            log.exception("%s: the pipeline failed", self.name)
            error = f"{type(e).__name__}: {e}"
        with self._cond:
            if self._run_id == run_id:
                self._error = error
                self._finished = True
                self._cond.notify_all()
