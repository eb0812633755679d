"""Errors of the generation engine that callers act on."""
from __future__ import annotations


class InvalidRequest(ValueError):
    """A request the engine refuses before queueing it (bad image, prompt too long, bad sampling
    parameters, too many images...). The message names the problem; the engine stays healthy."""


class EngineDead(RuntimeError):
    """The step loop died; `engine.error` says why. No request can be served any more."""


class RequestFailed(RuntimeError):
    """One request failed inside the engine after it was queued (its sampling, detokenization,
    stop checks or output building raised, or its logits were not finite); the others run on and
    the engine stays healthy. Raised to that request's consumer by AsyncLLMEngine.generate; the
    offline engine reports it as a RequestOutput with finish_reason "error"."""

    def __init__(self, request_id: str, reason: str):
        super().__init__(f"request {request_id} failed: {reason}")
        self.request_id, self.reason = request_id, reason
