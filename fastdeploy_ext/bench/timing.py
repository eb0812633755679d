"""Timing shared by the benchmarks: per-call times in ms, from CUDA events on a GPU (what the
stream spent between the two events) and from perf_counter elsewhere. Nothing here asserts a time."""
from __future__ import annotations

import statistics
import time

import torch


def call_times_ms(fn, warmup: int, iters: int, device_type: str = "cuda") -> list[float]:
    """fn run `warmup` times untimed, then `iters` times, each timed on its own."""
    cuda = device_type == "cuda"
    for _ in range(warmup):
        fn()
    if cuda:
        torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1000)
    return times


def median_ms(fn, warmup: int, iters: int, device_type: str = "cuda") -> float:
    return statistics.median(call_times_ms(fn, warmup, iters, device_type))
