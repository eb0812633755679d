"""`fastdeploy-ext serve` == `python -m fastdeploy_ext.entrypoints.openai.api_server`.

Start-up: parse flags (FastDeploy's names, ours, ``--config FILE.yaml``), log the resolved
configuration, listen at once (``/health`` says 503 until the engine can run a step), start the
engine in the background, watch it (if the step loop dies, ``/health`` turns 503 and the
process exits 1 rather than hanging).
SIGTERM drains: new API requests get 503, running and queued ones finish, then exit 0. A
second SIGTERM, or SIGINT, stops at once: every request still in flight is aborted in the engine
and answered 503 (a stream gets an error event, then ``[DONE]``), and the process exits with
status 128 + the signal number (143 for SIGTERM, 130 for SIGINT), as a shell reports a process
killed by that signal; the answers are sent first."""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import hmac
import logging
import signal
import sys
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import anyio
import uvicorn
from fastapi import FastAPI, Request
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import JSONResponse, Response, StreamingResponse

from ... import envs
from ...engine.errors import EngineDead, RequestFailed
from .. import args as shared_args
from ..args import CliError
from . import cli_args, inflight, protocol, request_log
from .errors import APIError
from .http_timeouts import timed_h11_protocol
from .media import MediaFetcher, MediaPolicy
from .metrics import ServerMetrics
from .serving_chat import ChatContext, ChatHandler, LogprobFormatter, _Disconnected, unless_stopped

log = logging.getLogger("fastdeploy_ext.server")

PROMETHEUS_TYPE = "text/plain; version=0.0.4; charset=utf-8"
# outcome label per refusal status, for fastdeploy_ext:requests_total
_STATUS_LABEL = {400: "bad_request", 401: "unauthorized", 404: "not_found", 413: "too_large", 429: "queue_full",
                 503: "unavailable", 504: "timeout"}


@dataclass
class ServerState:
    config: cli_args.ServerConfig
    engine: Any
    metrics: ServerMetrics
    chat: ChatHandler
    max_model_len: int | None
    model_root: str
    draining: bool = False
    engine_started: bool = False
    engine_failed: str | None = None       # why the engine cannot serve (start failure or dead loop)
    exit_code: int = 0
    server: uvicorn.Server | None = None
    tasks: list = field(default_factory=list)
    inflight_bytes: inflight.ByteBudget = field(default_factory=lambda: inflight.ByteBudget(1 << 62))
    jobs: Any = None                       # serving_jobs.JobRoutes with --jobs-dir, else None

    def stats(self):
        return self.engine.stats() if self.engine_started else None

    def request_exit(self, code: int) -> None:
        self.exit_code = max(self.exit_code, code)
        if self.server is not None:
            self.server.should_exit = True


