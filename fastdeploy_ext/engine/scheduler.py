"""Continuous batching: waiting and running queues; each step is a prefill batch or a decode
batch (nano-vllm's shape); preemption by recompute when KV blocks run out. A request waits or is
preempted and resumed, never dropped.

Priorities (vLLM's rule): every request has an integer ``priority``, lower runs earlier, default
0. Its scheduling key is (priority, arrival), arrival being the order the scheduler received it
(preprocessing done); the key is kept for the request's whole life, preemptions included.
- admission: the waiting request with the smallest key goes first (FIFO among equal
  priorities); when it does not fit (blocks, budget) nothing behind it is admitted in that step
  (no queue jumping). A preempted request keeps its key, so it resumes before every request of
  its priority that arrived after it. Admission never preempts a running request: a
  higher-priority arrival waits for blocks to free up (vLLM v1's rule), so strict priority can
  delay a low-priority request behind a stream of higher ones, but never among equals;
- running requests are kept in key order: chunked prefills and decode rows are scheduled
  highest priority first, and the preemption victim is the last one, the lowest priority
  (largest value) and, among those, the newest. With every priority equal this is "newest
  first" by arrival: a resumed request keeps its age and is not the next victim again.
Both queues cost O(log n) (heap push/pop) or O(n) memmove (sorted insert into running) per
admitted or preempted request; a step without admission or preemption touches neither.

Two admission modes (DESIGN.md section 4, FD_ENABLE_MAX_PREFILL):
- max prefill (1): each step admits waiting requests (up to max_num_seqs running) whole: no
  prompt is ever chunked, and the items of all requests admitted in the step are encoded in one
  packed vision pass bounded by max_encoder_cost;
- chunked (0): a prompt is prefilled in chunks under max_num_batched_tokens. A chunk may split
  an item's placeholder run: the item is encoded when the first chunk touching it is scheduled
  and its rows stay in the encoder cache (encoder_cache.py) until the chunk covering its last
  placeholder. When an item's encoder cost or rows do not fit this step, the chunk ends before
  the item (vLLM's rule) and the item waits for a later step.
In both modes the step's tokens stay within max_num_batched_tokens and its encoder cost within
max_encoder_cost, except that the first request of a step is always admitted whole in max
prefill mode (a prompt longer than the budget must still run). The encoder cache is never
over-committed: an item is reserved there when the step that encodes it is scheduled.

Mixed steps (SchedulerConfig.mixed_steps): without them a step that admits requests is a
prefill step only, so every running request waits for the newcomers' vision pass and prefill
before its next token (a 150 ms gap between two tokens on the H200 for a step of ~21 crops).
With them, the decode rows of the running requests are scheduled first (key order, blocks
allocated or victims preempted exactly as in a decode step) and ride in the same step as the
prefill, under what is left of max_num_batched_tokens: running requests advance one token in
every step. A mixed step's encoder work is bounded by ``mixed_encoder_cost`` (smaller than a
prefill step's max_encoder_cost: the decode rows wait for the step, so its vision pass is kept
short, and newcomers' images spread over more steps; the first admission may still exceed it,
as in any step). The prefill part of a mixed step never preempts (a victim could be a decode row
already scheduled in it): a chunk that needs blocks waits for a step with room, and a step whose
decode rows preempted admits nothing (the livelock rule above). A step without decode rows is
scheduled exactly as without mixed steps. In a mixed step the decode rows come first in
``scheduled`` (``ScheduledSeq.decode``), then the prefill chunks.
"""
from __future__ import annotations

import bisect
import heapq
import itertools
import logging
import numbers
import reprlib
from dataclasses import dataclass, field

from .block_manager import BlockManager
from .encoder_cache import EncoderCache, EncoderCacheError
from .errors import InvalidRequest
from .sequence import Sequence, SequenceStatus

log = logging.getLogger(__name__)

PRIORITY_MIN, PRIORITY_MAX = -(1 << 63), (1 << 63) - 1


