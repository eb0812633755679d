"""GPU micro-benchmark of the non-attention ops of one encoder layer: ATen (what the eager layer
and transformers run) vs ours (the fused Triton passes, the GELU GEMM epilogue, a padded MLP
width), side by side per token count, with the max error of ours against ATen.

Usage:  fastdeploy-ext bench layers [--tokens 10764,15680,512,320] [--iters 20] [--tune]
        (= python -m fastdeploy_ext.bench.layer_ops)
Prints one table; writes $OUT/layer_ops.json when OUT is set.  Nothing asserts a time.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import torch.nn.functional as F

from ..ops.norm import add_layer_norm
from ..ops.rotary import rotary_in_place, rotary_qk_in_place
from . import BenchError
from ..device_api import device_api_for
from .timing import median_ms

HIDDEN, INTER, HEADS, HEAD_DIM = 1152, 4304, 16, 72


def _time_device(fn, reps: int = 10, iters: int = 10) -> float:
    """Device time of one call: fn captured `reps` times in a CUDA graph and replayed, so
    Python launch overhead (large for Triton launches) is not in the figure."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(reps):
            fn()
    return median_ms(g.replay, 2, iters, device_api_for("cuda")) / reps


def _pad_rows(w: torch.Tensor, rows: int) -> torch.Tensor:
    return torch.cat([w, w.new_zeros(rows - w.shape[0], *w.shape[1:])]) if rows > w.shape[0] else w


