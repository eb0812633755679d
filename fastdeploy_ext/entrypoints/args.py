"""The command line's shared flags, defined once for every subcommand (info, encode, bench,
generate, serve) and turned into typed values in one place.

The pattern, for whoever adds a concern (the engine's scheduler flags, the server's host/port):

* ``add_<concern>_args(parser) -> argument group``: defines that concern's flags, nothing else;
* ``<concern>_from_args(ns) -> typed dataclass``: validates and converts them, raising
  :class:`CliError` (one line, exit status 2) for a bad value;
* a subcommand's parser comes from :func:`command_parser`; it calls the ``add_*`` functions it needs, then the matching ``*_from_args``;
  nothing below ``entrypoints/`` reads an argparse namespace (benchmarks, the engine and the
  server take the dataclasses).

The flags of DESIGN.md section 5 keep their names and meaning (tests outside this repository
rely on them); more flags may be added. Unknown flags are argparse usage errors (exit status 2).
"""
from __future__ import annotations

import argparse
import logging
import os
import sys

from .. import envs
from ..engine.config import PREPROCESS_DEVICES
from ..plan import DTYPES, GRID_SOURCES, QKV_LAYOUTS, SWITCHES, GraphOptimizationConfig, PlanRequest
from ..runner import LOAD_FORMATS, MODEL_FORMATS, ModelSource

log = logging.getLogger("fastdeploy_ext")

DEVICES = ("auto", "cuda", "metax", "cpu_amx", "cpu")

Group = argparse._ArgumentGroup   # what parser.add_argument_group returns (argparse has no public name)


class CliError(Exception):
    """An error meant for the user: printed as one line, exit status 2, no traceback."""


# ------------------------------------------------------------------ parsers
LOG_FORMAT = "%(asctime)s.%(msecs)03d [fastdeploy_ext] %(levelname)s %(message)s"
LOG_DATEFMT = "%Y-%m-%d %H:%M:%S"


class _StderrHandler(logging.StreamHandler):
    """Writes to whatever sys.stderr is at the time of each record (tests swap it)."""

    def __init__(self):
        super().__init__()

    @property
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, _value):
        pass


def setup_logging(log_file: str | None = None) -> None:
    """FD_LOG_LEVEL to stderr, one timestamped format for every command (fastdeploy-ext, the
    server), as logging.basicConfig would (nothing is added where the root logger already has
    handlers, e.g. under pytest). ``log_file`` (the server's --log-file) also appends every line
    to that file; the server calls this a second time, after parsing its flags, for it."""
    fmt = logging.Formatter(LOG_FORMAT, LOG_DATEFMT)
    root = logging.getLogger()
    if not root.handlers:
        h = _StderrHandler()
        h.setFormatter(fmt)
        root.addHandler(h)
        root.setLevel(getattr(logging, str(envs.FD_LOG_LEVEL.get()).upper(), logging.INFO))
    if log_file:
        try:
            fh = logging.FileHandler(log_file, encoding="utf-8")
        except OSError as e:
            raise CliError(f"--log-file {log_file}: {e.strerror or e}") from None
        fh.setFormatter(fmt)
        root.addHandler(fh)


def root_parser(prog: str, description: str) -> argparse.ArgumentParser:
    return argparse.ArgumentParser(prog=prog, description=description, allow_abbrev=False)


def command_parser(subparsers, name: str, help: str) -> argparse.ArgumentParser:
    """A subcommand's parser. Flags must be spelled in full (no prefix matching): adding a flag
    later never changes what an existing command line means, and a misspelt or removed flag is
    an error (exit status 2) instead of silently matching another."""
    return subparsers.add_parser(name, help=help, allow_abbrev=False)


# ------------------------------------------------------------------ model source
def add_model_args(p: argparse.ArgumentParser) -> Group:
    g = p.add_argument_group("model")
    g.add_argument("--model", default=None, help="local model directory (config.json, *.safetensors)")
    g.add_argument("--load-format", default="auto", choices=LOAD_FORMATS,
                   help="dummy: random weights from the built-in 0.9B config (no --model needed)")
    g.add_argument("--model-format", default="auto", choices=MODEL_FORMATS,
                   help="weight layout: torch Linear [out, in] or Paddle [in, out]; auto decides from shapes")
    g.add_argument("--model-family", default=None, metavar="NAME",
                   help="the model family (e.g. paddleocr_vl); default: the one config.json's model_type names, "
                        "or the default family for --load-format dummy")
    return g


