"""What the engine hands back per request: deltas while it runs, the whole output once at the end.

Every RequestOutput carries only what is new since the previous output of its request
(``delta_token_ids``, ``delta_text``, ``delta_logprobs``) and the running count
``num_output_tokens``; building one costs O(new tokens), and a consumer that keeps outputs
queued holds O(sequence) memory, never O(sequence^2). The final output (``finished``) also
carries the whole generation (``token_ids``, ``text``, ``logprobs``) for consumers that want only
the end (the offline LLM, non-streaming server requests); these are None before it.

``finish_reason`` is None until the last output: stop, length, abort, repetition, or error (a
failure of this request alone, ``error`` says why; the other requests run on).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from .sequence import RequestMetrics


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[dict] | None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    delta_token_ids: list[int]           # generated ids new since the previous output
    delta_text: str                      # text new since the previous output
    delta_logprobs: list[dict] | None    # per new token: {"token_id", "logprob", "rank", "top"}
    num_output_tokens: int               # generated so far, this output included
    finish_reason: str | None            # None until the last output: stop, length, abort, repetition, error
    stop_reason: int | str | None        # the stop string / stop token id that ended it
    token_ids: list[int] | None = None   # the final output only: every generated id
    text: str | None = None              # the final output only: the whole text
    logprobs: list[dict] | None = None   # the final output only: per generated token
    cumulative_logprob: float | None = None
    error: str | None = None             # finish_reason "error": why this request failed
    metrics: RequestMetrics = field(default_factory=RequestMetrics)
    _text_parts: list[str] | None = field(default=None, repr=False, compare=False)   # absorb() pending

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def outputs(self) -> list[CompletionOutput]:
        """vLLM's shape: the whole generation on the final output, the delta before it."""
        if self.finished:
            return [CompletionOutput(0, self.text or "", self.token_ids or [], self.cumulative_logprob,
                                     self.logprobs, self.finish_reason, self.stop_reason)]
        return [CompletionOutput(0, self.delta_text, self.delta_token_ids, self.cumulative_logprob,
                                 self.delta_logprobs)]

    def absorb(self, newer: "RequestOutput") -> None:
        """Fold the next output of the same request into this one (a queue coalescing outputs
        that nobody has read yet): deltas appended in place, everything else the newer's.
        The caller owns this output's lists (they are fresh per output) and calls settle()
        before handing it on; text pieces are joined once there (linear, not quadratic)."""
        self.delta_token_ids.extend(newer.delta_token_ids)
        if self._text_parts is None:
            self._text_parts = [self.delta_text]
        self._text_parts.append(newer.delta_text)
        if newer.delta_logprobs is not None:
            if self.delta_logprobs is None:
                self.delta_logprobs = []
            self.delta_logprobs.extend(newer.delta_logprobs)
        for name in ("num_output_tokens", "finish_reason", "stop_reason", "token_ids", "text", "logprobs",
                     "cumulative_logprob", "error", "metrics"):
            setattr(self, name, getattr(newer, name))

    def settle(self) -> "RequestOutput":
        """Join the text that absorb() collected into delta_text."""
        if self._text_parts is not None:
            self.delta_text, self._text_parts = "".join(self._text_parts), None
        return self
