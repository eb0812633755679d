"""`parse --workers N`: N engine processes on one host fed from one manifest.

The coordinator (the `parse` process) is the only writer: it holds the workspace and its lease
table; each worker (a spawned process with its own renderer, layout model and engine: one per
GPU with ``--gpus``, else all on the CPU or the default device) runs the pipeline over leased
pages and sends each page's result back over its pipe. Messages:

    worker -> coordinator: ("ready",) ("want",) ("renew", [lease, ...]) ("busy", device busy %)
                           ("commit", lease, work, PageResult, output tokens)
                           ("fail", lease, work, stage, message) ("bye",)
    coordinator -> worker: ("lease", lease, [PageWork, ...]) ("stop",)

A worker asks for the next lease when its pipeline wants more pages (so it keeps up to one
lease ahead of its pages in flight) and renews the leases it holds every ttl/3 seconds. A worker
that goes silent (stopped, hung, killed) lets its leases expire: the coordinator sees the expiry
at the deadline (its wait's timeout is the next expiry, never a poll), its pages go back to the
front and another worker gets them under a new fencing token; a late commit from the silent one
fails the token check and is refused (``StaleLease``), never written. A worker that dies gives
its leases back at once. The coordinator ends when every page is settled, then tells the
workers to stop and reads their pipes to the end (a late result is refused there too).
"""
from __future__ import annotations

import logging
import multiprocessing as mp
import os
import queue
import signal
import struct
import threading
import time
from typing import Iterator

from .pipeline import PageJob, PageOutcome

log = logging.getLogger(__name__)

#: a worker that has not said "ready" by then (model load included) is given up
WORKER_START_TIMEOUT_S = 600.0
#: fault injection for tests: the worker of this index stops itself (SIGSTOP) before sending
#: its first result, as a hung worker would
STOP_BEFORE_COMMIT_ENV = "FDX_PARSE_TEST_STOP_WORKER"


# ------------------------------------------------------------------ the worker process
class _Link:
    """The worker's end of its pipe: sends from several threads (writer, renewer), one at a time."""

    def __init__(self, conn):
        self.conn = conn
        self.lock = threading.Lock()

    def send(self, msg) -> None:
        with self.lock:
            self.conn.send(msg)

    def send_stopping_halfway(self, msg) -> None:
        """The fault injection's worst moment: the process stops (SIGSTOP) with half of the
        message's frame in the pipe (Connection's framing: a 4-byte big-endian length, then the
        pickle), and writes the rest when it is continued (SIGCONT)."""
        from multiprocessing.reduction import ForkingPickler
        payload = bytes(ForkingPickler.dumps(msg))
        frame = struct.pack("!i", len(payload)) + payload
        with self.lock:
            fd, half = self.conn.fileno(), len(frame) // 2
            _write_all(fd, frame[:half])
            os.kill(os.getpid(), signal.SIGSTOP)
            _write_all(fd, frame[half:])


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


class _LinkSink:
    """The worker's pipeline sink: results go to the coordinator, which commits or refuses."""

    def __init__(self, link: _Link, index: int, held: dict):
        self.link, self.index, self.held = link, index, held
        self.stop_once = os.environ.get(STOP_BEFORE_COMMIT_ENV) == str(index)

    def commit(self, job: PageJob, result) -> bool:
        if self.stop_once:
            self.stop_once = False
            log.warning("parse worker %d (pid %d): stopping itself before its first commit (%s)", self.index,
                        os.getpid(), STOP_BEFORE_COMMIT_ENV)
            self.link.send_stopping_halfway(("commit", job.lease, job.work, result, 0))
        else:
            self.link.send(("commit", job.lease, job.work, result, 0))
        self._page_left(job)
        return True

    def fail(self, job: PageJob, stage: str, message: str) -> None:
        self.link.send(("fail", job.lease, job.work, stage, message))
        self._page_left(job)

    def _page_left(self, job: PageJob) -> None:
        entry = self.held.get(job.lease.lease_id)
        if entry is not None:
            entry[1] -= 1
            if entry[1] <= 0:
                self.held.pop(job.lease.lease_id, None)


