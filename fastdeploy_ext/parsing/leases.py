"""Work handed out as leases: a unit of pages, an expiry, an attempt count and a fencing token.

The coordinator owns one LeaseTable (in memory: a lease is only meaningful while its coordinator
lives; after a crash every unfinished page is simply pending again). A worker that stops
(SIGSTOP, a hung GPU, a lost Ray actor) lets its lease expire; its pages go back to the front of
the queue and are granted again under a new, higher token. When the stale worker wakes up and
sends its results, the commit checks the token against the page's current one and refuses
(``StaleLease``): a page is committed by the lease that currently holds it, or by none.
"""
from __future__ import annotations

import functools
import threading
import time
from collections import deque
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Callable, Iterable

if TYPE_CHECKING:
    from .pages import PageWork


def synchronized(method):
    """Run under the instance's ``_lock``: the coordinator may commit from a writer thread while
    another thread grants, renews or expires (the Workspace and its LeaseTable share one lock)."""
    @functools.wraps(method)
    def locked(self, *args, **kwargs):
        with self._lock:
            return method(self, *args, **kwargs)
    return locked


class StaleLease(RuntimeError):
    """A commit (or renewal) under a lease that expired or was superseded: the page is (or will
    be) redone under its current lease, so this result must not be written."""


@dataclass(frozen=True)
class Lease:
    lease_id: int
    worker: str
    keys: tuple[str, ...]
    expires_at: float        # on the table's clock (time.monotonic by default)
    attempt: int             # 1 for pages never leased before; the max over the lease's pages
    token: int               # fencing token: strictly increasing over every grant of this table


@dataclass
class _Held:
    lease: Lease
    ttl_s: float
    open: dict[str, PageWork]        # pages of the lease not yet committed or failed


class LeaseTable:
    def __init__(self, clock: Callable[[], float] = time.monotonic,
                 settled: Callable[[str], bool] | None = None, lock: threading.RLock | None = None):
        """``settled(key)``: the page needs no more work (done, or failed this run), so a stale
        ``pending`` list never re-grants it. The Workspace passes its own page states; without
        one the table remembers the keys settled through it."""
        self.clock = clock
        self._lock = lock or threading.RLock()
        self._settled_here: set[str] | None = None if settled else set()
        self._settled = settled or self._settled_here.__contains__
        self._next_id = 1
        self._next_token = 1
        self._held: dict[int, _Held] = {}
        self._owner: dict[str, int] = {}          # key -> token of the lease holding it now
        self._attempts: dict[str, int] = {}       # key -> grants so far (dropped once settled)
        self._returned: deque[PageWork] = deque()  # pages of expired leases: granted first

    # ------------------------------------------------------------------ granting
    @synchronized
    def grant(self, worker: str, pending: Iterable[PageWork], max_pages: int, ttl_s: float) -> Lease | None:
        """Lease up to ``max_pages`` pages nobody holds: returned pages of expired leases first,
        then ``pending`` in its order. None when there is nothing to hand out."""
        if max_pages < 1 or ttl_s <= 0:
            raise ValueError(f"a lease needs max_pages >= 1 and ttl_s > 0, got {max_pages}, {ttl_s}")
        taken: dict[str, PageWork] = {}

        def take(work: PageWork) -> None:
            if work.key not in self._owner and work.key not in taken and not self._settled(work.key):
                taken[work.key] = work

        while self._returned and len(taken) < max_pages:
            take(self._returned.popleft())
        if len(taken) < max_pages:
            # never pull an item we will not look at: ``pending`` may be a cursor that consumes
            for work in pending:
                take(work)
                if len(taken) == max_pages:
                    break
        if not taken:
            return None
        attempt = 0
        for key in taken:
            self._attempts[key] = self._attempts.get(key, 0) + 1
            attempt = max(attempt, self._attempts[key])
        lease = Lease(self._next_id, worker, tuple(taken), self.clock() + ttl_s, attempt, self._next_token)
        self._next_id += 1
        self._next_token += 1
        self._held[lease.lease_id] = _Held(lease, ttl_s, taken)
        for key in taken:
            self._owner[key] = lease.token
        return lease

    # ------------------------------------------------------------------ checking
    @synchronized
    def check(self, lease: Lease) -> bool:
        """The lease is the one this table holds under that id (same token) and not expired."""
        held = self._held.get(lease.lease_id)
        return held is not None and held.lease.token == lease.token and self.clock() < held.lease.expires_at

    @synchronized
    def check_key(self, lease: Lease, key: str) -> bool:
        """The fencing check at commit: the lease is current and ``key`` is still open under it."""
        return self.check(lease) and self._owner.get(key) == lease.token and key in self._held[lease.lease_id].open

    @synchronized
    def renew(self, lease: Lease, ttl_s: float | None = None) -> Lease:
        """Extend a current lease from now (by its original ttl unless given); StaleLease if it
        expired or was superseded. Returns the lease with its new expiry (same token)."""
        if not self.check(lease):
            raise StaleLease(f"lease {lease.lease_id} of worker {lease.worker!r} cannot be renewed: "
                             "it expired or was superseded")
        held = self._held[lease.lease_id]
        renewed = replace(lease, expires_at=self.clock() + (held.ttl_s if ttl_s is None else ttl_s))
        held.lease = renewed
        return renewed

    # ------------------------------------------------------------------ ending
    @synchronized
    def settle(self, lease: Lease, key: str) -> None:
        """``key`` was committed or failed under ``lease``; the lease ends with its last page."""
        held = self._held[lease.lease_id]
        del held.open[key]
        del self._owner[key]
        self._attempts.pop(key, None)
        if self._settled_here is not None:
            self._settled_here.add(key)
        if not held.open:
            del self._held[lease.lease_id]

    @synchronized
    def expire(self, now: float | None = None) -> list[Lease]:
        """End every lease whose expiry has passed; their open pages go back to the front of the
        queue (attempt counts kept, so a page that keeps killing workers is visible)."""
        now = self.clock() if now is None else now
        gone = [h for h in self._held.values() if h.lease.expires_at <= now]
        for held in gone:
            del self._held[held.lease.lease_id]
            for key, work in held.open.items():
                del self._owner[key]
                self._returned.append(work)
        return [h.lease for h in gone]

    def attempts(self, key: str) -> int:
        return self._attempts.get(key, 0)

    @property
    def active(self) -> list[Lease]:
        return [h.lease for h in self._held.values()]
