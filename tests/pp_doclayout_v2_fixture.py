"""A tiny random PP-DocLayoutV2 built by transformers (tests/test_pp_doclayout_v2.py): V3's tiny
detector (tests/pp_doclayout_fixture.py) without the mask branch, a 2-layer reading-order
network, per-class thresholds that keep some queries and drop others, and a class order that
is not the identity (so a relabelling bug shows); every weight drawn from one seed, saved with
``save_pretrained``."""
from __future__ import annotations

import json

from . import pp_doclayout_fixture as v3

BACKBONE = dict(v3.BACKBONE, out_features=["stage2", "stage3", "stage4"])
TINY = {k: v for k, v in v3.TINY.items()
        if k not in ("x4_feat_dim", "mask_feature_channels", "num_prototypes", "global_pointer_head_size")}
READING_ORDER = dict(hidden_size=32, num_attention_heads=2, intermediate_size=64, num_hidden_layers=2,
                     coordinate_size=8, shape_size=8, num_classes=20, global_pointer_head_size=16,
                     max_position_embeddings=64)
NUM_CLASSES = 25
#: the thresholds of the classes the random detector never predicts best (0.5 to 0.9 by class);
#: each class it does predict gets one in the widest gap among the middle half of its best scores
#: on the sample pixels (``build_reference``), so the kept set is a strict part of the queries
THRESHOLDS = [0.5 + 0.1 * (i % 5) for i in range(NUM_CLASSES)]
#: a many-to-one, non-monotonic relabelling onto the network's 20 classes
CLASS_ORDER = [(7 * i + 3) % 20 for i in range(NUM_CLASSES)]
#: the weights' seed: chosen so that the encoder's k-th and k+1-th query scores of the test
#: pixels differ by >= 1e-3 (the test asserts it), so that fp32 rounding cannot swap the top-k
SEED = 5
IMAGE = v3.IMAGE
sample_pixels = v3.sample_pixels


def build_reference(seed: int = SEED):
    import torch
    from transformers import PPDocLayoutV2Config, PPDocLayoutV2ForObjectDetection
    from fastdeploy_ext.models.pp_doclayout_v3.config import RELEASED_LABELS
    cfg = PPDocLayoutV2Config(backbone_config=dict(BACKBONE), reading_order_config=dict(READING_ORDER),
                              id2label=dict(enumerate(RELEASED_LABELS)), class_thresholds=list(THRESHOLDS),
                              class_order=list(CLASS_ORDER), **TINY)
    torch.manual_seed(seed)
    model = v3.randomize_weights(PPDocLayoutV2ForObjectDetection(cfg).eval(), seed)
    with torch.no_grad():
        best, cls = model(pixel_values=sample_pixels()).logits.max(-1)
    scores, thresholds = best.sigmoid(), list(THRESHOLDS)
    for c in cls.unique().tolist():
        s = scores[cls == c].sort().values
        if len(s) >= 2:
            # the widest gap in the middle half, so that no score sits next to its threshold
            lo, hi = max(1, len(s) // 4), max(2, 3 * len(s) // 4 + 1)
            i = lo + int((s[lo:hi] - s[lo - 1:hi - 1]).argmax())
            thresholds[c] = float((s[i - 1] + s[i]) / 2)
    model.config.class_thresholds = thresholds
    return model


def write_model(path, seed: int = SEED):
    model = build_reference(seed)
    model.save_pretrained(str(path))
    (path / "preprocessor_config.json").write_text(json.dumps(
        {"size": {"height": IMAGE, "width": IMAGE}, "do_resize": True, "do_rescale": True,
         "rescale_factor": 1 / 255, "image_mean": [0, 0, 0], "image_std": [1, 1, 1]}))
    return model
