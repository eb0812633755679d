"""What the framework asks of a device beyond torch's tensor ops, as one narrow object a backend
supplies: memory queries, pinned host staging and the upload, the graph API (capture, replay,
pools, the capture stream), peak-memory profiling, synchronize and a timer for the benchmarks,
the host-sync guard, the fallbacks its libraries take, and host reads that complete later (the
engine's overlapped step loop reads a step's sampled ids one step late).

``DeviceAPI`` itself is the host's: no pinned memory, no graphs, no allocator statistics (the
CPU's are not worth trusting), perf_counter timing. A backend whose torch device type needs more
registers a subclass for that type (``register_device_api``; the CUDA one lives in
backends/cuda/ and also serves MACA's torch, which exposes its card as ``cuda``). Nothing outside
backends/ tests a device type for these: it asks ``device_api_for(device)``.

The registry is filled when a backend's module is imported (the runner registry's entry points
do that); a device type nobody registered runs with the host API, and that is logged once with
the reason, never taken silently.
"""
from __future__ import annotations

import contextlib
import logging
import resource
import time
from typing import Callable, ClassVar, TypeVar

import torch

from .plan import Decision

log = logging.getLogger(__name__)

T = TypeVar("T")
U = TypeVar("U")

#: device types that are the host: the host API is theirs by right, not a fallback
HOST_DEVICE_TYPES = ("cpu", "meta")


