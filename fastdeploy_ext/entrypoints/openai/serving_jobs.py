"""PaddleOCR's document-parsing job API on `serve` (what ``paddleocr``'s API client speaks):

    POST /api/v2/ocr/jobs                  submit: JSON {fileUrl, model, optionalPayload, pageRanges?,
                                           batchId?} or multipart (file, model, optionalPayload as a
                                           JSON string, ...) -> data.jobId
    GET  /api/v2/ocr/jobs/{jobId}          state pending|running|done|failed, extractProgress,
                                           errorMsg, resultUrl.jsonUrl once done
    GET  /api/v2/ocr/jobs/batch/{batchId}  extractResult: the status of each job of the batch
    GET  /api/v2/ocr/results/{jobId}/{secret}/{file}   the JSON Lines result and the Markdown
                                           images (pre-signed: no Bearer header, the secret is
                                           the credential; gone when the job expires)

Every answer is ``{code, msg, data}`` (code 0 on success; an error keeps its HTTP status, which
the client maps to its exceptions). Job endpoints take ``Authorization: Bearer <token>``
checked against ``--api-key`` (any token when none is set)."""
from __future__ import annotations

import asyncio
import hmac
import json
import logging
from dataclasses import dataclass, replace
from pathlib import Path, PurePosixPath
from typing import Any, Callable

from starlette.requests import Request
from starlette.responses import FileResponse, JSONResponse

from .jobs import JobRecord, JobService, JobState, QueueFull

log = logging.getLogger("fastdeploy_ext.jobs")

API = "/api/v2/ocr"
#: the client's document-parsing model names that this server serves (its VLM + layout model)
VL_MODELS = ("PaddleOCR-VL", "PaddleOCR-VL-1.5", "PaddleOCR-VL-1.6")
#: names the client knows that are other pipelines
OTHER_MODELS = ("PP-StructureV3", "PP-OCRv5", "PP-OCRv5-latin", "PP-OCRv6")
#: input suffixes by the file's magic bytes, when the name says nothing
_MAGIC = ((b"%PDF", ".pdf"), (b"\x89PNG", ".png"), (b"\xff\xd8", ".jpg"), (b"RIFF", ".webp"), (b"BM", ".bmp"),
          (b"II*\x00", ".tif"), (b"MM\x00*", ".tif"))


class JobAPIError(Exception):
    def __init__(self, status: int, msg: str):
        super().__init__(msg)
        self.status, self.msg = status, msg

    def response(self) -> JSONResponse:
        return JSONResponse({"code": self.status, "msg": self.msg, "data": None}, status_code=self.status)


def ok(data: dict) -> JSONResponse:
    return JSONResponse({"code": 0, "msg": "Success", "data": data})


# ------------------------------------------------------------------ optionalPayload
@dataclass(frozen=True)
class OptionRule:
    """One key of the client's PaddleOCRVLOptions: the values that ask for nothing this server
    lacks (accepted; ``apply`` maps a value to ParseOptions fields, else it is ignored with a
    log line); any other value is a 400 naming the key and ``missing``."""
    accepts: Callable[[Any], bool]
    missing: str
    apply: Callable[[Any], dict] | None = None


def _is(*values):
    return lambda v: any(v == x and type(v) is type(x) for x in values)


def _pos_int(v):
    return isinstance(v, int) and not isinstance(v, bool) and v > 0


def _unit_float(v):
    return isinstance(v, (int, float)) and not isinstance(v, bool) and 0.0 <= v <= 1.0


