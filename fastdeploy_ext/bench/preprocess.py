"""`fastdeploy-ext bench preprocess`: images/s of our image processor at 1 and N workers against
transformers' two PaddleOCR-VL processors (PIL-backed and torchvision-backed), same images, one run.

Ours at 1 worker calls ``ImageProcessor.preprocess`` in this thread; at N workers it goes through
``PreprocessPool`` (N threads). The references at 1 worker run one batch call with
torch.set_num_threads(1); at N workers they are measured two ways and both are printed: their
own batch call with torch.set_num_threads(N) (torchvision's intra-op threads) and N threads
each calling the processor on one image at a time. Before timing, our first image is checked
bit for bit against the PIL-backed reference (printed as `bitwise_equal_pil`). Inputs are decoded
PIL images (what transformers' processors take), seeded random noise at --size. Nothing here
asserts a time."""
from __future__ import annotations

import json
import logging
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch

from . import BenchError
from .timing import median_ms

log = logging.getLogger(__name__)

#: the family whose transformers processors are the references (its processor is ours)
REFERENCE_FAMILY = "paddleocr_vl"


def add_arguments(p) -> None:
    p.add_argument("--model", default=None, help="read preprocessor_config.json from this model dir "
                   "(default: the released checkpoint's settings)")
    p.add_argument("--images", type=int, default=16, help="images per timed batch")
    p.add_argument("--size", default="1080x1920", help="HxW of each synthetic image (default a 1080p page)")
    p.add_argument("--workers", default=None,
                   help="comma list of worker counts (default: 1 and one per usable core)")
    p.add_argument("--iters", type=int, default=3)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--no-reference", action="store_true", help="skip the transformers processors")
    p.add_argument("--json-out", default=None)


def _parse(args, family):
    try:
        h, w = (int(x) for x in args.size.lower().split("x"))
        if h <= 0 or w <= 0:
            raise ValueError
    except ValueError:
        raise BenchError(f"--size must be HxW with positive integers, got {args.size!r}") from None
    if args.images < 1 or args.iters < 1 or args.warmup < 0:
        raise BenchError("--images and --iters must be >= 1, --warmup >= 0")
    if args.workers:
        try:
            workers = [int(x) for x in args.workers.split(",") if x.strip()]
        except ValueError:
            raise BenchError(f"--workers must be a comma list of integers, got {args.workers!r}") from None
        if not workers or any(n < 1 for n in workers):
            raise BenchError(f"--workers must be positive integers, got {args.workers!r}")
    else:
        with family.preprocess_pool(family.released_image_processor()) as pool:   # no thread starts before a submit
            workers = sorted({1, pool.workers})
    return (h, w), workers


def _references(kw: dict) -> dict:
    """name -> processor instance, or a string saying why it is unavailable."""
    out: dict = {}
    try:
        from transformers.models.paddleocr_vl.image_processing_pil_paddleocr_vl import PaddleOCRVLImageProcessorPil
        out["transformers-pil"] = PaddleOCRVLImageProcessorPil(**kw)
    except Exception as e:  # noqa: BLE001 - report, don't fail the bench
        out["transformers-pil"] = f"unavailable ({type(e).__name__}: {e})"
    try:
        import torchvision  # noqa: F401 - transformers falls back to PIL silently-ish without it
        from transformers.models.paddleocr_vl.image_processing_paddleocr_vl import PaddleOCRVLImageProcessor
        out["transformers-torchvision"] = PaddleOCRVLImageProcessor(**kw)
    except Exception as e:  # noqa: BLE001
        out["transformers-torchvision"] = f"unavailable ({type(e).__name__}: {str(e)[:120]})"
    return out


