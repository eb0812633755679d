"""Graph capture settings: ``--graph-optimization-config`` and the encoder's graph paths."""
from __future__ import annotations

import json
from dataclasses import dataclass


@dataclass(frozen=True)
class EncoderGraphPath:
    """A family of captured encoder graphs for one kind of batch (e.g. small layout blocks)."""
    name: str
    min_tokens: int
    max_tokens: int
    max_image_tokens: int      # images with more patches are not routed to this path
    max_segments: int          # most images (frames) packed into one replay

    @property
    def budgets(self) -> tuple[int, ...]:
        out, b = [], self.min_tokens
        while b < self.max_tokens:
            out.append(b)
            b *= 2
        return tuple(out + [self.max_tokens])

    def validate(self) -> None:
        if not 0 < self.min_tokens <= self.max_tokens:
            raise ValueError(f"graph path {self.name!r}: need 0 < min_tokens <= max_tokens")
        if self.max_image_tokens > self.max_tokens or self.max_segments < 1:
            raise ValueError(f"graph path {self.name!r}: max_image_tokens must be <= max_tokens and max_segments >= 1")


@dataclass(frozen=True)
class ViewGraphPath:
    """Captured encoder graphs of a tower whose input is a number of same-size views (e.g.
    DeepSeek-OCR-2's 1024 global views, its 768 crops): one graph per budget of views; a batch's
    views of this path pad to the smallest budget that holds them, or run eager above the largest."""
    name: str
    budgets: tuple[int, ...]

    def validate(self) -> None:
        b = self.budgets
        if (not isinstance(b, tuple) or not b or list(b) != sorted(set(b))
                or not all(isinstance(x, int) and not isinstance(x, bool) and x > 0 for x in b)):
            raise ValueError(f"graph path {self.name!r}: budgets must be a non-empty list of distinct positive "
                             f"view counts, got {list(b) if isinstance(b, tuple) else b!r}")


# DeepSeek-OCR-2's two paths: a page has one global view and 0-6 crops, so a batch of 16 pages holds
# 16 global views and up to 96 crops; each path picks its own budget (vLLM's dual-path graphs). The
# local budgets hold whole A4 pages (six crops each: 6, 12, 24, 48, 96) as well as powers of two for
# the two- and four-crop pages of wider images: 1, 2, 4, 8 or 16 A4 pages fill a budget exactly
DEFAULT_VIEW_GRAPH_PATHS = (
    ViewGraphPath("global", (1, 2, 4, 8, 16)),
    ViewGraphPath("local", (2, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96)),
)


def _parse_path(p) -> "EncoderGraphPath | ViewGraphPath":
    """One entry of ``encoder_graph_paths``: {name, budgets} (views) or the token-budget form."""
    if not isinstance(p, dict):
        raise ValueError(f"--graph-optimization-config encoder_graph_paths: each path is an object, got {p!r}")
    try:
        if "budgets" in p:
            b = p["budgets"]
            p = p | {"budgets": tuple(sorted(set(b))) if isinstance(b, list) and all(
                isinstance(x, int) for x in b) else b}
            return ViewGraphPath(**p)
        return EncoderGraphPath(**p)
    except TypeError as e:
        raise ValueError(f"--graph-optimization-config encoder_graph_paths: {e}") from None


# Graphs pay where launches dominate (one 8x40 block: 13.2 ms eager -> 3.5 ms replayed on the
# H200); a whole page padded to a budget lost to eager (69.2 vs 65.1 ms), so by default only small
# batches are captured. A "pages" path can be configured.
DEFAULT_GRAPH_PATHS = (
    EncoderGraphPath("blocks", min_tokens=512, max_tokens=4096, max_image_tokens=2048, max_segments=64),
)


# Decode graphs per batch-size bucket (a batch pads to the smallest bucket that holds it): dense
# where batches are small, coarser above, up to the default max_num_seqs.
DEFAULT_CAPTURE_SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256)


# Detector graphs per batch-size bucket at the detector's fixed input (a batch pads to the
# smallest bucket that holds it; a larger one runs in chunks of the largest)
DEFAULT_DETECTOR_CAPTURE_SIZES = (1, 2, 4, 8, 16, 32)


