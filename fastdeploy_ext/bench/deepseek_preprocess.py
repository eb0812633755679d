"""`python3 -m fastdeploy_ext.bench.deepseek_preprocess`: DeepSeek-OCR-2's image preprocessing,
transformers' PIL processor vs ours on the host (PIL) vs ours on a device, the same pages.

Each page is a decoded PIL image (seeded noise at --page-size; a 150 dpi A4 page, 1240x1754, is
a six-crop page), so decoding is outside every column. Columns, per page:

- ``transformers``: ``DeepseekOcr2ImageProcessorPil`` (normalized float32 views), one thread;
- ``ours host``: ``DeepseekOCR2ImageProcessor`` with PIL (uint8 patches), one thread;
- ``ours <device>``: the same processor ``on_device`` (--device, e.g. cuda): the upload, the
  resizes and the cuts there, the device synchronized after each page;
- ``ours host xN`` / ``ours <device> xN``: N threads over the pages (--workers), what the engine's
  preprocessing pool does.

For each: pages/s, wall ms a page, host CPU ms a page (the process's CPU time over the run: what
the preprocessing takes from the step loop's host), and the ratio of transformers' wall ms to
it. Before timing, each of ours is checked against the host path byte for byte
(``bitwise_equal``). Nothing here asserts a time."""
from __future__ import annotations

import argparse
import json
import os
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch
from PIL import Image

from . import BenchError


def pages(n: int, size: tuple[int, int]) -> list[Image.Image]:
    w, h = size
    rng = np.random.default_rng(0)
    return [Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)) for _ in range(n)]


def timed(fn, imgs, workers: int, sync) -> tuple[float, float]:
    """(wall s, process CPU s) of fn over every image, on ``workers`` threads."""
    def one(im):
        fn(im)
        sync()
    c0, t0 = time.process_time(), time.perf_counter()
    if workers == 1:
        for im in imgs:
            one(im)
    else:
        with ThreadPoolExecutor(workers) as pool:
            list(pool.map(one, imgs))
    return time.perf_counter() - t0, time.process_time() - c0


def run(n: int, size: tuple[int, int], device: str | None, workers: list[int], reference: bool) -> list[dict]:
    from ..device_api import device_api_for
    from ..models.registry import get_family
    imgs = pages(n, size)
    host = get_family("deepseek_ocr2").image_processor(None)
    want = host.pixel_values(host.views(imgs[0])[0])
    sides = {"ours host": (host, lambda: None)}
    if device:
        dev = torch.device(device)
        sides[f"ours {device}"] = (host.on_device(dev), device_api_for(dev).synchronize)
    rows = []

    def record(name, nw, wall, cpu, equal=None):
        rows.append({"column": name, "workers": nw, "pages_per_s": n / wall, "wall_ms": 1e3 * wall / n,
                     "cpu_ms": 1e3 * cpu / n, **({} if equal is None else {"bitwise_equal": equal})})

    if reference:
        try:
            from transformers.models.deepseek_ocr2.image_processing_pil_deepseek_ocr2 import \
                DeepseekOcr2ImageProcessorPil
        except ImportError as e:
            raise BenchError(f"transformers has no DeepSeek-OCR-2 processor here ({e}); --no-reference skips it")
        ref = DeepseekOcr2ImageProcessorPil()
        ref(images=[imgs[0]], return_tensors="pt")
        record("transformers", 1, *timed(lambda im: ref(images=[im], return_tensors="pt"), imgs, 1, lambda: None))
    for name, (proc, sync) in sides.items():
        got = proc.pixel_values(proc.views(imgs[0])[0])       # also the device's warm-up
        equal = bool(torch.equal(got.cpu(), want))
        for nw in workers:
            fn = lambda im, proc=proc: proc.pixel_values(proc.views(im)[0])   # noqa: E731
            record(name if nw == 1 else f"{name} x{nw}", nw, *timed(fn, imgs, nw, sync), equal)
    base = next((r["wall_ms"] for r in rows if r["column"] == "transformers"), None)
    for r in rows:
        r["ratio_vs_transformers"] = None if base is None else base / r["wall_ms"]
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python3 -m fastdeploy_ext.bench.deepseek_preprocess",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--pages", type=int, default=16)
    p.add_argument("--page-size", default="1240x1754", metavar="WxH")
    p.add_argument("--device", default=None, help="also ours on this device (e.g. cuda)")
    p.add_argument("--workers", default="1,4", help="comma list of thread counts for ours")
    p.add_argument("--no-reference", action="store_true", help="skip transformers' processor")
    p.add_argument("--json-out", default=None)
    args = p.parse_args(argv)
    from .generate import parse_page_size
    try:
        w, h = parse_page_size(args.page_size)
    except ValueError as e:
        raise SystemExit(str(e))
    try:
        workers = [int(v) for v in args.workers.split(",") if v.strip()]
        if args.pages < 1 or not workers or min(workers) < 1:
            raise ValueError
    except ValueError:
        raise SystemExit("--pages >= 1 and --workers positive integers, e.g. 1,4")
    try:
        rows = run(args.pages, (w, h), args.device, workers, not args.no_reference)
    except BenchError as e:
        raise SystemExit(str(e))
    print(f"DeepSeek-OCR-2 preprocessing, {args.pages} pages of {w}x{h} (decoded), ms a page:")
    print(f"  {'column':<22} {'pages/s':>8} {'wall ms':>8} {'CPU ms':>8} {'x transformers':>15}  bitwise_equal")
    for r in rows:
        ratio = "" if r["ratio_vs_transformers"] is None else f"{r['ratio_vs_transformers']:.2f}"
        print(f"  {r['column']:<22} {r['pages_per_s']:>8.1f} {r['wall_ms']:>8.1f} {r['cpu_ms']:>8.1f} {ratio:>15}  "
              f"{r.get('bitwise_equal', '')}")
    path = args.json_out or (os.path.join(os.environ["OUT"], "deepseek_preprocess.json") if os.environ.get("OUT") else None)
    if path:
        with open(path, "w") as f:
            json.dump({"pages": args.pages, "page_size": [w, h], "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