# ------------------------------------------------------------------ ASGI gate
class Gate:
    """Before any /v1 route runs: 503 while draining, 401 without the API key, 413 for a body
    over the limit (Content-Length first; otherwise counted while reading, the body is then
    replayed to the app), 429 when the body's bytes would take the bytes held for all requests
    past --max-inflight-body-bytes. Pure ASGI so an oversized body is never buffered past the
    limit. The request's bytes (its body, and the images fetched for it, through
    `inflight.current_ledger`) stay counted until its answer is complete."""

    def __init__(self, app, state: ServerState):
        self.app, self.state = app, state

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or not scope["path"].startswith("/v1/"):
            return await self.app(scope, receive, send)
        st, cfg = self.state, self.state.config
        if st.draining:
            return await self._refuse(scope, receive, send, APIError(
                503, "the server is shutting down (draining); retry on another replica", code="draining"))
        if cfg.api_key is not None:
            auth = dict(scope["headers"]).get(b"authorization", b"").decode("latin-1")
            token = auth[7:] if auth[:7].lower() == "bearer " else ""
            if not hmac.compare_digest(token.encode(), cfg.api_key.encode()):
                return await self._refuse(scope, receive, send, APIError(
                    401, "missing or wrong API key (send `Authorization: Bearer <key>`)", code="invalid_api_key"))
        if scope["method"] != "POST":
            return await self.app(scope, receive, send)
        limit = cfg.max_body_bytes
        too_large = APIError(413, f"request body is larger than {limit} bytes (--max-request-body-bytes)",
                             code="request_too_large")
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            return await self._refuse(scope, receive, send, too_large)
        ledger = inflight.Ledger(st.inflight_bytes)
        ledger_token = inflight.current_ledger.set(ledger)
        try:
            try:
                if declared is not None and declared.isdigit():
                    ledger.take(int(declared))   # reserved up front: refused before a byte is read
                body = bytearray()
                while True:
                    msg = await receive()
                    if msg["type"] == "http.disconnect":
                        return
                    body += msg.get("body", b"")
                    if len(body) > limit:
                        return await self._refuse(scope, receive, send, too_large)
                    if len(body) > ledger.held:
                        ledger.take(len(body) - ledger.held)
                    if not msg.get("more_body", False):
                        break
            except APIError as e:                # the byte budget is spent: 429
                return await self._refuse(scope, receive, send, e)
            replayed = False

            async def replay():
                nonlocal replayed
                if not replayed:
                    replayed = True
                    return {"type": "http.request", "body": bytes(body), "more_body": False}
                return await receive()
            return await self.app(scope, replay, send)
        finally:
            inflight.current_ledger.reset(ledger_token)
            ledger.release()

    async def _refuse(self, scope, receive, send, err: APIError):
        self.state.metrics.outcome(_STATUS_LABEL.get(err.status, "error"))
        if scope["path"] == "/v1/chat/completions":
            request_log.log_access(None, err.status, finish=err.code)
        # the body may be unread: close the connection rather than parse its rest as a request
        await err.response(headers={"Connection": "close"})(scope, receive, send)


class DisconnectAwareSSE(StreamingResponse):
    """Streams while listening for the client's disconnect whatever the ASGI spec version, and
    always closes the body iterator (whose `finally` aborts the engine request)."""

    async def __call__(self, scope, receive, send):
        try:
            async with anyio.create_task_group() as tg:
                async def stream():
                    try:
                        await self.stream_response(send)
                    except OSError:        # the client went away mid-send
                        pass
                    tg.cancel_scope.cancel()
                tg.start_soon(stream)
                await self.listen_for_disconnect(receive)
                tg.cancel_scope.cancel()
        finally:
            with anyio.CancelScope(shield=True):
                await self.body_iterator.aclose()


async def _wait_disconnect(receive) -> None:
    while True:
        msg = await receive()
        if msg["type"] == "http.disconnect":
            return


def _stopping(state: ServerState) -> asyncio.Future:
    """The server's one stop-now future (made in the serving loop on first use): the chat route
    (serving_chat.unless_stopped) and every stream wait on it alongside their own work, so
    stopping costs no task per chunk."""
    ctx = state.chat.ctx
    if ctx.stopping is None:
        ctx.stopping = asyncio.get_running_loop().create_future()
    return ctx.stopping


def _loggable(text: str, limit: int = 300) -> str:
    """One log line's worth of a client-supplied message (no lone surrogates: the log stream
    could not encode them)."""
    text = text if len(text) <= limit else text[:limit] + "..."
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


