"""PP-DocLayoutV2 (the layout detector the original PaddleOCR-VL pairs with) behind the detector
interface, registered as ``pp_doclayout_v2`` under ``fastdeploy_ext.models``. It shares V3's
family for what is the same (the deformable-attention component, the 800x800 processor, the
label names, the post-processing: V2's outputs come kept-first with the order logits over them,
the shape V3's post-processing reads) and has its own config and module."""
from __future__ import annotations

from typing import ClassVar

from ..pp_doclayout_v3.family import PPDocLayoutV3Family
from .config import PPDocLayoutV2Config


class PPDocLayoutV2Family(PPDocLayoutV3Family):
    name: ClassVar[str] = "pp_doclayout_v2"
    model_types: ClassVar[tuple[str, ...]] = ("pp_doclayout_v2",)
    #: V2 has no mask head: a runner asked for masks refuses before reading any weight (the
    #: module's ``with_masks`` setter refuses too)
    supports_masks: ClassVar[bool] = False

    def default_config(self) -> PPDocLayoutV2Config:
        return PPDocLayoutV2Config()

    def read_config(self, model_dir: str) -> PPDocLayoutV2Config:
        return PPDocLayoutV2Config.from_model_dir(model_dir)

    def conformance_fixture(self, workdir: str):
        from .conformance import PPDocLayoutV2Conformance
        return PPDocLayoutV2Conformance(workdir)

    def transformers_reference(self, model_dir, model, cfg):
        """transformers' PPDocLayoutV2ForObjectDetection with the same weights (bench detect's reference)."""
        from .reference import transformers_reference
        return transformers_reference(model_dir, model, cfg)

    def load_detector(self, model_dir, *, dtype, device, cfg):
        from .loader import load_detector
        return load_detector(model_dir, dtype=dtype, device=device, cfg=cfg)
