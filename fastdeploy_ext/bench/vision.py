"""`fastdeploy-ext bench vision`: the transformers reference and our plan variants side by side,
in one process on one device, on the anchor workloads (WORKLOADS: the shapes of the H200
baseline measurements quoted in docs/PERFORMANCE.md).

Prints ms per batch, speed-up over the reference (ref ms / ours ms), peak memory, and how close
each variant's output is to the reference (cosine). Nothing here asserts a time."""
from __future__ import annotations

import argparse
import gc
import json
import logging
from dataclasses import dataclass, replace
from functools import partial

import torch

from ..device_api import DeviceAPI
from ..plan import PlanError, PlanRequest
from ..runner import ModelSource, choose_device
from . import BenchError
from .timing import Timer, cosine, peak_gib, reset_peak

log = logging.getLogger(__name__)

WORKLOADS = {
    "page": [(1, 78, 138)],                                                            # 1080p page, 10764 patches
    "blocks16": [(1, h, w) for h, w in [(8, 40), (12, 60), (20, 30), (6, 90), (30, 30), (10, 50), (16, 64),
                                        (24, 24)] * 2],                                 # 10360 patches
    "block8x40": [(1, 8, 40)],
    "small64": [(1, h, w) for h, w in [(8, 40), (6, 30), (10, 24), (4, 60)] * 16],       # 15680 patches
    # an A4 scan at 300 dpi (3508x2480) resized to the released checkpoint's max_pixels (2822400):
    # smart_resize -> 1988x1400, 14200 patches in one sequence
    "scan": [(1, 142, 100)],
    "pages4": [(1, 78, 138)] * 4,
    "img1536": [(1, 32, 48)],                                                           # the cpu_amx target shape                                                       # 4 pages, 43056 patches
}


@dataclass(frozen=True)
class Variant:
    name: str
    qkv_layout: str
    grid_thw: str
    graphs: bool
    attention_backend: str = "auto"
    fused_layers: str = "off"


# "eager" = ATen LayerNorm/bias/GELU/residual ops around the GEMMs; "fused" = the Triton
# residual+bias+LayerNorm passes and the GELU GEMM epilogue. On CUDA rows the default attention
# backend (triton_rope_varlen) rotates q and k in place with one Triton pass; sdpa rows rotate
# them with the fused path's Triton pass or ATen.
VARIANTS = (
    Variant("dense/device/eager", "dense", "device", False),
    Variant("strided/device/eager", "strided", "device", False),
    Variant("strided/host/eager", "strided", "host", False),
    Variant("dense/host/fused", "dense", "host", False, fused_layers="on"),
    Variant("strided/host/fused", "strided", "host", False, fused_layers="on"),
    Variant("strided/host/graph", "strided", "host", True),
    Variant("strided/host/graph+fused", "strided", "host", True, fused_layers="on"),
    Variant("cudnn:strided/host/eager", "strided", "host", False, "sdpa_cudnn"),
    # the Triton kernel alone, for comparison where the plan picks fa3_varlen (fa3 extra installed)
    Variant("triton:strided/host/fused", "strided", "host", False, "triton_rope_varlen", "on"),
    Variant("triton:strided/host/graph+fused", "strided", "host", True, "triton_rope_varlen", "on"),
)


@dataclass(frozen=True)
class VisionBenchOptions:
    workloads: tuple[str, ...] = ("page", "blocks16", "block8x40", "small64")
    variants: str = "all"              # comma list of Variant names, or "all"
    iters: int = 10
    warmup: int = 3
    reference: bool = True             # time the transformers reference too
    json_out: str | None = None
    profile: int = 0                   # > 0: profile one call per workload, print the top kernels


def add_arguments(p: argparse.ArgumentParser) -> None:
    """bench vision's own flags (the shared model/device/plan flags come from the CLI)."""
    g = p.add_argument_group("bench vision")
    g.add_argument("--workloads", default=",".join(VisionBenchOptions.workloads),
                   help=f"comma list of {', '.join(WORKLOADS)}")
    g.add_argument("--variants", default="all", help="comma list of plan variants or 'all'")
    g.add_argument("--iters", type=int, default=VisionBenchOptions.iters)
    g.add_argument("--warmup", type=int, default=VisionBenchOptions.warmup)
    g.add_argument("--no-reference", action="store_true", help="skip the transformers reference")
    g.add_argument("--json-out", default=None, help="write results as JSON here")
    g.add_argument("--profile", type=int, default=0, metavar="TOP",
                   help="also profile one call per workload and print the TOP most expensive kernels")


