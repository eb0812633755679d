"""`fastdeploy-ext bench detect`: our layout detector (PP-DocLayoutV3 on the runner's plan:
kernels, graphs, dtype) against transformers' PPDocLayoutV3ForObjectDetection with the same
weights on the same pixels, per batch size (default 1, 8 and 32), in one run: ms per batch and
pages/s side by side with the ratios.

Same outputs on both sides: transformers' forward always computes the mask outputs (of every
decoder layer; it has no switch to skip them), so the comparison runs ours with masks on as
well (the model's returned ``out_masks``; its graphs are captured that way). ``--masks off``
times ours as parsing runs it (no masks) and says so in the table: the reference still computes
them, so that ratio compares different outputs.

Weights: ``--model DIR`` (both load the checkpoint) or ``--load-format dummy`` (the full default
config, our random weights copied into the reference by name). Pixels: seeded random pages at
the processor's fixed size. Before timing, both detect on the smallest batch and the detections
are compared (`same_detections`: labels and reading order equal, scores within 1e-3). Nothing
here asserts a time."""
from __future__ import annotations

import dataclasses
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
    p.add_argument("--model", default=None, help="a PP-DocLayoutV3 checkpoint directory (save_pretrained layout)")
    p.add_argument("--load-format", choices=("auto", "dummy"), default="auto",
                   help="dummy: the full default config with random weights (no checkpoint)")
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="auto", help="the plan's dtype (auto: the row's default)")
    p.add_argument("--batch-sizes", default=",".join(map(str, DEFAULT_BATCH_SIZES)),
                   help="comma list of pages per batch (default 1,8,32)")
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--masks", choices=("on", "off"), default="on",
                   help="on (default): both sides compute the mask outputs; off: ours without them (the "
                        "reference cannot skip them: the ratio then compares different outputs)")
    p.add_argument("--threshold", type=float, default=0.5, help="score threshold of the detections check")
    p.add_argument("--no-reference", action="store_true", help="ours only (no transformers)")
    p.add_argument("--json-out", default=None, help="write the results as JSON here")


@dataclass(frozen=True)
class DetectBenchOptions:
    model: str | None
    device: str
    dtype: str
    batch_sizes: tuple[int, ...]
    iters: int
    warmup: int
    masks: bool
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
    return DetectBenchOptions(model, args.device, args.dtype, sizes, args.iters, args.warmup, args.masks == "on",
                              args.threshold, not args.no_reference, args.json_out)


# ------------------------------------------------------------------ the reference
def transformers_config(cfg):
    """transformers' PPDocLayoutV3Config for our config (the same architecture)."""
    from transformers import PPDocLayoutV3Config
    skip = {"backbone", "labels", "image_size"}
    kw = {f.name: (list(v) if isinstance(v, tuple) else v) for f in dataclasses.fields(cfg)
          if f.name not in skip for v in [getattr(cfg, f.name)]}
    bb = {f.name: (list(v) if isinstance(v, tuple) else v) for f in dataclasses.fields(cfg.backbone)
          for v in [getattr(cfg.backbone, f.name)]}
    bb |= {"model_type": "hgnet_v2", "hidden_sizes": list(cfg.backbone.stage_out_channels),
           "out_features": [f"stage{i}" for i in cfg.backbone.out_indices]}
    bb.pop("out_indices")
    kw["positional_encoding_temperature"] = int(kw["positional_encoding_temperature"])    # an int field there
    return PPDocLayoutV3Config(backbone_config=bb, id2label=dict(enumerate(cfg.labels)), **kw)


def reference_with_our_weights(model, cfg):
    """transformers' model of ``cfg`` holding ``model``'s weights: written as the checkpoint
    save_pretrained would (our names are its converted names under ``model.``) and read back by
    from_pretrained, which maps them onto its modules; a reference tensor left unloaded other than
    the ones inference does not read is an error."""
    import tempfile

    from safetensors.torch import save_file
    from transformers import PPDocLayoutV3ForObjectDetection

    from ..models.pp_doclayout_v3.loader import PREFIX
    with tempfile.TemporaryDirectory(prefix="fdx-bench-detect-") as d:
        transformers_config(cfg).save_pretrained(d)
        save_file({PREFIX + k: v.detach().float().cpu().contiguous() for k, v in model.state_dict().items()},
                  f"{d}/model.safetensors", metadata={"format": "pt"})
        ref, info = PPDocLayoutV3ForObjectDetection.from_pretrained(d, output_loading_info=True)
    left = [k for k in info["missing_keys"] if "denoising_class_embed" not in k and not k.endswith("num_batches_tracked")]
    if left or info["unexpected_keys"] or info.get("mismatched_keys"):
        raise BenchError(f"our weights do not map onto transformers' model: missing {left[:3]}, unexpected "
                         f"{list(info['unexpected_keys'])[:3]}, mismatched {list(info.get('mismatched_keys') or [])[:3]}")
    return ref.eval()


def load_reference(opts: DetectBenchOptions, runner):
    if opts.model is not None:
        from transformers import PPDocLayoutV3ForObjectDetection
        ref = PPDocLayoutV3ForObjectDetection.from_pretrained(opts.model).eval()
    else:
        ref = reference_with_our_weights(runner.detector, runner.detector_cfg)
    return ref.to(device=runner.device, dtype=runner.dtype)


# ------------------------------------------------------------------ the run
def make_pages(n: int, size: tuple[int, int], seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n, 3, *size), generator=g, dtype=torch.uint8).float() / 255


def same_detections(ours, theirs, score_tol: float = 1e-3) -> bool:
    for a, b in zip(ours, theirs):
        if [(d.label, d.order) for d in a] != [(d.label, d.order) for d in b]:
            return False
        if any(abs(x.score - y.score) > score_tol for x, y in zip(a, b)):
            return False
    return len(ours) == len(theirs)


def run(opts: DetectBenchOptions) -> dict:
    from ..plan import PlanRequest
    from ..runner import create_runner
    runner = create_runner(PlanRequest(device=opts.device, dtype=opts.dtype, detector_masks=opts.masks))
    if not hasattr(runner, "load_detector"):
        raise BenchError(f"runner {runner.name} has no detector path")
    runner.load_detector(opts.model, load_format="dummy" if opts.model is None else "auto")
    graphs = runner.capture_detector_graphs()
    size = runner.detector_input_size()
    ref = load_reference(opts, runner) if opts.reference else None
    api, dev = runner.device_api, runner.device
    pages = make_pages(max(opts.batch_sizes), size)
    fam, cfg = runner.detector_family, runner.detector_cfg
    result = {"device": str(dev), "row": runner.plan.row, "dtype": str(runner.dtype).removeprefix("torch."),
              "input": list(size), "masks": "on (both sides)" if opts.masks else "off in ours only (the reference computes them)",
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
    head = [f"bench detect: {result['model']} on {result['device']} (row {result['row']}), {result['dtype']}, "
            f"input {result['input'][0]}x{result['input'][1]}, masks {result['masks']}, graphs {result['graphs']}"]
    if "same_detections" in result:
        head.append(f"same detections as the reference: {result['same_detections']} ({result['detections_checked']})")
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
    return 0 if result.get("same_detections", True) else 1
