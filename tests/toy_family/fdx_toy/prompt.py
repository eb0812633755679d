"""toy_vlm's tokenizer, chat template and prompt builder.

The tokenizer is byte level (every UTF-8 byte one token, ids 4..259) with four special tokens
whose ids config.json names; a model dir needs no tokenizer files. The template renders
``<s>User: <image>...text\\nAssistant: `` with each image where its part is; the builder
expands each ``<image>`` to the fixed number of embeddings per image and gives 1D positions
[1, n] (rope over the token index: rope_delta is 0).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import torch

from fastdeploy_ext.inputs.messages import MessageError, normalize_messages

from .config import ToyConfig
from fastdeploy_ext.models.checkpoint_checks import decode_byte_tokens

PAD, BOS, EOS, IMAGE = "<pad>", "<s>", "</s>", "<image>"
BYTE_BASE = 4


class PromptError(ValueError):
    """The prompt cannot be built (bad messages, images and placeholders disagree)."""


@dataclass
class ByteTokenizer:
    special: dict[str, int]

    def __post_init__(self):
        clash = {t: i for t, i in self.special.items() if BYTE_BASE <= i < BYTE_BASE + 256}
        if clash:
            raise ValueError(f"special token ids {clash} collide with the byte ids {BYTE_BASE}..{BYTE_BASE + 255}")
        self._by_id = {i: t for t, i in self.special.items()}

    def encode(self, text: str) -> list[int]:
        out, i = [], 0
        while i < len(text):
            hit = next((t for t in self.special if text.startswith(t, i)), None)
            if hit is not None:
                out.append(self.special[hit])
                i += len(hit)
                continue
            j = min([k for k in (text.find(t, i) for t in self.special) if k > i] + [len(text)])
            out.extend(BYTE_BASE + b for b in text[i:j].encode("utf-8"))
            i = j
        return out

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return decode_byte_tokens(ids, BYTE_BASE, self._by_id, skip_special_tokens)


def load_tokenizer(cfg: ToyConfig) -> ByteTokenizer:
    return ByteTokenizer({PAD: cfg.pad_token_id, BOS: cfg.bos_token_id, EOS: cfg.eos_token_id,
                          IMAGE: cfg.image_token_id})


@dataclass(frozen=True)
class ChatTemplate:
    source: str = "built-in (toy_vlm)"

    def render(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        out = [BOS]
        for m in messages:
            role = m["role"]
            body = "".join(IMAGE if p["type"] == "image" else p["text"] for p in m["content"])
            if role == "user":
                out.append(f"User: {body}\n")
            elif role == "assistant":
                out.append(f"Assistant: {body}{EOS}")
            elif role == "system":
                out.append(f"{body}\n")
            else:
                raise PromptError(f"unsupported role {role!r} (user, assistant or system)")
        if add_generation_prompt:
            out.append("Assistant: ")
        return "".join(out)


@dataclass
class Prompt:
    token_ids: list[int]
    positions: torch.Tensor                  # int64 [1, n]
    rope_delta: int = 0
    image_grids: list[tuple[int, int, int]] = field(default_factory=list)
    image_token_ranges: list[tuple[int, int]] = field(default_factory=list)   # [start, end) per image

    @property
    def image_runs(self) -> list[tuple[int, int]]:
        """(offset, length) of each image's placeholder run (what the engine places rows at)."""
        return [(a, b - a) for a, b in self.image_token_ranges]




def build_prompt(tokenizer: ByteTokenizer, template: ChatTemplate, cfg: ToyConfig, *, messages=None, prompt=None,
                 image_grids: Sequence[tuple[int, int, int]] = ()) -> Prompt:
    """``messages`` (or ``prompt``: one user turn, the images first) -> token ids with each
    image placeholder expanded to ``cfg.embeddings_per_image`` image tokens, 1D positions."""
    grids = [tuple(int(x) for x in g) for g in image_grids]
    for i, g in enumerate(grids):
        if g != cfg.grid:
            raise PromptError(f"image {i}: grid {g}, but every toy_vlm image has the grid {cfg.grid}")
    if messages is None:
        if prompt is None:
            raise PromptError("give messages or a prompt")
        messages = [{"role": "user", "content": [{"type": "image"}] * len(grids) + [{"type": "text", "text": prompt}]}]
    try:
        msgs = normalize_messages(messages).messages      # the framework's one normalizer
    except MessageError as e:
        raise PromptError(str(e)) from None
    n_parts = sum(p["type"] == "image" for m in msgs for p in m["content"])
    if n_parts != len(grids):
        raise PromptError(f"the messages have {n_parts} image part(s) but {len(grids)} image(s) were given")
    ids, ranges = [], []
    img, per = cfg.image_token_id, cfg.embeddings_per_image
    for t in tokenizer.encode(template.render(msgs)):
        if t == img:
            ranges.append((len(ids), len(ids) + per))
            ids.extend([img] * per)
        else:
            ids.append(t)
    if len(ranges) != len(grids):
        raise PromptError(f"the rendered prompt has {len(ranges)} image placeholder(s) for {len(grids)} image(s)")
    return Prompt(ids, torch.arange(len(ids)).view(1, -1), 0, grids, ranges)
