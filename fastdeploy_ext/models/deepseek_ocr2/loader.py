"""DeepSeek-OCR-2 checkpoints: DeepSeek's tensor names, which transformers' ``save_pretrained`` keeps.

A model dir holds ``model.safetensors`` or shards listed by ``model.safetensors.index.json``.
Names (as the release and ``save_pretrained`` write them) -> our modules:

- ``model.sam_model.*`` -> ``vision.sam.*`` (blocks, patch_embed.proj, pos_embed, neck.0-3, net_2, net_3)
- ``model.qwen2_model.model.model.*`` -> ``vision.encoder.*``; ``model.qwen2_model.query_1024/768``
- ``model.projector.layers.*`` -> ``vision.projector.*``; ``model.view_seperator`` (sic)
- ``model.embed_tokens``, ``model.layers.N.*``, ``model.norm``, ``lm_head`` -> the decoder; the
  routed experts are stored one by one (``mlp.experts.E.{gate,up,down}_proj``) and stacked here.

Every expected tensor must be present with the shape the config implies; a missing, unexpected
or misshapen one is a CheckpointError naming it.
"""
from __future__ import annotations

import json
import logging
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from ..checkpoint_checks import check_state_dict
from ..interface import CheckpointError
from .config import DeepseekOCR2Config

log = logging.getLogger(__name__)

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"

VISION_RENAMES = (("model.sam_model.", "sam."), ("model.qwen2_model.model.model.", "encoder."),
                  ("model.qwen2_model.", ""), ("model.projector.layers.", "projector."),
                  ("model.view_seperator", "view_separator"))
TEXT_RENAMES = (("model.", ""), ("lm_head.", "lm_head."))
EXPERT = re.compile(r"^layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate|up|down)_proj\.weight$")


@dataclass(frozen=True)
class LoadReport:
    model_dir: str | None
    files: tuple[str, ...]
    layout: str
    layout_reason: str
    tensors_loaded: int


def weight_files(model_dir: str | Path) -> list[Path]:
    d = Path(model_dir)
    if (d / INDEX).is_file():
        try:
            names = sorted(set(json.loads((d / INDEX).read_text())["weight_map"].values()))
        except (json.JSONDecodeError, KeyError, AttributeError) as e:
            raise CheckpointError(f"{d / INDEX}: not a safetensors index ({e})") from None
        files = [d / n for n in names]
        for f in files:
            if not f.is_file():
                raise CheckpointError(f"{d / INDEX} lists {f.name}, which is missing")
        return files
    if (d / SINGLE).is_file():
        return [d / SINGLE]
    raise CheckpointError(f"{d}: no {SINGLE} or {INDEX}")


def part_of(name: str) -> str:
    return "vision" if name.startswith(("model.sam_model.", "model.qwen2_model.", "model.projector.",
                                        "model.view_seperator")) else "text"


def rename(name: str, part: str) -> str:
    for old, new in (VISION_RENAMES if part == "vision" else TEXT_RENAMES):
        if name.startswith(old):
            return new + name[len(old):]
    return name


def read_part(model_dir: str | Path, part: str) -> tuple[dict[str, torch.Tensor], list[Path]]:
    """``part``'s tensors under our names (experts still one by one)."""
    from safetensors import SafetensorError, safe_open
    files = weight_files(model_dir)
    out: dict[str, torch.Tensor] = {}
    for f in files:
        try:
            with safe_open(str(f), framework="pt") as h:
                for k in h.keys():
                    if part_of(k) == part:
                        out[rename(k, part)] = h.get_tensor(k)
        except (SafetensorError, OSError, RuntimeError) as e:
            raise CheckpointError(f"{f}: cannot read safetensors file ({e})") from None
    return out, files


