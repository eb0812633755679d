"""DeepSeek-OCR-2's configuration as typed dataclasses, in the released geometry by default.

Three parts: the SAM ViT-B image encoder (patch 16, 14x14 windows, global layers, a conv neck
and two stride-2 convs), the Qwen2-0.5B used as a vision encoder over [visual tokens, learned
queries], and the DeepSeek3B-MoE-A570M decoder (plain MHA, layer 0 dense, 64 routed experts of
which 6 per token, 2 shared).

transformers' own config defaults do not describe the released model (its text defaults are a
Llama-7B's), so the released values are written here (``DeepseekOCR2Config()``). A config.json
is read in either form:

- transformers' (``model_type: deepseek_ocr2``, what ``save_pretrained`` writes): nested
  ``vision_config.sam_config`` / ``vision_config.encoder_config`` / ``text_config``;
- DeepSeek's release (``model_type: deepseek_vl_v2``, the original checkpoint's config.json):
  ``language_config`` with DeepSeek-V2 keys (``first_k_dense_replace``, ``n_routed_experts``,
  ``use_mla`` false ...) and ``projector_config``; the vision tower's geometry is not spelled
  out there (DeepSeek's code hard-codes it), so the released geometry is used and the projector's
  ``input_dim`` must match it.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from ..interface import CheckpointError, read_config_json

MODEL_TYPE = "deepseek_ocr2"
RELEASED_MODEL_TYPE = "deepseek_vl_v2"


@dataclass(frozen=True)
class SamConfig:
    hidden_size: int = 768
    num_hidden_layers: int = 12
    num_attention_heads: int = 12
    mlp_dim: int = 3072
    image_size: int = 1024                  # the size the absolute positions were trained at
    patch_size: int = 16
    num_channels: int = 3
    window_size: int = 14
    global_attn_indexes: tuple[int, ...] = (2, 5, 8, 11)
    output_channels: int = 256              # the neck's width
    downsample_channels: tuple[int, int] = (512, 896)
    layer_norm_eps: float = 1e-6

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def grid(self) -> int:
        """Patches per side at ``image_size`` (the pos-embedding table's side)."""
        return self.image_size // self.patch_size


@dataclass(frozen=True)
class EncoderConfig:
    """The Qwen2 decoder stack used as a vision encoder (no embeddings, no head)."""
    hidden_size: int = 896
    num_hidden_layers: int = 24
    num_attention_heads: int = 14
    num_key_value_heads: int = 2
    intermediate_size: int = 4864
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1e6

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads


@dataclass(frozen=True)
class TextConfig:
    hidden_size: int = 1280
    num_hidden_layers: int = 12
    num_attention_heads: int = 10
    num_key_value_heads: int = 10
    intermediate_size: int = 6848           # the dense layers' MLP
    moe_intermediate_size: int = 896        # one routed expert's width
    n_routed_experts: int = 64
    num_experts_per_tok: int = 6
    n_shared_experts: int = 2
    first_k_dense: int = 1                  # layers [0, first_k_dense) are dense
    routed_scaling_factor: float = 1.0
    vocab_size: int = 129280
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    max_position_embeddings: int = 8192
    bos_token_id: int = 0
    eos_token_id: int = 1
    pad_token_id: int | None = None

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    def is_sparse(self, layer: int) -> bool:
        return layer >= self.first_k_dense


@dataclass(frozen=True)
class DeepseekOCR2Config:
    sam: SamConfig = field(default_factory=SamConfig)
    encoder: EncoderConfig = field(default_factory=EncoderConfig)
    text: TextConfig = field(default_factory=TextConfig)
    image_token_id: int = 128815
    # the image processor's geometry (the released preprocessor_config)
    base_size: int = 1024                   # the global view
    tile_size: int = 768                    # one local crop
    min_crops: int = 2
    max_crops: int = 6
    downsample_ratio: int = 4               # SAM grid -> query grid (two stride-2 convs)

    # ----------------------------------------------------------------- derived geometry
    def queries(self, size: int) -> int:
        """Learned queries (= output rows) of a view of ``size`` pixels: (size / 16 / 4)^2."""
        side = size // self.sam.patch_size // self.downsample_ratio
        return side * side

    @property
    def global_queries(self) -> int:
        return self.queries(self.base_size)

    @property
    def crop_queries(self) -> int:
        return self.queries(self.tile_size)

    def patches(self, size: int) -> int:
        return (size // self.sam.patch_size) ** 2

    @property
    def patch_dim(self) -> int:
        return self.sam.num_channels * self.sam.patch_size ** 2

    def image_rows(self, num_crops: int) -> int:
        """Embedding rows of one image: crops, the global view, one view separator."""
        return num_crops * self.crop_queries + self.global_queries + 1

    def image_patches(self, num_crops: int) -> int:
        return num_crops * self.patches(self.tile_size) + self.patches(self.base_size)

    # ----------------------------------------------------------------- validation
    def validate(self, source: str = "config") -> "DeepseekOCR2Config":
        s, e, t = self.sam, self.encoder, self.text
        problems = []
        if s.hidden_size % s.num_attention_heads:
            problems.append(f"sam hidden_size {s.hidden_size} is not divisible by num_attention_heads")
        if s.downsample_channels[1] != e.hidden_size:
            problems.append(f"sam downsample_channels[1] {s.downsample_channels[1]} must equal the encoder's "
                            f"hidden_size {e.hidden_size}")
        if any(not 0 <= i < s.num_hidden_layers for i in s.global_attn_indexes):
            problems.append(f"sam global_attn_indexes {list(s.global_attn_indexes)} outside 0..{s.num_hidden_layers - 1}")
        for size in (self.base_size, self.tile_size):
            if size % (s.patch_size * self.downsample_ratio):
                problems.append(f"view size {size} is not a multiple of patch_size x downsample_ratio")
        if e.hidden_size % e.num_attention_heads or e.num_attention_heads % e.num_key_value_heads:
            problems.append("encoder heads: hidden_size / num_attention_heads / num_key_value_heads do not divide")
        if t.hidden_size % t.num_attention_heads or t.num_attention_heads % t.num_key_value_heads:
            problems.append("text heads: hidden_size / num_attention_heads / num_key_value_heads do not divide")
        if not 0 < t.num_experts_per_tok <= t.n_routed_experts:
            problems.append(f"num_experts_per_tok {t.num_experts_per_tok} must be in 1..n_routed_experts "
                            f"{t.n_routed_experts}")
        if not 0 <= t.first_k_dense <= t.num_hidden_layers:
            problems.append(f"first_k_dense {t.first_k_dense} outside 0..num_hidden_layers")
        if not 1 <= self.min_crops <= self.max_crops:
            problems.append(f"min_crops {self.min_crops} / max_crops {self.max_crops}")
        if not 0 <= self.image_token_id < t.vocab_size:
            problems.append(f"image_token_id {self.image_token_id} outside the vocab of {t.vocab_size}")
        if problems:
            raise CheckpointError(f"{source}: " + "; ".join(problems))
        return self

    # ----------------------------------------------------------------- config.json
    @classmethod
    def from_dict(cls, d: dict, source: str = "config") -> "DeepseekOCR2Config":
        mt = d.get("model_type")
        if mt == MODEL_TYPE:
            return _from_transformers(d, source).validate(source)
        if mt == RELEASED_MODEL_TYPE:
            return _from_release(d, source).validate(source)
        raise CheckpointError(f"{source}: model_type {mt!r}, expected {MODEL_TYPE!r} (transformers) or "
                              f"{RELEASED_MODEL_TYPE!r} (DeepSeek's release)")

    @classmethod
    def from_model_dir(cls, model_dir: str | Path) -> "DeepseekOCR2Config":
        data, path = read_config_json(model_dir)
        return cls.from_dict(data, str(path))

    def to_transformers_json(self) -> dict:
        """This config in transformers' form (``DeepseekOcr2Config(**d)`` builds the same model)."""
        s, e, t = self.sam, self.encoder, self.text
        return {
            "model_type": MODEL_TYPE, "image_token_id": self.image_token_id,
            "vision_config": {
                "sam_config": {**asdict(s), "global_attn_indexes": list(s.global_attn_indexes),
                               "downsample_channels": list(s.downsample_channels)},
                "encoder_config": {k: v for k, v in asdict(e).items() if k != "rope_theta"}
                | {"rope_parameters": {"rope_type": "default", "rope_theta": e.rope_theta}, "vocab_size": 1}},
            "text_config": {
                **{k: v for k, v in asdict(t).items() if k not in ("first_k_dense", "rope_theta")},
                "mlp_layer_types": ["dense" if not t.is_sparse(i) else "sparse" for i in range(t.num_hidden_layers)],
                "rope_parameters": {"rope_type": "default", "rope_theta": t.rope_theta}},
        }


def _pick(cls, d: dict, source: str, renames: dict[str, str] | None = None, **extra) -> Any:
    """``cls`` from the keys of ``d`` it has (after ``renames``); unknown keys are ignored (a
    config.json carries many that do not change the model)."""
    names = {f.name: f for f in fields(cls)}
    kw = {}
    for k, v in d.items():
        k = (renames or {}).get(k, k)
        if k in names:
            kw[k] = tuple(v) if isinstance(v, list) else v
    kw.update(extra)
    try:
        return cls(**kw)
    except TypeError as e:
        raise CheckpointError(f"{source}: {e}") from None


def _rope_theta(d: dict, default: float) -> float:
    rp = d.get("rope_parameters") or {}
    if rp.get("rope_type", "default") != "default":
        raise CheckpointError(f"rope_type {rp.get('rope_type')!r}: only the default rope is supported")
    return float(rp.get("rope_theta", d.get("rope_theta", default)))


def _first_k_dense(types: list[str] | None, n_layers: int, source: str) -> int:
    """transformers' ``mlp_layer_types`` (dense/sparse per layer) as a dense prefix length."""
    if types is None:
        return 0
    if len(types) != n_layers or any(x not in ("dense", "sparse") for x in types):
        raise CheckpointError(f"{source}: text_config.mlp_layer_types must list dense/sparse for each of the "
                              f"{n_layers} layers, got {types}")
    k = types.index("sparse") if "sparse" in types else n_layers
    if any(x != "sparse" for x in types[k:]):
        raise CheckpointError(f"{source}: text_config.mlp_layer_types {types}: dense layers must all come first")
    return k


def _from_transformers(d: dict, source: str) -> DeepseekOCR2Config:
    vis = d.get("vision_config") or {}
    sam_d, enc_d, txt_d = vis.get("sam_config") or {}, vis.get("encoder_config") or {}, d.get("text_config") or {}
    sam = _pick(SamConfig, sam_d, source)
    if "mlp_dim" not in sam_d and "hidden_size" in sam_d:
        sam = replace(sam, mlp_dim=int(sam.hidden_size * float(sam_d.get("mlp_ratio", 4.0))))
    enc = _pick(EncoderConfig, enc_d, source, rope_theta=_rope_theta(enc_d, EncoderConfig.rope_theta))
    n_layers = int(txt_d.get("num_hidden_layers", TextConfig.num_hidden_layers))
    text = _pick(TextConfig, txt_d, source, rope_theta=_rope_theta(txt_d, TextConfig.rope_theta),
                 first_k_dense=_first_k_dense(txt_d.get("mlp_layer_types"), n_layers, source))
    if txt_d.get("topk_method", "greedy") != "greedy":
        raise CheckpointError(f"{source}: text_config.topk_method {txt_d.get('topk_method')!r}: only greedy routing")
    if txt_d.get("num_key_value_heads") is None:
        text = replace(text, num_key_value_heads=text.num_attention_heads)
    return DeepseekOCR2Config(sam=sam, encoder=enc, text=text,
                              image_token_id=int(d.get("image_token_id", DeepseekOCR2Config.image_token_id)))


def _from_release(d: dict, source: str) -> DeepseekOCR2Config:
    lang = d.get("language_config")
    if not isinstance(lang, dict):
        raise CheckpointError(f"{source}: model_type {RELEASED_MODEL_TYPE} needs a language_config object")
    if lang.get("use_mla") or lang.get("kv_lora_rank"):
        raise CheckpointError(f"{source}: language_config uses MLA (use_mla / kv_lora_rank): DeepSeek-OCR-2's "
                              "decoder is plain multi-head attention")
    if lang.get("topk_method", "greedy") != "greedy" or lang.get("scoring_func", "softmax") != "softmax":
        raise CheckpointError(f"{source}: language_config routing {lang.get('topk_method')}/"
                              f"{lang.get('scoring_func')}: only greedy softmax routing")
    if lang.get("norm_topk_prob"):
        raise CheckpointError(f"{source}: language_config.norm_topk_prob true: DeepSeek-OCR-2 does not renormalise")
    text = _pick(TextConfig, lang, source, renames={"first_k_dense_replace": "first_k_dense"})
    if lang.get("num_key_value_heads") is None:
        text = replace(text, num_key_value_heads=text.num_attention_heads)
    enc = EncoderConfig()
    proj = d.get("projector_config") or {}
    if proj and (int(proj.get("input_dim", enc.hidden_size)) != enc.hidden_size
                 or int(proj.get("n_embed", text.hidden_size)) != text.hidden_size):
        raise CheckpointError(f"{source}: projector_config {proj.get('input_dim')} -> {proj.get('n_embed')} does not "
                              f"match DeepSeek-OCR-2 ({enc.hidden_size} -> {text.hidden_size}); DeepSeek-OCR (v1) and "
                              "DeepSeek-VL2 are other models")
    return DeepseekOCR2Config(text=text, encoder=enc,
                              image_token_id=int(d.get("image_token_id", DeepseekOCR2Config.image_token_id)))


def released_config_json() -> dict:
    """The released checkpoint's config.json (DeepSeek's form) as far as it describes the model."""
    return {
        "model_type": RELEASED_MODEL_TYPE,
        "architectures": ["DeepseekOCR2ForCausalLM"],
        "language_config": {
            "model_type": "deepseek_v2", "hidden_size": 1280, "intermediate_size": 6848,
            "moe_intermediate_size": 896, "num_hidden_layers": 12, "num_attention_heads": 10,
            "num_key_value_heads": 10, "n_routed_experts": 64, "n_shared_experts": 2, "num_experts_per_tok": 6,
            "first_k_dense_replace": 1, "topk_method": "greedy", "n_group": 1, "topk_group": 1,
            "norm_topk_prob": False, "routed_scaling_factor": 1.0, "scoring_func": "softmax",
            "use_mla": False, "kv_lora_rank": None, "q_lora_rank": None, "vocab_size": 129280,
            "max_position_embeddings": 8192, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
            "bos_token_id": 0, "eos_token_id": 1, "torch_dtype": "bfloat16"},
        "projector_config": {"model_type": "mlp_projector", "projector_type": "linear", "input_dim": 896,
                             "n_embed": 1280},
        "image_token_id": 128815,
    }
