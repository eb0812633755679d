"""Where a decode step's time goes: per-step wall time of LLMEngine.step() at a few batch sizes
(text-only prompts, greedy, no detokenization), then a torch.profiler table of the decode steps
at batch 1 (CPU ops and device kernels, counted per step). Runs against whichever
fastdeploy_ext is on the path, so two commits (a wheel each) compare in one GPU call:

    PYTHONPATH=/tmp/old python3 ci/step_profile.py --device cuda --label old
    PYTHONPATH=/tmp/new python3 ci/step_profile.py --device cuda --label new
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from fastdeploy_ext.engine.config import EngineConfig
from fastdeploy_ext.engine.llm_engine import LLMEngine
from fastdeploy_ext.engine.sampling_params import RepetitionGuard, SamplingParams
from fastdeploy_ext.plan import PlanRequest


def params(tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True, detokenize=False,
                          repetition_guard=RepetitionGuard(enabled=False))


def decode_step_times(engine: LLMEngine, batch: int, tokens: int, tag: str) -> list[float]:
    for i in range(batch):
        engine.add_request(f"{tag}-{i}", {"prompt": f"OCR: line {i} of the page"}, params(tokens))
    times = []
    while engine.has_unfinished():
        t0 = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t0)
    return times[2:-2]          # the prefill step(s) and the last (finishing) steps out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--label", default="")
    ap.add_argument("--batches", default="1,8,64")
    ap.add_argument("--tokens", type=int, default=200)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--profile-steps", type=int, default=40)
    ap.add_argument("--cprofile", action="store_true", help="also the Python functions' own time over 200 "
                    "decode steps at batch 1 (cProfile: slows every call alike, compare commits by it)")
    args = ap.parse_args()
    cfg = EngineConfig(load_format="dummy", plan=PlanRequest(device=args.device, dtype="bfloat16"),
                       max_num_seqs=64, max_model_len=2048, gpu_memory_utilization=0.5)
    engine = LLMEngine(cfg)
    decode_step_times(engine, 1, 32, "warm")
    for r in range(args.rounds):
        for b in (int(x) for x in args.batches.split(",")):
            t = decode_step_times(engine, b, args.tokens, f"r{r}b{b}")
            print(f"[{args.label}] round {r} batch {b}: decode step median {statistics.median(t) * 1e3:.3f} ms, "
                  f"p10 {sorted(t)[len(t) // 10] * 1e3:.3f} ms over {len(t)} steps", flush=True)
    # profile decode steps at batch 1
    engine.add_request("prof", {"prompt": "OCR: profile"}, params(args.profile_steps + 8))
    for _ in range(4):
        engine.step()
    acts = [torch.profiler.ProfilerActivity.CPU]
    if args.device == "cuda":
        acts.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=acts) as prof:
        for _ in range(args.profile_steps):
            engine.step()
    while engine.has_unfinished():
        engine.step()
    n = args.profile_steps
    rows = []
    for e in prof.key_averages():
        dev = getattr(e, "device_time_total", getattr(e, "cuda_time_total", 0))
        rows.append((e.key, e.count / n, e.self_cpu_time_total / n, dev / n))
    print(f"[{args.label}] per decode step at batch 1 (mean over {n} steps): op, calls, self CPU us, device us")
    for key, calls, cpu, dev in sorted(rows, key=lambda r: -r[2])[:40]:
        print(f"[{args.label}]   {key[:70]:70s} {calls:6.1f} {cpu:9.1f} {dev:9.1f}")
    print(f"[{args.label}] device kernels per step, by device time:")
    for key, calls, cpu, dev in sorted(rows, key=lambda r: -r[3])[:25]:
        if dev > 0:
            print(f"[{args.label}]   {key[:70]:70s} {calls:6.1f} {dev:9.1f}")
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
