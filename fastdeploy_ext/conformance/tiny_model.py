"""Tiny random PaddleOCR-VL checkpoints written by transformers' save_pretrained (torch layout)
and their Paddle-layout twins, the test images, plus the transformers reference for the vision
path. make_references.py ships their outputs as package data; the suite reads those.

Tiny but faithful where kernels care: vision head_dim is 72 like the released model (2 heads of
72), the merge is 2x2, the position grid is resampled. write_torch_model and
reference_image_features need transformers (the `test` extra); the twin and the images do not.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch

TINY_VISION = dict(hidden_size=144, intermediate_size=200, num_hidden_layers=2, num_attention_heads=2,
                   image_size=84, patch_size=14)
TINY_TEXT = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=1, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16, vocab_size=256)
TINY_PREPROCESSOR = {"min_pixels": 28 * 28, "max_pixels": 28 * 28 * 64, "image_mean": [0.5, 0.5, 0.5],
                     "image_std": [0.5, 0.5, 0.5], "patch_size": 14, "merge_size": 2, "temporal_patch_size": 1}


def hf_config():
    from transformers import PaddleOCRVLConfig
    return PaddleOCRVLConfig(vision_config=dict(TINY_VISION), text_config=dict(TINY_TEXT))


def write_torch_model(path: str | Path, seed: int = 0, dtype: torch.dtype = torch.float32) -> Path:
    """save_pretrained of a random tiny PaddleOCRVLForConditionalGeneration, weights stored in
    ``dtype`` (the shipped references use bfloat16: half the bytes, and every value is still
    exact when loaded in fp32)."""
    from transformers import PaddleOCRVLForConditionalGeneration
    path = Path(path)
    torch.manual_seed(seed)
    model = PaddleOCRVLForConditionalGeneration(hf_config()).eval()
    # Random init leaves norms at 1/0 and biases at 0; perturb them so a wrong mapping shows.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim == 1:
                p.add_(torch.randn_like(p) * 0.1)
            if "position_embedding" in name:
                p.normal_(0, 0.5)
    model.to(dtype).save_pretrained(path)
    (path / "preprocessor_config.json").write_text(json.dumps(TINY_PREPROCESSOR, indent=1))
    return path


# Sizes that need no resize under TINY_PREPROCESSOR (multiples of 28 within its pixel range), so
# transformers' two resize backends agree: (width, height)
TINY_IMAGE_SIZES = ((112, 56), (56, 84), (28, 28), (84, 140))


def write_images(path: str | Path, seed: int = 1) -> list[Path]:
    """Random RGB PNGs of TINY_IMAGE_SIZES (Pillow only)."""
    from PIL import Image
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(seed)
    out = []
    for i, (w, h) in enumerate(TINY_IMAGE_SIZES):
        arr = (torch.rand(h, w, 3, generator=g) * 255).to(torch.uint8).numpy()
        p = path / f"img{i}.png"
        Image.fromarray(arr).save(p)
        out.append(p)
    return out


def _is_linear_weight(name: str, t: torch.Tensor) -> bool:
    return t.ndim == 2 and name.endswith(".weight") and "embed" not in name


def write_paddle_twin(src: str | Path, dst: str | Path, shards: int = 2) -> Path:
    """The same weights in Paddle layout (every Linear weight [in, out]), sharded, with the
    preprocessor config in its `size` form — as PaddleX/FastDeploy exports look."""
    from safetensors.torch import load_file, save_file
    src, dst = Path(src), Path(dst)
    dst.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for f in sorted(src.glob("*.safetensors")):
        tensors.update(load_file(str(f)))
    tensors = {k: (v.t().contiguous() if _is_linear_weight(k, v) else v) for k, v in tensors.items()}
    names = sorted(tensors)
    weight_map = {}
    for i in range(shards):
        fname = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        part = {k: tensors[k] for k in names[i::shards]}
        save_file(part, str(dst / fname), metadata={"format": "pt"})
        weight_map.update({k: fname for k in part})
    (dst / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    cfg = json.loads((src / "config.json").read_text())
    cfg["torch_dtype"] = cfg.pop("dtype", "float32")
    (dst / "config.json").write_text(json.dumps(cfg, indent=1))
    pp = dict(TINY_PREPROCESSOR)
    pp["size"] = {"shortest_edge": pp.pop("min_pixels"), "longest_edge": pp.pop("max_pixels")}
    (dst / "preprocessor_config.json").write_text(json.dumps(pp, indent=1))
    return dst


def reference_image_features(model_dir: str | Path, pixel_values: torch.Tensor, grid_thw: list,
                             dtype: torch.dtype = torch.float32, device: str = "cpu") -> list[torch.Tensor]:
    """transformers' `model.model.get_image_features(...).pooler_output` — the contract for encode."""
    from transformers import PaddleOCRVLForConditionalGeneration
    model = PaddleOCRVLForConditionalGeneration.from_pretrained(str(model_dir), dtype=dtype).to(device).eval()
    with torch.inference_mode():
        out = model.model.get_image_features(
            pixel_values.to(device, dtype), torch.tensor(grid_thw, dtype=torch.int64, device=device))
    return [t.float().cpu() for t in out.pooler_output]
