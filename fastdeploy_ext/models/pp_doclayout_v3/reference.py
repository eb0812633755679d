"""transformers' PPDocLayoutV3ForObjectDetection with our detector's weights: the reference
`bench detect` and ci/detector_bf16_check.py compare against (needs transformers)."""
from __future__ import annotations

import dataclasses
import tempfile

from ..interface import CheckpointError
from .loader import PREFIX


def transformers_config(cfg):
    """transformers' PPDocLayoutV3Config for our config (the same architecture)."""
    from transformers import PPDocLayoutV3Config
    skip = {"backbone", "labels", "image_size"}
    kw = {f.name: (list(v) if isinstance(v, tuple) else v) for f in dataclasses.fields(cfg)
          if f.name not in skip for v in [getattr(cfg, f.name)]}
    bb = {f.name: (list(v) if isinstance(v, tuple) else v) for f in dataclasses.fields(cfg.backbone)
          for v in [getattr(cfg.backbone, f.name)]}
    bb |= {"model_type": "hgnet_v2", "hidden_sizes": list(cfg.backbone.stage_out_channels),
           "out_features": [f"stage{i}" for i in cfg.backbone.out_indices]}
    bb.pop("out_indices")
    kw["positional_encoding_temperature"] = int(kw["positional_encoding_temperature"])    # an int field there
    return PPDocLayoutV3Config(backbone_config=bb, id2label=dict(enumerate(cfg.labels)), **kw)


def reference_with_our_weights(model, cfg):
    """transformers' model of ``cfg`` holding ``model``'s weights: written as the checkpoint
    save_pretrained would (our names are its converted names under ``model.``) and read back by
    from_pretrained, which maps them onto its modules; a reference tensor left unloaded, other
    than the training-only denoising embedding and BatchNorm step counters, is an error."""
    from safetensors.torch import save_file
    from transformers import PPDocLayoutV3ForObjectDetection
    with tempfile.TemporaryDirectory(prefix="fdx-pp-doclayout-ref-") as d:
        transformers_config(cfg).save_pretrained(d)
        save_file({PREFIX + k: v.detach().float().cpu().contiguous() for k, v in model.state_dict().items()},
                  f"{d}/model.safetensors", metadata={"format": "pt"})
        ref, info = PPDocLayoutV3ForObjectDetection.from_pretrained(d, output_loading_info=True)
    left = [k for k in info["missing_keys"] if "denoising_class_embed" not in k and not k.endswith("num_batches_tracked")]
    if left or info["unexpected_keys"] or info.get("mismatched_keys"):
        raise CheckpointError(f"our weights do not map onto transformers' model: missing {left[:3]}, unexpected "
                              f"{list(info['unexpected_keys'])[:3]}, mismatched {list(info.get('mismatched_keys') or [])[:3]}")
    return ref.eval()


def transformers_reference(model_dir: str | None, model, cfg):
    """The reference for ``model_dir``'s checkpoint (from_pretrained), or, without one, for
    ``model``'s (random) weights."""
    if model_dir is not None:
        from transformers import PPDocLayoutV3ForObjectDetection
        return PPDocLayoutV3ForObjectDetection.from_pretrained(model_dir).eval()
    return reference_with_our_weights(model, cfg)
