"""The server's own flags (`serve` / `python -m ...api_server`), FastDeploy's flags that mean
nothing here (accepted with a one-line notice), and ``--config FILE.yaml``.

The model, device, plan and engine flags are the shared ones of `entrypoints/args.py`; this
module adds what only the HTTP server needs and turns it into a typed `ServerConfig`."""
from __future__ import annotations

import argparse
import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path

import yaml

from ..args import CliError

log = logging.getLogger("fastdeploy_ext")

DEFAULT_MAX_BODY_BYTES = 64 * 1024 * 1024
# bodies and fetched images held at once across all requests, by default: four maximal requests
INFLIGHT_BODIES = 4
DEFAULT_HEADER_TIMEOUT_S = 10.0
DEFAULT_BODY_TIMEOUT_S = 30.0

# Where the API key may come from, first wins: the flag (or its --config key), then these
# environment variables (vLLM's name last, so one deployment's env works for both servers).
# Not in envs.ALL on purpose: `fastdeploy-ext` prints every envs.ALL value, and this is a secret.
API_KEY_ENV_VARS = ("FD_API_KEY", "VLLM_API_KEY")
# Flags whose values are secrets: never logged (see redact_argv).
SECRET_FLAGS = frozenset({"--api-key"})
REDACTED = "<redacted>"

# FastDeploy flags with no meaning in this single-process server. They are accepted (so a
# FastDeploy launch line works unchanged) and each is named in one log line with the reason.
IGNORED_FASTDEPLOY_FLAGS: dict[str, str] = {
    "--engine-worker-queue-port": "no separate engine worker process",
    "--cache-queue-port": "no separate cache manager process",
    "--pod-ips": "single node",
    "--workers": "one API server process (the engine is in-process)",
    "--enable-mm": "multimodal is always on (PaddleOCR-VL)",
    "--reasoning-parser": "no reasoning output in OCR models",
    "--tool-call-parser": "no tool calls in OCR models",
    "--enable-prefix-caching": "no prefix caching (every page is a different image)",
    "--enable-chunked-prefill": "chunking follows FD_ENABLE_MAX_PREFILL",
    "--max-num-partial-prefills": "chunking follows FD_ENABLE_MAX_PREFILL",
    "--swap-space": "preemption recomputes; no CPU swap",
    "--kv-cache-ratio": "the KV pool is sized from --gpu-memory-utilization",
    "--block-size": "the KV block size comes from the device's capability row",
    "--quantization": "weights run in --dtype",
    "--splitwise-role": "no prefill/decode disaggregation",
    "--enable-logprob": "logprobs are always available",
    "--max-processor-cache": "no processor cache",
}


@dataclass(frozen=True)
class ServerConfig:
    host: str
    port: int
    metrics_port: int | None
    served_model_names: tuple[str, ...]
    api_key: str | None
    request_timeout: float
    allowed_local_media_path: Path | None
    max_concurrency: int
    max_body_bytes: int
    media_fetch_timeout: float
    repetition_guard: dict | None      # overrides of the engine's RepetitionGuard defaults
    log_level: str
    max_inflight_body_bytes: int = INFLIGHT_BODIES * DEFAULT_MAX_BODY_BYTES
    header_timeout: float = DEFAULT_HEADER_TIMEOUT_S
    body_timeout: float = DEFAULT_BODY_TIMEOUT_S
    media_fetch: bool = True
    allowed_media_domains: tuple[str, ...] | None = None
    allow_private_media_fetch: bool = False
    log_stats_interval: float = 10.0   # seconds between stats lines (request_log.py); 0: none


def _positive(kind):
    def conv(raw: str):
        try:
            v = kind(raw)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a positive {kind.__name__}, got {raw!r}") from None
        if not v > 0:
            raise argparse.ArgumentTypeError(f"expected a positive {kind.__name__}, got {raw!r}")
        return v
    return conv


def _port(raw: str) -> int:
    try:
        v = int(raw)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a port number, got {raw!r}") from None
    if not 0 <= v <= 65535:
        raise argparse.ArgumentTypeError(f"port must be in [0, 65535], got {v}")
    return v


