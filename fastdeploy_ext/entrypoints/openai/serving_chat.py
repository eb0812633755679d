"""One chat request through the engine: admission, media, sampling parameters, the engine call
under the request's deadline and its client's connection, and the answer (JSON or SSE).

Cancellation has one rule: whatever ends a request early (client disconnect, timeout, server
error), `_Run.close()` aborts it in the engine, which frees its KV blocks. It runs from a
`finally`, so no path can leak a running sequence."""
from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, AsyncIterator

from ...engine.errors import EngineDead, InvalidRequest, RequestFailed
from ...engine.sampling_params import NGramBlocker, RepetitionGuard, SamplingParams
from ...inputs.messages import MessageError, NormalizedMessages, normalize_messages
from . import protocol, request_log
from .errors import APIError, bad_request, server_stopping

log = logging.getLogger("fastdeploy_ext.server")


def sse(obj: Any) -> bytes:
    """One Server-Sent Event carrying a JSON object (or the literal [DONE])."""
    data = obj if isinstance(obj, str) else json.dumps(obj, ensure_ascii=False, separators=(",", ":"))
    return f"data: {data}\n\n".encode()


def openai_finish(finish_reason: str | None, stop_reason: Any) -> tuple[str | None, Any]:
    """Engine finish reasons -> OpenAI's. The repetition guard's own reason is reported as
    finish_reason "stop" (clients know only stop/length) with stop_reason "repetition"."""
    if finish_reason == "repetition":
        return "stop", "repetition"
    if finish_reason == "abort":
        return "abort", stop_reason
    return finish_reason, stop_reason


