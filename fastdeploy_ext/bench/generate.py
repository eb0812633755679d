"""`fastdeploy-ext bench generate`: our engine and transformers' `generate` in one run, same
prompt ids and pixels; same weights with --model DIR (with --load-format dummy transformers
uses its own random init of the same config: speed compares, tokens do not). DESIGN.md section
7, issue 8 item 12. Nothing here asserts a time.

Workloads (greedy, ignore_eos, "OCR:"):
- page1: one 1080p page (--page-size WxH for another size); time to first token from the call with the PNG bytes in memory to the
  first token on the host (preprocess + vision + prefill), then decode tokens/s at batch 1;
- pages64: N different 1080p pages (--page-size) x exactly T new tokens: pages/s and output
  tokens/s (the reference runs a subset at batch --ref-batch; compared per page); e.g. A4 at
  150 dpi, ``--page-size 1240x1754``, is a six-crop page for DeepSeek-OCR-2;
- lines256: N text-line crops x 64 tokens;
- blocks: --pages N document pages as a layout-parsing pipeline feeds them, 16 crops per page
  (2 titles ~900x60 px / 16 tokens, 9 paragraphs ~1000x180 / 120, 1 table ~1000x600 / 600 with
  "Table Recognition:", 2 formulas ~500x80 / 60 with "Formula Recognition:", 2 captions ~800x60 /
  40), at the released checkpoint's min/max pixels (sent as the requests' mm_processor_kwargs),
  with priorities: the table -2, paragraphs -1, the rest 0, so the long decodes start first;
  pages/s and req/s; no transformers reference (mixed prompts and output lengths per request,
  where its generate takes one length per batch);
- lines512: 512 of the lines workload's crops x 32 tokens (the reference as for lines256).
All requests of a workload are submitted at once. Each workload also reports its steps by kind
(prefill / decode: count, total and median wall time; prefill steps that also advanced running
requests counted as mixed; the decode batch: requests running at a decode step's start, median
and max) and, with --itl, the inter-token gaps of running requests from a
re-run with every request streamed (p50 / p99 / max, and apart those that span a prefill step:
what a newcomer's vision pass and prefill cost the requests already decoding), and, with
--profile, the device-active
fraction of a second, profiled run (the union of the device's kernel intervals from
torch.profiler over that run's wall time; n/a where the device API has no profiler activity).
Also reported: GPU busy % (the backend's utilization reader sampled through each of our runs), peak device
memory, where our wall time went (prefill steps with their vision passes, decode steps, the rest;
preprocessing CPU time in the pool), and whether the reference produced the same tokens (fp32 only; bf16 batching changes
reduction order). On CPU the defaults shrink to the tiny-model scale: page1 and 16 lines.
"""
from __future__ import annotations

import argparse
import io
import json
import logging
import os
import statistics
import threading
import time
from dataclasses import dataclass, replace

import numpy as np
import torch

from ..device_api import DeviceAPI, device_api_for
from ..engine.config import EngineConfig
from ..engine.errors import InvalidRequest
from ..engine.llm_engine import LLMEngine
from ..engine.sampling_params import RepetitionGuard, SamplingParams

log = logging.getLogger(__name__)

WORKLOADS = ("page1", "pages64", "lines256", "blocks", "lines512")
NEW_WORKLOADS = ("blocks", "lines512")


@dataclass(frozen=True)
class GenerateBenchOptions:
    workloads: tuple[str, ...] = WORKLOADS
    pages: int = 64
    page_tokens: int = 512
    page1_tokens: int = 256
    page_size: tuple[int, int] = (1920, 1080)   # page1 / pages64 pages, (width, height)
    lines: int = 256
    line_tokens: int = 64
    crops_per_page: int = 16            # blocks: the first K crops of each page's layout (tests use fewer)
    block_token_scale: float = 1.0      # blocks: output lengths x this (tests shrink them), at least 1
    lines512: int = 512
    lines512_tokens: int = 32
    profile: bool = False
    itl: bool = False                   # a streamed re-run for the inter-token gaps (not page1)
    ref_batch: int = 32
    reference: bool = True
    json_out: str | None = None
    prompt: str = "OCR:"


