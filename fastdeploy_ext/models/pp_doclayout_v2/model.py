"""PP-DocLayoutV2 (transformers' ``PPDocLayoutV2ForObjectDetection``): the shared PP-DocLayout
detector (pp_doclayout_v3/model.py DetectorCore) without a mask branch and with RT-DETR's own
class and box head per decoder layer, then the reading-order network on the boxes that pass
their class's threshold.

Between the two, as the reference does: each query's best class and its score (sigmoid);
kept = score >= class_thresholds[class]; the queries reordered kept-first (by the reference's
own unstable sort: see ``reading_order_inputs``); kept boxes to corners on a 0..1000 grid, the rest zero boxes;
classes relabelled through ``class_order`` (the non-kept ones as class 0 first). The outputs'
``logits`` and ``pred_boxes`` are in that kept-first order, which ``order_logits`` indexes, so the
post-processing (V3's) applies unchanged.

Parameter names: the detector under ``model.``, the network under ``reading_order.``, as
``save_pretrained`` writes them."""
from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from ..pp_doclayout_v3.model import DetectorCore, DetectorOutputs
from .config import PPDocLayoutV2Config
from .reading_order import ReadingOrder


class LayoutDetector(DetectorCore):
    """V2's detector: per-layer heads, no mask branch; ``forward -> (logits, boxes, DecoderState)``."""

    def __init__(self, cfg: PPDocLayoutV2Config):
        super().__init__(cfg, mask_branch=False, per_layer_heads=True)

    def forward(self, pixels: torch.Tensor):
        st = self.run(pixels)
        return self.decoder.class_embed[len(self.decoder.layers) - 1](st.hidden), st.boxes, st


def reading_order_inputs(logits: torch.Tensor, boxes: torch.Tensor, thresholds: torch.Tensor,
                         class_order: torch.Tensor):
    """What the reading-order network reads, as the reference builds it: ``(permutation [B, Q]
    kept-first, grid boxes [B, Q, 4], relabelled classes [B, Q], number kept [B])``."""
    best, cls = logits.max(-1)
    kept = best.sigmoid() >= thresholds[cls]         # float32 thresholds, as the reference's
    # the same (unstable) sort as the reference: the network reads the kept boxes in this order
    # (their positions are embedded), and an unstable sort's order of equal keys is the
    # implementation's, so only the same op on the same device gives the reference's sequence
    perm = torch.argsort(kept.int(), dim=1, descending=True)
    kept_sorted = kept.gather(1, perm)
    boxes_sorted = boxes.gather(1, perm[..., None].expand(-1, -1, 4))
    grid, labels = _grid_and_labels(kept_sorted, cls.gather(1, perm), boxes_sorted, class_order)
    return perm, grid, labels, kept.sum(1)


def _grid_and_labels(kept: torch.Tensor, cls: torch.Tensor, boxes: torch.Tensor, class_order: torch.Tensor):
    """Kept boxes (cx, cy, w, h in [0, 1]) as corners on the 0..1000 grid (the rest zero boxes)
    and their classes through ``class_order`` (the rest class_order[0]), all already kept-first."""
    c, wh = boxes[..., :2], boxes[..., 2:]
    grid = (torch.cat([c - 0.5 * wh, c + 0.5 * wh], -1) * 1000).clamp(0.0, 1000.0)
    grid = torch.where(kept[..., None], grid, 0.0)
    return grid, class_order[torch.where(kept, cls, 0)]


def sorted_reading_order_inputs(logits: torch.Tensor, boxes: torch.Tensor, thresholds: torch.Tensor,
                                class_order: torch.Tensor):
    """``(grid, labels, num_kept)`` of outputs already in kept-first order (the model's own
    ``logits`` / ``pred_boxes``): what the reading-order network read to make ``order_logits``."""
    best, cls = logits.max(-1)
    kept = best.sigmoid() >= thresholds[cls]
    grid, labels = _grid_and_labels(kept, cls, boxes, class_order)
    return grid, labels, kept.sum(1)


class PPDocLayoutV2(nn.Module):
    """``forward(pixels [B, 3, H, W] in [0, 1]) -> DetectorOutputs`` (``out_masks`` always None:
    V2 has no mask head)."""

    def __init__(self, cfg: PPDocLayoutV2Config):
        super().__init__()
        self.cfg = cfg
        self.model = LayoutDetector(cfg)
        self.reading_order = ReadingOrder(cfg.reading_order)
        # the thresholds are kept as float32 bit patterns in an int32 buffer: a module cast to
        # bf16 casts float buffers, and the reference compares against float32 thresholds
        self.register_buffer("threshold_bits", torch.tensor(cfg.class_thresholds, dtype=torch.float32)
                             .view(torch.int32), persistent=False)
        self.register_buffer("class_order", torch.tensor(cfg.class_order, dtype=torch.long), persistent=False)

    @property
    def with_masks(self) -> bool:
        return False

    @with_masks.setter
    def with_masks(self, value: bool) -> None:
        if value:
            raise ValueError("PP-DocLayoutV2 has no mask head: masks cannot be computed for this family")

    @property
    def thresholds(self) -> torch.Tensor:
        return self.threshold_bits.view(torch.float32)

    def order_logits_of(self, logits: torch.Tensor, boxes: torch.Tensor) -> torch.Tensor:
        """The reading-order network on kept-first outputs (``forward``'s logits and pred_boxes,
        or a reference's): its ``order_logits`` for exactly those inputs."""
        grid, labels, num_kept = sorted_reading_order_inputs(logits, boxes, self.thresholds, self.class_order)
        return self.reading_order(grid, labels, num_kept)

    def set_deformable_kernel(self, kernel: Callable) -> None:
        self.model.set_deformable_kernel(kernel)

    def set_aifi_attention(self, attend: Callable) -> None:
        self.model.set_aifi_attention(attend)

    def forward(self, pixels: torch.Tensor) -> DetectorOutputs:
        logits, boxes, st = self.model(pixels)
        perm, grid, labels, num_kept = reading_order_inputs(logits, boxes, self.thresholds, self.class_order)
        order = self.reading_order(grid, labels, num_kept)
        logits = logits.gather(1, perm[..., None].expand(-1, -1, logits.shape[-1]))
        boxes = boxes.gather(1, perm[..., None].expand(-1, -1, 4))
        return DetectorOutputs(logits, boxes, order, st.enc_outputs_class, st.enc_outputs_coord_logits, None)
