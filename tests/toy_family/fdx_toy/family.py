"""toy_vlm behind fastdeploy_ext's family interface (fastdeploy_ext/models/interface.py).

Registered through the entry point ``toy_vlm=fdx_toy.family:ToyVLMFamily`` of the group
``fastdeploy_ext.models`` (setup.py). It uses only the framework's neutral modules: the
interface, the plan's Component/ComponentKind, the varlen attention backends the runner hands
in, the input hygiene of fastdeploy_ext/inputs and the upload helper.
"""
from __future__ import annotations

from typing import ClassVar, Sequence

import torch

from fastdeploy_ext.models.interface import BatchError, ModelFamily
from fastdeploy_ext.plan import Component, ComponentKind

from .config import ToyConfig


class ToyVLMFamily(ModelFamily):
    name: ClassVar[str] = "toy_vlm"
    model_types: ClassVar[tuple[str, ...]] = ("toy_vlm",)

    # ------------------------------------------------------------------ config
    def default_config(self) -> ToyConfig:
        return ToyConfig()

    def read_config(self, model_dir: str) -> ToyConfig:
        return ToyConfig.from_model_dir(model_dir)

    def components(self, cfg: ToyConfig) -> tuple[Component, ...]:
        return (Component("vision.attention", ComponentKind.VISION_VARLEN_ATTENTION, cfg.vision_head_dim,
                          cfg.vision_num_heads),
                Component("text.attention", ComponentKind.PAGED_DECODER_ATTENTION, cfg.head_dim,
                          cfg.num_attention_heads, cfg.num_key_value_heads))

    # ------------------------------------------------------------------ loading
    def load_vision(self, model_dir, *, dtype, device, model_format, cfg):
        from .loader import load
        return load("vision", model_dir, cfg, dtype=dtype, device=device, model_format=model_format)

    def build_vision_model(self, cfg):
        from .vision import ToyVision
        with torch.device("meta"):
            return ToyVision(cfg)

    def load_text(self, model_dir, *, dtype, device, model_format, cfg):
        from .loader import load
        return load("text", model_dir, cfg, dtype=dtype, device=device, model_format=model_format)

    def load_tokenizer(self, model_dir, cfg):
        from .prompt import ChatTemplate, load_tokenizer
        return load_tokenizer(cfg), ChatTemplate()

    def image_processor(self, model_dir):
        from .processor import ToyImageProcessor
        return ToyImageProcessor(ToyConfig.from_model_dir(model_dir) if model_dir else ToyConfig())

    def build_prompt(self, tokenizer, chat_template, cfg, *, messages=None, prompt=None, image_grids=()):
        from .prompt import build_prompt
        return build_prompt(tokenizer, chat_template, cfg, messages=messages, prompt=prompt, image_grids=image_grids)

    # ------------------------------------------------------------------ execution
    def vision_execution(self, attention, strided_qkv, fused_layers, *, kernels=None):
        from .vision import ToyExecution
        return ToyExecution(attention, strided_qkv)

    def metadata_builder(self, cfg, vision_model, *, dtype, device, attention):
        from .vision import ToyMetadataBuilder
        return ToyMetadataBuilder(cfg, device=device, attention=attention)

    def check_pixels(self, cfg: ToyConfig, pixel_values, grids):
        pv = pixel_values
        if not isinstance(pv, torch.Tensor):
            raise BatchError(f"pixel_values must be a torch.Tensor, got {type(pv).__name__}")
        c, p = cfg.num_channels, cfg.patch_size
        if pv.ndim not in (2, 4) or (pv.shape[0] > 0 and pv[0].numel() != cfg.patch_dim):
            raise BatchError(f"pixel_values must be [N, {c}, {p}, {p}] or [N, {cfg.patch_dim}], got {list(pv.shape)}")
        if not pv.is_floating_point():
            raise BatchError(f"pixel_values must be floating point, got {pv.dtype}")
        if len(grids) == 0:
            raise BatchError("empty batch: at least one image is needed")
        out = []
        for i, g in enumerate(grids):
            if len(g) != 3:
                raise BatchError(f"image {i}: grid_thw must be (t, h, w), got {tuple(g)}")
            g = tuple(int(x) for x in g)
            if min(g) < 1:
                raise BatchError(f"image {i}: grid_thw {g} has a non-positive dimension")
            if g != cfg.grid:
                raise BatchError(f"image {i}: grid_thw {g}, but every toy_vlm image is resized to "
                                 f"{cfg.image_size}x{cfg.image_size}: grid {cfg.grid}")
            out.append(g)
        if pv.shape[0] != len(out) * cfg.patches_per_image:
            raise BatchError(f"pixel_values hold {pv.shape[0]} patches but grid_thw describes "
                             f"{len(out) * cfg.patches_per_image}")
        return out

    def output_sizes(self, cfg: ToyConfig, grids: Sequence) -> list[int]:
        return [cfg.embeddings_per_image for _ in grids]

    def encoder_cost(self, cfg: ToyConfig, grid) -> int:
        """What one image costs the encoder budget: its patches (the same for every image)."""
        return cfg.patches_per_image

    def profile_images(self, cfg: ToyConfig, max_encoder_patches: int):
        """As many (fixed-size) images as the budget admits, at least one."""
        from fastdeploy_ext.runner import ImageBatch
        n = max(1, max_encoder_patches // cfg.patches_per_image)
        pv = torch.zeros(n * cfg.patches_per_image, cfg.num_channels, cfg.patch_size, cfg.patch_size)
        return ImageBatch(pv, [cfg.grid] * n)

    def activation_bytes(self, cfg: ToyConfig, max_num_batched_tokens, max_encoder_patches, element_size):
        from fastdeploy_ext.memory_profile import decoder_prefill_bytes
        d = cfg.vision_hidden_size
        vision = max_encoder_patches * (7 * d + cfg.vision_intermediate_size) * element_size
        text = decoder_prefill_bytes(max_num_batched_tokens, hidden=cfg.hidden_size,
                                     q=cfg.num_attention_heads * cfg.head_dim, kv=cfg.num_key_value_heads * cfg.head_dim,
                                     intermediate=cfg.intermediate_size, element_size=element_size)
        return vision, text

    def eos_token_ids(self, cfg: ToyConfig) -> tuple[int, ...]:
        return (cfg.eos_token_id,)

    def vocab_size(self, cfg: ToyConfig) -> int:
        return cfg.vocab_size

    def graph_buffers(self, cfg, tokens, attention_state, *, device, dtype):
        from .vision import ToyBudgetBuffers
        return ToyBudgetBuffers(cfg, tokens, attention_state, device=device, dtype=dtype)

    def image_token_id(self, cfg: ToyConfig) -> int:
        return cfg.image_token_id

    @property
    def position_rows(self) -> int:
        return 1        # 1D rope over the token index

    def encoder_matmul_shapes(self, cfg: ToyConfig, tokens: int):
        d, m2 = cfg.vision_hidden_size, cfg.merge ** 2
        merged = max(1, tokens // m2)
        return ((tokens, cfg.patch_dim, d), (tokens, d, 3 * d), (tokens, d, d), (tokens, d, cfg.vision_intermediate_size),
                (tokens, cfg.vision_intermediate_size, d), (merged, d * m2, d * m2), (merged, d * m2, cfg.hidden_size))

    # ------------------------------------------------------------------ conformance
    def conformance_fixture(self, workdir):
        from .conformance import ToyConformance
        return ToyConformance(workdir)
