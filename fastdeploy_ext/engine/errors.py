"""Errors of the generation engine that callers act on."""
from __future__ import annotations


class InvalidRequest(ValueError):
    """A request the engine refuses before queueing it (bad image, prompt too long, bad sampling
    parameters, too many images...). The message names the problem; the engine stays healthy."""


class EngineDead(RuntimeError):
    """The step loop died; `engine.error` says why. No request can be served any more."""
