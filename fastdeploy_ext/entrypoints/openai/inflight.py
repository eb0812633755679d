"""Bytes held in memory for requests: their bodies and the images fetched for them, across all
requests at once (``--max-inflight-body-bytes``).

The per-request limits (``--max-request-body-bytes``, the same cap per fetched image) bound one
request; this bounds them all together, so that many large requests at the same moment cannot
add up to gigabytes before any is admitted. A request that would push the total over the
limit is answered 429 (retry later). Each request's bytes are counted in its `Ledger`, set by
the ASGI gate for the duration of the request (a context variable, so the media fetcher deep
inside the chat handler charges the same ledger without being handed it), and given back when
the request's answer is complete."""
from __future__ import annotations

import contextvars
from dataclasses import dataclass

from .errors import APIError


class ByteBudget:
    """The server-wide count. Single-threaded (the event loop), so no lock."""

    def __init__(self, limit: int):
        self.limit = limit
        self.used = 0

    def try_take(self, n: int) -> bool:
        if self.used + n > self.limit:
            return False
        self.used += n
        return True

    def give(self, n: int) -> None:
        self.used -= n


@dataclass
class Ledger:
    """One request's share of the budget."""
    budget: ByteBudget
    held: int = 0

    def take(self, n: int) -> None:
        """Count n more bytes for this request, or raise the 429."""
        if not self.budget.try_take(n):
            raise over_budget(self.budget, n)
        self.held += n

    def release(self) -> None:
        self.budget.give(self.held)
        self.held = 0


current_ledger: contextvars.ContextVar[Ledger | None] = contextvars.ContextVar("fastdeploy_ext_ledger", default=None)


def charge(n: int) -> None:
    """Count n bytes against the current request's ledger (no-op outside a request)."""
    ledger = current_ledger.get()
    if ledger is not None:
        ledger.take(n)


def over_budget(budget: ByteBudget, n: int) -> APIError:
    return APIError(429, f"the server already holds {budget.used} bytes of request bodies and fetched images; "
                         f"{n} more would pass --max-inflight-body-bytes {budget.limit}; retry later",
                    code="inflight_bytes_full")
