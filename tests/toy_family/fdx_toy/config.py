"""toy_vlm's config.json as a typed dataclass.

Every image is resized to ``image_size`` x ``image_size`` and cut into patches of
``patch_size``: a fixed grid of (image_size / patch_size)^2 patches, merged ``merge`` x
``merge`` into a fixed number of embeddings per image (32 px, patches of 8, 2x2 merge: 16
patches -> 4 embeddings). The decoder uses 1D rope over the token index.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, fields
from pathlib import Path

from fastdeploy_ext.models.interface import CheckpointError

MODEL_TYPE = "toy_vlm"


@dataclass(frozen=True)
class ToyConfig:
    # vision: fixed-size patch encoder
    image_size: int = 32
    patch_size: int = 8
    num_channels: int = 3
    merge: int = 2
    vision_hidden_size: int = 32
    vision_num_heads: int = 2            # head_dim 16
    vision_num_layers: int = 1
    vision_intermediate_size: int = 64
    layer_norm_eps: float = 1e-6
    # text: decoder with 1D rope and GQA
    hidden_size: int = 64
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 16
    num_hidden_layers: int = 2
    intermediate_size: int = 96
    vocab_size: int = 264                # 4 special ids + 256 bytes + 4 spare
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    # special ids: the byte tokenizer's bytes start after them (tokenizer.py)
    pad_token_id: int = 0
    bos_token_id: int = 1
    eos_token_id: int = 2
    image_token_id: int = 3

    @property
    def grid_side(self) -> int:
        return self.image_size // self.patch_size

    @property
    def patches_per_image(self) -> int:
        return self.grid_side ** 2

    @property
    def embeddings_per_image(self) -> int:
        return self.patches_per_image // self.merge ** 2

    @property
    def patch_dim(self) -> int:
        return self.num_channels * self.patch_size ** 2

    @property
    def vision_head_dim(self) -> int:
        return self.vision_hidden_size // self.vision_num_heads

    @property
    def grid(self) -> tuple[int, int, int]:
        """The one (t, h, w) patch grid every image has."""
        return (1, self.grid_side, self.grid_side)

    def validate(self, source: str = "config") -> "ToyConfig":
        problems = []
        if self.image_size % self.patch_size:
            problems.append(f"image_size {self.image_size} is not a multiple of patch_size {self.patch_size}")
        elif self.grid_side % self.merge:
            problems.append(f"the patch grid side {self.grid_side} is not a multiple of merge {self.merge}")
        if self.vision_hidden_size % self.vision_num_heads:
            problems.append(f"vision_hidden_size {self.vision_hidden_size} is not divisible by vision_num_heads")
        if self.num_attention_heads % self.num_key_value_heads:
            problems.append("num_attention_heads must be a multiple of num_key_value_heads")
        if self.head_dim % 2:
            problems.append(f"head_dim {self.head_dim} must be even (rope rotates pairs)")
        if problems:
            raise CheckpointError(f"{source}: " + "; ".join(problems))
        return self

    @classmethod
    def from_dict(cls, d: dict, source: str = "config") -> "ToyConfig":
        names = {f.name for f in fields(cls)}
        kw = {k: v for k, v in d.items() if k in names}
        return cls(**kw).validate(source)

    @classmethod
    def from_model_dir(cls, model_dir: str | Path) -> "ToyConfig":
        path = Path(model_dir) / "config.json"
        if not path.is_file():
            raise FileNotFoundError(f"{path}: no config.json in the model directory")
        try:
            data = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}: not valid JSON ({e})") from None
        if data.get("model_type") != MODEL_TYPE:
            raise CheckpointError(f"{path}: model_type {data.get('model_type')!r}, expected {MODEL_TYPE!r}")
        return cls.from_dict(data, str(path))

    def to_json(self) -> dict:
        return {"model_type": MODEL_TYPE, **asdict(self)}
