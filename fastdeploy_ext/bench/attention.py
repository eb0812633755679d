"""GPU micro-benchmark: vision-encoder varlen attention backends (bf16, H=16, D=72).

Workloads (packed token counts):
  page     one 1080p page = 1 sequence of 10764 tokens
  blocks16 16 layout blocks [320,720,600,540,900,500,1024,576]*2
  small64  64 small blocks [320,180,240,240]*16
  one320   one 8x40 block of 320 tokens

Backends (q/k/v are strided views of one random packed qkv buffer [N, 3*H*D]):
  triton           fastdeploy_ext.ops.triton.varlen_attention.varlen_attention (one launch)
  triton_bm64      same with BLOCK_M=64 (its own block table)
  triton_rope      the triton_rope_varlen backend's work: q and k rotated in place by the
                   one-launch Triton pass (cos/sin [N, D] fp32), then the kernel
  triton_BMxBNwWsS   extra configs given with --configs "BM,BN,W,S;..."
  rotary+triton    out-of-place rotary in torch (fp32, cast) + triton (what the pass replaces)
  sdpa_cudnn_loop  per-image loop of F.scaled_dot_product_attention (CUDNN_ATTENTION), output
                   copied into a [N, H, D] buffer (the reference for errors and ratios)
  sdpa_flash_loop  same with FLASH_ATTENTION
  flex             torch.compile(flex_attention) with a document block mask (mask built once,
                   outside the timing)
  sdpa_cudnn_single  one SDPA cuDNN call over the single image, no copy back (1-image only)

Usage:  fastdeploy-ext bench attention [--quick] [--no-flex] [--sweep] [--configs ...] [--diag]
        (= python -m fastdeploy_ext.bench.attention)
Writes $OUT/attn_bench.json when OUT is set.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import statistics
import sys
import time
import traceback

import torch
import torch.nn.functional as F

from . import BenchError
from ..device_api import device_api_for
from .timing import call_times_ms

WORKLOADS: dict[str, list[int]] = {
    "page": [10764],
    "blocks16": [320, 720, 600, 540, 900, 500, 1024, 576] * 2,
    "small64": [320, 180, 240, 240] * 16,
    "one320": [320],
}
H = 16
D = 72


def _time_ms(fn, warmup: int, iters: int) -> tuple[float, list[float]]:
    """Median of per-call CUDA-event times (ms), and the times."""
    times = call_times_ms(fn, warmup, iters, device_api_for("cuda"))
    return statistics.median(times), times


def _rotate_half(x):
    h = x.shape[-1] // 2
    return torch.cat([-x[..., h:], x[..., :h]], dim=-1)


def _apply_rotary(x, cos, sin):
    xf = x.float()
    return (xf * cos[:, None, :] + _rotate_half(xf) * sin[:, None, :]).to(x.dtype)


def _sdpa_loop(q, k, v, lens, out, backend):
    from torch.nn.attention import sdpa_kernel

    with sdpa_kernel(backend):
        s = 0
        for n in lens:
            qi = q[s:s + n].transpose(0, 1).unsqueeze(0)
            ki = k[s:s + n].transpose(0, 1).unsqueeze(0)
            vi = v[s:s + n].transpose(0, 1).unsqueeze(0)
            oi = F.scaled_dot_product_attention(qi, ki, vi)
            out[s:s + n].copy_(oi[0].transpose(0, 1))
            s += n
    return out


def _make_inputs(lens, device, dtype=torch.bfloat16, seed=0):
    n = sum(lens)
    g = torch.Generator(device=device).manual_seed(seed)
    qkv = torch.randn(n, 3 * H * D, device=device, dtype=dtype, generator=g)
    q, k, v = qkv.view(n, 3, H, D).unbind(1)
    ang = torch.rand(n, D // 2, device=device, generator=g) * 50.0
    ang = torch.cat([ang, ang], dim=-1)
    return qkv, q, k, v, ang.cos().contiguous(), ang.sin().contiguous()


def run_workload(name, lens, args, ta, results):
    dev = "cuda"
    n = sum(lens)
    flops = sum(4.0 * m * m * H * D for m in lens)
    scale = D ** -0.5
    _qkv, q, k, v, cos, sin = _make_inputs(lens, dev)   # q/k/v: strided views of _qkv
    max_len = max(lens)
    warm, iters = (2, 5) if args.quick else (5, 20)

    outs: dict[str, torch.Tensor] = {}
    rows = []

    def bench(backend, fn, ref_key="sdpa_cudnn_loop", out_getter=None):
        rec = {"workload": name, "backend": backend, "tokens": n, "images": len(lens)}
        try:
            t0 = time.time()
            o = fn()
            torch.cuda.synchronize()
            rec["first_call_s"] = round(time.time() - t0, 3)
            ms, all_ms = _time_ms(fn, warm, iters)
            rec["ms"] = ms
            rec["ms_min"] = min(all_ms)
            rec["tflops"] = flops / (ms * 1e-3) / 1e12
            if out_getter is not None:
                o = out_getter(o)
            outs[backend] = o.detach().clone() if o is not None else None
        except Exception as e:  # noqa: BLE001 - one backend failing must not stop the run
            rec["error"] = f"{type(e).__name__}: {e}"[:500]
            if args.verbose:
                traceback.print_exc()
        rec["_ref"] = ref_key
        rows.append(rec)

    out_buf = torch.empty(n, H, D, device=dev, dtype=q.dtype)

    # cuDNN loop first: it is the reference
    from torch.nn.attention import SDPBackend

    bench("sdpa_cudnn_loop", lambda: _sdpa_loop(q, k, v, lens, torch.empty_like(out_buf), SDPBackend.CUDNN_ATTENTION))
    bench("sdpa_flash_loop", lambda: _sdpa_loop(q, k, v, lens, torch.empty_like(out_buf), SDPBackend.FLASH_ATTENTION))

    if ta is not None:
        bt = ta.build_block_table(lens).to(dev)
        bench("triton", lambda: ta.varlen_attention(q, k, v, bt, max_len, scale, out=out_buf))
        bt64 = ta.build_block_table(lens, block_m=64).to(dev)
        out64 = torch.empty_like(out_buf)
        bench("triton_bm64", lambda: ta.varlen_attention(q, k, v, bt64, max_len, scale, out=out64, block_m=64))
        # rotary: reference is rotary-applied inputs through the (non-fused) triton kernel
        out_r = torch.empty_like(out_buf)
        bench("rotary+triton",
              lambda: ta.varlen_attention(_apply_rotary(q, cos, sin), _apply_rotary(k, cos, sin), v, bt, max_len,
                                          scale, out=out_r), ref_key="sdpa_cudnn_loop_rotary")
        # in place on a scratch copy of the packed buffer: the first call (whose output is
        # checked) rotates the original values; later timed calls rotate again (same cost)
        from fastdeploy_ext.ops.rotary import rotary_q_and_k_in_place
        scratch = _qkv.clone()
        qs, ks, vs = scratch.view(n, 3, H, D).unbind(1)
        out_f = torch.empty_like(out_buf)

        def rope_then_kernel():
            rotary_q_and_k_in_place(qs, ks, cos, sin)
            return ta.varlen_attention(qs, ks, vs, bt, max_len, scale, out=out_f)
        bench("triton_rope", rope_then_kernel, ref_key="sdpa_cudnn_loop_rotary")
        for spec in [c for c in (args.configs or "").split(";") if c.strip()]:
            bm, bn, nw, ns = (int(x) for x in spec.split(","))
            btc = ta.build_block_table(lens, block_m=bm).to(dev)
            outc = torch.empty_like(out_buf)
            bench(f"triton_{bm}x{bn}w{nw}s{ns}",
                  functools.partial(ta.varlen_attention, q, k, v, btc, max_len, scale, out=outc, block_m=bm,
                                    block_n=bn, num_warps=nw, num_stages=ns))

    if not args.no_flex:
        try:
            from torch.nn.attention.flex_attention import (
                create_block_mask,
                flex_attention,
            )

            doc = torch.repeat_interleave(torch.arange(len(lens), device=dev),
                                          torch.tensor(lens, device=dev))

            def doc_mask(b, h, q_idx, kv_idx):
                return doc[q_idx] == doc[kv_idx]

            t0 = time.time()
            bm = create_block_mask(doc_mask, None, None, n, n, device=dev)
            torch.cuda.synchronize()
            mask_s = time.time() - t0
            flex = torch.compile(flex_attention, dynamic=False)
            qf, kf, vf = (t.transpose(0, 1).unsqueeze(0) for t in (q, k, v))
            bench("flex", lambda: flex(qf, kf, vf, block_mask=bm, scale=scale),
                  out_getter=lambda o: o[0].transpose(0, 1))
            rows[-1]["block_mask_s"] = round(mask_s, 4)
        except Exception as e:  # noqa: BLE001
            rows.append({"workload": name, "backend": "flex", "error": f"{type(e).__name__}: {e}"[:500],
                         "_ref": "sdpa_cudnn_loop"})

    if len(lens) == 1:
        from torch.nn.attention import sdpa_kernel

        qs, ks, vs = (t.transpose(0, 1).unsqueeze(0) for t in (q, k, v))

        def single():
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                return F.scaled_dot_product_attention(qs, ks, vs)

        bench("sdpa_cudnn_single", single, out_getter=lambda o: o[0].transpose(0, 1))

    # rotary reference: cuDNN loop on rotated inputs (computed once, not timed)
    try:
        from torch.nn.attention import SDPBackend as _B

        outs["sdpa_cudnn_loop_rotary"] = _sdpa_loop(_apply_rotary(q, cos, sin), _apply_rotary(k, cos, sin), v, lens,
                                                    torch.empty_like(out_buf), _B.CUDNN_ATTENTION)
    except Exception as e:  # noqa: BLE001
        print(f"# {name}: rotary reference failed: {e}", file=sys.stderr)

    base_ms = next((r.get("ms") for r in rows if r["backend"] == "sdpa_cudnn_loop"), None)
    for r in rows:
        ref_key = r.pop("_ref", "sdpa_cudnn_loop")
        o, ref = outs.get(r["backend"]), outs.get(ref_key)
        if o is not None and ref is not None and r["backend"] != ref_key:
            r["max_abs_err"] = (o.float() - ref.float()).abs().max().item()
            r["err_vs"] = ref_key
        if base_ms and r.get("ms"):
            r["speedup_vs_cudnn_loop"] = base_ms / r["ms"]
        results.append(r)
    outs.clear()
    torch.cuda.empty_cache()


def run_sweep(args, ta, results):
    """Time the triton kernel over a small config grid per workload (for picking defaults)."""
    warm, iters = (2, 5) if args.quick else (3, 10)
    scale = D ** -0.5
    for name, lens in WORKLOADS.items():
        _, q, k, v, _cos, _sin = _make_inputs(lens, "cuda")
        flops = sum(4.0 * m * m * H * D for m in lens)
        out = torch.empty(sum(lens), H, D, device="cuda", dtype=q.dtype)
        best = None
        for bm in (64, 128):
            bt = ta.build_block_table(lens, block_m=bm).cuda()
            for bn in (32, 64, 128):
                for nw in (4, 8):
                    for ns in (2, 3, 4):
                        kw = {"block_m": bm, "block_n": bn, "num_warps": nw, "num_stages": ns}
                        rec = {"sweep": name, **kw}
                        try:
                            fn = functools.partial(ta.varlen_attention, q, k, v, bt, max(lens), scale, out=out, **kw)
                            ms, _ = _time_ms(fn, warm, iters)
                            rec["ms"] = ms
                            rec["tflops"] = flops / (ms * 1e-3) / 1e12
                            if best is None or ms < best["ms"]:
                                best = rec
                        except Exception as e:  # noqa: BLE001
                            rec["error"] = f"{type(e).__name__}: {e}"[:300]
                        results.append(rec)
                        print(json.dumps(rec), flush=True)
        print(f"# best for {name}: {best}", flush=True)


def print_diag(ta) -> list[dict]:
    """Registers / spills / shared memory / wgmma use of every compiled variant of the kernel."""
    recs = []
    kern = getattr(ta, "_KERNEL", None)
    caches = getattr(kern, "device_caches", None) or {}
    for entry in caches.values():
        cache = entry[0] if isinstance(entry, tuple) else entry
        for key, ck in list(cache.items()):
            rec = {}
            try:
                if hasattr(ck, "_init_handles"):
                    ck._init_handles()
                md = getattr(ck, "metadata", None)
                ptx = ck.asm.get("ptx", "") if hasattr(ck, "asm") else ""
                rec = {
                    "n_regs": getattr(ck, "n_regs", None), "n_spills": getattr(ck, "n_spills", None),
                    "num_warps": getattr(md, "num_warps", None), "num_stages": getattr(md, "num_stages", None),
                    "shared": getattr(md, "shared", None),
                    "wgmma": ptx.count("wgmma.mma_async"), "mma_sync": ptx.count("mma.sync"),
                    "cp_async": ptx.count("cp.async"), "ld_global_v4": ptx.count("ld.global.v4"),
                    "key": str(key)[-300:],
                }
            except Exception as e:  # noqa: BLE001
                rec = {"error": str(e)[:200], "key": str(key)[-300:]}
            recs.append(rec)
            print("# diag " + json.dumps(rec), flush=True)
    return recs


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--quick", action="store_true", help="fewer warmup/timed iterations")
    ap.add_argument("--no-flex", action="store_true", help="skip FlexAttention (torch.compile takes a while)")
    ap.add_argument("--sweep", action="store_true", help="also sweep triton block sizes / warps / stages")
    ap.add_argument("--workloads", default=",".join(WORKLOADS), help="comma list of " + ",".join(WORKLOADS))
    ap.add_argument("--configs", default="", help='extra triton configs to time: "BM,BN,WARPS,STAGES;..."')
    ap.add_argument("--diag", action="store_true", help="print regs/spills/smem/wgmma of compiled kernels")
    ap.add_argument("-v", "--verbose", action="store_true", help="print tracebacks of failing backends")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(ap)
    try:
        return run_cli(ap.parse_args(argv))
    except BenchError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


def run_cli(args) -> int:
    """`fastdeploy-ext bench attention` / `python -m fastdeploy_ext.bench.attention`."""
    unknown = [w for w in args.workloads.split(",") if w and w not in WORKLOADS]
    if unknown:
        raise BenchError(f"unknown workloads {unknown}; known: {', '.join(WORKLOADS)}")
    if not torch.cuda.is_available():
        raise BenchError("needs a CUDA device (it times CUDA attention kernels); this machine has none")
    try:
        from fastdeploy_ext.ops.triton import varlen_attention as ta
        from fastdeploy_ext.ops.triton.runtime import triton_available

        ok, why = triton_available()
        if not ok:
            print(f"triton kernel unavailable: {why}", file=sys.stderr)
            ta = None
    except Exception as e:  # noqa: BLE001
        print(f"triton kernel import failed: {e}", file=sys.stderr)
        ta = None

    import triton as _triton  # noqa: F401 - version print only

    t_start = time.time()
    env = {"torch": torch.__version__, "cuda": torch.version.cuda, "device": torch.cuda.get_device_name(),
           "triton": getattr(sys.modules.get("triton"), "__version__", None),
           "cudnn": torch.backends.cudnn.version(), "H": H, "D": D, "dtype": "bfloat16"}
    print("# " + json.dumps(env), flush=True)
    results: list[dict] = []
    for name in [w for w in args.workloads.split(",") if w]:
        run_workload(name, WORKLOADS[name], args, ta, results)
    sweep: list[dict] = []
    if args.sweep and ta is not None:
        run_sweep(args, ta, sweep)

    diag = print_diag(ta) if (args.diag and ta is not None) else []
    hdr = f"{'workload':<9} {'backend':<20} {'ms':>9} {'TFLOP/s':>8} {'x cudnn':>8} {'max_abs_err':>12}  note"
    print(hdr)
    print("-" * len(hdr))
    for r in results:
        if "error" in r:
            print(f"{r['workload']:<9} {r['backend']:<20} {'-':>9} {'-':>8} {'-':>8} {'-':>12}  ERROR {r['error'][:90]}")
            continue
        err = r.get("max_abs_err")
        note = f"vs {r['err_vs']}" if r.get("err_vs") and r["err_vs"] != "sdpa_cudnn_loop" else ""
        print(f"{r['workload']:<9} {r['backend']:<20} {r['ms']:>9.4f} {r['tflops']:>8.1f} "
              f"{r.get('speedup_vs_cudnn_loop', float('nan')):>8.2f} "
              f"{(f'{err:.2e}' if err is not None else '-'):>12}  {note}")
    total = time.time() - t_start
    print(f"# total {total:.1f} s")
    out_dir = os.environ.get("OUT")
    if out_dir:
        os.makedirs(out_dir, exist_ok=True)
        with open(os.path.join(out_dir, "attn_bench.json"), "w") as f:
            json.dump({"env": env, "results": results, "sweep": sweep, "diag": diag, "total_s": total}, f, indent=1,
                      default=lambda x: None if isinstance(x, float) and math.isnan(x) else str(x))
        print(f"# wrote {os.path.join(out_dir, 'attn_bench.json')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