class LogprobFormatter:
    """Engine per-token logprob records -> OpenAI's ``logprobs.content`` entries."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    def _tok(self, token_id: int) -> dict:
        s = self.tokenizer.decode([token_id], skip_special_tokens=False) if self.tokenizer is not None else str(token_id)
        return {"token": s, "bytes": list(s.encode("utf-8"))}

    def entries(self, records: list[dict], top_n: int) -> list[dict]:
        out = []
        for r in records:
            e = self._tok(r["token_id"]) | {"logprob": float(r["logprob"])}
            top = r.get("top") or []
            if isinstance(top, dict):
                top = list(top.items())
            e["top_logprobs"] = [self._tok(int(t)) | {"logprob": float(lp)} for t, lp in top[:top_n]]
            out.append(e)
        return out


@dataclass
class ChatContext:
    """What a request needs from the server (one per app)."""
    engine: Any
    metrics: Any
    fetcher: Any
    served_names: tuple[str, ...]
    request_timeout: float
    max_concurrency: int
    repetition_guard: dict | None
    logprob_formatter: LogprobFormatter | None = None
    limits: Any = None               # engine.input_processor.InputLimits: checked before any fetch
    mm_kwargs_check: Any = None      # the engine's mm_processor_kwargs check (once it has started)
    inflight: int = 0
    idle: asyncio.Event = field(default_factory=asyncio.Event)   # set while inflight == 0
    background: set = field(default_factory=set)                  # abort tasks kept alive until done
    stopping: asyncio.Future | None = None   # resolved when the server stops now: streams end with a 503 event

    def __post_init__(self):
        self.idle.set()


def sampling_params(req: protocol.ChatCompletionRequest, guard: dict | None) -> SamplingParams:
    kw: dict[str, Any] = dict(max_tokens=req.output_limit, stop=req.stop, stop_token_ids=req.stop_token_ids,
                              ignore_eos=req.ignore_eos, seed=req.seed, n=req.n,
                              skip_special_tokens=req.skip_special_tokens,
                              include_stop_str_in_output=req.include_stop_str_in_output)
    for name in ("temperature", "top_p", "top_k", "repetition_penalty", "min_tokens"):
        v = getattr(req, name)
        if v is not None:
            kw[name] = v
    if req.logprobs:
        kw["logprobs"] = req.top_logprobs or 0
    override = req.repetition_guard.model_dump(exclude_none=True) if req.repetition_guard else {}
    if guard is not None or override:
        kw["repetition_guard"] = RepetitionGuard(**{**(guard or {}), **override})
    if req.ngram_blocker is not None:
        kw["ngram_blocker"] = NGramBlocker(**req.ngram_blocker.model_dump())
    return SamplingParams(**kw)


def normalized(req: protocol.ChatCompletionRequest) -> NormalizedMessages:
    """The request's messages through the one normalizer the engine uses too (inputs/messages.py);
    the image payloads are the URLs the parts carry (protocol.ImagePart checked their shape)."""
    return normalize_messages([m.model_dump(exclude_none=True) for m in req.messages])


def check_before_fetch(req: protocol.ChatCompletionRequest, ctx: ChatContext) -> None:
    """The engine's cheap input checks, here before any image URL is fetched: the number of
    images (--limit-mm-per-prompt), the text's byte length (--max-model-len) and
    mm_processor_kwargs, so that a request refused anyway costs no download."""
    try:
        if ctx.limits is not None:
            norm = normalized(req)
            ctx.limits.check_counts(len(norm.images), norm.texts)
        if ctx.mm_kwargs_check is not None and req.mm_processor_kwargs is not None:
            ctx.mm_kwargs_check(req.mm_processor_kwargs.model_dump(exclude_none=True))
    except (InvalidRequest, MessageError) as e:
        raise bad_request(str(e)) from None


async def resolve_messages(req: protocol.ChatCompletionRequest, fetcher) -> list[dict]:
    """OpenAI messages -> the engine's: each image part becomes ``{"type": "image", "image": X}``
    with X the fetched bytes (http(s), allowed local files) or the data URL itself."""
    norm = normalized(req)
    urls = iter(norm.images)
    messages, n = [], 0
    for m in norm.messages:
        parts = []
        for p in m["content"]:
            if p["type"] == "image":
                parts.append({"type": "image", "image": await fetcher.fetch(next(urls), f"image {n}")})
                n += 1
            else:
                parts.append(p)
        messages.append({"role": m["role"], "content": parts})
    return messages


async def unless_stopped(work: asyncio.Future, stopping: asyncio.Future):
    """``work``'s result (a request's `ChatHandler.create`), unless the server stops now first (or
    already has): then ``work`` is cancelled, its cleanup aborts the request in the engine
    wherever it was (fetching images, queued, generating), and the client gets 503."""
    try:
        await asyncio.wait({work, stopping}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        if not work.done():
            work.cancel()
            await asyncio.wait({work})
    if work.cancelled():
        raise server_stopping()
    return work.result()


class _Run:
    """One admitted request's engine stream, its deadline and its cleanup."""

    def __init__(self, ctx: ChatContext, rid: str, deadline: float):
        self.ctx, self.rid, self.deadline = ctx, rid, deadline
        self.stream: AsyncIterator | None = None
        self.done = False            # the engine finished the request (nothing to abort)
        self.closed = False

    def remaining(self) -> float:
        return self.deadline - time.monotonic()

    async def next(self, disconnected: asyncio.Future | None = None):
        """The next engine output, or APIError(504) at the deadline / None on disconnect."""
        step = asyncio.ensure_future(self.stream.__anext__())
        waits = {step} if disconnected is None else {step, disconnected}
        done, _ = await asyncio.wait(waits, timeout=max(self.remaining(), 0), return_when=asyncio.FIRST_COMPLETED)
        if step in done:
            out = step.result()      # StopAsyncIteration / InvalidRequest / EngineDead propagate
            if out.finish_reason is not None:
                self.done = True
            return out
        step.cancel()
        if disconnected is not None and disconnected in done:
            return None
        raise APIError(504, f"request timed out after {self.ctx.request_timeout:g} s (--request-timeout); "
                            f"it was aborted", code="request_timeout")

    def close(self) -> None:
        """Idempotent; never awaits (it runs in finally blocks, possibly under cancellation)."""
        if self.closed:
            return
        self.closed = True
        self.ctx.inflight -= 1
        self.ctx.metrics.inflight.set(self.ctx.inflight)
        if self.ctx.inflight == 0:
            self.ctx.idle.set()
        if self.stream is not None and not self.done:
            task = asyncio.get_running_loop().create_task(self._abort())
            self.ctx.background.add(task)
            task.add_done_callback(self.ctx.background.discard)

    async def _abort(self) -> None:
        try:
            await self.ctx.engine.abort(self.rid)
            log.info("request %s aborted", self.rid)
        except Exception:  # noqa: BLE001 - an abort failure must not kill the server; say so
            log.exception("aborting request %s failed", self.rid)
        if self.stream is not None:
            try:
                await self.stream.aclose()
            except Exception:  # noqa: BLE001
                pass


