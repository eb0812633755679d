"""DeepSeek-OCR-2's tokenizer, prompt format and prompt builder.

The model takes no chat template: a prompt is BOS + the user's text with ``<image>`` where each
image goes, e.g. ``<image>\\nFree OCR.`` or ``<image>\\n<|grounding|>Convert the document to
markdown.``. Messages render so: each image part as ``<image>\\n``, text parts as they are,
user turns only (an assistant turn, a system text are appended as plain text after the user's:
the model was trained on single-turn OCR prompts). Each ``<image>`` expands to the image's rows
(crops x 144 + 256 + 1); positions are 1D over the token index (rope_delta 0).

Tokenizer: the model dir's ``tokenizer.json`` (the ``tokenizers`` library), encoded without
special tokens (BOS is added here); without a model dir, a byte-level one whose specials map to
the config's ids, so the dummy path runs with no files.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

import torch

from ...inputs.messages import MessageError, normalize_messages
from .config import DeepseekOCR2Config
from .processor import num_crops
from ..checkpoint_checks import decode_byte_tokens

log = logging.getLogger(__name__)

BOS, EOS, IMAGE = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<image>"
BYTE_BASE = 3


class PromptError(ValueError):
    """The prompt cannot be built (bad messages, images and placeholders disagree)."""


class TokenizerError(ValueError):
    pass


@dataclass
class ByteTokenizer:
    """UTF-8 bytes as ids BYTE_BASE..BYTE_BASE+255, the specials as single tokens; other ids
    (a random model emits any) decode to U+FFFD."""
    special: dict[str, int]
    source: str = "built-in byte tokenizer"

    def __post_init__(self):
        clash = [t for t, i in self.special.items() if BYTE_BASE <= i < BYTE_BASE + 256]
        if clash:
            raise TokenizerError(f"special tokens {clash} collide with the byte ids {BYTE_BASE}..{BYTE_BASE + 255}")
        self._by_id = {i: t for t, i in self.special.items()}
        self._specials = sorted(self.special, key=len, reverse=True)

    def encode(self, text: str) -> list[int]:
        out, i = [], 0
        while i < len(text):
            hit = next((t for t in self._specials if text.startswith(t, i)), None)
            if hit is not None:
                out.append(self.special[hit])
                i += len(hit)
                continue
            out.extend(BYTE_BASE + b for b in text[i].encode("utf-8"))
            i += 1
        return out

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return decode_byte_tokens(ids, BYTE_BASE, self._by_id, skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self.special.get(token)


class FileTokenizer:
    """A tokenizer.json through the ``tokenizers`` library, no special tokens added on encode."""

    def __init__(self, tok, source: str):
        self.tok, self.source = tok, source

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.tok.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self.tok.token_to_id(token)


def builtin_special_tokens(cfg: DeepseekOCR2Config) -> dict[str, int]:
    return {BOS: cfg.text.bos_token_id, EOS: cfg.text.eos_token_id, IMAGE: cfg.image_token_id}


def load_tokenizer(model_dir: str | Path | None, cfg: DeepseekOCR2Config):
    if model_dir is None:
        return ByteTokenizer(builtin_special_tokens(cfg))
    f = Path(model_dir) / "tokenizer.json"
    if not f.is_file():
        raise TokenizerError(f"{model_dir}: no tokenizer.json")
    from tokenizers import Tokenizer
    try:
        tok = FileTokenizer(Tokenizer.from_file(str(f)), str(f))
    except Exception as e:
        raise TokenizerError(f"{f}: cannot load ({e})") from None
    got = tok.token_to_id(IMAGE)
    if got != cfg.image_token_id:
        raise TokenizerError(f"{f}: token {IMAGE} has id {got}, config.json says {cfg.image_token_id}")
    log.info("tokenizer from %s", f)
    return tok


@dataclass(frozen=True)
class PromptFormat:
    """DeepSeek-OCR-2's plain prompt (the engine's chat_template slot)."""
    source: str = "built-in (deepseek_ocr2: <image>\\n + text)"

    def render(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        return "".join(IMAGE + "\n" if p["type"] == "image" else p["text"] for m in messages for p in m["content"])


@dataclass
class Prompt:
    token_ids: list[int]
    positions: torch.Tensor                  # int64 [1, n]
    rope_delta: int = 0
    image_grids: list[tuple[int, int, int]] = field(default_factory=list)
    image_runs: list[tuple[int, int]] = field(default_factory=list)          # (offset, length) per image


def build_prompt(tokenizer, template: PromptFormat, cfg: DeepseekOCR2Config, *, messages=None, prompt=None,
                 image_grids: Sequence[tuple[int, int, int]] = ()) -> Prompt:
    """``messages`` (or ``prompt``: one user turn, the images first) -> BOS + ids with each
    ``<image>`` expanded to its image's rows; 1D positions."""
    grids = [tuple(int(x) for x in g) for g in image_grids]
    if messages is None:
        if prompt is None:
            raise PromptError("give messages or a prompt")
        messages = [{"role": "user", "content": [{"type": "image"}] * len(grids) + [{"type": "text", "text": prompt}]}]
    try:
        msgs = normalize_messages(messages).messages
    except MessageError as e:
        raise PromptError(str(e)) from None
    n_parts = sum(p["type"] == "image" for m in msgs for p in m["content"])
    if n_parts != len(grids):
        raise PromptError(f"the messages have {n_parts} image part(s) but {len(grids)} image(s) were given")
    img = cfg.image_token_id
    ids, runs = [cfg.text.bos_token_id], []
    for t in tokenizer.encode(template.render(msgs)):
        if t == img:
            if len(runs) == len(grids):
                raise PromptError(f"the prompt text has more {IMAGE} placeholders than the {len(grids)} image(s)")
            n = cfg.image_rows(num_crops(grids[len(runs)]))
            runs.append((len(ids), n))
            ids.extend([img] * n)
        else:
            ids.append(t)
    if len(runs) != len(grids):
        raise PromptError(f"the rendered prompt has {len(runs)} image placeholder(s) for {len(grids)} image(s)")
    return Prompt(ids, torch.arange(len(ids)).view(1, -1), 0, grids, runs)
