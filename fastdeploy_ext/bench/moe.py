"""`python3 -m fastdeploy_ext.bench.moe`: DeepSeek-OCR-2's MoE layer, ours vs the alternatives.

One MoE layer of the decoder at its real shape (hidden 1280, 64 routed experts of width 896,
top-6 softmax without renormalisation, 2 shared experts; random weights as ``--load-format
dummy`` draws them, the same in every column) for decode-sized (1, 64, 128 tokens) and prefill-sized (4096) batches:

- ``ours``: the family decoder's MoE layer with the ``triton_moe`` backend (the grouped GEMM,
  ops/triton/grouped_moe.py);
- ``aten_moe``: the same layer with the ATen experts (the fallback);
- ``tf_loop``: transformers' DeepseekOcr2TextMoe with its default experts (a Python loop over the
  experts that receive tokens; it reads the hit experts back to the host);
- ``tf_grouped_mm``: the same module with ``experts_implementation="grouped_mm"`` where torch
  has a grouped GEMM for the device.

Each column times the whole layer (router, routed experts, shared experts) eagerly; ``ours`` and
``aten_moe`` are also timed as one CUDA graph replay (the decode step runs in graphs; the
transformers loop cannot be captured). Ratios are the other's time over ours (> 1: ours faster).
Before timing, every column's output is compared with ours (cosine). Where the device has graphs the grouping of
rows by expert is also timed alone (graphed), torch ops vs the per-expert kernel, and the router
alone three ways (ATen; ATen's GEMM + the Triton tail; the Triton launch with the GEMM fused). Times are
medians of CUDA event timings (the device API's timer). Nothing here asserts a time.
"""
from __future__ import annotations

import argparse
import json
from dataclasses import dataclass

import torch

from ..device_api import device_api_for
from .timing import cosine, median_ms


@dataclass(frozen=True)
class MoEShape:
    hidden: int
    experts: int
    width: int
    top_k: int
    shared: int


RELEASED = MoEShape(hidden=1280, experts=64, width=896, top_k=6, shared=2)   # the family's TextConfig defaults
TINY = MoEShape(hidden=64, experts=8, width=32, top_k=3, shared=2)     # a CPU smoke run: the tiny checkpoint's
DEFAULT_TOKENS = (1, 64, 128, 4096)


def build_layers(shape: MoEShape, dtype: torch.dtype, device: torch.device, seed: int = 0):
    """(our MoE layer, transformers' DeepseekOcr2TextMoe with the same weights or None, why not).
    Ours is the family's own decoder (through the model-family seam: one MoE layer, random
    weights as ``--load-format dummy`` draws them), so the layer timed is the one the engine runs."""
    import dataclasses

    from ..models.registry import get_family
    family = get_family("deepseek_ocr2")
    cfg = family.default_config()
    heads = 10 if shape.hidden % 10 == 0 else 4
    text = dataclasses.replace(cfg.text, hidden_size=shape.hidden, moe_intermediate_size=shape.width,
                               n_routed_experts=shape.experts, num_experts_per_tok=shape.top_k,
                               n_shared_experts=shape.shared, num_hidden_layers=1, first_k_dense=0,
                               num_attention_heads=heads, num_key_value_heads=heads, vocab_size=256)
    decoder, _ = family.load_text(None, dtype=dtype, device=device, model_format="auto",
                                  cfg=dataclasses.replace(cfg, text=text))
    ours = decoder.layers[0].mlp
    try:
        from transformers.models.deepseek_ocr2.configuration_deepseek_ocr2 import DeepseekOcr2TextConfig
        from transformers.models.deepseek_ocr2.modeling_deepseek_ocr2 import DeepseekOcr2TextMoe
    except Exception as e:  # noqa: BLE001 - any import failure: no transformers columns
        return decoder, ours, None, f"transformers' DeepSeek-OCR-2 not importable ({type(e).__name__}: {e})"
    tc = DeepseekOcr2TextConfig(hidden_size=shape.hidden, moe_intermediate_size=shape.width,
                                num_experts=shape.experts, num_experts_per_tok=shape.top_k,
                                n_shared_experts=shape.shared, topk_method="greedy", routed_scaling_factor=1.0)
    tc._experts_implementation = "eager"
    ref = DeepseekOcr2TextMoe(tc)
    with torch.no_grad():
        ref.gate.weight.copy_(ours.gate.weight.float().cpu())
        ref.experts.gate_up_proj.copy_(ours.gate_up.float().cpu())
        ref.experts.down_proj.copy_(ours.down.float().cpu())
        for name in ("gate_proj", "up_proj", "down_proj"):
            getattr(ref.shared_experts, name).weight.copy_(getattr(ours.shared_experts, name).weight.float().cpu())
    ref = ref.to(device, dtype)
    ref.gate.float()                           # the router in fp32, as ours (the loader keeps it so)
    return decoder, ours, ref, ""