_BOOL = lambda v: isinstance(v, bool)  # noqa: E731
OPTION_RULES: dict[str, OptionRule] = {
    "useDocOrientationClassify": OptionRule(_is(False), "document orientation classification is not implemented"),
    "useDocUnwarping": OptionRule(_is(False), "document unwarping is not implemented"),
    "useLayoutDetection": OptionRule(_is(True), "parsing without layout detection is not implemented"),
    "useChartRecognition": OptionRule(_BOOL, "", lambda v: {"chart_recognition": v}),
    "useSealRecognition": OptionRule(_BOOL, "", lambda v: {"seal_recognition": v}),
    "useOcrForImageBlock": OptionRule(_is(False), "OCR of image blocks is not implemented"),
    "layoutThreshold": OptionRule(_unit_float, "a per-class layoutThreshold (object) is not implemented; "
                                  "give one number in [0, 1]", lambda v: {"layout_threshold": float(v)}),
    "layoutNms": OptionRule(_is(True), "layout detection without NMS is not implemented"),
    "layoutUnclipRatio": OptionRule(_is(1, 1.0, [1, 1], [1.0, 1.0]), "layoutUnclipRatio other than 1 is not "
                                    "implemented"),
    "layoutMergeBboxesMode": OptionRule(lambda v: False, "layoutMergeBboxesMode is not implemented"),
    "layoutShapeMode": OptionRule(_is("auto"), "layoutShapeMode other than 'auto' is not implemented"),
    "promptLabel": OptionRule(lambda v: False, "promptLabel (parsing without layout detection) is not implemented"),
    "formatBlockContent": OptionRule(_is(False), "formatBlockContent is not implemented"),
    "repetitionPenalty": OptionRule(_is(1, 1.0), "repetitionPenalty other than 1 is not implemented"),
    "temperature": OptionRule(_is(0, 0.0), "sampling (temperature > 0) is not implemented: blocks are decoded "
                              "greedily"),
    "topP": OptionRule(_is(1, 1.0), "topP other than 1 is not implemented"),
    "minPixels": OptionRule(lambda v: False, "minPixels is not implemented"),
    "maxPixels": OptionRule(_pos_int, "maxPixels must be an integer > 0", lambda v: {"block_max_pixels": v}),
    "maxNewTokens": OptionRule(_pos_int, "maxNewTokens must be an integer > 0", lambda v: {"max_new_tokens": v}),
    "vlmExtraArgs": OptionRule(_is({}), "vlmExtraArgs are not implemented"),
    "mergeLayoutBlocks": OptionRule(_is(True), "mergeLayoutBlocks false is not implemented"),
    "markdownIgnoreLabels": OptionRule(lambda v: False, "markdownIgnoreLabels is not implemented"),
    "prettifyMarkdown": OptionRule(_BOOL, ""),
    "showFormulaNumber": OptionRule(_is(False), "showFormulaNumber is not implemented"),
    "restructurePages": OptionRule(_is(False), "restructuring pages across a document is not implemented"),
    "mergeTables": OptionRule(_is(False), "merging tables across pages is not implemented"),
    "relevelTitles": OptionRule(_is(False), "relevelling titles is not implemented"),
    "returnMarkdownImages": OptionRule(_is(True), "returnMarkdownImages false is not implemented"),
    "outputFormats": OptionRule(lambda v: False, "outputFormats is not implemented (results are JSON Lines)"),
    "visualize": OptionRule(_BOOL, "", lambda v: {"visualize": v}),   # outputImages.layout_det_res
}


def job_options(payload: Any, base_opts) -> dict:
    """optionalPayload -> the ParseOptions fields a job overrides (JobAPIError 400 for a key
    outside the client's PaddleOCRVLOptions or a value asking for what is not implemented)."""
    if payload is None:
        return {}
    if not isinstance(payload, dict):
        raise JobAPIError(400, "optionalPayload must be a JSON object")
    fields: dict = {}
    for key, value in payload.items():
        rule = OPTION_RULES.get(key)
        if rule is None:
            raise JobAPIError(400, f"optionalPayload.{key}: unknown option (PaddleOCR-VL options: "
                                   f"{', '.join(sorted(OPTION_RULES))})")
        if value is None:
            continue
        if not rule.accepts(value):
            raise JobAPIError(400, f"optionalPayload.{key}={json.dumps(value)}: {rule.missing}")
        if rule.apply is None:
            log.info("jobs: optionalPayload.%s=%s accepted and ignored (nothing to do for it here)", key,
                     json.dumps(value))
            continue
        fields.update(rule.apply(value))
    # the server's limits stay the ceiling: a job may ask for less, never more
    if "max_new_tokens" in fields:
        fields["max_new_tokens"] = min(fields["max_new_tokens"], base_opts.max_new_tokens)
    if "block_max_pixels" in fields and base_opts.block_max_pixels is not None:
        fields["block_max_pixels"] = min(fields["block_max_pixels"], base_opts.block_max_pixels)
    return fields


def served_version(model_dir: str | None) -> str | None:
    """Which of the client's VL names the served weights are, by their directory's name
    (PaddleOCR-VL-1.5, ...); None when the name does not say (random weights, a renamed dir)."""
    name = Path(model_dir).name.lower() if model_dir else ""
    for m in reversed(VL_MODELS[1:]):
        if m.lower() in name:
            return m
    return VL_MODELS[0] if VL_MODELS[0].lower() in name else None


