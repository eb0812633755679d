"""toy_vlm checkpoints: one ``model.safetensors`` whose tensors are named as the modules'
parameters, prefixed ``vision.`` (ToyVision) and ``text.`` (ToyDecoder), torch layout only
(Linear [out, in]); and the writer tests use to build one (tests build tiny models themselves).
"""
from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from fastdeploy_ext.models.checkpoint_checks import check_state_dict
from fastdeploy_ext.models.interface import CheckpointError

from .config import ToyConfig
from .text import ToyDecoder
from .vision import ToyVision

log = logging.getLogger(__name__)

WEIGHTS = "model.safetensors"
PREFIX = {"vision": "vision.", "text": "text."}


@dataclass(frozen=True)
class LoadReport:
    model_dir: str | None
    files: tuple[str, ...]
    layout: str
    layout_reason: str
    tensors_loaded: int


def random_init(model: nn.Module, seed: int, scale: float = 0.2) -> nn.Module:
    """Weights large enough that greedy decoding depends on its inputs (an init of 0.02 makes a
    tiny decoder repeat one token); norms near 1 and biases near 0, perturbed so that a wrong
    mapping of any tensor shows."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            if name.endswith("norm.weight") or name.endswith("norm1.weight") or name.endswith("norm2.weight"):
                p.copy_(1 + 0.1 * noise)
            elif p.ndim == 1:
                p.copy_(0.1 * noise)
            else:
                p.copy_(scale * noise)
    return model


def build(part: str, cfg: ToyConfig) -> nn.Module:
    return ToyVision(cfg) if part == "vision" else ToyDecoder(cfg)


def write_checkpoint(path: str | Path, cfg: ToyConfig | None = None, *, seed: int = 0,
                     dtype: torch.dtype = torch.float32) -> Path:
    """A model dir: config.json and model.safetensors with random weights (``seed``)."""
    from safetensors.torch import save_file
    cfg = cfg or ToyConfig()
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for i, part in enumerate(("vision", "text")):
        model = random_init(build(part, cfg), seed * 2 + i)
        tensors.update({PREFIX[part] + k: v.to(dtype).contiguous() for k, v in model.state_dict().items()})
    save_file(tensors, str(path / WEIGHTS), metadata={"format": "pt"})
    (path / "config.json").write_text(json.dumps(cfg.to_json(), indent=1))
    return path


def read_tensors(model_dir: str | Path, part: str) -> dict[str, torch.Tensor]:
    """``part``'s tensors of the checkpoint, without the prefix."""
    from safetensors import SafetensorError, safe_open
    f = Path(model_dir) / WEIGHTS
    if not f.is_file():
        raise CheckpointError(f"{model_dir}: no {WEIGHTS}")
    pre = PREFIX[part]
    try:
        with safe_open(str(f), framework="pt") as h:
            return {k[len(pre):]: h.get_tensor(k) for k in h.keys() if k.startswith(pre)}
    except (SafetensorError, OSError, RuntimeError) as e:
        raise CheckpointError(f"{f}: cannot read safetensors file ({e})") from None


def load(part: str, model_dir: str | Path | None, cfg: ToyConfig, *, dtype: torch.dtype, device: torch.device,
         model_format: str = "auto", seed: int = 0) -> tuple[nn.Module, LoadReport]:
    """``part`` ("vision" or "text") from ``model_dir``, or random weights when it is None."""
    if model_format == "paddle":
        raise CheckpointError("toy_vlm checkpoints exist in torch layout only; --model-format paddle cannot load one")
    if model_dir is None:
        model = random_init(build(part, cfg), seed * 2 + (part == "text")).to(device=device, dtype=dtype).eval()
        return model, LoadReport(None, (), "random", "--load-format dummy: random weights",
                                 sum(1 for _ in model.parameters()))
    with torch.device("meta"):
        model = build(part, cfg)
    tensors = read_tensors(model_dir, part)
    expected = model.state_dict()
    check_state_dict(expected, tensors, model_dir, lambda name: PREFIX[part] + name)
    model.load_state_dict({k: v.to(dtype) for k, v in tensors.items()}, assign=True, strict=True)
    if part == "vision":     # the merge order is computed, not loaded: rebuild it off the meta device
        from .vision import merge_order
        model.order = merge_order(cfg.grid_side, cfg.merge)
    model = model.to(device)
    report = LoadReport(str(model_dir), (str(Path(model_dir) / WEIGHTS),), "torch",
                        "toy_vlm checkpoints are torch layout", len(tensors))
    log.info("toy_vlm %s: %d tensors from %s", part, len(tensors), model_dir)
    return model.eval(), report