# ------------------------------------------------------------------ app
def build_app(state: ServerState) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app):
        state.tasks.append(asyncio.create_task(_start_engine(state)))
        if state.jobs is not None:
            from .serving_jobs import expiry_loop
            state.jobs.service.start(asyncio.get_running_loop())
            state.tasks.append(asyncio.create_task(expiry_loop(state.jobs.service,
                                                               min(60.0, state.jobs.service.config.ttl_s / 4))))
        yield
        for t in state.tasks:
            t.cancel()
        if state.jobs is not None:
            await asyncio.to_thread(state.jobs.service.close)
        await state.chat.ctx.fetcher.aclose()
        if state.engine_started:
            try:
                await state.engine.shutdown(drain=False)
            except Exception:  # noqa: BLE001 - shutting down anyway; say what failed
                log.exception("engine shutdown failed")

    app = FastAPI(title="fastdeploy_ext OpenAI-compatible server", lifespan=lifespan, docs_url=None,
                  redoc_url=None, openapi_url=None)

    @app.exception_handler(APIError)
    async def _api_error(request: Request, err: APIError):
        # a refusal is the client's problem (or a 503/504 the client must retry): one line, no traceback
        state.metrics.outcome(_STATUS_LABEL.get(err.status, "error"))
        if request.url.path == "/v1/chat/completions":
            request_log.log_access(None, err.status, finish=err.code or "error")
        log.warning("%s %s -> %d %s: %s", request.method, request.url.path, err.status, err.code or "",
                    _loggable(err.message))
        return err.response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):
        return APIError(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}").response()

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception):
        log.exception("unexpected error in %s %s", request.method, request.url.path)
        state.metrics.outcome("error")
        return APIError(500, f"internal error ({type(exc).__name__}: {exc})", code="internal_error").response()

    @app.get("/health")
    async def health():
        if state.engine_started and not state.engine.healthy:
            # at once, not at the watchdog's next poll: "stuck" (a step past --step-timeout) or "dead"
            status = getattr(state.engine, "status", "dead")
            reason = state.engine_failed or getattr(state.engine, "reason", None)
            return JSONResponse({"status": status, "reason": reason}, status_code=503)
        if state.engine_failed:
            return JSONResponse({"status": "dead", "reason": state.engine_failed}, status_code=503)
        if state.draining:
            return JSONResponse({"status": "draining"}, status_code=503)
        if not (state.engine_started and state.engine.ready):
            return JSONResponse({"status": "loading"}, status_code=503)
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def metrics():
        return Response(state.metrics.render(), media_type=PROMETHEUS_TYPE)

    @app.get("/v1/models")
    async def models():
        return protocol.model_list(list(state.config.served_model_names), state.model_root, state.max_model_len)

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        if state.engine_failed:
            raise APIError(503, f"the engine is not running: {state.engine_failed}", code="engine_dead")
        if not (state.engine_started and state.engine.ready):
            raise APIError(503, "the engine is still starting; poll /health", code="loading")
        body = protocol.parse_json_body(await request.body())     # 400 for any hostile body
        disconnected = asyncio.ensure_future(_wait_disconnect(request.receive))
        try:   # 503 if the server stops now, before or while the request runs
            result = await unless_stopped(asyncio.ensure_future(state.chat.create(body, disconnected)),
                                          _stopping(state))
        except _Disconnected:
            state.metrics.outcome("cancelled")
            request_log.log_access(None, 499, finish="cancelled")
            return Response(status_code=499)     # nobody reads it; the request is aborted
        except EngineDead as e:                  # the watchdog is about to exit the process
            raise APIError(503, f"the engine stopped: {e}", code="engine_dead") from None
        except RequestFailed as e:               # this request alone failed; the engine serves on
            raise APIError(500, str(e), code="request_failed") from None
        finally:
            disconnected.cancel()
        if isinstance(result, dict):
            return JSONResponse(result)
        return DisconnectAwareSSE(result, media_type="text/event-stream",
                                  headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    if state.jobs is not None:
        state.jobs.mount(app)
    from .ui import mount as mount_ui      # /ui: the page over the job API (it says when the API is off)
    mount_ui(app)
    return Gate(app, state)


# ------------------------------------------------------------------ lifecycle
async def _start_engine(state: ServerState) -> None:
    try:
        await state.engine.start()
    except Exception as e:  # noqa: BLE001 - any start failure: say why, exit non-zero
        log.exception("engine start failed")
        state.engine_failed = f"start failed: {type(e).__name__}: {e}"
        state.request_exit(1)
        return
    state.engine_started = True
    state.tasks.append(asyncio.create_task(request_log.stats_loop(
        state.stats, state.config.log_stats_interval, request_log.utilization_reader(state.engine))))
    state.chat.ctx.logprob_formatter = LogprobFormatter(getattr(state.engine, "tokenizer", None))
    processor = getattr(getattr(state.engine, "engine", None), "input_processor", None)
    if processor is not None:
        state.chat.ctx.limits = processor.limits
        state.chat.ctx.mm_kwargs_check = processor.request_preprocessor_config
    log.info("engine ready: serving %s on http://%s:%d", ", ".join(state.config.served_model_names),
             state.config.host, state.config.port)
    await _watchdog(state)


async def _watchdog(state: ServerState, period: float = 0.25) -> None:
    """If the step loop dies, /health turns 503 and the process exits 1 (never hangs half-alive)."""
    while True:
        await asyncio.sleep(period)
        if not state.engine.healthy:
            # dead (the step loop died) or stuck (a step ran past --step-timeout)
            stuck = getattr(state.engine, "status", "dead") == "stuck"
            state.engine_failed = state.engine.reason if stuck else f"engine loop died: {state.engine.error}"
            log.error("%s; exiting with status 1", state.engine_failed)
            await asyncio.sleep(2 * period)      # let a health probe see the 503
            state.request_exit(1)
            return


async def _drain(state: ServerState) -> None:
    ctx = state.chat.ctx
    log.info("SIGTERM: draining %d request(s) in flight; new requests get 503", ctx.inflight)
    if state.jobs is not None:       # the job in flight stops; its pages left resume on the next start
        state.jobs.draining = True
        state.jobs.service.stop()
    await ctx.idle.wait()
    if _stopping(state).done():
        return                                  # a second signal took over (_stop_now)
    if state.engine_started:
        await state.engine.shutdown(drain=True)
        state.engine_started = False
    log.info("drained; exiting")
    state.request_exit(0)


async def _stop_now(state: ServerState, sig: int, grace_s: float = 2.0) -> None:
    """Abort every request in flight with 503 (streams: ChatHandler._stream; the rest: the chat
    route's `unless_stopped`), give the answers up to ``grace_s`` to go out, exit 128 + sig."""
    code = 128 + sig
    ctx = state.chat.ctx
    log.warning("%s%s: aborting %d request(s) in flight with 503; exiting with status %d",
                signal.Signals(sig).name, " while draining" if state.draining else "", ctx.inflight, code)
    state.draining = True
    stopping = _stopping(state)
    if not stopping.done():
        stopping.set_result(None)
    try:
        await asyncio.wait_for(ctx.idle.wait(), grace_s)
    except asyncio.TimeoutError:
        log.warning("%d request(s) still in flight after %g s; exiting anyway", ctx.inflight, grace_s)
    state.request_exit(code)


class _Server(uvicorn.Server):
    """uvicorn, except that the first SIGTERM drains instead of closing the listener, and a second
    SIGTERM (or a SIGINT) aborts what is left with 503 and exits 128 + the signal (`_stop_now`)
    instead of uvicorn's shutdown (which answers the rest 500 and re-raises the signal)."""

    def __init__(self, config, state: ServerState):
        super().__init__(config)
        self.state = state
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stopping = False

    async def serve(self, sockets=None):
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)

    def handle_exit(self, sig, frame):
        if self._loop is None:
            return super().handle_exit(sig, frame)
        if sig == signal.SIGTERM and not self.state.draining:
            self.state.draining = True
            self._loop.call_soon_threadsafe(lambda: self.state.tasks.append(
                asyncio.ensure_future(_drain(self.state))))
            return
        if sig in (signal.SIGTERM, signal.SIGINT) and not self._stopping:
            self._stopping = True
            self._loop.call_soon_threadsafe(lambda: self.state.tasks.append(
                asyncio.ensure_future(_stop_now(self.state, sig))))
            return
        super().handle_exit(sig, frame)         # a third signal: uvicorn's own (SIGINT twice: force exit)