def _json_object(raw: str) -> dict:
    try:
        v = json.loads(raw)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not valid JSON ({e.msg}): {raw!r}") from None
    if not isinstance(v, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {raw!r}")
    return v


def add_serve_arguments(p: argparse.ArgumentParser) -> None:
    """Every flag of `serve`: the shared model/device/plan/engine groups, then the server's."""
    from .. import args as shared
    shared.add_runner_args(p)
    shared.add_engine_args(p)
    add_server_args(p)
    add_job_arguments(p)


def add_server_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("HTTP server")
    g.add_argument("--host", default="0.0.0.0",
                   help="address to listen on; the default 0.0.0.0 is every interface of the machine (reachable "
                        "from the network: set --api-key, or --host 127.0.0.1 for this machine only)")
    g.add_argument("--port", type=_port, default=8000, help="port of the OpenAI API (0: any free port)")
    g.add_argument("--metrics-port", type=_port, default=None,
                   help="also serve /metrics on this port (it is always on the main port too)")
    g.add_argument("--served-model-name", nargs="+", default=None,
                   help="model name(s) clients may send as `model`, the first one answered back and listed "
                        "first (default: the --model path and its directory name, or 'dummy')")
    g.add_argument("--api-key", default=None,
                   help="require `Authorization: Bearer KEY` on /v1/* (default: $FD_API_KEY, then $VLLM_API_KEY; "
                        "never logged)")
    g.add_argument("--request-timeout", type=_positive(float), default=600.0,
                   help="seconds a chat request may take; past it the request is aborted and answered 504")
    g.add_argument("--allowed-local-media-path", default=None,
                   help="directory from which image parts may name local files (path or file://); off by default")
    g.add_argument("--max-concurrency", type=_positive(int), default=512,
                   help="chat requests in flight (running + waiting); beyond it new ones get 429")
    g.add_argument("--max-request-body-bytes", type=_positive(int), default=DEFAULT_MAX_BODY_BYTES,
                   help="request bodies and fetched images above this many bytes get 413 / 400")
    g.add_argument("--max-inflight-body-bytes", type=_positive(int), default=None,
                   help="bytes of request bodies and fetched images held at once across all requests; a request "
                        "whose bytes would go past it gets 429 (default: 4 x --max-request-body-bytes)")
    g.add_argument("--header-timeout", type=_positive(float), default=DEFAULT_HEADER_TIMEOUT_S,
                   help="seconds for a request's line and headers to arrive; past it: 408 and the connection closes")
    g.add_argument("--body-timeout", type=_positive(float), default=DEFAULT_BODY_TIMEOUT_S,
                   help="seconds for a request's body to arrive after its headers; past it: 408, connection closed")
    g.add_argument("--media-fetch", choices=("on", "off"), default="on",
                   help="fetch http(s) image URLs (off: only data: URLs and allowed local files)")
    g.add_argument("--media-fetch-timeout", type=_positive(float), default=10.0,
                   help="seconds to fetch one http(s) image URL (all its redirects included)")
    g.add_argument("--allowed-media-domains", nargs="+", default=None, metavar="HOST",
                   help="fetch image URLs only from these host names (exact match, every redirect too)")
    g.add_argument("--allow-private-media-fetch", action="store_true",
                   help="let image URLs reach loopback, private and link-local addresses (refused by default: "
                        "a URL must not reach inside the server's network); multicast, 0.0.0.0 and reserved "
                        "addresses stay refused")
    g.add_argument("--repetition-guard", type=_json_object, default=None,
                   help='engine repetition-loop guard settings, JSON, e.g. \'{"enabled": true, "max_period": 64, '
                        '"min_repeats": 8, "min_span": 128}\'')
    g.add_argument("--tensor-parallel-size", type=int, default=1, help="must be 1 (one device per server)")
    g.add_argument("--log-file", default=None, metavar="FILE",
                   help="also append every log line (start-up, access lines, stats lines) to FILE")
    g.add_argument("--log-stats-interval", type=float, default=10.0, metavar="SECONDS",
                   help="seconds between the stats lines (throughput, running/waiting, KV usage); 0: none")
    g.add_argument("--uvicorn-log-level", default="warning",
                   choices=("critical", "error", "warning", "info", "debug", "trace"))
    g.add_argument("--config", default=None, metavar="FILE.yaml",
                   help="any flag as a YAML key (max_num_seqs: 64 or max-num-seqs: 64); the command line wins")
    ig = p.add_argument_group("FastDeploy flags accepted and ignored (each logs why)")
    for flag in IGNORED_FASTDEPLOY_FLAGS:
        ig.add_argument(flag, nargs="?", const=True, default=None, help=argparse.SUPPRESS)


def notice_ignored_flags(ns: argparse.Namespace) -> list[str]:
    lines = []
    for flag, why in IGNORED_FASTDEPLOY_FLAGS.items():
        v = getattr(ns, flag[2:].replace("-", "_"))
        if v is not None:
            lines.append(f"ignoring FastDeploy flag {flag}{'' if v is True else '=' + str(v)}: {why}")
            log.info("%s", lines[-1])
    return lines


def resolve_api_key(ns: argparse.Namespace, environ=os.environ) -> tuple[str | None, str]:
    """(the key or None, where it came from). The flag wins; an empty environment variable counts
    as unset (as vLLM reads VLLM_API_KEY), an empty flag is an error (it would mean no auth)."""
    if ns.api_key is not None:
        if not ns.api_key:
            raise CliError("--api-key is empty (omit it to serve without a key)")
        return ns.api_key, "--api-key"
    for name in API_KEY_ENV_VARS:
        if environ.get(name):
            return environ[name], name
    return None, "none of --api-key, " + ", ".join(API_KEY_ENV_VARS) + " is set"


def redact_argv(tokens: list[str]) -> list[str]:
    """Command-line tokens with the values of SECRET_FLAGS replaced, for logging."""
    out, hide_next = [], False
    for t in tokens:
        flag, eq, _ = t.partition("=")
        if hide_next:
            out.append(REDACTED)
        elif eq and flag in SECRET_FLAGS:
            out.append(f"{flag}={REDACTED}")
        else:
            out.append(t)
        hide_next = not eq and t in SECRET_FLAGS
    return out


def default_served_names(model_dir: str | None) -> tuple[str, ...]:
    """The names a client may send when --served-model-name is not given: the --model path as
    typed (vLLM's default) and the directory's own name (`/models/PaddleOCR-VL-0.9B` ->
    `PaddleOCR-VL-0.9B`, what PaddleX's pipeline config sends); `dummy` for random weights."""
    if not model_dir:
        return ("dummy",)
    base = os.path.basename(os.path.normpath(model_dir))
    return (model_dir,) if base in ("", model_dir) else (model_dir, base)


def server_config_from_args(ns: argparse.Namespace, default_model_names: tuple[str, ...]) -> ServerConfig:
    if isinstance(default_model_names, str):
        default_model_names = (default_model_names,)
    if ns.log_stats_interval < 0:
        raise CliError(f"--log-stats-interval must be >= 0 seconds (0: no stats lines), got {ns.log_stats_interval:g}")
    api_key, key_source = resolve_api_key(ns)
    log.info("API key: %s", f"required, from {key_source}" if api_key else f"off ({key_source})")
    if ns.tensor_parallel_size != 1:
        raise CliError(f"--tensor-parallel-size {ns.tensor_parallel_size}: only 1 is supported "
                       f"(one device per server; run one server per device behind a load balancer)")
    media_root = None
    if ns.allowed_local_media_path:
        media_root = Path(os.path.realpath(ns.allowed_local_media_path))
        if not media_root.is_dir():
            raise CliError(f"--allowed-local-media-path {ns.allowed_local_media_path}: not a directory")
    if ns.repetition_guard is not None:
        from ...engine.sampling_params import RepetitionGuard
        try:
            RepetitionGuard(**ns.repetition_guard).validate()
        except (TypeError, ValueError) as e:
            raise CliError(f"--repetition-guard: {e}") from None
    inflight = ns.max_inflight_body_bytes or INFLIGHT_BODIES * ns.max_request_body_bytes
    if inflight < ns.max_request_body_bytes:
        raise CliError(f"--max-inflight-body-bytes {inflight} is below --max-request-body-bytes "
                       f"{ns.max_request_body_bytes}: no request of the maximal size could ever be admitted")
    return ServerConfig(host=ns.host, port=ns.port, metrics_port=ns.metrics_port,
                        served_model_names=tuple(dict.fromkeys(ns.served_model_name or default_model_names)),
                        api_key=api_key, request_timeout=ns.request_timeout,
                        allowed_local_media_path=media_root, max_concurrency=ns.max_concurrency,
                        max_body_bytes=ns.max_request_body_bytes, media_fetch_timeout=ns.media_fetch_timeout,
                        repetition_guard=ns.repetition_guard, log_level=ns.uvicorn_log_level,
                        max_inflight_body_bytes=inflight, header_timeout=ns.header_timeout,
                        body_timeout=ns.body_timeout, media_fetch=ns.media_fetch == "on",
                        allowed_media_domains=_domains(ns.allowed_media_domains),
                        allow_private_media_fetch=ns.allow_private_media_fetch,
                        log_stats_interval=ns.log_stats_interval)


def _domains(names: list[str] | None) -> tuple[str, ...] | None:
    if names is None:
        return None
    out = tuple(n.strip().rstrip(".").lower() for n in names)
    bad = [n for n in out if not n or "/" in n or ":" in n]
    if bad:
        raise CliError(f"--allowed-media-domains: expected host names (no scheme, port or path), got {bad}")
    return out


# -------------------------------------------------------------------- --config FILE.yaml
def expand_config_file(parser: argparse.ArgumentParser, argv: list[str]) -> list[str]:
    """Replace ``--config FILE`` by the file's keys as flags, placed BEFORE the command line's
    own flags so that the command line wins (argparse keeps the last value). Values go through
    the same flag parsing and checks as typed ones; an unknown key is an error naming it."""
    path, rest, i = None, [], 0
    while i < len(argv):
        a = argv[i]
        if a == "--config":
            if i + 1 >= len(argv):
                parser.error("--config needs a FILE.yaml")
            path, i = argv[i + 1], i + 2
            continue
        if a.startswith("--config="):
            path = a.split("=", 1)[1]
        else:
            rest.append(a)
        i += 1
    if path is None:
        return argv
    try:
        with open(path, encoding="utf-8") as f:
            data = yaml.safe_load(f)
    except OSError as e:
        parser.error(f"--config {path}: {e.strerror or e}")
    except yaml.YAMLError as e:
        parser.error(f"--config {path}: not valid YAML ({str(e).splitlines()[0]})")
    if data is None:
        return rest
    if not isinstance(data, dict):
        parser.error(f"--config {path}: expected a mapping of flag names to values")
    actions = parser._option_string_actions      # argparse has no public lookup
    tokens: list[str] = []
    for key, value in data.items():
        flag = "--" + str(key).replace("_", "-")
        action = actions.get(flag)
        if action is None or flag == "--config":
            parser.error(f"--config {path}: unknown key {key!r}")
        if action.nargs == 0:                    # store_true style switches
            if not isinstance(value, bool):
                parser.error(f"--config {path}: {key} must be true or false, got {value!r}")
            if value:
                tokens.append(flag)
            elif isinstance(action, argparse.BooleanOptionalAction):     # on by default: false says --no-X
                tokens.append("--no-" + flag[2:])
            continue
        values = value if isinstance(value, list) and action.nargs in ("+", "*") else [value]
        tokens.append(flag)
        for v in values:
            tokens.append(json.dumps(v) if isinstance(v, (dict, list)) else
                          ("true" if v is True else "false" if v is False else str(v)))
    log.info("--config %s: %s", path, " ".join(redact_argv(tokens)))
    return tokens + rest


def add_job_arguments(p: argparse.ArgumentParser) -> None:
    from ..parse_cmd import add_parse_options
    g = p.add_argument_group("document-parsing jobs (PaddleOCR's job API; off without --jobs-dir)")
    g.add_argument("--jobs-dir", default=None, metavar="DIR",
                   help="where accepted jobs, their progress and results live (a restart resumes them)")
    g.add_argument("--max-queued-jobs", type=int, default=64, metavar="N",
                   help="jobs queued or running at once; a submit beyond gets 429")
    g.add_argument("--max-running-jobs", type=int, default=4, metavar="N",
                   help="jobs parsed at once (each its own pipeline on the shared renderer, layout model and "
                        "engine: their pages interleave), within --job-pages-in-flight pages in all")
    g.add_argument("--job-pages-in-flight", type=int, default=None, metavar="N",
                   help="pages in flight across every running job, which bounds host memory and the engine's "
                        "queue (default: 4 x --max-pages-in-flight); each job also keeps within --max-pages-in-flight")
    g.add_argument("--max-upload-bytes", type=int, default=200 << 20, metavar="N",
                   help="largest document accepted (upload or fileUrl), in bytes")
    g.add_argument("--job-ttl", type=float, default=86400.0, metavar="S",
                   help="a finished job (its result files with it) is removed S seconds after it ends")
    g.add_argument("--job-priority", type=int, default=100, metavar="N",
                   help="added to every parsing block's engine priority: chat (priority 0) runs first; 0 = equal")
    add_parse_options(p)
