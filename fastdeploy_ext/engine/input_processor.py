"""Request preprocessing, run in a worker pool off the step loop: OpenAI-style messages or a raw
prompt -> chat template -> token ids with the image placeholders expanded, mrope positions and
rope_delta; images decoded, resized and patchified with their host grid_thw.

Everything that can be wrong with a request is found here and raised as InvalidRequest, before
the request is queued.
"""
from __future__ import annotations

import time
import dataclasses
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from ..inputs.images import ImageInputError, resolve_source
from .errors import InvalidRequest
from .sequence import ImageInput, ProcessedPrompt


class PromptBuilder(Protocol):
    """The model side of prompt building (models/paddleocr_vl/prompt.py)."""
    image_token_id: int
    eos_token_ids: tuple[int, ...]
    vocab_size: int
    tokenizer: Any

    def build(self, messages: list[dict], grids: list[tuple[int, int, int]]) -> tuple[list[int], torch.Tensor, int]:
        """Chat template over messages whose content parts are {"type": "text"} / {"type": "image"}
        -> token ids (placeholders expanded to h*w/4 per image), mrope positions [3, n], rope_delta."""


class ModelPromptBuilder:
    """PaddleOCR-VL's: the runner's tokenizer and chat template (from the model dir, or the
    built-in ones with --load-format dummy) and models/paddleocr_vl/prompt.build_prompt."""

    def __init__(self, runner):
        cfg = runner.cfg
        self.cfg, self.tokenizer, self.template = cfg, runner.tokenizer, runner.chat_template
        if self.tokenizer is None:
            raise ValueError("the runner has no tokenizer: load the model with with_text=True")
        self.image_token_id = cfg.image_token_id
        self.vocab_size = cfg.text.vocab_size
        eos = getattr(cfg, "eos_token_id", None)
        eos = getattr(cfg.text, "eos_token_id", 2) if eos is None else eos
        self.eos_token_ids = tuple(eos) if isinstance(eos, (list, tuple)) else (int(eos),)

    def build(self, messages, grids):
        from ..models.paddleocr_vl.prompt import build_prompt
        p = build_prompt(self.tokenizer, self.template, self.cfg, messages=messages, image_grids=grids)
        return p.token_ids, p.positions, p.rope_delta


IMAGE_PART_TYPES = ("image_url", "image", "input_image", "image_pil")


def image_source(obj: Any) -> Any:
    """A message's image (a content part's value, or a bare object) -> what the image processor
    reads: a path, bytes or a PIL image (fastdeploy_ext/inputs: data: URLs decoded, file:// paths,
    remote URLs refused)."""
    if isinstance(obj, dict):
        obj = obj.get("url", obj.get("image_url", obj.get("image")))
    try:
        return resolve_source(obj)
    except ImageInputError as e:
        raise InvalidRequest(str(e)) from None


def split_messages(messages: Any) -> tuple[list[dict], list[Any]]:
    """OpenAI-style messages -> (messages with image parts as {"type": "image"}, image sources)."""
    if not isinstance(messages, list) or not messages:
        raise InvalidRequest("messages must be a non-empty list of {'role': ..., 'content': ...}")
    out, images = [], []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or "role" not in m:
            raise InvalidRequest(f"messages[{i}] must be a dict with 'role' and 'content'")
        content = m.get("content")
        if content is None or isinstance(content, str):
            out.append({"role": m["role"], "content": content or ""})
            continue
        if not isinstance(content, list):
            raise InvalidRequest(f"messages[{i}].content must be a string or a list of parts")
        parts = []
        for j, part in enumerate(content):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind == "text":
                parts.append({"type": "text", "text": str(part.get("text", ""))})
            elif kind in IMAGE_PART_TYPES:
                images.append(image_source(part.get(kind, part.get("image_url", part.get("url")))))
                parts.append({"type": "image"})
            else:
                raise InvalidRequest(f"messages[{i}].content[{j}]: unsupported part type {kind!r} "
                                     f"(text, {', '.join(IMAGE_PART_TYPES)})")
        out.append({"role": m["role"], "content": parts})
    return out, images


@dataclass
class InputLimits:
    max_images: int
    max_encoder_patches: int
    max_model_len: int


# transformers' processor upscales a 1-pixel-wide image to min_pixels of pure interpolation; no
# text fits in it, so a request carrying one is refused as bad input (the "1x1" case)
MIN_IMAGE_SIDE = 2
MM_PROCESSOR_KWARGS = ("min_pixels", "max_pixels")   # vLLM's per-request processor overrides we honour