# ------------------------------------------------------------------ flags -> objects
def build_parser(prog: str = "fastdeploy-ext serve") -> argparse.ArgumentParser:
    p = shared_args.root_parser(prog, "OpenAI-compatible server (FastDeploy-style flags)")
    cli_args.add_serve_arguments(p)
    return p


def _metrics_app(state: ServerState):
    """The --metrics-port app: /metrics only (lifespan off; the main app owns the engine)."""
    async def app(scope, receive, send):
        if scope["path"] == "/metrics":
            resp = Response(state.metrics.render(), media_type=PROMETHEUS_TYPE)
        else:
            resp = APIError(404, f"{scope['path']}: only /metrics is served on this port").response()
        await resp(scope, receive, send)
    return app


def run_server(ns: argparse.Namespace) -> int:
    """Everything after flag parsing; shared by both entry points."""
    return asyncio.run(_serve(build_state(ns)))


def build_state(ns: argparse.Namespace) -> ServerState:
    """Flags -> the server's objects (engine created, not started). CliError for bad values."""
    cli_args.notice_ignored_flags(ns)
    source = shared_args.model_source_from_args(ns)
    engine_config = shared_args.engine_config_from_args(ns, source, shared_args.plan_request_from_args(ns))
    config = cli_args.server_config_from_args(ns, default_model_names=cli_args.default_served_names(source.model_dir))
    log.info("max prefill: %s", engine_config.max_prefill().reason)
    log.info("server: host=%s port=%d metrics_port=%s served_model_names=%s api_key=%s request_timeout=%gs "
             "max_concurrency=%d max_request_body_bytes=%d max_inflight_body_bytes=%d header_timeout=%gs "
             "body_timeout=%gs allowed_local_media_path=%s",
             config.host, config.port, config.metrics_port, list(config.served_model_names),
             "set" if config.api_key else "off", config.request_timeout, config.max_concurrency,
             config.max_body_bytes, config.max_inflight_body_bytes, config.header_timeout, config.body_timeout,
             config.allowed_local_media_path)
    if config.host in ("0.0.0.0", "::"):
        log.info("listening on every interface (--host %s): reachable from the network%s", config.host,
                 "" if config.api_key else "; no --api-key set")
    log.info("image URLs: %s", "not fetched (--media-fetch off)" if not config.media_fetch else
             "fetched from %s; %s" % (
                 "any host" if config.allowed_media_domains is None else ", ".join(config.allowed_media_domains),
                 "loopback/private/link-local addresses allowed (--allow-private-media-fetch)"
                 if config.allow_private_media_fetch else "loopback, private, link-local, multicast and reserved "
                 "addresses refused"))
    from ...engine.async_engine import AsyncLLMEngine
    engine = AsyncLLMEngine(engine_config)
    metrics_holder: list[ServerState] = []
    metrics = ServerMetrics(lambda: metrics_holder[0].stats() if metrics_holder else None,
                            config.served_model_names[0])
    fetcher = MediaFetcher(MediaPolicy(config.max_body_bytes, config.media_fetch_timeout,
                                       config.allowed_local_media_path, fetch_enabled=config.media_fetch,
                                       allowed_domains=config.allowed_media_domains,
                                       allow_private=config.allow_private_media_fetch))
    ctx = ChatContext(engine=engine, metrics=metrics, fetcher=fetcher, served_names=config.served_model_names,
                      request_timeout=config.request_timeout, max_concurrency=config.max_concurrency,
                      repetition_guard=config.repetition_guard)
    state = ServerState(config=config, engine=engine, metrics=metrics, chat=ChatHandler(ctx),
                        max_model_len=getattr(engine_config, "max_model_len", None),
                        model_root=source.model_dir or "dummy",
                        inflight_bytes=inflight.ByteBudget(config.max_inflight_body_bytes))
    metrics_holder.append(state)
    state.jobs = _build_jobs(ns, state, fetcher)
    return state


