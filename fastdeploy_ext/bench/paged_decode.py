"""GPU micro-benchmark: the Triton paged decode kernel (ops/triton/paged_attention.py) at a
decoder's shape against torch SDPA on the same keys and values laid out densely (no paging: the
reference a paged kernel would like to match), plus any other launch tiles of ours, in one run.

Default shape: DeepSeek-OCR-2's decoder (10 heads x 128, MHA) at batch 64 with ~1.9k tokens of
context each, KV blocks of 64 tokens scattered over the pool, the partition count set by a
graph's max context (``--max-context``) as a captured decode step has it. Per column: median ms
per call, the K/V bytes read per second, and sdpa/ours (above 1: ours faster); the max abs
difference of ours against SDPA.

Usage:  python3 -m fastdeploy_ext.bench.paged_decode [--batch 64] [--context 1900] [--heads 10]
        [--kv-heads 10] [--head-dim 128] [--block-size 64] [--max-context 2304]
        [--tiles "256,4,3;128,4,3;512,8,3"] [--iters 50]
Writes $OUT/paged_decode.json when OUT is set.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

import torch
import torch.nn.functional as F

from ..device_api import device_api_for
from ..ops.triton.paged_attention import DEFAULT_DECODE_TILES, DecodeTiles, paged_decode
from ..ops.triton.runtime import interpreted
from .timing import call_times_ms


def make_inputs(batch: int, context: int, heads: int, kv_heads: int, head_dim: int, block_size: int,
                dtype: torch.dtype, device, seed: int = 0):
    """q [B, H, D]; a paged pool whose blocks are handed to the sequences in a random order; the
    same keys and values dense [B, KVH, ctx, D] for SDPA."""
    g = torch.Generator().manual_seed(seed)
    per_seq = -(-context // block_size)
    nblocks = batch * per_seq + 1
    k_cache = torch.randn(nblocks, block_size, kv_heads, head_dim, generator=g).to(device, dtype)
    v_cache = torch.randn(nblocks, block_size, kv_heads, head_dim, generator=g).to(device, dtype)
    tables = (torch.randperm(nblocks - 1, generator=g)[:batch * per_seq] + 1).view(batch, per_seq)
    q = torch.randn(batch, heads, head_dim, generator=g).to(device, dtype)
    lens = torch.full((batch,), context, dtype=torch.int32)
    flat = tables.to(device).reshape(-1).long()

    def dense(cache):                     # [B, KVH, ctx, D]
        return cache[flat].view(batch, per_seq * block_size, kv_heads, head_dim)[:, :context].transpose(1, 2)
    return q, k_cache, v_cache, tables.to(device, torch.int32), lens.to(device), dense(k_cache), dense(v_cache)


def run(a) -> dict:
    device = torch.device(a.device)
    api = device_api_for(a.device)
    dtype = getattr(torch, a.dtype)
    q, kc, vc, tables, lens, kd, vd = make_inputs(a.batch, a.context, a.heads, a.kv_heads, a.head_dim,
                                                  a.block_size, dtype, device)
    scale = a.head_dim ** -0.5
    group = a.heads // a.kv_heads
    kd_q, vd_q = (kd.repeat_interleave(group, 1), vd.repeat_interleave(group, 1)) if group > 1 else (kd, vd)

    def sdpa():
        return F.scaled_dot_product_attention(q[:, :, None], kd_q, vd_q, scale=scale)[:, :, 0]

    def ours(tiles: DecodeTiles):
        return lambda: paged_decode(q, kc, vc, tables, lens, scale, max_context_len=a.max_context, tiles=tiles)

    tiles = [DEFAULT_DECODE_TILES] + [t for t in a.tiles if t != DEFAULT_DECODE_TILES]
    kv_bytes = 2 * a.batch * a.context * a.kv_heads * a.head_dim * torch.finfo(dtype).bits // 8
    ref = sdpa()
    t_ref = statistics.median(call_times_ms(sdpa, a.warmup, a.iters, api))
    print(f"paged decode  batch {a.batch} x context {a.context}, {a.heads} q / {a.kv_heads} kv heads x "
          f"{a.head_dim}, blocks of {a.block_size}, max context {a.max_context}, {a.dtype}: "
          f"{kv_bytes / 2**20:.0f} MiB of K/V a call  (sdpa/ours > 1: ours faster)")
    print(f"{'column':<28} {'ms':>8} {'GB/s':>8} {'sdpa/ours':>9} {'max|diff|':>10}")
    print(f"{'sdpa dense (reference)':<28} {t_ref:8.4f} {kv_bytes / t_ref / 1e6:8.0f} {1.0:9.2f} {0.0:10.2e}")
    rows = [dict(column="sdpa", ms=t_ref, gbps=kv_bytes / t_ref / 1e6)]
    for t in tiles:
        fn = ours(t)
        diff = (fn().float() - ref.float()).abs().max().item()
        ms = statistics.median(call_times_ms(fn, a.warmup, a.iters, api))
        name = f"ours {t.part_tokens},{t.num_warps},{t.num_stages}" + (" (default)" if t == DEFAULT_DECODE_TILES else "")
        print(f"{name:<28} {ms:8.4f} {kv_bytes / ms / 1e6:8.0f} {t_ref / ms:9.2f} {diff:10.2e}", flush=True)
        rows.append(dict(column=name, part_tokens=t.part_tokens, num_warps=t.num_warps, num_stages=t.num_stages,
                         ms=ms, gbps=kv_bytes / ms / 1e6, ratio=t_ref / ms, max_diff=diff))
    return dict(shape=dict(batch=a.batch, context=a.context, heads=a.heads, kv_heads=a.kv_heads,
                           head_dim=a.head_dim, block_size=a.block_size, max_context=a.max_context,
                           dtype=a.dtype), rows=rows)


def _tiles(text: str) -> list[DecodeTiles]:
    try:
        return [DecodeTiles(*(int(x) for x in c.split(","))) for c in text.split(";") if c.strip()]
    except (TypeError, ValueError) as e:
        raise argparse.ArgumentTypeError(f"{e} (want \"PART_TOKENS,WARPS,STAGES;...\", e.g. \"256,4,3\")") from e


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python3 -m fastdeploy_ext.bench.paged_decode",
                                description="paged decode attention: our Triton kernel vs dense SDPA (CUDA)")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--context", type=int, default=1900)
    p.add_argument("--heads", type=int, default=10)
    p.add_argument("--kv-heads", type=int, default=10)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--block-size", type=int, default=64)
    p.add_argument("--max-context", type=int, default=None, help="the graph's max context (default context + 404)")
    p.add_argument("--tiles", type=_tiles, default=[], help='other launch tiles of ours, "PART,WARPS,STAGES;..."')
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--device", default="cuda", help="cuda (the CPU only under TRITON_INTERPRET=1, as a smoke run)")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--iters", type=int, default=50)
    a = p.parse_args(argv)
    if min(a.batch, a.context, a.heads, a.kv_heads, a.head_dim) < 1 or a.heads % a.kv_heads:
        p.error("sizes must be >= 1 and --heads a multiple of --kv-heads")
    a.max_context = a.max_context or a.context + 404
    if a.max_context < a.context:
        p.error("--max-context must be >= --context")
    from ..ops.triton.runtime import available_on
    ok, why = available_on(torch.device(a.device))
    if not ok and not (a.device == "cpu" and interpreted()):
        raise SystemExit(f"paged_decode bench: the Triton kernel cannot run on {a.device}: {why}")
    result = run(a)
    out = os.environ.get("OUT")
    if out:
        with open(os.path.join(out, "paged_decode.json"), "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
