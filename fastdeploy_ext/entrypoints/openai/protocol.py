"""The request models of `/v1/chat/completions` and the response shapes.

Parsing is strict: an unknown top-level parameter is a 400 that names it (a typo such as
``max_token`` must not be silently ignored), and a wrong type is a 400 that names the field
(numbers are JSON numbers: ``true``, ``"5"`` or ``5.0`` is not an integer, as pydantic's lax mode
would have it; an integer is a float).
Ranges (temperature >= 0, top_p in (0, 1], ...) are the engine's `SamplingParams.validate`,
checked once there. Before any of that, `parse_json_body` turns the raw bytes into JSON values
the rest can trust (nesting depth bounded, text valid Unicode, numbers finite and 64-bit), so a
hostile body is a 400 naming the problem, never a RecursionError, an overflow in the sampler or
a tokenizer's TypeError. Responses are plain dicts built by the functions below (one per shape)."""
from __future__ import annotations

import json
import math
import re
import reprlib
import time
from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, StrictFloat, StrictInt, ValidationError, model_validator

from ...inputs.messages import JSON_IMAGE_PART_TYPES, image_payload
from .errors import APIError, bad_request


# ---------------------------------------------------------------------- the raw body
#: Deepest nesting of arrays/objects a request may use. A chat request needs 5 (messages ->
#: message -> content -> part -> image_url); the cap keeps recursive code (json, pydantic, repr)
#: far from Python's recursion limit.
MAX_JSON_DEPTH = 32
INT64_MIN, INT64_MAX = -(1 << 63), (1 << 63) - 1
_SURROGATE = re.compile("[\ud800-\udfff]")


class _NonJSONConstant(str):
    """What Python's json makes of NaN / Infinity / -Infinity (not JSON): kept as a marker so the
    check below can name the field that carried it."""


def _path(parts: list) -> str:
    return ".".join(str(p) if isinstance(p, int) or not _SURROGATE.search(p) else ascii(p) for p in parts) or "body"


def _int_text(v: int) -> str:
    digits = str(abs(v))
    return str(v) if len(digits) <= 24 else f"{'-' if v < 0 else ''}{digits[:6]}... ({len(digits)} digits)"


def parse_json_body(raw: bytes) -> Any:
    """Request bytes -> a JSON value, or APIError(400) naming the problem and where it is."""
    try:
        body = json.loads(raw, parse_constant=_NonJSONConstant)
    except RecursionError:
        raise bad_request(f"the request body nests arrays/objects deeper than {MAX_JSON_DEPTH} levels",
                          code="invalid_json") from None
    except ValueError as e:   # JSONDecodeError, UnicodeDecodeError, an integer of > 4300 digits
        raise bad_request(f"the request body is not valid JSON ({e})", code="invalid_json") from None
    check_json_values(body)
    return body


def check_json_values(body: Any) -> None:
    """Walks the parsed body and refuses, naming the field: nesting deeper than MAX_JSON_DEPTH; a
    lone UTF-16 surrogate in any string or key (``\\ud800`` is legal JSON but not Unicode: no
    tokenizer can encode it); an integer outside 64 bits (no field means such a number; torch and
    the sampler overflow on it); a non-finite number (1e999, NaN, Infinity).

    One tight loop per container, recursing only into containers (at most MAX_JSON_DEPTH deep, so
    recursion is safe): linear in the values, a small fraction of json.loads' own cost, and paths
    are built only for the error message."""
    if type(body) is dict or type(body) is list:
        _check_container(body, None, 1)
    else:
        _check_scalar(body, None, None)


def _check_container(c: dict | list, where: tuple | None, depth: int) -> None:
    if depth > MAX_JSON_DEPTH:
        parts = _parts(where)
        raise bad_request(f"{_path(parts[:3])}...: the request body nests arrays/objects deeper than "
                          f"{MAX_JSON_DEPTH} levels", param=_path(parts[:1]), code="invalid_json")
    if type(c) is dict:
        for k in c:
            if not k.isascii():
                _check_scalar(k, where, k)
        items = c.items()
    else:
        items = enumerate(c)
    for k, x in items:
        t = type(x)
        if t is str:
            if not x.isascii() and _SURROGATE.search(x):
                _check_scalar(x, where, k)
        elif t is int:
            if x > INT64_MAX or x < INT64_MIN:
                _check_scalar(x, where, k)
        elif t is float:
            if x - x != 0.0:                          # inf - inf is nan; finite - itself is 0
                _check_scalar(x, where, k)
        elif t is dict or t is list:
            _check_container(x, (where, k), depth + 1)
        elif t is _NonJSONConstant:
            _check_scalar(x, where, k)