def check_model(model: Any, served: str | None) -> str:
    """The job's model name (the client's default when none): one of the VL names (a warning when
    the served weights are another version: they parse it all the same), else a 400."""
    if model is None:
        return VL_MODELS[-1]
    if model in VL_MODELS:
        if served and model != served:
            log.warning("jobs: model %s asked; the served weights are %s (they parse it)", model, served)
        return model
    if model in OTHER_MODELS:
        raise JobAPIError(400, f"model {model}: not served here (this server runs the PaddleOCR-VL pipeline: "
                               f"{', '.join(VL_MODELS)})")
    raise JobAPIError(400, f"model {model!r}: unknown (choose from {', '.join(VL_MODELS)})")


def input_suffix(name: str | None, data: bytes) -> str:
    from ...parsing.sources import SUPPORTED_SUFFIXES
    suffix = PurePosixPath(name or "").suffix.lower()
    if suffix in SUPPORTED_SUFFIXES:
        return suffix
    for magic, sfx in _MAGIC:
        if data.startswith(magic):
            return sfx
    raise JobAPIError(400, f"file {name or '(unnamed)'}: not a PDF or a supported image "
                           f"({', '.join(sorted(SUPPORTED_SUFFIXES))})")


# ------------------------------------------------------------------ the routes
class JobRoutes:
    def __init__(self, service: JobService, *, api_key: str | None, fetcher, served_version: str | None = None):
        self.service, self.api_key, self.fetcher = service, api_key, fetcher
        self.served_version = served_version
        self.draining = False

    def auth(self, request: Request) -> None:
        if self.api_key is None:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() not in ("bearer", "token"):      # "token": PaddleX serving's examples
            token = ""
        if not hmac.compare_digest(token.encode(), self.api_key.encode()):
            raise JobAPIError(401, "missing or wrong access token (send `Authorization: Bearer <token>`)")

    async def _body(self, request: Request) -> bytes:
        limit = self.service.config.max_upload_bytes
        declared = request.headers.get("content-length")
        # the multipart framing is counted too: a little slack over the document's own limit
        cap = limit + 64 * 1024
        if declared is not None and declared.isdigit() and int(declared) > cap:
            raise JobAPIError(413, f"the upload is larger than {limit} bytes (--max-upload-bytes)")
        body = bytearray()
        async for chunk in request.stream():
            body += chunk
            if len(body) > cap:
                raise JobAPIError(413, f"the upload is larger than {limit} bytes (--max-upload-bytes)")
        return bytes(body)

    async def submit(self, request: Request) -> JSONResponse:
        self.auth(request)
        if self.draining or self.service.stopping:
            raise JobAPIError(503, "the server is shutting down; retry on another replica")
        body = await self._body(request)
        ctype = request.headers.get("content-type", "")
        if ctype.startswith("multipart/form-data"):
            fields, data, name = await self._multipart(request, body)
            try:
                payload = json.loads(fields.get("optionalPayload") or "{}")
            except ValueError as e:
                raise JobAPIError(400, f"optionalPayload: not JSON ({e})") from None
        else:
            try:
                fields = json.loads(body)
            except ValueError as e:
                raise JobAPIError(400, f"the body is neither multipart/form-data nor JSON ({e})") from None
            if not isinstance(fields, dict):
                raise JobAPIError(400, "the JSON body must be an object")
            url = fields.get("fileUrl")
            if not isinstance(url, str) or not url:
                raise JobAPIError(400, "fileUrl: required (or upload the file as multipart/form-data)")
            data, name = await self._fetch(url), PurePosixPath(url.split("?", 1)[0]).name
            payload = fields.get("optionalPayload")
        if len(data) > self.service.config.max_upload_bytes:
            raise JobAPIError(413, f"the document is larger than {self.service.config.max_upload_bytes} bytes "
                                   f"(--max-upload-bytes)")
        if not data:
            raise JobAPIError(400, "file: empty")
        model = check_model(fields.get("model"), self.served_version)
        options = job_options(payload, self.service.base_opts)
        ranges = fields.get("pageRanges")
        if ranges is not None:
            from ...parsing.sources import parse_page_ranges
            try:
                parse_page_ranges(str(ranges))
            except ValueError as e:
                raise JobAPIError(400, f"pageRanges: {e}") from None
        batch = fields.get("batchId")
        try:
            replace(self.service.base_opts, **options).validate()
        except ValueError as e:
            raise JobAPIError(400, f"optionalPayload: {e}") from None
        try:
            rec = await asyncio.to_thread(self.service.submit, data, input_suffix(name, data), model=model,
                                          options=options, page_ranges=None if ranges is None else str(ranges),
                                          batch_id=None if batch is None else str(batch))
        except QueueFull as e:
            raise JobAPIError(429, str(e)) from None
        return ok({"jobId": rec.job_id})

    async def _multipart(self, request: Request, body: bytes):
        sent = False

        async def replay():
            nonlocal sent
            if not sent:
                sent = True
                return {"type": "http.request", "body": body, "more_body": False}
            return {"type": "http.disconnect"}
        try:
            form = await Request(request.scope, replay).form(max_files=1, max_fields=16)
        except Exception as e:  # noqa: BLE001 - a malformed multipart body is the client's problem
            raise JobAPIError(400, f"multipart body: {e}") from None
        upload = form.get("file")
        if upload is None or isinstance(upload, str):
            raise JobAPIError(400, "file: required (a multipart file field named 'file')")
        data = await upload.read()
        fields = {k: v for k, v in form.items() if isinstance(v, str)}
        return fields, data, upload.filename

    async def _fetch(self, url: str) -> bytes:
        from .errors import APIError
        try:
            got = await self.fetcher.fetch(url, "fileUrl")
        except APIError as e:
            raise JobAPIError(400 if e.status < 500 else e.status, e.message.replace("image", "file")) from None
        if isinstance(got, str):
            raise JobAPIError(400, "fileUrl: data: URLs are not accepted; upload the file as multipart/form-data")
        return got

    def _job(self, request: Request, job_id: str) -> JobRecord:
        self.auth(request)
        rec = self.service.jobs.get(job_id)
        if rec is None:
            raise JobAPIError(404, f"job {job_id}: not found (unknown, or expired)")
        return rec

    def status_data(self, request: Request, rec: JobRecord) -> dict:
        data: dict = {"jobId": rec.job_id, "state": rec.state.value, "model": rec.model}
        if rec.batch_id is not None:
            data["batchId"] = rec.batch_id
        if rec.state is not JobState.PENDING:
            data["extractProgress"] = {"totalPages": rec.total_pages, "extractedPages": rec.extracted_pages,
                                       "startTime": _iso(rec.started), "endTime": _iso(rec.finished)}
        if rec.state is JobState.DONE:
            data["resultUrl"] = {"jsonUrl": self.result_url(request, rec, "result.jsonl")}
        if rec.state is JobState.FAILED:
            data["errorMsg"] = rec.error_msg or "failed"
        # the server's own clock, unrounded (Unix seconds): startTime/endTime are whole seconds,
        # too coarse to time a run from (bench serve --workloads parse reads these)
        data["timestamps"] = {"created": rec.created, "started": rec.started, "finished": rec.finished}
        return data

    def result_url(self, request: Request, rec: JobRecord, rel: str) -> str:
        return f"{str(request.base_url).rstrip('/')}{API}/results/{rec.job_id}/{rec.secret}/{rel}"

    async def status(self, request: Request, job_id: str) -> JSONResponse:
        return ok(self.status_data(request, self._job(request, job_id)))

    async def batch(self, request: Request, batch_id: str) -> JSONResponse:
        self.auth(request)
        recs = self.service.batch(batch_id)
        if not recs:
            raise JobAPIError(404, f"batch {batch_id}: not found (no job names it, or they expired)")
        return ok({"batchId": batch_id, "extractResult": [self.status_data(request, r) for r in recs]})

    async def result_file(self, request: Request, job_id: str, secret: str, rel: str):
        rec = self.service.jobs.get(job_id)
        # one answer for a wrong secret and an unknown job: the URL alone is the credential
        if rec is None or rec.state is not JobState.DONE or not hmac.compare_digest(secret.encode(),
                                                                                    rec.secret.encode()):
            raise JobAPIError(404, "no such result (unknown, expired, or not done)")
        path = self.service.result_path(rec, rel)
        if path is None:
            raise JobAPIError(404, "no such result file")
        if rel == "result.jsonl":
            return await asyncio.to_thread(self._absolute_jsonl, request, rec, path)
        return FileResponse(path)

    def _absolute_jsonl(self, request: Request, rec: JobRecord, path: Path):
        """The stored lines name images relative to the job; served, they are absolute URLs."""
        from starlette.responses import Response
        out = []
        for line in path.read_text(encoding="utf-8").splitlines():
            if not line.strip():
                continue
            obj = json.loads(line)
            for item in obj["result"]["layoutParsingResults"]:
                for imgs in (item["markdown"]["images"], item["outputImages"]):
                    for k, rel in imgs.items():
                        imgs[k] = self.result_url(request, rec, rel)
            out.append(json.dumps(obj, ensure_ascii=False))
        return Response("\n".join(out) + "\n", media_type="application/jsonl")

    # ------------------------------------------------------------ PaddleX's /layout-parsing
    async def layout_parsing(self, request: Request) -> JSONResponse:
        """PaddleX serving's synchronous call: one document (``file`` as a URL or base64,
        ``fileType`` 0 PDF / 1 image, the pipeline options at the top level) parsed as a job of
        the same queue and limits, answered when its last page is in; the Markdown images inline
        as base64, as PaddleX returns them."""
        import base64
        import binascii
        import uuid
        log_id = str(uuid.uuid4())
        try:
            self.auth(request)
            if self.draining or self.service.stopping:
                raise JobAPIError(503, "the server is shutting down; retry on another replica")
            try:
                body = json.loads(await self._body(request))
            except ValueError as e:
                raise JobAPIError(400, f"the body is not JSON ({e})") from None
            if not isinstance(body, dict):
                raise JobAPIError(400, "the JSON body must be an object")
            file, file_type = body.pop("file", None), body.pop("fileType", None)
            if not isinstance(file, str) or not file:
                raise JobAPIError(400, "file: required (a URL or the file's bytes in base64)")
            if file_type not in (None, 0, 1):
                raise JobAPIError(400, f"fileType: {file_type!r} (0 = PDF, 1 = image)")
            if "://" in file[:16] or file.startswith("/"):
                data, name = await self._fetch(file), PurePosixPath(file.split("?", 1)[0]).name
            else:
                try:
                    data, name = base64.b64decode(file, validate=True), None
                except (binascii.Error, ValueError):
                    raise JobAPIError(400, "file: neither a URL nor valid base64") from None
            if len(data) > self.service.config.max_upload_bytes:
                raise JobAPIError(413, f"the document is larger than {self.service.config.max_upload_bytes} "
                                       f"bytes (--max-upload-bytes)")
            suffix = ".pdf" if file_type == 0 else input_suffix(name, data)
            if file_type == 1 and suffix == ".pdf":
                raise JobAPIError(400, "fileType 1 (image) but the file is a PDF")
            options = job_options(body, self.service.base_opts)
            try:
                rec = await asyncio.to_thread(self.service.submit, data, suffix, model=VL_MODELS[-1],
                                              options=options, page_ranges=None, batch_id=None)
            except QueueFull as e:
                raise JobAPIError(429, str(e)) from None
            try:
                while rec.state not in (JobState.DONE, JobState.FAILED):
                    if self.service.stopping:       # the job resumes on the next start; this call cannot wait
                        raise JobAPIError(503, "the server is shutting down; the document was not finished")
                    await asyncio.sleep(0.05)
                if rec.state is JobState.FAILED:
                    msg = rec.error_msg or "failed"
                    raise JobAPIError(400 if msg.startswith("input") else 500, msg)
                result = await asyncio.to_thread(self._inline_result, rec)
            finally:
                await asyncio.to_thread(self.service.remove, rec.job_id)
        except JobAPIError as e:
            log.warning("POST /layout-parsing -> %d: %s", e.status, e.msg[:300])
            return JSONResponse({"logId": log_id, "errorCode": e.status, "errorMsg": e.msg}, status_code=e.status)
        return JSONResponse({"logId": log_id, "errorCode": 0, "errorMsg": "Success", "result": result})

    def _inline_result(self, rec: JobRecord) -> dict:
        import base64
        pages, info = [], None
        path = self.service.result_path(rec, "result.jsonl")
        for line in path.read_text(encoding="utf-8").splitlines() if path else []:
            if not line.strip():
                continue
            res = json.loads(line)["result"]
            for item in res["layoutParsingResults"]:
                for imgs in (item["markdown"]["images"], item["outputImages"]):
                    for k, rel in imgs.items():
                        f = self.service.result_path(rec, rel)
                        imgs[k] = base64.b64encode(f.read_bytes()).decode() if f else ""
                pages.append(item)
            d = res["dataInfo"]
            if d.get("type") == "pdf":
                info = info or {"type": "pdf", "numPages": d["numPages"], "pages": []}
                info["pages"] += d["pages"]
            else:
                info = d
        return {"layoutParsingResults": pages, "dataInfo": info}

    def mount(self, app) -> None:
        async def guarded(fn, request, *args):
            try:
                return await fn(request, *args)
            except JobAPIError as e:
                log.warning("%s %s -> %d: %s", request.method, request.url.path, e.status, e.msg[:300])
                return e.response()

        @app.post(f"{API}/jobs")
        async def submit(request: Request):
            return await guarded(self.submit, request)

        @app.get(f"{API}/jobs/batch/{{batch_id}}")
        async def batch(request: Request, batch_id: str):
            return await guarded(self.batch, request, batch_id)

        @app.get(f"{API}/jobs/{{job_id}}")
        async def status(request: Request, job_id: str):
            return await guarded(self.status, request, job_id)

        @app.post("/layout-parsing")
        async def layout_parsing(request: Request):
            return await self.layout_parsing(request)

        @app.get(f"{API}/results/{{job_id}}/{{secret}}/{{rel:path}}")
        async def result(request: Request, job_id: str, secret: str, rel: str):
            return await guarded(self.result_file, request, job_id, secret, rel)


