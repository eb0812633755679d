"""`fastdeploy-ext` command line: info, encode, detect, bench (the shared flags live in args.py).

The forms of DESIGN.md section 5 are a contract used by tests outside this repository: flags
keep their names and meaning; new flags may be added.
"""
from __future__ import annotations

import json
import logging
import os
import sys
import time

from .. import __version__, envs
from ..plan import PlanError
from ..runner import ModelSource
from ..bench import BenchError
from .args import (CliError, add_engine_args, add_model_args, add_runner_args, command_parser,
                   engine_config_from_args, model_source_from_args, plan_request_from_args, root_parser,
                   setup_logging)

log = logging.getLogger("fastdeploy_ext")


def build_runner(args, source: ModelSource | None = None):
    """The runner the flags ask for, with ``source``'s weights loaded and graphs captured."""
    from ..runner import create_runner
    request = plan_request_from_args(args)
    try:
        runner = create_runner(request)
    except (PlanError, RuntimeError, ValueError) as e:
        raise CliError(str(e)) from None
    if source is not None:
        from ..models.interface import CheckpointError
        try:
            source.load_into(runner)
        except (CheckpointError, FileNotFoundError, ValueError) as e:
            raise CliError(str(e)) from None
        report = runner.capture_graphs()
        if report.captured:
            log.info("captured %d encoder graphs %s in %.1fs, graph memory %.1f MiB", report.captured, report.paths,
                     report.capture_seconds, report.graph_memory_bytes / 2**20)
        elif report.reason:
            log.info("encoder graphs: none (%s)", report.reason)
    for line in runner.describe().splitlines():
        log.info("%s", line)
    return runner


# -------------------------------------------------------------------------- info
def _info_model(args) -> tuple[object, object, dict]:
    """The family and config `info` resolves the plan for: --model DIR's config.json (no weight
    is read), --model-family NAME's built-in config, or the default family's (also for
    --load-format dummy); with what was read, for the report."""
    from ..models.interface import CheckpointError
    from ..models.registry import detect_family
    model_dir = None if args.load_format == "dummy" else args.model
    if args.load_format == "dummy" and args.model:
        log.info("--load-format dummy: ignoring --model %s", args.model)
    try:
        choice = detect_family(model_dir, args.model_family)
        cfg = choice.family.read_config(model_dir) if model_dir else choice.family.default_config()
    except (CheckpointError, FileNotFoundError, ValueError) as e:
        raise CliError(str(e)) from None
    return choice.family, cfg, {"family": choice.family.name, "reason": choice.reason,
                                "config": f"{model_dir}/config.json" if model_dir else "built-in"}


def cmd_info(args) -> int:
    """The text report, or with --json one JSON object only (backends, environment, capability
    rows, probes, the model the plan is for, the plan per component): a script reads stdout with
    json.loads. The plan is resolved for --model DIR's config (only config.json is read) or a
    family's built-in config; without them, the default family's."""
    from ..runner import available_backends
    backends = available_backends()
    from ..capabilities import capability_table
    try:
        table = capability_table(args.capabilities)
    except PlanError as e:
        raise CliError(str(e)) from None
    if args.model and args.load_format != "dummy" and not os.path.isdir(args.model):
        raise CliError(f"--model {args.model}: not a directory (a model directory with config.json)")
    family, cfg, model = _info_model(args)
    from ..runner import create_runner
    try:
        runner = create_runner(plan_request_from_args(args))
        plan_for_model = getattr(runner, "plan_for_model", None)
        if plan_for_model is None:
            raise CliError(f"backend {runner.name} cannot resolve its plan for a model before loading it")
        plan = plan_for_model(family, cfg)
    except (PlanError, RuntimeError, ValueError) as e:
        raise CliError(str(e)) from None
    if args.json:
        print(json.dumps({"version": __version__, "backends": sorted(backends),
                          "environment": {v.name: v.get() for v in envs.ALL},
                          "capability_rows": {name: {"runner": row.runner, "source": str(row.source)}
                                              for name, row in table.items()},
                          "probes": {name: cls.probe().summary() for name, cls in sorted(backends.items())},
                          "probe": runner.probe_result.to_dict(), "model": model, "plan": plan.to_dict()},
                         default=str))
        return 0
    print("fastdeploy_ext info")
    print("backends:", ", ".join(sorted(backends)))
    print("environment:", ", ".join(f"{v.name}={v.get()}" for v in envs.ALL))
    print("capability rows:")
    for name, row in table.items():
        print(f"  {name:<12} runner={row.runner:<8} from {row.source}")
    print("probes:")
    for name, cls in sorted(backends.items()):
        print(f"  {name:<8} {cls.probe().summary()}")
    print(f"model: {model['family']} family ({model['reason']}), config {model['config']}")
    print(runner.describe())
    return 0