def check_priority(value) -> int:
    """A request's priority: an integer in the int64 range (lower runs earlier); InvalidRequest
    naming the field otherwise (a bool or a float is not a priority)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise InvalidRequest(f"priority must be an integer, got {type(value).__name__} {reprlib.repr(value)}")
    value = int(value)
    if not PRIORITY_MIN <= value <= PRIORITY_MAX:
        raise InvalidRequest(f"priority {value} is outside the 64-bit range [-2^63, 2^63 - 1]")
    return value


class SchedulerError(RuntimeError):
    """A queue invariant broke (a request queued twice): an engine bug, never user input."""


class WaitingQueue:
    """Waiting sequences as a heap on their scheduling key (priority, arrival): peek/pop the
    smallest in O(1)/O(log n); membership by seq_id in O(1); removal (an abort) O(n)."""

    def __init__(self):
        self._heap: list[tuple[tuple[int, int], Sequence]] = []   # keys are unique: seqs never compared
        self._ids: set[int] = set()

    def push(self, seq: Sequence, key: tuple[int, int]) -> None:
        if seq.seq_id in self._ids:
            raise SchedulerError(f"{seq} is already waiting")
        heapq.heappush(self._heap, (key, seq))
        self._ids.add(seq.seq_id)

    def peek(self) -> Sequence:
        return self._heap[0][1]

    def pop(self) -> Sequence:
        seq = heapq.heappop(self._heap)[1]
        self._ids.discard(seq.seq_id)
        return seq

    def remove(self, seq: Sequence) -> None:
        i = next(i for i, (_, s) in enumerate(self._heap) if s is seq)
        self._heap[i] = self._heap[-1]
        self._heap.pop()
        heapq.heapify(self._heap)
        self._ids.discard(seq.seq_id)

    def __contains__(self, seq: Sequence) -> bool:
        return seq.seq_id in self._ids

    def __len__(self) -> int:
        return len(self._heap)

    def __iter__(self):
        """In admission order (sorted: for lookups and tests, not the step's hot path)."""
        return iter([s for _, s in sorted(self._heap, key=lambda e: e[0])])


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 16384
    max_encoder_cost: int = 65536      # one step's encoder work, in the family's unit (--max-encoder-patches)
    enable_max_prefill: bool = True
    mixed_steps: bool = False          # running requests' decode rows ride in prefill steps
    mixed_encoder_cost: int | None = None   # a mixed step's encoder budget (None: max_encoder_cost)


@dataclass
class ScheduledSeq:
    seq: Sequence
    start: int              # tokens already in the cache
    num_tokens: int         # tokens run in this step
    encode: tuple[int, ...] = ()   # items encoded in this step (reserved in the encoder cache)
    decode: bool = False           # a decode row (its one new token) in a mixed step

    @property
    def end(self) -> int:
        return self.start + self.num_tokens

    @property
    def completes_prefill(self) -> bool:
        """This step's last token is the sequence's last: its logits give the next token."""
        return self.end == self.seq.num_tokens


@dataclass
class SchedulerOutput:
    is_prefill: bool               # True when any prompt chunk runs (a mixed step too)
    scheduled: list[ScheduledSeq] = field(default_factory=list)

    @property
    def num_decode_rows(self) -> int:
        """Decode rows of a mixed step (they come first in ``scheduled``)."""
        return sum(s.decode for s in self.scheduled) if self.is_prefill else 0

    @property
    def num_tokens(self) -> int:
        return sum(s.num_tokens for s in self.scheduled)


class Scheduler:
    def __init__(self, config: SchedulerConfig, block_manager: BlockManager, encoder_cache: EncoderCache):
        self.config = config
        self.bm = block_manager
        self.encoder_cache = encoder_cache
        self.waiting = WaitingQueue()
        self.running: list[Sequence] = []      # in key order: the last is the first preemption victim
        self.num_preemptions = 0
        self._arrivals = itertools.count()
        self._keys: dict[int, tuple[int, int]] = {}   # seq_id -> (priority, arrival), for its whole life

    # ------------------------------------------------------------------ queues
    def key(self, seq: Sequence) -> tuple[int, int]:
        """The scheduling key (priority, arrival): smaller is admitted first and preempted last."""
        return self._keys[seq.seq_id]

    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        if seq.seq_id in self._keys:
            raise SchedulerError(f"{seq} was already added")
        self._keys[seq.seq_id] = (seq.priority, next(self._arrivals))
        self.waiting.push(seq, self._keys[seq.seq_id])

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    def finish(self, seq: Sequence) -> None:
        """Remove a finished or aborted sequence and free its blocks."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.bm.free(seq)
        self.encoder_cache.drop_sequence(seq.seq_id)
        self._keys.pop(seq.seq_id, None)
        seq.status = SequenceStatus.FINISHED

    def find(self, request_id: str) -> Sequence | None:
        for seq in (*self.running, *self.waiting):
            if seq.request_id == request_id:
                return seq
        return None

    # ------------------------------------------------------------------ scheduling
    def schedule(self) -> SchedulerOutput | None:
        if self.config.mixed_steps:
            return self._schedule_mixed()
        out = self._schedule_prefill()
        if out.scheduled:
            return out
        out = self._schedule_decode()
        return out if out.scheduled else None

    def _schedule_mixed(self) -> SchedulerOutput | None:
        """Decode rows of the running requests first, then prefill under the budget they leave
        (module docstring); no decode row: the step is scheduled as without mixed steps."""
        before = self.num_preemptions
        decode = self._schedule_decode(skip_prefilling=True)
        if not decode.scheduled:
            out = self._schedule_prefill()
            if out.scheduled:
                return out
            out = self._schedule_decode()
            return out if out.scheduled else None
        if self.num_preemptions > before or not self.waiting and not any(s.in_prefill for s in self.running):
            return decode
        cfg = self.config
        budget = cfg.max_num_batched_tokens - len(decode.scheduled)
        cost = min(cfg.max_encoder_cost, cfg.mixed_encoder_cost or cfg.max_encoder_cost)
        prefill = self._schedule_prefill(budget=budget, may_preempt=False, cost_budget=cost)
        if not prefill.scheduled and cost < cfg.max_encoder_cost:
            # nothing fit the mixed budget (a chunk's next item costs more): the full budget, else
            # that item would wait for as long as anything decodes (nothing was reserved above)
            prefill = self._schedule_prefill(budget=budget, may_preempt=False)
        if not prefill.scheduled:
            return decode
        for s in decode.scheduled:
            s.decode = True
        return SchedulerOutput(True, decode.scheduled + prefill.scheduled)

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.bm.free(seq)
        self.encoder_cache.drop_sequence(seq.seq_id)     # recompute encodes its items again
        seq.reset_for_recompute()
        self.waiting.push(seq, self.key(seq))    # its old key: resumed before newer requests of its priority
        self.num_preemptions += 1
        log.debug("preempted %s (recompute): %d free blocks", seq, self.bm.num_free)

    def _make_room(self, seq: Sequence, num_tokens: int) -> bool:
        """Preempt the last running sequences (lowest priority, newest) until seq's table can cover
        num_tokens; False if seq itself had to go (it is then back in the waiting queue)."""
        while not self.bm.can_allocate(seq, num_tokens):
            victim = self.running[-1]
            self._preempt(victim)
            if victim is seq:
                return False
        return True

    def _encoder_work(self, seq: Sequence, n: int, cost_left: int | None) -> tuple[int, list[int], int]:
        """The chunk [computed, computed + n) cut so that the items it touches that are not in the
        encoder cache fit ``cost_left`` (None: no cost bound) and the cache's free rows: (tokens,
        items to encode, their cost). The chunk ends before the first item that does not fit."""
        start = seq.num_computed_tokens
        cache = self.encoder_cache
        items, cost, rows = [], 0, 0
        for k in seq.items_in(start, start + n):
            if (seq.seq_id, k) in cache:
                continue
            it = seq.items[k]
            if it.offset < start:
                # rows released before the chunk that covers its last placeholder: re-encoding
                # now would hide the bookkeeping bug, waiting would hang this sequence forever
                raise EncoderCacheError(f"{seq}: item {k} (placeholders [{it.offset}, {it.end})) left the encoder "
                                        f"cache before its last chunk")
            if (cost_left is not None and cost + it.encoder_cost > cost_left) or \
                    not cache.can_reserve(rows + it.num_embeddings):
                return it.offset - start, items, cost
            items.append(k)
            cost += it.encoder_cost
            rows += it.num_embeddings
        return n, items, cost

    def _reserve(self, seq: Sequence, items: list[int]) -> None:
        for k in items:
            self.encoder_cache.reserve((seq.seq_id, k), seq.items[k].num_embeddings)

    def _schedule_prefill(self, budget: int | None = None, may_preempt: bool = True,
                          cost_budget: int | None = None) -> SchedulerOutput:
        """``budget``: the step's tokens left (default max_num_batched_tokens); ``may_preempt``
        False: a chunk that needs blocks the pool does not have waits; ``cost_budget``: the
        step's encoder work (default max_encoder_cost); mixed steps pass both."""
        cfg = self.config
        out = SchedulerOutput(is_prefill=True)
        budget = cfg.max_num_batched_tokens if budget is None else budget
        cost_left = cfg.max_encoder_cost if cost_budget is None else cost_budget
        preemptions_before = self.num_preemptions
        # 1. chunked mode: running sequences whose prompt is only partly in the cache go first
        for seq in list(self.running):
            if not seq.in_prefill or budget <= 0 or seq not in self.running:
                continue
            n, items, cost = self._encoder_work(seq, min(seq.num_pending_tokens, budget), cost_left)
            if n == 0:
                continue
            if not may_preempt and not self.bm.can_allocate(seq, seq.num_computed_tokens + n):
                continue
            if not self._make_room(seq, seq.num_computed_tokens + n):
                continue
            self.bm.allocate(seq, seq.num_computed_tokens + n)
            self._reserve(seq, items)
            out.scheduled.append(ScheduledSeq(seq, seq.num_computed_tokens, n, tuple(items)))
            budget -= n
            cost_left -= cost
        # 2. admit waiting requests in key order (priority, then arrival; a preempted one keeps
        # its key, so it comes before the newer requests of its priority), unless
        # this step had to preempt: re-admitting at once the sequence that just preempted
        # itself would refill the same blocks, and a step that is always a prefill starves the
        # decoding sequences that must finish to free them (a livelock)
        preempted = self.num_preemptions > preemptions_before
        while not preempted and self.waiting and len(self.running) < cfg.max_num_seqs and budget > 0:
            seq = self.waiting.peek()
            first = not out.scheduled
            pending = seq.num_pending_tokens
            if cfg.enable_max_prefill:
                if not first and pending > budget:
                    break
                # whole: every item it touches, over the cost budget only when it is the first
                n, items, cost = self._encoder_work(seq, pending, None if first else cost_left)
                if n < pending:
                    break
            else:
                n, items, cost = self._encoder_work(seq, min(pending, budget), cost_left)
                if n == 0:
                    break                # its next item waits for encoder budget or cache rows
            if not self.bm.can_allocate(seq, seq.num_computed_tokens + n):
                break                    # wait for blocks; never jump the queue
            self.waiting.pop()
            self.bm.allocate(seq, seq.num_computed_tokens + n)
            self._reserve(seq, items)
            seq.status = SequenceStatus.RUNNING
            bisect.insort(self.running, seq, key=self.key)
            out.scheduled.append(ScheduledSeq(seq, seq.num_computed_tokens, n, tuple(items)))
            budget -= n
            cost_left -= cost
        return out

    def _schedule_decode(self, skip_prefilling: bool = False) -> SchedulerOutput:
        """One token for each running request (``skip_prefilling``: not those whose prompt is
        still being prefilled, a mixed step's prefill part schedules them)."""
        out = SchedulerOutput(is_prefill=False)
        limit = min(self.config.max_num_seqs, self.config.max_num_batched_tokens)
        i = 0
        while i < len(self.running) and len(out.scheduled) < limit:     # key order: highest priority, oldest first
            seq = self.running[i]
            if skip_prefilling and seq.in_prefill:
                i += 1
                continue
            # A new block only when the token crosses a block boundary (once per block_size
            # steps); otherwise nothing to allocate or preempt for.
            if not self.bm.covers(seq, seq.num_tokens):
                # victims are always later in the key-ordered list than seq (lower priority or
                # newer), or seq itself when it is the last: then it left the list and the loop
                # ends. O(running) per step.
                if not self._make_room(seq, seq.num_tokens):
                    break
                self.bm.allocate(seq, seq.num_tokens)
            out.scheduled.append(ScheduledSeq(seq, seq.num_computed_tokens, 1))
            i += 1
        return out