class InputProcessor:
    def __init__(self, builder: PromptBuilder, image_processor, limits: InputLimits):
        self.builder = builder
        self.image_processor = image_processor
        self.limits = limits
        self._overridden: dict[tuple, Any] = {}   # (min_pixels, max_pixels) -> processor, a few at most

    def _processor_for(self, kwargs: Any):
        """The image processor for a request's ``mm_processor_kwargs`` (min/max_pixels bound the
        resize, as in vLLM); the default one when there are none."""
        if not kwargs:
            return self.image_processor
        if not isinstance(kwargs, dict) or set(kwargs) - set(MM_PROCESSOR_KWARGS):
            bad = sorted(set(kwargs) - set(MM_PROCESSOR_KWARGS)) if isinstance(kwargs, dict) else kwargs
            raise InvalidRequest(f"mm_processor_kwargs: unsupported {bad!r} (supported: {', '.join(MM_PROCESSOR_KWARGS)})")
        for k, v in kwargs.items():
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise InvalidRequest(f"mm_processor_kwargs.{k} must be a positive integer, got {v!r}")
        cfg = self.image_processor.cfg
        key = (kwargs.get("min_pixels", cfg.min_pixels), kwargs.get("max_pixels", cfg.max_pixels))
        proc = self._overridden.get(key)
        if proc is None:
            try:
                proc = type(self.image_processor)(dataclasses.replace(cfg, min_pixels=key[0], max_pixels=key[1]))
            except ValueError as e:       # e.g. min_pixels > max_pixels
                raise InvalidRequest(f"mm_processor_kwargs: {e}") from None
            if len(self._overridden) >= 16:          # bounded: clients choose these values
                self._overridden.pop(next(iter(self._overridden)))
            self._overridden[key] = proc
        return proc

    def process(self, prompt: dict) -> ProcessedPrompt:
        """prompt: {"messages": [...]} or {"prompt": str, "images" | "multi_modal_data": ...}."""
        t0 = time.perf_counter()
        if not isinstance(prompt, dict):
            raise InvalidRequest(f"a prompt is a dict with 'messages' or 'prompt', got {type(prompt).__name__}")
        if prompt.get("messages") is not None:
            messages, images = split_messages(prompt["messages"])
            prompt_text = None
        elif isinstance(prompt.get("prompt"), str):
            images = prompt.get("images")
            mm = prompt.get("multi_modal_data") or {}
            if images is None:
                images = mm.get("image")
            if images is None:
                images = []
            elif not isinstance(images, (list, tuple)):
                images = [images]
            images = [image_source(im) for im in images]
            # a raw prompt is the text of one user turn after its images, rendered with the
            # model's chat template (OCR users pass the task, e.g. "OCR:")
            prompt_text = prompt["prompt"]
            messages = [{"role": "user", "content": [{"type": "image"}] * len(images)
                         + [{"type": "text", "text": prompt_text}]}]
        else:
            raise InvalidRequest("a prompt needs 'messages' (chat) or 'prompt' (a string)")
        image_processor = self._processor_for(prompt.get("mm_processor_kwargs"))
        lim = self.limits
        if len(images) > lim.max_images:
            raise InvalidRequest(f"{len(images)} images in one prompt; --limit-mm-per-prompt allows {lim.max_images}")
        processed = []
        for k, src in enumerate(images):
            try:
                processed.append(image_processor.preprocess(src))
            except ValueError as e:       # ImageInputError names the source and the problem
                raise InvalidRequest(f"image {k}: {e}") from None
        for k, im in enumerate(processed):
            h, w = im.original_size
            if min(h, w) < MIN_IMAGE_SIDE:
                raise InvalidRequest(f"image {k} ({im.source}) is {w}x{h} pixels: too small to hold text (each "
                                     f"side needs at least {MIN_IMAGE_SIDE} pixels)")
            if im.num_patches > lim.max_encoder_patches:
                raise InvalidRequest(f"image {k} ({im.source}) has {im.num_patches} patches, above "
                                     f"--max-encoder-patches {lim.max_encoder_patches}")
        grids = [tuple(im.grid_thw) for im in processed]
        try:
            ids, positions, rope_delta = self.builder.build(messages, grids)
        except ValueError as e:
            raise InvalidRequest(str(e)) from None
        if len(ids) >= lim.max_model_len:
            raise InvalidRequest(f"the prompt has {len(ids)} tokens; --max-model-len {lim.max_model_len} leaves no "
                                 "room for output")
        offsets = _image_offsets(ids, self.builder.image_token_id)
        m2 = image_processor.cfg.merge_size ** 2
        if len(offsets) != len(processed) or any(
                n != im.num_patches // m2 for (_, n), im in zip(offsets, processed)):
            raise InvalidRequest(f"the prompt has {len(offsets)} image placeholder runs for {len(processed)} images")
        inputs = [ImageInput(im.pixel_values, tuple(im.grid_thw), off, n, im.source)
                  for (off, n), im in zip(offsets, processed)]
        out = ProcessedPrompt(list(ids), positions, int(rope_delta), inputs, prompt_text, time.perf_counter() - t0)
        out.validate()
        return out


def _image_offsets(ids: list[int], image_token_id: int) -> list[tuple[int, int]]:
    """(start, length) of each run of image-placeholder tokens."""
    runs, i, n = [], 0, len(ids)
    while i < n:
        if ids[i] == image_token_id:
            j = i
            while j < n and ids[j] == image_token_id:
                j += 1
            runs.append((i, j - i))
            i = j
        else:
            i += 1
    return runs
