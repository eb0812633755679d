"""GPU micro-benchmark: DeepSeek-OCR-2's attention kernels (ops/attention/biased.py), ours
(Triton) against the ATen backends, side by side at the released shapes (bf16 by default).

Workloads (12 heads x 64 for SAM, 14 q / 2 kv heads x 64 for the Qwen2 encoder):
  window_v16     SAM windowed layer, 16 global views: 16 x 25 windows of 14x14 (64x64 padded to 70x70)
  global_v16     SAM global layer, 16 global views: 64x64 = 4096 tokens each
  global_v1      SAM global layer, one global view
  window_c96     SAM windowed layer, 96 crops: 96 x 16 windows of 14x14 (48x48 padded to 56x56)
  global_c96     SAM global layer, 96 crops: 48x48 = 2304 tokens each
  encoder_v16    Qwen2 encoder layer, 16 global views: 256 visual + 256 queries
  encoder_c96    Qwen2 encoder layer, 96 crops: 144 visual + 144 queries

q/k/v are SAM's strided views of one packed qkv (the encoder's: views of [B, N, H, D]
projections); rel_h / rel_w (the per-query projections both backends take) are made once,
outside the timing. ``aten``: sdpa_bias (the [N, N] bias materialized from them, then SDPA) /
sdpa_mask (k/v repeated to the query heads, the boolean mask built once per forward as the
model does). ``ours``: triton_relpos / triton_prefix_causal. Per workload: median ms per call,
aten/ours (above 1: ours is faster), the peak memory each call adds, and the max abs difference.

``--configs "BM,BN,W,S;..."`` adds a column per block config of ours (block_m, block_n, warps,
stages) next to the default (ops/triton/biased_attention.py default_config), for tuning.

Usage:  python3 -m fastdeploy_ext.bench.deepseek_attention [--workloads a,b] [--iters N]
        [--warmup N] [--dtype bfloat16|float16|float32] [--configs "64,64,4,3;128,64,8,3"]
Writes $OUT/deepseek_attention.json when OUT is set.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from dataclasses import asdict, dataclass

import torch

from ..device_api import device_api_for
from ..ops.attention.biased import SDPA_BIAS, SDPA_MASK, TRITON_PREFIX_CAUSAL, TRITON_RELPOS
from ..ops.triton.biased_attention import BlockConfig, prefix_causal_attention, relpos_attention
from .timing import call_times_ms


@dataclass(frozen=True)
class Workload:
    name: str
    kind: str          # "relpos" | "prefix"
    batch: int         # windows / views / crops in one call
    side: int          # relpos: the grid side; prefix: the visual prefix (as many queries follow)
    what: str


SAM_HEADS, ENC_HEADS, ENC_KV_HEADS, HEAD_DIM = 12, 14, 2, 64
WORKLOADS = {w.name: w for w in (
    Workload("window_v16", "relpos", 16 * 25, 14, "16 views x 25 windows of 14x14"),
    Workload("global_v16", "relpos", 16, 64, "16 views of 64x64"),
    Workload("global_v1", "relpos", 1, 64, "1 view of 64x64"),
    Workload("window_c96", "relpos", 96 * 16, 14, "96 crops x 16 windows of 14x14"),
    Workload("global_c96", "relpos", 96, 48, "96 crops of 48x48"),
    Workload("encoder_v16", "prefix", 16, 256, "16 views: 256 visual + 256 queries"),
    Workload("encoder_c96", "prefix", 96, 144, "96 crops: 144 visual + 144 queries"),
)}


def _relpos_inputs(w: Workload, dtype, device, configs):
    from ..ops.attention.biased import rel_pos_table
    g = torch.Generator(device=device).manual_seed(0)
    n, b, h, d = w.side * w.side, w.batch, SAM_HEADS, HEAD_DIM
    qkv = torch.randn(b, n, 3, h, d, generator=g, device=device, dtype=dtype)
    q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)
    qg = q.reshape(b, h, w.side, w.side, d)
    table = rel_pos_table(0.1 * torch.randn(2 * w.side - 1, d, generator=g, device=device, dtype=dtype), w.side)
    rel_h = torch.einsum("bnhwc,hkc->bnhwk", qg, table).reshape(b, h, n, w.side)
    rel_w = torch.einsum("bnhwc,wkc->bnhwk", qg, table).reshape(b, h, n, w.side)
    tuned = [lambda c=c: relpos_attention(q, k, v, rel_h, rel_w, HEAD_DIM ** -0.5, c) for c in configs]
    return (lambda: SDPA_BIAS(q, k, v, rel_h, rel_w)), (lambda: TRITON_RELPOS(q, k, v, rel_h, rel_w)), tuned


def _prefix_inputs(w: Workload, dtype, device, configs):
    g = torch.Generator(device=device).manual_seed(0)
    n, b = 2 * w.side, w.batch

    def proj(heads):
        return torch.randn(b, n, heads, HEAD_DIM, generator=g, device=device, dtype=dtype).transpose(1, 2)
    q, k, v = proj(ENC_HEADS), proj(ENC_KV_HEADS), proj(ENC_KV_HEADS)
    mask = SDPA_MASK.prepare(w.side, n, device)
    state = TRITON_PREFIX_CAUSAL.prepare(w.side, n, device)
    tuned = [lambda c=c: prefix_causal_attention(q, k, v, w.side, HEAD_DIM ** -0.5, c) for c in configs]
    return (lambda: SDPA_MASK(q, k, v, mask)), (lambda: TRITON_PREFIX_CAUSAL(q, k, v, state)), tuned


def _peak_mib(api, fn) -> float:
    """Memory one call adds at its peak (the output included), MiB."""
    api.synchronize()
    base = api.allocated_bytes()
    api.reset_peak_allocated()
    out = fn()
    api.synchronize()
    peak = api.peak_allocated_bytes() - base
    del out
    return peak / 2 ** 20


#: the kernels are CUDA Triton kernels; the device API does the rest (sync, memory, timing)
DEVICE = "cuda"


def _device_name(api) -> str:
    return f"{api.name} {api.device}"


def run(workloads: list[str], dtype: torch.dtype, warmup: int, iters: int,
        configs: tuple[BlockConfig, ...] = ()) -> list[dict]:
    device = torch.device(DEVICE)
    ok, why = TRITON_RELPOS.available(device)
    if not ok:
        raise SystemExit(f"deepseek_attention bench: the Triton kernels cannot run on {DEVICE}: {why}")
    api, rows = device_api_for(DEVICE), []
    print(f"{_device_name(api)}  dtype={str(dtype).removeprefix('torch.')}  warmup={warmup} "
          f"iters={iters}  (aten/ours > 1: ours faster)")
    print(f"{'workload':<12} {'shape':<36} {'aten ms':>9} {'ours ms':>9} {'aten/ours':>9} "
          f"{'aten MiB':>9} {'ours MiB':>9} {'max|diff|':>10}"
          + "".join(f" {'x'.join(map(str, c)):>12}" for c in configs))
    for name in workloads:
        w = WORKLOADS[name]
        make = _relpos_inputs if w.kind == "relpos" else _prefix_inputs
        aten, ours, tuned = make(w, dtype, device, configs)
        diff = (aten().float() - ours().float()).abs().max().item()
        mem_a, mem_o = _peak_mib(api, aten), _peak_mib(api, ours)
        t_a = statistics.median(call_times_ms(aten, warmup, iters, api))
        t_o = statistics.median(call_times_ms(ours, warmup, iters, api))
        t_c = [statistics.median(call_times_ms(fn, warmup, iters, api)) for fn in tuned]
        row = dict(asdict(w), aten_ms=t_a, ours_ms=t_o, ratio=t_a / t_o, aten_mib=mem_a, ours_mib=mem_o, max_diff=diff,
                   configs={"x".join(map(str, c)): t for c, t in zip(configs, t_c)})
        rows.append(row)
        print(f"{name:<12} {w.what:<36} {t_a:9.3f} {t_o:9.3f} {t_a / t_o:9.2f} {mem_a:9.0f} {mem_o:9.0f} "
              f"{diff:10.2e}" + "".join(f" {t:12.3f}" for t in t_c), flush=True)
        del aten, ours, tuned
        api.empty_cache()
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python3 -m fastdeploy_ext.bench.deepseek_attention",
                                description="DeepSeek-OCR-2 attention: our Triton kernels vs ATen (CUDA)")
    p.add_argument("--workloads", default=",".join(WORKLOADS), help=f"comma-separated, of {', '.join(WORKLOADS)}")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--configs", default="", help='extra block configs of ours, "BM,BN,W,S;..."')
    a = p.parse_args(argv)
    try:
        configs = tuple(BlockConfig(*(int(x) for x in c.split(","))) for c in a.configs.split(";") if c.strip())
    except (TypeError, ValueError) as e:
        p.error(f"--configs: {e} (want \"BM,BN,W,S;...\", e.g. \"64,64,4,3\")")
    names = [n for n in a.workloads.split(",") if n]
    unknown = [n for n in names if n not in WORKLOADS]
    if unknown:
        p.error(f"unknown workload(s) {', '.join(unknown)}; known: {', '.join(WORKLOADS)}")
    if a.warmup < 0 or a.iters < 1:
        p.error("--warmup must be >= 0 and --iters >= 1")
    rows = run(names, getattr(torch, a.dtype), a.warmup, a.iters, configs)
    out = os.environ.get("OUT")
    if out:
        with open(os.path.join(out, "deepseek_attention.json"), "w") as f:
            json.dump({"dtype": a.dtype, "device": _device_name(device_api_for(DEVICE)), "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
