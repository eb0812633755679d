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


def add_server_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("HTTP server")
    g.add_argument("--host", default="0.0.0.0", help="address to listen on")
    g.add_argument("--port", type=_port, default=8000, help="port of the OpenAI API (0: any free port)")
    g.add_argument("--metrics-port", type=_port, default=None,
                   help="also serve /metrics on this port (it is always on the main port too)")
    g.add_argument("--served-model-name", nargs="+", default=None,
                   help="model name(s) clients may send as `model`, the first one answered back and listed "
                        "first (default: the --model path and its directory name, or 'dummy')")
    g.add_argument("--api-key", default=None, help="require `Authorization: Bearer KEY` on /v1/*")
    g.add_argument("--request-timeout", type=_positive(float), default=600.0,
                   help="seconds a chat request may take; past it the request is aborted and answered 504")
    g.add_argument("--allowed-local-media-path", default=None,
                   help="directory from which image parts may name local files (path or file://); off by default")
    g.add_argument("--max-concurrency", type=_positive(int), default=512,
                   help="chat requests in flight (running + waiting); beyond it new ones get 429")
    g.add_argument("--max-request-body-bytes", type=_positive(int), default=DEFAULT_MAX_BODY_BYTES,
                   help="request bodies and fetched images above this many bytes get 413 / 400")
    g.add_argument("--media-fetch-timeout", type=_positive(float), default=10.0,
                   help="seconds to fetch one http(s) image URL")
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
    return ServerConfig(host=ns.host, port=ns.port, metrics_port=ns.metrics_port,
                        served_model_names=tuple(dict.fromkeys(ns.served_model_name or default_model_names)),
                        api_key=ns.api_key, request_timeout=ns.request_timeout,
                        allowed_local_media_path=media_root, max_concurrency=ns.max_concurrency,
                        max_body_bytes=ns.max_request_body_bytes, media_fetch_timeout=ns.media_fetch_timeout,
                        repetition_guard=ns.repetition_guard, log_level=ns.uvicorn_log_level,
                        log_stats_interval=ns.log_stats_interval)


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
            continue
        values = value if isinstance(value, list) and action.nargs in ("+", "*") else [value]
        tokens.append(flag)
        for v in values:
            tokens.append(json.dumps(v) if isinstance(v, (dict, list)) else
                          ("true" if v is True else "false" if v is False else str(v)))
    log.info("--config %s: %s", path, " ".join(tokens))
    return tokens + rest
