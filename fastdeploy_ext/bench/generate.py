"""`fastdeploy-ext bench generate`: our engine and transformers' `generate` in one run, same
prompt ids and pixels; same weights with --model DIR (with --load-format dummy transformers
uses its own random init of the same config: speed compares, tokens do not). DESIGN.md section
7, issue 8 item 12. Nothing here asserts a time.

Workloads (greedy, ignore_eos, "OCR:"):
- page1: one 1080p page; time to first token from the call with the PNG bytes in memory to the
  first token on the host (preprocess + vision + prefill), then decode tokens/s at batch 1;
- pages64: N different 1080p pages x exactly T new tokens: pages/s and output tokens/s (the
  reference runs a subset at batch --ref-batch; compared per page);
- lines256: N text-line crops x 64 tokens.
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
from ..engine.llm_engine import LLMEngine
from ..engine.sampling_params import RepetitionGuard, SamplingParams

log = logging.getLogger(__name__)

WORKLOADS = ("page1", "pages64", "lines256")


@dataclass(frozen=True)
class GenerateBenchOptions:
    workloads: tuple[str, ...] = WORKLOADS
    pages: int = 64
    page_tokens: int = 512
    page1_tokens: int = 256
    lines: int = 256
    line_tokens: int = 64
    ref_batch: int = 32
    reference: bool = True
    json_out: str | None = None
    prompt: str = "OCR:"


def add_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("bench generate")
    g.add_argument("--workloads", default=None, help=f"comma list of {', '.join(WORKLOADS)} "
                   "(default: all; on CPU page1,lines256 with --lines 16)")
    g.add_argument("--pages", type=int, default=64)
    g.add_argument("--page-tokens", type=int, default=512)
    g.add_argument("--page1-tokens", type=int, default=256, help="tokens of the batch-1 decode measurement")
    g.add_argument("--lines", type=int, default=None, help="text-line crops (default 256; 16 on CPU)")
    g.add_argument("--line-tokens", type=int, default=64)
    g.add_argument("--ref-batch", type=int, default=32, help="the reference's batch (a subset of the pages/lines)")
    g.add_argument("--no-reference", action="store_true", help="skip transformers")
    g.add_argument("--json-out", default=None)


def options_from_args(ns, on_cpu: bool) -> GenerateBenchOptions:
    wl = tuple(ns.workloads.split(",")) if ns.workloads else (("page1", "lines256") if on_cpu else WORKLOADS)
    bad = set(wl) - set(WORKLOADS)
    if bad:
        raise ValueError(f"unknown workload(s) {sorted(bad)}; choose from {', '.join(WORKLOADS)}")
    return GenerateBenchOptions(workloads=wl, pages=ns.pages, page_tokens=ns.page_tokens, page1_tokens=ns.page1_tokens,
                                lines=ns.lines or (16 if on_cpu else 256), line_tokens=ns.line_tokens,
                                ref_batch=ns.ref_batch, reference=not ns.no_reference, json_out=ns.json_out)


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


def page_pngs(n: int, seed0: int = 0) -> list[bytes]:
    return [synthetic_png(seed0 + i, 1920, 1080, 40) for i in range(n)]


def line_pngs(n: int, seed0: int = 10_000) -> list[bytes]:
    return [synthetic_png(seed0 + i, 640 + 16 * (i % 8), 48, 1) for i in range(n)]


def _warm_kinds(workloads) -> list[str]:
    return list(dict.fromkeys("lines256" if wl == "lines256" else "page" for wl in workloads))


def warmup_images(workloads) -> list[list[bytes]]:
    """One warm-up image per image shape among ``workloads``: a text line for lines256, a 1080p
    page for page1 / pages64."""
    return [line_pngs(1, 99_999) if k == "lines256" else page_pngs(1, 77_777) for k in _warm_kinds(workloads)]


def bench_params(tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True, detokenize=False,
                          repetition_guard=RepetitionGuard(enabled=False))


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
    """All requests submitted at once (preprocessing in the pool); wall time to the last token,
    first-token time of the earliest request, token ids per request, and where the wall time
    went (see `_stages`)."""
    api = device_api_for(getattr(engine.runner, "device", "cpu"))
    api.synchronize()
    _reset_peak(api)
    params = bench_params(tokens)
    ids = [f"bench-{time.monotonic_ns()}-{i}" for i in range(len(images))]
    done = {}
    before = engine.stats()
    steps_done = (before.num_prefill_steps, before.num_decode_steps)
    step_s = {"prefill": 0.0, "decode": 0.0}
    from tqdm.auto import tqdm
    # finished requests on stderr (a multi-minute CPU run is not silent); updated only when a
    # request finishes, at most once a second: nothing measurable inside the timed loop
    bar = tqdm(total=len(images), desc="bench generate", unit="req", mininterval=1.0, disable=len(images) < 2)
    with bar, GpuBusySampler(getattr(engine.runner, "utilization_reader", lambda: None)()) as gpu:
        t0, t0_epoch = time.perf_counter(), time.time()
        for rid, png in zip(ids, images):
            engine.submit(rid, {"prompt": prompt, "images": [png]}, params, stream=len(images) == 1)
        while engine.has_unfinished():
            ts = time.perf_counter()
            outs = engine.step()
            # a step ends with its sampled ids on the host (a device sync), so its wall time
            # covers its device work; a call that ran no step (nothing ready) counts as other
            dt = time.perf_counter() - ts
            st = engine.stats()
            now = (st.num_prefill_steps, st.num_decode_steps)
            if now != steps_done:
                step_s["prefill" if now[0] > steps_done[0] else "decode"] += dt
                steps_done = now
            for o in outs:
                if o.finished:
                    done[o.request_id] = o
                    bar.update(1)
            if not outs and not engine.has_unfinished_in_engine():
                time.sleep(0.0005)          # still preprocessing: nothing to run yet
        wall = time.perf_counter() - t0
    n_out = sum(len(o.token_ids) for o in done.values())
    firsts = [o.metrics.first_token for o in done.values() if o.metrics.first_token is not None]
    return {"wall_s": wall, "ttft_s": min(firsts) - t0_epoch if firsts else None, "requests": len(images),
            "output_tokens": n_out, "requests_per_s": len(images) / wall, "output_tokens_per_s": n_out / wall,
            "gpu_busy_pct": gpu.busy_pct, "peak_memory_bytes": _peak(api),
            "stages": _stages(before, engine.stats(), step_s, wall),
            "token_ids": [done[r].token_ids for r in ids],
            "kv_blocks_used_after": engine.block_manager.num_used}


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
            "preprocess_cpu_s": after.preprocess_s - before.preprocess_s}


def stages_line(st: dict) -> str:
    return (f"    stages: prefill {st['prefill_s']:.2f} s / {st['prefill_steps']} steps "
            f"({st['vision_passes']} vision passes) | decode {st['decode_s']:.2f} s / {st['decode_steps']} steps "
            f"| other {st['other_s']:.2f} s | preprocessing {st['preprocess_cpu_s']:.2f} s of worker CPU (overlapped)")


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
    ref = TransformersReference(config.model, device, dtype, engine) if opts.reference else None
    report = {"device": str(device), "dtype": str(dtype).replace("torch.", ""), "model": config.model or "dummy",
              "max_prefill": bool(engine.max_prefill.value), "max_num_seqs": config.max_num_seqs,
              "max_num_batched_tokens": config.max_num_batched_tokens,
              "kv_blocks": engine.block_manager.num_blocks, "workloads": {},
              "reference_weights": (None if ref is None else "same as ours" if ref.same_weights else
                                    "transformers' own random init (dummy): speed compares, tokens do not")}
    # warm-up: one image of each shape the requested workloads use (other pixels than the timed
    # ones), so no workload's first request pays Triton compiles or allocator growth; the
    # reference likewise. Only those shapes: a 1080p page on the CPU takes minutes.
    warm = warmup_images(opts.workloads)
    log.info("bench generate: warm-up with %d image(s) (%s)", len(warm),
             ", ".join("line" if wl == "lines256" else "page" for wl in _warm_kinds(opts.workloads)))
    for imgs in warm:
        run_ours(engine, imgs, opts.prompt, 4)
    if ref:
        for imgs in warm:
            ref.generate(imgs, opts.prompt, 4)
    for wl in opts.workloads:
        if wl == "page1":
            pages = page_pngs(1, 5_000)
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
        else:
            imgs = page_pngs(opts.pages) if wl == "pages64" else line_pngs(opts.lines)
            tokens = opts.page_tokens if wl == "pages64" else opts.line_tokens
            ours = run_ours(engine, imgs, opts.prompt, tokens)
            ids = ours.pop("token_ids")
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


def _same(v) -> str:
    if v is None:
        return "n/a (other random weights)"
    return str(v) if isinstance(v, bool) else f"{v * 100:.0f}%"


def print_report(report: dict) -> None:
    print(f"bench generate: device {report['device']} dtype {report['dtype']} model {report['model']} "
          f"max_prefill={report['max_prefill']} kv_blocks={report['kv_blocks']}")
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
        else:
            line = (f"  {wl}: {o['requests']} req, {o['requests_per_s']:.2f} req/s, "
                    f"{o['output_tokens_per_s']:.0f} out tok/s, wall {o['wall_s']:.2f} s")
            if ref:
                line += (f" | transformers {ref['requests']} req at batch {ref['requests']}: "
                         f"{ref['requests_per_s']:.2f} req/s | x{r['speedup_per_request']:.2f} per request, "
                         f"same tokens: {_same(r['same_tokens_fraction'])}")
        print(line + f" | GPU busy {busy}, peak {mem}")
        if o.get("stages"):
            print(stages_line(o["stages"]))


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
