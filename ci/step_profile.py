"""Where a step's time goes.

Decode (default): per-step wall time of LLMEngine.step() at a few batch sizes (text-only prompts,
greedy, no detokenization), then a torch.profiler table of the decode steps at batch 1 (CPU ops
and device kernels, counted per step). Runs against whichever fastdeploy_ext is on the path, so
two commits (a wheel each) compare in one GPU call:

    PYTHONPATH=/tmp/old python3 ci/step_profile.py --device cuda --label old
    PYTHONPATH=/tmp/new python3 ci/step_profile.py --device cuda --label new

Prefill (--prefill): the steps of bench generate's document-shaped workloads (blocks: --pages
pages x 16 layout crops at the released min/max pixels; lines: --lines text-line crops), each
prefill step's wall time against its device time (the union of the device's kernel intervals
inside the step, torch.profiler; async scheduling off here unless asked, so a step's kernels end
inside it) and its host phases (inbox, scheduling, the vision pass's host side with its metadata,
the text step's build + launch, sampling, waiting for the sampled ids). Each workload runs twice:
"ready" (every request preprocessed before the first step) and "streaming" (all submitted at once,
preprocessing in the engine's pool while the steps run, as bench generate does): the difference
is what the preprocessing threads cost the step loop. --mixed-steps / --no-mixed-steps choose the
scheduling of the steps that admit requests (default: the device row's). On the CPU (the shipped
tiny model, fp32) there is no device time: the host phases still show where a prefill step goes,
and --host-only replaces the vision encoder's and the text decoder's forward with zeros of their
output shapes, so what is left of a step is its host work alone (metadata, uploads, batch
building, scheduling, sampling, output processing; it runs against older trees too).

    python3 ci/step_profile.py --prefill --device cuda --pages 8 --lines 512
    python3 ci/step_profile.py --prefill --device cpu --pages 1 --lines 32
    python3 ci/step_profile.py --prefill --device cpu --host-only --pages 2 --lines 64 --line-tokens 4

--count-calls (with --prefill): torch calls (functions and Tensor methods, each a dispatcher trip
and on a device an op or a launch) of one prefill step of 8 and of 32 line crops, grouped by the
calling function: the per-image slope says what still costs per image (device independent).
"""
from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
from pathlib import Path

import torch

# the tree's package, not a carried wheel's: run as a script, only ci/ would be on the path first
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fastdeploy_ext.engine.config import EngineConfig
from fastdeploy_ext.engine.llm_engine import LLMEngine
from fastdeploy_ext.engine.sampling_params import RepetitionGuard, SamplingParams
from fastdeploy_ext.plan import PlanRequest


def params(tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True, detokenize=False,
                          repetition_guard=RepetitionGuard(enabled=False))


FILL = " and the next line of it"


def decode_prompt(i: int, repeats: int = 0) -> str:
    """A text prompt, distinct per request, lengthened by ``repeats`` copies of FILL."""
    return f"OCR: line {i} of the page" + FILL * repeats


