"""The one error type a page can fail with, anywhere in the parse pipeline: which stage failed
and why, in words a user can act on. The writer records ``stage`` and ``message`` in
errors.jsonl; the run goes on with the other pages."""
from __future__ import annotations

#: the pipeline's stages, in the order a page goes through them; "worker": every worker that held the
#: page was lost (a distributed run's --max-attempts)
STAGES = ("input", "render", "layout", "vlm", "assemble", "write", "worker")


class PageError(Exception):
    """A page (or a whole input file) that cannot be parsed. ``str(e)`` = ``"<stage>: <message>"``."""

    def __init__(self, stage: str, message: str):
        if stage not in STAGES:
            raise ValueError(f"unknown parse stage {stage!r} (one of {', '.join(STAGES)})")
        self.stage = stage
        self.message = message
        super().__init__(f"{stage}: {message}")

    def __reduce__(self):  # crosses process pools (render workers) despite the custom __init__
        return (PageError, (self.stage, self.message))