def add_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("bench generate")
    g.add_argument("--workloads", default=None, help=f"comma list of {', '.join(WORKLOADS)} "
                   "(default: all; on CPU page1,lines256 with --lines 16)")
    g.add_argument("--pages", type=int, default=64, help="pages of pages64, and of blocks (16 crops each)")
    g.add_argument("--page-tokens", type=int, default=512)
    g.add_argument("--page1-tokens", type=int, default=256, help="tokens of the batch-1 decode measurement")
    g.add_argument("--page-size", default="1920x1080", metavar="WxH",
                   help="page1 / pages64: the pages' size in pixels (1240x1754: A4 at 150 dpi)")
    g.add_argument("--lines", type=int, default=None, help="text-line crops (default 256; 16 on CPU)")
    g.add_argument("--line-tokens", type=int, default=64)
    g.add_argument("--crops-per-page", type=int, default=16,
                   help="blocks: the first K of each page's 16 crops (K=5 is one of each kind; for quick runs)")
    g.add_argument("--block-token-scale", type=float, default=1.0,
                   help="blocks: output lengths (16/120/600/60/40) times this, at least 1 (for quick runs)")
    g.add_argument("--lines512", type=int, default=512, help="requests of lines512")
    g.add_argument("--lines512-tokens", type=int, default=32)
    g.add_argument("--profile", action="store_true",
                   help="blocks / lines512: a second, profiled run for the device-active fraction")
    g.add_argument("--itl", action="store_true",
                   help="pages64 / lines256 / blocks / lines512: a re-run with every request streamed, reporting "
                        "the inter-token gaps of running requests (those spanning a prefill step apart)")
    g.add_argument("--ref-batch", type=int, default=32, help="the reference's batch (a subset of the pages/lines)")
    g.add_argument("--no-reference", action="store_true", help="skip transformers")
    g.add_argument("--json-out", default=None)


def options_from_args(ns, on_cpu: bool) -> GenerateBenchOptions:
    wl = tuple(ns.workloads.split(",")) if ns.workloads else (("page1", "lines256") if on_cpu else WORKLOADS)
    bad = set(wl) - set(WORKLOADS)
    if bad:
        raise ValueError(f"unknown workload(s) {sorted(bad)}; choose from {', '.join(WORKLOADS)}")
    if not 1 <= ns.crops_per_page <= len(PAGE_LAYOUT):
        raise ValueError(f"--crops-per-page must be in [1, {len(PAGE_LAYOUT)}], got {ns.crops_per_page}")
    if not ns.block_token_scale > 0:
        raise ValueError(f"--block-token-scale must be > 0, got {ns.block_token_scale}")
    page_size = parse_page_size(getattr(ns, "page_size", "1920x1080"))
    return GenerateBenchOptions(workloads=wl, pages=ns.pages, page_tokens=ns.page_tokens, page1_tokens=ns.page1_tokens,
                                page_size=page_size,
                                lines=ns.lines or (16 if on_cpu else 256), line_tokens=ns.line_tokens,
                                crops_per_page=ns.crops_per_page, block_token_scale=ns.block_token_scale,
                                lines512=ns.lines512, lines512_tokens=ns.lines512_tokens, profile=ns.profile,
                                itl=getattr(ns, "itl", False),
                                ref_batch=ns.ref_batch, reference=not ns.no_reference, json_out=ns.json_out)


def parse_page_size(text: str) -> tuple[int, int]:
    """``WxH`` in pixels, each side 16..10000 (a page beyond that is no page)."""
    try:
        w, h = (int(v) for v in text.lower().split("x"))
    except ValueError:
        raise ValueError(f"--page-size must be WxH in pixels, like 1240x1754, got {text!r}") from None
    if not (16 <= w <= 10_000 and 16 <= h <= 10_000):
        raise ValueError(f"--page-size sides must be within 16..10000 pixels, got {w}x{h}")
    return w, h