def _iso(t: float | None) -> str | None:
    if t is None:
        return None
    import datetime
    return datetime.datetime.fromtimestamp(t, datetime.timezone.utc).isoformat(timespec="seconds")


#: the running jobs' pipeline stages (summed over their pipelines), as gauges ``job_<key>``
PIPELINE_GAUGES = (
    ("pages_in_flight", "Pages of parsing jobs in their pipelines (rendering, laid out, in the VLM or writing)"),
    ("rendering", "Pages submitted to the render pool and not rendered yet (the render queue)"),
    ("layout_queue", "Rendered pages waiting for the layout model"),
    ("blocks_in_flight", "VLM blocks of parsing jobs in the engine (waiting or running there)"),
    ("write_queue", "Finished pages waiting for the writer (assemble, commit)"),
)


class JobsCollector:
    """The job API's counts in /metrics, read from the service at scrape time (counters since
    this process started; gauges of what is queued and running now)."""

    def __init__(self, service: JobService):
        self.service = service

    def describe(self):
        return []

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
        svc = self.service
        states = [r.state for r in list(svc.jobs.values())]
        depths = svc.depths()
        c = dict(svc.counts)
        yield CounterMetricFamily("fastdeploy_ext:jobs_submitted", "Parsing jobs accepted", value=c["submitted"])
        yield CounterMetricFamily("fastdeploy_ext:jobs_done", "Parsing jobs finished done", value=c["done"])
        yield CounterMetricFamily("fastdeploy_ext:jobs_failed", "Parsing jobs finished failed", value=c["failed"])
        yield CounterMetricFamily("fastdeploy_ext:job_pages", "Pages of parsing jobs settled (done or failed)",
                                  value=c["pages"])
        yield GaugeMetricFamily("fastdeploy_ext:jobs_pending", "Parsing jobs queued",
                                value=states.count(JobState.PENDING))
        yield GaugeMetricFamily("fastdeploy_ext:jobs_running", "Parsing jobs running",
                                value=states.count(JobState.RUNNING))
        yield GaugeMetricFamily("fastdeploy_ext:job_pages_per_second", "Pages of parsing jobs settled per second "
                                f"over the last {svc.rate.window_s:g} s", value=svc.rate.rate())
        for key, doc in PIPELINE_GAUGES:
            yield GaugeMetricFamily(f"fastdeploy_ext:job_{key}", doc, value=float(depths[key]))
        yield GaugeMetricFamily("fastdeploy_ext:job_pages_in_flight_limit", "Pages in flight across the running jobs "
                                "at most (--job-pages-in-flight)", value=float(svc.page_slots.size))


async def expiry_loop(service: JobService, period_s: float) -> None:
    while True:
        await asyncio.to_thread(service.expire)
        await asyncio.sleep(period_s)
