"""Request preprocessing, run in a worker pool off the step loop: OpenAI-style messages or a raw
prompt -> the model family's prompt (token ids with each item's placeholders expanded, rope
positions [P, n], rope_delta, the placeholder runs it made) and the family's image processor's
host tensors -> a ProcessedPrompt with one MultiModalItem per image.

What is asked of the model side (a family, through :class:`FamilyPromptBuilder`):
- a prompt builder (:class:`PromptBuilder`);
- an image processor: ``preprocess(src, max_patches=...)`` -> an object with ``pixel_values``
  (the host encoder inputs), ``grid_thw`` (the host grid), ``source`` and ``original_size``
  ((h, w) decoded); optionally ``request_config(kwargs, max_cost=..., max_model_len=...)`` for
  a request's ``mm_processor_kwargs`` (a config the processor's type is built from;
  ValueError naming the key). Without it a request with mm_processor_kwargs is refused.

Everything that can be wrong with a request is found here and raised as InvalidRequest, before
the request is queued.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Protocol, Sequence

import torch

from ..inputs.images import ImageInputError, resolve_source
from ..inputs.messages import MessageError, NormalizedMessages, normalize_messages
from .errors import InvalidRequest
from .sequence import MultiModalItem, ProcessedPrompt


class BuiltPrompt(Protocol):
    """What a family's build_prompt returns (models/interface.py)."""
    token_ids: list[int]
    positions: torch.Tensor              # int64 [P, len(token_ids)]
    rope_delta: int
    image_runs: list[tuple[int, int]]    # (offset, length) of each image's placeholder run


class PromptBuilder(Protocol):
    """The model side of prompt building."""
    image_token_id: int
    eos_token_ids: tuple[int, ...]
    vocab_size: int
    position_rows: int
    tokenizer: Any

    def build(self, messages: list[dict], grids: list[tuple[int, ...]]) -> BuiltPrompt:
        """Chat template over normalized messages ({"type": "text"} / {"type": "image"} parts)."""

    def output_sizes(self, grids: Sequence[tuple[int, ...]]) -> list[int]:
        """Encoder output rows (= placeholder tokens) per image."""

    def encoder_cost(self, grid: tuple[int, ...]) -> int:
        """The scheduler's encoder cost of one image."""


class FamilyPromptBuilder:
    """A loaded model's prompt side: its family's hooks over its config, tokenizer and chat
    template (from the model dir, or the family's built-in ones with --load-format dummy)."""

    def __init__(self, family, cfg, tokenizer, chat_template):
        if tokenizer is None:
            raise ValueError("the model has no tokenizer: load it with with_text=True")
        self.family, self.cfg, self.tokenizer, self.template = family, cfg, tokenizer, chat_template
        self.image_token_id = family.image_token_id(cfg)
        self.vocab_size = family.vocab_size(cfg)
        self.eos_token_ids = tuple(family.eos_token_ids(cfg))
        self.position_rows = family.position_rows

    @classmethod
    def from_runner(cls, runner) -> "FamilyPromptBuilder":
        return cls(runner.family, runner.cfg, runner.tokenizer, runner.chat_template)

    def build(self, messages, grids):
        return self.family.build_prompt(self.tokenizer, self.template, self.cfg, messages=messages, image_grids=grids)

    def output_sizes(self, grids):
        return self.family.output_sizes(self.cfg, grids)

    def encoder_cost(self, grid):
        return self.family.encoder_cost(self.cfg, grid)


def image_source(obj: Any) -> Any:
    """An image payload -> what the image processor reads: a path, bytes or a PIL image
    (fastdeploy_ext/inputs: data: URLs decoded, file:// paths, remote URLs refused)."""
    try:
        return resolve_source(obj)
    except ImageInputError as e:
        raise InvalidRequest(str(e)) from None


def split_messages(messages: Any) -> NormalizedMessages:
    """OpenAI-style messages -> normalized messages and their image payloads (inputs/messages.py),
    as InvalidRequest when malformed."""
    try:
        norm = normalize_messages(messages)
    except MessageError as e:
        raise InvalidRequest(str(e)) from None
    if any(im is None for im in norm.images):
        k = norm.images.index(None)
        raise InvalidRequest(f"image part {k} of the messages carries no image (give 'image', 'image_url' or "
                             f"'image_pil' with it)")
    return norm


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
    max_encoder_cost: int          # --max-encoder-patches: one item's encoder cost may not exceed it
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


