"""DeepSeek-OCR-2 behind the model-family seam (models/interface.py).

An image is a global 1024 view plus 0-6 local 768 crops (processor.py), its grid
``(1 + crops, rows, cols)``; it yields crops x 144 + 256 + 1 embedding rows (crops, global,
view separator). The decoder is a 12-layer MoE with plain MHA and 1D rope (P = 1).

The plan chooses a kernel per component (components()): SAM's windowed and global attention with
the decomposed relative-position bias, the Qwen2 encoder's prefix-causal attention, the decoder's
paged attention and the MoE's routed experts. Every row lists ATen backends for the tower and the
MoE for now (SDPA with a bias / a mask, text.py's eager experts); SAM's q/k/v are views of its
fused projection where the chosen kernel reads strides (the plan's qkv_layout). The tower's
encoder graphs are two paths of view budgets (encoder_graphs.py), on by default on the CUDA rows.
"""
from __future__ import annotations

from typing import ClassVar, Sequence

import torch

from ...plan import Component, ComponentKind
from ..interface import BatchError, ModelFamily
from .config import MODEL_TYPE, RELEASED_MODEL_TYPE, DeepseekOCR2Config


class DeepseekOCR2Family(ModelFamily):
    name: ClassVar[str] = "deepseek_ocr2"
    model_types: ClassVar[tuple[str, ...]] = (MODEL_TYPE, RELEASED_MODEL_TYPE)

    # ------------------------------------------------------------------ benchmarks
    def vision_bench(self):
        from .bench import run_vision_bench     # its own workloads (views and crops) and reference
        return run_vision_bench

    def generate_reference(self):
        from .bench import TransformersReference    # one request per transformers generate call
        return TransformersReference

    # ------------------------------------------------------------------ config
    def default_config(self) -> DeepseekOCR2Config:
        return DeepseekOCR2Config()

    def read_config(self, model_dir: str) -> DeepseekOCR2Config:
        return DeepseekOCR2Config.from_model_dir(model_dir)

    def components(self, cfg: DeepseekOCR2Config) -> tuple[Component, ...]:
        t, s, e = cfg.text, cfg.sam, cfg.encoder
        experts = (f"{t.n_routed_experts} experts of width {t.moe_intermediate_size}, top-{t.num_experts_per_tok}, "
                   f"{t.n_shared_experts} shared")
        return (Component("vision.sam.window_attention", ComponentKind.RELPOS_WINDOW_ATTENTION, s.head_dim,
                          s.num_attention_heads),
                Component("vision.sam.global_attention", ComponentKind.RELPOS_GLOBAL_ATTENTION, s.head_dim,
                          s.num_attention_heads),
                Component("vision.encoder.attention", ComponentKind.PREFIX_CAUSAL_ATTENTION, e.head_dim,
                          e.num_attention_heads, e.num_key_value_heads),
                Component("text.attention", ComponentKind.PAGED_DECODER_ATTENTION, t.head_dim,
                          t.num_attention_heads, t.num_key_value_heads),
                Component("text.moe.experts", ComponentKind.MOE_EXPERTS, 0, 0, detail=experts))

    # ------------------------------------------------------------------ loading
    def load_vision(self, model_dir, *, dtype, device, model_format, cfg):
        from .loader import load
        return load("vision", model_dir, cfg, dtype=dtype, device=device, model_format=model_format)

    def build_vision_model(self, cfg):
        from .vision import DeepseekOCR2Vision
        with torch.device("meta"):
            return DeepseekOCR2Vision(cfg)

    def load_text(self, model_dir, *, dtype, device, model_format, cfg):
        from .loader import load
        return load("text", model_dir, cfg, dtype=dtype, device=device, model_format=model_format)

    def load_tokenizer(self, model_dir, cfg):
        from .prompt import PromptFormat, load_tokenizer
        return load_tokenizer(model_dir, cfg), PromptFormat()

    def image_processor(self, model_dir):
        from .processor import DeepseekOCR2ImageProcessor
        return DeepseekOCR2ImageProcessor(DeepseekOCR2Config.from_model_dir(model_dir) if model_dir else None)

    def build_prompt(self, tokenizer, chat_template, cfg, *, messages=None, prompt=None, image_grids=()):
        from .prompt import build_prompt
        return build_prompt(tokenizer, chat_template, cfg, messages=messages, prompt=prompt, image_grids=image_grids)

    # ------------------------------------------------------------------ execution
    def vision_execution(self, attention, strided_qkv, fused_layers, *, kernels=None):
        """The tower's attention runs through the backends the plan chose for its kinds (ATen's
        SDPA where none is given: a tower outside a runner)."""
        from .vision import VisionExecution
        chosen = {f: kernels[k] for f, k in (("window_attention", ComponentKind.RELPOS_WINDOW_ATTENTION),
                                             ("global_attention", ComponentKind.RELPOS_GLOBAL_ATTENTION),
                                             ("prefix_attention", ComponentKind.PREFIX_CAUSAL_ATTENTION))
                  if kernels and k in kernels}
        return VisionExecution(attention, strided_qkv, fused_layers, **chosen)

    def metadata_builder(self, cfg, vision_model, *, dtype, device, attention):
        from .vision import VisionMetadataBuilder
        return VisionMetadataBuilder(cfg, device=device)

    def check_pixels(self, cfg: DeepseekOCR2Config, pixel_values, grids) -> list:
        pv = pixel_values
        if not isinstance(pv, torch.Tensor):
            raise BatchError(f"pixel_values must be a torch.Tensor, got {type(pv).__name__}")
        c, p = cfg.sam.num_channels, cfg.sam.patch_size
        if pv.ndim not in (2, 4) or (pv.shape[0] > 0 and pv[0].numel() != cfg.patch_dim):
            raise BatchError(f"pixel_values must be [N, {c}, {p}, {p}] or [N, {cfg.patch_dim}] patches, "
                             f"got {list(pv.shape)}")
        if not (pv.is_floating_point() or pv.dtype == torch.uint8):
            raise BatchError(f"pixel_values must be the processor's uint8 bytes or normalized floating-point "
                             f"pixels, got {pv.dtype}")
        if len(grids) == 0:
            raise BatchError("empty batch: at least one image is needed")
        out = []
        for i, g in enumerate(grids):
            if len(g) != 3:
                raise BatchError(f"image {i}: grid must be (views, rows, cols), got {tuple(g)}")
            views, rows, cols = (int(x) for x in g)
            if min(views, rows, cols) < 1:
                raise BatchError(f"image {i}: grid {(views, rows, cols)} has a non-positive dimension")
            crops = views - 1
            if crops == 0 and (rows, cols) != (1, 1):
                raise BatchError(f"image {i}: grid {(views, rows, cols)}: no crops but a {rows}x{cols} tiling")
            if crops and (rows * cols != crops or not cfg.min_crops <= crops <= cfg.max_crops):
                raise BatchError(f"image {i}: grid {(views, rows, cols)}: {crops} crops must be rows x cols and "
                                 f"within {cfg.min_crops}..{cfg.max_crops}")
            out.append((views, rows, cols))
        want = sum(cfg.image_patches(g[0] - 1) for g in out)
        if pv.shape[0] != want:
            raise BatchError(f"pixel_values hold {pv.shape[0]} patches but the grids describe {want}")
        return out

    def output_sizes(self, cfg: DeepseekOCR2Config, grids: Sequence) -> list[int]:
        return [cfg.image_rows(int(g[0]) - 1) for g in grids]

    def encode_outputs(self, cfg: DeepseekOCR2Config, grids: Sequence) -> dict[str, torch.Tensor]:
        """`encode` writes each image's crop count (int64 [n]) instead of a patch grid."""
        return {"num_crops": torch.tensor([int(g[0]) - 1 for g in grids], dtype=torch.int64)}

    def encoder_cost(self, cfg: DeepseekOCR2Config, grid) -> int:
        """Input patches: 4096 for the global view + 2304 per crop."""
        return cfg.image_patches(int(grid[0]) - 1)

    # --- memory profile
    def profile_images(self, cfg: DeepseekOCR2Config, max_encoder_patches: int):
        from ...runner import ImageBatch
        n, s = profile_views(cfg, max_encoder_patches), cfg.sam
        pv = torch.zeros(n * cfg.image_patches(0), s.num_channels, s.patch_size, s.patch_size)
        return ImageBatch(pv, [(1, 1, 1)] * n)

    def activation_bytes(self, cfg: DeepseekOCR2Config, max_num_batched_tokens, max_encoder_patches, element_size):
        """Vision: the global path over profile_images' views: SAM's per-patch activations
        (residual, LN, qkv, attention out, MLP), a global layer's decomposed relative-position
        bias [views, heads, N, N] (materialized for ATen's SDPA), then the Qwen2 encoder over
        [visual, queries]. Prefill: the larger of the dense and MoE layers per token, plus ATen's
        gathered experts (one chunk of tokens x top-k experts' gate/up weights)."""
        from ...memory_profile import decoder_prefill_bytes
        from ...ops.moe import GATHER_CHUNK
        s, e, t, el = cfg.sam, cfg.encoder, cfg.text, element_size
        views, n = profile_views(cfg, max_encoder_patches), cfg.patches(cfg.base_size)
        sam = views * n * (7 * s.hidden_size + s.mlp_dim) * el + views * s.num_attention_heads * n * n * el
        encoder = decoder_prefill_bytes(views * 2 * cfg.global_queries, hidden=e.hidden_size,
                                        q=e.hidden_size, kv=e.num_key_value_heads * e.head_dim,
                                        intermediate=e.intermediate_size, element_size=el)
        moe = (t.num_experts_per_tok + t.n_shared_experts) * t.moe_intermediate_size
        dense = t.intermediate_size if t.first_k_dense else 0
        text = decoder_prefill_bytes(max_num_batched_tokens, hidden=t.hidden_size, q=t.num_attention_heads * t.head_dim,
                                     kv=t.num_key_value_heads * t.head_dim, intermediate=max(dense, moe),
                                     element_size=el)
        if t.first_k_dense < t.num_hidden_layers:
            chunk = min(max_num_batched_tokens, GATHER_CHUNK) * t.num_experts_per_tok
            text += chunk * 2 * t.moe_intermediate_size * t.hidden_size * el
        return sam + encoder, text

    def eos_token_ids(self, cfg: DeepseekOCR2Config) -> tuple[int, ...]:
        return (cfg.text.eos_token_id,)

    def vocab_size(self, cfg: DeepseekOCR2Config) -> int:
        return cfg.text.vocab_size

    def graph_buffers(self, cfg, tokens, attention_state, *, device, dtype):
        raise NotImplementedError("deepseek_ocr2: encoder graphs are budgets of views per path (encoder_graphs), "
                                  "not of packed patches")

    def encoder_graphs(self, runner, paths):
        """The dual-path graphs: the global views and the crops, each path its own budgets."""
        from .encoder_graphs import DeepseekEncoderGraphs
        return DeepseekEncoderGraphs(runner, paths)

    def image_token_id(self, cfg: DeepseekOCR2Config) -> int:
        return cfg.image_token_id

    @property
    def position_rows(self) -> int:
        return 1        # 1D rope over the token index

    def encoder_matmul_shapes(self, cfg: DeepseekOCR2Config, tokens: int):
        s, e = cfg.sam, cfg.encoder
        q = max(1, tokens // 16)          # encoder tokens: SAM's grid / 16 visual + as many queries
        kv = e.num_key_value_heads * e.head_dim
        return ((tokens, cfg.patch_dim, s.hidden_size), (tokens, s.hidden_size, 3 * s.hidden_size),
                (tokens, s.hidden_size, s.hidden_size), (tokens, s.hidden_size, s.mlp_dim),
                (tokens, s.mlp_dim, s.hidden_size), (2 * q, e.hidden_size, e.hidden_size),
                (2 * q, e.hidden_size, kv), (2 * q, e.hidden_size, e.intermediate_size),
                (2 * q, e.intermediate_size, e.hidden_size), (q, e.hidden_size, cfg.text.hidden_size))

    # ------------------------------------------------------------------ benchmarks, serving
    def builtin_special_tokens(self, cfg: DeepseekOCR2Config) -> dict[str, int]:
        from .prompt import builtin_special_tokens
        return builtin_special_tokens(cfg)

    # ------------------------------------------------------------------ conformance
    def conformance_fixture(self, workdir):
        from .conformance import DeepseekOCR2Conformance
        return DeepseekOCR2Conformance(workdir)


def profile_views(cfg: DeepseekOCR2Config, max_encoder_patches: int) -> int:
    """Images without crops one step's budget admits (at least one): the worst case. The two
    paths run one after the other and the crop path of any admitted batch has fewer patches
    than this global path; a global view also has more patches than a crop (SAM's global
    attention is quadratic in them)."""
    return max(1, max_encoder_patches // cfg.image_patches(0))