# ------------------------------------------------------------------ inputs
def synthetic_png(seed: int, width: int, height: int, lines: int) -> bytes:
    """A document-like image: white page, dark 'text' strokes in rows (different per seed)."""
    from PIL import Image
    rng = np.random.default_rng(seed)
    img = np.full((height, width, 3), 255, np.uint8)
    row_h = max(height // max(lines, 1), 8)
    for r in range(lines):
        y = r * row_h + row_h // 4
        x = int(rng.integers(0, width // 10))
        while x < width - 20:
            w = int(rng.integers(4, 40))
            img[y:y + row_h // 2, x:x + w] = rng.integers(0, 90)
            x += w + int(rng.integers(3, 15))
    buf = io.BytesIO()
    Image.fromarray(img).save(buf, format="PNG")
    return buf.getvalue()


def page_pngs(n: int, seed0: int = 0, size: tuple[int, int] = (1920, 1080)) -> list[bytes]:
    return [synthetic_png(seed0 + i, size[0], size[1], 40) for i in range(n)]


def line_pngs(n: int, seed0: int = 10_000) -> list[bytes]:
    return [synthetic_png(seed0 + i, 640 + 16 * (i % 8), 48, 1) for i in range(n)]


@dataclass(frozen=True)
class BlockKind:
    """One kind of layout block: its crop size, output length, prompt and priority."""
    name: str
    width: int
    height: int
    text_rows: int
    tokens: int
    prompt: str = "OCR:"
    priority: int = 0            # lower decodes first: the long outputs start early


BLOCK_KINDS = {k.name: k for k in (
    BlockKind("title", 900, 60, 1, 16),
    BlockKind("paragraph", 1000, 180, 5, 120, priority=-1),
    BlockKind("table", 1000, 600, 20, 600, "Table Recognition:", priority=-2),
    BlockKind("formula", 500, 80, 2, 60, "Formula Recognition:"),
    BlockKind("caption", 800, 60, 1, 40),
)}
#: one page's 16 crops in submission order: 2 titles, 9 paragraphs, 1 table, 2 formulas, 2
#: captions, interleaved so that the first five are one of each kind (--crops-per-page 5)
PAGE_LAYOUT = ("title", "paragraph", "table", "formula", "caption", "paragraph", "paragraph", "title",
               "paragraph", "formula", "paragraph", "caption", "paragraph", "paragraph", "paragraph", "paragraph")


@dataclass(frozen=True)
class BenchRequest:
    image: bytes
    prompt: str
    tokens: int
    priority: int = 0
    kind: str = ""
    mm_processor_kwargs: dict | None = None

    def engine_prompt(self) -> dict:
        p = {"prompt": self.prompt, "images": [self.image]}
        if self.mm_processor_kwargs:
            p["mm_processor_kwargs"] = dict(self.mm_processor_kwargs)
        return p


def block_requests(pages: int, crops_per_page: int = 16, token_scale: float = 1.0, mm_kwargs: dict | None = None,
                   seed0: int = 20_000) -> list[BenchRequest]:
    """``pages`` pages of the first ``crops_per_page`` crops of PAGE_LAYOUT, each crop a
    different synthetic image of its kind's size."""
    out = []
    for page in range(pages):
        for j, name in enumerate(PAGE_LAYOUT[:crops_per_page]):
            k = BLOCK_KINDS[name]
            png = synthetic_png(seed0 + page * 100 + j, k.width, k.height, k.text_rows)
            out.append(BenchRequest(png, k.prompt, max(1, round(k.tokens * token_scale)), k.priority, k.name, mm_kwargs))
    return out


def released_pixel_kwargs(engine: LLMEngine) -> tuple[dict | None, str]:
    """The released checkpoint's min/max pixels as mm_processor_kwargs (the family's
    ``released_image_processor`` hook), and where they came from."""
    family = getattr(engine.runner, "family", None)
    try:
        cfg = family.released_image_processor().cfg
    except (AttributeError, NotImplementedError) as e:
        return None, f"the engine's own image processor (no released settings: {e})"
    return ({"min_pixels": cfg.min_pixels, "max_pixels": cfg.max_pixels},
            f"released min_pixels {cfg.min_pixels}, max_pixels {cfg.max_pixels}")


def _warm_kinds(workloads) -> list[str]:
    kind = {"lines256": "line", "lines512": "line", "blocks": "blocks"}
    return list(dict.fromkeys(kind.get(wl, "page") for wl in workloads))


def warmup_images(workloads, page_size: tuple[int, int] = (1920, 1080)) -> list[list[bytes]]:
    """One warm-up image per image shape among ``workloads``: a text line for lines256 /
    lines512, a page of ``page_size`` for page1 / pages64, one crop of each block kind for blocks."""
    def images(k):
        if k == "line":
            return line_pngs(1, 99_999)
        if k == "blocks":
            return [r.image for r in block_requests(1, len(BLOCK_KINDS), seed0=88_888)]
        return page_pngs(1, 77_777, page_size)
    return [images(k) for k in _warm_kinds(workloads)]


def bench_params(tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True, detokenize=False,
                          repetition_guard=RepetitionGuard(enabled=False))


def interval_union_s(intervals: list[tuple[float, float]]) -> float:
    """Total length of the union of [start, end) intervals (overlapping kernels on several
    streams count once)."""
    total, end = 0.0, None
    for a, b in sorted(intervals):
        if end is None or a > end:
            total += b - a
            end = b
        elif b > end:
            total += b - end
            end = b
    return total


def step_summary(times: list[float]) -> dict:
    return {"count": len(times), "total_s": sum(times), "median_s": statistics.median(times) if times else None}


def _quantile(sorted_values: list[float], q: float) -> float:
    return sorted_values[min(len(sorted_values) - 1, int(q * len(sorted_values)))]


def gap_summary(gaps: list[float]) -> dict:
    if not gaps:
        return {"count": 0, "p50_ms": None, "p99_ms": None, "max_ms": None}
    g = sorted(gaps)
    return {"count": len(g), "p50_ms": _quantile(g, 0.5) * 1e3, "p99_ms": _quantile(g, 0.99) * 1e3,
            "max_ms": g[-1] * 1e3}


def inter_token_gaps(token_times: dict[str, list[float]], prefill_ends: list[float]) -> dict:
    """Gaps between consecutive token arrivals on the host, per request, over all requests: all
    of them, and those during which a prefill step ended (a newcomer's vision pass and prefill
    ran between the two tokens, or, with mixed steps, produced the second)."""
    import bisect
    ends = sorted(prefill_ends)
    every, spanning = [], []
    for times in token_times.values():
        for a, b in zip(times, times[1:]):
            every.append(b - a)
            i = bisect.bisect_right(ends, a)
            if i < len(ends) and ends[i] <= b:
                spanning.append(b - a)
    return {"all": gap_summary(every), "spanning_prefill": gap_summary(spanning)}


# ------------------------------------------------------------------ measuring
class GpuBusySampler:
    """Mean device utilization (% of time a kernel ran, per sample of the vendor's management
    library) while running, from ``DeviceRunner.utilization_reader()``; None where the backend
    cannot tell (CPU)."""

    def __init__(self, read_pct, period_s: float = 0.02):
        self.samples: list[int] = []
        self.period = period_s
        self._stop = threading.Event()
        self._read = read_pct

    def __enter__(self):
        if self._read is not None:
            self._thread = threading.Thread(target=self._run, daemon=True)
            self._thread.start()
        return self

    def _run(self):
        while not self._stop.is_set():
            self.samples.append(self._read())
            time.sleep(self.period)

    def __exit__(self, *exc):
        self._stop.set()
        if self._read is not None:
            self._thread.join()

    @property
    def busy_pct(self) -> float | None:
        return statistics.fmean(self.samples) if self.samples else None


def _reset_peak(api: DeviceAPI) -> None:
    if api.allocator_stats:
        api.reset_peak_allocated()


def _peak(api: DeviceAPI) -> int | None:
    """Peak bytes since _reset_peak where the allocator reports it; the process's peak RSS on the host."""
    return api.peak_allocated_bytes() if api.allocator_stats else api.memory_stats().get("peak_bytes")


def run_ours(engine: LLMEngine, images: list[bytes], prompt: str, tokens: int) -> dict:
    """``images`` with one prompt and output length (see run_requests)."""
    return run_requests(engine, [BenchRequest(png, prompt, tokens) for png in images])


def run_requests(engine: LLMEngine, requests: list[BenchRequest], profile: bool = False, itl: bool = False) -> dict:
    """All requests submitted at once (preprocessing in the pool); wall time to the last token,
    first-token time of the earliest request, token ids per request, the steps by kind, and where
    the wall time went (see `_stages`). ``profile``: the run under torch.profiler with the device
    API's activity, for the device-active fraction. ``itl``: every request streamed, the time
    each token reached the host recorded (``inter_token_gaps``)."""
    api = device_api_for(getattr(engine.runner, "device", "cpu"))
    api.synchronize()
    _reset_peak(api)
    ids = [f"bench-{time.monotonic_ns()}-{i}" for i in range(len(requests))]
    done = {}
    before = engine.stats()
    steps_done = (before.num_prefill_steps, before.num_decode_steps)
    step_s = {"prefill": 0.0, "decode": 0.0}
    step_times: dict[str, list[float]] = {"prefill": [], "decode": []}
    decode_batch: list[int] = []
    running = before.num_running
    token_times: dict[str, list[float]] = {}
    prefill_ends: list[float] = []
    prof = _profiler(api) if profile else None
    from tqdm.auto import tqdm
    # finished requests on stderr (a multi-minute CPU run is not silent); updated only when a
    # request finishes, at most once a second: nothing measurable inside the timed loop
    bar = tqdm(total=len(requests), desc="bench generate", unit="req", mininterval=1.0, disable=len(requests) < 2)
    with bar, GpuBusySampler(getattr(engine.runner, "utilization_reader", lambda: None)()) as gpu, \
            (prof if prof is not None else _nothing()):
        t0, t0_epoch = time.perf_counter(), time.time()
        futures = [engine.submit(rid, r.engine_prompt(), bench_params(r.tokens), stream=itl or len(requests) == 1,
                                 priority=r.priority) for rid, r in zip(ids, requests)]
        while engine.has_unfinished():
            ts = time.perf_counter()
            outs = engine.step()
            # a step ends with its sampled ids on the host (a device sync), so its wall time
            # covers its device work; a call that ran no step (nothing ready) counts as other
            dt = time.perf_counter() - ts
            st = engine.stats()
            now = (st.num_prefill_steps, st.num_decode_steps)
            if now != steps_done:
                kind = "prefill" if now[0] > steps_done[0] else "decode"
                step_s[kind] += dt
                step_times[kind].append(dt)
                if kind == "decode":         # a decode step admits nobody: it ran those running before it
                    decode_batch.append(running)
                steps_done = now
                if itl and kind == "prefill":
                    prefill_ends.append(ts + dt)
            running = st.num_running
            if itl:
                for o in outs:
                    if o.delta_token_ids:
                        token_times.setdefault(o.request_id, []).append(ts + dt)
            for o in outs:
                if o.finished:
                    done[o.request_id] = o
                    bar.update(1)
            if not outs and not engine.has_unfinished_in_engine():
                time.sleep(0.0005)          # still preprocessing: nothing to run yet
        api.synchronize()
        wall = time.perf_counter() - t0
    for i, f in enumerate(futures):       # refused before queueing (e.g. pixels over the engine's limits)
        if f.exception() is not None:
            raise InvalidRequest(f"bench request {i} ({requests[i].kind or 'image'}): {f.exception()}")
    n_out = sum(len(o.token_ids) for o in done.values())
    firsts = [o.metrics.first_token for o in done.values() if o.metrics.first_token is not None]
    res = {"wall_s": wall, "ttft_s": min(firsts) - t0_epoch if firsts else None, "requests": len(requests),
           "output_tokens": n_out, "requests_per_s": len(requests) / wall, "output_tokens_per_s": n_out / wall,
           "gpu_busy_pct": gpu.busy_pct, "peak_memory_bytes": _peak(api),
           "steps": {k: step_summary(v) for k, v in step_times.items()},
           "decode_batch": {"median": statistics.median(decode_batch) if decode_batch else None,
                            "max": max(decode_batch, default=None)},
           "mixed_steps": engine.stats().num_mixed_steps - before.num_mixed_steps,
           "stages": _stages(before, engine.stats(), step_s, wall),
           "token_ids": [done[r].token_ids for r in ids],
           "first_scheduled_s": [done[r].metrics.first_scheduled - t0_epoch for r in ids],
           "kv_blocks_used_after": engine.block_manager.num_used}
    if itl:
        res["inter_token_gaps"] = inter_token_gaps(token_times, prefill_ends)
    if prof is not None:
        res["device_active_s"] = device_active_s(prof)
        res["device_active_fraction"] = res["device_active_s"] / wall
    return res


class _nothing:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


def _profiler(api: DeviceAPI):
    """torch.profiler with the device's activity (None on the host: nothing to profile)."""
    if api.profiler_activity is None:
        return None
    from torch.profiler import profile
    return profile(activities=[api.profiler_activity])


def device_active_s(prof) -> float:
    """Seconds of the union of the device-side events (kernels, copies) the profiler recorded."""
    from torch.autograd import DeviceType
    spans = [(e.time_range.start / 1e6, e.time_range.end / 1e6) for e in prof.events()
             if e.device_type != DeviceType.CPU and e.time_range.end > e.time_range.start]
    return interval_union_s(spans)


def _stages(before, after, step_s: dict, wall: float) -> dict:
    """Where a run's wall time went: prefill steps (their vision passes included), decode steps,
    and the rest (the step loop waiting for preprocessing, or between steps). Preprocessing is
    CPU time summed over the worker pool, overlapped with the steps; vision_host_s is the host's
    time in the vision passes (on CUDA the launches, the device time lands in prefill_s)."""
    return {"prefill_steps": after.num_prefill_steps - before.num_prefill_steps, "prefill_s": step_s["prefill"],
            "decode_steps": after.num_decode_steps - before.num_decode_steps, "decode_s": step_s["decode"],
            "other_s": max(wall - step_s["prefill"] - step_s["decode"], 0.0),
            "vision_passes": after.vision_passes - before.vision_passes,
            "vision_host_s": after.vision_s - before.vision_s,
            "preprocess_worker_s": after.preprocess_s - before.preprocess_s}


def stages_line(st: dict) -> str:
    return (f"    stages: prefill {st['prefill_s']:.2f} s / {st['prefill_steps']} steps "
            f"({st['vision_passes']} vision passes) | decode {st['decode_s']:.2f} s / {st['decode_steps']} steps "
            f"| other {st['other_s']:.2f} s | preprocessing {st['preprocess_worker_s']:.2f} s summed over the workers (wall, overlapped)")


def gaps_line(gaps: dict, mixed: bool) -> str:
    def one(g):
        if not g["count"]:
            return "none"
        return f"{g['count']} gaps, p50 {g['p50_ms']:.1f} ms, p99 {g['p99_ms']:.1f} ms, max {g['max_ms']:.1f} ms"
    return (f"    inter-token gaps (streamed re-run, mixed steps {'on' if mixed else 'off'}): all {one(gaps['all'])} "
            f"| spanning a prefill step {one(gaps['spanning_prefill'])}")


def steps_line(steps: dict) -> str:
    def one(kind):
        st = steps[kind]
        med = f", median {st['median_s'] * 1000:.2f} ms" if st["median_s"] is not None else ""
        return f"{kind} {st['count']} steps, {st['total_s']:.2f} s{med}"
    return f"    steps: {one('prefill')} | {one('decode')}"


# ------------------------------------------------------------------ the reference
class TransformersReference:
    """transformers' PaddleOCRVLForConditionalGeneration: the model dir's weights, or (dummy)
    its own random init of the released config: the same shapes and work, other values, so
    speed compares and tokens do not (reported as such)."""

    def __init__(self, model_dir: str | None, device: torch.device, dtype: torch.dtype, engine: LLMEngine):
        from transformers import PaddleOCRVLConfig, PaddleOCRVLForConditionalGeneration
        if model_dir is None:
            with torch.device(device):
                self.model = PaddleOCRVLForConditionalGeneration(PaddleOCRVLConfig()).to(dtype).eval()
        else:
            self.model = PaddleOCRVLForConditionalGeneration.from_pretrained(model_dir, dtype=dtype).to(device).eval()
        self.same_weights = model_dir is not None
        self.device, self.engine = device, engine
        self.api = device_api_for(device)

    def _inputs(self, images: list[bytes], prompt: str):
        """Same prompt ids and pixels as ours (our processor equals transformers' PIL one); left
        padding for the batch."""
        procs = [self.engine.input_processor.process({"prompt": prompt, "images": [png]}) for png in images]
        n = max(len(p.prompt_token_ids) for p in procs)
        ids = torch.zeros(len(procs), n, dtype=torch.long)
        mask = torch.zeros(len(procs), n, dtype=torch.long)
        for i, p in enumerate(procs):
            ids[i, n - len(p.prompt_token_ids):] = torch.tensor(p.prompt_token_ids)
            mask[i, n - len(p.prompt_token_ids):] = 1
        pv = torch.cat([it.encoder_inputs for p in procs for it in p.items])
        grid = torch.tensor([it.grid for p in procs for it in p.items])
        d = self.device
        mm = (ids == self.model.config.image_token_id).int()
        return dict(input_ids=ids.to(d), attention_mask=mask.to(d), pixel_values=pv.to(d, self.model.dtype),
                    image_grid_thw=grid.to(d), mm_token_type_ids=mm.to(d))

    def generate(self, images: list[bytes], prompt: str, tokens: int) -> tuple[float, list[list[int]]]:
        self.api.synchronize()
        t0 = time.perf_counter()
        inputs = self._inputs(images, prompt)
        with torch.inference_mode():
            out = self.model.generate(**inputs, max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False)
        self.api.synchronize()
        dt = time.perf_counter() - t0
        n = inputs["input_ids"].shape[1]
        return dt, out[:, n:].tolist()


def reference_class(engine: LLMEngine):
    """transformers' model of the engine's family: the family's own (``generate_reference()``),
    else PaddleOCR-VL's above."""
    family = getattr(engine.runner, "family", None)
    own = family.generate_reference() if family is not None else None
    return own or TransformersReference


# ------------------------------------------------------------------ the run
# The reference runs in this process on the same GPU: its weights, KV cache and a 32-page vision
# pass need tens of GiB, which a KV pool sized at 0.9 of the card leaves no room for (measured on
# the H200: the reference's first pages64 batch ran out of memory).
REFERENCE_GPU_SHARE = 0.5


def run_generate_bench(config: EngineConfig, opts: GenerateBenchOptions) -> dict:
    if opts.reference and config.gpu_memory_utilization > REFERENCE_GPU_SHARE:
        log.info("bench generate: the transformers reference shares the device: our KV pool sized at "
                 "--gpu-memory-utilization %.2f instead of %.2f (--no-reference keeps yours)",
                 REFERENCE_GPU_SHARE, config.gpu_memory_utilization)
        config = replace(config, gpu_memory_utilization=REFERENCE_GPU_SHARE)
    engine = LLMEngine(config)
    device = torch.device(engine.runner.device)
    dtype = engine.runner.dtype
    ref = reference_class(engine)(config.model, device, dtype, engine) if opts.reference else None
    report = {"device": str(device), "dtype": str(dtype).replace("torch.", ""), "model": config.model or "dummy",
              "max_prefill": bool(engine.max_prefill.value), "max_num_seqs": config.max_num_seqs,
              "max_num_batched_tokens": config.max_num_batched_tokens,
              "kv_blocks": engine.block_manager.num_blocks, "page_size": "%dx%d" % opts.page_size, "workloads": {},
              "reference_weights": (None if ref is None else "same as ours" if ref.same_weights else
                                    "transformers' own random init (dummy): speed compares, tokens do not")}
    # warm-up: one image of each shape the requested workloads use (other pixels than the timed
    # ones), so no workload's first request pays Triton compiles or allocator growth; the
    # reference likewise. Only those shapes: a 1080p page on the CPU takes minutes.
    warm = warmup_images(opts.workloads, opts.page_size)
    kinds = _warm_kinds(opts.workloads)
    pixel_kwargs, pixels_source = released_pixel_kwargs(engine) if "blocks" in opts.workloads else (None, "")
    log.info("bench generate: warm-up with %d image(s) (%s)", sum(map(len, warm)), ", ".join(kinds))
    for kind, imgs in zip(kinds, warm):
        if kind == "blocks":       # at the pixel bounds the timed blocks use
            run_requests(engine, [BenchRequest(png, opts.prompt, 4, mm_processor_kwargs=pixel_kwargs) for png in imgs])
        else:
            run_ours(engine, imgs, opts.prompt, 4)
    if ref:
        for kind, imgs in zip(kinds, warm):
            if kind != "blocks":       # the reference does not run blocks (module docstring)
                ref.generate(imgs, opts.prompt, 4)
    for wl in opts.workloads:
        if wl == "page1":
            pages = page_pngs(1, 5_000, opts.page_size)
            first = run_ours(engine, pages, opts.prompt, 1)
            full = run_ours(engine, pages, opts.prompt, opts.page1_tokens)
            res = {"ours": {"ttft_s": first["wall_s"],
                            "decode_tokens_per_s": (opts.page1_tokens - 1) / (full["wall_s"] - full["ttft_s"]),
                            "gpu_busy_pct": full["gpu_busy_pct"], "peak_memory_bytes": full["peak_memory_bytes"],
                            "stages": full["stages"]}}
            if ref:
                t1, _ = ref.generate(pages, opts.prompt, 1)
                tn, ref_ids = ref.generate(pages, opts.prompt, opts.page1_tokens)
                res["reference"] = {"ttft_s": t1, "decode_tokens_per_s": (opts.page1_tokens - 1) / (tn - t1)}
                res["same_tokens"] = ref_ids[0] == full["token_ids"][0] if ref.same_weights else None
                res["ttft_speedup"] = t1 / first["wall_s"]
                res["decode_speedup"] = res["ours"]["decode_tokens_per_s"] / res["reference"]["decode_tokens_per_s"]
        elif wl == "blocks":
            res = _blocks(engine, opts, pixel_kwargs, pixels_source)
        else:
            imgs = {"pages64": lambda: page_pngs(opts.pages, size=opts.page_size), "lines256": lambda: line_pngs(opts.lines),
                    "lines512": lambda: line_pngs(opts.lines512)}[wl]()
            tokens = {"pages64": opts.page_tokens, "lines256": opts.line_tokens, "lines512": opts.lines512_tokens}[wl]
            reqs = [BenchRequest(png, opts.prompt, tokens) for png in imgs]
            ours = run_requests(engine, reqs)
            ids = ours.pop("token_ids")
            ours.pop("first_scheduled_s")
            if wl in NEW_WORKLOADS:
                _profiled(engine, reqs, ours, opts)
            _gaps(engine, reqs, ours, opts)
            res = {"ours": ours}
            if ref:
                sub = imgs[:opts.ref_batch]
                dt, ref_ids = ref.generate(sub, opts.prompt, tokens)
                res["reference"] = {"requests": len(sub), "wall_s": dt, "requests_per_s": len(sub) / dt,
                                    "output_tokens_per_s": len(sub) * tokens / dt}
                res["speedup_per_request"] = ours["requests_per_s"] / res["reference"]["requests_per_s"]
                res["same_tokens_fraction"] = (sum(a == b for a, b in zip(ref_ids, ids)) / len(sub)
                                               if ref.same_weights else None)
        report["workloads"][wl] = res
        log.info("%s: %s", wl, json.dumps(res, default=str))
    report["kv_blocks_used_at_end"] = engine.block_manager.num_used
    engine.shutdown()
    return report


def _profiled(engine: LLMEngine, reqs: list[BenchRequest], ours: dict, opts: GenerateBenchOptions) -> None:
    """--profile: the same requests again under torch.profiler; its device-active fraction (the
    profiled run's own wall, which the profiler slows: the headline figures are the unprofiled run's)."""
    if not opts.profile:
        ours.update(device_active_fraction=None, device_active="not measured (run with --profile)")
        return
    api = device_api_for(getattr(engine.runner, "device", "cpu"))
    if api.profiler_activity is None:
        ours.update(device_active_fraction=None,
                    device_active=f"n/a: the {api.name} device API has no profiler activity (no device kernels)")
        return
    run = run_requests(engine, reqs, profile=True)
    ours.update(device_active_fraction=run["device_active_fraction"], device_active_s=run["device_active_s"],
                profiled_wall_s=run["wall_s"],
                device_active=f"{run['device_active_fraction'] * 100:.0f}% of a profiled re-run's "
                              f"{run['wall_s']:.2f} s wall (union of device kernel intervals, torch.profiler)")


def _gaps(engine: LLMEngine, reqs: list[BenchRequest], ours: dict, opts: GenerateBenchOptions) -> None:
    """--itl: the same requests again, every one streamed; the inter-token gaps of that run
    (streaming adds an output per request per step: the headline figures are the first run's)."""
    if not opts.itl:
        return
    run = run_requests(engine, reqs, itl=True)
    ours.update(inter_token_gaps=run["inter_token_gaps"], itl_wall_s=run["wall_s"],
                mixed_steps_enabled=bool(engine.mixed_steps.value))


def _blocks(engine: LLMEngine, opts: GenerateBenchOptions, pixel_kwargs: dict | None, pixels_source: str) -> dict:
    reqs = block_requests(opts.pages, opts.crops_per_page, opts.block_token_scale, pixel_kwargs)
    ours = run_requests(engine, reqs)
    ours.pop("token_ids")
    first = ours.pop("first_scheduled_s")
    kinds = {}
    for name in dict.fromkeys(r.kind for r in reqs):
        idx = [i for i, r in enumerate(reqs) if r.kind == name]
        k = BLOCK_KINDS[name]
        kinds[name] = {"requests": len(idx), "tokens": reqs[idx[0]].tokens, "priority": k.priority, "prompt": k.prompt,
                       "size": f"{k.width}x{k.height}",
                       "median_first_scheduled_s": statistics.median(first[i] for i in idx)}
    ours.update(pages=opts.pages, crops_per_page=opts.crops_per_page, pages_per_s=opts.pages / ours["wall_s"],
                kinds=kinds, pixels=pixels_source, token_scale=opts.block_token_scale,
                priority="table -2, paragraph -1, title/formula/caption 0: lower is scheduled first, so the "
                         "long decodes start early")
    _profiled(engine, reqs, ours, opts)
    _gaps(engine, reqs, ours, opts)
    return {"ours": ours, "reference": None,
            "reference_skipped": "not run for blocks: mixed prompts and output lengths per request (transformers' "
                                 "generate takes one length per batch)"}


def _same(v) -> str:
    if v is None:
        return "n/a (other random weights)"
    return str(v) if isinstance(v, bool) else f"{v * 100:.0f}%"


def print_report(report: dict) -> None:
    print(f"bench generate: device {report['device']} dtype {report['dtype']} model {report['model']} "
          f"max_prefill={report['max_prefill']} kv_blocks={report['kv_blocks']} max_num_seqs={report['max_num_seqs']} "
          f"pages {report.get('page_size', '1920x1080')}")
    for wl, r in report["workloads"].items():
        o, ref = r["ours"], r.get("reference")
        busy = f"{o['gpu_busy_pct']:.0f}%" if o.get("gpu_busy_pct") is not None else "n/a"
        mem = f"{o['peak_memory_bytes'] / 2**30:.2f} GiB" if o.get("peak_memory_bytes") else "n/a"
        if wl == "page1":
            line = f"  page1: TTFT {o['ttft_s'] * 1000:.1f} ms, decode {o['decode_tokens_per_s']:.1f} tok/s"
            if ref:
                line += (f" | transformers TTFT {ref['ttft_s'] * 1000:.1f} ms, decode {ref['decode_tokens_per_s']:.1f} "
                         f"tok/s | x{r['ttft_speedup']:.2f} TTFT, x{r['decode_speedup']:.2f} decode, "
                         f"same tokens: {_same(r['same_tokens'])}")
        elif wl == "blocks":
            line = (f"  blocks: {o['pages']} pages x {o['crops_per_page']} crops = {o['requests']} req, "
                    f"{o['pages_per_s']:.2f} pages/s ({o['requests_per_s']:.1f} req/s), "
                    f"{o['output_tokens_per_s']:.0f} out tok/s, wall {o['wall_s']:.2f} s")
        else:
            line = (f"  {wl}: {o['requests']} req, {o['requests_per_s']:.2f} req/s, "
                    f"{o['output_tokens_per_s']:.0f} out tok/s, wall {o['wall_s']:.2f} s")
            if ref:
                line += (f" | transformers {ref['requests']} req at batch {ref['requests']}: "
                         f"{ref['requests_per_s']:.2f} req/s | x{r['speedup_per_request']:.2f} per request, "
                         f"same tokens: {_same(r['same_tokens_fraction'])}")
        print(line + f" | GPU busy {busy}, peak {mem}")
        if wl == "blocks":
            print(f"    priority: {o['priority']}; pixels: {o['pixels']}"
                  + (f"; output lengths x{o['token_scale']:g}" if o["token_scale"] != 1 else ""))
            print("    kinds: " + ", ".join(f"{n} {k['requests']} x {k['tokens']} tok (priority {k['priority']}, "
                                             f"first scheduled at {k['median_first_scheduled_s']:.2f} s median)"
                                             for n, k in o["kinds"].items()))
            print(f"    reference: {r['reference_skipped']}")
        if o.get("steps"):
            batch = o.get("decode_batch") or {}
            print(steps_line(o["steps"]) + f" | mixed {o.get('mixed_steps', 0)} of the prefill steps"
                  + (f" | decode batch median {batch['median']:g}, max {batch['max']}" if batch.get("max") else ""))
        if o.get("inter_token_gaps"):
            print(gaps_line(o["inter_token_gaps"], o["mixed_steps_enabled"]))
        if o.get("stages"):
            print(stages_line(o["stages"]))
        if "device_active" in o:
            print(f"    device active: {o['device_active']}")


def run_cli(config: EngineConfig, opts: GenerateBenchOptions) -> int:
    report = run_generate_bench(config, opts)
    print_report(report)
    if opts.json_out:
        os.makedirs(os.path.dirname(os.path.abspath(opts.json_out)), exist_ok=True)
        with open(opts.json_out, "w") as f:
            json.dump(report, f, indent=1, default=str)
        print(f"wrote {opts.json_out}")
    return 0


__all__ = ["GenerateBenchOptions", "run_generate_bench", "add_arguments", "options_from_args", "run_cli"]