def model_source_from_args(ns: argparse.Namespace, *, default_dummy: bool = False) -> ModelSource:
    """--model / --load-format / --model-format. ``default_dummy``: no --model means random
    weights (benchmarks) instead of an error."""
    load_format = ns.load_format
    if default_dummy and not ns.model and load_format == "auto":
        load_format = "dummy"
    if load_format == "dummy":
        if ns.model:
            log.info("--load-format dummy: ignoring --model %s", ns.model)
        return ModelSource(None, "dummy", ns.model_format, getattr(ns, "model_family", None))
    if not ns.model:
        raise CliError("--model DIR is required (or --load-format dummy for random weights)")
    if not os.path.isdir(ns.model):
        # checked here, before anything is built or a server listens: one line, exit status 2
        what = "is a file, not a directory" if os.path.exists(ns.model) else "does not exist"
        raise CliError(f"--model {ns.model}: {what} (a local model directory with config.json and "
                       f"*.safetensors; or --load-format dummy for random weights)")
    return ModelSource(ns.model, load_format, ns.model_format, getattr(ns, "model_family", None))


# ------------------------------------------------------------------ device and plan
def add_device_args(p: argparse.ArgumentParser) -> Group:
    g = p.add_argument_group("device")
    g.add_argument("--device", default="auto", help=f"one of {', '.join(DEVICES)} or an installed vendor backend")
    g.add_argument("--dtype", default="auto", choices=DTYPES)
    return g


def add_plan_args(p: argparse.ArgumentParser) -> Group:
    """The run-plan overrides: every one defaults to `auto`, the capability row's choice."""
    g = p.add_argument_group("run plan (auto = the device's capability row decides; see `info`)")
    g.add_argument("--attention-backend", default="auto",
                   help="force an attention backend of the device's capability row (see `info`)")
    g.add_argument("--text-attention-backend", default="auto",
                   help="force a paged attention backend of the text decoder from the device's row (see `info`)")
    g.add_argument("--qkv-layout", default="auto", choices=QKV_LAYOUTS)
    g.add_argument("--grid-thw", default="auto", choices=GRID_SOURCES,
                   help="where batch metadata is derived: host ints (no syncs) or device tensors (reference)")
    g.add_argument("--fused-layers", default="auto", choices=SWITCHES,
                   help="Triton residual+bias+LayerNorm and q/k rotary passes, GELU in the fc1 GEMM (CUDA)")
    g.add_argument("--capabilities", default=None, metavar="FILE.yaml",
                   help="capability rows overriding the ones the backends ship (also FD_CAPABILITIES; "
                        "schema in fastdeploy_ext/capabilities.py)")
    g.add_argument("--graph-optimization-config", default=None,
                   help='JSON. Decoder graphs (FastDeploy keys): "use_cudagraph", "cudagraph_capture_sizes" '
                        '(decode batch sizes); encoder graphs: "use_encoder_cudagraph", "encoder_graph_paths", '
                        '"encoder_split_oversize_batches"; e.g. \'{"use_cudagraph": true, "cudagraph_capture_sizes": '
                        '[1, 8, 64], "use_encoder_cudagraph": true, "encoder_graph_paths": [{"name": "blocks", '
                        '"min_tokens": 512, "max_tokens": 4096, "max_image_tokens": 2048, "max_segments": 64}]}\'; DeepSeek-OCR-2 '
                        'takes view budgets per path: [{"name": "global", "budgets": [1, 2, 4, 8, 16]}, {"name": '
                        '"local", "budgets": [2, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96]}]')
    return g


def add_runner_args(p: argparse.ArgumentParser, *, model: bool = True) -> None:
    """The flags every command that builds a runner shares: model (optional), device, plan."""
    if model:
        add_model_args(p)
    add_device_args(p)
    add_plan_args(p)


def _requested_family(ns: argparse.Namespace) -> str | None:
    """--model-family, else the family of --model's config.json (None: the default family, or a
    directory the loader will report on)."""
    if getattr(ns, "model_family", None):
        return ns.model_family
    model = getattr(ns, "model", None)
    if not model:
        return None
    from ..models.registry import detect_family
    try:
        return detect_family(model).family.name
    except Exception:  # noqa: BLE001 - an unreadable or unknown config is load_model's error to report
        return None


def plan_request_from_args(ns: argparse.Namespace, device: str | None = None) -> PlanRequest:
    """--device, --dtype and the plan flags -> PlanRequest (validated: a bad value is a CliError)."""
    try:
        gc = GraphOptimizationConfig.from_json(ns.graph_optimization_config)
        request = PlanRequest(device=device or ns.device, dtype=ns.dtype, attention_backend=ns.attention_backend,
                              qkv_layout=ns.qkv_layout, grid_thw=ns.grid_thw,
                              fused_layers=ns.fused_layers, graph_config=gc, capabilities=ns.capabilities,
                              text_attention_backend=getattr(ns, "text_attention_backend", "auto"),
                              model_family=_requested_family(ns))
        request.validate()
    except ValueError as e:      # PlanError is a ValueError
        raise CliError(str(e)) from None
    return request


