"""`fastdeploy-ext` command line: info, encode, bench.

The forms of DESIGN.md section 5 are a contract used by tests outside this repository: flags
keep their names and meaning; new flags may be added.
"""
from __future__ import annotations

import argparse
import json
import logging
import sys
import time

from .. import envs
from ..plan import DTYPES, GRID_SOURCES, QKV_LAYOUTS, SWITCHES, GraphOptimizationConfig, PlanError, PlanRequest

log = logging.getLogger("fastdeploy_ext")

DEVICES = ("auto", "cuda", "metax", "cpu_amx", "cpu")


class CliError(Exception):
    """An error meant for the user: printed as one line, exit status 2, no traceback."""


def setup_logging() -> None:
    level = str(envs.FD_LOG_LEVEL.get()).upper()
    logging.basicConfig(level=getattr(logging, level, logging.INFO), stream=sys.stderr,
                        format="[fastdeploy_ext] %(levelname)s %(message)s")


def add_plan_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("device and plan")
    g.add_argument("--device", default="auto", help=f"one of {', '.join(DEVICES)} or an installed vendor backend")
    g.add_argument("--dtype", default="auto", choices=DTYPES)
    g.add_argument("--attention-backend", default="auto",
                   help="force an attention backend of the device's capability row (see `info`)")
    g.add_argument("--qkv-layout", default="auto", choices=QKV_LAYOUTS)
    g.add_argument("--grid-thw", default="auto", choices=GRID_SOURCES,
                   help="where batch metadata is derived: host ints (no syncs) or device tensors (reference)")
    g.add_argument("--compile-layers", default="auto", choices=SWITCHES,
                   help="torch.compile the non-attention halves of each encoder layer")
    g.add_argument("--fused-layers", default="auto", choices=SWITCHES,
                   help="Triton residual+bias+LayerNorm and q/k rotary passes, GELU in the fc1 GEMM (CUDA)")
    g.add_argument("--graph-optimization-config", default=None,
                   help='JSON, e.g. \'{"use_cudagraph": true, "encoder_graph_paths": [{"name": "blocks", '
                        '"min_tokens": 512, "max_tokens": 4096, "max_image_tokens": 2048, "max_segments": 64}]}\'')


def add_model_args(p: argparse.ArgumentParser, required: bool = True) -> None:
    p.add_argument("--model", default=None, help="local model directory (config.json, *.safetensors)")
    p.add_argument("--load-format", default="auto", choices=("auto", "safetensors", "dummy"),
                   help="dummy: random weights from the built-in 0.9B config (no --model needed)")
    p.add_argument("--model-format", default="auto", choices=("auto", "torch", "paddle"),
                   help="weight layout: torch Linear [out, in] or Paddle [in, out]; auto decides from shapes")


def request_from_args(args, device: str | None = None) -> PlanRequest:
    try:
        gc = GraphOptimizationConfig.from_json(getattr(args, "graph_optimization_config", None))
    except ValueError as e:
        raise CliError(str(e)) from None
    return PlanRequest(device=device or args.device, dtype=args.dtype, attention_backend=args.attention_backend,
                       qkv_layout=args.qkv_layout, grid_thw=args.grid_thw, compile_layers=args.compile_layers,
                       fused_layers=args.fused_layers, graph_config=gc)


def check_model_args(args) -> None:
    if args.load_format == "dummy":
        if args.model:
            log.info("--load-format dummy: ignoring --model %s", args.model)
        args.model = None
    elif not args.model:
        raise CliError("--model DIR is required (or --load-format dummy for random weights)")


def build_runner(args, load: bool = True):
    from ..runner import create_runner
    request = request_from_args(args)
    try:
        runner = create_runner(request)
    except (PlanError, RuntimeError, ValueError) as e:
        raise CliError(str(e)) from None
    if load:
        from ..models.paddleocr_vl.loader import CheckpointError
        try:
            runner.load_model(args.model, load_format=args.load_format, model_format=args.model_format)
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
def cmd_info(args) -> int:
    from ..platforms import onednn_amx_evidence
    from ..runner import available_backends
    backends = available_backends()
    print("fastdeploy_ext info")
    print("backends:", ", ".join(sorted(backends)))
    print("environment:", ", ".join(f"{v.name}={v.get()}" for v in envs.ALL))
    print("probes:")
    for name, cls in sorted(backends.items()):
        print(f"  {name:<8} {cls.probe().summary()}")
    if args.device in ("auto", "cpu_amx", "cpu"):
        ev = onednn_amx_evidence()
        print(f"oneDNN AMX evidence: amx_used={ev.amx_used} isa={ev.isa!r} kernels={ev.kernels} ({ev.reason})")
    from ..runner import create_runner
    try:
        runner = create_runner(request_from_args(args))
    except (PlanError, RuntimeError, ValueError) as e:
        raise CliError(str(e)) from None
    print(runner.describe())
    if args.json:
        print(json.dumps({"probe": runner.probe_result.to_dict(), "plan": runner.plan.to_dict()}, default=str))
    return 0


