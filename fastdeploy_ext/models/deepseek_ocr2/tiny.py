"""A tiny random DeepSeek-OCR-2 for tests and the conformance suite: the real geometry (1024 global
view, 768 crops, patch 16, 14x14 windows, 256/144 queries) at tiny widths, built and saved by
transformers (``save_pretrained``: DeepSeek's tensor names), so that our loader reads exactly
what a released checkpoint's layout is and transformers' model is the reference.

Weights are re-drawn (transformers' init gives SAM 1e-10 weights and leaves the view separator
uninitialised) at a scale where every tensor moves the outputs. The tokenizer is a word-level
one (ids 0 bos, 1 eos, 2 pad, 3 ``<image>``, then words), saved as tokenizer.json.
"""
from __future__ import annotations

import re
from pathlib import Path

import torch

WORDS = ["<bos>", "<eos>", "<pad>", "<image>", "<unk>", "Free", "OCR.", "Convert", "the", "document", "to",
         "markdown."]
VOCAB = 256
IMAGE_TOKEN_ID = 3


def transformers_config(**text_overrides):
    from transformers import DeepseekOcr2Config
    text = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
                num_key_value_heads=4, vocab_size=VOCAB, mlp_layer_types=["dense", "sparse", "sparse"],
                n_routed_experts=8, num_experts_per_tok=3, n_shared_experts=2, moe_intermediate_size=32,
                bos_token_id=0, eos_token_id=1, pad_token_id=2)
    text.update(text_overrides)
    return DeepseekOcr2Config(
        vision_config=dict(
            sam_config=dict(hidden_size=32, num_hidden_layers=4, num_attention_heads=2, global_attn_indexes=[1, 3],
                            window_size=14, image_size=1024, patch_size=16, output_channels=16,
                            downsample_channels=[32, 64]),
            encoder_config=dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                intermediate_size=128, vocab_size=1,
                                rope_parameters={"rope_type": "default", "rope_theta": 1e6})),
        text_config=text, image_token_id=IMAGE_TOKEN_ID)


def randomize(model: torch.nn.Module, seed: int) -> torch.nn.Module:
    """Weights where every tensor moves the outputs and greedy decoding varies with its input,
    yet bf16 stays within the suite's cosine bounds: matrices ~ N(0, gain^2 / fan_in) with gain 1
    in the vision tower (its 6 + 2 layers amplify rounding) and 1.5 in the decoder, token
    embeddings of unit scale (so the token, not a shared direction, decides the next one)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            if re.search(r"norm\d?\.weight$|layernorm\.weight$|layer_norm\d\.weight$", name):
                p.copy_(1 + 0.1 * noise)
            elif "embed_tokens" in name:
                p.copy_(noise)
            elif "pos_embed" in name or "query_" in name or "view_separator" in name:
                p.copy_(0.5 * noise)
            elif p.ndim == 1:
                p.copy_(0.05 * noise)
            else:
                gain = 1.5 if ("language_model" in name or name.startswith("lm_head")) else 1.0
                p.copy_(noise * (gain / p[0].numel() ** 0.5))
    return model


def tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast
    vocab = {w: i for i, w in enumerate(WORDS)}
    vocab.update({f"w{i}": i for i in range(len(WORDS), VOCAB)})
    tk = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tk.post_processor = processors.TemplateProcessing(single="<bos> $A", special_tokens=[("<bos>", 0)])
    return PreTrainedTokenizerFast(tokenizer_object=tk, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>",
                                   unk_token="<unk>", additional_special_tokens=["<image>"])


def build_reference(seed: int = 0, **text_overrides):
    """transformers' model (eval, fp32, eager SDPA) with the tiny config and re-drawn weights."""
    from transformers import DeepseekOcr2ForConditionalGeneration
    torch.manual_seed(seed)
    model = DeepseekOcr2ForConditionalGeneration(transformers_config(**text_overrides)).eval()
    return randomize(model, seed)


def write_checkpoint(path: str | Path, seed: int = 0, **text_overrides) -> Path:
    """A model dir as ``save_pretrained`` writes it (config.json, model.safetensors,
    tokenizer.json ...) with the tiny config."""
    path = Path(path)
    model = build_reference(seed, **text_overrides)
    model.save_pretrained(str(path))
    tokenizer().save_pretrained(str(path))
    return path


def processor(tok=None):
    """transformers' processor over the PIL image processor and the tiny tokenizer."""
    from transformers import DeepseekOcr2Processor
    from transformers.models.deepseek_ocr2.image_processing_pil_deepseek_ocr2 import DeepseekOcr2ImageProcessorPil
    return DeepseekOcr2Processor(image_processor=DeepseekOcr2ImageProcessorPil(), tokenizer=tok or tokenizer())