@dataclass(frozen=True)
class GraphOptimizationConfig:
    """`--graph-optimization-config` JSON. FastDeploy's keys keep FastDeploy's meaning:
    ``use_cudagraph`` (decoder graphs) and ``cudagraph_capture_sizes`` (the decode batch sizes
    captured). The vision encoder's graphs have their own keys: ``use_encoder_cudagraph``,
    ``encoder_graph_paths`` (list of {name, min_tokens, max_tokens, max_image_tokens,
    max_segments}, budgets over patches; for a tower over fixed-size views, DeepSeek-OCR-2's,
    {name, budgets}: its paths "global" and "local" with their view counts), ``encoder_overlap_paths``
    (such a tower's paths replayed side by side on two streams, each path its own graph pool;
    off unless true) and ``encoder_split_oversize_batches`` (pack batches
    larger than every budget into several replays instead of one eager pass). A layout detector's graphs:
    ``use_detector_cudagraph`` and ``detector_capture_sizes`` (its batch-size buckets). None:
    the row's default."""
    use_cudagraph: bool | None = None
    cudagraph_capture_sizes: tuple[int, ...] = DEFAULT_CAPTURE_SIZES
    use_encoder_cudagraph: bool | None = None
    encoder_graph_paths: tuple[EncoderGraphPath | ViewGraphPath, ...] = DEFAULT_GRAPH_PATHS
    encoder_split_oversize_batches: bool = False
    encoder_overlap_paths: bool | None = None
    use_detector_cudagraph: bool | None = None
    detector_capture_sizes: tuple[int, ...] = DEFAULT_DETECTOR_CAPTURE_SIZES

    KEYS = ("use_cudagraph", "cudagraph_capture_sizes", "use_encoder_cudagraph", "encoder_graph_paths",
            "encoder_split_oversize_batches", "encoder_overlap_paths", "use_detector_cudagraph",
            "detector_capture_sizes")

    @classmethod
    def from_json(cls, text: str | None) -> "GraphOptimizationConfig":
        if not text:
            return cls()
        try:
            d = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"--graph-optimization-config is not valid JSON: {e}") from None
        if not isinstance(d, dict):
            raise ValueError("--graph-optimization-config must be a JSON object")
        unknown = set(d) - set(cls.KEYS)
        if unknown:
            raise ValueError(f"--graph-optimization-config: unknown keys {sorted(unknown)}; known: {sorted(cls.KEYS)}")
        paths = DEFAULT_GRAPH_PATHS
        if "encoder_graph_paths" in d:
            if not isinstance(d["encoder_graph_paths"], list) or not d["encoder_graph_paths"]:
                raise ValueError("--graph-optimization-config encoder_graph_paths must be a non-empty list of paths")
            paths = tuple(_parse_path(p) for p in d["encoder_graph_paths"])
            if len({type(p) for p in paths}) > 1:
                raise ValueError("--graph-optimization-config encoder_graph_paths: all paths take one form, "
                                 "{name, budgets} (views) or {name, min_tokens, max_tokens, max_image_tokens, "
                                 "max_segments} (patches)")
            if len({p.name for p in paths}) < len(paths):
                raise ValueError(f"--graph-optimization-config encoder_graph_paths: path names repeat: "
                                 f"{[p.name for p in paths]}")
            for p in paths:
                p.validate()
        def sizes_of(key, default):
            if key not in d:
                return default
            sizes = d[key]
            if (not isinstance(sizes, list) or not sizes
                    or not all(isinstance(x, int) and not isinstance(x, bool) and x > 0 for x in sizes)):
                raise ValueError(f"--graph-optimization-config {key} must be a non-empty list of "
                                 f"positive integers, got {sizes!r}")
            return tuple(sorted(set(sizes)))

        def switch(key):
            return None if d.get(key) is None else bool(d[key])
        return cls(switch("use_cudagraph"), sizes_of("cudagraph_capture_sizes", DEFAULT_CAPTURE_SIZES),
                   switch("use_encoder_cudagraph"), paths, bool(d.get("encoder_split_oversize_batches", False)),
                   switch("encoder_overlap_paths"), switch("use_detector_cudagraph"),
                   sizes_of("detector_capture_sizes", DEFAULT_DETECTOR_CAPTURE_SIZES))
