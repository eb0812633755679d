"""What capturing a set of graphs costs: the wall time and the device memory their private pool
keeps reserved. Shared by every graph owner (encoder paths, detector buckets, ...)."""
from __future__ import annotations

import gc
import time
from dataclasses import dataclass
from typing import Callable


@dataclass(frozen=True)
class CaptureCost:
    seconds: float
    memory_bytes: int


def measured_capture(api, capture: Callable[[object, object], None]) -> CaptureCost:
    """Runs ``capture(pool, stream)`` (one shared graph pool and side stream for all its graphs)
    between two settled reads of the device's reserved memory. The caching allocator's free
    blocks are released on both sides (warm-up buffers, other runners' frees), so the difference
    is what the graphs' pool keeps."""
    t0 = time.perf_counter()
    gc.collect()
    api.synchronize()
    api.empty_cache()
    before = api.reserved_bytes()
    capture(api.graph_pool(), api.new_stream())
    api.synchronize()
    api.empty_cache()
    return CaptureCost(time.perf_counter() - t0, api.reserved_bytes() - before)