# ------------------------------------------------------------------------ encode
def cmd_encode(args) -> int:
    from safetensors.torch import save_file

    from ..inputs.images import ImageInputError, resolve_source
    from ..models.interface import BatchError, FamilyRole, require_role
    from ..models.registry import detect_family
    from ..runner import ImageBatch

    source = model_source_from_args(args)
    try:   # the family the runner will load (the same detection), for its host-side processor
        family = detect_family(source.model_dir, source.model_family).family
        require_role(family, FamilyRole.VLM, "encode")
        processor = family.image_processor(source.model_dir)
    except (FileNotFoundError, ValueError) as e:
        raise CliError(str(e)) from None
    try:   # images first: a bad file fails fast, before the model is loaded
        # a path, a file:// path or a data: URL (fastdeploy_ext/inputs), named by its path
        labels = [source_label(p) for p in args.image]
        images = [processor.preprocess(resolve_source(p, lb), lb) for p, lb in zip(args.image, labels)]
    except ImageInputError as e:
        raise CliError(str(e)) from None
    runner = build_runner(args, source)
    t0 = time.perf_counter()
    try:
        feats = runner.encode_images(ImageBatch.from_images(images))
    except BatchError as e:
        raise CliError(str(e)) from None
    # the family's per-image metadata: grid_thw [n, 3] (PaddleOCR-VL), num_crops [n] (DeepSeek-OCR-2)
    extra = runner.family.encode_outputs(runner.cfg, [tuple(im.grid_thw) for im in images])
    tensors = {f"image_{i}": f.detach().cpu().contiguous() for i, f in enumerate(feats)}
    tensors.update(extra)
    save_file(tensors, args.output, metadata={"device": runner.plan.device, "row": runner.plan.row,
                                              "dtype": runner.plan.dtype.value,
                                              "emulated": str(runner.plan.emulated).lower()})
    dt = time.perf_counter() - t0
    shapes = ", ".join(f"image_{i} {list(f.shape)}" for i, f in enumerate(feats))
    meta = "; ".join(f"{k} {v.tolist()}" for k, v in extra.items())
    print(f"wrote {args.output}: {shapes}; {meta} ({dt * 1000:.1f} ms)")
    return 0


# ------------------------------------------------------------------------- bench
def cmd_bench_vision(args) -> int:
    from ..bench import vision
    if not args.no_reference:
        import transformers  # noqa: F401 - the reference's package, missing -> one line before any loading
    try:
        return vision.run_vision_bench(model_source_from_args(args, default_dummy=True), plan_request_from_args(args),
                                       vision.options_from_args(args))
    except RuntimeError as e:   # --device absent
        raise CliError(str(e)) from None


# ---------------------------------------------------------------------- generate
def cmd_generate(args) -> int:
    """One request per image (the prompt in the model's chat template); --json prints one JSON
    object per image: source (the path), text, token_ids (generated only), prompt_token_ids."""
    from ..engine.errors import InvalidRequest
    from ..engine.sampling_params import SamplingParams
    from .llm import LLM
    images = expand_image_args(args.image)      # before the model loads: a bad pattern fails fast
    source = model_source_from_args(args)
    config = engine_config_from_args(args, source, plan_request_from_args(args))
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                            top_k=args.top_k, seed=args.seed, repetition_penalty=args.repetition_penalty,
                            ignore_eos=args.ignore_eos)
    try:
        params.validate()
    except InvalidRequest as e:
        raise CliError(str(e)) from None
    try:
        llm = LLM.from_config(config)
    except (PlanError, RuntimeError, ValueError) as e:
        raise CliError(str(e)) from None
    reqs = [{"prompt": args.prompt, "images": [path]} for path in images]
    try:
        outs = llm.generate(reqs, params, use_tqdm=True)      # the progress bar is on stderr
    except InvalidRequest as e:
        raise CliError(str(e)) from None
    finally:
        llm.shutdown()
    failed = 0
    for path, out in zip(images, outs):
        o = out.outputs[0]
        if o.finish_reason == "error":      # this image alone failed in the engine; the others are printed
            failed += 1
            print(f"fastdeploy-ext generate: error: {source_label(path)}: {out.error}", file=sys.stderr)
            continue
        if args.json:
            print(json.dumps({"source": source_label(path), "text": o.text,
                              "token_ids": o.token_ids, "prompt_token_ids": out.prompt_token_ids}), flush=True)
        else:
            print(o.text, flush=True)
        log.info("%s: %d prompt + %d generated tokens, finish_reason %s", source_label(path),
                 len(out.prompt_token_ids), len(o.token_ids), o.finish_reason)
    return 1 if failed else 0


