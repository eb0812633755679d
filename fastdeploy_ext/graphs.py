"""Encoder graphs over token budgets (captured and replayed through the runner's device API:
CUDA graphs on CUDA and MACA).

Each graph path (e.g. "blocks" for small layout crops, "pages" for whole pages) captures the
encoder + projector at token budgets doubling from its minimum to its maximum (plus the
maximum). By default a batch that fits one budget of one path is padded to the smallest such
budget and replayed, and any other batch runs as one eager packed pass (measured faster than
several padded replays: see route_batch). With ``encoder_split_oversize_batches`` a batch is
instead packed greedily, in order, into groups that fit a path, each padded and replayed, and
only images no path accepts run eager. All metadata (position embeddings, rotary tables, merge
permutation, the attention backend's state) is prepared outside the graph on the host path and
copied into the graph's static buffers with device-to-device copies: replay makes no host sync.

Padding needs an attention backend whose launch does not depend on the batch (``graph_safe``):
the backend object supplies the static state its captured launch reads (for the Triton varlen
kernel, a block table padded with no-op rows) and loads each batch's state into it.

Which paths are captured by default: DEFAULT_GRAPH_PATHS in plan.py (small batches only; a
whole page lost to eager when padded).
"""
from __future__ import annotations

import gc
import logging
import time
from dataclasses import dataclass, field
from functools import partial

import torch

from .plan import EncoderGraphPath
from .runner import GraphReport

log = logging.getLogger(__name__)


@dataclass
class GraphStats:
    hits: int = 0                 # groups replayed
    fallbacks: int = 0            # images run eager (no path fits them)
    padded_tokens: int = 0
    real_tokens: int = 0
    per_budget: dict = field(default_factory=dict)


def capture_graphs(api, make: dict) -> tuple[dict, float, int]:
    """Build and capture each graph of ``make`` (key -> a callable making an object with
    ``capture(api, pool, stream)``), in its order, on one shared pool and side stream. Returns
    the graphs by key, the seconds it took and the graph memory: what the private pool keeps
    reserved, measured with the caching allocator's free blocks released on both sides (warm-up
    buffers, other runners' frees)."""
    t0 = time.perf_counter()
    gc.collect()
    api.synchronize()
    api.empty_cache()
    before = api.reserved_bytes()
    pool, stream = api.graph_pool(), api.new_stream()
    graphs = {}
    for key, new in make.items():
        g = new()
        g.capture(api, pool, stream)
        graphs[key] = g
    api.synchronize()
    api.empty_cache()
    return graphs, time.perf_counter() - t0, api.reserved_bytes() - before


class _BudgetGraph:
    """One captured graph for a budget of `tokens` patches over the family's static buffers
    (what the budget holds and yields is the family's: ModelFamily.graph_buffers)."""

    def __init__(self, runner, tokens: int, max_segments: int):
        self.tokens = tokens
        # the attention state the captured launch reads; unused entries are no-ops (each still
        # costs a little: docs/PERFORMANCE.md, "one 8x40 block")
        state = runner.execution.attention.graph_state(tokens, max_segments, runner.device)
        self.buffers = runner.family.graph_buffers(runner.cfg, tokens, state, device=runner.device,
                                                   dtype=runner.dtype)
        self.model, self.execution = runner.model, runner.execution
        self.graph = None                                 # the device API's graph (replay())
        self.out: torch.Tensor | None = None

    def _forward(self):
        return self.model(self.buffers.pixels, self.buffers.meta, self.execution)

    def eager(self, n: int) -> torch.Tensor:
        """The captured forward run eagerly on the static buffers as the last replay left them
        (the same padded batch): the conformance suite's bitwise reference for the replay."""
        return self._forward()[:self.buffers.outputs(n)]

    def capture(self, api, pool, stream) -> None:
        # warmed up on the shared side stream first (Triton compiles its kernels for these shapes),
        # then captured on it
        self.graph, self.out = api.capture_graph(self._forward, pool, stream)

    def replay(self, pixels: torch.Tensor, meta) -> torch.Tensor:
        self.buffers.load(pixels, meta)
        self.graph.replay()
        return self.out[:self.buffers.outputs(meta.num_tokens)]


