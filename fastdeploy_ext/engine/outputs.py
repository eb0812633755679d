"""What the engine hands back per request: vLLM's RequestOutput/CompletionOutput shape, plus the
flat fields the streaming server reads (cumulative token_ids/text, delta_text, finish_reason)."""
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
    token_ids: list[int]                 # cumulative generated ids
    text: str                            # cumulative generated text
    delta_text: str                      # text new since the previous output of this request
    delta_token_ids: list[int]
    finish_reason: str | None            # None until the last output: stop, length, abort, repetition
    stop_reason: int | str | None        # the stop string / stop token id that ended it
    logprobs: list[dict] | None          # per generated token: {"token_id", "logprob", "rank", "top"}
    cumulative_logprob: float | None
    metrics: RequestMetrics = field(default_factory=RequestMetrics)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def outputs(self) -> list[CompletionOutput]:
        return [CompletionOutput(0, self.text, self.token_ids, self.cumulative_logprob, self.logprobs,
                                 self.finish_reason, self.stop_reason)]
