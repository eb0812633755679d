"""The asyncio face of the engine, for the OpenAI server (COORD contract).

The step loop runs in one background thread that owns the scheduler; asyncio callers talk to it
through thread-safe hand-offs only: a request is preprocessed in the engine's worker pool
(awaited by the caller, so a bad request raises InvalidRequest before anything is queued), then
queued; each step's outputs are delivered to per-request channels with call_soon_threadsafe.
A consumer that stops iterating aborts its request.

``submit`` is the loop-free face for callers that want only each request's final output (the
parsing jobs' block requests): no coroutine and no event-loop hand-off per request; its callback
runs on the step loop's thread. With hundreds of blocks in flight the per-request asyncio
machinery held the GIL longer than the step loop's own host work.

Outputs are deltas (outputs.py). A request's channel holds at most one unread output: a new
one is folded into the unread one (deltas appended), so a consumer that stops reading costs
O(its sequence) memory whatever the number of steps, and reads everything it missed at once
when it comes back; the request itself runs on to its end (max_tokens bounds it).

Failures: a request that fails alone in the engine (finish_reason "error") raises RequestFailed
to its consumer, the other requests run on. A fault in what the batch shares kills the step
loop: ``error`` is set, ``healthy`` is False at once and every consumer gets EngineDead.

``status``: starting, ready, stuck (a step has run longer than ``--step-timeout`` seconds, the
first step not counted: it compiles and warms up), dead, stopped. ``healthy`` is False when
stuck or dead (the server's watchdog then exits for a restart).
"""
from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import deque
from typing import AsyncIterator, Callable

from .config import EngineConfig
from .errors import EngineDead, InvalidRequest, RequestFailed
from .llm_engine import EngineStats, LLMEngine
from .outputs import RequestOutput
from .sampling_params import SamplingParams

log = logging.getLogger(__name__)

PromptInput = dict   # {"prompt": str | None, "messages": [...] | None, "images": [...]}


class OutputChannel:
    """One request's outputs, on its consumer's event loop (push runs there, through
    call_soon_threadsafe). Holds at most one unread RequestOutput (later ones are folded into
    it) and then at most one terminal exception."""

    def __init__(self):
        self._items: deque = deque()
        self._ready = asyncio.Event()

    def __len__(self) -> int:
        return len(self._items)

    def push(self, item) -> None:
        tail = self._items[-1] if self._items else None
        if isinstance(item, RequestOutput) and isinstance(tail, RequestOutput) and not tail.finished:
            tail.absorb(item)
        else:
            self._items.append(item)
        self._ready.set()

    async def get(self):
        while not self._items:
            self._ready.clear()
            await self._ready.wait()
        item = self._items.popleft()
        return item.settle() if isinstance(item, RequestOutput) else item


