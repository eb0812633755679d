"""The asyncio face of the engine, for the OpenAI server (COORD contract).

The step loop runs in one background thread that owns the scheduler; asyncio callers talk to it
through thread-safe hand-offs only: a request is preprocessed in the engine's worker pool
(awaited by the caller, so a bad request raises InvalidRequest before anything is queued), then
queued; each step's outputs are delivered to per-request asyncio queues with
call_soon_threadsafe. A consumer that stops iterating aborts its request.
"""
from __future__ import annotations

import asyncio
import logging
import threading
from typing import AsyncIterator

from .config import EngineConfig
from .errors import EngineDead, InvalidRequest
from .llm_engine import EngineStats, LLMEngine
from .outputs import RequestOutput
from .sampling_params import SamplingParams

log = logging.getLogger(__name__)

PromptInput = dict   # {"prompt": str | None, "messages": [...] | None, "images": [...]}


class AsyncLLMEngine:
    def __init__(self, config: EngineConfig, runner=None, input_processor=None):
        self.config = config
        self._runner, self._input_processor = runner, input_processor
        self.engine: LLMEngine | None = None
        self.ready = False
        self.error: str | None = None
        self._thread: threading.Thread | None = None
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._accepting = False
        self._queues: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._qlock = threading.Lock()

    # ------------------------------------------------------------------ lifecycle
    async def start(self) -> None:
        """Load the model, size the KV pool, start the step loop (the slow parts in a thread)."""
        if self.engine is not None:
            return
        loop = asyncio.get_running_loop()
        self.engine = await loop.run_in_executor(
            None, lambda: LLMEngine(self.config, runner=self._runner, input_processor=self._input_processor))
        self._thread = threading.Thread(target=self._run_loop, name="fdx-step-loop", daemon=True)
        self._thread.start()
        self._accepting = True
        self.ready = True

    @property
    def healthy(self) -> bool:
        return self.error is None and (self._thread is None or self._thread.is_alive() or self._stop.is_set())

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
                for out in eng.step():
                    self._deliver(out.request_id, out)
        except BaseException as e:      # the loop died: every waiting request learns why
            self.error = f"step loop died: {type(e).__name__}: {e}"
            log.exception("engine step loop died")
            with self._qlock:
                rids = list(self._queues)
            for rid in rids:
                self._deliver(rid, EngineDead(self.error))

    def _deliver(self, request_id: str, item) -> None:
        with self._qlock:
            entry = self._queues.get(request_id)
        if entry is not None:
            loop, q = entry
            try:
                loop.call_soon_threadsafe(q.put_nowait, item)
            except RuntimeError:        # the caller's loop is closed: nobody listens any more
                pass

    # ------------------------------------------------------------------ requests
    def _check_alive(self) -> None:
        if self.error is not None:
            raise EngineDead(self.error)
        if self.engine is None or not self._accepting:
            raise EngineDead("the engine is not running (not started or shutting down)")

    async def generate(self, request_id: str, prompt: PromptInput,
                       params: SamplingParams | None = None) -> AsyncIterator[RequestOutput]:
        """Incremental outputs of one request (cumulative token_ids/text plus delta_text); the
        last has finish_reason set. InvalidRequest is raised before anything is queued."""
        self._check_alive()
        loop = asyncio.get_running_loop()
        with self._qlock:
            if request_id in self._queues:
                raise InvalidRequest(f"request id {request_id!r} is already running")
            q: asyncio.Queue = asyncio.Queue()
            self._queues[request_id] = (loop, q)
        finished = False
        try:
            eng = self.engine
            seq = await loop.run_in_executor(eng.pool, eng.process_request, request_id, prompt, params)
            self._check_alive()
            eng.add_sequence(seq, stream=True)
            self._wake.set()
            while True:
                item = await q.get()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
                if finished:
                    break
        finally:
            with self._qlock:
                self._queues.pop(request_id, None)
            if not finished and self.engine is not None:
                self.engine.abort_request(request_id)   # the client went away: free its blocks
                self._wake.set()

    async def abort(self, request_id: str) -> None:
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
                rids = list(self._queues)
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
