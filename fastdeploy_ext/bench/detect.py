"""`fastdeploy-ext bench detect`: our layout detector (PP-DocLayoutV3, or ``--model-family
pp_doclayout_v2``, on the runner's plan: kernels, graphs, dtype) against the family's
transformers model (``transformers_reference``) with the same weights on the same pixels, per batch size (default 1, 8 and 32), in one run: ms per batch and
pages/s side by side with the ratios.

Same outputs on both sides: transformers' forward always computes the mask outputs (of every
decoder layer; it has no switch to skip them), so the comparison runs ours with masks on as
well (the model's returned ``out_masks``; its graphs are captured that way); a family without a
mask head (PP-DocLayoutV2: neither side computes masks) runs with them off. ``--masks off``
times ours as parsing runs it (no masks) and says so in the table: the reference still computes
them, so that ratio compares different outputs.

Weights: ``--model DIR`` (both load the checkpoint) or ``--load-format dummy`` (the full default
config, our random weights copied into the reference by name). Pixels: seeded random pages at
the processor's fixed size. Before timing, both detect on the smallest batch and the detections
are compared (`same_detections`: labels and reading order equal, scores within 1e-3; exit status
1 when they differ in fp32). Nothing here asserts a time."""
from __future__ import annotations

import json
import logging
from dataclasses import dataclass

import torch

from . import BenchError
from .timing import median_ms

log = logging.getLogger(__name__)

DEFAULT_BATCH_SIZES = (1, 8, 32)
COLUMNS = ("batch", "ours_ms", "ref_ms", "speedup", "ours_pages_s", "ref_pages_s")


def add_arguments(p) -> None:
    p.add_argument("--model", default=None, help="a detector checkpoint directory (save_pretrained layout)")
    p.add_argument("--model-family", default=None,
                   help="the detector family (default: config.json's model_type, or pp_doclayout_v3 with --load-format "
                        "dummy)")
    p.add_argument("--load-format", choices=("auto", "dummy"), default="auto",
                   help="dummy: the full default config with random weights (no checkpoint)")
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="auto", help="the plan's dtype (auto: the row's default)")
    p.add_argument("--batch-sizes", default=",".join(map(str, DEFAULT_BATCH_SIZES)),
                   help="comma list of pages per batch (default 1,8,32)")
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--masks", choices=("auto", "on", "off"), default="auto",
                   help="auto (default): on where the family has a mask head (both sides compute the mask outputs), "
                        "else off on both sides; on; off: ours without them (a reference with a mask head cannot "
                        "skip them: the ratio then compares different outputs)")
    p.add_argument("--threshold", type=float, default=0.5, help="score threshold of the detections check")
    p.add_argument("--no-reference", action="store_true", help="ours only (no transformers)")
    p.add_argument("--json-out", default=None, help="write the results as JSON here")


@dataclass(frozen=True)
class DetectBenchOptions:
    model: str | None
    model_family: str | None
    device: str
    dtype: str
    batch_sizes: tuple[int, ...]
    iters: int
    warmup: int
    masks: bool | None              # None: auto (the family's mask head decides)
    threshold: float
    reference: bool
    json_out: str | None


def options_from_args(args) -> DetectBenchOptions:
    try:
        sizes = tuple(int(x) for x in str(args.batch_sizes).split(",") if x.strip())
    except ValueError:
        raise BenchError(f"--batch-sizes must be a comma list of integers, got {args.batch_sizes!r}") from None
    if not sizes or min(sizes) < 1:
        raise BenchError(f"--batch-sizes must be positive integers, got {args.batch_sizes!r}")
    if args.iters < 1 or args.warmup < 0:
        raise BenchError("--iters must be >= 1 and --warmup >= 0")
    if not 0.0 <= args.threshold <= 1.0:
        raise BenchError(f"--threshold must be in [0, 1], got {args.threshold}")
    model = None if args.load_format == "dummy" else args.model
    if model is None and args.load_format != "dummy":
        raise BenchError("bench detect needs --model DIR or --load-format dummy")
    masks = {"auto": None, "on": True, "off": False}[args.masks]
    return DetectBenchOptions(model, getattr(args, "model_family", None), args.device, args.dtype, sizes, args.iters,
                              args.warmup, masks, args.threshold, not args.no_reference, args.json_out)


# ------------------------------------------------------------------ the reference
def load_reference(opts: DetectBenchOptions, runner):
    """The family's transformers model with the same weights (the checkpoint's, or the loaded
    detector's random ones), in the runner's device and dtype."""
    family = runner.detector_family
    make = getattr(family, "transformers_reference", None)
    if make is None:
        raise BenchError(f"detector family {family.name} has no transformers reference (--no-reference: ours only)")
    return make(opts.model, runner.detector, runner.detector_cfg).to(device=runner.device, dtype=runner.dtype)


# ------------------------------------------------------------------ the run
def make_pages(n: int, size: tuple[int, int], seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n, 3, *size), generator=g, dtype=torch.uint8).float() / 255


