"""Timing shared by the benchmarks: per-call times in ms from the device API's timer (CUDA
events on a GPU: what the stream spent between the two events; perf_counter on the host).
Nothing here asserts a time."""
from __future__ import annotations

import statistics

import torch
import torch.nn.functional as F

from ..device_api import DeviceAPI, device_api_for


def call_times_ms(fn, warmup: int, iters: int, api: DeviceAPI | None = None) -> list[float]:
    """fn run `warmup` times untimed, then `iters` times, each timed on its own by ``api``
    (None: the host's)."""
    api = api or device_api_for("cpu")
    for _ in range(warmup):
        fn()
    api.synchronize()
    return [api.time_ms(fn) for _ in range(iters)]


def median_ms(fn, warmup: int, iters: int, api: DeviceAPI | None = None) -> float:
    return statistics.median(call_times_ms(fn, warmup, iters, api))


class Timer:
    """Median time of fn by the device API's timer (CUDA events on a GPU, perf_counter on the host)."""

    def __init__(self, api: DeviceAPI, warmup: int, iters: int):
        self.api, self.warmup, self.iters = api, warmup, iters

    def __call__(self, fn) -> float:
        return median_ms(fn, self.warmup, self.iters, self.api)


def reset_peak(api: DeviceAPI) -> None:
    """Start a peak-memory window: queued work finished and cached blocks returned first, so
    the next peak is the measured call's own."""
    if api.allocator_stats:
        api.synchronize()
        api.empty_cache()
        api.reset_peak_allocated()


def peak_gib(api: DeviceAPI) -> float | None:
    """Peak allocated GiB since reset_peak, where the allocator reports it."""
    return api.peak_allocated_bytes() / 2**30 if api.allocator_stats else None


def cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(F.cosine_similarity(a.float().flatten(), b.float().flatten(), dim=0))
