"""PP-DocLayoutV2's config, read from transformers' ``PPDocLayoutV2Config`` fields: the shared
detector (pp_doclayout_v3/config.py DetectorConfig; no mask branch, the backbone hands over
stages 2-4 only), the per-class score thresholds that pick the boxes the reading-order network
sees, the class order that relabels them, and that network's own config
(``reading_order_config``: transformers' ``PPDocLayoutV2ReadingOrderConfig``)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

from ..interface import CheckpointError
from ..pp_doclayout_v3.config import BackboneConfig, DetectorConfig, pick_fields


@dataclass(frozen=True)
class ReadingOrderConfig:
    """The reading-order network: a LayoutLMv3-style encoder over [start, boxes..., end] whose
    attention carries a pairwise box-relation bias, ending in a GlobalPointer head."""
    hidden_size: int = 512
    num_attention_heads: int = 8
    intermediate_size: int = 2048
    num_hidden_layers: int = 6
    hidden_act: str = "gelu"
    layer_norm_eps: float = 1e-5
    max_position_embeddings: int = 514
    max_2d_position_embeddings: int = 1024
    type_vocab_size: int = 1
    vocab_size: int = 4
    start_token_id: int = 0
    pad_token_id: int = 1
    end_token_id: int = 2
    pred_token_id: int = 3
    coordinate_size: int = 171
    shape_size: int = 170
    num_classes: int = 20
    relation_bias_embed_dim: int = 16
    relation_bias_theta: float = 10000.0
    relation_bias_scale: float = 100.0
    global_pointer_head_size: int = 64
    has_spatial_attention_bias: bool = True
    has_relative_attention_bias: bool = False
    rel_2d_pos_bins: int = 64


def _default_thresholds() -> tuple[float, ...]:
    return (0.5,) * 25


def _default_class_order() -> tuple[int, ...]:
    # no checkpoint is available here: the built-in (dummy-weights) config folds the 25 detector
    # classes onto the network's 20 reading-order classes; a checkpoint's config.json gives its own
    return tuple(i % ReadingOrderConfig.num_classes for i in range(25))


@dataclass(frozen=True)
class PPDocLayoutV2Config(DetectorConfig):
    model_type: ClassVar[str] = "pp_doclayout_v2"
    backbone_out_indices: ClassVar[tuple[int, ...]] = (2, 3, 4)
    sub_config_fields: ClassVar[tuple[str, ...]] = ("backbone", "labels", "reading_order")

    backbone: BackboneConfig = field(default_factory=lambda: BackboneConfig(out_indices=(2, 3, 4)))
    #: per detector class: the score (sigmoid of its best class logit) a query needs to enter the
    #: reading-order network
    class_thresholds: tuple[float, ...] = field(default_factory=_default_thresholds)
    #: per detector class: the reading-order network's class id for it
    class_order: tuple[int, ...] = field(default_factory=_default_class_order)
    reading_order: ReadingOrderConfig = field(default_factory=ReadingOrderConfig)

    @classmethod
    def _sub_configs(cls, d: dict, source: str) -> dict[str, Any]:
        kw = super()._sub_configs(d, source)
        ro = d.get("reading_order_config") or {}
        if not isinstance(ro, dict):
            raise CheckpointError(f"{source}: reading_order_config must be a mapping")
        kw["reading_order"] = ReadingOrderConfig(**pick_fields(ReadingOrderConfig, ro))
        for key in ("class_thresholds", "class_order"):
            if d.get(key) is None:
                # transformers' default is None, with which its forward cannot run: refuse by name
                raise CheckpointError(f"{source}: {key} is missing (PP-DocLayoutV2 needs one entry per class)")
        return kw

    def validate(self, source: str = "config") -> None:
        super().validate(source)

        def bad(msg):
            raise CheckpointError(f"{source}: {msg}")
        ro = self.reading_order
        for key in ("class_thresholds", "class_order"):
            if len(getattr(self, key)) != self.num_labels:
                bad(f"{key} has {len(getattr(self, key))} entries for {self.num_labels} classes")
        if not all(0.0 <= float(t) <= 1.0 for t in self.class_thresholds):
            bad("class_thresholds must be scores in [0, 1]")
        if not all(isinstance(c, int) and 0 <= c < ro.num_classes for c in self.class_order):
            bad(f"class_order entries must be reading-order class ids in [0, {ro.num_classes})")
        if ro.hidden_size % ro.num_attention_heads:
            bad(f"reading_order_config.hidden_size {ro.hidden_size} is not divisible by num_attention_heads "
                f"{ro.num_attention_heads}")
        if not ro.has_spatial_attention_bias:
            bad("reading_order_config.has_spatial_attention_bias=False is not supported (the 1D relative bias is "
                "not built)")
        # positions run to num_queries + 2 (the end token after every query); boxes to 1000
        if ro.max_position_embeddings < self.num_queries + 3:
            bad(f"reading_order_config.max_position_embeddings {ro.max_position_embeddings} < num_queries + 3 "
                f"({self.num_queries + 3})")
        if ro.max_2d_position_embeddings <= 1000:
            bad("reading_order_config.max_2d_position_embeddings must exceed 1000 (boxes are on a 0..1000 grid)")
        if ro.relation_bias_embed_dim % 2:
            bad("reading_order_config.relation_bias_embed_dim must be even (sin and cos halves)")
