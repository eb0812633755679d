"""PaddleOCR-VL model configuration as typed dataclasses.

Reads config.json in both shapes seen in the wild: transformers 5 (`vision_config` +
`text_config`) and the released checkpoint (text fields at the top level). Only the fields the
runtime uses are kept; everything else in config.json is ignored on purpose.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path


@dataclass(frozen=True)
class VisionConfig:
    hidden_size: int = 1152
    intermediate_size: int = 4304
    num_hidden_layers: int = 27
    num_attention_heads: int = 16
    num_channels: int = 3
    patch_size: int = 14
    image_size: int = 384
    layer_norm_eps: float = 1e-6
    hidden_act: str = "gelu_pytorch_tanh"
    spatial_merge_size: int = 2
    rope_theta: float = 10000.0

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def num_grid_per_side(self) -> int:
        return self.image_size // self.patch_size

    def validate(self) -> None:
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(
                f"vision hidden_size {self.hidden_size} is not divisible by num_attention_heads "
                f"{self.num_attention_heads}")
        if self.head_dim % 4:
            raise ValueError(f"vision head_dim {self.head_dim} must be divisible by 4 for the 2D rotary")
        if self.hidden_act not in ("gelu_pytorch_tanh", "gelu"):
            raise ValueError(f"unsupported vision hidden_act {self.hidden_act!r}")


@dataclass(frozen=True)
class TextConfig:
    hidden_size: int = 1024
    intermediate_size: int = 3072
    num_hidden_layers: int = 18
    num_attention_heads: int = 16
    num_key_value_heads: int = 2
    head_dim: int = 128
    vocab_size: int = 103424
    rms_norm_eps: float = 1e-5
    rope_theta: float = 500000.0
    mrope_section: tuple[int, ...] = (16, 24, 24)
    tie_word_embeddings: bool = True


@dataclass(frozen=True)
class PaddleOCRVLConfig:
    vision: VisionConfig = field(default_factory=VisionConfig)
    text: TextConfig = field(default_factory=TextConfig)
    projector_eps: float = 1e-5
    image_token_id: int = 100295
    vision_start_token_id: int = 101305
    vision_end_token_id: int = 101306
    bos_token_id: int = 1
    eos_token_id: int = 2
    pad_token_id: int = 0

    @classmethod
    def from_dict(cls, d: dict) -> "PaddleOCRVLConfig":
        vd = dict(d.get("vision_config") or {})
        td = dict(d.get("text_config") or {})
        if not td:  # released checkpoints keep the text fields at the top level
            td = {k: v for k, v in d.items() if k != "vision_config"}
        rope_v = vd.get("rope_parameters") or {}
        vision = VisionConfig(
            **{k: vd[k] for k in VisionConfig.__dataclass_fields__ if k in vd and k != "rope_theta"},
            rope_theta=float(rope_v.get("rope_theta", vd.get("rope_theta", 10000.0))),
        )
        vision.validate()
        rope_t = td.get("rope_parameters") or td.get("rope_scaling") or {}
        text_kw = {k: td[k] for k in TextConfig.__dataclass_fields__
                   if k in td and k not in ("rope_theta", "mrope_section", "head_dim", "tie_word_embeddings")}
        text = TextConfig(
            **text_kw,
            head_dim=int(td.get("head_dim") or td.get("hidden_size", 1024) // td.get("num_attention_heads", 16)),
            rope_theta=float(rope_t.get("rope_theta", td.get("rope_theta", 500000.0))),
            mrope_section=tuple(rope_t.get("mrope_section", (16, 24, 24))),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", td.get("tie_word_embeddings", True))),
        )
        ids = {k: d[k] for k in ("image_token_id", "vision_start_token_id", "vision_end_token_id") if k in d}
        for k in ("bos_token_id", "eos_token_id", "pad_token_id"):   # top level (released) or text_config
            v = d.get(k, td.get(k))
            if isinstance(v, list):     # eos may be a list; the first is the end-of-sequence token
                v = v[0] if v else None
            if v is not None:
                ids[k] = int(v)
        return cls(vision=vision, text=text, **ids)

    @classmethod
    def from_model_dir(cls, model_dir: str | Path) -> "PaddleOCRVLConfig":
        from ..interface import read_config_json
        return cls.from_dict(read_config_json(model_dir)[0])

    def to_dict(self) -> dict:
        return asdict(self)
