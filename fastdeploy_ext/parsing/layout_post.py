"""The layout detector's boxes -> the page's blocks: what PaddleX does after the model, written
from its documented behaviour. In order:

1. score threshold (0.3, PaddleX's PaddleOCR-VL-1.5 pipeline value; per class allowed);
2. boxes clipped to the page, empty ones dropped;
3. class-aware NMS: a box is suppressed by a higher-scoring one of the same class above IoU 0.6,
   of another class only above 0.98 (two classes on one region are usually both meant);
4. merging within a class, for pairs where the smaller box lies in the larger by more than
   ``overlap_ratio`` of its area: ``large`` keeps the larger box (charts, display formulas,
   titles: a fragment inside one is part of it), ``small`` keeps the smaller, ``union`` replaces
   both by their union box (text split into pieces becomes one block);
5. the overlap filter across classes: of two boxes of different classes overlapping by more
   than ``overlap_ratio`` of the smaller one, the smaller is dropped (text inside a table or an
   image is part of it);
6. reading order: the model's own (its pointer head orders the detections); a merged block
   takes the earliest place of its parts; ``order`` is renumbered 0..n-1.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterable

import numpy as np

Box = tuple[float, float, float, float]

#: classes whose fragments are parts of one block (PaddleX's "large" merge mode)
LARGE_MERGE_LABELS = ("chart", "display_formula", "doc_title", "paragraph_title")
MERGE_MODES = ("large", "small", "union")


def _default_merge_modes() -> dict[str, str]:
    return {label: "large" for label in LARGE_MERGE_LABELS}


@dataclass
class LayoutBlock:
    label: str
    score: float
    bbox: Box                   # x0, y0, x1, y1 in page pixels
    order: int                  # reading order, 0..n-1 on the page


@dataclass
class LayoutPostConfig:
    #: one score for every class, or per class (``"default"`` for the rest, else 0.3)
    threshold: float | dict[str, float] = 0.3
    nms_iou_same: float = 0.6
    nms_iou_cross: float = 0.98
    overlap_ratio: float = 0.7
    #: per class: "large", "small" or "union"; classes not named use ``default_merge_mode``
    merge_modes: dict[str, str] = field(default_factory=_default_merge_modes)
    default_merge_mode: str = "union"

    def __post_init__(self):
        for label, mode in {**self.merge_modes, "<default>": self.default_merge_mode}.items():
            if mode not in MERGE_MODES:
                raise ValueError(f"merge mode for {label!r} must be one of {', '.join(MERGE_MODES)}, got {mode!r}")
        for name in ("nms_iou_same", "nms_iou_cross", "overlap_ratio"):
            v = getattr(self, name)
            if not 0.0 <= v <= 1.0:
                raise ValueError(f"{name} must be in [0, 1], got {v!r}")

    def threshold_for(self, label: str) -> float:
        if isinstance(self.threshold, dict):
            return float(self.threshold.get(label, self.threshold.get("default", 0.3)))
        return float(self.threshold)

    def merge_mode(self, label: str) -> str:
        return self.merge_modes.get(label, self.default_merge_mode)


# --------------------------------------------------------------------------------------------
# box geometry
# --------------------------------------------------------------------------------------------

def area(b: Box) -> float:
    return max(0.0, b[2] - b[0]) * max(0.0, b[3] - b[1])


def intersection(a: Box, b: Box) -> float:
    w = min(a[2], b[2]) - max(a[0], b[0])
    h = min(a[3], b[3]) - max(a[1], b[1])
    return w * h if w > 0 and h > 0 else 0.0


def iou(a: Box, b: Box) -> float:
    inter = intersection(a, b)
    union = area(a) + area(b) - inter
    return inter / union if union > 0 else 0.0


def overlap_of_smaller(a: Box, b: Box) -> float:
    """The share of the smaller box that lies in the other one."""
    small = min(area(a), area(b))
    return intersection(a, b) / small if small > 0 else 0.0


def union_box(a: Box, b: Box) -> Box:
    return (min(a[0], b[0]), min(a[1], b[1]), max(a[2], b[2]), max(a[3], b[3]))


# --------------------------------------------------------------------------------------------
# the steps
# --------------------------------------------------------------------------------------------

@dataclass
class _Cand:
    label: str
    score: float
    bbox: Box
    rank: float                 # the model's reading order (smaller = earlier)


def _field(det: Any, name: str):
    return det[name] if isinstance(det, dict) else getattr(det, name)


def _candidates(detections: Iterable[Any], width: int, height: int, cfg: LayoutPostConfig) -> list[_Cand]:
    out = []
    for i, det in enumerate(detections):
        label, score = str(_field(det, "label")), float(_field(det, "score"))
        if score < cfg.threshold_for(label):
            continue
        x0, y0, x1, y1 = (float(v) for v in _field(det, "bbox"))
        b = (min(max(x0, 0.0), width), min(max(y0, 0.0), height), min(max(x1, 0.0), width), min(max(y1, 0.0), height))
        if area(b) <= 0:
            continue
        # a Detection carries its rank; a plain dict is in reading order already
        rank = det.get("order", i) if isinstance(det, dict) else getattr(det, "order", i)
        out.append(_Cand(label, score, b, float(rank)))
    return out


def _pairwise(boxes: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """[n, 4] boxes -> ([n, n] intersection areas, [n] areas)."""
    x0 = np.maximum(boxes[:, None, 0], boxes[None, :, 0])
    y0 = np.maximum(boxes[:, None, 1], boxes[None, :, 1])
    x1 = np.minimum(boxes[:, None, 2], boxes[None, :, 2])
    y1 = np.minimum(boxes[:, None, 3], boxes[None, :, 3])
    inter = np.clip(x1 - x0, 0, None) * np.clip(y1 - y0, 0, None)
    areas = np.clip(boxes[:, 2] - boxes[:, 0], 0, None) * np.clip(boxes[:, 3] - boxes[:, 1], 0, None)
    return inter, areas


def class_aware_nms(cands: list[_Cand], iou_same: float, iou_cross: float) -> list[_Cand]:
    """Greedy NMS by score (ties: reading order), with a threshold per same / other class: a box
    goes when it overlaps a kept, higher-scoring box above the threshold for their pair."""
    if not cands:
        return []
    ordered = sorted(cands, key=lambda c: (-c.score, c.rank))
    inter, areas = _pairwise(np.array([c.bbox for c in ordered], dtype=np.float64))
    union = areas[:, None] + areas[None, :] - inter
    ious = np.divide(inter, union, out=np.zeros_like(inter), where=union > 0)
    labels = np.array([c.label for c in ordered])
    suppresses = ious > np.where(labels[:, None] == labels[None, :], iou_same, iou_cross)
    gone = np.zeros(len(ordered), dtype=bool)
    kept = []
    for i in range(len(ordered)):
        if not gone[i]:
            kept.append(ordered[i])
            gone |= suppresses[i]
    return kept


def merge_within_class(cands: list[_Cand], cfg: LayoutPostConfig) -> list[_Cand]:
    """Repeatedly resolve one same-class pair overlapping by more than ``overlap_ratio`` of the
    smaller box, per the class's merge mode, until none is left."""
    cands = list(cands)
    changed = True
    while changed:              # a pass per round: a merged box may now meet one checked before
        changed = False
        i = 0
        while i < len(cands):
            j = i + 1
            while j < len(cands):
                a, b = cands[i], cands[j]
                if a.label != b.label or overlap_of_smaller(a.bbox, b.bbox) <= cfg.overlap_ratio:
                    j += 1
                    continue
                mode = cfg.merge_mode(a.label)
                big, small = (a, b) if (area(a.bbox), -a.rank) >= (area(b.bbox), -b.rank) else (b, a)
                if mode == "union":
                    kept = _Cand(a.label, max(a.score, b.score), union_box(a.bbox, b.bbox), min(a.rank, b.rank))
                else:
                    kept = big if mode == "large" else small
                    kept = _Cand(kept.label, kept.score, kept.bbox, min(a.rank, b.rank))
                cands[i] = kept
                del cands[j]
                changed = True
                j = i + 1       # the kept box changed: check it against the rest again
            i += 1
    return cands


