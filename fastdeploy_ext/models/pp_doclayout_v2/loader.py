"""Loads what transformers' ``save_pretrained`` writes for PPDocLayoutV2ForObjectDetection: the
detector's tensors under ``model.``, the reading-order network's under ``reading_order.``, which
are model.py's own names (no prefix to strip): the shared checked load of the V3 loader."""
from __future__ import annotations

import torch

from ..pp_doclayout_v3.loader import DetectorLoadReport, load_checked
from .config import PPDocLayoutV2Config
from .model import PPDocLayoutV2

#: written by save_pretrained, not used by inference: BatchNorm's step counters, the
#: training-time denoising class embedding, and the reading-order encoder's LayoutLMv3 2D
#: relative-position tables (the reference computes its bias from the box relations instead)
UNUSED_SUFFIXES = (".num_batches_tracked",)
UNUSED_NAMES = ("model.denoising_class_embed.weight", "reading_order.encoder.rel_pos_x_bias.weight",
                "reading_order.encoder.rel_pos_y_bias.weight")


def build_model(cfg: PPDocLayoutV2Config) -> PPDocLayoutV2:
    return PPDocLayoutV2(cfg).eval()


def load_detector(model_dir: str | None, *, dtype: torch.dtype, device: torch.device,
                  cfg: PPDocLayoutV2Config, seed: int = 0) -> tuple[PPDocLayoutV2, DetectorLoadReport]:
    return load_checked(build_model, model_dir, dtype=dtype, device=device, cfg=cfg, seed=seed, prefix="",
                        unused=lambda name: name in UNUSED_NAMES or name.endswith(UNUSED_SUFFIXES),
                        family="PP-DocLayoutV2")