class AsyncLLMEngine:
    def __init__(self, config: EngineConfig, runner=None, input_processor=None):
        self.config = config
        self._runner, self._input_processor = runner, input_processor
        # called in start(), before the KV pool is sized from free memory: a Decision(bytes,
        # reason) that something else in this process (the job API's layout model) will still
        # allocate, so the pool leaves it free (LLMEngine's reserved_memory); None: nothing
        self.reserve_memory: Callable[[], object] | None = None
        self.engine: LLMEngine | None = None
        self.ready = False
        self.error: str | None = None
        self._thread: threading.Thread | None = None
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._accepting = False
        self._queues: dict[str, tuple[asyncio.AbstractEventLoop, OutputChannel]] = {}
        self._callbacks: dict[str, Callable] = {}  # submit()'s requests: on_done(output, error)
        self._qlock = threading.Lock()
        self._preprocessing: set[str] = set()    # in the worker pool, not yet queued in the engine
        self._aborted_early: set[str] = set()    # aborted while preprocessing
        self._step_started: float | None = None  # monotonic start of the step running now
        self._stuck: str | None = None           # latched: why the loop is stuck

    # ------------------------------------------------------------------ lifecycle
    async def start(self) -> None:
        """Load the model, size the KV pool, start the step loop (the slow parts in a thread)."""
        if self.engine is not None:
            return
        loop = asyncio.get_running_loop()
        reserve = self.reserve_memory
        self.engine = await loop.run_in_executor(
            None, lambda: LLMEngine(self.config, runner=self._runner, input_processor=self._input_processor,
                                    reserved_memory=reserve() if reserve is not None else None))
        self._thread = threading.Thread(target=self._run_loop, name="fdx-step-loop", daemon=True)
        self._thread.start()
        self._accepting = True
        self.ready = True

    @property
    def status(self) -> str:
        """starting, ready, stuck, dead or stopped (see the module docstring)."""
        if self.error is not None or (self._thread is not None and not self._thread.is_alive()
                                      and not self._stop.is_set()):
            return "dead"
        if self._stop.is_set():
            return "stopped"
        if self.engine is None or not self.ready:
            return "starting"
        if self._check_stuck():
            return "stuck"
        return "ready"

    @property
    def reason(self) -> str | None:
        """Why the engine is dead or stuck (None otherwise)."""
        return self.error or self._stuck

    @property
    def healthy(self) -> bool:
        return self.status not in ("dead", "stuck")

    def _check_stuck(self) -> bool:
        if self._stuck is None:
            t0, limit = self._step_started, self.config.step_timeout
            # the first step that runs the model compiles and warms up: not timed
            done = self.engine.num_steps if self.engine is not None else 0
            if t0 is not None and done >= 1 and time.monotonic() - t0 > limit:
                self._stuck = (f"engine stuck: a step has run for more than --step-timeout {limit:g} s "
                               f"(after {done} steps)")
                log.error("%s", self._stuck)
        return self._stuck is not None

    @property
    def tokenizer(self):
        return self.engine.input_processor.builder.tokenizer if self.engine else None

    def _run_loop(self) -> None:
        eng = self.engine
        try:
            while not self._stop.is_set():
                if not eng.has_unfinished():
                    self._wake.wait(0.05)
                    self._wake.clear()
                    continue
                self._step_started = time.monotonic()
                outs = eng.step()
                self._step_started = None
                for out in outs:
                    self._deliver(out.request_id, out)
        except BaseException as e:      # the loop died: every waiting request learns why
            self.error = f"step loop died: {type(e).__name__}: {e}"
            log.exception("engine step loop died")
            with self._qlock:
                rids = list(self._queues) + list(self._callbacks)
            for rid in rids:
                self._deliver(rid, EngineDead(self.error))

    def _deliver(self, request_id: str, item) -> None:
        with self._qlock:
            entry = self._queues.get(request_id)
            done = isinstance(item, BaseException) or item.finished
            cb = self._callbacks.pop(request_id, None) if entry is None and done else None
        if cb is not None:
            self._call_back(request_id, cb, item)
        elif entry is not None:
            loop, q = entry
            try:
                loop.call_soon_threadsafe(q.push, item)
            except RuntimeError:        # the caller's loop is closed: nobody listens any more
                pass

    @staticmethod
    def _call_back(request_id: str, cb: Callable, item) -> None:
        """``cb(output, None)`` for a request that ended well, ``cb(None or output, why)`` else;
        a callback that raises is logged and never stops the step loop."""
        if isinstance(item, BaseException):
            args = (None, f"{type(item).__name__}: {item}")
        elif item.finish_reason in ("error", "abort"):
            args = (item, item.error or item.finish_reason)
        else:
            args = (item, None)
        try:
            cb(*args)
        except Exception:  # noqa: BLE001 - the caller's bug must not kill every other request
            log.exception("the done-callback of request %s raised", request_id)

    # ------------------------------------------------------------------ requests
    def submit(self, request_id: str, prompt: PromptInput, params: SamplingParams | None, priority: int,
               on_done: Callable) -> None:
        """Thread-safe, no event loop: preprocess in the engine's pool and queue without
        streaming; ``on_done`` is called once, with the final output (the step loop's thread)
        or with why the request was refused or failed. EngineDead / InvalidRequest (a duplicate
        id) are raised here, before anything is queued."""
        self._check_alive()
        with self._qlock:
            if request_id in self._queues or request_id in self._callbacks:
                raise InvalidRequest(f"request id {request_id!r} is already running")
            self._callbacks[request_id] = on_done
        fut = self.engine.submit(request_id, prompt, params, stream=False, priority=priority)
        fut.add_done_callback(lambda f: self._submitted(request_id, f))

    def _submitted(self, request_id: str, fut) -> None:
        err = None if fut.cancelled() else fut.exception()
        if fut.cancelled() or err is not None:            # refused by preprocessing: never queued
            with self._qlock:
                cb = self._callbacks.pop(request_id, None)
            if cb is not None:
                self._call_back(request_id, cb, err if err is not None else InvalidRequest("cancelled"))
        self._wake.set()

    def _check_alive(self) -> None:
        if self.error is not None:
            raise EngineDead(self.error)
        if self.engine is None or not self._accepting:
            raise EngineDead("the engine is not running (not started or shutting down)")

    async def generate(self, request_id: str, prompt: PromptInput, params: SamplingParams | None = None,
                       priority: int = 0, stream: bool = True) -> AsyncIterator[RequestOutput]:
        """Outputs of one request as deltas (outputs.py); the last has finish_reason set and the
        whole generation. ``stream=False``: only that last one (no per-token delivery, no
        incremental detokenization: what a caller that reads only the final text wants, since
        with hundreds of requests running the per-token hand-offs cost the step loop more than
        the step). ``priority``: lower is scheduled earlier, FIFO among equals
        (scheduler.py). InvalidRequest is raised before anything is queued (a bad priority
        included); RequestFailed if the request fails in the engine; EngineDead if the step loop
        dies."""
        self._check_alive()
        loop = asyncio.get_running_loop()
        with self._qlock:
            if request_id in self._queues:
                raise InvalidRequest(f"request id {request_id!r} is already running")
            q = OutputChannel()
            self._queues[request_id] = (loop, q)
            self._preprocessing.add(request_id)
        finished = False
        try:
            eng = self.engine
            try:
                seq = await loop.run_in_executor(eng.pool, eng.process_request, request_id, prompt, params,
                                                 None, priority)
            finally:
                with self._qlock:
                    self._preprocessing.discard(request_id)
                    aborted = request_id in self._aborted_early
                    self._aborted_early.discard(request_id)
            self._check_alive()
            eng.add_sequence(seq, stream=stream)
            if aborted:                  # aborted while preprocessing: it ends with "abort" at once
                eng.abort_request(request_id)
            self._wake.set()
            while True:
                item = await q.get()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                if item.finish_reason == "error":
                    raise RequestFailed(request_id, item.error or "unknown error")
                yield item
                if finished:
                    break
        finally:
            with self._qlock:
                self._queues.pop(request_id, None)
            if not finished and self.engine is not None:
                self.engine.abort_request(request_id)   # the client went away: free its blocks
                self._wake.set()

    def backlog(self, request_id: str) -> int:
        """Outputs of a request delivered and not read yet (at most 1 output + 1 error)."""
        with self._qlock:
            entry = self._queues.get(request_id)
        return len(entry[1]) if entry is not None else 0

    async def abort(self, request_id: str) -> None:
        self.abort_nowait(request_id)

    def abort_nowait(self, request_id: str) -> None:
        """``abort`` from any thread (the engine's abort is thread-safe)."""
        with self._qlock:
            if request_id in self._preprocessing:
                self._aborted_early.add(request_id)
        if self.engine is not None:
            self.engine.abort_request(request_id)
            self._wake.set()

    def stats(self) -> EngineStats:
        if self.engine is None:
            raise EngineDead("the engine is not started")
        return self.engine.stats()

    async def shutdown(self, drain: bool = True) -> None:
        """Stop accepting requests; drain=True lets running and queued requests finish, False
        aborts them (their streams end with finish_reason "abort")."""
        self._accepting = False
        eng = self.engine
        if eng is None:
            return
        if not drain:
            with self._qlock:
                rids = list(self._queues) + list(self._callbacks)
            for rid in rids:
                eng.abort_request(rid)
            self._wake.set()
        while self._thread is not None and self._thread.is_alive() and eng.has_unfinished() and self.error is None:
            await asyncio.sleep(0.01)
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            await asyncio.get_running_loop().run_in_executor(None, self._thread.join, 5.0)
        eng.shutdown()
        self.ready = False
