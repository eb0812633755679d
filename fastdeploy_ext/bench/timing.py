"""Timing shared by the benchmarks: per-call times in ms from the device API's timer (CUDA
events on a GPU: what the stream spent between the two events; perf_counter on the host).
Nothing here asserts a time."""
from __future__ import annotations

import statistics

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
