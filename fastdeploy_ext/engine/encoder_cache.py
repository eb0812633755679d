"""Encoder outputs per multimodal item, from the vision pass to the last prefill chunk that reads
them (the idea of vLLM's EncoderCacheManager, on this scheduler's terms).

Why a cache: a chunk of a chunked prefill may end inside an image's placeholder run; the encoder
cannot produce half an image, so the whole item is encoded once and its rows are kept until the
chunk that covers its last placeholder has been built. Keys are (sequence id, item index).

Life of an entry:

1. ``reserve`` - the scheduler, when it schedules the step whose chunk first touches the item:
   room is taken then, so admission never promises rows the cache cannot hold and a step never
   encodes what it cannot keep;
2. ``store`` - the engine, right after the vision pass (the features must have the reserved
   number of rows);
3. ``release`` - the engine, once the chunk covering the item's last placeholder is built
   (consumed), or ``drop_sequence`` - the scheduler, when the sequence is preempted (recompute
   encodes again), finishes or is aborted (evicted before it was fully read).

Capacity is in embedding rows (``--encoder-cache-size``). An item with more rows than the whole
cache could never be scheduled; the engine refuses such a request at admission
(InvalidRequest), so the scheduler never waits on it forever.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

ItemKey = tuple[int, int]          # (seq_id, index of the item in the sequence's prompt)


class EncoderCacheError(RuntimeError):
    """A bookkeeping error (a double reservation, features of the wrong size, a read of rows
    that were never stored or already released): a bug in the caller, never bad input."""


@dataclass(frozen=True)
class EncoderCacheStats:
    capacity_rows: int
    used_rows: int                 # reserved or stored
    num_items: int                 # entries now
    num_encoded: int               # items stored since start
    num_consumed: int              # items released after their last chunk
    num_evicted: int               # items dropped before their last chunk (preemption, abort, failure)


class EncoderCache:
    def __init__(self, capacity_rows: int):
        if isinstance(capacity_rows, bool) or not isinstance(capacity_rows, int) or capacity_rows < 1:
            raise ValueError(f"the encoder cache needs a positive number of rows, got {capacity_rows!r}")
        self.capacity = capacity_rows
        self.used = 0
        self._rows: dict[ItemKey, int] = {}                       # reserved rows per entry
        self._features: dict[ItemKey, torch.Tensor] = {}          # stored entries
        self._by_seq: dict[int, set[int]] = {}
        self.num_encoded = self.num_consumed = self.num_evicted = 0

    # ------------------------------------------------------------------ queries
    def __contains__(self, key: ItemKey) -> bool:
        return key in self._rows

    def __len__(self) -> int:
        return len(self._rows)

    @property
    def free(self) -> int:
        return self.capacity - self.used

    def can_reserve(self, rows: int) -> bool:
        return rows <= self.free

    def is_stored(self, key: ItemKey) -> bool:
        return key in self._features

    def items_of(self, seq_id: int) -> set[int]:
        return set(self._by_seq.get(seq_id, ()))

    def stats(self) -> EncoderCacheStats:
        return EncoderCacheStats(self.capacity, self.used, len(self._rows), self.num_encoded, self.num_consumed,
                                 self.num_evicted)

    # ------------------------------------------------------------------ life of an entry
    def reserve(self, key: ItemKey, rows: int) -> None:
        if key in self._rows:
            raise EncoderCacheError(f"item {key} is already in the encoder cache")
        if rows < 1 or rows > self.free:
            raise EncoderCacheError(f"item {key}: {rows} rows do not fit ({self.free} of {self.capacity} free)")
        self._rows[key] = rows
        self._by_seq.setdefault(key[0], set()).add(key[1])
        self.used += rows

    def store(self, key: ItemKey, features: torch.Tensor) -> None:
        rows = self._rows.get(key)
        if rows is None:
            raise EncoderCacheError(f"item {key} was not reserved before its encoder pass")
        if key in self._features:
            raise EncoderCacheError(f"item {key} is already stored")
        if features.shape[0] != rows:
            raise EncoderCacheError(f"item {key}: the encoder gave {features.shape[0]} rows, {rows} were reserved "
                                    f"(its placeholder tokens)")
        self._features[key] = features
        self.num_encoded += 1

    def get(self, key: ItemKey) -> torch.Tensor:
        feats = self._features.get(key)
        if feats is None:
            state = "reserved but not encoded" if key in self._rows else "not in the encoder cache"
            raise EncoderCacheError(f"item {key} is {state}")
        return feats

    def release(self, key: ItemKey) -> None:
        """The item's last chunk is built: its rows are free again."""
        if key not in self._features:
            raise EncoderCacheError(f"item {key} released but not stored")
        self._remove(key)
        self.num_consumed += 1

    def drop_sequence(self, seq_id: int) -> int:
        """Drop every entry of a sequence (preempted, finished or aborted); returns how many."""
        keys = [(seq_id, k) for k in self._by_seq.get(seq_id, ())]
        for key in keys:
            self._remove(key)
        self.num_evicted += len(keys)
        return len(keys)

    def _remove(self, key: ItemKey) -> None:
        self.used -= self._rows.pop(key)
        self._features.pop(key, None)
        ks = self._by_seq[key[0]]
        ks.discard(key[1])
        if not ks:
            del self._by_seq[key[0]]
