"""Multimodal prompt building: chat template -> token ids with each image placeholder expanded to
h*w/4 image tokens, and the 3D mrope positions exactly as transformers' `get_rope_index`.

Positions (int64 [3, n]): a text token takes one position on all three axes; an image's token at
merged row i, column j after s positions gets (s, s+i, s+j); the text after the image continues
at s + max(h, w) / merge. ``rope_delta`` = max position + 1 - n, so a decode step's position is
(sequence length + rope_delta) on all axes. Text-only prompts use 1D positions (delta 0).
Message parts are normalized by fastdeploy_ext/inputs/messages.py (the one normalizer the
engine and the server use too). Everything here is host work on Python ints and CPU tensors.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import torch

from ...inputs.messages import MessageError
from ...inputs.messages import normalize_messages as _normalize
from .config import PaddleOCRVLConfig
from .tokenizer import ChatTemplate, TextTokenizer

TASK_PROMPTS = {
    "ocr": "OCR:",
    "table": "Table Recognition:",
    "formula": "Formula Recognition:",
    "chart": "Chart Recognition:",
}


class PromptError(ValueError):
    """The prompt cannot be built (placeholders and images disagree, bad messages)."""


@dataclass
class Prompt:
    token_ids: list[int]
    positions: torch.Tensor              # int64 [3, n]
    rope_delta: int
    image_grids: list[tuple[int, int, int]] = field(default_factory=list)
    image_runs: list[tuple[int, int]] = field(default_factory=list)   # (offset, length) of each image's
                                                                     # placeholder run, in order

    @property
    def num_image_tokens(self) -> int:
        return sum(n for _, n in self.image_runs)


def image_token_count(grid: tuple[int, int, int], merge: int) -> int:
    t, h, w = grid
    return t * (h // merge) * (w // merge)


def rope_index(token_ids: Sequence[int], image_token_id: int, grids: Sequence[tuple[int, int, int]],
               merge: int) -> tuple[torch.Tensor, int, list[tuple[int, int]]]:
    """transformers' get_rope_index for one sequence: (positions [3, n], rope_delta, image runs as
    (offset, length)).
    Each maximal run of image tokens is one image, in order (as transformers groups them)."""
    ids = torch.as_tensor(list(token_ids), dtype=torch.int64)
    n = ids.numel()
    is_img = (ids == image_token_id).tolist()
    runs: list[tuple[int, int]] = []
    i = 0
    while i < n:
        if is_img[i]:
            j = i
            while j < n and is_img[j]:
                j += 1
            runs.append((i, j - i))
            i = j
        else:
            i += 1
    if len(runs) != len(grids):
        raise PromptError(f"the prompt has {len(runs)} image-token run(s) but {len(grids)} image(s) were given")
    pieces, pos, prev = [], 0, 0
    for (s, length), grid in zip(runs, grids):
        e = s + length
        t, h, w = grid
        gh, gw = h // merge, w // merge
        if e - s != t * gh * gw:
            raise PromptError(f"image of grid {tuple(grid)} needs {t * gh * gw} image tokens, the prompt has {e - s}")
        if s > prev:
            pieces.append(torch.arange(pos, pos + s - prev).expand(3, -1))
            pos += s - prev
        tt = torch.arange(t).view(t, 1, 1).expand(t, gh, gw).reshape(-1) + pos
        hh = torch.arange(gh).view(1, gh, 1).expand(t, gh, gw).reshape(-1) + pos
        ww = torch.arange(gw).view(1, 1, gw).expand(t, gh, gw).reshape(-1) + pos
        pieces.append(torch.stack([tt, hh, ww]))
        pos += max(h, w) // merge
        prev = e
    if n > prev:
        pieces.append(torch.arange(pos, pos + n - prev).expand(3, -1))
    positions = torch.cat(pieces, 1) if pieces else torch.zeros(3, 0, dtype=torch.int64)
    delta = int(positions.max()) + 1 - n if n else 0
    return positions.contiguous(), delta, runs


def normalize_messages(messages: list[dict], num_images: int | None = None) -> list[dict]:
    """Messages in the template's shape (inputs/messages.py), checked to carry ``num_images``
    image parts when given. The image payloads are the caller's."""
    try:
        out = _normalize(messages).messages
    except MessageError as e:
        raise PromptError(str(e)) from None
    if num_images is not None:
        n = sum(p["type"] == "image" for m in out for p in m["content"])
        if n != num_images:
            raise PromptError(f"the messages have {n} image part(s) but {num_images} image(s) were given")
    return out


def task_messages(prompt: str, num_images: int = 1) -> list[dict]:
    """One user turn: the images, then the text (a task name like "ocr" maps to its prompt)."""
    text = TASK_PROMPTS.get(prompt, prompt)
    return [{"role": "user", "content": [{"type": "image"}] * num_images + [{"type": "text", "text": text}]}]


def tokens_and_positions(tokenizer: TextTokenizer, cfg: PaddleOCRVLConfig, text: str,
                         grids: Sequence[tuple[int, int, int]]) -> Prompt:
    """Tokenize a rendered prompt, expand each image placeholder token to h*w/4 image tokens and
    compute the mrope positions (1D for a text-only prompt)."""
    grids = [tuple(int(x) for x in g) for g in grids]
    ids = tokenizer.encode(text)
    merge, img = cfg.vision.spatial_merge_size, cfg.image_token_id
    n_placeholders = sum(1 for t in ids if t == img)
    if n_placeholders != len(grids):
        raise PromptError(f"the rendered prompt has {n_placeholders} image placeholder(s) for {len(grids)} image(s) "
                          f"(does the chat template emit one placeholder per image part?)")
    if not grids:
        return Prompt(ids, torch.arange(len(ids)).expand(3, -1).contiguous(), 0)
    expanded: list[int] = []
    g = iter(grids)
    for t in ids:
        if t == img:
            expanded.extend([img] * image_token_count(next(g), merge))
        else:
            expanded.append(t)
    positions, delta, ranges = rope_index(expanded, img, grids, merge)
    return Prompt(expanded, positions, delta, grids, ranges)


def build_prompt(tokenizer: TextTokenizer, template: ChatTemplate, cfg: PaddleOCRVLConfig, *,
                 messages: list[dict] | None = None, prompt: str | None = None,
                 image_grids: Sequence[tuple[int, int, int]] = (), add_generation_prompt: bool = True) -> Prompt:
    """Render the chat (``messages``, or ``prompt`` as one user turn with the images first),
    tokenize it, expand each image placeholder token to h*w/4 image tokens and compute the
    mrope positions. ``image_grids``: each image's (t, h, w) patch grid, in prompt order."""
    if messages is None:
        if prompt is None:
            raise PromptError("give messages or a prompt")
        messages = task_messages(prompt, len(image_grids))
    msgs = normalize_messages(messages, len(image_grids))
    return tokens_and_positions(tokenizer, cfg, template.render(msgs, add_generation_prompt), image_grids)
