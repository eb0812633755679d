"""DeepSeek-OCR-2's dual-path encoder graphs (captured and replayed through the runner's device
API: CUDA graphs on CUDA and MACA).

The tower runs a batch as two passes of same-size views (vision.py): its 1024 global views (one
per image) and its 768 crops (0-6 per image). Each pass is one path with its own budgets over
the number of views: ``global`` (e.g. 1, 2, 4, 8, 16) and ``local`` (e.g. 2, 4, ..., 96). Per
batch, each path independently pads its views to the smallest budget that holds them and replays
that graph, or runs eager above its largest (a batch without crops has no local pass at all).
Views are independent through SAM, the query encoder and the projector (attention within a view,
per-view convolutions), so a padding view never changes a real one's rows; replay equals the
eager forward on the same padded buffer bit for bit, and the unpadded eager pass within GEMM
rounding.

Replay makes no host sync: the views are split by path from host ints (the metadata builder's),
gathered into the path's static buffer with one device copy (``torch.cat(..., out=)``), and the
rows are reassembled per image from the static outputs by the eager forward's own code
(DeepseekOCR2Vision.split_views / assemble).

Where the plan overlaps the paths (``graph_overlap``, off unless ``encoder_overlap_paths``), a
batch with crops replays its global path on a side stream beside its local path
(DeviceAPI.side_by_side), for the small kernels and tails of one path to fill what the other
leaves idle; on an H200 that measured no faster (each path fills the GPU alone). Two replays at
once must not share intermediates, so then each path captures into a graph pool of its own
(checked after capture); otherwise all graphs share one pool, largest first.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from functools import partial
from typing import Sequence

import torch

from ...detector_graphs import bucket_for
from ...graphs import capture_graphs
from ...plan import ViewGraphPath
from ...runner import GraphReport

log = logging.getLogger(__name__)

#: path name -> whether its views are the global ones (else the crops)
PATH_IS_GLOBAL = {"global": True, "local": False}


@dataclass
class PathStats:
    replays: int = 0
    real_views: int = 0
    padded_views: int = 0
    eager_views: int = 0          # views run eager (above the path's largest budget, or no such path)
    per_budget: dict = field(default_factory=dict)


class _ViewBudgetGraph:
    """One captured pass of a path over a static buffer of ``views`` views' patches."""

    def __init__(self, model, is_global: bool, views: int, view_patches: int, ex, *, device, dtype):
        self.model, self.is_global, self.views, self.ex = model, is_global, views, ex
        self.view_patches = view_patches
        self.pixels = torch.zeros(views * view_patches, model.cfg.patch_dim, device=device, dtype=dtype)
        self.graph = self.pool = None
        self.out: torch.Tensor | None = None

    def _forward(self) -> torch.Tensor:
        return self.model.encode_views(self.pixels, self.views, self.is_global, self.ex)

    def capture(self, api, pool, stream) -> None:
        self.pool = pool
        self.graph, self.out = api.capture_graph(self._forward, pool, stream)

    def load(self, parts: Sequence[torch.Tensor]) -> None:
        n = len(parts) * self.view_patches
        torch.cat(list(parts), out=self.pixels[:n])
        if n < self.pixels.shape[0]:
            self.pixels[n:].zero_()           # padding views: zeros, whatever the last replay left

    def replay(self, parts: Sequence[torch.Tensor]) -> torch.Tensor:
        """[len(parts), queries, text width]: a view of the static output (valid until this
        graph replays again)."""
        self.load(parts)
        self.graph.replay()
        return self.out[:len(parts)]

    def eager(self, n: int) -> torch.Tensor:
        """The captured pass run eagerly on the static buffer as the last replay left it (the same
        padded batch): the reference a replay must equal bitwise."""
        from ...ops.precision import fp32_convolutions
        with torch.inference_mode(), fp32_convolutions(self.pixels.device, self.pixels.dtype):
            return self._forward()[:n]