class DeviceAPI:
    """The host's answers (also every method's contract for a backend's subclass)."""

    name: ClassVar[str] = "host"
    #: the allocator reports allocated / reserved / peak bytes (memory_profile measures, else estimates)
    allocator_stats: ClassVar[bool] = False
    #: capture_graph / graph_pool / new_stream work (encoder and decode graphs need them)
    supports_graphs: ClassVar[bool] = False
    #: the torch.profiler activity of this device's kernels, or None (host: CPU time only)
    profiler_activity: ClassVar[object | None] = None

    def __init__(self, device: torch.device):
        self.device = torch.device(device)

    # ------------------------------------------------------------ memory
    def memory(self) -> tuple[int, int] | None:
        """(free, total) bytes of the device now, or None: this device cannot tell."""
        return None

    def memory_query(self) -> Decision:
        """Whether memory() answers, with the reason (logged by the runner at creation)."""
        return Decision(False, f"{self.name} device API ({self.device.type}): no free/total memory query; "
                               "the KV pool is sized from --kv-cache-memory")

    def memory_stats(self) -> dict:
        """Current and peak memory in bytes, and what measured them."""
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        return {"device": str(self.device), "peak_bytes": peak, "kind": "host RSS (peak)"}

    # ------------------------------------------------------------ peak-memory profiling
    def allocated_bytes(self) -> int:
        raise self._no("allocator statistics")

    def reserved_bytes(self) -> int:
        raise self._no("allocator statistics")

    def peak_allocated_bytes(self) -> int:
        raise self._no("allocator statistics")

    def reset_peak_allocated(self) -> None:
        raise self._no("allocator statistics")

    def empty_cache(self) -> None:
        """Return the allocator's free blocks to the device (nothing to do on the host)."""

    def synchronize(self) -> None:
        """Wait for all queued device work (host work is never queued)."""

    # ------------------------------------------------------------ host staging and upload
    def pin(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` (host) in memory the device copies from without blocking the host, or ``t``."""
        return t

    def upload(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` (host, ideally from pin) on the device, queued without blocking where possible."""
        return t.to(self.device, non_blocking=True)

    def stage_and_upload(self, t: torch.Tensor) -> torch.Tensor:
        """A pageable host tensor on the device without a host sync (pinned first where the
        device needs it): the step paths' metadata uploads. Non-blocking: a blocking upload
        waits for the device's queued work (torch synchronizes the stream after it); a pageable
        source is staged before the call returns, so the caller may reuse it."""
        return t.to(self.device, non_blocking=True)

    def transfer_event(self):
        """An event (record() / synchronize()) that says when queued uploads left their host
        buffers, or None where uploads are done when they return."""
        return None

    def start_host_read(self, tensors: tuple[torch.Tensor, ...]) -> "HostRead":
        """Queue copies of ``tensors`` (device) to the host without waiting for them; the
        returned read's get() waits and gives the host tensors. The host's: nothing is queued,
        get() reads them then (a blocking copy only for a device type nobody registered)."""
        return HostRead(tensors)

    # ------------------------------------------------------------ graphs
    def graph_pool(self):
        """A memory pool handle graphs captured together share."""
        raise self._no("graphs")

    def new_stream(self):
        """A side stream to warm up and capture on."""
        raise self._no("graphs")

    def is_capturing(self) -> bool:
        """Whether the current stream is capturing a graph (its kernels then run only at replay:
        nothing made now may be cached as if it were computed). No graphs here: never."""
        return False

    def side_by_side(self, first: Callable[[], T], second: Callable[[], U]) -> tuple[T, U]:
        """(first(), second()) with their device work free to overlap: ``first`` queued on a
        side stream that waits for the work queued so far, ``second`` on the current stream,
        which then waits for the side stream's, so the results are ready to use on the current
        stream. No host sync. The host's: one after the other."""
        return first(), second()

    def capture_graph(self, forward: Callable[[], T], pool, stream=None, warmup: int = 2) -> tuple[object, T]:
        """Warm ``forward`` up ``warmup`` times on a side stream (``stream``, or a fresh one),
        then capture one call into a graph allocating from ``pool`` (captured on ``stream``, or
        the graph's default capture stream). Returns the graph (``.replay()``) and the captured
        call's output, the static tensor replays overwrite."""
        raise self._no("graphs")

    # ------------------------------------------------------------ benchmarks
    def time_ms(self, fn: Callable[[], object]) -> float:
        """Milliseconds of one call of fn: what the device spent on it where it queues work."""
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1000

    # ------------------------------------------------------------ guards and fallbacks
    def sync_guard(self) -> contextlib.AbstractContextManager:
        """Context failing on any device->host sync of this device (sync_guard.py)."""
        from .sync_guard import HostSyncGuard
        return HostSyncGuard(watch={self.device.type})

    def fallback_notes(self, fused_layers: bool) -> tuple[str, ...]:
        """Where this device's libraries will take another path than the plan promises."""
        return ()

    def _no(self, what: str) -> RuntimeError:
        return RuntimeError(f"{self.device}: the {self.name} device API has no {what} (a backend supplies them "
                            "by registering a DeviceAPI for its torch device type: fastdeploy_ext/device_api.py)")


class HostRead:
    """Host copies of device tensors, queued by ``start_host_read``: ``get()`` waits for the copies
    (``event.synchronize()``; no event: the tensors are read then) and returns host tensors."""

    def __init__(self, tensors: tuple[torch.Tensor, ...], event=None):
        self.tensors, self.event = tuple(tensors), event

    def get(self) -> tuple[torch.Tensor, ...]:
        if self.event is not None:
            self.event.synchronize()
            self.event = None
        return tuple(t.cpu() for t in self.tensors)


# ---------------------------------------------------------------------- registry
_BY_TYPE: dict[str, type[DeviceAPI]] = {}
_INSTANCES: dict[torch.device | str, DeviceAPI] = {}     # keyed by what callers pass (a device or its name)


def register_device_api(device_type: str, cls: type[DeviceAPI]) -> None:
    """``cls`` serves every torch device of ``device_type`` (called by a backend at import)."""
    _BY_TYPE[device_type] = cls
    for key in [k for k, api in _INSTANCES.items() if api.device.type == device_type]:
        del _INSTANCES[key]


def device_api_for(device: torch.device | str) -> DeviceAPI:
    """The device API of ``device`` (one instance per device). The metadata uploads of every
    vision pass come through here: a hit is one dict lookup."""
    api = _INSTANCES.get(device)
    if api is None:
        dev = torch.device(device)
        api = next((a for a in _INSTANCES.values() if a.device == dev), None) or _device_api_class(dev.type)(dev)
        _INSTANCES[device] = _INSTANCES[dev] = api
    return api


def _device_api_class(device_type: str) -> type[DeviceAPI]:
    cls = _BY_TYPE.get(device_type)
    if cls is not None or device_type in HOST_DEVICE_TYPES:
        return cls or DeviceAPI
    from .runner import available_backends
    available_backends()                    # importing the installed backends registers their APIs
    cls = _BY_TYPE.get(device_type)
    if cls is None:
        log.warning("device type %s: no backend registered a device API for it; running with the host's "
                    "(no pinned staging, no graphs, no memory query)", device_type)
        cls = DeviceAPI
    return cls