def _parts(where: tuple | None) -> list:
    out = []
    while where is not None:
        where, key = where
        out.append(key)
    return out[::-1]


def _check_scalar(v: Any, where: tuple | None, key: Any) -> None:
    """Raises the 400 for a bad scalar ``v`` at ``where`` + ``key`` (None: the body itself)."""
    at = _path(_parts(where) + ([] if key is None else [key]))
    if isinstance(v, _NonJSONConstant):
        raise bad_request(f"{at}: {str(v)} is not a JSON number", param=at, code="invalid_json")
    if isinstance(v, str):
        m = _SURROGATE.search(v)
        if m:
            raise bad_request(f"{at}: the text has a lone UTF-16 surrogate U+{ord(m.group()):04X} at character "
                              f"{m.start()} (not valid Unicode; send astral characters as a surrogate pair)",
                              param=at, code="invalid_unicode")
    elif isinstance(v, bool) or v is None:
        return
    elif isinstance(v, int):
        if not INT64_MIN <= v <= INT64_MAX:
            raise bad_request(f"{at}: the integer {_int_text(v)} is outside the 64-bit range [-2^63, 2^63 - 1]",
                              param=at, code="integer_out_of_range")
    elif isinstance(v, float):
        if not math.isfinite(v):
            raise bad_request(f"{at}: the number is out of range (not a finite 64-bit float)", param=at,
                              code="number_out_of_range")


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ImageURL(_Strict):
    url: str
    detail: Literal["auto", "low", "high"] | None = None   # accepted for compatibility; no effect


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ImagePart(_Strict):
    """An image part of a type a JSON body can carry (inputs/messages.py, the one normalizer):
    ``image_url`` (OpenAI chat; vLLM also takes the bare URL string), ``input_image`` (OpenAI
    Responses) or ``image`` (a URL string)."""
    type: Literal[JSON_IMAGE_PART_TYPES]
    image_url: Union[ImageURL, str, None] = None
    image: str | None = None

    @model_validator(mode="after")
    def _payload(self) -> "ImagePart":
        url = image_payload(self.model_dump(exclude_none=True), "this part")   # MessageError: a ValueError
        if not isinstance(url, str):
            raise ValueError(f"a {self.type!r} part needs its image URL")
        extra = {"image_url", "image"} - {"image" if self.type == "image" else "image_url"}
        if any(getattr(self, k) is not None for k in extra):
            raise ValueError(f"a {self.type!r} part takes no {sorted(extra)[0]!r}")
        return self

    @property
    def url(self) -> str:
        return image_payload(self.model_dump(exclude_none=True))


ContentPart = Annotated[Union[TextPart, ImagePart], Field(discriminator="type")]   # errors name the part type


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant"]
    content: Union[str, list[ContentPart], None] = None
    name: str | None = None


class StreamOptions(_Strict):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class MMProcessorKwargs(_Strict):
    """vLLM's per-request processor overrides; here the resize bounds of the image processor."""
    min_pixels: StrictInt | None = Field(None, ge=1)
    max_pixels: StrictInt | None = Field(None, ge=1)


class RepetitionGuardOverride(_Strict):
    enabled: bool | None = None
    max_period: StrictInt | None = None
    min_repeats: StrictInt | None = None
    min_span: StrictInt | None = None


class NGramBlockerSpec(_Strict):
    """engine.sampling_params.NGramBlocker's fields (DeepSeek-OCR's no-repeat n-gram rule)."""
    size: StrictInt
    window: StrictInt
    whitelist: list[StrictInt] = Field(default_factory=list)