def _graphed(fn, api):
    """fn captured in one graph by the device API (warmed up on a side stream first): its replay."""
    graph, _ = api.capture_graph(fn, api.graph_pool(), stream=api.new_stream())
    return graph.replay


def _grouping_times(moe, x, warmup: int, iters: int, api) -> dict[str, float]:
    """The device-side grouping alone, graphed: torch ops vs the grouping kernel (a program per expert, which
    align_by_expert picks up to ALIGN_KERNEL_MAX_ROWS rows)."""
    from ..ops.triton.grouped_moe import align_by_expert, pick_blocks
    _, idx = moe.route(x)
    e = moe.gate_up.shape[0]
    bm = pick_blocks(idx.numel(), e).block_m
    return {f"group_{name}_graph": median_ms(_graphed(lambda kernel=kernel: align_by_expert(idx, e, bm, kernel=kernel),
                                                      api), warmup, iters, api)
            for name, kernel in (("torch", False), ("kernel", True))}


def _router_times(moe, x, warmup: int, iters: int, api) -> dict[str, float]:
    """The router alone, graphed, two ways: ATen (fp32 GEMM, softmax, topk), and ATen's GEMM +
    the Triton softmax top-k tail (router_topk)."""
    from ..ops.moe import aten_route
    from ..ops.triton.moe_routing import router_topk
    gate, k, scale = moe.gate.weight, moe.c.num_experts_per_tok, moe.c.routed_scaling_factor
    ways = {"aten": lambda: aten_route(x, gate, k, scale),
            "tail": lambda: router_topk(x, gate, k, scale)}
    return {f"route_{name}_graph": median_ms(_graphed(fn, api), warmup, iters, api) for name, fn in ways.items()}


def _config_times(moe, x, configs, warmup: int, iters: int, api) -> dict[str, float]:
    """The routed experts alone (grouped_moe on the layer's routing, graphed), with the tile
    table's pick and with each of ``configs`` (MoEBlocks): a sweep to tune pick_blocks by."""
    from ..ops.triton.grouped_moe import grouped_moe, pick_blocks
    w, idx = moe.route(x)
    picked = pick_blocks(idx.numel(), moe.gate_up.shape[0])
    out = {}
    for cfg in (picked, *configs):
        key = "routed_" + "x".join(str(v) for v in (cfg.block_m, cfg.block_n, cfg.block_k, cfg.num_warps,
                                                      cfg.num_stages))
        fn = _graphed(lambda cfg=cfg: grouped_moe(x, w, idx, moe.gate_up, moe.down, cfg), api)
        out[key + ("_picked" if cfg is picked else "")] = median_ms(fn, warmup, iters, api)
    return out


def run(shape: MoEShape, tokens, dtype: torch.dtype, device: torch.device, *, warmup: int, iters: int,
        graphs: bool, configs=()) -> list[dict]:
    from ..ops.moe import BUILTIN_MOE_BACKENDS
    backends = {b.name: b for b in BUILTIN_MOE_BACKENDS}
    decoder, ours, ref, ref_why = build_layers(shape, dtype, device)
    triton_ok, triton_why = backends["triton_moe"].available(device)
    api = device_api_for(device)
    rows = []
    for t in tokens:
        x = torch.randn(t, shape.hidden, generator=torch.Generator().manual_seed(t)).to(device, dtype)
        cols: dict[str, object] = {}
        notes: dict[str, str] = {}

        def layer(backend):
            def call():
                decoder.moe_experts = backends[backend]
                return ours(x)
            return call

        fns = {"aten_moe": layer("aten_moe")}
        if triton_ok:
            fns["ours"] = layer("triton_moe")
        else:
            notes["ours"] = triton_why
        if ref is not None:
            def tf(impl):
                def call():
                    ref.experts.config._experts_implementation = impl
                    return ref(x[None])[0]
                return call
            fns["tf_loop"] = tf("eager")
            fns["tf_grouped_mm"] = tf("grouped_mm")
        else:
            notes["tf_loop"] = notes["tf_grouped_mm"] = ref_why
        base_name = "ours" if "ours" in fns else "aten_moe"
        with torch.inference_mode():
            base = fns[base_name]()
            for name, fn in list(fns.items()):
                try:
                    cols[f"cos_{name}"] = round(cosine(fn(), base), 6)
                except Exception as e:  # noqa: BLE001 - a column that cannot run here is reported, not fatal
                    notes[name] = f"{type(e).__name__}: {str(e).splitlines()[0][:120]}"
                    del fns[name]
            for name, fn in fns.items():
                cols[name] = median_ms(fn, warmup, iters, api)
            if graphs and api.supports_graphs:
                for name in ("ours", "aten_moe"):
                    if name in fns:
                        cols[f"{name}_graph"] = median_ms(_graphed(fns[name], api), warmup, iters, api)
                if triton_ok:
                    cols.update(_grouping_times(ours, x, warmup, iters, api))
                    cols.update(_router_times(ours, x, warmup, iters, api))
                    if configs:
                        cols.update(_config_times(ours, x, configs, warmup, iters, api))
        decoder.moe_experts = backends["aten_moe"]
        ref_time = cols.get("ours")
        ratios = {f"{k}/ours": cols[k] / ref_time for k in ("aten_moe", "tf_loop", "tf_grouped_mm")
                  if ref_time and k in cols}
        if "ours_graph" in cols and "aten_moe_graph" in cols:
            ratios["aten_moe_graph/ours_graph"] = cols["aten_moe_graph"] / cols["ours_graph"]
        rows.append({"tokens": t, "base": base_name, **cols, **ratios, "notes": notes})
    return rows


