"""The device API of torch's ``cuda`` devices: NVIDIA's, and MetaX MACA's torch builds, which
expose their card as ``cuda`` (so the MetaX runner on a real card gets this one through the
same registration; under emulation on the host it gets the host's).

Everything here is torch's CUDA runtime API: the caching allocator's statistics, page-locked
host memory, CUDA graphs with a shared pool, CUDA events as the benchmarks' timer, and
``torch.cuda.set_sync_debug_mode`` on top of the op-level guard."""
from __future__ import annotations

import torch

from fastdeploy_ext.device_api import DeviceAPI, HostRead, register_device_api
from fastdeploy_ext.fallbacks import GELU_UNFUSED_NOTE, addmm_activation_available
from fastdeploy_ext.plan import Decision


class CudaDeviceAPI(DeviceAPI):
    name = "cuda"
    allocator_stats = True
    supports_graphs = True

    def __init__(self, device):
        super().__init__(device)
        self._side = None        # side_by_side's stream, made on first use

    # ProfilerActivity is looked up once here rather than imported at module level: torch.profiler
    # is a heavy import the runner never needs
    @property
    def profiler_activity(self):
        from torch.profiler import ProfilerActivity
        return ProfilerActivity.CUDA

    # ------------------------------------------------------------ memory
    def memory(self):
        return torch.cuda.mem_get_info(self.device)

    def memory_query(self) -> Decision:
        return Decision(True, "torch.cuda.mem_get_info (the driver's free/total of the card)")

    def memory_stats(self) -> dict:
        free, total = torch.cuda.mem_get_info(self.device)
        return {"device": str(self.device), "allocated_bytes": torch.cuda.memory_allocated(self.device),
                "peak_bytes": torch.cuda.max_memory_allocated(self.device),
                "reserved_bytes": torch.cuda.memory_reserved(self.device), "free_bytes": free,
                "total_bytes": total, "kind": "torch caching allocator"}

    def allocated_bytes(self) -> int:
        return torch.cuda.memory_allocated(self.device)

    def reserved_bytes(self) -> int:
        return torch.cuda.memory_reserved(self.device)

    def peak_allocated_bytes(self) -> int:
        return torch.cuda.max_memory_allocated(self.device)

    def reset_peak_allocated(self) -> None:
        torch.cuda.reset_peak_memory_stats(self.device)

    def empty_cache(self) -> None:
        torch.cuda.empty_cache()

    def synchronize(self) -> None:
        torch.cuda.synchronize(self.device)

    # ------------------------------------------------------------ host staging and upload
    def pin(self, t: torch.Tensor) -> torch.Tensor:
        return t.pin_memory()

    def stage_and_upload(self, t: torch.Tensor) -> torch.Tensor:
        # a copy from pageable memory blocks the host until staged; from pinned memory it is
        # queued on the stream and the host goes on
        return t.pin_memory().to(self.device, non_blocking=True)

    def transfer_event(self):
        return torch.cuda.Event()

    def start_host_read(self, tensors):
        # page-locked targets so the copies queue on the stream behind the work that produces
        # the tensors; the event says when they have landed (the host goes on meanwhile)
        host = tuple(torch.empty(t.shape, dtype=t.dtype, pin_memory=True).copy_(t, non_blocking=True)
                     for t in tensors)
        event = torch.cuda.Event()
        event.record()
        return HostRead(host, event)

    # ------------------------------------------------------------ graphs
    def graph_pool(self):
        return torch.cuda.graph_pool_handle()

    def new_stream(self):
        return torch.cuda.Stream(self.device)

    def is_capturing(self) -> bool:
        return torch.cuda.is_current_stream_capturing()

    def side_by_side(self, first, second):
        # Tensors ``first`` allocates come from the side stream's blocks of the caching allocator;
        # the current stream reads them only after its wait below, and the side stream is used
        # again only after its own wait on the current stream: no block is reused while read.
        current = torch.cuda.current_stream(self.device)
        if self._side is None:
            self._side = torch.cuda.Stream(self.device)
        self._side.wait_stream(current)
        with torch.cuda.stream(self._side):
            a = first()
        b = second()
        current.wait_stream(self._side)
        return a, b

    def capture_graph(self, forward, pool, stream=None, warmup: int = 2):
        side = stream if stream is not None else torch.cuda.Stream(self.device)
        current = torch.cuda.current_stream(self.device)
        side.wait_stream(current)
        with torch.cuda.stream(side):        # warm up off the capture (Triton compiles, allocator grows)
            for _ in range(warmup):
                forward()
        current.wait_stream(side)
        torch.cuda.synchronize(self.device)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool, stream=stream):
            out = forward()
        return graph, out

    # ------------------------------------------------------------ benchmarks
    def time_ms(self, fn) -> float:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end)

    # ------------------------------------------------------------ guards and fallbacks
    def sync_guard(self):
        from fastdeploy_ext.sync_guard import cuda_host_sync_guard
        return cuda_host_sync_guard()

    def fallback_notes(self, fused_layers: bool) -> tuple[str, ...]:
        return (GELU_UNFUSED_NOTE,) if fused_layers and not addmm_activation_available() else ()


register_device_api("cuda", CudaDeviceAPI)