class InputProcessor:
    def __init__(self, builder: PromptBuilder, image_processor, limits: InputLimits):
        self.builder = builder
        self.image_processor = image_processor
        self.limits = limits
        self._overridden: dict[Any, Any] = {}     # request config -> processor, a few at most

    def request_preprocessor_config(self, kwargs: Any):
        """The processor config for a request's ``mm_processor_kwargs`` (PaddleOCR-VL: min/max_pixels
        bound the resize, as in vLLM), checked against the server's limits by the processor's
        ``request_config`` hook: no image is touched and nothing is built (the server calls it
        before fetching the request's images)."""
        if not isinstance(kwargs, dict):
            raise InvalidRequest(f"mm_processor_kwargs must be an object, got {kwargs!r}")
        hook = getattr(self.image_processor, "request_config", None)
        if hook is None:
            raise InvalidRequest(f"mm_processor_kwargs: this model's image processor takes none, got {kwargs!r}")
        try:
            return hook(kwargs, max_cost=self.limits.max_encoder_cost, max_model_len=self.limits.max_model_len)
        except ValueError as e:
            raise InvalidRequest(str(e)) from None

    def processor_for(self, kwargs: Any):
        """The image processor for a request's ``mm_processor_kwargs``; the default one when
        there are none."""
        if not kwargs:
            return self.image_processor
        cfg = self.request_preprocessor_config(kwargs)
        proc = self._overridden.get(cfg)
        if proc is None:
            proc = type(self.image_processor)(cfg)
            device = getattr(self.image_processor, "device", None)
            if device is not None:                   # a request's config keeps where views are made
                proc = proc.on_device(device)
            if len(self._overridden) >= 16:          # bounded: clients choose these values
                self._overridden.pop(next(iter(self._overridden)), None)
            self._overridden[cfg] = proc
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
            norm = split_messages(prompt["messages"])
            messages, images = norm.messages, [image_source(im) for im in norm.images]
            texts, prompt_text = norm.texts, None
        elif isinstance(prompt.get("prompt"), str):
            images = prompt.get("images")
            mm = prompt.get("multi_modal_data") or {}
            if images is None:
                images = mm.get("image")
            if images is None:
                images = []
            elif not isinstance(images, (list, tuple)):
                images = [images]
            images = [image_source(im.get("url", im.get("image_url", im.get("image"))) if isinstance(im, dict) else im)
                      for im in images]
            # a raw prompt is the text of one user turn after its images, rendered with the
            # model's chat template (OCR users pass the task, e.g. "OCR:")
            prompt_text = prompt["prompt"]
            messages = [{"role": "user", "content": [{"type": "image"}] * len(images)
                         + [{"type": "text", "text": prompt_text}]}]
            texts = [prompt_text]
        else:
            raise InvalidRequest("a prompt needs 'messages' (chat) or 'prompt' (a string)")
        lim, builder = self.limits, self.builder
        n_bytes = lim.check_counts(len(images), texts)
        image_processor = self.processor_for(prompt.get("mm_processor_kwargs"))
        if n_bytes > lim.max_model_len:     # every token covers >= 1 byte: fewer bytes cannot overflow
            self._check_text_tokens(texts)
        processed = []
        for k, src in enumerate(images):
            try:
                processed.append(image_processor.preprocess(src, max_patches=lim.max_encoder_cost))
            except ValueError as e:       # ImageInputError names the source and the problem
                raise InvalidRequest(f"image {k}: {e}") from None
        grids = [tuple(im.grid_thw) for im in processed]
        costs = [int(builder.encoder_cost(g)) for g in grids]
        for k, (im, cost) in enumerate(zip(processed, costs)):
            h, w = im.original_size
            if min(h, w) < MIN_IMAGE_SIDE:
                raise InvalidRequest(f"image {k} ({im.source}) is {w}x{h} pixels: too small to hold text (each "
                                     f"side needs at least {MIN_IMAGE_SIDE} pixels)")
            if cost > lim.max_encoder_cost:
                raise InvalidRequest(f"image {k} ({im.source}) has an encoder cost of {cost} (patches), above "
                                     f"--max-encoder-patches {lim.max_encoder_cost}")
        try:
            built = builder.build(messages, grids)
        except ValueError as e:
            raise InvalidRequest(str(e)) from None
        ids = list(built.token_ids)
        if len(ids) >= lim.max_model_len:
            raise InvalidRequest(f"the prompt has {len(ids)} tokens; --max-model-len {lim.max_model_len} leaves no "
                                 "room for output")
        runs, sizes = list(built.image_runs), builder.output_sizes(grids)
        if [n for _, n in runs] != list(sizes):
            raise InvalidRequest(f"the prompt has placeholder runs of {[n for _, n in runs]} tokens for images of "
                                 f"{list(sizes)} embeddings")
        items = [MultiModalItem(im.pixel_values, g, off, n, cost, im.source)
                 for (off, n), im, g, cost in zip(runs, processed, grids, costs)]
        out = ProcessedPrompt(ids, built.positions, int(built.rope_delta), items, prompt_text,
                              time.perf_counter() - t0)
        try:
            out.validate(builder.position_rows)
        except ValueError as e:           # the family's prompt builder broke the contract
            raise InvalidRequest(f"the model's prompt builder: {e}") from None
        # the runner puts encoder rows at the placeholder tokens: the runs must be exactly those
        img = builder.image_token_id
        if sum(sizes) != sum(1 for t in ids if t == img) or any(ids[i] != img for it in items
                                                                for i in range(it.offset, it.end)):
            raise InvalidRequest(f"the model's prompt builder: placeholder runs {runs} are not the prompt's "
                                 f"image tokens ({img})")
        return out
