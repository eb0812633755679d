"""Continuous batching: waiting and running queues; each step is a prefill batch or a decode
batch (nano-vllm's shape); preemption by recompute, newest first, when KV blocks run out. A
request waits or is preempted and resumed, never dropped.

Two admission modes (DESIGN.md section 4, FD_ENABLE_MAX_PREFILL):
- max prefill (1): each step admits waiting requests (up to max_num_seqs running) whole: no
  prompt is ever chunked, and the images of all requests admitted in the step are encoded in
  one packed vision pass bounded by max_encoder_patches;
- chunked (0): a prompt is prefilled in chunks under max_num_batched_tokens (a chunk may split
  an image's tokens; its features are computed once per request and kept until the last chunk).
In both modes the step's tokens stay within max_num_batched_tokens and its patches within
max_encoder_patches, except that the first request of a step is always admitted whole in max
prefill mode (a prompt longer than the budget must still run).
"""
from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass, field

from .block_manager import BlockManager
from .sequence import Sequence, SequenceStatus

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 16384
    max_model_len: int = 16384
    max_encoder_patches: int = 65536
    enable_max_prefill: bool = True


@dataclass
class ScheduledSeq:
    seq: Sequence
    start: int              # tokens already in the cache
    num_tokens: int         # tokens run in this step

    @property
    def end(self) -> int:
        return self.start + self.num_tokens

    @property
    def completes_prefill(self) -> bool:
        """This step's last token is the sequence's last: its logits give the next token."""
        return self.end == self.seq.num_tokens


@dataclass
class SchedulerOutput:
    is_prefill: bool
    scheduled: list[ScheduledSeq] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(s.num_tokens for s in self.scheduled)


class Scheduler:
    def __init__(self, config: SchedulerConfig, block_manager: BlockManager):
        self.config = config
        self.bm = block_manager
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []      # admission order: the last is the newest
        self.num_preemptions = 0

    # ------------------------------------------------------------------ queues
    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)

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
        seq.image_features = None
        seq.status = SequenceStatus.FINISHED

    def find(self, request_id: str) -> Sequence | None:
        for seq in (*self.running, *self.waiting):
            if seq.request_id == request_id:
                return seq
        return None

    # ------------------------------------------------------------------ scheduling
    def schedule(self) -> SchedulerOutput | None:
        out = self._schedule_prefill()
        if out.scheduled:
            return out
        out = self._schedule_decode(out.preempted)
        return out if out.scheduled else None

    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> None:
        self.running.remove(seq)
        self.bm.free(seq)
        seq.reset_for_recompute()
        self.waiting.appendleft(seq)     # resumed before any newer request
        out.preempted.append(seq)
        self.num_preemptions += 1
        log.debug("preempted %s (recompute): %d free blocks", seq, self.bm.num_free)

    def _make_room(self, seq: Sequence, num_tokens: int, out: SchedulerOutput) -> bool:
        """Preempt the newest running sequences until seq's table can cover num_tokens; False if
        seq itself had to go (it is then back in the waiting queue)."""
        while not self.bm.can_allocate(seq, num_tokens):
            victim = self.running[-1]
            self._preempt(victim, out)
            if victim is seq:
                return False
        return True

    def _schedule_prefill(self) -> SchedulerOutput:
        cfg = self.config
        out = SchedulerOutput(is_prefill=True)
        budget = cfg.max_num_batched_tokens
        patches = 0
        # 1. chunked mode: running sequences whose prompt is only partly in the cache go first
        for seq in list(self.running):
            if not seq.in_prefill or budget <= 0 or seq not in self.running:
                continue
            n = min(seq.num_pending_tokens, budget)
            if not self._make_room(seq, seq.num_computed_tokens + n, out):
                continue
            self.bm.allocate(seq, seq.num_computed_tokens + n)
            out.scheduled.append(ScheduledSeq(seq, seq.num_computed_tokens, n))
            budget -= n
        # 2. admit waiting requests in arrival order (preempted ones are at the front)
        while self.waiting and len(self.running) < cfg.max_num_seqs and budget > 0:
            seq = self.waiting[0]
            first = not out.scheduled
            pending = seq.num_pending_tokens
            new_patches = seq.num_patches if seq.image_features is None and seq.num_computed_tokens < seq.images_end else 0
            if cfg.enable_max_prefill:
                if not first and (pending > budget or patches + new_patches > cfg.max_encoder_patches):
                    break
                n = pending
            else:
                if not first and patches + new_patches > cfg.max_encoder_patches:
                    break
                n = min(pending, budget)
            if not self.bm.can_allocate(seq, seq.num_computed_tokens + n):
                break                    # wait for blocks; never jump the queue
            self.waiting.popleft()
            self.bm.allocate(seq, seq.num_computed_tokens + n)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            out.scheduled.append(ScheduledSeq(seq, seq.num_computed_tokens, n))
            budget -= n
            patches += new_patches
        return out

    def _schedule_decode(self, preempted: list[Sequence]) -> SchedulerOutput:
        out = SchedulerOutput(is_prefill=False, preempted=preempted)
        limit = min(self.config.max_num_seqs, self.config.max_num_batched_tokens)
        i = 0
        while i < len(self.running) and len(out.scheduled) < limit:     # oldest first
            seq = self.running[i]
            # A new block only when the token crosses a block boundary (once per block_size
            # steps); otherwise nothing to allocate or preempt for.
            if not self.bm.covers(seq, seq.num_tokens):
                # victims are always newer (later in the list) than seq, or seq itself when it
                # is the newest: then it left the list and the loop ends. O(running) per step.
                if not self._make_room(seq, seq.num_tokens, out):
                    break
                self.bm.allocate(seq, seq.num_tokens)
            out.scheduled.append(ScheduledSeq(seq, seq.num_computed_tokens, 1))
            i += 1
        return out
