"""The PP-DocLayout detectors' configs, read from the fields transformers' config.json holds
(its ``PPDocLayoutV3Config`` / ``PPDocLayoutV2Config`` with an ``hgnet_v2`` backbone sub-config).
``DetectorConfig`` is the RT-DETR-shaped detector both families share (backbone, hybrid encoder,
deformable decoder); ``PPDocLayoutV3Config`` adds V3's mask branch and pointer head (V2's config,
in models/pp_doclayout_v2/config.py, adds its reading-order network). The defaults are the
released architecture's (HGNetV2-L, d_model 256, 300 queries, 6 decoder layers)."""
from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any, ClassVar

from ..interface import CheckpointError, read_config_json

#: the released checkpoint's class names, by id (the config's default ``num_labels`` is 2, so the
#: built-in config names these 25)
RELEASED_LABELS = (
    "abstract", "algorithm", "aside_text", "chart", "content", "display_formula", "doc_title", "figure_title",
    "footer", "footer_image", "footnote", "formula_number", "header", "header_image", "image", "inline_formula",
    "number", "paragraph_title", "reference", "reference_content", "seal", "table", "text", "vertical_text",
    "vision_footnote")


@dataclass(frozen=True)
class BackboneConfig:
    """HGNetV2 (transformers' ``hgnet_v2`` config): a stem, then 4 stages of HG blocks."""
    num_channels: int = 3
    stem_channels: tuple[int, ...] = (3, 32, 48)
    stem_strides: tuple[int, ...] = (2, 1, 1, 2, 1)
    stage_in_channels: tuple[int, ...] = (48, 128, 512, 1024)
    stage_mid_channels: tuple[int, ...] = (48, 96, 192, 384)
    stage_out_channels: tuple[int, ...] = (128, 512, 1024, 2048)
    stage_num_blocks: tuple[int, ...] = (1, 1, 3, 1)
    stage_downsample: tuple[bool, ...] = (False, True, True, True)
    stage_downsample_strides: tuple[int, ...] = (2, 2, 2, 2)
    stage_light_block: tuple[bool, ...] = (False, False, True, True)
    stage_kernel_size: tuple[int, ...] = (3, 3, 5, 5)
    stage_numb_of_layers: tuple[int, ...] = (6, 6, 6, 6)
    hidden_act: str = "relu"
    use_learnable_affine_block: bool = False
    out_indices: tuple[int, ...] = (1, 2, 3, 4)     # stage1..stage4 (0 is the stem)


def pick_fields(klass, src: dict) -> dict:
    """The keys of ``src`` that are fields of the dataclass ``klass`` (lists as tuples; None
    values left to the field's default)."""
    out = {}
    for f in fields(klass):
        if f.name in src and src[f.name] is not None:
            v = src[f.name]
            out[f.name] = tuple(v) if isinstance(v, list) else v
    return out


