"""Load PaddleOCR-VL weights from a local model directory (or build random ones).

Accepts tensor names as released / as transformers' save_pretrained writes them
(`visual.vision_model.*`, `mlp_AR.*`, `model.*` decoder, `lm_head.*` when untied) and as
transformers names them in memory (`model.visual.*`, `model.projector.*`,
`model.language_model.*`), single-file or sharded safetensors, in torch layout (Linear
[out, in]) or Paddle layout (Linear [in, out]). The vision path (encoder + projector) and the
text decoder load separately (`load_vision`, `load_text`) from the same files.

The layout is decided from the shape of a non-square Linear weight (vision `mlp.fc1.weight` is
[intermediate, hidden] in torch layout): config.json's `dtype`/`torch_dtype` key cannot tell them
apart since transformers 5 writes `dtype` too.
"""
from __future__ import annotations

import json
import logging
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Literal

import torch

from ..interface import CheckpointError
from .config import PaddleOCRVLConfig
from .text import ErnieTextModel
from .vision import PaddleOCRVLVision

log = logging.getLogger(__name__)

ModelFormat = Literal["auto", "torch", "paddle"]
MODEL_FORMATS = ("auto", "torch", "paddle")

_ALIASES = ((re.compile(r"^model\.visual\."), "visual."),
            (re.compile(r"^model\.projector\."), "mlp_AR."),
            (re.compile(r"^model\.language_model\."), "model."))
_V = "visual.vision_model."
_IGNORED = re.compile(r"\.(packing_position_embedding|head)\.")   # released extras we never use


@dataclass(frozen=True)
class LoadReport:
    model_dir: str | None
    files: tuple[str, ...]
    layout: str                 # "torch" | "paddle" | "random"
    layout_reason: str
    tensors_loaded: int


def _canonical(name: str) -> str:
    for pat, repl in _ALIASES:
        name = pat.sub(repl, name)
    return name


def safetensors_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as e:
            raise CheckpointError(f"{index}: not a valid safetensors index ({e})") from None
        files = sorted({model_dir / f for f in weight_map.values()})
        missing = [str(f) for f in files if not f.is_file()]
        if missing:
            raise CheckpointError(f"{index} lists shards that do not exist: {', '.join(missing)}")
        return files
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{model_dir}: no *.safetensors files")
    return files


def _iter_tensors(files: list[Path], wanted) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors import SafetensorError, safe_open
    for f in files:
        try:
            with safe_open(str(f), framework="pt") as h:
                for raw in h.keys():
                    name = _canonical(raw)
                    if wanted(name):
                        yield name, h.get_tensor(raw)
        except (SafetensorError, OSError, RuntimeError) as e:  # corrupt header or truncated file
            raise CheckpointError(f"{f}: cannot read safetensors file ({e})") from None


def _wanted(name: str) -> bool:
    return (name.startswith(_V) or name.startswith("mlp_AR.")) and not _IGNORED.search(name)


_T = "model."
_TEXT_KEY = f"{_T}layers.0.mlp.gate_proj.weight"
_VISION_KEY = f"{_V}encoder.layers.0.mlp.fc1.weight"


def _wanted_text(name: str) -> bool:
    return (name.startswith(_T) or name.startswith("lm_head.")) and not _IGNORED.search(name)