class ChatHandler:
    def __init__(self, ctx: ChatContext):
        self.ctx = ctx

    @property
    def model_name(self) -> str:
        return self.ctx.served_names[0]

    def _admit(self, rid: str) -> _Run:
        ctx = self.ctx
        if ctx.inflight >= ctx.max_concurrency:
            raise APIError(429, f"the server has {ctx.inflight} requests in flight (--max-concurrency "
                                f"{ctx.max_concurrency}); retry later", code="queue_full")
        ctx.inflight += 1
        ctx.idle.clear()
        ctx.metrics.inflight.set(ctx.inflight)
        return _Run(ctx, rid, time.monotonic() + ctx.request_timeout)

    async def create(self, body: Any, disconnected: asyncio.Future):
        """Returns a JSON-able dict, or an async iterator of SSE bytes (stream=True).
        Raises APIError for every refusal."""
        t0 = time.monotonic()
        req = protocol.parse_chat_request(body)
        if req.model is not None and req.model not in self.ctx.served_names:
            raise protocol.not_found_model(req.model, list(self.ctx.served_names))
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        run = self._admit(rid)
        try:
            try:
                params = sampling_params(req, self.ctx.repetition_guard)
                params.validate()
            except (InvalidRequest, TypeError) as e:
                raise bad_request(str(e)) from None
            check_before_fetch(req, self.ctx)
            messages = await asyncio.wait_for(resolve_messages(req, self.ctx.fetcher),
                                              timeout=max(run.remaining(), 0))
            prompt: dict[str, Any] = {"messages": messages}
            if req.mm_processor_kwargs is not None:
                prompt["mm_processor_kwargs"] = req.mm_processor_kwargs.model_dump(exclude_none=True)
            self.ctx.metrics.requests_number.labels(self.model_name).inc()
            if params.max_tokens is not None:
                self.ctx.metrics.max_tokens_param.labels(self.model_name).observe(params.max_tokens)
            run.stream = self.ctx.engine.generate(rid, prompt, params, priority=req.priority).__aiter__()
            first = await self._first(run, disconnected)
            if first is None:
                raise _Disconnected()
        except asyncio.TimeoutError:
            run.close()
            raise APIError(504, f"request timed out after {self.ctx.request_timeout:g} s (--request-timeout) "
                                f"while fetching its images", code="request_timeout") from None
        except BaseException:
            run.close()
            raise
        if req.stream:
            return self._stream(req, run, first, t0, disconnected)
        try:
            return await self._complete(req, run, first, t0, disconnected)
        finally:
            run.close()

    async def _first(self, run: _Run, disconnected):
        try:
            return await run.next(disconnected)
        except InvalidRequest as e:
            run.done = True           # refused before queueing: nothing to abort
            raise bad_request(str(e)) from None
        except StopAsyncIteration:
            run.done = True
            raise APIError(500, "the engine ended the request without an output") from None

    def _observe(self, out, t0: float, clock: "_TokenClock") -> None:
        m, name = self.ctx.metrics, self.model_name
        n_prompt, n_out = len(out.prompt_token_ids), len(out.token_ids)
        m.e2e.labels(name).observe(time.monotonic() - t0)
        if clock.first is not None:
            m.ttft.labels(name).observe(clock.first - t0)
        for g in clock.gaps:
            m.tpot.labels(name).observe(g)
        m.prompt_tokens.labels(name).inc(n_prompt)
        m.generation_tokens.labels(name).inc(n_out)
        m.request_prompt_tokens.labels(name).observe(n_prompt)
        m.request_generation_tokens.labels(name).observe(n_out)
        pm = getattr(out, "metrics", None)
        if pm is not None:
            m.preprocess.observe(pm.preprocess_s)
            if pm.vision_s:
                m.vision.observe(pm.vision_s)
        m.request_success.labels(name).inc()
        m.outcome("ok")
        request_log.log_access(out.request_id, 200, n_prompt, n_out, None if clock.first is None else clock.first - t0,
                               time.monotonic() - t0, out.finish_reason)

    def _logprobs(self, req, records) -> dict | None:
        if not req.logprobs:
            return None
        return {"content": self.ctx.logprob_formatter.entries(records or [], req.top_logprobs or 0)}

    async def _complete(self, req, run: _Run, out, t0: float, disconnected) -> dict:
        clock = _TokenClock()
        clock.observe(out.num_output_tokens)
        while out.finish_reason is None:
            out = await run.next(disconnected)
            if out is None:
                raise _Disconnected()
            clock.observe(out.num_output_tokens)
        finish, stop_reason = openai_finish(out.finish_reason, out.stop_reason)
        self._observe(out, t0, clock)
        return protocol.chat_completion(run.rid, req.model or self.model_name, int(time.time()), out.text, finish,
                                        stop_reason, self._logprobs(req, out.logprobs),
                                        protocol.usage(len(out.prompt_token_ids), len(out.token_ids)))

    async def _stream(self, req, run: _Run, first, t0: float, disconnected) -> AsyncIterator[bytes]:
        model, created = req.model or self.model_name, int(time.time())
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        chunk = lambda delta, **kw: protocol.chat_chunk(run.rid, model, created, delta,  # noqa: E731
                                                        with_usage_field=include_usage, **kw)
        status = "cancelled"
        try:
            yield sse(chunk({"role": "assistant", "content": ""}))
            out, clock = first, _TokenClock()
            while True:
                new_ids = clock.observe(out.num_output_tokens)
                finish, stop_reason = openai_finish(out.finish_reason, out.stop_reason)
                if out.delta_text or new_ids > 0 or finish is not None:
                    lp = self._logprobs(req, out.delta_logprobs) if new_ids > 0 else None
                    delta = {"content": out.delta_text} if (out.delta_text or finish is None) else {}
                    yield sse(chunk(delta, finish_reason=finish, stop_reason=stop_reason, logprobs=lp))
                if finish is not None:
                    break
                try:
                    out = await run.next(self.ctx.stopping)    # disconnect is the response's job (it cancels us)
                except APIError as e:
                    status = "timeout"
                    yield sse(e.body())
                    yield sse("[DONE]")
                    return
                if out is None:                 # the server stops now; close() aborts the request
                    status = "unavailable"
                    yield sse(server_stopping().body())
                    yield sse("[DONE]")
                    return
            self._observe(out, t0, clock)
            status = "ok"
            if include_usage:
                yield sse(chunk(None, use=protocol.usage(len(out.prompt_token_ids), len(out.token_ids))))
            yield sse("[DONE]")
        except EngineDead as e:
            status = "error"
            yield sse(APIError(500, f"the engine stopped: {e}").body())
        except RequestFailed as e:          # this request alone failed; the others stream on
            status = "error"
            yield sse(APIError(500, str(e), code="request_failed").body())
        finally:
            if status != "ok":
                self.ctx.metrics.outcome(status)
                request_log.log_access(run.rid, {"timeout": 504, "error": 500}.get(status, 499),
                                       e2e_s=time.monotonic() - t0, finish=status)
            run.close()


class _TokenClock:
    """Time to first token and inter-token gaps, from the running token counts of a request's
    outputs as they arrive (a step that brings k tokens counts k gaps of 1/k of its wait)."""

    def __init__(self):
        self.first: float | None = None
        self.prev: float | None = None
        self.count = 0
        self.gaps: list[float] = []

    def observe(self, n_tokens: int) -> int:
        """Record the output seen now; returns how many tokens it added."""
        new = n_tokens - self.count
        if new > 0:
            now = time.monotonic()
            if self.first is None:
                self.first = now
            else:
                self.gaps.extend([(now - self.prev) / new] * new)
            self.prev, self.count = now, n_tokens
        return new


class _Disconnected(Exception):
    """The client went away before its answer was ready."""