def agreement(ours, theirs) -> float:
    """The share of detection slots (over pages, in reading order) where both have the same label."""
    slots = sum(max(len(a), len(b)) for a, b in zip(ours, theirs))
    same = sum(x.label == y.label for a, b in zip(ours, theirs) for x, y in zip(a, b))
    return same / slots if slots else 1.0


def same_detections(ours, theirs, score_tol: float = 1e-3) -> bool:
    for a, b in zip(ours, theirs):
        if [(d.label, d.order) for d in a] != [(d.label, d.order) for d in b]:
            return False
        if any(abs(x.score - y.score) > score_tol for x, y in zip(a, b)):
            return False
    return len(ours) == len(theirs)


def run(opts: DetectBenchOptions) -> dict:
    from ..models.registry import DEFAULT_DETECTOR_FAMILY, detect_family
    from ..plan import PlanRequest
    from ..runner import create_runner
    family = detect_family(opts.model, opts.model_family or (DEFAULT_DETECTOR_FAMILY if opts.model is None else None)
                           ).family
    masks = family.supports_masks if opts.masks is None else opts.masks
    if masks and not family.supports_masks:
        raise BenchError(f"--masks on: detector family {family.name} has no mask head")
    runner = create_runner(PlanRequest(device=opts.device, dtype=opts.dtype, detector_masks=masks))
    if not hasattr(runner, "load_detector"):
        raise BenchError(f"runner {runner.name} has no detector path")
    runner.load_detector(opts.model, load_format="dummy" if opts.model is None else "auto", model_family=family.name)
    graphs = runner.capture_detector_graphs()
    size = runner.detector_input_size()
    ref = load_reference(opts, runner) if opts.reference else None
    api, dev = runner.device_api, runner.device
    pages = make_pages(max(opts.batch_sizes), size)
    fam, cfg = runner.detector_family, runner.detector_cfg
    result = {"device": str(dev), "row": runner.plan.row, "dtype": str(runner.dtype).removeprefix("torch."),
              "family": fam.name, "input": list(size),
              "masks": ("on (both sides)" if masks else "off on both sides (the family has no mask head)"
                        if not fam.supports_masks else "off in ours only (the reference computes them)"),
              "graphs": list(runner.plan.detector_graphs.value) or f"off ({graphs.reason})",
              "model": opts.model or "dummy (default config, random weights)", "rows": []}
    b0 = min(opts.batch_sizes)
    sizes0 = [size] * b0
    ours_dets = runner.detect(pages[:b0], sizes0, threshold=opts.threshold)
    if ref is not None:
        with torch.inference_mode():
            out = ref(pixel_values=pages[:b0].to(dev, runner.dtype))
        theirs = fam.postprocess(cfg, out, sizes0, threshold=opts.threshold)
        result["same_detections"] = same_detections(ours_dets, theirs)
        result["label_agreement"] = agreement(ours_dets, theirs)
        result["detections_checked"] = f"batch {b0}, threshold {opts.threshold}: {sum(map(len, ours_dets))} ours, " \
                                       f"{sum(map(len, theirs))} reference"
    for b in opts.batch_sizes:
        px = pages[:b].to(dev, runner.dtype)
        with torch.inference_mode():
            ours = median_ms(lambda: runner.detect_uploaded(px), opts.warmup, opts.iters, api)
            row = {"batch": b, "ours_ms": ours, "ours_pages_s": b / ours * 1000}
            if ref is not None:
                theirs_ms = median_ms(lambda: ref(pixel_values=px), opts.warmup, opts.iters, api)
                row |= {"ref_ms": theirs_ms, "ref_pages_s": b / theirs_ms * 1000, "speedup": theirs_ms / ours}
        result["rows"].append(row)
    return result


def format_table(result: dict) -> str:
    def cell(v):
        return "-" if v is None else (f"{v:.2f}" if isinstance(v, float) else str(v))
    head = [f"bench detect: {result['family']} {result['model']} on {result['device']} (row {result['row']}), {result['dtype']}, "
            f"input {result['input'][0]}x{result['input'][1]}, masks {result['masks']}, graphs {result['graphs']}"]
    if "same_detections" in result:
        head.append(f"same detections as the reference: {result['same_detections']} ({result['detections_checked']}; "
                    f"labels agree in {result['label_agreement']:.1%} of the reading-order slots)")
    lines = [" ".join(f"{c:>14}" for c in COLUMNS)]
    for r in result["rows"]:
        lines.append(" ".join(f"{cell(r.get(c)):>14}" for c in COLUMNS))
    return "\n".join(head + lines)


def run_cli(args) -> int:
    opts = options_from_args(args)
    result = run(opts)
    print(format_table(result))
    if opts.json_out:
        with open(opts.json_out, "w") as f:
            json.dump(result, f, indent=1)
    # fp32 must reproduce the reference's detections; in bf16/fp16 two implementations may
    # round a near-tie differently (the agreement is printed, the bf16 check is ci/detector_bf16_check.py)
    return 0 if result.get("same_detections", True) or result["dtype"] != "float32" else 1
