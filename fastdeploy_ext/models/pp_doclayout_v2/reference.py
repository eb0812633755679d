"""transformers' PPDocLayoutV2ForObjectDetection with our detector's weights: the reference that
`bench detect` and the conformance fixture compare against (needs transformers)."""
from __future__ import annotations

import dataclasses
import tempfile

from ..interface import CheckpointError
from .loader import UNUSED_NAMES


def transformers_config(cfg):
    """transformers' PPDocLayoutV2Config for our config (the same architecture)."""
    from transformers import PPDocLayoutV2Config

    from ..pp_doclayout_v3.reference import transformers_config as v3_config
    v3 = v3_config(cfg).to_dict()                  # the shared detector's fields, backbone included
    ro = {f.name: getattr(cfg.reading_order, f.name) for f in dataclasses.fields(cfg.reading_order)}
    for key in ("relation_bias_theta", "relation_bias_scale"):      # int fields there
        ro[key] = int(ro[key])
    # V2's own fields are set below (the V3 config carried them along as plain attributes)
    drop = ("model_type", "transformers_version", "architectures", "reading_order", "class_thresholds", "class_order")
    keep = {k: v for k, v in v3.items() if k not in drop}
    return PPDocLayoutV2Config(**(keep | {"reading_order_config": ro, "class_thresholds": list(cfg.class_thresholds),
                                          "class_order": list(cfg.class_order)}))


def check_loading_info(info) -> None:
    """Every reference tensor loaded but the ones inference does not use (the loader's UNUSED_NAMES,
    BatchNorm step counters)."""
    left = [k for k in info["missing_keys"] if k not in UNUSED_NAMES and not k.endswith("num_batches_tracked")]
    if left or info["unexpected_keys"] or info.get("mismatched_keys"):
        raise CheckpointError(f"our weights do not map onto transformers' PP-DocLayoutV2: missing {left[:3]}, "
                              f"unexpected {list(info['unexpected_keys'])[:3]}, mismatched "
                              f"{list(info.get('mismatched_keys') or [])[:3]}")


def from_pretrained(model_dir: str):
    """transformers' model of a checkpoint directory (our loader's names are save_pretrained's)."""
    from transformers import PPDocLayoutV2ForObjectDetection
    ref, info = PPDocLayoutV2ForObjectDetection.from_pretrained(str(model_dir), output_loading_info=True)
    check_loading_info(info)
    return ref.eval()


def reference_with_our_weights(model, cfg):
    """transformers' model of ``cfg`` holding ``model``'s weights (written under our names, which
    are save_pretrained's, and read back by from_pretrained)."""
    from safetensors.torch import save_file
    with tempfile.TemporaryDirectory(prefix="fdx-pp-doclayout-v2-ref-") as d:
        transformers_config(cfg).save_pretrained(d)
        save_file({k: v.detach().float().cpu().contiguous() for k, v in model.state_dict().items()},
                  f"{d}/model.safetensors", metadata={"format": "pt"})
        return from_pretrained(d)


def transformers_reference(model_dir: str | None, model, cfg):
    """The reference for ``model_dir``'s checkpoint, or, without one, for ``model``'s (random) weights."""
    return from_pretrained(model_dir) if model_dir is not None else reference_with_our_weights(model, cfg)