def options_from_args(ns: argparse.Namespace) -> VisionBenchOptions:
    return VisionBenchOptions(tuple(w.strip() for w in ns.workloads.split(",") if w.strip()), ns.variants,
                              ns.iters, ns.warmup, not ns.no_reference, ns.json_out, ns.profile)


def run_vision_bench(source: ModelSource, base: PlanRequest, opts: VisionBenchOptions) -> int:
    """Every variant of VARIANTS (or those opts.variants names) on opts.workloads; ``base``: the
    user's plan flags, which override the variants' where they are not "auto". A family with
    its own workloads and reference runs its ``vision_bench()`` instead."""
    from ..models.registry import detect_family
    family = detect_family(source.model_dir if source.load_format != "dummy" else None, source.model_family).family
    own = family.vision_bench()
    if own is not None:
        return own(source, base, opts)
    workloads = list(opts.workloads)
    unknown = [w for w in workloads if w not in WORKLOADS]
    if unknown:
        raise BenchError(f"unknown workloads {unknown}; known: {', '.join(WORKLOADS)}")
    names = [n.strip() for n in opts.variants.split(",") if n.strip()]
    unknown_v = [n for n in names if opts.variants != "all" and n not in {v.name for v in VARIANTS}]
    if unknown_v:   # a misspelt name must not silently drop a row (the amx step once asked for one)
        raise BenchError(f"unknown variants {unknown_v}; known: {', '.join(v.name for v in VARIANTS)}")
    variants = VARIANTS if opts.variants == "all" else tuple(v for v in VARIANTS if v.name in names)
    if not variants:
        raise BenchError(f"no variant matches {opts.variants!r}; known: {', '.join(v.name for v in VARIANTS)}")
    cls, probe, why = choose_device(base.device)

    results: list[dict] = []
    reference_out: dict[str, torch.Tensor] = {}
    ref_ms: dict[str, float] = {}
    timer = None
    g = torch.Generator().manual_seed(0)
    inputs_cpu = {w: torch.randn(sum(t * h * ww for t, h, ww in WORKLOADS[w]), 3, 14, 14, generator=g)
                  for w in workloads}

    for v in variants:
        req = replace(base, qkv_layout=v.qkv_layout, grid_thw=v.grid_thw,
                      fused_layers=v.fused_layers if base.fused_layers == "auto" else base.fused_layers,
                      attention_backend=v.attention_backend if base.attention_backend == "auto" else base.attention_backend,
                      graph_config=replace(base.graph_config, use_encoder_cudagraph=v.graphs))
        try:
            runner = cls.create(req, probe=probe)
        except PlanError as e:
            print(f"variant {v.name}: skipped on this device: {e}")
            continue
        source.load_into(runner)
        api = runner.device_api
        timer = timer or Timer(api, opts.warmup, opts.iters)
        report = runner.capture_graphs()
        print(f"\n== {v.name}: attention={runner.plan.attention.value} qkv={runner.plan.qkv_layout.value} "
              f"grid={runner.plan.grid_thw.value} "
              f"fused={runner.plan.fused_layers.value} "
              f"graphs={report.captured} ({report.capture_seconds:.1f}s, {report.graph_memory_bytes / 2**20:.0f} MiB)"
              f"{' [EMULATED]' if runner.plan.emulated else ''}")
        if opts.reference and not ref_ms:
            ref = _reference(runner, workloads, inputs_cpu, timer, reference_out, ref_ms)
            results += ref
        for w in workloads:
            grids = WORKLOADS[w]
            encode = partial(runner.encode_uploaded, runner.upload_pixels(inputs_cpu[w]), grids)
            encode()
            reset_peak(api)
            ms = timer(encode)
            peak = peak_gib(api)
            out = torch.cat(encode())
            cos = cosine(out, reference_out[w]) if w in reference_out else None
            row = {"workload": w, "variant": v.name, "ms": ms, "peak_gib": peak, "cosine_vs_ref": cos,
                   "speedup_vs_ref": (ref_ms[w] / ms) if w in ref_ms else None,
                   "attention": runner.plan.attention.value, "device": runner.plan.device, "row": runner.plan.row,
                   "emulated": runner.plan.emulated}
            if runner.graphs is not None:
                row["graph_stats"] = {"hits": runner.graphs.stats.hits, "fallbacks": runner.graphs.stats.fallbacks}
            if opts.profile:
                row["profile"] = profile_kernels(encode, api, opts.profile)
            results.append(row)
            sp = f"x{row['speedup_vs_ref']:5.2f} vs ref" if row["speedup_vs_ref"] else "(no reference)"
            pk = f"peak {peak:6.2f} GiB" if peak is not None else ""
            cs = f"cos {cos:.5f}" if cos is not None else ""
            print(f"  {w:<10} {ms:9.2f} ms  {sp}  {pk}  {cs}")
        # every reference to the runner goes (the bound `encode` too), so its weights and graph
        # pool are freed before the next variant's peak memory is measured
        del runner, encode
        gc.collect()
        api.empty_cache()

    _print_table(results, workloads)
    if opts.json_out:
        with open(opts.json_out, "w") as f:
            json.dump({"device": str(probe.summary()), "results": results}, f, indent=1)
    return 0


