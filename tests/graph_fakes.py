"""A graph API on the host for the graph owners' CPU tests (detector buckets, encoder paths): a
"replay" re-runs the captured call and writes into the captured output, as a CUDA graph replay
writes its static outputs, so padding, bucketing and reading-before-the-next-replay are tested
without a GPU."""
from __future__ import annotations

import dataclasses

import torch

from fastdeploy_ext.device_api import DeviceAPI


class ReplayGraph:
    """``out``: a tensor or a dataclass of tensors (None fields stay None)."""

    def __init__(self, forward, out):
        self.forward, self.out, self.replays = forward, out, 0

    def replay(self):
        new = self.forward()
        if isinstance(self.out, torch.Tensor):
            self.out.copy_(new)
        else:
            for f in dataclasses.fields(self.out):
                t = getattr(self.out, f.name)
                if t is not None:
                    t.copy_(getattr(new, f.name))
        self.replays += 1


class HostGraphAPI(DeviceAPI):
    supports_graphs = True
    name = "host-graphs"

    def graph_pool(self):
        return None

    def reserved_bytes(self) -> int:
        return 0

    def new_stream(self):
        return None

    def capture_graph(self, forward, pool, stream=None, warmup: int = 2):
        out = forward()
        return ReplayGraph(forward, out), out
