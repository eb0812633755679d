"""Loads what transformers' ``save_pretrained`` writes for PPDocLayoutV3ForObjectDetection: one
``model.safetensors`` (or shards with ``model.safetensors.index.json``), tensors named
``model.<module path>``, the decoder's class and box heads absent (tied to the encoder's).
The names match model.py's modules after the ``model.`` prefix, so a load is a checked copy
(``load_checked``, which PP-DocLayoutV2's loader shares)."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

from ..interface import CheckpointError
from .config import PPDocLayoutV3Config
from .model import PPDocLayoutV3

PREFIX = "model."
#: written by save_pretrained, not used by inference: the training-time denoising class
#: embedding and BatchNorm's step counters
UNUSED_SUFFIXES = (".num_batches_tracked",)
UNUSED_NAMES = ("model.denoising_class_embed.weight",)


@dataclass(frozen=True)
class DetectorLoadReport:
    model_dir: str | None
    files: tuple[str, ...]
    tensors_loaded: int
    tensors_ignored: int
    layout: str = "torch"
    layout_reason: str = "save_pretrained names"


def checkpoint_files(model_dir: str) -> list[Path]:
    d = Path(model_dir)
    index = d / "model.safetensors.index.json"
    if index.exists():
        try:
            names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (json.JSONDecodeError, KeyError) as e:
            raise CheckpointError(f"{index}: not a safetensors index ({e})") from None
        return [d / n for n in names]
    single = d / "model.safetensors"
    if not single.exists():
        raise CheckpointError(f"{model_dir}: no model.safetensors (or model.safetensors.index.json)")
    return [single]


def read_tensors(model_dir: str) -> tuple[dict[str, torch.Tensor], list[Path]]:
    from safetensors.torch import load_file
    files = checkpoint_files(model_dir)
    out: dict[str, torch.Tensor] = {}
    for f in files:
        if not f.exists():
            raise CheckpointError(f"{f}: listed in the index but missing")
        out.update(load_file(str(f)))
    return out, files


def build_model(cfg: PPDocLayoutV3Config) -> PPDocLayoutV3:
    return PPDocLayoutV3(cfg).eval()


def load_detector(model_dir: str | None, *, dtype: torch.dtype, device: torch.device,
                  cfg: PPDocLayoutV3Config, seed: int = 0) -> tuple[PPDocLayoutV3, DetectorLoadReport]:
    """The detector with the checkpoint's weights (random ones, seeded, when ``model_dir`` is None)."""
    return load_checked(build_model, model_dir, dtype=dtype, device=device, cfg=cfg, seed=seed, prefix=PREFIX,
                        unused=lambda name: name in UNUSED_NAMES or name.endswith(UNUSED_SUFFIXES),
                        family="PP-DocLayoutV3")


def load_checked(build: Callable[[Any], torch.nn.Module], model_dir: str | None, *, dtype: torch.dtype,
                 device: torch.device, cfg: Any, seed: int, prefix: str, unused: Callable[[str], bool],
                 family: str) -> tuple[torch.nn.Module, DetectorLoadReport]:
    """A detector family's checked load (both PP-DocLayout families): ``build(cfg)``, then every
    written tensor either ``unused`` (counted as ignored) or, ``prefix`` stripped, one of the
    module's own with its shape; none of the module's missing. Random weights (seeded, norms
    with trained-like statistics) when ``model_dir`` is None."""
    torch.manual_seed(seed)
    model = build(cfg)
    if model_dir is None:
        _randomize_norms(model)
        return model.to(device=device, dtype=dtype), DetectorLoadReport(None, (), 0, 0, "dummy", "random weights")
    tensors, files = read_tensors(model_dir)
    expected = model.state_dict()
    ignored = 0
    loaded: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        if unused(name):
            ignored += 1
            continue
        if not name.startswith(prefix) or name[len(prefix):] not in expected:
            raise CheckpointError(f"{model_dir}: unexpected tensor {name!r} (not a {family} parameter at "
                                  "this config)")
        key = name[len(prefix):]
        if tuple(t.shape) != tuple(expected[key].shape):
            raise CheckpointError(f"{model_dir}: tensor {name!r} has shape {list(t.shape)}, the config gives "
                                  f"{list(expected[key].shape)}")
        loaded[key] = t
    missing = sorted(set(expected) - set(loaded))
    if missing:
        raise CheckpointError(f"{model_dir}: {len(missing)} tensors missing, e.g. {', '.join(prefix + m for m in missing[:3])}")
    model.load_state_dict(loaded, strict=True)
    return (model.to(device=device, dtype=dtype),
            DetectorLoadReport(str(model_dir), tuple(str(f) for f in files), len(loaded), ignored))


def _randomize_norms(model: torch.nn.Module) -> None:
    """Random weights that behave like trained ones (non-degenerate norm statistics), so a dummy
    run exercises every path: BatchNorm statistics near identity."""
    from .model import BatchNorm
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, BatchNorm):
                m.running_var.uniform_(0.5, 1.5)
                m.running_mean.normal_(0, 0.1)