def source_label(value: str) -> str:
    """How an --image value is named in output: its path, or `<data URL>` (whatever its case)
    rather than megabytes of base64."""
    from ..inputs.sources import DATA, parse_source
    return "<data URL>" if parse_source(value).scheme == DATA else value


def cmd_bench_generate(args) -> int:
    from ..bench import generate as generate_bench
    from ..runner import choose_device
    source = model_source_from_args(args, default_dummy=True)
    config = engine_config_from_args(args, source, plan_request_from_args(args))
    try:
        # the host backends get the bench's smaller default workloads (a 1080p page takes minutes there)
        backend = args.device if args.device != "auto" else choose_device("auto")[0].name
        on_cpu = backend in ("cpu", "cpu_amx")
        opts = generate_bench.options_from_args(args, on_cpu)
        return generate_bench.run_cli(config, opts)
    except (PlanError, RuntimeError, ValueError) as e:
        raise CliError(str(e)) from None


# ------------------------------------------------------------------------ detect
def cmd_detect(args) -> int:
    """Layout detections per image: label, score, bbox in the image's pixels, in reading order."""
    from ..inputs.images import ImageInputError, resolve_source
    from ..models.interface import CheckpointError
    from .detector import Detector
    source = model_source_from_args(args)
    paths = expand_image_args(args.image)
    try:
        detector = Detector(source.model_dir, load_format=source.load_format, model_family=source.model_family,
                            threshold=args.threshold, request=plan_request_from_args(args))
    except (CheckpointError, PlanError, FileNotFoundError, RuntimeError, ValueError) as e:
        raise CliError(str(e)) from None
    for line in detector.runner.describe().splitlines():
        log.info("%s", line)
    labels = [source_label(p) for p in paths]
    t0 = time.perf_counter()
    try:
        results = detector.detect([resolve_source(p, lb) for p, lb in zip(paths, labels)])
    except (ImageInputError, ValueError) as e:
        raise CliError(str(e)) from None
    log.info("detected %d pages in %.1f ms", len(paths), (time.perf_counter() - t0) * 1000)
    for label, dets in zip(labels, results):
        if args.json:
            print(json.dumps({"image": label, "detections": [d.to_json() for d in dets]}))
        else:
            print(f"{label}: {len(dets)} detections")
            for d in dets:
                print(f"  {d.label:<18} {d.score:.3f} [{', '.join(f'{v:.1f}' for v in d.bbox)}]")
    return 0


# ------------------------------------------------------------------------- parse
def add_parse_subcommands(sub) -> None:
    """`parse` and `parse-status` (entrypoints/parse_cmd.py)."""
    from .parse_cmd import add_parse_commands
    add_parse_commands(sub, command_parser)


def add_bench_parse_subcommand(bsub) -> None:
    """`bench parse`: ours vs the PaddleX-style page-group pipeline on one engine (bench/parse.py)."""
    from ..bench import parse as parse_bench
    from .parse_cmd import add_parse_options
    bp = command_parser(bsub, "parse", "document parsing pages/s: our pipeline vs PaddleX's page groups "
                                       "(synthetic planted-layout PDFs, or --pdf DIR)")
    add_model_args(bp)
    add_parse_options(bp)
    add_runner_args(bp, model=False)
    add_engine_args(bp)
    parse_bench.add_arguments(bp)
    bp.set_defaults(func=cmd_bench_parse)


def cmd_bench_parse(args) -> int:
    from ..bench import parse as parse_bench
    from .parse_cmd import parse_options_from_args
    opts = parse_options_from_args(args, output=None, default_dummy=True)
    try:
        return parse_bench.run_cli(opts, parse_bench.options_from_args(args))
    except (PlanError, RuntimeError, ValueError) as e:
        raise CliError(str(e)) from None


