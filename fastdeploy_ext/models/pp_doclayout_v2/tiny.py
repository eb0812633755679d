"""The conformance suite's tiny PP-DocLayoutV2 (the family's own reference builder): V3's tiny
detector (pp_doclayout_v3/tiny.py: 300 queries over 336 encoder positions at 128x128, the 25
released classes, the same pages) without the mask branch, a 2-layer reading-order network,
per-class thresholds that keep a strict part of the queries and a class order that is not the
identity (so a relabelling bug shows).

The weights need no transformers and no shipped checkpoint: every tensor of OUR module is drawn
from SEED (V3's ``randomize``, in our state_dict order) and written under our names, which are
the names save_pretrained writes, with a config.json in transformers' field names, so both our
loader and transformers' ``from_pretrained`` read the same directory (``write_model``).

SEED is chosen so that the encoder's 300th and 301st scores differ by >= 1e-3 on the pages, and
the THRESHOLDS sit at least THRESHOLD_MARGIN from every query's best score (fp32
rounding on any device cannot change what is selected or kept; the fixture asserts both)."""
from __future__ import annotations

import json
from pathlib import Path

import torch

from ..pp_doclayout_v3 import tiny as v3

BACKBONE = dict(v3.BACKBONE, out_features=["stage2", "stage3", "stage4"])
TINY = {k: v for k, v in v3.TINY.items()
        if k not in ("x4_feat_dim", "mask_feature_channels", "num_prototypes", "global_pointer_head_size")}
READING_ORDER = dict(hidden_size=32, num_attention_heads=2, intermediate_size=64, num_hidden_layers=2,
                     coordinate_size=8, shape_size=8, num_classes=20, global_pointer_head_size=16,
                     max_position_embeddings=TINY["num_queries"] + 4)
NUM_CLASSES = 25
#: a many-to-one, non-monotonic relabelling onto the network's 20 classes
CLASS_ORDER = [(7 * i + 3) % 20 for i in range(NUM_CLASSES)]
SEED = 2
#: per class: the score a query's best class needs to be kept (``choose_thresholds`` on the pages)
THRESHOLDS = [0.5, 0.865782, 0.7, 0.8, 0.9, 0.816745, 0.6, 0.7, 0.887748, 0.9, 0.5, 0.877918, 0.7, 0.8, 0.9,
              0.5, 0.6, 0.7, 0.8, 0.9, 0.5, 0.6, 0.7, 0.835957, 0.9]
#: a score within the outputs' tolerance (1e-4 on the logits; sigmoid's slope is <= 1/4) moves by
#: <= 2.5e-5, so a 1e-4 margin keeps the kept set the reference's
THRESHOLD_MARGIN = 1e-4
#: the detections' score threshold (random weights put the top scores near 0.9)
DETECT_THRESHOLD = 0.9            # 15 and 35 kept; no score within 1e-4 of it
IMAGE = v3.IMAGE
PAGE_SIZES = v3.PAGE_SIZES
pages = v3.pages
page_pixels = v3.page_pixels


def config_dict(thresholds=None) -> dict:
    """config.json in transformers' PPDocLayoutV2Config field names (what our reader reads)."""
    from ..pp_doclayout_v3.config import RELEASED_LABELS
    return dict(TINY, model_type="pp_doclayout_v2", backbone_config=dict(BACKBONE, model_type="hgnet_v2"),
                reading_order_config=dict(READING_ORDER), id2label={str(i): n for i, n in enumerate(RELEASED_LABELS)},
                class_thresholds=list(THRESHOLDS if thresholds is None else thresholds), class_order=list(CLASS_ORDER))


def build_model(seed: int = SEED, thresholds=None):
    """Our module of the tiny config with every tensor drawn from ``seed`` (fp32, CPU)."""
    from .config import PPDocLayoutV2Config
    from .model import PPDocLayoutV2
    cfg = PPDocLayoutV2Config.from_dict(config_dict(thresholds))
    torch.manual_seed(seed)
    model = PPDocLayoutV2(cfg).eval()
    v3.randomize(model, seed)
    return model


def write_model(path, seed: int = SEED, thresholds=None) -> Path:
    from safetensors.torch import save_file
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    model = build_model(seed, thresholds)
    (path / "config.json").write_text(json.dumps(config_dict(thresholds), indent=1))
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(path / "model.safetensors"),
              metadata={"format": "pt"})
    (path / "preprocessor_config.json").write_text(json.dumps(
        {"size": {"height": IMAGE, "width": IMAGE}, "do_resize": True, "do_rescale": True,
         "rescale_factor": 1 / 255, "image_mean": [0, 0, 0], "image_std": [1, 1, 1]}))
    return path


def threshold_margin(logits: torch.Tensor, thresholds) -> float:
    """The smallest distance between a query's best score and its class's threshold."""
    best, cls = logits.float().max(-1)
    return float((best.sigmoid() - torch.tensor(thresholds, dtype=torch.float32)[cls]).abs().min())


def kept_counts(logits: torch.Tensor, thresholds) -> list[int]:
    best, cls = logits.float().max(-1)
    return (best.sigmoid() >= torch.tensor(thresholds, dtype=torch.float32)[cls]).sum(1).tolist()


def choose_thresholds(logits: torch.Tensor) -> list[float]:
    """How THRESHOLDS were made: per class the detector predicts best, the middle of the widest gap
    among the middle half of its best scores (a strict part of its queries kept); 0.5 to 0.9 for
    the others."""
    best, cls = logits.float().max(-1)
    scores, out = best.sigmoid(), [0.5 + 0.1 * (i % 5) for i in range(NUM_CLASSES)]
    for c in cls.unique().tolist():
        s = scores[cls == c].sort().values
        if len(s) >= 4:
            lo, hi = len(s) // 4, 3 * len(s) // 4 + 1
            i = lo + int((s[lo:hi] - s[lo - 1:hi - 1]).argmax())
            out[c] = round(float((s[i - 1] + s[i]) / 2), 6)
    return out
