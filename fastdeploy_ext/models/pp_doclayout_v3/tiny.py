"""The conformance suite's tiny PP-DocLayoutV3 (the family's own reference builder): built by
transformers (its PPDocLayoutV3ForObjectDetection, every weight drawn from one seed so nothing is degenerate:
transformers' init zeroes the deformable attention's projections and gives BatchNorm weights of
~0.01), written by ``save_pretrained``, with the pages it is run on. Used by make_references.py
(the shipped checkpoint and goldens) and, where transformers imports, for the live reference.

The tiny architecture keeps the released query count (300) and the 25 released classes: a
128x128 input gives the encoder 16x16 + 8x8 + 4x4 = 336 positions, so its top-300 selection is
a real choice, and SEED is chosen so that the 300th and 301st of its scores differ by >= 1e-3 on
the pages below (fp32 rounding cannot swap what is selected; the suite asserts it)."""
from __future__ import annotations

import json
from pathlib import Path

import torch

BACKBONE = dict(model_type="hgnet_v2", arch="L", stem_channels=[3, 8, 8], stage_in_channels=[8, 16, 32, 64],
                stage_mid_channels=[8, 8, 16, 16], stage_out_channels=[16, 32, 64, 128], stage_num_blocks=[1, 1, 2, 1],
                stage_downsample=[False, True, True, True], stage_light_block=[False, False, True, True],
                stage_kernel_size=[3, 3, 5, 5], stage_numb_of_layers=[2, 2, 2, 2], hidden_sizes=[16, 32, 64, 128],
                out_features=["stage1", "stage2", "stage3", "stage4"])
TINY = dict(encoder_in_channels=[32, 64, 128], encoder_hidden_dim=32, d_model=32, encoder_ffn_dim=64,
            decoder_ffn_dim=64, encoder_attention_heads=2, decoder_attention_heads=2, decoder_layers=2,
            num_queries=300, decoder_in_channels=[32, 32, 32], x4_feat_dim=16, mask_feature_channels=[16, 16],
            num_prototypes=8, global_pointer_head_size=16)
SEED = 8
IMAGE = 128                                    # the processor's size (preprocessor_config.json)
#: the pages the suite detects on: (height, width) of each, random uint8 content from PAGE_SEED
PAGE_SIZES = ((160, 120), (128, 128))
PAGE_SEED = 7
THRESHOLD = 0.95                # random weights put the top scores near 1: 11 of 300 kept a page


def build_reference(seed: int = SEED):
    from transformers import PPDocLayoutV3Config, PPDocLayoutV3ForObjectDetection

    from .config import RELEASED_LABELS
    cfg = PPDocLayoutV3Config(backbone_config=dict(BACKBONE), id2label=dict(enumerate(RELEASED_LABELS)), **TINY)
    torch.manual_seed(seed)
    model = PPDocLayoutV3ForObjectDetection(cfg).eval()
    randomize(model, seed)
    return model


def randomize(model: torch.nn.Module, seed: int) -> None:
    """Every tensor of ``model`` drawn from ``seed``: norm statistics near identity, weights
    scaled by 1/sqrt(fan-in), biases small."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, t in list(model.state_dict(keep_vars=True).items()):
            if name.endswith("num_batches_tracked"):
                continue
            if name.endswith("running_var"):
                t.copy_(torch.rand(t.shape, generator=g) + 0.5)
            elif name.endswith("running_mean") or name.endswith(".bias"):
                t.copy_(torch.randn(t.shape, generator=g) * 0.1)
            elif t.ndim == 1:
                t.copy_(torch.rand(t.shape, generator=g) + 0.5)
            else:
                t.copy_(torch.randn(t.shape, generator=g) / t[0].numel() ** 0.5)


def write_model(path: Path, seed: int = SEED):
    path = Path(path)
    model = build_reference(seed)
    model.save_pretrained(str(path))
    (path / "preprocessor_config.json").write_text(json.dumps(
        {"size": {"height": IMAGE, "width": IMAGE}, "do_resize": True, "do_rescale": True,
         "rescale_factor": 1 / 255, "image_mean": [0, 0, 0], "image_std": [1, 1, 1]}))
    return model


def pages() -> list[torch.Tensor]:
    """The suite's pages: [3, h, w] uint8 each."""
    g = torch.Generator().manual_seed(PAGE_SEED)
    return [torch.randint(0, 256, (3, h, w), generator=g, dtype=torch.uint8) for h, w in PAGE_SIZES]


def page_pixels(model_dir: Path) -> tuple[torch.Tensor, list[tuple[int, int]]]:
    """Our processor's pixels for the pages (the model dir's preprocessor config) and their sizes."""
    from .processor import DetectorImageProcessor, DetectorPreprocessorConfig
    proc = DetectorImageProcessor(DetectorPreprocessorConfig.from_model_dir(str(model_dir)))
    return proc.preprocess(pages())


def topk_gap(enc_outputs_class: torch.Tensor, k: int) -> float:
    """The smallest gap, over pages, between the encoder's k-th and k+1-th position scores (the
    max over classes of each position's logit, as the query selection ranks them)."""
    scores = enc_outputs_class.float().max(-1).values.sort(-1, descending=True).values
    return float((scores[:, k - 1] - scores[:, k]).min())
