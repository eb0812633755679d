"""The contract between the scheduler (engine/) and the model runner: what one step runs.

The scheduler decides which sequences run and which KV blocks they own; the runner turns a
StepBatch into next-token logits. Everything here is host data (Python ints, host tensors), so
building a step never touches the device and never syncs — with one exception, the overlapped
loop's input ids: a decode row whose token the host has not read yet (it was sampled by the step
still running) names its row in ``StepBatch.prev_token_ids``, the previous step's sampled ids on
the device, and the runner copies it there on the device (``SeqStep.prev_row``). A runner that
can do that says so with ``takes_device_token_ids = True``.

Mixed steps: a prefill StepBatch may also carry decode rows (one token at ``start_pos``, no
``rope_positions``: position ``start_pos + rope_delta`` on every row, ``prev_row`` allowed as in
a decode step), run through the prefill path; a runner that can says so with
``takes_mixed_steps = True``.

Positions: a prefill's ``rope_positions`` is int64 ``[P, len(token_ids)]`` with ``P =
family.position_rows`` (3 for PaddleOCR-VL's mrope rows t/h/w, 1 for a 1D rope); a decode token's
position is ``start_pos + rope_delta`` on every row (``rope_delta`` is 0 for a 1D rope). Encoder
output arrives as ``image_embeds``: one row per placeholder token of this chunk, in order (the
engine slices them from the encoder cache, so a chunk that ends inside an item gets only the rows
of its own placeholders).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch


#: the host's stand-in for a sampled id it has not read yet (never a vocabulary id)
UNRESOLVED_TOKEN = -1


@dataclass
class SeqStep:
    """One sequence's share of a step."""
    seq_id: int
    token_ids: list[int]                 # prefill: this chunk's prompt tokens; decode: [last token]
    start_pos: int                       # tokens already in this sequence's KV cache (KV slots
                                         # [start_pos, start_pos + len(token_ids)) are written now)
    block_table: list[int]               # the sequence's physical KV blocks, in order, covering
                                         # start_pos + len(token_ids) tokens
    rope_positions: torch.Tensor | None  # prefill: int64 [P, len(token_ids)] rope positions (host),
                                         # P = family.position_rows; decode (or a mixed step's decode
                                         # row): None (position = start_pos + rope_delta on every row)
    rope_delta: int = 0                  # max position + 1 - prompt length (transformers' rope_deltas;
                                         # 0 for a 1D rope)
    image_embeds: torch.Tensor | None = None  # [k, text_hidden] encoder rows for the k placeholder
                                         # tokens among token_ids, in order (device or host; the
                                         # runner moves them)
    need_logits: bool = True             # False for a prefill chunk that is not the prompt's last
    prev_row: int | None = None          # decode row: the token is prev_token_ids[prev_row] (device),
                                         # token_ids[0] only a placeholder (UNRESOLVED_TOKEN)


@dataclass
class StepBatch:
    is_prefill: bool                     # a prefill step (it may carry decode rows: mixed steps) or a
                                         # decode step (one token per sequence)
    seqs: list[SeqStep] = field(default_factory=list)
    prev_token_ids: torch.Tensor | None = None   # int64 [m] on the device: the previous step's sampled
                                         # ids, read by the rows with a prev_row
    num_decode_rows: int = 0             # a mixed prefill step: its first rows are decode rows (one
                                         # token each, no rope_positions); the runner may attend them
                                         # with its decode kernel and the rest with its prefill kernel
    borrow_logits: bool = False          # the caller consumes the logits before its next step (the
                                         # engine samples them on the stream right away): the runner
                                         # may return a view of a buffer that the next step reuses
                                         # (the decode graph's static output) instead of a copy

    @property
    def num_tokens(self) -> int:
        return sum(len(s.token_ids) for s in self.seqs)


@dataclass(frozen=True)
class KVCacheSpec:
    """What one KV block costs on this runner (the engine sizes its pool from it)."""
    block_size: int                      # tokens per block (from the capability row)
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype

    @property
    def bytes_per_block(self) -> int:
        elem = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.num_layers * self.block_size * self.num_kv_heads * self.head_dim * elem