def run(tokens: list[int], iters: int, warmup: int, pad_to: int) -> list[dict]:
    dev, dt = torch.device("cuda"), torch.bfloat16
    g = torch.Generator(device="cpu").manual_seed(0)

    def rnd(*shape, s=1.0):
        return (torch.randn(*shape, generator=g) * s).to(dev, dt)

    w_qkv, b_qkv = rnd(3 * HIDDEN, HIDDEN, s=0.03), rnd(3 * HIDDEN, s=0.1)
    w_o, b_o = rnd(HIDDEN, HIDDEN, s=0.03), rnd(HIDDEN, s=0.1)
    w1, b1 = rnd(INTER, HIDDEN, s=0.03), rnd(INTER, s=0.1)
    w2, b2 = rnd(HIDDEN, INTER, s=0.015), rnd(HIDDEN, s=0.1)
    ln_w, ln_b = rnd(HIDDEN, s=0.1) + 1, rnd(HIDDEN, s=0.1)
    inter_p = -(-INTER // pad_to) * pad_to
    w1p, b1p = _pad_rows(w1, inter_p), _pad_rows(b1, inter_p)
    w2p = _pad_rows(w2.t(), inter_p).t().contiguous()
    rows = []
    for n in tokens:
        x, a = rnd(n, HIDDEN), rnd(n, HIDDEN)
        h = F.layer_norm(x, (HIDDEN,), ln_w, ln_b, 1e-6)
        m = F.gelu(F.linear(h, w1, b1), approximate="tanh")
        qkv = F.linear(h, w_qkv, b_qkv)
        cos, sin = (torch.randn(n, HEAD_DIM, generator=g).to(dev) for _ in range(2))

        def aten_add_ln():
            return F.layer_norm(x + F.linear(a, w_o, b_o), (HIDDEN,), ln_w, ln_b, 1e-6)

        def ours_add_ln():
            return add_layer_norm(x, torch.mm(a, w_o.t()), b_o, ln_w, ln_b, 1e-6)[1]

        def aten_fc1():
            return F.gelu(F.linear(h, w1, b1), approximate="tanh")

        def ours_fc1():
            return torch._addmm_activation(b1, h, w1.t(), use_gelu=True)

        def ours_fc1_pad():
            return torch._addmm_activation(b1p, h, w1p.t(), use_gelu=True)

        mp = F.pad(m, (0, inter_p - INTER))

        def aten_fc2():
            return F.linear(m, w2, b2)

        def ours_fc2_pad():
            return F.linear(mp, w2p, b2)

        qkv_a, qkv_b = qkv.clone(), qkv.clone()

        def aten_rotary():
            q, k, _ = qkv_a.view(n, 3, HEADS, HEAD_DIM).unbind(1)
            rotary_in_place(q, cos, sin)
            rotary_in_place(k, cos, sin)

        def ours_rotary():
            rotary_qk_in_place(qkv_b[:, :2 * HIDDEN].view(n, 2 * HEADS, HEAD_DIM), cos, sin)

        def aten_mlp_half():   # out_proj + residual -> LN -> fc1 + GELU -> fc2 + residual -> next LN
            y = x + F.linear(a, w_o, b_o)
            z = F.gelu(F.linear(F.layer_norm(y, (HIDDEN,), ln_w, ln_b, 1e-6), w1, b1), approximate="tanh")
            y = y + F.linear(z, w2, b2)
            return F.layer_norm(y, (HIDDEN,), ln_w, ln_b, 1e-6)

        def ours_mlp_half(w1_=w1, b1_=b1, w2_=w2):
            y, hh = add_layer_norm(x, torch.mm(a, w_o.t()), b_o, ln_w, ln_b, 1e-6)
            z = torch._addmm_activation(b1_, hh, w1_.t(), use_gelu=True)
            return add_layer_norm(y, torch.mm(z, w2_.t()), b2, ln_w, ln_b, 1e-6)[1]

        cases = [
            ("out_proj+residual+LayerNorm", aten_add_ln, ours_add_ln),
            ("fc1+GELU", aten_fc1, ours_fc1),
            (f"fc1+GELU, width {inter_p}", aten_fc1, ours_fc1_pad),
            (f"fc2, width {inter_p}", aten_fc2, ours_fc2_pad),
            ("q/k rotary", aten_rotary, ours_rotary),
            ("MLP half (out_proj..next LN)", aten_mlp_half, ours_mlp_half),
            (f"MLP half, width {inter_p}", aten_mlp_half, lambda: ours_mlp_half(w1p, b1p, w2p)),
        ]
        for name, ref_fn, our_fn in cases:
            cuda = device_api_for("cuda")
            t_ref, t_our = median_ms(ref_fn, warmup, iters, cuda), median_ms(our_fn, warmup, iters, cuda)
            d_ref, d_our = _time_device(ref_fn), _time_device(our_fn)
            err = None
            if "rotary" in name:
                qkv_a.copy_(qkv)
                qkv_b.copy_(qkv)
                aten_rotary()
                ours_rotary()
                err = (qkv_a.float() - qkv_b.float()).abs().max().item()
            else:
                r, o = ref_fn(), our_fn()
                o = o[:, :r.shape[1]]
                err = (r.float() - o.float()).abs().max().item()
            rows.append({"tokens": n, "op": name, "aten_ms": t_ref, "ours_ms": t_our, "speedup": t_ref / t_our,
                         "aten_device_ms": d_ref, "ours_device_ms": d_our, "max_abs_err": err})
            print(f"{n:>6} {name:<32} eager: aten {t_ref:7.4f} ours {t_our:7.4f} ms x{t_ref / t_our:5.2f} | "
                  f"device: aten {d_ref:7.4f} ours {d_our:7.4f} ms x{d_ref / d_our:5.2f} | max|err| {err:.3g}",
                  flush=True)
    return rows


def tune(tokens: list[int]) -> list[dict]:
    """Device time of the two Triton passes over their launch parameters (picks the defaults)."""
    dev, dt = torch.device("cuda"), torch.bfloat16
    out = []
    for n in tokens:
        x, d = torch.randn(n, HIDDEN, device=dev, dtype=dt), torch.randn(n, HIDDEN, device=dev, dtype=dt)
        w, b = torch.randn(HIDDEN, device=dev, dtype=dt), torch.randn(HIDDEN, device=dev, dtype=dt)
        ref = _time_device(lambda: F.layer_norm(x + d + b, (HIDDEN,), w, b, 1e-6))
        # small grids: the first, larger ones did not finish inside the GPU leg's time limit
        for rows in (1, 2, 4):
            for warps in (4, 8):
                ms = _time_device(lambda: add_layer_norm(x, d, b, w, b, 1e-6, tuning=(rows, warps)))
                out.append({"tokens": n, "kernel": "add_ln", "rows": rows, "warps": warps, "ms": ms, "aten_ms": ref})
        qkv = torch.randn(n, 3 * HIDDEN, device=dev, dtype=dt)
        cos, sin = torch.randn(n, HEAD_DIM, device=dev), torch.randn(n, HEAD_DIM, device=dev)
        qk = qkv[:, :2 * HIDDEN].view(n, 2 * HEADS, HEAD_DIM)
        for bt in (16, 32, 64):
            for grp in (2, 4, 8):
                for warps in (4,):
                    ms = _time_device(lambda: rotary_qk_in_place(qk, cos, sin, tuning=(bt, grp, warps)))
                    out.append({"tokens": n, "kernel": "rotary_qk", "block_t": bt, "heads": grp, "warps": warps,
                                "ms": ms})
        for kern in ("add_ln", "rotary_qk"):
            best = sorted((r for r in out if r["tokens"] == n and r["kernel"] == kern), key=lambda r: r["ms"])[:3]
            print(f"# tune {n} {kern}: " + " | ".join(json.dumps(r) for r in best), flush=True)
    return out


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--tokens", default="10764,15680,512,320", help="comma list of token counts")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--pad-to", type=int, default=128, help="pad the MLP width to a multiple of this")
    ap.add_argument("--tune", action="store_true", help="also sweep the Triton passes' launch parameters")


def run_cli(args) -> int:
    """`fastdeploy-ext bench layers` / `python -m fastdeploy_ext.bench.layer_ops`."""
    try:
        tokens = [int(t) for t in args.tokens.split(",") if t.strip()]
    except ValueError:
        raise BenchError(f"--tokens must be a comma list of positive ints, got {args.tokens!r}") from None
    if not tokens or min(tokens) < 1 or args.pad_to < 1 or args.iters < 1 or args.warmup < 0:
        raise BenchError("--tokens, --pad-to and --iters must be positive, --warmup >= 0")
    if not torch.cuda.is_available():
        raise BenchError("needs a CUDA device (it times CUDA kernels: cuBLASLt epilogues, Triton); "
                         "this machine has none")
    print(f"# {torch.cuda.get_device_name()} torch {torch.__version__} bf16, hidden {HIDDEN}, MLP {INTER}")
    rows = run(tokens, args.iters, args.warmup, args.pad_to)
    if args.tune:
        rows += tune(tokens)
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "layer_ops.json"), "w") as f:
            json.dump(rows, f, indent=1)
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_arguments(ap)
    try:
        return run_cli(ap.parse_args(argv))
    except BenchError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
