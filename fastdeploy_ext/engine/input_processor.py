"""Request preprocessing, run in a worker pool off the step loop: OpenAI-style messages or a raw
prompt -> chat template -> token ids with the image placeholders expanded, mrope positions and
rope_delta; images decoded, resized and patchified with their host grid_thw.

Everything that can be wrong with a request is found here and raised as InvalidRequest, before
the request is queued.
"""
from __future__ import annotations

import time
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


# transformers' processor upscales a 1-pixel-wide image to min_pixels of pure interpolation; no
# text fits in it, so a request carrying one (a 1x1 image, say) is refused as bad input
MIN_IMAGE_SIDE = 2
# A cheap bound on a prompt's text before any tokenizing: no tokenizer averages more than ~8 UTF-8
# bytes a token on real text of any script (the byte-level dummy one: 1), so text of more than
# max_model_len * 32 bytes cannot fit in the context whatever it says; refused on its length alone.
MAX_TEXT_BYTES_PER_TOKEN = 32


def text_bytes(texts: list[str]) -> int:
    """UTF-8 length of the texts; InvalidRequest for text that is not valid Unicode (a lone
    surrogate, which JSON's \\ud800 escapes can carry, has no UTF-8 form and no tokenizer takes it)."""
    n = 0
    for t in texts:
        try:
            n += len(t.encode("utf-8"))
        except UnicodeEncodeError as e:
            raise InvalidRequest(f"the prompt's text has a lone surrogate {t[e.start]!r} at character {e.start}: "
                                 f"not valid Unicode") from None
    return n


def bounded_token_count(encode, text: str, limit: int) -> int:
    """len(encode(text)) when it is at most ``limit``; otherwise some count above ``limit``,
    found without tokenizing more than about twice the text that ``limit`` tokens cover: growing
    prefixes (doubling from 4 * (limit + 1) characters) cut before a whitespace character, where
    BPE pre-tokenizers (byte-level, metaspace: every tokenizer the engine loads) split anyway,
    so a prefix's tokens are the first tokens of the whole text. A huge text over the context
    costs a bounded tokenizer call, not one over all of it."""
    n = 4 * (limit + 1)
    while n < len(text):
        cut = _whitespace_before(text, n)
        count = len(encode(text[:cut]))
        if count > limit:
            return count
        n *= 2
    return len(encode(text))


def _whitespace_before(text: str, n: int) -> int:
    """The last cut <= n where text[cut] is whitespace and text[cut - 1] is not (n if none)."""
    i = n
    while i > 0 and not text[i].isspace():
        i -= 1
        if n - i > 4096:            # one enormous word: cut inside it
            return n
    while i > 0 and text[i - 1].isspace():
        i -= 1
    return i if i > 0 else n


@dataclass
class InputLimits:
    max_images: int
    max_encoder_patches: int
    max_model_len: int

    @property
    def max_text_bytes(self) -> int:
        return self.max_model_len * MAX_TEXT_BYTES_PER_TOKEN

    def check_counts(self, n_images: int, texts: list[str]) -> int:
        """The checks that need no tokenizer and no image: the number of images
        (--limit-mm-per-prompt) and the text's byte length. Run before any image is fetched,
        decoded or resized and before any text is tokenized (the server runs them too, before
        its fetches). Returns the text's UTF-8 length."""
        if n_images > self.max_images:
            raise InvalidRequest(f"{n_images} images in one prompt; --limit-mm-per-prompt allows {self.max_images}")
        n = text_bytes(texts)
        if n > self.max_text_bytes:
            raise InvalidRequest(f"the prompt's text is {n} bytes, more than --max-model-len {self.max_model_len} "
                                 f"tokens can hold (at most {MAX_TEXT_BYTES_PER_TOKEN} bytes a token: "
                                 f"{self.max_text_bytes} bytes)")
        return n

    def max_request_pixels(self, patch_size: int, merge_size: int) -> int:
        """The largest resized image a request may ask for with mm_processor_kwargs: one whose
        patches fit --max-encoder-patches and whose tokens fit --max-model-len."""
        return min(self.max_encoder_patches * patch_size ** 2, self.max_model_len * (patch_size * merge_size) ** 2)


def message_texts(messages: list[dict]) -> list[str]:
    """The text parts of split_messages' output."""
    out = []
    for m in messages:
        c = m["content"]
        if isinstance(c, str):
            out.append(c)
        else:
            out.extend(p["text"] for p in c if p.get("type") == "text")
    return out


class InputProcessor:
    def __init__(self, builder: PromptBuilder, image_processor, limits: InputLimits):
        self.builder = builder
        self.image_processor = image_processor
        self.limits = limits
        self._overridden: dict[tuple, Any] = {}   # (min_pixels, max_pixels) -> processor, a few at most

    def request_preprocessor_config(self, kwargs: Any):
        """The preprocessor config for a request's ``mm_processor_kwargs`` (min/max_pixels bound
        the resize, as in vLLM), checked against the server's limits: no image is touched and
        nothing is built (the server calls it before fetching the request's images)."""
        if not isinstance(kwargs, dict):
            raise InvalidRequest(f"mm_processor_kwargs must be an object, got {kwargs!r}")
        from ..models.paddleocr_vl.processor import request_config
        cfg = self.image_processor.cfg
        try:
            return request_config(cfg, kwargs, self.limits.max_request_pixels(cfg.patch_size, cfg.merge_size))
        except ValueError as e:
            raise InvalidRequest(str(e)) from None

    def processor_for(self, kwargs: Any):
        """The image processor for a request's ``mm_processor_kwargs``; the default one when
        there are none."""
        if not kwargs:
            return self.image_processor
        cfg = self.request_preprocessor_config(kwargs)
        key = (cfg.min_pixels, cfg.max_pixels)
        proc = self._overridden.get(key)
        if proc is None:
            proc = type(self.image_processor)(cfg)
            if len(self._overridden) >= 16:          # bounded: clients choose these values
                self._overridden.pop(next(iter(self._overridden)), None)
            self._overridden[key] = proc
        return proc

    def _check_text_tokens(self, texts: list[str]) -> None:
        """More text tokens than --max-model-len allows: refused after tokenizing a bounded
        prefix of the text, before the full prompt is built."""
        limit, total = self.limits.max_model_len, 0
        encode = self.builder.tokenizer.encode
        for t in texts:
            total += bounded_token_count(encode, t, limit - total)
            if total > limit:
                raise InvalidRequest(f"the prompt's text has more than {limit} tokens; --max-model-len "
                                     f"{limit} leaves no room for output")

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
        lim = self.limits
        texts = message_texts(messages)
        n_bytes = lim.check_counts(len(images), texts)
        image_processor = self.processor_for(prompt.get("mm_processor_kwargs"))
        if n_bytes > lim.max_model_len:     # every token covers >= 1 byte: fewer bytes cannot overflow
            self._check_text_tokens(texts)
        processed = []
        for k, src in enumerate(images):
            try:
                processed.append(image_processor.preprocess(src, max_patches=lim.max_encoder_patches))
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