def build_parser():
    p = root_parser("fastdeploy-ext", "Fast OCR VLM inference (PaddleOCR-VL)")
    p.add_argument("--version", action="version", version=f"fastdeploy-ext {__version__}")
    sub = p.add_subparsers(dest="command", required=True)

    info = command_parser(sub, "info", "print device probes and the run plan with reasons (per model component: "
                                       "--model DIR reads only its config.json)")
    add_model_args(info)
    add_runner_args(info, model=False)
    info.add_argument("--json", action="store_true", help="print one JSON object only (probes, rows, plan)")
    info.set_defaults(func=cmd_info)

    enc = command_parser(sub, "encode", "vision encoder + projector features of images, to safetensors")
    add_model_args(enc)
    enc.add_argument("--image", action="append", required=True, help="image file (repeat for a batch)")
    enc.add_argument("--output", required=True, help="output .safetensors (image_0.., grid_thw)")
    add_runner_args(enc, model=False)
    enc.set_defaults(func=cmd_encode)

    gen = command_parser(sub, "generate", "OCR text of images (one request per --image)")
    add_model_args(gen)
    gen.add_argument("--image", action="extend", nargs="+", required=True, metavar="PATH",
                     help="image files, globs ('scans/*.png') and directories (their images, sorted); "
                          "several after one --image or --image repeated; one request each, in order")
    gen.add_argument("--prompt", required=True, help='the task text, e.g. "OCR:", "Table Recognition:"')
    gen.add_argument("--max-tokens", type=int, default=None, help="default: --max-model-len minus the prompt")
    gen.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--repetition-penalty", type=float, default=1.0)
    gen.add_argument("--ignore-eos", action="store_true", help="run to --max-tokens (benchmarks)")
    gen.add_argument("--json", action="store_true", help="one JSON object per image: source, text, token_ids, prompt_token_ids")
    add_runner_args(gen, model=False)
    add_engine_args(gen)
    gen.set_defaults(func=cmd_generate)

    det = command_parser(sub, "detect", "layout detection (PP-DocLayoutV3): per image its boxes with label and "
                                        "score, in reading order")
    add_model_args(det)
    det.add_argument("--image", action="extend", nargs="+", required=True, metavar="PATH",
                     help="image files, globs and directories (their images, sorted)")
    det.add_argument("--threshold", type=float, default=0.5,
                     help="score threshold (default 0.5, transformers'; PaddleX's PaddleOCR-VL-1.5 pipeline uses 0.3)")
    det.add_argument("--json", action="store_true",
                     help='one JSON object per image: {"image", "detections": [{"label", "score", "bbox"}]}')
    add_runner_args(det, model=False)
    det.set_defaults(func=cmd_detect)

    add_parse_subcommands(sub)

    bench = command_parser(sub, "bench", "benchmarks: ours vs the transformers reference, as ratios")
    bsub = bench.add_subparsers(dest="bench_target", required=True)
    from ..bench import attention as attention_bench
    from ..bench import layer_ops, vision
    bv = command_parser(bsub, "vision", "vision encoder + projector on the anchor workloads")
    add_runner_args(bv)
    vision.add_arguments(bv)
    bv.set_defaults(func=cmd_bench_vision)
    ba = command_parser(bsub, "attention", "varlen attention kernels alone, per layer (CUDA)")
    attention_bench.add_arguments(ba)
    ba.set_defaults(func=attention_bench.run_cli)
    bl = command_parser(bsub, "layers", "non-attention ops of a layer: ATen vs the fused path (CUDA)")
    layer_ops.add_arguments(bl)
    bl.set_defaults(func=layer_ops.run_cli)
    bg = command_parser(bsub, "generate", "end to end: page1 (TTFT, decode tok/s), pages64, lines256, lines512 vs transformers; blocks (layout crops, ours only)")
    add_runner_args(bg)
    add_engine_args(bg)
    from ..bench import generate as generate_bench
    generate_bench.add_arguments(bg)
    bg.set_defaults(func=cmd_bench_generate)
    from ..bench import preprocess as preprocess_bench
    bp = command_parser(bsub, "preprocess", "image preprocessing images/s at 1 and N workers vs transformers")
    preprocess_bench.add_arguments(bp)
    bp.set_defaults(func=preprocess_bench.run_cli)
    from ..bench import serve as serve_bench
    bs = command_parser(bsub, "serve", "the OpenAI server under load (single, 4x8, 32 concurrent) vs transformers "
                                       "generate behind the same request stream")
    serve_bench.add_arguments(bs)
    bs.set_defaults(func=serve_bench.run_cli)
    from ..bench import gemm as gemm_bench
    bg = command_parser(bsub, "gemm", "GEMM ceiling on the encoder's shapes vs the encoder's own GEMM rate")
    gemm_bench.add_arguments(bg)
    bg.set_defaults(func=gemm_bench.run_cli)
    from ..bench import detect as detect_bench
    bd = command_parser(bsub, "detect", "layout detector (PP-DocLayoutV3) ms per batch and pages/s at batch 1, 8, "
                                        "32 vs transformers, same weights and pixels")
    detect_bench.add_arguments(bd)
    bd.set_defaults(func=detect_bench.run_cli)
    add_bench_parse_subcommand(bsub)

    # listed here for --help; main() hands `serve` to the api_server module (one code path,
    # which also expands --config FILE.yaml before parsing)
    from .openai.cli_args import add_serve_arguments
    srv = command_parser(sub, "serve", "OpenAI-compatible server (FastDeploy-style flags; "
                                       "same as python -m fastdeploy_ext.entrypoints.openai.api_server)")
    add_serve_arguments(srv)
    return p


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["serve"]:
        try:
            from .openai.api_server import main as serve_main
        except ModuleNotFoundError as e:
            return _missing_extra("serve", e)
        return serve_main(argv[1:], prog="fastdeploy-ext serve")
    setup_logging()
    parser = build_parser()
    args = parser.parse_args(argv)
    command = args.command + (f" {args.bench_target}" if args.command == "bench" else "")
    try:
        from ..runner import emulated_backends
        try:
            emulation = emulated_backends(envs.FD_EMULATE.get())
        except ValueError as e:
            raise CliError(str(e)) from None
        with emulation:     # FD_EMULATE=metax: the backend's own fakes, for this command only
            return args.func(args)
    except (CliError, BenchError) as e:
        print(f"fastdeploy-ext {command}: error: {e}", file=sys.stderr)
        return 2
    except ModuleNotFoundError as e:
        return _missing_extra(command, e)
    except BrokenPipeError:
        return _reader_gone()