def filter_overlaps(cands: list[_Cand], ratio: float) -> list[_Cand]:
    """Across classes: of two boxes overlapping by more than ``ratio`` of the smaller, drop the
    smaller (equal areas: the lower score)."""
    if not cands:
        return []
    inter, areas = _pairwise(np.array([c.bbox for c in cands], dtype=np.float64))
    smaller = np.minimum(areas[:, None], areas[None, :])
    overlap = np.divide(inter, smaller, out=np.zeros_like(inter), where=smaller > 0)
    dropped: set[int] = set()
    for i, j in zip(*np.nonzero(np.triu(overlap > ratio, 1))):      # pairs in (i, j) order
        i, j = int(i), int(j)
        if i in dropped or j in dropped:
            continue
        a, b = cands[i], cands[j]
        if a.label != b.label:              # same-class pairs were merged before
            dropped.add(j if (area(b.bbox), b.score) < (area(a.bbox), a.score) else i)
    return [c for k, c in enumerate(cands) if k not in dropped]


def postprocess(detections: list, width: int, height: int, cfg: LayoutPostConfig | None = None) -> list[LayoutBlock]:
    """Detections of one page (dicts with ``label``, ``score``, ``bbox``, in the model's reading
    order, or Detection objects with their ``order``) -> the page's blocks in reading order."""
    cfg = cfg or LayoutPostConfig()
    cands = _candidates(detections, width, height, cfg)
    cands = class_aware_nms(cands, cfg.nms_iou_same, cfg.nms_iou_cross)
    cands = merge_within_class(cands, cfg)
    cands = filter_overlaps(cands, cfg.overlap_ratio)
    cands.sort(key=lambda c: c.rank)
    return [LayoutBlock(c.label, c.score, c.bbox, i) for i, c in enumerate(cands)]