def pack_groups(grids: list[tuple[int, int, int]], paths: tuple[EncoderGraphPath, ...]
                ) -> list[tuple[EncoderGraphPath | None, list[int]]]:
    """Greedy in-order packing of a batch into replay groups.

    An image goes to the first path whose max_image_tokens holds one of its frames (None: no
    path, run eager). Consecutive images of the same path share a group while the group stays
    within the path's max_tokens and max_segments."""
    groups: list[tuple[EncoderGraphPath | None, list[int]]] = []
    sizes: list[tuple[int, int]] = []          # (tokens, segments) per group
    for i, (t, h, w) in enumerate(grids):
        n = t * h * w
        path = next((p for p in paths if h * w <= p.max_image_tokens and n <= p.max_tokens
                     and t <= p.max_segments), None)
        if groups and groups[-1][0] is path:
            tok, seg = sizes[-1]
            if path is None or (tok + n <= path.max_tokens and seg + t <= path.max_segments):
                groups[-1][1].append(i)
                sizes[-1] = (tok + n, seg + t)
                continue
        groups.append((path, [i]))
        sizes.append((n, t))
    return groups


def route_batch(grids: list[tuple[int, int, int]], paths: tuple[EncoderGraphPath, ...], split_oversize: bool
                ) -> list[tuple[EncoderGraphPath | None, list[int]]]:
    """Replay groups for a batch. A batch that fits one budget of one path is one replay. A
    batch that does not is, by default, one eager packed pass: on the H200 that beat splitting
    it into several padded replays (docs/PERFORMANCE.md: 16 blocks 25.3 vs 33.7 ms, 64 small
    blocks 35.3 vs 41.5 ms). ``split_oversize`` packs it greedily into replay groups instead."""
    groups = pack_groups(grids, paths)
    if split_oversize or (len(groups) == 1 and groups[0][0] is not None):
        return groups
    return [(None, list(range(len(grids))))]


class EncoderGraphs:
    def __init__(self, runner, paths: tuple[EncoderGraphPath, ...], split_oversize: bool = False):
        self.api = runner.device_api
        if not self.api.supports_graphs:
            raise RuntimeError(f"encoder graphs need a device with a graph API; the {self.api.name} device API "
                               f"of {runner.device} has none")
        if not runner.execution.attention.graph_safe:
            raise RuntimeError(f"encoder graphs need a graph-safe attention backend, plan has "
                               f"{runner.execution.attention.name}")
        self.runner, self.paths, self.split_oversize = runner, paths, split_oversize
        self.graphs: dict[tuple[str, int], _BudgetGraph] = {}
        self.stats = GraphStats()

    def capture(self) -> GraphReport:
        with torch.inference_mode():
            # largest first, so smaller graphs reuse the shared pool's blocks
            todo = {(path.name, b): partial(_BudgetGraph, self.runner, b, path.max_segments)
                    for path in self.paths for b in sorted(path.budgets, reverse=True)}
            self.graphs, dt, mem = capture_graphs(self.api, todo)
        report = GraphReport(captured=len(self.graphs), paths={p.name: list(p.budgets) for p in self.paths},
                             capture_seconds=dt, graph_memory_bytes=mem)
        log.info("encoder graphs: %d captured in %.1fs, %.1f MiB (%s)", report.captured, dt, mem / 2**20, report.paths)
        return report

    def run(self, pixels: torch.Tensor, grids: list[tuple[int, int, int]]) -> torch.Tensor:
        """Encoder + projector for the batch through graphs where possible; same output layout
        as the eager forward (projector tokens of all images, concatenated)."""
        offsets = [0]
        for t, h, w in grids:
            offsets.append(offsets[-1] + t * h * w)
        outs = []
        for path, idx in route_batch(grids, self.paths, self.split_oversize):
            sub_grids = [grids[j] for j in idx]
            sub_pixels = pixels[offsets[idx[0]]:offsets[idx[-1] + 1]]
            meta = self.runner.meta_builder.build_host(sub_grids)
            if path is None:
                self.stats.fallbacks += len(idx)
                outs.append(self.runner.model(sub_pixels, meta, self.runner.execution))
                continue
            budget = next(b for b in path.budgets if b >= meta.num_tokens)
            self.stats.hits += 1
            self.stats.real_tokens += meta.num_tokens
            self.stats.padded_tokens += budget - meta.num_tokens
            key = (path.name, budget)
            self.stats.per_budget[key] = self.stats.per_budget.get(key, 0) + 1
            # the replayed output lives in the graph's static buffer: copy it out before the
            # next group can replay the same graph
            outs.append(self.graphs[key].replay(sub_pixels, meta).clone())
        return outs[0] if len(outs) == 1 else torch.cat(outs)
