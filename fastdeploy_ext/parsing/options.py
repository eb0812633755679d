"""``ParseOptions``: what `fastdeploy-ext parse` takes, one field per flag, and the planted
layouts file the benchmarks and tests give it."""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

from .pipeline import PipelineOptions

FORMATS = frozenset({"md", "json"})


@dataclass
class ParseOptions:
    """What `fastdeploy-ext parse` takes (the CLI builds it; every field is a flag)."""
    model: str | None = None                 # VLM dir; None with load_format "dummy"
    load_format: str = "auto"
    model_format: str = "auto"
    model_family: str | None = None
    layout_model: str | None = None          # layout dir; None: random weights (layout_load_format "dummy")
    layout_load_format: str = "auto"
    layout_family: str | None = None
    device: str = "auto"
    dtype: str = "auto"
    output: str | None = None                # the workspace; None: pages are only yielded
    formats: frozenset[str] = FORMATS
    pages: str | None = None                 # "1-3,7" (1-based, per document)
    dpi: int = 144
    chart_recognition: bool = False
    seal_recognition: bool = False
    jsonl_shards: int | None = None
    max_pages_in_flight: int = 16
    max_new_tokens: int = 4096
    retry_failed: bool = False
    workers: int = 1
    gpus: tuple[int, ...] | None = None      # one worker per listed CUDA device
    render_workers: int = 2
    layout_batch: int = 8
    layout_threshold: float = 0.3
    block_max_pixels: int | None = None
    planted_layouts: str | None = None       # a planted-layout JSON file (benchmarks, tests)
    planted_decode: bool = False             # each block decodes its kind's planted length (random weights)
    stub_vlm: bool = False
    visualize: bool = False                  # per page a layout picture beside its Markdown (visualize.py)
    lease_ttl_s: float = 60.0                # --workers: a silent worker's pages go back after this
    lease_pages: int = 4                     # --workers: pages per lease
    engine: object | None = None             # engine.config.EngineConfig (engine and plan flags)

    def validate(self) -> None:
        bad = set(self.formats) - FORMATS
        if not self.formats or bad:
            raise ValueError(f"formats: {', '.join(sorted(bad)) or 'none given'} (choose from md, json)")
        if self.model is None and self.load_format != "dummy" and not self.stub_vlm:
            raise ValueError("model=DIR is required (or load_format='dummy' for random weights)")
        if self.jsonl_shards is not None and self.jsonl_shards < 1:
            raise ValueError(f"jsonl_shards must be >= 1, got {self.jsonl_shards}")
        if self.workers < 1:
            raise ValueError(f"workers must be >= 1, got {self.workers}")
        if self.gpus is not None and len(self.gpus) != self.workers:
            raise ValueError(f"gpus lists {len(self.gpus)} devices for {self.workers} workers (give one per worker)")
        if self.lease_ttl_s <= 0 or self.lease_pages < 1:
            raise ValueError("lease_ttl_s must be > 0 and lease_pages >= 1")
        if not 0.0 <= self.layout_threshold <= 1.0:
            raise ValueError(f"layout_threshold must be in [0, 1], got {self.layout_threshold}")
        self.pipeline_options().validate()

    def pipeline_options(self) -> PipelineOptions:
        return PipelineOptions(max_pages_in_flight=self.max_pages_in_flight, layout_batch=self.layout_batch,
                               layout_threshold=self.layout_threshold, dpi=self.dpi,
                               max_new_tokens=self.max_new_tokens, block_max_pixels=self.block_max_pixels,
                               stub_vlm=self.stub_vlm, planted_decode=self.planted_decode,
                               visualize=self.visualize)

    def fingerprint(self) -> dict:
        """What the outputs depend on (a rerun with another fingerprint on the same workspace is
        refused): the models, the dtype, the options that change a page's text or boxes."""
        return {"model": _model_id(self.model, self.load_format), "layout_model":
                _model_id(self.layout_model, self.layout_load_format), "dtype": self.dtype, "dpi": self.dpi,
                "chart_recognition": self.chart_recognition, "seal_recognition": self.seal_recognition,
                "max_new_tokens": self.max_new_tokens, "block_max_pixels": self.block_max_pixels,
                "layout_threshold": self.layout_threshold, "stub_vlm": self.stub_vlm,
                "planted_layouts": _file_sha(self.planted_layouts),
                # only when on: a workspace made before the option existed keeps its fingerprint
                **({"visualize": True} if self.visualize else {})}


def _model_id(path: str | None, load_format: str) -> str:
    if path is None or load_format == "dummy":
        return "dummy"
    cfg = Path(path) / "config.json"
    digest = hashlib.sha256(cfg.read_bytes()).hexdigest()[:16] if cfg.is_file() else "no-config"
    return f"{Path(path).name}:{digest}"


def _file_sha(path: str | None) -> str | None:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()[:16] if path else None


# ------------------------------------------------------------------ planted layouts
class PlantedLayoutFile:
    """Known boxes per page from a JSON file: ``{"pages": {"<file name>": [[det, ...] per page]},
    "mix": [det, ...]}``; a det is ``{"label", "score", "bbox"}`` with bbox in fractions of the
    page's width and height (so any dpi works). A page not listed gets ``mix`` (the planted
    block mix for real PDFs); neither: no blocks."""

    def __init__(self, path: str):
        try:
            data = json.loads(Path(path).read_text())
        except (OSError, ValueError) as e:
            raise ValueError(f"planted layouts {path}: {e}") from None
        self.pages: dict[str, list[list[dict]]] = data.get("pages", {})
        self.mix: list[dict] | None = data.get("mix")

    def detections(self, path: str, page_index: int, width: int, height: int) -> list[dict]:
        per_page = self.pages.get(Path(path).name)
        dets = per_page[page_index] if per_page is not None and page_index < len(per_page) else self.mix or []
        return [{"label": d["label"], "score": float(d.get("score", 0.9)),
                 "bbox": [d["bbox"][0] * width, d["bbox"][1] * height, d["bbox"][2] * width, d["bbox"][3] * height]}
                for d in dets]