def worker_main(index: int, opts, conn, device: int | None, log_level: int) -> None:
    """A worker process: build the models, say ready, run leased pages until told to stop.
    ``opts``: the coordinator's ParseOptions (its EngineConfig included)."""
    if device is not None:
        os.environ["CUDA_VISIBLE_DEVICES"] = str(device)
    logging.basicConfig(level=log_level, format=f"%(asctime)s [fastdeploy_ext worker {index}] %(levelname)s %(message)s")
    from .coordinator import build_engine, build_layout, build_pipeline
    from .render import PageRenderer
    link = _Link(conn)
    renderer = PageRenderer(workers=opts.render_workers)
    try:
        layout = build_layout(opts)
        engine = build_engine(opts, layout)       # after the layout model: its memory is kept out of the KV pool
        held: dict[int, list] = {}           # lease_id -> [lease, pages not yet sent]
        stop = threading.Event()

        make = getattr(getattr(engine, "runner", None), "utilization_reader", None)
        busy = make() if callable(make) else None     # the backend's busy reader; None on the CPU

        def renew_loop():
            # renewals every ttl/3 at most; the device's busy % (for the coordinator's progress)
            # every 2 s where there is a reader
            while not stop.wait(min(opts.lease_ttl_s / 3, 2.0) if busy is not None else opts.lease_ttl_s / 3):
                leases = [e[0] for e in list(held.values())]
                if leases:
                    link.send(("renew", leases))
                if busy is not None:
                    try:
                        link.send(("busy", float(busy())))
                    except Exception:  # noqa: BLE001 - a management library hiccup: no sample
                        pass
        threading.Thread(target=renew_loop, name="fdx-parse-renew", daemon=True).start()

        def jobs() -> Iterator[PageJob]:
            while True:
                link.send(("want",))
                msg = conn.recv()
                if msg[0] == "stop":
                    return
                _, lease, works = msg
                held[lease.lease_id] = [lease, len(works)]
                for w in works:
                    yield PageJob(w, lease)

        link.send(("ready",))
        pipe = build_pipeline(opts, renderer=renderer, layout=layout, engine=engine,
                              sink=_LinkSink(link, index, held))
        for _ in pipe.run(jobs()):
            pass
        stop.set()
        link.send(("bye",))
    finally:
        renderer.close()
    # everything this process owns is sent or closed: skip the interpreter's slow teardown of
    # the models (the coordinator waits for the exit)
    logging.shutdown()
    os._exit(0)


# ------------------------------------------------------------------ the coordinator
class _Worker:
    def __init__(self, index: int, proc, conn):
        self.index, self.proc, self.conn = index, proc, conn
        self.name = f"worker-{index}"
        self.ready = False
        self.waiting = False          # asked for a lease and was not answered yet
        self.done = False             # said bye or its pipe closed