def detect_layout(tensors: dict[str, torch.Tensor], cfg: PaddleOCRVLConfig, forced: ModelFormat,
                  key: str = _VISION_KEY) -> tuple[str, str]:
    """torch or paddle, from the shape of one non-square Linear weight (``key``: the vision fc1
    or the decoder's gate_proj)."""
    if key == _TEXT_KEY:
        torch_shape = (cfg.text.intermediate_size, cfg.text.hidden_size)
    else:
        torch_shape = (cfg.vision.intermediate_size, cfg.vision.hidden_size)
    shape = tuple(tensors[key].shape) if key in tensors else None
    if forced != "auto":
        expect = torch_shape if forced == "torch" else torch_shape[::-1]
        if shape is not None and shape != expect:
            raise CheckpointError(
                f"--model-format {forced} expects {key} of shape {list(expect)}, the checkpoint has {list(shape)}")
        return forced, "forced by --model-format"
    if shape is None:
        raise CheckpointError(f"cannot detect the weight layout: {key} is missing from the checkpoint")
    if shape == torch_shape:
        return "torch", f"{key} is {list(shape)} = [out, in]"
    if shape == torch_shape[::-1]:
        return "paddle", f"{key} is {list(shape)} = [in, out] (Paddle export)"
    raise CheckpointError(f"{key} has shape {list(shape)}; config.json implies {list(torch_shape)} (torch) "
                          f"or {list(torch_shape[::-1])} (paddle)")


def _to_ours(tensors: dict[str, torch.Tensor], cfg: PaddleOCRVLConfig, layout: str) -> dict[str, torch.Tensor]:
    """Rename to our module's parameter names, fuse q/k/v, flatten the patch conv, undo Paddle's
    [in, out] Linear layout. Embedding tables and norms are layout-independent."""
    def linear(name: str) -> torch.Tensor:
        w = tensors.pop(name)
        return w.t() if layout == "paddle" else w

    out: dict[str, torch.Tensor] = {}
    vc = cfg.vision
    e = f"{_V}embeddings."
    out["encoder.patch_embedding.weight"] = tensors.pop(e + "patch_embedding.weight").reshape(vc.hidden_size, -1)
    out["encoder.patch_embedding.bias"] = tensors.pop(e + "patch_embedding.bias")
    out["encoder.position_embedding"] = tensors.pop(e + "position_embedding.weight")
    for i in range(vc.num_hidden_layers):
        src, dst = f"{_V}encoder.layers.{i}.", f"encoder.layers.{i}."
        a = src + "self_attn."
        out[dst + "qkv.weight"] = torch.cat([linear(a + f"{p}_proj.weight") for p in "qkv"])
        out[dst + "qkv.bias"] = torch.cat([tensors.pop(a + f"{p}_proj.bias") for p in "qkv"])
        out[dst + "out_proj.weight"] = linear(a + "out_proj.weight")
        out[dst + "out_proj.bias"] = tensors.pop(a + "out_proj.bias")
        for m in ("fc1", "fc2"):
            out[dst + f"{m}.weight"] = linear(src + f"mlp.{m}.weight")
            out[dst + f"{m}.bias"] = tensors.pop(src + f"mlp.{m}.bias")
        for ln in ("layer_norm1", "layer_norm2"):
            for p in ("weight", "bias"):
                out[dst + f"{ln}.{p}"] = tensors.pop(src + f"{ln}.{p}")
    for p in ("weight", "bias"):
        out[f"encoder.post_layernorm.{p}"] = tensors.pop(f"{_V}post_layernorm.{p}")
        out[f"projector.pre_norm.{p}"] = tensors.pop(f"mlp_AR.pre_norm.{p}")
    for m in ("linear_1", "linear_2"):
        out[f"projector.{m}.weight"] = linear(f"mlp_AR.{m}.weight")
        out[f"projector.{m}.bias"] = tensors.pop(f"mlp_AR.{m}.bias")
    return out


def build_vision_model(cfg: PaddleOCRVLConfig) -> PaddleOCRVLVision:
    with torch.device("meta"):
        return PaddleOCRVLVision(cfg.vision, cfg.text.hidden_size, cfg.projector_eps)


