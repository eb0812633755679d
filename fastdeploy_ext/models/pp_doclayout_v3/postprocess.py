"""Detector outputs -> detections per page (what transformers' ``post_process_object_detection``
computes, without the mask polygons): sigmoid of the class logits, top-k over queries x classes
(k = number of queries), the score threshold, boxes from (cx, cy, w, h) to corners scaled to the
page, in reading order from the pointer head's pairwise votes."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch


@dataclass(frozen=True)
class Detection:
    label: str
    label_id: int
    score: float
    bbox: tuple[float, float, float, float]     # x0, y0, x1, y1 in the page's pixels
    order: int                                  # the query's reading-order rank

    def to_json(self) -> dict:
        return {"label": self.label, "score": self.score, "bbox": list(self.bbox)}


def reading_order_ranks(order_logits: torch.Tensor) -> torch.Tensor:
    """[B, Q, Q] pairwise logits (entry i, j > i: "i before j") -> [B, Q] each query's rank. A
    query's votes: sigmoid(i, j) summed over i above it plus 1 - sigmoid(j, i) over j below it;
    ranks follow the votes ascending."""
    p = order_logits.sigmoid()
    votes = p.triu(1).sum(1) + (1.0 - p.transpose(1, 2)).tril(-1).sum(1)
    pointers = votes.argsort(dim=1)
    ranks = torch.empty_like(pointers)
    ranks.scatter_(1, pointers, torch.arange(p.shape[1], device=p.device).expand_as(pointers).contiguous())
    return ranks


def corners(boxes: torch.Tensor, sizes: Sequence[tuple[int, int]]) -> torch.Tensor:
    """[B, Q, 4] (cx, cy, w, h) in [0, 1] -> (x0, y0, x1, y1) in each page's pixels ((height, width))."""
    c, wh = boxes[..., :2], boxes[..., 2:]
    xyxy = torch.cat([c - 0.5 * wh, c + 0.5 * wh], -1)
    hw = torch.as_tensor(sizes, dtype=xyxy.dtype, device=xyxy.device)
    scale = torch.stack([hw[:, 1], hw[:, 0], hw[:, 1], hw[:, 0]], 1)
    return xyxy * scale[:, None, :]


def detections(logits: torch.Tensor, pred_boxes: torch.Tensor, order_logits: torch.Tensor,
               sizes: Sequence[tuple[int, int]], labels: Sequence[str], *, threshold: float) -> list[list[Detection]]:
    if logits.shape[0] != len(sizes):
        raise ValueError(f"{logits.shape[0]} images in the outputs but {len(sizes)} page sizes")
    logits, pred_boxes, order_logits = logits.float().cpu(), pred_boxes.float().cpu(), order_logits.float().cpu()
    q, c = logits.shape[1:]
    if c != len(labels):
        raise ValueError(f"the model has {c} classes but {len(labels)} label names")
    ranks = reading_order_ranks(order_logits)
    boxes = corners(pred_boxes, sizes)
    scores, flat = logits.sigmoid().flatten(1).topk(q, dim=1)
    cls, query = flat % c, flat // c
    out = []
    for b in range(logits.shape[0]):
        keep = scores[b] >= threshold
        s, k, qi = scores[b][keep], cls[b][keep], query[b][keep]
        r = ranks[b][qi]
        # the reference's own (unstable) sort on the same tensor: one query kept under two classes
        # shares a rank, and which class comes first is that sort's choice, so only the same op
        # on the same host tensor reproduces transformers' order (tests/test_pp_doclayout_v2.py)
        order = torch.sort(r).indices
        out.append([Detection(labels[int(k[i])], int(k[i]), float(s[i]),
                              tuple(float(v) for v in boxes[b, int(qi[i])]), int(r[i])) for i in order])
    return out