class DeepseekEncoderGraphs:
    """The runner's encoder graphs for a DeepSeek-OCR-2 model: ``paths`` (ViewGraphPath, names
    in PATH_IS_GLOBAL) captured by capture(), batches encoded by run()."""

    def __init__(self, runner, paths: Sequence[ViewGraphPath]):
        self.api = runner.device_api
        if not self.api.supports_graphs:
            raise RuntimeError(f"encoder graphs need a device with a graph API; the {self.api.name} device API "
                               f"of {runner.device} has none")
        unknown = [p.name for p in paths if p.name not in PATH_IS_GLOBAL]
        if unknown:
            raise ValueError(f"deepseek_ocr2 encoder graph paths are {list(PATH_IS_GLOBAL)}; got {unknown}")
        self.runner, self.model, self.cfg = runner, runner.model, runner.cfg
        self.device, self.dtype = runner.device, runner.dtype
        self.ex = runner.execution          # the plan's qkv layout and attention backends
        self.paths = {p.name: p for p in paths}
        self.overlap = bool(runner.plan.graph_overlap.value)
        self.graphs: dict[tuple[str, int], _ViewBudgetGraph] = {}
        self.stats = {name: PathStats() for name in PATH_IS_GLOBAL}

    def view_patches(self, name: str) -> int:
        c = self.cfg
        return c.patches(c.base_size if PATH_IS_GLOBAL[name] else c.tile_size)

    def capture(self) -> GraphReport:
        from ...ops.precision import fp32_convolutions
        make = {(p.name, b): partial(_ViewBudgetGraph, self.model, PATH_IS_GLOBAL[p.name], b, self.view_patches(p.name),
                                     self.ex, device=self.device, dtype=self.dtype)
                for p in self.paths.values() for b in sorted(p.budgets, reverse=True)}  # largest first: pool reuse
        # one pool for all, or (overlapping paths) one per path
        groups = ([{k: v for k, v in make.items() if k[0] == name} for name in self.paths] if self.overlap
                  else [make])
        dt = mem = 0
        # captured under the eager path's precision (an fp32 plan: no TF32 convolutions)
        with torch.inference_mode(), fp32_convolutions(self.device, self.dtype):
            for group in groups:
                graphs, t, m = capture_graphs(self.api, group)
                self.graphs.update(graphs)
                dt, mem = dt + t, mem + m
        self.check_pools()
        report = GraphReport(captured=len(self.graphs), paths={p.name: list(p.budgets) for p in self.paths.values()},
                             capture_seconds=dt, graph_memory_bytes=mem)
        log.info("deepseek_ocr2 encoder graphs: %d captured in %.1fs, %.1f MiB (views per path: %s; %s)",
                 report.captured, dt, mem / 2 ** 20, report.paths,
                 "paths replayed side by side, a pool each" if self.overlap else "one pool")
        return report

    def check_pools(self) -> None:
        """Overlapping paths replay at the same time: their graphs must not share a pool (each
        replay writes its intermediates into its pool's blocks)."""
        if not self.overlap:
            return
        seen: list[tuple[object, str]] = []
        for (name, _), g in self.graphs.items():
            other = next((n for pool, n in seen if pool == g.pool and n != name), None)
            if other is not None:
                raise RuntimeError(f"encoder graph paths {other!r} and {name!r} share a graph pool but replay side "
                                   "by side: their intermediates would overwrite each other")
            seen.append((g.pool, name))

    def encode_path(self, name: str, parts: Sequence[torch.Tensor]) -> torch.Tensor:
        """One path's views ([patches, C*P*P] each) -> [views, queries, text width]: replayed at
        the path's smallest budget holding them, eager above its largest (or without the path)."""
        n, st = len(parts), self.stats[name]
        path = self.paths.get(name)
        budget = bucket_for(n, path.budgets) if path is not None else None
        if budget is None:
            st.eager_views += n
            return self.model.encode_views(torch.cat(list(parts)), n, PATH_IS_GLOBAL[name], self.ex)
        st.replays += 1
        st.real_views += n
        st.padded_views += budget - n
        st.per_budget[budget] = st.per_budget.get(budget, 0) + 1
        return self.graphs[(name, budget)].replay(parts)

    def run(self, pixels: torch.Tensor, grids: list[tuple[int, int, int]]) -> torch.Tensor:
        """The tower's rows for the packed batch (the eager forward's layout: per image its crops,
        its global view, the separator). Each path's output is read by assemble() before any
        other replay of its graph."""
        meta = self.runner.meta_builder.build_host(grids)
        glob, crops = self.model.split_views(pixels, meta)
        if not crops:
            return self.model.assemble(self.encode_path("global", glob), None, meta.crops)
        if self.overlap:
            g_rows, c_rows = self.api.side_by_side(partial(self.encode_path, "global", glob),
                                                   partial(self.encode_path, "local", crops))
        else:
            g_rows, c_rows = self.encode_path("global", glob), self.encode_path("local", crops)
        return self.model.assemble(g_rows, c_rows, meta.crops)

    def describe(self) -> str:
        return "; ".join(f"{name} views {list(p.budgets)}" for name, p in self.paths.items()) + (
            "; side by side" if self.overlap else "")
