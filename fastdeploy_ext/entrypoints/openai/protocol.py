"""The request models of `/v1/chat/completions` and the response shapes.

Parsing is strict: an unknown top-level parameter is a 400 that names it (a typo such as
``max_token`` must not be silently ignored), and a wrong type is a 400 that names the field.
Ranges (temperature >= 0, top_p in (0, 1], ...) are the engine's `SamplingParams.validate`,
checked once there. Responses are plain dicts built by the functions below (one per shape)."""
from __future__ import annotations

import time
from typing import Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from .errors import APIError, bad_request


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ImageURL(_Strict):
    url: str
    detail: Literal["auto", "low", "high"] | None = None   # accepted for compatibility; no effect


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ImagePart(_Strict):
    type: Literal["image_url"]
    image_url: Union[ImageURL, str]       # vLLM also takes the bare URL string

    @property
    def url(self) -> str:
        return self.image_url if isinstance(self.image_url, str) else self.image_url.url


ContentPart = Union[TextPart, ImagePart]


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant"]
    content: Union[str, list[ContentPart], None] = None
    name: str | None = None


class StreamOptions(_Strict):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class MMProcessorKwargs(_Strict):
    """vLLM's per-request processor overrides; here the resize bounds of the image processor."""
    min_pixels: int | None = Field(None, ge=1)
    max_pixels: int | None = Field(None, ge=1)


class RepetitionGuardOverride(_Strict):
    enabled: bool | None = None
    max_period: int | None = None
    min_repeats: int | None = None
    min_span: int | None = None


class ChatCompletionRequest(_Strict):
    model: str | None = None
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    stop: Union[str, list[str], None] = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    n: int = 1
    user: str | None = None                # accepted, unused (OpenAI clients send it)
    # vLLM's extra parameters
    top_k: int | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    min_tokens: int | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    mm_processor_kwargs: MMProcessorKwargs | None = None
    # ours: per-request override of the server's repetition-loop guard (e.g. {"enabled": false}
    # for a page that legitimately repeats), keys of engine.sampling_params.RepetitionGuard
    repetition_guard: RepetitionGuardOverride | None = None

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
            parts.append(f"{where}: {err['msg']}" + (f" (got {err['input']!r:.80})" if err["type"] != "missing" else ""))
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