# ------------------------------------------------------------------------ encode
def cmd_encode(args) -> int:
    import torch
    from safetensors.torch import save_file

    from ..models.paddleocr_vl.metadata import BatchError
    from ..models.paddleocr_vl.processor import ImageInputError, ImageProcessor, PreprocessorConfig
    from ..runner import ImageBatch

    check_model_args(args)
    try:
        pcfg = PreprocessorConfig.from_model_dir(args.model) if args.model else PreprocessorConfig()
    except ValueError as e:
        raise CliError(str(e)) from None
    processor = ImageProcessor(pcfg)
    try:   # images first: a bad file fails fast, before the model is loaded
        images = [processor.preprocess(p) for p in args.image]
    except ImageInputError as e:
        raise CliError(str(e)) from None
    runner = build_runner(args)
    t0 = time.perf_counter()
    try:
        feats = runner.encode_images(ImageBatch.from_images(images))
    except BatchError as e:
        raise CliError(str(e)) from None
    grid = torch.tensor([im.grid_thw for im in images], dtype=torch.int64)
    tensors = {f"image_{i}": f.detach().cpu().contiguous() for i, f in enumerate(feats)}
    tensors["grid_thw"] = grid
    save_file(tensors, args.output, metadata={"device": runner.plan.device, "row": runner.plan.row,
                                              "dtype": runner.plan.dtype.value,
                                              "emulated": str(runner.plan.emulated).lower()})
    dt = time.perf_counter() - t0
    shapes = ", ".join(f"image_{i} {list(f.shape)}" for i, f in enumerate(feats))
    print(f"wrote {args.output}: {shapes}; grid_thw {grid.tolist()} ({dt * 1000:.1f} ms)")
    return 0


# ------------------------------------------------------------------------- bench
def cmd_bench(args) -> int:
    if args.bench_target == "vision":
        from ..bench.vision import run_vision_bench
        return run_vision_bench(args)
    raise CliError(f"unknown bench target {args.bench_target!r}")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="fastdeploy-ext", description="Fast OCR VLM inference (PaddleOCR-VL)")
    sub = p.add_subparsers(dest="command", required=True)

    info = sub.add_parser("info", help="print device probes and the run plan with reasons")
    add_plan_args(info)
    info.add_argument("--json", action="store_true", help="also print probe and plan as JSON")
    info.set_defaults(func=cmd_info)

    enc = sub.add_parser("encode", help="vision encoder + projector features of images, to safetensors")
    add_model_args(enc)
    enc.add_argument("--image", action="append", required=True, help="image file (repeat for a batch)")
    enc.add_argument("--output", required=True, help="output .safetensors (image_0.., grid_thw)")
    add_plan_args(enc)
    enc.set_defaults(func=cmd_encode)

    bench = sub.add_parser("bench", help="benchmarks: ours vs the transformers reference, as ratios")
    bsub = bench.add_subparsers(dest="bench_target", required=True)
    bv = bsub.add_parser("vision", help="vision encoder + projector on the anchor workloads")
    add_model_args(bv)
    add_plan_args(bv)
    bv.add_argument("--workloads", default="page,blocks16,block8x40,small64",
                    help="comma list of page, blocks16, block8x40, small64")
    bv.add_argument("--variants", default="all", help="comma list of plan variants or 'all'")
    bv.add_argument("--iters", type=int, default=10)
    bv.add_argument("--warmup", type=int, default=3)
    bv.add_argument("--no-reference", action="store_true", help="skip the transformers reference")
    bv.add_argument("--json-out", default=None, help="write results as JSON here")
    bv.add_argument("--profile", type=int, default=0, metavar="TOP",
                    help="also profile one call per workload and print the TOP most expensive kernels")
    bv.set_defaults(func=cmd_bench)
    from ..bench import attention as attention_bench
    from ..bench import layer_ops
    ba = bsub.add_parser("attention", help="varlen attention kernels alone, per layer (CUDA)")
    attention_bench.add_arguments(ba)
    ba.set_defaults(func=attention_bench.run_cli)
    bl = bsub.add_parser("layers", help="non-attention ops of a layer: ATen vs the fused path (CUDA)")
    layer_ops.add_arguments(bl)
    bl.set_defaults(func=layer_ops.run_cli)
    return p


def main(argv: list[str] | None = None) -> int:
    setup_logging()
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except CliError as e:
        print(f"fastdeploy-ext {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