def run_cli(args) -> int:
    from PIL import Image

    from ..models.registry import get_family

    family = get_family(REFERENCE_FAMILY)
    (h, w), workers = _parse(args, family)
    proc = family.image_processor(args.model) if args.model else family.released_image_processor()
    cfg = proc.cfg
    kw = dict(min_pixels=cfg.min_pixels, max_pixels=cfg.max_pixels, image_mean=list(cfg.image_mean),
              image_std=list(cfg.image_std), patch_size=cfg.patch_size, merge_size=cfg.merge_size,
              temporal_patch_size=cfg.temporal_patch_size)
    rng = np.random.default_rng(1)
    images = [Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)) for _ in range(args.images)]
    n = len(images)
    patches = proc.num_patches(h, w)
    print(f"bench preprocess: {n} images {h}x{w} -> {proc.resized_size(h, w)} ({patches} patches each), "
          f"pixel recipe {proc.pixel_recipe}, workers {workers}, torch threads {torch.get_num_threads()}")
    rows: list[dict] = []
    torch_threads0 = torch.get_num_threads()

    def record(name, mode, nw, ms, note=""):
        ips = n / (ms / 1000)
        rows.append({"processor": name, "mode": mode, "workers": nw, "ms_per_batch": ms, "images_per_s": ips,
                     "ms_per_image_core": ms * nw / n, "note": note})
        print(f"  {name:<26} {mode:<14} workers {nw:>3}: {ms:9.1f} ms / {n} images = {ips:8.1f} images/s {note}")

    refs = {} if args.no_reference else _references(kw)
    bitwise = None
    pil_ref = refs.get("transformers-pil")
    if pil_ref is not None and not isinstance(pil_ref, str):
        ref_pv = np.asarray(pil_ref(images=[images[0]], return_tensors="np")["pixel_values"], dtype=np.float32)
        ours_pv = proc.preprocess(images[0]).pixel_values.numpy()
        bitwise = bool(ours_pv.shape == ref_pv.shape and np.array_equal(ours_pv.view(np.uint32), ref_pv.view(np.uint32)))
        print(f"  bitwise_equal_pil: {bitwise}")

    for nw in workers:
        if nw == 1:
            ms = median_ms(lambda: [proc.preprocess(im) for im in images], args.warmup, args.iters)
            record("ours", "serial", 1, ms)
        else:
            with family.preprocess_pool(proc, nw) as pool:
                ms = median_ms(lambda: pool.map(images), args.warmup, args.iters)
            record("ours", "thread-pool", nw, ms)
    for name, ref in refs.items():
        if isinstance(ref, str):
            rows.append({"processor": name, "note": ref})
            print(f"  {name:<26} {ref}")
            continue
        for nw in workers:
            try:
                torch.set_num_threads(nw)
                ms = median_ms(lambda: ref(images=images, return_tensors="pt"), args.warmup, args.iters)
                record(name, "torch-threads", nw, ms)
                if nw > 1:
                    torch.set_num_threads(1)
                    with ThreadPoolExecutor(nw) as ex:
                        ms = median_ms(lambda: list(ex.map(lambda im: ref(images=[im], return_tensors="pt"), images)),
                                       args.warmup, args.iters)
                    record(name, "thread-pool", nw, ms)
            finally:
                torch.set_num_threads(torch_threads0)

    # speed-ups: ours vs each reference, at the same worker count (best mode of the reference)
    summary = {}
    for nw in workers:
        ours = [r for r in rows if r["processor"] == "ours" and r.get("workers") == nw]
        for name in refs:
            ref_rows = [r for r in rows if r["processor"] == name and r.get("workers") == nw]
            if ours and ref_rows:
                best = max(r["images_per_s"] for r in ref_rows)
                summary[f"{name}@{nw}"] = ours[0]["images_per_s"] / best
    for k, v in summary.items():
        print(f"  ours vs {k}: x{v:.2f} (images/s, vs the reference's best mode)")
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump({"images": n, "size": [h, w], "patches_per_image": patches, "pixel_recipe": proc.pixel_recipe,
                       "bitwise_equal_pil": bitwise, "rows": rows, "speedup": summary}, f, indent=1)
    return 0