def _build_jobs(ns: argparse.Namespace, state: ServerState, fetcher: MediaFetcher):
    """The job API's service with --jobs-dir (its pipeline options from the parse flags), else None."""
    from .jobs import jobs_config_from_args
    from .serving_jobs import JobRoutes, JobsCollector, served_version
    cfg = jobs_config_from_args(ns)
    if cfg is None:
        return None
    import dataclasses
    from ..parse_cmd import parse_options_from_args
    from .jobs import JobService
    # serve's own --workers (FastDeploy's, ignored) is not parse's: one pipeline in this process
    opts = parse_options_from_args(argparse.Namespace(**{**vars(ns), "workers": 1, "gpus": None}), output=None)
    service = JobService(cfg, opts, state.engine,
                         engine_ready=lambda: state.engine_started and state.engine.ready)
    # the layout model loads before the engine and its pass's memory stays out of the KV pool
    state.engine.reserve_memory = service.layout_reservation
    job_fetcher = MediaFetcher(dataclasses.replace(fetcher.policy, max_bytes=cfg.max_upload_bytes))
    log.info("jobs: the PaddleOCR job API on %s/api/v2/ocr/jobs: jobs in %s, at most %d queued, uploads up to %d "
             "bytes, finished jobs kept %g s, block priority +%d (chat first), layout model %s",
             f"http://{state.config.host}:{state.config.port}", cfg.jobs_dir, cfg.max_queued_jobs,
             cfg.max_upload_bytes, cfg.ttl_s, cfg.priority_offset, opts.layout_model or "random weights (dummy)")
    state.metrics.registry.register(JobsCollector(service))
    return JobRoutes(service, api_key=state.config.api_key, fetcher=job_fetcher,
                     served_version=served_version(opts.model))