@dataclass(frozen=True)
class DetectorConfig:
    """The detector both PP-DocLayout families share. Subclasses name their ``model_type`` and
    the backbone stages their checkpoint's config lists (``backbone_out_indices``)."""
    model_type: ClassVar[str] = ""
    backbone_out_indices: ClassVar[tuple[int, ...]] = ()
    #: sub-config fields built from their own config.json keys (``_sub_configs``), not picked by name
    sub_config_fields: ClassVar[tuple[str, ...]] = ("backbone", "labels")

    backbone: BackboneConfig = field(default_factory=BackboneConfig)
    encoder_hidden_dim: int = 256
    encoder_in_channels: tuple[int, ...] = (512, 1024, 2048)
    feat_strides: tuple[int, ...] = (8, 16, 32)
    encoder_layers: int = 1
    encoder_ffn_dim: int = 1024
    encoder_attention_heads: int = 8
    encode_proj_layers: tuple[int, ...] = (2,)
    positional_encoding_temperature: float = 10000.0
    encoder_activation_function: str = "gelu"
    activation_function: str = "silu"
    hidden_expansion: float = 1.0
    d_model: int = 256
    num_queries: int = 300
    decoder_in_channels: tuple[int, ...] = (256, 256, 256)
    decoder_ffn_dim: int = 1024
    num_feature_levels: int = 3
    decoder_n_points: int = 4
    decoder_layers: int = 6
    decoder_attention_heads: int = 8
    decoder_activation_function: str = "relu"
    anchor_image_size: tuple[int, int] | None = None
    layer_norm_eps: float = 1e-5
    batch_norm_eps: float = 1e-5
    labels: tuple[str, ...] = RELEASED_LABELS
    #: the fixed input the processor resizes every page to (transformers' processor: 800x800)
    image_size: tuple[int, int] = (800, 800)

    @property
    def num_labels(self) -> int:
        return len(self.labels)

    @classmethod
    def from_dict(cls, d: dict, source: str = "config"):
        kw = pick_fields(cls, d)
        for name in cls.sub_config_fields:
            kw.pop(name, None)
        kw.update(cls._sub_configs(d, source))
        cfg = cls(**kw)
        cfg.validate(source)
        return cfg

    @classmethod
    def _sub_configs(cls, d: dict, source: str) -> dict[str, Any]:
        """The ``sub_config_fields`` from ``d``: the backbone and the labels (id2label)."""
        kw: dict[str, Any] = {}
        bb = d.get("backbone_config") or {}
        if not isinstance(bb, dict):
            raise CheckpointError(f"{source}: backbone_config must be a mapping")
        if bb.get("model_type", "hgnet_v2") != "hgnet_v2":
            raise CheckpointError(f"{source}: backbone_config.model_type {bb.get('model_type')!r}: only hgnet_v2 is "
                                  "supported")
        kw["backbone"] = BackboneConfig(**({"out_indices": cls.backbone_out_indices} | pick_fields(BackboneConfig, bb)))
        id2label = d.get("id2label")
        if isinstance(id2label, dict) and id2label:
            try:
                ids = sorted(int(k) for k in id2label)
            except ValueError:
                raise CheckpointError(f"{source}: id2label keys must be integers") from None
            if ids != list(range(len(ids))):
                raise CheckpointError(f"{source}: id2label must number classes 0..{len(ids) - 1}")
            kw["labels"] = tuple(str(id2label[str(i)] if str(i) in id2label else id2label[i]) for i in ids)
        return kw

    @classmethod
    def from_model_dir(cls, model_dir: str):
        try:
            data, path = read_config_json(model_dir)
        except FileNotFoundError as e:
            raise CheckpointError(str(e)) from None
        if data.get("model_type") not in (None, cls.model_type):
            raise CheckpointError(f"{path}: model_type {data.get('model_type')!r} is not {cls.model_type}")
        # what this implementation does not build: refused by name rather than run wrongly
        for key, supported in (("learn_initial_query", False), ("normalize_before", False), ("eval_size", None)):
            if data.get(key, supported) != supported:
                raise CheckpointError(f"{path}: {key}={data[key]!r} is not supported (only {supported!r})")
        return cls.from_dict(data, source=str(path))

    def validate(self, source: str = "config") -> None:
        def bad(msg):
            raise CheckpointError(f"{source}: {msg}")
        if self.d_model % self.decoder_attention_heads:
            bad(f"d_model {self.d_model} is not divisible by decoder_attention_heads {self.decoder_attention_heads}")
        if self.encoder_hidden_dim % self.encoder_attention_heads:
            bad(f"encoder_hidden_dim {self.encoder_hidden_dim} is not divisible by encoder_attention_heads")
        if self.num_feature_levels != len(self.decoder_in_channels):
            bad(f"num_feature_levels {self.num_feature_levels} != len(decoder_in_channels) "
                f"{len(self.decoder_in_channels)} (extra levels are not supported)")
        if len(self.encoder_in_channels) != len(self.feat_strides):
            bad("encoder_in_channels and feat_strides differ in length")
        if self.backbone.use_learnable_affine_block:
            bad("backbone_config.use_learnable_affine_block is not supported")
        if self.backbone.out_indices != self.backbone_out_indices:
            bad(f"backbone_config.out_indices {list(self.backbone.out_indices)}: only "
                f"{list(self.backbone_out_indices)} is supported")
        if self.encoder_hidden_dim % 4:
            bad("encoder_hidden_dim must be divisible by 4 (2D sine position embedding)")


@dataclass(frozen=True)
class PPDocLayoutV3Config(DetectorConfig):
    """V3: the shared detector plus the encoder's mask prototypes (stride 4, so the backbone
    also hands over its first stage) and the decoder's GlobalPointer reading-order head."""
    model_type: ClassVar[str] = "pp_doclayout_v3"
    backbone_out_indices: ClassVar[tuple[int, ...]] = (1, 2, 3, 4)

    backbone: BackboneConfig = field(default_factory=lambda: BackboneConfig(out_indices=(1, 2, 3, 4)))
    mask_feature_channels: tuple[int, ...] = (64, 64)
    x4_feat_dim: int = 128
    num_prototypes: int = 32
    mask_enhanced: bool = True
    global_pointer_head_size: int = 64
