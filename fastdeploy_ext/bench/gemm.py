"""`fastdeploy-ext bench gemm`: the GEMM ceiling on the encoder's own shapes, and how close the
encoder gets to it.

1. Ceiling: TFLOP/s of ``F.linear`` (bias included, as in the encoder) for the four layer GEMMs
   (qkv 1152->3456, out_proj 1152->1152, fc1 1152->4304, fc2 4304->1152) at each --tokens count.
2. Encoder: one profiled call of the real encoder (+ projector) on --workload; the GEMM ops' time
   (addmm/mm/_addmm_activation, self time) against the FLOPs they do, so its rate and the ratio to
   the ceiling at the same token count (FLOP-weighted over the four shapes); the top ops too.
3. On CPU, oneDNN verbose evidence from a child process running the same shapes: which
   implementation executed (e.g. ``brg_matmul:avx10_1_512_amx``).

Nothing here asserts a time."""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

import torch
import torch.nn.functional as F

from . import BenchError
from .timing import median_ms

HIDDEN, INTER = 1152, 4304


def layer_shapes(hidden: int = HIDDEN, inter: int = INTER) -> dict[str, tuple[int, int]]:
    """(in, out) of an encoder layer's four GEMMs (the released 0.9B's by default)."""
    return {"qkv": (hidden, 3 * hidden), "out_proj": (hidden, hidden), "fc1": (hidden, inter), "fc2": (inter, hidden)}


LAYER_SHAPES = layer_shapes()
GEMM_OPS = ("aten::addmm", "aten::mm", "aten::_addmm_activation", "aten::bmm")
ATTENTION_OPS = ("aten::_scaled_dot_product_flash_attention_for_cpu", "aten::_scaled_dot_product_flash_attention",
                 "aten::_scaled_dot_product_cudnn_attention", "aten::_scaled_dot_product_efficient_attention")

_CHILD = r"""
import json, sys, torch, torch.nn.functional as F
m, dtype, shapes = int(sys.argv[1]), getattr(torch, sys.argv[2]), json.loads(sys.argv[3])
with torch.inference_mode():
    for k, n in shapes:
        x = torch.randn(m, k, dtype=dtype); w = torch.randn(n, k, dtype=dtype); b = torch.randn(n, dtype=dtype)
        F.linear(x, w, b)
print("fdx: done", flush=True)
"""


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="model dir whose encoder runs (and whose layer shapes the "
                   "ceiling uses); default: random weights of the released 0.9B config")
    p.add_argument("--device", default="cpu_amx", help="cpu_amx, cpu or cuda")
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32", "float16"))
    p.add_argument("--tokens", default="320,1536", help="comma list of token counts (GEMM M) for the ceiling")
    p.add_argument("--workload", default="img1536", help="bench vision workload the encoder runs")
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--json-out", default=None)


def layer_gemm_flops(tokens: int, shapes: dict[str, tuple[int, int]] = LAYER_SHAPES) -> dict[str, float]:
    return {name: 2.0 * tokens * k * n for name, (k, n) in shapes.items()}


def encoder_gemm_flops(tokens: int, layers: int, patch_dim: int, merge: int, text_hidden: int,
                       shapes: dict[str, tuple[int, int]] = LAYER_SHAPES) -> float:
    """All GEMM FLOPs of one encoder + projector call on ``tokens`` patches."""
    per_layer = sum(layer_gemm_flops(tokens, shapes).values())
    hidden = shapes["out_proj"][0]
    merged = tokens // (merge * merge)
    proj_in = hidden * merge * merge
    return (layers * per_layer + 2.0 * tokens * patch_dim * hidden
            + 2.0 * merged * proj_in * proj_in + 2.0 * merged * proj_in * text_hidden)


def weighted_ceiling(rates: dict[str, float], tokens: int, shapes: dict[str, tuple[int, int]] = LAYER_SHAPES) -> float:
    """TFLOP/s of the four layer GEMMs run back to back at their measured rates."""
    fl = layer_gemm_flops(tokens, shapes)
    return sum(fl.values()) / sum(fl[n] / rates[n] for n in fl)


def kernel_evidence(runner_cls, tokens: int, dtype: str, shapes: dict[str, tuple[int, int]] = LAYER_SHAPES) -> dict:
    """The backend's own evidence of which kernels ran the encoder's GEMM shapes (on cpu_amx:
    oneDNN's verbose log of a child process running them)."""
    def run(env: dict[str, str]) -> str:
        r = subprocess.run([sys.executable, "-c", _CHILD, str(tokens), dtype, json.dumps(list(shapes.values()))],
                           env=dict(os.environ, **env), capture_output=True, text=True, timeout=120)
        return r.stdout + "\n" + r.stderr
    try:
        ev = runner_cls.matmul_kernel_evidence(run)
    except Exception as e:  # noqa: BLE001 - evidence is reported, never fatal
        return {"amx_used": False, "reason": f"child failed: {type(e).__name__}: {e}"}
    return ev if ev is not None else {"amx_used": False, "reason": f"the {runner_cls.name} backend reads no kernel log"}


def _profile_ops(fn) -> dict[str, float]:
    from torch.profiler import ProfilerActivity, profile
    fn()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    return {e.key: e.self_cpu_time_total / 1000 for e in prof.key_averages()}