class ChatCompletionRequest(_Strict):
    model: str | None = None
    messages: list[ChatMessage] = Field(min_length=1)
    # >= 1 checked here, not only in SamplingParams: the engine sees one name for both fields, so
    # only the schema can name the one the client sent
    max_tokens: StrictInt | None = Field(None, ge=1)
    max_completion_tokens: StrictInt | None = Field(None, ge=1)
    temperature: StrictFloat | None = None
    top_p: StrictFloat | None = None
    seed: StrictInt | None = None
    stop: Union[str, list[str], None] = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    logprobs: bool = False
    top_logprobs: StrictInt | None = None
    n: StrictInt = 1
    user: str | None = None                # accepted, unused (OpenAI clients send it)
    # vLLM's extra parameters
    top_k: StrictInt | None = None
    repetition_penalty: StrictFloat | None = None
    ignore_eos: bool = False
    stop_token_ids: list[StrictInt] | None = None
    min_tokens: StrictInt | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    mm_processor_kwargs: MMProcessorKwargs | None = None
    # vLLM's scheduling priority: lower is scheduled earlier, FIFO among equals (engine/scheduler.py);
    # an integer of the int64 range (check_json_values refuses a wider one, naming the field)
    priority: StrictInt = 0
    # ours: per-request override of the server's repetition-loop guard (e.g. {"enabled": false}
    # for a page that legitimately repeats), keys of engine.sampling_params.RepetitionGuard
    repetition_guard: RepetitionGuardOverride | None = None
    # ours: DeepSeek-OCR's per-request n-gram blocker ({"size": 30, "window": 90, "whitelist": [...]})
    ngram_blocker: NGramBlockerSpec | None = None

    @property
    def output_limit(self) -> int | None:
        """max_completion_tokens (OpenAI's current name) wins over max_tokens (the old one)."""
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


KNOWN_PARAMS = frozenset(ChatCompletionRequest.model_fields)


def _loc(loc: tuple) -> str:
    # pydantic reports union members as extra loc entries ("str", "list[...]"); keep field path
    return ".".join(str(p) for p in loc if isinstance(p, int) or not any(c in str(p) for c in "[]"))


def parse_chat_request(body: Any) -> ChatCompletionRequest:
    """JSON body -> request, or APIError(400) naming every unknown parameter / the bad field."""
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object")
    unknown = sorted(k for k in body if k not in KNOWN_PARAMS)
    if unknown:
        raise bad_request(f"unknown parameter{'s' if len(unknown) > 1 else ''}: {', '.join(unknown)} "
                          f"(supported: {', '.join(sorted(KNOWN_PARAMS))})", param=unknown[0],
                          code="unknown_parameter")
    try:
        req = ChatCompletionRequest.model_validate(body)
    except ValidationError as e:
        errs = e.errors()
        parts = []
        for err in errs[:3]:
            where = _loc(err["loc"]) or "body"
            # reprlib: bounded work for a huge input (a 10M-item list in the wrong field)
            got = f" (got {reprlib.repr(err['input'])[:80]})" if err["type"] != "missing" else ""
            parts.append(f"{where}: {err['msg']}{got}")
        raise bad_request("invalid request: " + "; ".join(parts), param=_loc(errs[0]["loc"]) or None) from None
    if req.top_logprobs is not None and not req.logprobs:
        raise bad_request("top_logprobs needs logprobs: true", param="top_logprobs")
    if req.stream_options is not None and not req.stream:
        raise bad_request("stream_options needs stream: true", param="stream_options")
    return req


# ---------------------------------------------------------------------- responses
def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def chat_completion(rid: str, model: str, created: int, text: str, finish_reason: str | None,
                    stop_reason: Any, logprobs: dict | None, use: dict) -> dict:
    return {"id": rid, "object": "chat.completion", "created": created, "model": model,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                         "logprobs": logprobs, "finish_reason": finish_reason, "stop_reason": stop_reason}],
            "usage": use}


def chat_chunk(rid: str, model: str, created: int, delta: dict | None, finish_reason: str | None = None,
               stop_reason: Any = None, logprobs: dict | None = None, use: dict | None = None,
               with_usage_field: bool = False) -> dict:
    """One `chat.completion.chunk`. ``delta=None`` is the usage-only chunk (empty choices)."""
    chunk: dict = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
                   "choices": [] if delta is None else [
                       {"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason,
                        "stop_reason": stop_reason}]}
    if with_usage_field or use is not None:
        chunk["usage"] = use
    return chunk


def model_list(names: list[str], root: str, max_model_len: int | None) -> dict:
    now = int(time.time())
    return {"object": "list", "data": [
        {"id": n, "object": "model", "created": now, "owned_by": "fastdeploy_ext", "root": root,
         "max_model_len": max_model_len} for n in names]}


def not_found_model(name: str, served: list[str]) -> APIError:
    return APIError(404, f"the model `{name}` does not exist (served: {', '.join(served)})", "model",
                    "model_not_found")