def repeats_for(engine: LLMEngine, tokens: int) -> tuple[int, int]:
    """(FILL copies that bring a prompt to about ``tokens`` tokens, that prompt's length): the KV
    length the decode steps read, whatever the tokenizer (a byte-level one makes a word several
    tokens)."""
    def length(r):
        return engine.process_request("len", {"prompt": decode_prompt(0, r)}, params(1)).prompt_len
    base, per = length(0), length(1) - length(0)
    repeats = max(0, (tokens - base) // max(1, per))
    return repeats, length(repeats)


def timed_step(engine: LLMEngine) -> tuple[str | None, float, int]:
    """One engine step: its kind by the engine's own counters ("prefill" for a step that ran any
    prefill, mixed or not; "decode"; None when nothing ran), its wall time, and the requests
    running when it started (a decode step's batch: it admits nobody)."""
    st = engine.stats()
    running, counts = st.num_running, (st.num_prefill_steps, st.num_decode_steps)
    t0 = time.perf_counter()
    engine.step()
    dt = time.perf_counter() - t0
    st = engine.stats()
    if st.num_prefill_steps > counts[0]:
        return "prefill", dt, running
    return ("decode" if st.num_decode_steps > counts[1] else None), dt, running


class GcPauses:
    """The garbage collector's pauses while it is on: collections by generation and their wall
    time (gc.callbacks), to tell a collection from a device wait in a step's idle gaps."""

    def __init__(self):
        self.pauses: list[tuple[int, float]] = []
        self._t0 = 0.0

    def _hook(self, phase, info):
        if phase == "start":
            self._t0 = time.perf_counter()
        else:
            self.pauses.append((info["generation"], time.perf_counter() - self._t0))

    def __enter__(self):
        gc.callbacks.append(self._hook)
        return self

    def __exit__(self, *exc):
        gc.callbacks.remove(self._hook)

    def summary(self) -> str:
        if not self.pauses:
            return "no collections"
        by_gen = [sum(1 for g, _ in self.pauses if g == n) for n in range(3)]
        total = sum(d for _, d in self.pauses)
        return (f"{len(self.pauses)} collections (gen0/1/2: {by_gen[0]}/{by_gen[1]}/{by_gen[2]}), "
                f"{total * 1e3:.2f} ms in all, longest {max(d for _, d in self.pauses) * 1e3:.3f} ms; "
                f"frozen objects {gc.get_freeze_count()}")


def decode_step_times(engine: LLMEngine, batch: int, tokens: int, tag: str, repeats: int = 0) -> list[float]:
    """The wall times of the decode steps that ran the whole batch (prefill steps, a long
    context's chunked ones included, and the steps after the first request finished are out)."""
    for i in range(batch):
        engine.add_request(f"{tag}-{i}", {"prompt": decode_prompt(i, repeats)}, params(tokens))
    times = []
    while engine.has_unfinished():
        kind, dt, running = timed_step(engine)
        if kind == "decode" and running == batch:
            times.append(dt)
    return times[1:] or times          # the first full-batch step may still pay a graph's first replay


# ---------------------------------------------------------------------- prefill steps
PHASES = ("inbox", "schedule", "vision host", "  vision metadata", "text build+launch", "sample", "wait for ids")


class StepPhases:
    """Host time per phase of each step, from wrappers on the engine's own methods (instance
    attributes: nothing changes for other engines)."""

    def __init__(self, engine: LLMEngine):
        from fastdeploy_ext.engine import llm_engine
        from fastdeploy_ext.ops import sampler
        self.now: dict[str, float] = {}
        self._undo = []
        self._wrap(engine, "_take_inbox", "inbox")
        self._wrap(engine.scheduler, "schedule", "schedule")
        self._wrap(engine, "_encode", "vision host")
        builder = getattr(engine.runner, "meta_builder", None)
        if builder is not None:
            self._wrap(builder, "build_host", "  vision metadata")
        self._wrap(engine.runner, "execute", "text build+launch")
        self._wrap(llm_engine, "sample_async", "sample")
        real = sampler.PendingSample.result
        phases = self

        def result(pending):
            t0 = time.perf_counter()
            try:
                return real(pending)
            finally:
                phases.now["wait for ids"] = phases.now.get("wait for ids", 0.0) + time.perf_counter() - t0
        sampler.PendingSample.result = result
        self._undo.append(lambda: setattr(sampler.PendingSample, "result", real))

    def _wrap(self, obj, name: str, phase: str) -> None:
        real = getattr(obj, name)
        had = name in vars(obj)

        def timed(*a, **kw):
            t0 = time.perf_counter()
            try:
                return real(*a, **kw)
            finally:
                self.now[phase] = self.now.get(phase, 0.0) + time.perf_counter() - t0
        setattr(obj, name, timed)
        self._undo.append(lambda: setattr(obj, name, real) if had else delattr(obj, name))

    def take(self) -> dict[str, float]:
        out, self.now = self.now, {}
        return out

    def restore(self) -> None:
        for undo in reversed(self._undo):
            undo()


def prefill_requests(workload: str, args, engine: LLMEngine):
    from fastdeploy_ext.bench.generate import BenchRequest, block_requests, line_pngs, released_pixel_kwargs
    if workload == "blocks":
        kwargs, _ = released_pixel_kwargs(engine)
        return block_requests(args.pages, 16, args.block_token_scale, kwargs)
    return [BenchRequest(png, "OCR:", args.line_tokens) for png in line_pngs(args.lines)]


def run_steps(engine: LLMEngine, reqs, streaming: bool, profile: bool):
    """All requests stepped to the end; per step (kind, wall s, window on the profiler's clock,
    host phases, images encoded, decode rows in it)."""
    from fastdeploy_ext.bench.generate import bench_params
    phases = StepPhases(engine)
    tag = f"p{time.monotonic_ns()}"
    if not streaming:
        for i, r in enumerate(reqs):
            engine.add_sequence(engine.process_request(f"{tag}-{i}", r.engine_prompt(), bench_params(r.tokens),
                                                       priority=r.priority))
    steps = []
    prof = None
    if profile:
        acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
        prof = torch.profiler.profile(activities=acts)
        prof.__enter__()
    try:
        if streaming:
            for i, r in enumerate(reqs):
                engine.submit(f"{tag}-{i}", r.engine_prompt(), bench_params(r.tokens), priority=r.priority)
        while engine.has_unfinished():
            before = engine.stats()
            t0 = time.perf_counter()
            with torch.profiler.record_function(f"fdx_step_{len(steps)}"):
                engine.step()
            dt = time.perf_counter() - t0
            after = engine.stats()
            kind = ("prefill" if after.num_prefill_steps > before.num_prefill_steps else
                    "decode" if after.num_decode_steps > before.num_decode_steps else None)
            if kind is None:
                phases.take()
                time.sleep(0.0005)      # still preprocessing: nothing ran
                continue
            steps.append({"kind": kind, "wall": dt, "phases": phases.take(),
                          "images": after.encoder_items_encoded - before.encoder_items_encoded,
                          "decode_rows": getattr(after, "mixed_decode_rows", 0) - getattr(before, "mixed_decode_rows", 0)})
    finally:
        if prof is not None:
            prof.__exit__(None, None, None)
        phases.restore()
    if prof is not None:
        device_times(prof, steps)
    return steps


def device_times(prof, steps) -> None:
    """Each step's device time: the union of the device events inside its record_function window."""
    from torch.autograd import DeviceType

    from fastdeploy_ext.bench.generate import interval_union_s
    windows = {}
    spans = []
    for e in prof.events():
        if e.device_type == DeviceType.CPU and e.name.startswith("fdx_step_"):
            windows[int(e.name[len("fdx_step_"):])] = (e.time_range.start, e.time_range.end)
        elif e.device_type != DeviceType.CPU and e.time_range.end > e.time_range.start:
            spans.append((e.time_range.start, e.time_range.end))
    spans.sort()
    for i, st in enumerate(steps):
        a, b = windows.get(i, (0, 0))
        inside = [(max(x, a), min(y, b)) for x, y in spans if y > a and x < b]
        st["device"] = interval_union_s(inside) / 1e6


def start_full_batch(engine: LLMEngine, tag: str, batch: int, steps: int, repeats: int) -> None:
    """``batch`` requests with room for ``steps`` decode steps (64 tokens of headroom: the first
    decode while the later ones still prefill), stepped to the first decode step of the whole
    batch: every request is past its prefill (a long context takes several chunked prefill
    steps), so the steps after it are decode steps of the whole batch. (Waiting for each
    request's first output does not work: a request that does not stream has one output, when
    it finishes.)"""
    for i in range(batch):
        engine.add_request(f"{tag}-{i}", {"prompt": decode_prompt(i, repeats)}, params(steps + 64))
    while True:
        kind, _, running = timed_step(engine)
        if kind == "decode" and running == batch:
            return
        if not engine.has_unfinished():
            raise SystemExit(f"the {tag} batch finished before a decode step of all {batch}")


def find_syncs(engine: LLMEngine, batch: int, steps: int, repeats: int, label: str) -> None:
    """Each distinct Python stack that made the host wait for the device during ``steps`` decode
    steps of ``batch`` requests (torch.cuda.set_sync_debug_mode("warn"): every synchronizing
    call torch knows of warns; the warning is raised where the op returns to Python)."""
    import collections
    import traceback
    import warnings
    if not torch.cuda.is_available():
        raise SystemExit("--find-syncs needs a CUDA device (it uses torch.cuda's sync debug mode)")
    start_full_batch(engine, "sync", batch, steps, repeats)
    seen: collections.Counter = collections.Counter()

    def record(message, category, filename, lineno, file=None, line=None):
        stack = [f for f in traceback.extract_stack()[:-1] if "warnings" not in f.filename]
        key = tuple(f"{f.filename.split('site-packages/')[-1]}:{f.lineno} {f.name}" for f in stack[-8:])
        seen[(str(message).split("\n")[0][:100], key)] += 1
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings():         # restores showwarning and the filters on exit
            warnings.simplefilter("always")
            warnings.showwarning = record
            for _ in range(steps):
                engine.step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    print(f"[{label}] host syncs over {steps} decode steps at batch {batch}: {sum(seen.values())} "
          f"({len(seen)} distinct stacks)")
    for (msg, stack), n in seen.most_common():
        print(f"[{label}]   {n / steps:.2f} a step: {msg}")
        for frame in stack:
            print(f"[{label}]       {frame}")
    while engine.has_unfinished():
        engine.step()


GAP_BUCKETS_US = (2, 5, 20, 100, 1000)


def device_gaps(prof, steps: int, label: str) -> None:
    """Where the device idled over the profiled steps: the union of its kernel and copy intervals
    against the window from the first to the last, and the idle gaps by length. Short gaps
    (< 5 us) are launch gaps between kernels (inside a graph too); long ones are the device
    waiting for the host (scheduling, batch building, a sync)."""
    from torch.autograd import DeviceType
    spans = sorted((e.time_range.start, e.time_range.end, e.name) for e in prof.events()
                   if e.device_type != DeviceType.CPU and e.time_range.end > e.time_range.start)
    if not spans:
        print(f"[{label}] device gaps: no device events captured")
        return
    busy, gaps = 0.0, []
    start, end, last_name = spans[0]
    for a, b, name in spans[1:]:
        if a > end:
            busy += end - start
            gaps.append((a - end, last_name, name))
            start, end = a, b
        if b >= end:
            end, last_name = b, name
    busy += end - start
    window = end - spans[0][0]          # `end` is the last interval's: the latest end of all
    print(f"[{label}] device timeline over {steps} steps: window {window / steps / 1e3:.3f} ms a step, busy "
          f"{busy / steps / 1e3:.3f} ms a step ({100 * busy / window:.1f} %), idle {(window - busy) / steps / 1e3:.3f} ms "
          f"a step in {len(gaps) / steps:.1f} gaps")
    edges = (0,) + GAP_BUCKETS_US + (float("inf"),)
    for lo, hi in zip(edges, edges[1:]):
        sel = [g for g, *_ in gaps if lo <= g < hi]
        print(f"[{label}]   gaps {lo:>5}-{hi:<5} us: {len(sel) / steps:7.1f} a step, {sum(sel) / steps:8.1f} us a step")
    print(f"[{label}]   the longest gaps (us, kernel before -> kernel after):")
    for g, before, after in sorted(gaps, reverse=True)[:10]:
        print(f"[{label}]     {g:8.1f}  {before[:50]} -> {after[:50]}")


def report_prefill(label: str, workload: str, mode: str, steps) -> None:
    med = statistics.median
    pre = [s for s in steps if s["kind"] == "prefill"]
    dec = [s for s in steps if s["kind"] == "decode"]
    if not pre:
        print(f"[{label}] {workload} {mode}: no prefill step")
        return
    head = (f"[{label}] {workload} {mode}: {len(pre)} prefill steps (median {med(s['images'] for s in pre)} images, "
            f"{sum(s['decode_rows'] > 0 for s in pre)} mixed), wall median {med(s['wall'] for s in pre) * 1e3:.1f} ms")
    if all("device" in s for s in pre):
        ratio = [s["wall"] / s["device"] for s in pre if s["device"] > 0]
        head += (f", device median {med(s['device'] for s in pre) * 1e3:.1f} ms, wall/device median "
                 f"{med(ratio):.2f} (max {max(ratio):.2f})")
    print(head)
    for ph in PHASES:
        vals = [s["phases"].get(ph, 0.0) for s in pre]
        print(f"[{label}]   {ph:22s} median {med(vals) * 1e3:8.2f} ms   total {sum(vals) * 1e3:9.1f} ms")
    for i, s in enumerate(pre):
        dev = f", device {s['device'] * 1e3:.1f} ms" if "device" in s else ""
        print(f"[{label}]   prefill step {i}: {s['images']} images, {s['decode_rows']} decode rows, wall "
              f"{s['wall'] * 1e3:.1f} ms{dev}")
    if dec:
        print(f"[{label}]   decode: {len(dec)} steps, wall median {med(s['wall'] for s in dec) * 1e3:.2f} ms")


def stub_compute(engine: LLMEngine) -> None:
    """--host-only: the vision encoder (+ projector) and the text decoder return zeros of their
    output shapes; everything around them runs as usual."""
    runner = engine.runner
    hidden, vocab = runner.text_model.cfg.hidden_size, runner.text.model.cfg.vocab_size
    dev, dtype = runner.device, runner.dtype

    class ZeroVision(torch.nn.Module):
        def forward(self, pixels, meta, execution):
            return torch.zeros(sum(meta.out_split_sizes), hidden, device=dev, dtype=dtype)
    runner.model = ZeroVision()
    runner.graphs = None
    runner.text.graphs = None
    runner.text.forward = lambda inp: torch.zeros(inp.logits_index.shape[0], vocab, device=dev)


def count_calls(engine: LLMEngine, label: str) -> None:
    import collections
    import sys

    from torch.overrides import TorchFunctionMode

    from fastdeploy_ext.bench.generate import bench_params, line_pngs

    class Calls(TorchFunctionMode):
        def __init__(self):
            super().__init__()
            self.by = collections.Counter()

        def __torch_function__(self, func, types, args=(), kwargs=None):
            if getattr(func, "__name__", "") != "__get__":          # attribute reads are not ops
                f = sys._getframe(1)
                self.by[f"{f.f_code.co_filename.split('fastdeploy_ext/')[-1]}:{f.f_code.co_name}"] += 1
            return func(*args, **(kwargs or {}))
    pngs = line_pngs(32)
    counted = {}
    for n in (8, 32, 8, 32):                 # the first two warm the per-shape caches
        for i, png in enumerate(pngs[:n]):
            engine.add_sequence(engine.process_request(f"calls-{n}-{i}-{time.monotonic_ns()}",
                                                       {"prompt": "OCR:", "images": [png]}, bench_params(2)))
        with Calls() as c:
            engine.step()
        while engine.has_unfinished():
            engine.step()
        counted[n] = c.by
    slope = {k: (counted[32][k] - counted[8][k]) / 24 for k in counted[32] | counted[8]}
    print(f"[{label}] torch calls in one prefill step: 8 images {sum(counted[8].values())}, 32 images "
          f"{sum(counted[32].values())}; per image {sum(slope.values()):.1f}, by caller:")
    for k, v in sorted(slope.items(), key=lambda kv: -kv[1]):
        if v:
            print(f"[{label}]   {v:6.1f}  {k}")


def prefill_main(args) -> None:
    from fastdeploy_ext.device_api import device_api_for
    on_cpu = args.device == "cpu"
    model = args.model
    if model is None and on_cpu:
        from fastdeploy_ext.conformance.references import Manifest
        model = str(Manifest.load().path("tiny_vl"))
    extra = {} if args.mixed_steps is None else {"mixed_steps": args.mixed_steps}
    cfg = EngineConfig(model=model, load_format="auto" if model else "dummy",
                       plan=PlanRequest(device=args.device, dtype="float32" if on_cpu else "bfloat16"),
                       max_num_seqs=256, max_model_len=4096, gpu_memory_utilization=0.8,
                       kv_cache_memory=(256 << 20) if on_cpu else None,
                       async_scheduling=bool(args.async_scheduling), **extra)
    engine = LLMEngine(cfg)
    mixed = getattr(engine, "mixed_steps", None)
    print(f"[{args.label}] async scheduling {'on' if engine.async_scheduling.value else 'off'}; mixed steps "
          + (f"{'on' if mixed.value else 'off'} ({mixed.reason})" if mixed else "n/a (this tree has none)")
          + ("; host only (vision and text forwards return zeros)" if args.host_only else ""))
    if args.count_calls:
        count_calls(engine, args.label)
        engine.shutdown()
        return
    if args.host_only:
        stub_compute(engine)
    profile = device_api_for(engine.runner.device).profiler_activity is not None and not args.host_only
    for workload in args.workloads.split(","):
        reqs = prefill_requests(workload, args, engine)
        run_steps(engine, reqs[:max(2, len(reqs) // 8)], streaming=False, profile=False)     # warm-up
        for mode in ("ready", "streaming"):
            report_prefill(args.label, workload, mode, run_steps(engine, reqs, streaming=mode == "streaming",
                                                                 profile=profile))
    engine.shutdown()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--prefill", action="store_true", help="the prefill steps of the blocks / lines workloads "
                    "(module docstring)")
    ap.add_argument("--workloads", default="blocks,lines", help="--prefill: blocks, lines")
    ap.add_argument("--model", default=None, help="a model dir (default: dummy weights; with --prefill the tiny "
                    "model on the CPU)")
    ap.add_argument("--pages", type=int, default=8, help="--prefill blocks: pages of 16 crops")
    ap.add_argument("--block-token-scale", type=float, default=1.0)
    ap.add_argument("--lines", type=int, default=512, help="--prefill lines: text-line crops")
    ap.add_argument("--line-tokens", type=int, default=32)
    ap.add_argument("--mixed-steps", action=argparse.BooleanOptionalAction, default=None)
    ap.add_argument("--host-only", action="store_true", help="--prefill: zeros for the vision and text forwards")
    ap.add_argument("--count-calls", action="store_true", help="--prefill: torch calls per image of a prefill step")
    ap.add_argument("--switch-interval", type=float, default=None, metavar="S",
                    help="--prefill: sys.setswitchinterval(S) first (Python's default 0.005): if 'streaming' "
                         "prefill steps are slow from the step loop waiting for the GIL the preprocessing threads "
                         "hold (it releases it at every torch call), a shorter interval shrinks the gap")
    ap.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=None,
                    help="overlapped scheduling on or off (default: --prefill off, so each step's kernels end "
                         "inside it; decode the capability row's default)")
    ap.add_argument("--gc-freeze", action="store_true",
                    help="decode: gc.collect() then gc.freeze() once the engine is built (the collector then "
                         "skips what startup made); each round prints the collections during its steps either way")
    ap.add_argument("--label", default="")
    ap.add_argument("--batches", default="1,8,64")
    ap.add_argument("--tokens", type=int, default=200)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--profile-steps", type=int, default=40)
    ap.add_argument("--model-family", default=None, help="decode: the family of the dummy weights (default: "
                    "PaddleOCR-VL), e.g. deepseek_ocr2")
    ap.add_argument("--context", type=int, default=0, metavar="TOKENS",
                    help="decode: prompt tokens per request (about; the KV length the decode steps read)")
    ap.add_argument("--profile-batch", type=int, default=1, help="decode: the batch of the profiled steps")
    ap.add_argument("--find-syncs", type=int, default=0, metavar="STEPS",
                    help="decode: run STEPS decode steps at --profile-batch under torch.cuda's sync debug mode and "
                         "print each distinct Python stack that synchronized the host with the device")
    ap.add_argument("--cprofile", action="store_true", help="also the Python functions' own time over 200 "
                    "decode steps at batch 1 (cProfile: slows every call alike, compare commits by it)")
    args = ap.parse_args()
    if args.prefill:
        if args.switch_interval is not None:
            import sys
            sys.setswitchinterval(args.switch_interval)
            print(f"[{args.label}] sys.setswitchinterval({args.switch_interval})")
        prefill_main(args)
        return
    batches = [int(x) for x in args.batches.split(",")]
    max_len = max(2048, args.context + args.tokens + args.profile_steps + 256)
    kw = dict(load_format="dummy") if args.model is None else dict(model=args.model)
    cfg = EngineConfig(**kw, model_family=args.model_family,
                       plan=PlanRequest(device=args.device, dtype="bfloat16" if args.model is None else "auto"),
                       max_num_seqs=max(64, *batches, args.profile_batch), max_model_len=max_len,
                       gpu_memory_utilization=0.5, async_scheduling=args.async_scheduling)
    engine = LLMEngine(cfg)
    if args.gc_freeze:
        gc.collect()
        gc.freeze()
        print(f"[{args.label}] gc: {gc.get_freeze_count()} objects frozen after startup")
    print(f"[{args.label}] async scheduling {'on' if engine.async_scheduling.value else 'off'} "
          f"({engine.async_scheduling.reason})")
    repeats = 0
    if args.context:
        repeats, prompt_tokens = repeats_for(engine, args.context)
        print(f"[{args.label}] prompt tokens per request: {prompt_tokens}")
    decode_step_times(engine, 1, 32, "warm")
    for r in range(args.rounds):
        for b in batches:
            with GcPauses() as pauses:
                t = decode_step_times(engine, b, args.tokens, f"r{r}b{b}", repeats)
            print(f"[{args.label}] round {r} batch {b}: decode step median {statistics.median(t) * 1e3:.3f} ms, "
                  f"p10 {sorted(t)[len(t) // 10] * 1e3:.3f} ms over {len(t)} steps; gc: {pauses.summary()}", flush=True)
    pb = args.profile_batch
    if args.find_syncs:
        find_syncs(engine, pb, args.find_syncs, repeats, args.label)
    # profile decode steps at --profile-batch
    start_full_batch(engine, "prof", pb, args.profile_steps, repeats)
    decode_steps_before = engine.stats().num_decode_steps
    acts = [torch.profiler.ProfilerActivity.CPU]
    if args.device == "cuda":
        acts.append(torch.profiler.ProfilerActivity.CUDA)
    t0 = time.perf_counter()
    with torch.profiler.profile(activities=acts) as prof:
        for _ in range(args.profile_steps):
            engine.step()
    wall = (time.perf_counter() - t0) / args.profile_steps
    profiled_decode_steps = engine.stats().num_decode_steps - decode_steps_before
    while engine.has_unfinished():
        engine.step()
    n = args.profile_steps
    rows = []
    kernels_us = 0.0
    for e in prof.key_averages():
        dev = getattr(e, "device_time_total", getattr(e, "cuda_time_total", 0))
        self_dev = getattr(e, "self_device_time_total", getattr(e, "self_cuda_time_total", 0))
        kernels_us += self_dev / n
        rows.append((e.key, e.count / n, e.self_cpu_time_total / n, dev / n))
    print(f"[{args.label}] batch {pb}: {wall * 1e3:.3f} ms a step (under the profiler), device kernels "
          f"{kernels_us / 1e3:.3f} ms a step (self device time summed); {profiled_decode_steps} of the "
          f"{n} profiled steps were decode steps")
    print(f"[{args.label}] per decode step at batch {pb} (mean over {n} steps): op, calls, self CPU us, device us")
    for key, calls, cpu, dev in sorted(rows, key=lambda r: -r[2])[:40]:
        print(f"[{args.label}]   {key[:70]:70s} {calls:6.1f} {cpu:9.1f} {dev:9.1f}")
    print(f"[{args.label}] device kernels per step, by device time:")
    for key, calls, cpu, dev in sorted(rows, key=lambda r: -r[3])[:25]:
        if dev > 0:
            print(f"[{args.label}]   {key[:70]:70s} {calls:6.1f} {dev:9.1f}")
    device_gaps(prof, n, args.label)
    if args.cprofile:
        import cProfile
        import pstats
        engine.add_request("cprof", {"prompt": "OCR: profile"}, params(208))
        for _ in range(4):
            engine.step()
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(200):
            engine.step()
        prof.disable()
        while engine.has_unfinished():
            engine.step()
        stats = pstats.Stats(prof).stats
        print(f"[{args.label}] cProfile over 200 decode steps at batch 1: own time us/step, calls/step, function")
        for (f, line, name), (cc, nc, tt, ct, _) in sorted(stats.items(), key=lambda kv: -kv[1][2])[:30]:
            print(f"[{args.label}]   {tt / 200 * 1e6:8.1f} {nc / 200:6.1f}  {f.split('site-packages/')[-1]}:{line} {name}")
    engine.shutdown()


if __name__ == "__main__":
    main()
