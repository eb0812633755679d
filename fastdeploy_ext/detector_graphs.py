"""A layout detector's forward captured per batch-size bucket (CUDA graphs through the runner's
device API, as graphs.py does for the vision encoder).

The detector's input is fixed (every page resized to the processor's size, 800x800), so the only
shape that varies is the batch: one graph per bucket (e.g. 1, 2, 4, 8, 16, 32) replays the whole
forward — backbone, encoder, top-k query selection, decoder, heads — over a static pixel buffer.
A batch is padded with zero pages to the smallest bucket that holds it; a batch larger than the
largest bucket runs as chunks of the largest, the remainder padded to its own bucket. Pages are
independent through the forward (inference batch norm, attention within a page, a per-page
top-k), so the padding never changes a real page's outputs; the conformance suite checks a
replay against the eager forward on the same padded buffer bitwise.
"""
from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass, field
from functools import partial
from typing import Sequence

import torch

from .runner import GraphReport

log = logging.getLogger(__name__)


def bucket_for(n: int, buckets: Sequence[int]) -> int | None:
    """The smallest bucket holding ``n`` pages (None: larger than every bucket)."""
    return next((b for b in sorted(buckets) if b >= n), None)


def plan_chunks(n: int, buckets: Sequence[int]) -> list[tuple[int, int, int]]:
    """(start, pages, bucket) per replay for a batch of ``n`` pages: chunks of the largest
    bucket, then the remainder padded to the smallest bucket that holds it."""
    if n < 1:
        raise ValueError(f"a batch needs at least one page, got {n}")
    if not buckets or min(buckets) < 1:
        raise ValueError(f"detector graph buckets must be positive batch sizes, got {list(buckets)}")
    top = max(buckets)
    out, start = [], 0
    while n - start > top:
        out.append((start, top, top))
        start += top
    out.append((start, n - start, bucket_for(n - start, buckets)))
    return out


def slice_outputs(out, n: int):
    """The first ``n`` pages of a DetectorOutputs-like dataclass of [B, ...] tensors (None kept)."""
    return dataclasses.replace(out, **{f.name: (None if getattr(out, f.name) is None else getattr(out, f.name)[:n])
                                        for f in dataclasses.fields(out)})


def concat_outputs(parts: list):
    if len(parts) == 1:
        return parts[0]
    first = parts[0]
    return dataclasses.replace(first, **{f.name: (None if getattr(first, f.name) is None else
                                                  torch.cat([getattr(p, f.name) for p in parts]))
                                          for f in dataclasses.fields(first)})


def clone_outputs(out):
    """The replayed outputs live in the graph's static buffers: copied out before the next
    replay of the same graph overwrites them."""
    return dataclasses.replace(out, **{f.name: (None if getattr(out, f.name) is None else getattr(out, f.name).clone())
                                        for f in dataclasses.fields(out)})


@dataclass
class DetectorGraphStats:
    replays: int = 0
    real_pages: int = 0
    padded_pages: int = 0
    per_bucket: dict = field(default_factory=dict)


class _BucketGraph:
    """One captured forward over a static [bucket, 3, H, W] pixel buffer."""

    def __init__(self, model, bucket: int, image_size: tuple[int, int], *, device, dtype):
        self.model, self.bucket = model, bucket
        self.pixels = torch.zeros(bucket, 3, *image_size, device=device, dtype=dtype)
        self.graph = None
        self.out = None

    def _forward(self):
        return self.model(self.pixels)

    def capture(self, api, pool, stream) -> None:
        self.graph, self.out = api.capture_graph(self._forward, pool, stream)

    def load(self, pixels: torch.Tensor) -> None:
        n = pixels.shape[0]
        self.pixels[:n].copy_(pixels)
        if n < self.bucket:
            self.pixels[n:].zero_()          # padding pages: zeros, whatever the last replay left

    def replay(self, pixels: torch.Tensor):
        self.load(pixels)
        self.graph.replay()
        return slice_outputs(self.out, pixels.shape[0])

    def eager(self):
        """The captured forward run eagerly on the static buffer as the last replay left it (the
        same padded batch): the reference a replay must equal bitwise."""
        from .ops.precision import fp32_convolutions
        with fp32_convolutions(self.pixels.device, self.pixels.dtype):
            return self.model(self.pixels)


class DetectorGraphs:
    def __init__(self, runner, buckets: Sequence[int], image_size: tuple[int, int]):
        self.api = runner.device_api
        if not self.api.supports_graphs:
            raise RuntimeError(f"detector graphs need a device with a graph API; the {self.api.name} device API "
                               f"of {runner.device} has none")
        self.model, self.device, self.dtype = runner.detector, runner.device, runner.dtype
        self.buckets = tuple(sorted(set(buckets)))
        self.image_size = tuple(image_size)
        self.graphs: dict[int, _BucketGraph] = {}
        self.stats = DetectorGraphStats()

    def capture(self) -> GraphReport:
        from .graphs import capture_graphs
        from .ops.precision import fp32_convolutions
        # captured under the eager path's precision (an fp32 plan: no TF32 convolutions)
        with torch.inference_mode(), fp32_convolutions(self.device, self.dtype):
            # largest first: smaller ones reuse its pool blocks
            self.graphs, dt, mem = capture_graphs(self.api, {
                b: partial(_BucketGraph, self.model, b, self.image_size, device=self.device, dtype=self.dtype)
                for b in sorted(self.buckets, reverse=True)})
        report = GraphReport(captured=len(self.graphs), paths={"detector": list(self.buckets)}, capture_seconds=dt,
                             graph_memory_bytes=mem)
        log.info("detector graphs: %d batch-size buckets %s at %dx%d captured in %.1fs, %.1f MiB", report.captured,
                 list(self.buckets), *self.image_size, dt, mem / 2 ** 20)
        return report

    def check_pixels(self, pixels: torch.Tensor) -> None:
        if tuple(pixels.shape[1:]) != (3, *self.image_size):
            raise ValueError(f"detector graphs were captured for [B, 3, {self.image_size[0]}, {self.image_size[1]}] "
                             f"pixels, got {list(pixels.shape)}")

    def run(self, pixels: torch.Tensor):
        """The detector's outputs for ``pixels`` [B, 3, H, W] (on the device, compute dtype)
        through the bucket graphs: same outputs as the eager forward, per page."""
        self.check_pixels(pixels)
        parts = []
        for start, n, bucket in plan_chunks(pixels.shape[0], self.buckets):
            out = self.graphs[bucket].replay(pixels[start:start + n])
            parts.append(clone_outputs(out))
            self.stats.replays += 1
            self.stats.real_pages += n
            self.stats.padded_pages += bucket - n
            self.stats.per_bucket[bucket] = self.stats.per_bucket.get(bucket, 0) + 1
        return concat_outputs(parts)