def _fmt(v) -> str:
    return f"{v:8.3f}" if isinstance(v, float) else f"{'n/a':>8}"


def print_table(rows: list[dict], shape: MoEShape, dtype: torch.dtype, device: torch.device) -> None:
    print(f"MoE layer: {device.type} {str(dtype).removeprefix('torch.')}, hidden {shape.hidden}, {shape.experts} "
          f"experts x {shape.width}, top-{shape.top_k}, {shape.shared} shared (ms, median; ratio = other / ours)")
    cols = ("ours", "aten_moe", "tf_loop", "tf_grouped_mm", "ours_graph", "aten_moe_graph")
    ratios = ("aten_moe/ours", "tf_loop/ours", "tf_grouped_mm/ours", "aten_moe_graph/ours_graph")
    print(f"{'tokens':>6} " + " ".join(f"{c:>14}" for c in cols) + " | " + " ".join(f"{r:>25}" for r in ratios))
    for r in rows:
        print(f"{r['tokens']:>6} " + " ".join(f"{_fmt(r.get(c)):>14}" for c in cols) + " | "
              + " ".join(f"{_fmt(r.get(x)):>25}" for x in ratios))
    if any("group_torch_graph" in r for r in rows):
        print("grouping rows by expert alone (graphed, ms): torch ops vs the per-expert kernel")
        for r in rows:
            print(f"{r['tokens']:>6} torch {_fmt(r.get('group_torch_graph'))} kernel {_fmt(r.get('group_kernel_graph'))}")
    if any("route_aten_graph" in r for r in rows):
        print("router alone (graphed, ms): ATen GEMM + softmax + topk | ATen GEMM + Triton tail")
        for r in rows:
            print(f"{r['tokens']:>6} aten {_fmt(r.get('route_aten_graph'))} tail {_fmt(r.get('route_tail_graph'))}")
    if any(k.startswith("routed_") for r in rows for k in r):
        print("routed experts alone (graphed, ms), by tiles BMxBNxBKxWxS (_picked: pick_blocks' choice)")
        for r in rows:
            print(f"{r['tokens']:>6} " + "  ".join(f"{k[7:]} {r[k]:.3f}" for k in r if k.startswith("routed_")))
    for r in rows:
        cos = ", ".join(f"{k[4:]} {v:.5f}" for k, v in r.items() if k.startswith("cos_"))
        print(f"  tokens {r['tokens']}: cosine vs {r['base']}: {cos}" + "".join(
            f"; {k} n/a: {why}" for k, why in r["notes"].items()))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python3 -m fastdeploy_ext.bench.moe", description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    p.add_argument("--tokens", default=",".join(map(str, DEFAULT_TOKENS)), help="comma list of batch sizes (tokens)")
    p.add_argument("--shape", default="released", choices=("released", "tiny"))
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--no-graphs", action="store_true", help="skip the graph columns")
    p.add_argument("--json-out", default=None)
    p.add_argument("--configs", default="", help='extra tiles for the routed experts alone (graphed), '
                   '"BM,BN,BK,W,S;...", e.g. "16,64,128,4,4"')
    a = p.parse_args(argv)
    from ..ops.triton.grouped_moe import MoEBlocks
    try:
        configs = tuple(MoEBlocks(*(int(v) for v in c.split(","))) for c in a.configs.split(";") if c.strip())
    except (TypeError, ValueError) as e:
        p.error(f"--configs: {e} (want \"BM,BN,BK,W,S;...\")")
    try:
        tokens = [int(t) for t in a.tokens.split(",") if t.strip()]
    except ValueError:
        p.error(f"--tokens must be a comma list of ints, got {a.tokens!r}")
    if not tokens or min(tokens) < 1:
        p.error(f"--tokens must list positive token counts, got {a.tokens!r}")
    device = torch.device(a.device)
    dtype = getattr(torch, a.dtype)
    shape = RELEASED if a.shape == "released" else TINY
    rows = run(shape, tokens, dtype, device, warmup=a.warmup, iters=a.iters, graphs=not a.no_graphs,
               configs=configs)
    print_table(rows, shape, dtype, device)
    if a.json_out:
        with open(a.json_out, "w") as f:
            json.dump({"shape": shape.__dict__, "dtype": a.dtype, "device": str(device), "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