def load_vision(model_dir: str | Path | None, *, dtype: torch.dtype, device: torch.device,
                model_format: ModelFormat = "auto", cfg: PaddleOCRVLConfig | None = None,
                seed: int = 0) -> tuple[PaddleOCRVLVision, PaddleOCRVLConfig, LoadReport]:
    """Vision encoder + projector with weights from ``model_dir``, or random weights from the
    built-in 0.9B config when ``model_dir`` is None (``--load-format dummy``)."""
    if model_format not in MODEL_FORMATS:
        raise ValueError(f"model_format must be one of {MODEL_FORMATS}, got {model_format!r}")
    if model_dir is None:
        cfg = cfg or PaddleOCRVLConfig()
        model = _random_init(build_vision_model(cfg), seed)
        model = model.to(device=device, dtype=dtype).eval()
        n = sum(1 for _ in model.parameters())
        return model, cfg, LoadReport(None, (), "random", "--load-format dummy: random weights", n)

    ckpt = _Checkpoint.open(model_dir, cfg, model_format, _wanted, "vision")
    model = build_vision_model(ckpt.cfg)
    n = ckpt.assign(model, _to_ours, dtype)
    model = model.to(device=device).eval()
    log.info("loaded %d tensors from %d file(s) in %s layout (%s)", n, len(ckpt.files), ckpt.layout, ckpt.reason)
    return model, ckpt.cfg, ckpt.report(n)


def _text_to_ours(tensors: dict[str, torch.Tensor], cfg: PaddleOCRVLConfig, layout: str) -> dict[str, torch.Tensor]:
    """Decoder tensors -> ErnieTextModel names: q/k/v and gate/up fused into one Linear each,
    Paddle's [in, out] Linear weights transposed (the embedding table is [vocab, hidden] in
    both layouts; an untied Paddle lm_head is a Linear, so [hidden, vocab])."""
    def linear(name: str) -> torch.Tensor:
        w = tensors.pop(name)
        return w.t() if layout == "paddle" else w

    out = {"embed_tokens.weight": tensors.pop(f"{_T}embed_tokens.weight"),
           "norm.weight": tensors.pop(f"{_T}norm.weight")}
    if "lm_head.weight" in tensors:
        out["lm_head.weight"] = linear("lm_head.weight")
    for i in range(cfg.text.num_hidden_layers):
        src, dst = f"{_T}layers.{i}.", f"layers.{i}."
        out[dst + "qkv_proj.weight"] = torch.cat([linear(src + f"self_attn.{p}_proj.weight") for p in "qkv"])
        out[dst + "o_proj.weight"] = linear(src + "self_attn.o_proj.weight")
        out[dst + "gate_up_proj.weight"] = torch.cat([linear(src + f"mlp.{p}_proj.weight") for p in ("gate", "up")])
        out[dst + "down_proj.weight"] = linear(src + "mlp.down_proj.weight")
        for ln in ("input_layernorm", "post_attention_layernorm"):
            out[dst + f"{ln}.weight"] = tensors.pop(src + f"{ln}.weight")
    return out


def build_text_model(cfg: PaddleOCRVLConfig, tied: bool) -> ErnieTextModel:
    with torch.device("meta"):
        return ErnieTextModel(cfg.text, tied)


def _finish_text(model: ErnieTextModel, device: torch.device) -> ErnieTextModel:
    # the rope buffers are computed, not loaded: rebuild them off the meta device, in fp32
    rope = type(model.rope)(model.cfg.head_dim, model.cfg.rope_theta, tuple(model.cfg.mrope_section))
    model.rope = rope
    return model.to(device=device).eval()