# ------------------------------------------------------------------ engine (scheduler, KV pool)
def add_engine_args(p: argparse.ArgumentParser) -> Group:
    """The generation engine's flags (FastDeploy/vLLM names)."""
    g = p.add_argument_group("engine (scheduler and KV cache; no prefix caching)")
    g.add_argument("--max-num-seqs", type=int, default=256, help="most requests running at once")
    g.add_argument("--max-num-batched-tokens", type=int, default=16384, help="tokens per step (prefill chunks, decode)")
    g.add_argument("--max-model-len", type=int, default=16384,
                   help="prompt + output tokens per request (an unset max_tokens means max-model-len - prompt)")
    g.add_argument("--limit-mm-per-prompt", default=None, help='JSON, e.g. \'{"image": 1}\' (the default)')
    g.add_argument("--max-encoder-patches", type=int, default=65536,
                   help="patches in one step's packed vision pass (~6 1080p pages)")
    g.add_argument("--encoder-cache-size", type=int, default=None, metavar="ROWS",
                   help="embedding rows of vision output kept from the vision pass to the last prefill chunk "
                        "that reads them; default max(--max-num-batched-tokens, --max-model-len)")
    g.add_argument("--gpu-memory-utilization", type=float, default=0.9,
                   help="share of device memory for weights, the profiled step peak and the KV pool")
    g.add_argument("--kv-cache-memory", default=None,
                   help="KV pool bytes on devices without a free-memory query (CPU), e.g. 2GiB; default 1GiB")
    g.add_argument("--step-timeout", type=float, default=300.0, metavar="S",
                   help="a step running longer than S seconds (the first, warm-up step not counted) marks the "
                        "engine stuck: the server's /health answers 503 and it exits 1 for a restart")
    g.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=None,
                   help="schedule and build step N+1 while the device runs step N (sampled ids feed the next "
                        "decode on the device; the host reads them one step late); off: every step waits for "
                        "its ids (default: the device's capability row: on for the CPU rows, off on the GPU "
                        "rows until verified there)")
    g.add_argument("--mixed-steps", action=argparse.BooleanOptionalAction, default=None,
                   help="running requests' decode rows ride in the steps that prefill new ones, so a newcomer's "
                        "vision pass does not stall their next token; off: such a step is a prefill only "
                        "(default: the device's capability row: on for the CPU rows, off on the GPU rows until "
                        "measured there)")
    g.add_argument("--preprocess-workers", type=int, default=4, metavar="N",
                   help="threads that decode and preprocess requests' images off the step loop")
    g.add_argument("--preprocess-device", choices=PREPROCESS_DEVICES, default="auto",
                   help="where image views are resized and cut: host (PIL), device (the runner's, for a model "
                        "whose processor can: DeepSeek-OCR-2; the same bytes, the host only decodes); auto: host")
    g.add_argument("--mixed-encoder-patches", type=int, default=None, metavar="N",
                   help="a mixed step's encoder budget (the running requests' tokens wait for its vision pass); "
                        "default min(16384, --max-encoder-patches)")
    return g


def engine_config_from_args(ns: argparse.Namespace, source: ModelSource, plan: PlanRequest):
    """The engine flags + model source + plan -> EngineConfig (a bad value is a CliError)."""
    from ..engine.config import EngineConfig, parse_bytes, parse_limit_mm
    try:
        cfg = EngineConfig(model=source.model_dir, load_format=source.load_format, model_format=source.model_format,
                           model_family=source.model_family, plan=plan, max_num_seqs=ns.max_num_seqs, max_num_batched_tokens=ns.max_num_batched_tokens,
                           max_model_len=ns.max_model_len, max_encoder_patches=ns.max_encoder_patches,
                           encoder_cache_size=getattr(ns, "encoder_cache_size", None),
                           limit_mm_per_prompt=parse_limit_mm(ns.limit_mm_per_prompt),
                           gpu_memory_utilization=ns.gpu_memory_utilization,
                           kv_cache_memory=parse_bytes(ns.kv_cache_memory),
                           step_timeout=getattr(ns, "step_timeout", 300.0),
                           async_scheduling=getattr(ns, "async_scheduling", None),
                           mixed_steps=getattr(ns, "mixed_steps", None),
                           mixed_encoder_patches=getattr(ns, "mixed_encoder_patches", None),
                           preprocess_workers=getattr(ns, "preprocess_workers", 4),
                           preprocess_device=getattr(ns, "preprocess_device", "auto"))
        cfg.validate()
    except (ValueError, TypeError) as e:
        raise CliError(str(e)) from None
    return cfg
