"""The transformers reference for the vision path, built with exactly our weights, so the
benchmark compares the same function (and reports how close the outputs are)."""
from __future__ import annotations

import torch


def hf_vision_reference(model, cfg, device: torch.device, dtype: torch.dtype):
    """transformers' PaddleOCRVisionModel (sdpa) + PaddleOCRProjector with our model's weights.
    Returns fn(pixel_values [N, C, P, P], grid_thw LongTensor) -> packed projector output."""
    from transformers import PaddleOCRVLConfig
    from transformers.models.paddleocr_vl.modeling_paddleocr_vl import PaddleOCRProjector, PaddleOCRVisionModel

    vc = cfg.vision
    hf_cfg = PaddleOCRVLConfig(
        vision_config=dict(hidden_size=vc.hidden_size, intermediate_size=vc.intermediate_size,
                           num_hidden_layers=vc.num_hidden_layers, num_attention_heads=vc.num_attention_heads,
                           image_size=vc.image_size, patch_size=vc.patch_size, layer_norm_eps=vc.layer_norm_eps),
        text_config=dict(hidden_size=cfg.text.hidden_size))
    hf_cfg.vision_config._attn_implementation = "sdpa"
    with torch.device("meta"):
        vision = PaddleOCRVisionModel(hf_cfg.vision_config)
        projector = PaddleOCRProjector(hf_cfg)
    ours = {k: v.detach() for k, v in model.state_dict().items()}
    d = vc.hidden_size
    vs = {"vision_model.embeddings.patch_embedding.weight": ours["encoder.patch_embedding.weight"].reshape(
              d, vc.num_channels, vc.patch_size, vc.patch_size),
          "vision_model.embeddings.patch_embedding.bias": ours["encoder.patch_embedding.bias"],
          "vision_model.embeddings.position_embedding.weight": ours["encoder.position_embedding"]}
    for i in range(vc.num_hidden_layers):
        o, h = f"encoder.layers.{i}.", f"vision_model.encoder.layers.{i}."
        for p in ("weight", "bias"):
            for j, name in enumerate("qkv"):
                vs[h + f"self_attn.{name}_proj.{p}"] = ours[o + f"qkv.{p}"][j * d:(j + 1) * d]
            vs[h + f"self_attn.out_proj.{p}"] = ours[o + f"out_proj.{p}"]
            vs[h + f"mlp.fc1.{p}"] = ours[o + f"fc1.{p}"]
            vs[h + f"mlp.fc2.{p}"] = ours[o + f"fc2.{p}"]
            vs[h + f"layer_norm1.{p}"] = ours[o + f"layer_norm1.{p}"]
            vs[h + f"layer_norm2.{p}"] = ours[o + f"layer_norm2.{p}"]
            vs[f"vision_model.post_layernorm.{p}"] = ours[f"encoder.post_layernorm.{p}"]
    ps = {k[len("projector."):]: v for k, v in ours.items() if k.startswith("projector.")}
    # built on the meta device (no random init of 0.4B parameters), then materialised and
    # filled; the two non-persistent buffers are recomputed as transformers does
    vision.to_empty(device=device)
    projector.to_empty(device=device)
    missing, unexpected = vision.load_state_dict(vs, strict=False)
    if unexpected or [k for k in missing if "position_ids" not in k]:
        raise RuntimeError(f"reference weight mapping is off: missing {missing}, unexpected {unexpected}")
    projector.load_state_dict(ps, strict=True)
    rotary = vision.vision_model.encoder.rotary_pos_emb
    spatial = vc.head_dim // 2
    rotary.inv_freq = 1.0 / (vc.rope_theta ** (torch.arange(0, spatial, 2, dtype=torch.float32, device=device) / spatial))
    emb = vision.vision_model.embeddings
    emb.position_ids = torch.arange(emb.num_positions, device=device).expand((1, -1))
    vision = vision.to(dtype=dtype).eval()
    rotary.inv_freq = rotary.inv_freq.float()         # transformers keeps the rotary in fp32
    projector = projector.to(dtype=dtype).eval()

    def run(pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
        with torch.inference_mode():
            hs = vision(pixel_values=pixel_values.unsqueeze(0), grid_thw=grid_thw).last_hidden_state
            return projector(hs, grid_thw)
    return run