def run_workers(opts, inputs: list[str], owner=None, on_start=None) -> Iterator[PageOutcome]:
    """The coordinator: open the workspace, start the workers, hand out leases, commit what
    they send; yields a PageOutcome per settled page. ``owner`` (the DocumentParser) gets
    ``pages_total`` and ``workspace_status``."""
    from dataclasses import replace
    from .coordinator import lease_works, open_workspace
    from .leases import StaleLease
    ws, todo = open_workspace(opts, inputs)
    table = ws.leases
    gpu_busy: dict[str, float] = {}      # worker -> its device's last busy %
    if owner is not None:
        owner.pages_total = todo
        owner._gpu_read = lambda: sum(gpu_busy.values()) / len(gpu_busy) if gpu_busy else None
    if on_start is not None:
        on_start(todo)
    ctx = mp.get_context("spawn")
    workers: list[_Worker] = []
    inbox: queue.Queue = queue.Queue()   # (worker, message | None at its pipe's end), from the readers
    payload = replace(opts, workers=1, gpus=None)
    level = logging.getLogger().getEffectiveLevel()
    cap = max(1, -(-opts.max_pages_in_flight // opts.lease_pages))      # leases a worker may hold
    try:
        for i in range(opts.workers):
            parent, child = ctx.Pipe()
            device = opts.gpus[i] if opts.gpus else None
            # not daemonic: a worker has its own render processes (the finally below ends it)
            proc = ctx.Process(target=worker_main, args=(i, payload, child, device, level), name=f"fdx-parse-worker-{i}")
            proc.start()
            child.close()
            w = _Worker(i, proc, parent)
            workers.append(w)
            threading.Thread(target=_read_into, args=(w, inbox), name=f"fdx-parse-read-{i}", daemon=True).start()
            log.info("parse: worker %d started (pid %d%s)", i, proc.pid,
                     f", CUDA device {device}" if device is not None else "")
        started = time.monotonic()
        stopping_since = None          # every page settled: the workers are told to stop
        while True:
            live = [w for w in workers if not w.done]
            if not live:
                break
            if not todo and stopping_since is None:
                stopping_since = time.monotonic()
                log.info("parse: every page settled; stopping the workers")
            if stopping_since is not None:
                for w in live:
                    if w.waiting:
                        _send(w, ("stop",))
                        w.waiting = False
                grace = opts.lease_ttl_s - (time.monotonic() - stopping_since)
                if grace <= 0:             # a worker that does not answer (stopped, hung) is not waited for
                    for w in live:
                        log.warning("parse: %s (pid %d) did not stop in time: killed", w.name, w.proc.pid)
                        w.proc.kill()
                        w.done = True
                    break
            nxt = min((lease.expires_at for lease in table.active), default=None)
            timeout = None if nxt is None else max(nxt - table.clock(), 0.0)
            if stopping_since is not None:
                timeout = grace if timeout is None else min(timeout, grace)
            if not all(w.ready for w in live):
                left = WORKER_START_TIMEOUT_S - (time.monotonic() - started)
                if left <= 0:
                    raise RuntimeError("parse: a worker did not start in time (see its log lines above)")
                timeout = left if timeout is None else min(timeout, left)
            arrived = []
            try:
                arrived.append(inbox.get(timeout=timeout))
                while True:
                    arrived.append(inbox.get_nowait())
            except queue.Empty:
                pass
            for lease in table.expire():
                log.warning("parse: lease %d of %s expired (token %d, %d pages, attempt %d): its pages go to "
                            "another worker", lease.lease_id, lease.worker, lease.token, len(lease.keys), lease.attempt)
            for w, msg in arrived:
                if w.done:
                    continue
                if msg is None:
                    _lost(w)
                    continue
                kind = msg[0]
                if kind == "ready":
                    w.ready = True
                elif kind == "want":
                    w.waiting = True
                elif kind == "renew":
                    for lease in msg[1]:
                        try:
                            table.renew(lease)
                        except StaleLease as e:
                            log.warning("parse: %s: %s", w.name, e)
                elif kind in ("commit", "fail"):
                    outcome = _settle(ws, table, msg)
                    if outcome is not None:      # settled once (the fencing token): one page less
                        todo -= 1
                        yield outcome
                elif kind == "busy":
                    gpu_busy[w.name] = msg[1]
                elif kind == "bye":
                    w.done = True
            # hand out work to every worker waiting for it (pages of expired leases first), once
            # every worker is up (the first one ready would otherwise take everything), and at
            # most `cap` leases per worker at once (its pages in flight, no hoarding)
            if not all(w.ready or w.done for w in workers):
                continue
            held = {}
            for lease in table.active:
                held[lease.worker] = held.get(lease.worker, 0) + 1
            for w in workers:
                if w.waiting and not w.done and stopping_since is None and held.get(w.name, 0) < cap:
                    lease = ws.grant(w.name, opts.lease_pages, opts.lease_ttl_s, retry_failed=opts.retry_failed)
                    if lease is not None:
                        _send(w, ("lease", lease, lease_works(ws, lease)))
                        w.waiting = False
                        log.info("parse: lease %d (token %d, attempt %d, %d pages) -> %s", lease.lease_id,
                                 lease.token, lease.attempt, len(lease.keys), w.name)
        for w in workers:
            w.proc.join(timeout=30)
            if w.proc.is_alive():
                w.proc.kill()
    finally:
        for w in workers:
            if w.proc.is_alive():
                w.proc.kill()
                w.proc.join(timeout=10)
        if owner is not None:
            owner.workspace_status = ws.status()
        ws.close()


def _read_into(w: _Worker, inbox: queue.Queue) -> None:
    """One thread per worker does the blocking reads: a worker stopped (SIGSTOP, a debugger)
    half-way through a send leaves a partial message in its pipe, and a recv() on it would hang
    the coordinator and with it every other worker's commits and the lease expiries."""
    while True:
        try:
            msg = w.conn.recv()
        except (EOFError, OSError):
            inbox.put((w, None))
            return
        inbox.put((w, msg))


def _send(w: _Worker, msg) -> None:
    try:
        w.conn.send(msg)
    except (BrokenPipeError, OSError):
        w.done = True


def _lost(w: _Worker) -> None:
    """A worker's pipe closed without "bye": it died; its leases expire at their deadline and
    their pages go to the others then."""
    w.done = True
    w.proc.join(timeout=5)
    log.error("parse: %s (pid %s) died (exit code %s): its pages go to the others when its leases expire",
              w.name, w.proc.pid, w.proc.exitcode)


def _settle(ws, table, msg) -> PageOutcome | None:
    """Commit (or record the failure of) one page under its lease; None when the lease is stale."""
    from .errors import PageError
    from .leases import StaleLease
    kind, lease, work = msg[0], msg[1], msg[2]
    job = PageJob(work, lease)
    try:
        if kind == "commit":
            ws.commit(lease, work.key, msg[3])
            blocks = len(getattr(msg[3], "record", {}).get("parsing_res_list", []))
            return PageOutcome(job, result=msg[3], blocks=blocks, output_tokens=msg[4])
        ws.fail(lease, work.key, msg[3], msg[4])
        return PageOutcome(job, error=PageError(msg[3], msg[4]))
    except StaleLease as e:
        log.warning("parse: refused a stale commit of page %s from %s (token %d): %s", work.key, lease.worker,
                    lease.token, e)
        return None
