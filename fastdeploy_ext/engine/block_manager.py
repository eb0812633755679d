"""Fixed-size KV blocks: a free list, per-sequence block tables, allocation on admission and at
block boundaries, release on finish, abort or preemption. No prefix caching (every OCR page is
a different image, so shared prefixes are a few template tokens).
"""
from __future__ import annotations

from collections import deque

from .sequence import Sequence


class BlockError(RuntimeError):
    """A block-table invariant broke (double free, foreign block): an engine bug, never user input."""


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int):
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"KV pool needs >= 1 block of >= 1 token, got {num_blocks} x {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free: deque[int] = deque(range(num_blocks))
        self._owner: dict[int, int] = {}     # block -> seq_id, to catch double frees and leaks

    # ------------------------------------------------------------------ observability
    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    @property
    def usage(self) -> float:
        return self.num_used / self.num_blocks

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # ------------------------------------------------------------------ allocation
    def covers(self, seq: Sequence, num_tokens: int) -> bool:
        """seq's block table already holds num_tokens tokens (the usual decode step)."""
        return len(seq.block_table) * self.block_size >= num_tokens

    def blocks_needed(self, seq: Sequence, num_tokens: int) -> int:
        """Extra blocks seq needs so its table covers num_tokens tokens."""
        return max(self.blocks_for(num_tokens) - len(seq.block_table), 0)

    def can_allocate(self, seq: Sequence, num_tokens: int) -> bool:
        return self.blocks_needed(seq, num_tokens) <= len(self._free)

    def allocate(self, seq: Sequence, num_tokens: int) -> None:
        """Grow seq's block table to cover num_tokens tokens (the caller checked can_allocate)."""
        need = self.blocks_needed(seq, num_tokens)
        if need > len(self._free):
            raise BlockError(f"allocate {need} blocks for seq {seq.seq_id} with {len(self._free)} free")
        for _ in range(need):
            b = self._free.popleft()
            self._owner[b] = seq.seq_id
            seq.block_table.append(b)

    def free(self, seq: Sequence) -> None:
        for b in seq.block_table:
            if self._owner.get(b) != seq.seq_id:
                raise BlockError(f"seq {seq.seq_id} frees block {b} owned by {self._owner.get(b)}")
            del self._owner[b]
            self._free.append(b)
        seq.block_table = []