async def _serve(state: ServerState) -> int:
    cfg = state.config
    uv = dict(log_level=cfg.log_level, timeout_graceful_shutdown=5, access_log=False,
              http=timed_h11_protocol(cfg.header_timeout, cfg.body_timeout))
    server = _Server(uvicorn.Config(build_app(state), host=cfg.host, port=cfg.port, lifespan="on", **uv), state)
    state.server = server
    metrics_server = None
    if cfg.metrics_port is not None:
        metrics_server = uvicorn.Server(uvicorn.Config(_metrics_app(state), host=cfg.host, port=cfg.metrics_port,
                                                       lifespan="off", **uv))
        metrics_server.capture_signals = contextlib.nullcontext      # the main server owns the signals
        metrics_task = asyncio.create_task(metrics_server.serve())
    await server.serve()
    if metrics_server is not None:
        metrics_server.should_exit = True
        await metrics_task
    if not server.started and state.exit_code == 0:
        state.exit_code = 1                     # e.g. the port was taken (uvicorn logged why)
    log.info("server exited with status %d", state.exit_code)
    return state.exit_code


def main(argv: list[str] | None = None, prog: str = "python -m fastdeploy_ext.entrypoints.openai.api_server") -> int:
    shared_args.setup_logging()
    parser = build_parser(prog)
    argv = list(sys.argv[1:] if argv is None else argv)
    ns = parser.parse_args(cli_args.expand_config_file(parser, argv))
    return serve_from_namespace(ns, prog)


def serve_from_namespace(ns: argparse.Namespace, prog: str = "fastdeploy-ext serve") -> int:
    from ...runner import emulated_backends
    try:
        try:
            emulation = emulated_backends(envs.FD_EMULATE.get())
        except ValueError as e:
            raise CliError(str(e)) from None
        shared_args.setup_logging(ns.log_file)
        with emulation:     # FD_EMULATE=metax: the backend's own fakes, as for every other command
            return run_server(ns)
    except CliError as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