#: the exit status of a process that SIGPIPE ended (128 + 13), as a Unix tool reports it
EXIT_BROKEN_PIPE = 141


def _reader_gone() -> int:
    """Whoever read our output went away (``fastdeploy-ext info | head``): stop without a
    traceback, and point stdout at /dev/null so the interpreter's final flush does not fail
    again on the closed pipe."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError, AttributeError):   # no real descriptor behind sys.stdout
        pass
    return EXIT_BROKEN_PIPE


# the extra of setup.py that installs a module a command imports on first use
EXTRA_OF_MODULE = {"fastapi": "serve", "uvicorn": "serve", "starlette": "serve", "prometheus_client": "serve",
                   "httpx": "serve", "anyio": "serve", "transformers": "test", "openai": "test",
                   "paddle": "paddle", "triton": "cuda"}


def _missing_extra(command: str, e: ModuleNotFoundError) -> int:
    """A module of an optional extra is not installed: one line naming the extra, exit status 2.
    Any other missing module is a bug or a broken install: its traceback is kept."""
    top = (e.name or "").split(".")[0]
    extra = EXTRA_OF_MODULE.get(top)
    if extra is None:
        raise e
    hint = " (or --no-reference: ours only)" if top == "transformers" and command.startswith("bench") else ""
    print(f"fastdeploy-ext {command}: error: needs the [{extra}] extra ({top} is not installed): "
          f"pip install 'fastdeploy_ext[{extra}]'{hint}", file=sys.stderr)
    return 2


def expand_image_args(items: list[str]) -> list[str]:
    """--image values -> image paths, in the order given: a file as is, a directory's image
    files sorted by name, a glob's matches sorted; data: URLs pass through. A glob that
    matches nothing or a directory without images is a CliError (a typo must not silently run
    on nothing); a missing plain path is left to the image loader, which names it."""
    import glob
    import os

    from ..inputs.sources import DATA, FILE, parse_source
    out: list[str] = []
    for item in items:
        if parse_source(item).scheme in (DATA, FILE) or os.path.isfile(item):
            out.append(item)        # an existing file is itself even if its name has glob characters
        elif os.path.isdir(item):
            found = sorted(os.path.join(item, n) for n in os.listdir(item)
                           if n.lower().endswith(IMAGE_SUFFIXES) and os.path.isfile(os.path.join(item, n)))
            if not found:
                raise CliError(f"--image {item}: directory has no image files ({', '.join(IMAGE_SUFFIXES)})")
            out.extend(found)
        elif glob.has_magic(item):
            found = sorted(p for p in glob.glob(item, recursive=True) if os.path.isfile(p))
            if not found:
                raise CliError(f"--image {item}: the pattern matches no file")
            out.extend(found)
        else:
            out.append(item)
    return out


IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".bmp", ".gif", ".tif", ".tiff", ".webp")


if __name__ == "__main__":
    sys.exit(main())
