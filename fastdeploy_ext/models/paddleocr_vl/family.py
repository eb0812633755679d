"""PaddleOCR-VL behind the family interface (models/interface.py): the runners reach this model
only through these hooks. Registered as ``paddleocr_vl`` under ``fastdeploy_ext.models``."""
from __future__ import annotations

import math
from typing import ClassVar, Sequence

import torch

from ...plan import Component, ComponentKind
from ..interface import ModelFamily
from .config import PaddleOCRVLConfig
from .metadata import BatchError, Grid, MetadataBuilder, VisionMetadata, validate_grids


class PaddleOCRVLFamily(ModelFamily):
    name: ClassVar[str] = "paddleocr_vl"
    model_types: ClassVar[tuple[str, ...]] = ("paddleocr_vl",)

    # ------------------------------------------------------------------ config
    def default_config(self) -> PaddleOCRVLConfig:
        return PaddleOCRVLConfig()

    def read_config(self, model_dir: str) -> PaddleOCRVLConfig:
        return PaddleOCRVLConfig.from_model_dir(model_dir)

    def components(self, cfg: PaddleOCRVLConfig) -> tuple[Component, ...]:
        v, t = cfg.vision, cfg.text
        return (Component("vision.attention", ComponentKind.VISION_VARLEN_ATTENTION, v.head_dim,
                          v.num_attention_heads),
                Component("text.attention", ComponentKind.PAGED_DECODER_ATTENTION, t.head_dim,
                          t.num_attention_heads, t.num_key_value_heads))

    # ------------------------------------------------------------------ loading
    def load_vision(self, model_dir, *, dtype, device, model_format, cfg):
        from .loader import load_vision
        model, _, report = load_vision(model_dir, dtype=dtype, device=device, model_format=model_format, cfg=cfg)
        return model, report

    def build_vision_model(self, cfg):
        from .loader import build_vision_model
        return build_vision_model(cfg)

    def load_text(self, model_dir, *, dtype, device, model_format, cfg):
        from .loader import load_text
        model, _, report = load_text(model_dir, dtype=dtype, device=device, model_format=model_format, cfg=cfg)
        return model, report

    def load_tokenizer(self, model_dir, cfg):
        from .tokenizer import load_chat_template, load_tokenizer
        return load_tokenizer(model_dir, cfg), load_chat_template(model_dir)

    def image_processor(self, model_dir):
        from .processor import ImageProcessor, PreprocessorConfig
        return ImageProcessor(PreprocessorConfig.from_model_dir(model_dir) if model_dir else PreprocessorConfig())

    def build_prompt(self, tokenizer, chat_template, cfg, *, messages=None, prompt=None, image_grids=()):
        from .prompt import build_prompt
        return build_prompt(tokenizer, chat_template, cfg, messages=messages, prompt=prompt, image_grids=image_grids)

    # ------------------------------------------------------------------ execution
    def vision_execution(self, attention, strided_qkv, fused_layers, *, kernels=None):
        from .vision import VisionExecution
        return VisionExecution(attention, strided_qkv, fused_layers)

    def metadata_builder(self, cfg, vision_model, *, dtype, device, attention):
        from ... import envs
        vc = cfg.vision
        return MetadataBuilder(
            head_dim=vc.head_dim, rope_theta=vc.rope_theta, merge=vc.spatial_merge_size, side=vc.num_grid_per_side,
            pos_table=vision_model.encoder.position_embedding.detach(), compute_dtype=dtype, device=device,
            cache_capacity=envs.FD_POS_EMBED_CACHE_SIZE.get(), attention=attention)

    def check_pixels(self, cfg, pixel_values, grids) -> list[Grid]:
        vc, pv = cfg.vision, pixel_values
        if not isinstance(pv, torch.Tensor):
            raise BatchError(f"pixel_values must be a torch.Tensor, got {type(pv).__name__}")
        patch_dim = vc.num_channels * vc.patch_size ** 2
        if pv.ndim not in (2, 4) or (pv.shape[0] > 0 and pv[0].numel() != patch_dim):
            raise BatchError(f"pixel_values must be [N, {vc.num_channels}, {vc.patch_size}, {vc.patch_size}] "
                             f"or [N, {patch_dim}], got {list(pv.shape)}")
        if not pv.is_floating_point():
            raise BatchError(f"pixel_values must be floating point, got {pv.dtype}")
        return validate_grids(grids, vc.spatial_merge_size, num_patches=pv.shape[0])

    def output_sizes(self, cfg, grids: Sequence[Grid]) -> list[int]:
        m2 = cfg.vision.spatial_merge_size ** 2      # the projector merges m x m patches into one row
        return [t * h * w // m2 for t, h, w in grids]

    def graph_buffers(self, cfg, tokens, attention_state, *, device, dtype) -> "BudgetBuffers":
        return BudgetBuffers(cfg, tokens, attention_state, device=device, dtype=dtype)

    def image_token_id(self, cfg) -> int:
        return cfg.image_token_id

    @property
    def position_rows(self) -> int:
        return 3        # 3D mrope (temporal, height, width)

    def encoder_matmul_shapes(self, cfg, tokens):
        v = cfg.vision
        h, inter, m2 = v.hidden_size, v.intermediate_size, v.spatial_merge_size ** 2
        merged = max(1, tokens // m2)
        return ((tokens, v.num_channels * v.patch_size ** 2, h), (tokens, h, 3 * h), (tokens, h, h),
                (tokens, h, inter), (tokens, inter, h), (merged, h * m2, h * m2),
                (merged, h * m2, cfg.text.hidden_size))

    # --- engine inputs
    def encoder_cost(self, cfg, grid: Grid) -> int:
        t, h, w = grid
        return t * h * w            # input patches: what the packed vision pass's work scales with

    # --- memory profile
    def profile_images(self, cfg, max_encoder_patches):
        """One image of a (1, h, w) grid with h*w <= the budget (at least merge x merge), h and w
        multiples of the merge, near square: the packed pass's memory scales with its patches."""
        from ...runner import ImageBatch
        vc = cfg.vision
        merge = vc.spatial_merge_size
        side = max(merge, int(math.isqrt(max_encoder_patches)) // merge * merge)
        w = max(merge, max_encoder_patches // side // merge * merge)
        return ImageBatch(torch.zeros(side * w, vc.num_channels, vc.patch_size, vc.patch_size), [(1, side, w)])

    def activation_bytes(self, cfg, max_num_batched_tokens, max_encoder_patches, element_size):
        from ...memory_profile import decoder_prefill_bytes
        vc, tc = cfg.vision, cfg.text
        # vision: residual + LN + qkv + attention out + MLP intermediate live at once, per patch
        vision = max_encoder_patches * (4 * vc.hidden_size + 3 * vc.hidden_size + vc.intermediate_size) * element_size
        text = decoder_prefill_bytes(max_num_batched_tokens, hidden=tc.hidden_size,
                                     q=tc.num_attention_heads * tc.head_dim, kv=tc.num_key_value_heads * tc.head_dim,
                                     intermediate=tc.intermediate_size, element_size=element_size)
        return vision, text

    def eos_token_ids(self, cfg) -> tuple[int, ...]:
        eos = getattr(cfg, "eos_token_id", None)
        eos = getattr(cfg.text, "eos_token_id", 2) if eos is None else eos
        return tuple(int(e) for e in eos) if isinstance(eos, (list, tuple)) else (int(eos),)

    def vocab_size(self, cfg) -> int:
        return cfg.text.vocab_size

    # --- benchmarks
    def released_image_processor(self):
        from .processor import ImageProcessor, PreprocessorConfig
        return ImageProcessor(PreprocessorConfig.from_dict(RELEASED_PREPROCESSOR, source="released checkpoint"))

    def preprocess_pool(self, processor, workers=None):
        from .preprocess_pool import PreprocessPool
        return PreprocessPool(processor, workers)

    def builtin_special_tokens(self, cfg):
        from .tokenizer import builtin_special_tokens
        return builtin_special_tokens(cfg)

    def default_chat_template(self) -> str:
        from .tokenizer import DEFAULT_CHAT_TEMPLATE
        return DEFAULT_CHAT_TEMPLATE


    # ------------------------------------------------------------------ conformance
    def conformance_fixture(self, workdir):
        from .conformance import PaddleOCRVLConformance
        return PaddleOCRVLConformance(workdir)


#: the released PaddleOCR-VL checkpoint's preprocessor settings (DESIGN.md section 4)
RELEASED_PREPROCESSOR = dict(min_pixels=147384, max_pixels=2822400, image_mean=[0.5] * 3, image_std=[0.5] * 3)


class BudgetBuffers:
    """The static inputs of an encoder graph captured at ``tokens`` patches: pixels, position
    embeddings, rotary tables, the merge permutation and the attention backend's state, with the
    metadata that points at them. A budget of N patches yields N / merge**2 projector rows."""

    def __init__(self, cfg: PaddleOCRVLConfig, tokens: int, attention_state, *, device, dtype):
        vc = cfg.vision
        self.m2 = vc.spatial_merge_size ** 2
        self.pixels = torch.zeros(tokens, vc.num_channels * vc.patch_size ** 2, device=device, dtype=dtype)
        self.pos = torch.zeros(tokens, vc.hidden_size, device=device, dtype=dtype)
        self.cos = torch.ones(tokens, vc.head_dim, device=device, dtype=torch.float32)
        self.sin = torch.zeros(tokens, vc.head_dim, device=device, dtype=torch.float32)
        self.merge_index = torch.arange(tokens, device=device)
        self.attention_state = attention_state
        self.meta = VisionMetadata(
            num_tokens=tokens, seq_lens=[tokens],
            cu_seqlens=torch.tensor([0, tokens], device=device, dtype=torch.int32), max_seqlen=tokens,
            cos=self.cos, sin=self.sin, pos_embed=self.pos, merge_index=self.merge_index,
            out_split_sizes=[self.outputs(tokens)], grids=[], source="graph", attention_state=attention_state.state)

    def outputs(self, num_tokens: int) -> int:
        return num_tokens // self.m2

    def load(self, pixels: torch.Tensor, meta: VisionMetadata) -> None:
        n = meta.num_tokens
        self.pixels[:n].copy_(pixels)
        self.pos[:n].copy_(meta.pos_embed)
        self.cos[:n].copy_(meta.cos)
        self.sin[:n].copy_(meta.sin)
        self.merge_index[:n].copy_(meta.merge_index)
        self.attention_state.load(meta.attention_state)