def run_cli(args) -> int:
    from ..plan import PlanError, PlanRequest
    from ..runner import ModelSource, choose_device
    from .vision import WORKLOADS

    try:
        tokens = [int(t) for t in args.tokens.split(",") if t.strip()]
    except ValueError:
        raise BenchError(f"--tokens must be a comma list of integers, got {args.tokens!r}") from None
    if not tokens or any(t < 1 for t in tokens):
        raise BenchError("--tokens must be positive")
    if args.workload not in WORKLOADS:
        raise BenchError(f"unknown workload {args.workload!r}; known: {', '.join(WORKLOADS)}")
    try:
        cls, probe, why = choose_device(args.device)
        runner = cls.create(PlanRequest(device=args.device, dtype=args.dtype), probe=probe)
    except (PlanError, RuntimeError, ValueError) as e:
        raise BenchError(str(e)) from None
    device, dtype = runner.device, runner.dtype
    from ..models.interface import CheckpointError
    try:
        (ModelSource(args.model, "auto", "auto") if args.model else ModelSource(None, "dummy", "auto")).load_into(runner)
    except (CheckpointError, FileNotFoundError, ValueError) as e:
        raise BenchError(str(e)) from None
    vc = runner.cfg.vision
    shapes = layer_shapes(vc.hidden_size, vc.intermediate_size)
    print(f"bench gemm: device {runner.plan.device} (row {runner.plan.row}), {dtype}, "
          f"torch threads {torch.get_num_threads()}")
    res: dict = {"device": runner.plan.device, "row": runner.plan.row, "dtype": str(dtype),
                 "threads": torch.get_num_threads(), "ceiling": {}, "encoder": {}}
    with torch.inference_mode():
        for m in tokens:
            rates = {}
            for name, (k, n) in shapes.items():
                x = torch.randn(m, k, device=device, dtype=dtype)
                w = torch.randn(n, k, device=device, dtype=dtype)
                b = torch.randn(n, device=device, dtype=dtype)
                ms = median_ms(lambda: F.linear(x, w, b), args.warmup, args.iters, runner.device_api)
                rates[name] = 2.0 * m * k * n / (ms / 1000) / 1e12
            res["ceiling"][m] = {"per_shape_tflops": rates, "weighted_tflops": weighted_ceiling(rates, m, shapes)}
            print(f"  ceiling M={m:<6} " + "  ".join(f"{n} {r:6.2f}" for n, r in rates.items())
                  + f"  -> weighted {res['ceiling'][m]['weighted_tflops']:.2f} TFLOP/s")

        grids = WORKLOADS[args.workload]
        n_tok = sum(t * h * w for t, h, w in grids)
        pixels = runner.upload_pixels(torch.randn(n_tok, 3, 14, 14))
        call = lambda: runner.encode_uploaded(pixels, grids)  # noqa: E731
        total_ms = median_ms(call, args.warmup, args.iters, runner.device_api)
        ops = _profile_ops(call)
        gemm_ms = sum(ops.get(k, 0.0) for k in GEMM_OPS)
        attn_ms = sum(ops.get(k, 0.0) for k in ATTENTION_OPS)
        flops = encoder_gemm_flops(n_tok, vc.num_hidden_layers, 3 * vc.patch_size ** 2, vc.spatial_merge_size,
                                   runner.cfg.text.hidden_size, shapes)
        rate = flops / (gemm_ms / 1000) / 1e12 if gemm_ms else None      # no GEMM op in the profile
        if n_tok not in res["ceiling"]:
            print(f"  (ceiling at M={n_tok} not measured: add it to --tokens for the ratio)")
        ceil = res["ceiling"].get(n_tok, {}).get("weighted_tflops")
        res["encoder"] = {"workload": args.workload, "tokens": n_tok, "ms": total_ms, "gemm_ms_profiled": gemm_ms,
                          "attention_ms_profiled": attn_ms, "gemm_tflop": flops / 1e12, "gemm_tflops": rate,
                          "ceiling_tflops": ceil, "ratio_to_ceiling": (rate / ceil) if ceil and rate else None,
                          "top_ops_ms": dict(sorted(ops.items(), key=lambda kv: -kv[1])[:12])}
        e = res["encoder"]
        print(f"  encoder {args.workload} ({n_tok} patches): {total_ms:.1f} ms; profiled GEMMs {gemm_ms:.1f} ms "
              f"({flops / 1e12:.2f} TFLOP -> " + (f"{rate:.2f} TFLOP/s" if rate is not None else "n/a")
              + (f", {e['ratio_to_ceiling'] * 100:.0f}% of the {ceil:.2f} ceiling" if ceil and rate else "")
              + f"), attention {attn_ms:.1f} ms")
        for k, v in e["top_ops_ms"].items():
            print(f"    {v:9.2f} ms  {k}")
    if device.type == "cpu":
        res["onednn"] = kernel_evidence(cls, n_tok, args.dtype, shapes)
        print(f"  oneDNN on the encoder shapes (M={n_tok}): amx_used={res['onednn']['amx_used']} "
              f"kernels={res['onednn'].get('kernels')}")
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(res, f, indent=1, default=str)
    return 0
