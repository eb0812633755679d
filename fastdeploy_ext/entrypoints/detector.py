"""``fastdeploy_ext.Detector``: a layout detector family's model on a device runner, in the shape
of ``LLM`` (one object, loaded once, called per batch of pages)."""
from __future__ import annotations

import logging
from typing import Sequence

from ..plan import PlanRequest

log = logging.getLogger(__name__)

#: transformers' post-processing default (PaddleX's PaddleOCR-VL-1.5 pipeline configures 0.3)
DEFAULT_THRESHOLD = 0.5


class Detector:
    """``Detector(model=DIR | None, device="auto")``; ``detect(images)`` -> per image its
    detections (label, score, bbox [x0, y0, x1, y1] in the image's pixels), in reading order.
    ``model=None`` (or ``load_format="dummy"``): random weights from the default detector
    family's built-in config."""

    def __init__(self, model: str | None = None, *, device: str = "auto", dtype: str = "auto",
                 load_format: str = "auto", model_family: str | None = None,
                 threshold: float = DEFAULT_THRESHOLD, request: PlanRequest | None = None, masks: bool | None = None):
        from ..runner import create_runner
        if model is None:
            load_format = "dummy"
        self.threshold = _check_threshold(threshold)
        self.runner = create_runner(request or PlanRequest(device=device, dtype=dtype))
        if not hasattr(self.runner, "load_detector"):
            raise ValueError(f"runner {self.runner.name} has no detector path (it does not build on TorchRunner)")
        self.load_report = self.runner.load_detector(model, load_format=load_format, model_family=model_family,
                                                     masks=masks)
        self.family, self.cfg = self.runner.detector_family, self.runner.detector_cfg
        # the plan's batch-size bucket graphs (CUDA rows); a no-op report with the reason elsewhere
        self.graph_report = self.runner.capture_detector_graphs()
        self.processor = self.family.image_processor(None if load_format == "dummy" else model, self.cfg)

    @property
    def labels(self) -> tuple[str, ...]:
        return self.family.label_names(self.cfg)

    def detect(self, images: Sequence, *, threshold: float | None = None, batch_size: int = 8) -> list[list]:
        """``images``: paths, encoded bytes, PIL images, [h, w, 3] uint8 arrays or [3, h, w]
        uint8 tensors. Pages run ``batch_size`` at a time."""
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        thr = self.threshold if threshold is None else _check_threshold(threshold)
        out: list[list] = []
        for i in range(0, len(images), batch_size):
            pixels, sizes = self.processor.preprocess(list(images[i:i + batch_size]))
            out.extend(self.runner.detect(pixels, sizes, threshold=thr))
        return out


def _check_threshold(t: float) -> float:
    if not isinstance(t, (int, float)) or not 0.0 <= float(t) <= 1.0:
        raise ValueError(f"threshold must be a score in [0, 1], got {t!r}")
    return float(t)
