"""Tiny random PaddleOCR-VL model dirs for the generation path: vision + projector + ERNIE
decoder written by transformers' save_pretrained, a byte-level BPE tokenizer trained in-process
(`tokenizers`), tokenizer_config.json and the released chat template.

The special tokens get small ids (the tiny vocab has 320 entries) and config.json names them, as
the released config does for its 103k vocab: <unk>/pad 0, bos 1, eos 2, image placeholder 3,
IMAGE_START 4, IMAGE_END 5. The decoder is small but keeps what kernels care about: GQA (4 query
heads over 2 KV heads), mrope sections over head_dim 32, RMSNorm, SiLU MLP. Tied (no
lm_head.weight in the checkpoint) or untied. Needs transformers (the `test` extra).
"""
from __future__ import annotations

import json
from pathlib import Path

import torch

from ..models.paddleocr_vl.tokenizer import (BOS, DEFAULT_CHAT_TEMPLATE, EOS, IMAGE_END, IMAGE_PLACEHOLDER,
                                             IMAGE_START, UNK)
from .tiny_model import TINY_PREPROCESSOR, TINY_VISION, write_paddle_twin

SPECIAL_TOKENS = (UNK, BOS, EOS, IMAGE_PLACEHOLDER, IMAGE_START, IMAGE_END)     # ids 0..5 in this order
TINY_IDS = dict(pad_token_id=0, bos_token_id=1, eos_token_id=2)
TINY_VL_IDS = dict(image_token_id=3, vision_start_token_id=4, vision_end_token_id=5, video_token_id=6)
TINY_GEN_TEXT = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2, head_dim=32, vocab_size=320, rms_norm_eps=1e-5,
                     rope_parameters={"rope_type": "default", "rope_theta": 500000.0, "mrope_section": [4, 6, 6]},
                     **TINY_IDS)
_CORPUS = ["User: OCR:\nAssistant: ", "Table Recognition:", "Formula Recognition:", "Chart Recognition:",
           "The quick brown fox jumps over the lazy dog.", "| a | b |\n|---|---|\n| 1 | 2 |", "E = mc^2",
           "Invoice number 12345, total 67.89 EUR", "Hello world, hello page."]


def hf_config(tied: bool = True):
    from transformers import PaddleOCRVLConfig
    text = dict(TINY_GEN_TEXT, tie_word_embeddings=tied)
    return PaddleOCRVLConfig(vision_config=dict(TINY_VISION), text_config=text, tie_word_embeddings=tied,
                             **TINY_VL_IDS)


def train_tokenizer(vocab_size: int = 320):
    """Byte-level BPE over a small corpus; the special tokens take ids 0..5."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE(unk_token=UNK))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(_CORPUS * 4, trainer)
    for i, t in enumerate(SPECIAL_TOKENS):
        assert tok.token_to_id(t) == i, (t, tok.token_to_id(t))
    assert tok.get_vocab_size() <= vocab_size
    return tok


def write_tokenizer_files(path: str | Path) -> Path:
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    train_tokenizer(TINY_GEN_TEXT["vocab_size"]).save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": BOS, "eos_token": EOS, "unk_token": UNK, "pad_token": UNK,
         "tokenizer_class": "PreTrainedTokenizerFast", "image_token": IMAGE_PLACEHOLDER}, indent=1))
    (path / "chat_template.jinja").write_text(DEFAULT_CHAT_TEMPLATE)
    return path


def write_tiny_vl_model(path: str | Path, *, tied: bool = True, seed: int = 0) -> Path:
    """save_pretrained of a random tiny PaddleOCRVLForConditionalGeneration (torch layout) plus
    tokenizer files, chat template and preprocessor config."""
    from transformers import PaddleOCRVLForConditionalGeneration
    path = Path(path)
    torch.manual_seed(seed)
    model = PaddleOCRVLForConditionalGeneration(hf_config(tied)).eval()
    # Norms start at 1 and position tables small: perturb so that wrong mappings show. The
    # decoder's weights are larger than the 0.02 init so that greedy decoding does not collapse
    # into repeating one token (a tied head at init copies its input) and depends on the image.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim == 1:
                p.add_(torch.randn_like(p) * 0.1)
            if "position_embedding" in name:
                p.normal_(0, 0.5)
            if "embed_tokens" in name or "lm_head" in name:
                p.normal_(0, 0.5)
            elif p.ndim == 2 and ".layers." in name and "visual" not in name:
                p.normal_(0, 0.2)
    model.save_pretrained(path)
    (path / "preprocessor_config.json").write_text(json.dumps(TINY_PREPROCESSOR, indent=1))
    write_tokenizer_files(path)
    return path


def write_tiny_vl_paddle_twin(src: str | Path, dst: str | Path) -> Path:
    """Paddle layout (every Linear [in, out], sharded) with the same tokenizer files."""
    import shutil
    dst = write_paddle_twin(src, dst)
    for f in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(Path(src) / f, Path(dst) / f)
    return dst


def load_reference(model_dir: str | Path, dtype: torch.dtype = torch.float32, device: str = "cpu"):
    from transformers import PaddleOCRVLForConditionalGeneration
    return PaddleOCRVLForConditionalGeneration.from_pretrained(str(model_dir), dtype=dtype).to(device).eval()


def reference_logits(model, token_ids: list[int], pixel_values: torch.Tensor | None = None,
                     grid_thw: list | None = None) -> torch.Tensor:
    """transformers' full-prompt forward: float32 logits [n, vocab] (mrope positions computed by
    its own get_rope_index from mm_token_type_ids)."""
    dev = next(model.parameters()).device
    ids = torch.tensor([token_ids], device=dev)
    kw = {}
    if pixel_values is not None:
        kw = dict(pixel_values=pixel_values.to(dev), image_grid_thw=torch.tensor(grid_thw, device=dev),
                  mm_token_type_ids=(ids == model.config.image_token_id).int())
    with torch.no_grad():
        return model(input_ids=ids, **kw).logits[0].float()