def profile_kernels(fn, api: DeviceAPI, top: int) -> list[dict]:
    """Per-kernel device time of one call of fn (torch.profiler, with the device API's profiler
    activity; CPU self time on the host), the `top` most expensive, printed and returned: the
    breakdown behind a gap."""
    from torch.profiler import ProfilerActivity, profile
    device_activity = api.profiler_activity
    acts = [ProfilerActivity.CPU] + ([device_activity] if device_activity is not None else [])
    fn()
    api.synchronize()
    with profile(activities=acts) as prof:
        fn()
        api.synchronize()
    # self time: an ATen op's total includes the kernels it launched, so totals would count a
    # kernel twice (as itself and inside aten::mm / aten::linear / ...)
    def own(e) -> float:
        if device_activity is None:
            return e.self_cpu_time_total
        return getattr(e, "self_device_time_total", getattr(e, "self_cuda_time_total", 0))
    events = sorted((e for e in prof.key_averages() if own(e) > 0), key=own, reverse=True)
    total = sum(own(e) for e in events) or 1.0
    rows = [{"name": e.key[:90], "calls": e.count, "ms": own(e) / 1000, "share": own(e) / total}
            for e in events[:top]]
    print(f"    profile ({'device' if device_activity is not None else 'cpu self'} time, top {top}):")
    for r in rows:
        print(f"      {r['ms']:8.3f} ms {r['share'] * 100:5.1f}% x{r['calls']:<5} {r['name']}")
    return rows


def _reference(runner, workloads, inputs_cpu, timer, reference_out, ref_ms) -> list[dict]:
    from .reference import hf_vision_reference
    ref = hf_vision_reference(runner.model, runner.cfg, runner.device, runner.dtype)
    rows = []
    print("== transformers reference (PaddleOCRVisionModel sdpa + PaddleOCRProjector)")
    for w in workloads:
        call = partial(ref, inputs_cpu[w].to(runner.device, runner.dtype),
                       torch.tensor(WORKLOADS[w], dtype=torch.int64, device=runner.device))
        reset_peak(runner.device_api)
        ms = timer(call)
        peak = peak_gib(runner.device_api)
        reference_out[w] = call().float()
        ref_ms[w] = ms
        rows.append({"workload": w, "variant": "transformers", "ms": ms, "peak_gib": peak, "speedup_vs_ref": 1.0})
        print(f"  {w:<10} {ms:9.2f} ms  " + (f"peak {peak:6.2f} GiB" if peak is not None else "peak n/a (CPU)"))
    del ref
    gc.collect()
    return rows


def _print_table(results: list[dict], workloads: list[str]) -> None:
    variants = list(dict.fromkeys(r["variant"] for r in results))
    print("\nms per batch (speed-up vs transformers) [peak GiB]")
    print(f"{'variant':<30}" + "".join(f"{w:>26}" for w in workloads))
    for v in variants:
        cells = []
        for w in workloads:
            r = next((x for x in results if x["variant"] == v and x["workload"] == w), None)
            if r is None:
                cells.append(f"{'-':>26}")
                continue
            sp = f"x{r['speedup_vs_ref']:.2f}" if r.get("speedup_vs_ref") else "   -"
            pk = f"[{r['peak_gib']:.2f}]" if r.get("peak_gib") is not None else ""
            cells.append(f"{r['ms']:>10.2f} ({sp}) {pk:>8}")
        print(f"{v:<30}" + "".join(cells))
