"""`python3 -m fastdeploy_ext.bench.gemm_gelu`: the erf-GELU GEMM (SAM's fc1), ours vs ATen.

SAM's MLP fc1 (768 -> 3072, bias, erf GELU) at the row counts a tower pass gives it: one page's
views (4096 + 6 x 2304 rows), 16 global views (65536) and 96 crops (221184). Columns:

- ``aten``: ``F.gelu(F.linear(x, w, b))`` (cuBLAS addmm with the bias, then the GELU kernel:
  what the ATen blocks and transformers run);
- ``ours``: ops/triton/gemm_gelu.linear_gelu_erf (the GELU in the GEMM's epilogue), with the
  tiles it picks, and with each of ``--tiles`` when given (a sweep: BMxBNxBK/warps/stages).

Each row: ms (median of CUDA event timings), TFLOP/s, the ratio aten / ours (> 1: ours faster),
and each column's max error against a float64 reference (ours rounds once, ATen twice). Nothing
here asserts a time."""
from __future__ import annotations

import argparse
import json
import os

import torch
import torch.nn.functional as F

from . import BenchError
from ..device_api import device_api_for
from .timing import median_ms

HIDDEN, WIDTH = 768, 3072                    # SAM ViT-B's MLP
DEFAULT_ROWS = (17920, 65536, 221184)        # one 6-crop page; 16 global views; 96 crops
DEFAULT_SWEEP = ("128x256x64/8/3", "128x256x64/8/4", "128x128x64/8/3", "128x128x64/4/4", "256x128x64/8/3",
                 "64x256x64/4/4")


def parse_tiles(spec: str):
    from ..ops.triton.gemm_gelu import GemmTiles
    try:
        dims, warps, stages = spec.split("/")
        bm, bn, bk = (int(v) for v in dims.split("x"))
        return GemmTiles(bm, bn, bk, group_m=8, num_warps=int(warps), num_stages=int(stages))
    except ValueError as e:
        raise BenchError(f"--tiles: {spec!r} is not BMxBNxBK/warps/stages (e.g. 128x256x64/8/3)") from e


def run(rows: list[int], sweep: list[str], iters: int, warmup: int) -> list[dict]:
    from ..ops.triton.gemm_gelu import linear_gelu_erf, pick_tiles
    api = device_api_for("cuda")
    g = torch.Generator().manual_seed(0)
    w = (torch.randn(WIDTH, HIDDEN, generator=g) * HIDDEN ** -0.5).to("cuda", torch.bfloat16)
    b = (torch.randn(WIDTH, generator=g) * 0.1).to("cuda", torch.bfloat16)
    out = []
    for m in rows:
        x = torch.randn(m, HIDDEN, generator=g).to("cuda", torch.bfloat16)
        probe = x[:4096]
        exact = F.gelu(probe.double() @ w.double().t() + b.double())
        flop = 2.0 * m * HIDDEN * WIDTH
        cols = {"aten": (lambda: F.gelu(F.linear(x, w, b)), F.gelu(F.linear(probe, w, b)))}
        picked = pick_tiles(m, WIDTH, HIDDEN)
        cols["ours"] = (lambda: linear_gelu_erf(x, w, b), linear_gelu_erf(probe, w, b))
        for spec in sweep:
            t = parse_tiles(spec)
            cols[f"ours {spec}"] = (lambda t=t: linear_gelu_erf(x, w, b, tiles=t), linear_gelu_erf(probe, w, b, tiles=t))
        with torch.inference_mode():
            times = {k: median_ms(fn, warmup, iters, api) for k, (fn, _) in cols.items()}
        for k, (_, sample) in cols.items():
            out.append({"rows": m, "column": k, "ms": times[k], "tflops": flop / times[k] / 1e9,
                        "aten_over_ours": times["aten"] / times[k],
                        "max_err": (sample.double() - exact).abs().max().item(),
                        "tiles": str(picked) if k == "ours" else k.removeprefix("ours ").strip()})
    return out


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--rows", default=",".join(str(r) for r in DEFAULT_ROWS), help="comma list of GEMM row counts")
    p.add_argument("--tiles", default=None, help="comma list of tiles to sweep besides the picked ones "
                   "(BMxBNxBK/warps/stages); 'default' for the built-in sweep")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--json-out", default=None)


def run_cli(args) -> int:
    from ..ops.triton.runtime import triton_available
    if not torch.cuda.is_available():
        raise BenchError("bench gemm_gelu needs a CUDA device (the kernel is a Triton GPU kernel)")
    ok, why = triton_available()
    if not ok:
        raise BenchError(f"bench gemm_gelu needs triton: {why}")
    rows = [int(r) for r in args.rows.split(",") if r.strip()]
    sweep = list(DEFAULT_SWEEP) if args.tiles == "default" else [s for s in (args.tiles or "").split(",") if s]
    result = run(rows, sweep, args.iters, args.warmup)
    print(f"erf-GELU GEMM {HIDDEN}->{WIDTH} bf16 on {torch.cuda.get_device_name()}: aten = addmm + GELU kernel, "
          "ours = GELU in the Triton GEMM's epilogue; ratio = aten / ours (> 1: ours faster)")
    print(f"  {'rows':>7} {'column':<24} {'ms':>8} {'TFLOP/s':>8} {'ratio':>6} {'max err':>9}")
    for r in result:
        print(f"  {r['rows']:>7} {r['column']:<24} {r['ms']:8.3f} {r['tflops']:8.1f} {r['aten_over_ours']:6.2f} "
              f"{r['max_err']:9.2e}")
    path = args.json_out or (os.path.join(os.environ["OUT"], "gemm_gelu.json") if os.environ.get("OUT") else None)
    if path:
        with open(path, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "results": result}, f, indent=1)
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python3 -m fastdeploy_ext.bench.gemm_gelu", description=__doc__.splitlines()[0])
    add_arguments(p)
    args = p.parse_args(argv)
    try:
        return run_cli(args)
    except BenchError as e:
        print(f"error: {e}")
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
