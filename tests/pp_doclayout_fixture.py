"""A tiny random PP-DocLayoutV3 built by transformers (tests/test_pp_doclayout_v3.py, the CLI
tests): every weight drawn from one seed so that nothing is degenerate (transformers' init
zeroes the deformable attention's projections and gives BatchNorm weights of ~0.01), saved
with ``save_pretrained``."""
from __future__ import annotations

import torch

from fastdeploy_ext.models.pp_doclayout_v3 import tiny as suite_tiny

#: the tiny architecture: the conformance suite's (HGNetV2 with 4 one-block stages, d_model 32,
#: 2 heads, 2 decoder layers, the 25 released classes) with 20 queries instead of 300
BACKBONE = suite_tiny.BACKBONE
TINY = {**suite_tiny.TINY, "num_queries": 20}
#: the weights' seed: chosen so that the encoder's k-th and k+1-th query scores of the test
#: pixels differ by >= 1e-3 (the test asserts it), so that fp32 rounding cannot swap the top-k
SEED = 3
IMAGE = 128       # the tiny model's input side (the processor's size in preprocessor_config.json)


def build_reference(seed: int = SEED):
    from transformers import PPDocLayoutV3Config, PPDocLayoutV3ForObjectDetection
    from fastdeploy_ext.models.pp_doclayout_v3.config import RELEASED_LABELS
    cfg = PPDocLayoutV3Config(backbone_config=dict(BACKBONE), id2label=dict(enumerate(RELEASED_LABELS)), **TINY)
    torch.manual_seed(seed)
    return randomize_weights(PPDocLayoutV3ForObjectDetection(cfg).eval(), seed)


def randomize_weights(model, seed: int):
    """Every weight of ``model`` drawn from ``seed`` (shared with the V2 fixture)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, t in list(model.state_dict(keep_vars=True).items()):
            if name.endswith("num_batches_tracked"):
                continue
            if name.endswith("running_var"):
                t.copy_(torch.rand(t.shape, generator=g) + 0.5)
            elif name.endswith("running_mean") or name.endswith(".bias"):
                t.copy_(torch.randn(t.shape, generator=g) * 0.1)
            elif t.ndim == 1:           # norm weights
                t.copy_(torch.rand(t.shape, generator=g) + 0.5)
            else:
                fan_in = t[0].numel()
                t.copy_(torch.randn(t.shape, generator=g) / fan_in ** 0.5)
    return model


def write_model(path, seed: int = SEED):
    import json
    model = build_reference(seed)
    model.save_pretrained(str(path))
    (path / "preprocessor_config.json").write_text(json.dumps(
        {"size": {"height": IMAGE, "width": IMAGE}, "do_resize": True, "do_rescale": True,
         "rescale_factor": 1 / 255, "image_mean": [0, 0, 0], "image_std": [1, 1, 1]}))
    return model


def sample_pixels(batch: int = 2) -> torch.Tensor:
    g = torch.Generator().manual_seed(7)
    return (torch.randint(0, 256, (batch, 3, IMAGE, IMAGE), generator=g, dtype=torch.uint8).float() / 255)