def stack_experts(tensors: dict[str, torch.Tensor], cfg: DeepseekOCR2Config, source: str) -> dict[str, torch.Tensor]:
    """experts.E.{gate,up,down}_proj -> mlp.gate_up [E, 2I, H] (gate rows first) and mlp.down [E, H, I]."""
    per: dict[int, dict[int, dict[str, torch.Tensor]]] = {}
    out = {}
    for k, v in tensors.items():
        m = EXPERT.match(k)
        if m:
            per.setdefault(int(m[1]), {}).setdefault(int(m[2]), {})[m[3]] = v
        else:
            out[k] = v
    n = cfg.text.n_routed_experts
    for layer, experts in per.items():
        for e in range(n):
            have = experts.get(e, {})
            for w in ("gate", "up", "down"):
                if w not in have:
                    raise CheckpointError(f"{source}: tensor model.layers.{layer}.mlp.experts.{e}.{w}_proj.weight is "
                                          f"missing from the checkpoint")
        extra = sorted(set(experts) - set(range(n)))
        if extra:
            raise CheckpointError(f"{source}: unexpected tensor model.layers.{layer}.mlp.experts.{extra[0]}.* "
                                  f"(config.json has {n} routed experts)")
        try:
            out[f"layers.{layer}.mlp.gate_up"] = torch.stack([torch.cat([experts[e]["gate"], experts[e]["up"]])
                                                              for e in range(n)])
            out[f"layers.{layer}.mlp.down"] = torch.stack([experts[e]["down"] for e in range(n)])
        except RuntimeError as err:
            raise CheckpointError(f"{source}: layer {layer}'s experts have inconsistent shapes ({err})") from None
    return out


def original_name(ours: str, part: str) -> str:
    """The checkpoint's name of one of our tensors (for error messages)."""
    for old, new in (VISION_RENAMES if part == "vision" else TEXT_RENAMES):
        if new and ours.startswith(new):
            return old + ours[len(new):]
    if part == "vision" and ours.startswith("query_"):
        return "model.qwen2_model." + ours
    return ours if ours.startswith("lm_head") else "model." + ours


def build(part: str, cfg: DeepseekOCR2Config) -> nn.Module:
    if part == "vision":
        from .vision import DeepseekOCR2Vision
        return DeepseekOCR2Vision(cfg)
    from .text import DeepseekOCR2Decoder
    return DeepseekOCR2Decoder(cfg.text)


def keep_dtype(name: str, dtype: torch.dtype) -> torch.dtype:
    """The router stays fp32 (it runs in fp32: a bf16 copy of its weights moves near-tied top-k
    choices, and one flipped expert moves a token's output far more than rounding does)."""
    return torch.float32 if name.endswith("mlp.gate.weight") else dtype


def random_init(model: nn.Module, seed: int, scale: float = 0.05) -> nn.Module:
    """Random weights for ``--load-format dummy``: norms near 1, the rest small normal noise."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            if re.search(r"(norm\d?|layernorm|neck\.[13])\.weight$", name):
                p.copy_(1 + 0.1 * noise)
            elif p.ndim == 1:
                p.copy_(0.02 * noise)
            else:
                p.copy_(scale * noise)
    return model


def load(part: str, model_dir: str | Path | None, cfg: DeepseekOCR2Config, *, dtype: torch.dtype,
         device: torch.device, model_format: str = "auto", seed: int = 0) -> tuple[nn.Module, LoadReport]:
    """``part`` ("vision" or "text") from ``model_dir``, or random weights when it is None."""
    if model_format == "paddle":
        raise CheckpointError("DeepSeek-OCR-2 checkpoints exist in torch layout only; --model-format paddle "
                              "cannot load one")
    if model_dir is None:
        with torch.device(device):
            model = build(part, cfg)
        model = random_init(model, seed * 2 + (part == "text"))
        for name, p in model.named_parameters():
            p.data = p.data.to(keep_dtype(name, dtype))
        model = model.eval()
        return model, LoadReport(None, (), "random", "--load-format dummy: random weights",
                                 sum(1 for _ in model.parameters()))
    source = str(model_dir)
    tensors, files = read_part(model_dir, part)
    if part == "text":
        tensors = stack_experts(tensors, cfg, source)
    with torch.device("meta"):
        model = build(part, cfg)
    expected = model.state_dict()
    check_state_dict(expected, tensors, source, lambda name: original_name(name, part))
    model.load_state_dict({k: v.to(keep_dtype(k, dtype)) for k, v in tensors.items()}, assign=True, strict=True)
    model = model.to(device).eval()
    log.info("deepseek_ocr2 %s: %d tensors from %s", part, len(tensors), source)
    return model, LoadReport(source, tuple(str(f) for f in files), "torch",
                             "DeepSeek-OCR-2 checkpoints are torch layout (DeepSeek's tensor names)", len(tensors))
