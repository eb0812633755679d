"""PP-DocLayoutV3 (the layout detector PaddleOCR-VL-1.5/1.6 pair with) behind the detector
interface (models/interface.py DetectorFamily). Registered as ``pp_doclayout_v3`` under
``fastdeploy_ext.models``."""
from __future__ import annotations

from typing import ClassVar

from ...plan import Component, ComponentKind
from ..interface import DetectorFamily
from .config import PPDocLayoutV3Config


class PPDocLayoutV3Family(DetectorFamily):
    name: ClassVar[str] = "pp_doclayout_v3"
    model_types: ClassVar[tuple[str, ...]] = ("pp_doclayout_v3",)

    def default_config(self) -> PPDocLayoutV3Config:
        return PPDocLayoutV3Config()

    def read_config(self, model_dir: str) -> PPDocLayoutV3Config:
        return PPDocLayoutV3Config.from_model_dir(model_dir)

    def components(self, cfg: PPDocLayoutV3Config) -> tuple[Component, ...]:
        # the decoder's cross-attention samples the multi-scale maps (deformable); the hybrid
        # encoder's AIFI layer attends within one feature map per page (dense: every page the
        # same length)
        heads, aifi_heads = cfg.decoder_attention_heads, cfg.encoder_attention_heads
        return (Component("decoder.cross_attention", ComponentKind.DEFORMABLE_ATTENTION, cfg.d_model // heads, heads),
                Component("encoder.aifi_attention", ComponentKind.DENSE_ATTENTION,
                          cfg.encoder_hidden_dim // aifi_heads, aifi_heads))

    def load_detector(self, model_dir, *, dtype, device, cfg):
        from .loader import load_detector
        return load_detector(model_dir, dtype=dtype, device=device, cfg=cfg)

    def image_processor(self, model_dir, cfg):
        from .processor import DetectorImageProcessor, DetectorPreprocessorConfig
        return DetectorImageProcessor(DetectorPreprocessorConfig.from_model_dir(model_dir))

    def label_names(self, cfg: PPDocLayoutV3Config) -> tuple[str, ...]:
        return cfg.labels

    def conformance_fixture(self, workdir: str):
        from .conformance import PPDocLayoutV3Conformance
        return PPDocLayoutV3Conformance(workdir)

    def transformers_reference(self, model_dir, model, cfg):
        """transformers' model with the same weights (bench detect's reference; needs transformers)."""
        from .reference import transformers_reference
        return transformers_reference(model_dir, model, cfg)

    def postprocess(self, cfg, outputs, sizes, *, threshold):
        from .postprocess import detections
        return detections(outputs.logits, outputs.pred_boxes, outputs.order_logits, sizes, cfg.labels,
                          threshold=threshold)