def load_text(model_dir: str | Path | None, *, dtype: torch.dtype, device: torch.device,
              model_format: ModelFormat = "auto", cfg: PaddleOCRVLConfig | None = None,
              seed: int = 0) -> tuple[ErnieTextModel, PaddleOCRVLConfig, LoadReport]:
    """The ERNIE-4.5 decoder (embeddings, layers, norm, LM head) from ``model_dir``, or random
    weights from the built-in config when ``model_dir`` is None. The LM head is tied to the
    embedding table exactly when the checkpoint has no ``lm_head.weight`` (the released 0.9B
    ships one and transformers then uses it, whatever config.json says about tying)."""
    if model_format not in MODEL_FORMATS:
        raise ValueError(f"model_format must be one of {MODEL_FORMATS}, got {model_format!r}")
    if model_dir is None:
        cfg = cfg or PaddleOCRVLConfig()
        model = _random_init(build_text_model(cfg, tied=False), seed + 1)   # as released: its own lm_head
        model = _finish_text(model.to(dtype=dtype), device)
        n = sum(1 for _ in model.parameters())
        return model, cfg, LoadReport(None, (), "random", "--load-format dummy: random weights", n)

    ckpt = _Checkpoint.open(model_dir, cfg, model_format, _wanted_text, "text", key=_TEXT_KEY)
    tied = "lm_head.weight" not in ckpt.tensors
    model = build_text_model(ckpt.cfg, tied)
    n = ckpt.assign(model, _text_to_ours, dtype)
    model = _finish_text(model, device)
    head = "tied to the embeddings (no lm_head.weight)" if tied else "untied (lm_head.weight present)"
    log.info("loaded the text decoder: %d tensors, %s layout, LM head %s", n, ckpt.layout, head)
    return model, ckpt.cfg, ckpt.report(n)


@dataclass
class _Checkpoint:
    """One part's tensors read from a model dir, with the layout they are in: the steps the
    vision and text loaders share (find the files, detect the layout, convert the names and
    layouts, check every shape against the config, load)."""
    model_dir: Path
    cfg: PaddleOCRVLConfig
    files: list[Path]
    tensors: dict[str, torch.Tensor]
    layout: str
    reason: str
    part: str

    @classmethod
    def open(cls, model_dir: str | Path, cfg: PaddleOCRVLConfig | None, model_format: ModelFormat, wanted,
             part: str, **layout_kw) -> "_Checkpoint":
        model_dir = Path(model_dir)
        if not model_dir.is_dir():
            raise CheckpointError(f"{model_dir}: model directory does not exist")
        cfg = cfg or PaddleOCRVLConfig.from_model_dir(model_dir)
        files = safetensors_files(model_dir)
        tensors = dict(_iter_tensors(files, wanted))
        layout, reason = detect_layout(tensors, cfg, model_format, **layout_kw)
        return cls(model_dir, cfg, files, tensors, layout, reason, part)

    def assign(self, model: torch.nn.Module, convert, dtype: torch.dtype) -> int:
        """convert(tensors, cfg, layout) -> our state dict (it pops what it uses); the shapes
        are checked against ``model`` before its parameters are replaced. Returns the count."""
        try:
            state = convert(self.tensors, self.cfg, self.layout)
        except KeyError as e:
            raise CheckpointError(f"{self.model_dir}: tensor {e.args[0]} is missing from the checkpoint") from None
        if self.tensors:
            log.info("ignoring %d unused %s tensors, e.g. %s", len(self.tensors), self.part, next(iter(self.tensors)))
        expected = dict(model.state_dict())
        for name, t in state.items():
            if tuple(t.shape) != tuple(expected[name].shape):
                raise CheckpointError(f"{self.model_dir}: tensor for {name} has shape {list(t.shape)}, "
                                      f"config.json implies {list(expected[name].shape)}")
        state = {k: v.to(dtype=dtype).contiguous() for k, v in state.items()}
        model.load_state_dict(state, assign=True, strict=True)
        return len(state)

    def report(self, n: int) -> LoadReport:
        return LoadReport(str(self.model_dir), tuple(str(f) for f in self.files), self.layout, self.reason, n)


def _random_init(model: torch.nn.Module, seed: int) -> torch.nn.Module:
    """A model built on the meta device, materialised on the CPU with every parameter drawn
    here: the modules' own default init (kaiming for 0.5 B Linear weights, ~10 s on two cores)
    would only be overwritten. Buffers are left empty: the callers rebuild the computed ones."""
    model = model.to_empty(device="cpu")
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0.0, 0.02, generator=g)
            elif p.ndim == 1:   # norm scales
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.02, generator=g)
    return model
