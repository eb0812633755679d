"""One request's state inside the engine (nano-vllm's Sequence): its prompt, its output, its
status and its KV block table. With overlapped scheduling ``token_ids`` may end with
UNRESOLVED_TOKEN entries (engine/step.py): ids sampled on the device that the host reads one
step later; sizes count them, output processing only ever sees read ids.

The contract with a model family (models/interface.py), on the input side:

- ``ProcessedPrompt.positions`` is int64 ``[P, len(prompt_token_ids)]`` with ``P =
  family.position_rows`` (3 for PaddleOCR-VL's mrope, 1 for a 1D rope). An output token re-fed
  after a preemption sits at ``index + rope_delta`` on every row, as a decode step's token does;
  a 1D-rope family has ``rope_delta == 0``.
- ``ProcessedPrompt.items`` are the prompt's multimodal items (images) in prompt order. Each
  :class:`MultiModalItem` holds its host-side encoder inputs and grid (what the runner's
  ``encode_images`` takes), the prompt index of its first placeholder token, its
  ``num_embeddings`` (encoder output rows = its placeholder tokens, from
  ``family.output_sizes``) and its ``encoder_cost`` (what the scheduler budgets against
  --max-encoder-patches, in the family's unit, from ``family.encoder_cost``). An item's
  placeholders are one contiguous run ``[offset, offset + num_embeddings)``.

Encoder outputs are not kept here: engine/encoder_cache.py holds them per item. A sequence is
owned by the step-loop thread; nothing here touches the device.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field

import torch

from .sampling_params import SamplingParams
from .step import UNRESOLVED_TOKEN


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class FinishReason(str, enum.Enum):
    STOP = "stop"               # eos, a stop token id or a stop string
    LENGTH = "length"           # max_tokens or max_model_len
    ABORT = "abort"
    REPETITION = "repetition"   # the repetition-loop guard (servers report "stop" + stop_reason)
    ERROR = "error"             # this request failed alone (RequestOutput.error says why)


@dataclass
class MultiModalItem:
    """One multimodal input of a prompt (an image), ready for the encoder."""
    encoder_inputs: torch.Tensor        # host tensor the encoder packs (PaddleOCR-VL: float32 patches
                                        # [t*h*w, C, P, P]); rows of several items are concatenated
    grid: tuple[int, ...]               # host ints the family's metadata derives from (PaddleOCR-VL:
                                        # grid_thw); never read back from the device
    offset: int                         # prompt index of its first placeholder token
    num_embeddings: int                 # encoder output rows = its placeholder tokens
    encoder_cost: int                   # what one encoder pass over it costs, in the family's unit
                                        # (PaddleOCR-VL: patches t*h*w), budgeted per step
    source: str = ""

    @property
    def end(self) -> int:
        """Prompt index after its last placeholder token."""
        return self.offset + self.num_embeddings


@dataclass
class ProcessedPrompt:
    """What preprocessing (in the worker pool) hands to the step loop: ready host data."""
    prompt_token_ids: list[int]
    positions: torch.Tensor              # int64 [P, len(prompt_token_ids)], P = family.position_rows
    rope_delta: int
    items: list[MultiModalItem] = field(default_factory=list)
    prompt_text: str | None = None
    preprocess_s: float = 0.0

    def validate(self, position_rows: int) -> None:
        """The shapes the runner relies on: positions [P, n], and items in prompt order whose
        placeholder runs lie inside the prompt without overlapping."""
        n = len(self.prompt_token_ids)
        if tuple(self.positions.shape) != (position_rows, n):
            raise ValueError(f"positions must be [{position_rows}, {n}], got {list(self.positions.shape)}")
        prev = 0
        for k, it in enumerate(self.items):
            if it.offset < prev or it.end > n or it.num_embeddings < 1 or it.encoder_cost < 1:
                raise ValueError(f"item {k}: placeholder run [{it.offset}, {it.end}) with cost {it.encoder_cost} "
                                 f"does not fit a prompt of {n} tokens after the previous item (ends at {prev})")
            prev = it.end


@dataclass
class RequestMetrics:
    arrival: float = 0.0
    first_scheduled: float | None = None
    first_token: float | None = None
    finish: float | None = None
    preprocess_s: float = 0.0
    vision_s: float = 0.0
    num_preemptions: int = 0


class Sequence:
    def __init__(self, seq_id: int, request_id: str, prompt: ProcessedPrompt, params: SamplingParams,
                 max_tokens: int, eos_token_ids: tuple[int, ...] = (), arrival: float = 0.0,
                 priority: int = 0):
        self.seq_id = seq_id
        self.request_id = request_id
        self.prompt = prompt
        self.params = params
        self.max_tokens = max_tokens                 # resolved (max_model_len - prompt when unset)
        self.eos_token_ids = eos_token_ids
        self.prompt_len = len(prompt.prompt_token_ids)
        self.token_ids: list[int] = list(prompt.prompt_token_ids)   # prompt + output
        self.status = SequenceStatus.WAITING
        self.priority = priority                     # lower is scheduled earlier (scheduler.py)
        self.stream = False                          # report every new token, not only the last
        self.block_table: list[int] = []
        self.num_computed_tokens = 0                 # tokens whose K/V are in the cache
        self.logprobs: list[dict] = []               # per output token, when params.logprobs is set
        self.cumulative_logprob = 0.0
        self.finish_reason: FinishReason | None = None
        self.stop_reason: int | str | None = None
        self.metrics = RequestMetrics(arrival=arrival, preprocess_s=prompt.preprocess_s)
        self.generator: torch.Generator | None = None   # per-request sampling stream (seed)
        # incremental detokenization state (engine/detokenizer.py)
        self.text = ""
        self.prefix_offset = self.read_offset = self.prompt_len
        self.num_sent_text = 0                        # characters already streamed
        # repetition guard: repeat_runs[p-1] = trailing positions i with out[i] == out[i - p]
        # (no state at all when the guard is off)
        guard = params.repetition_guard
        self.repeat_runs: list[int] = [0] * guard.max_period if guard.enabled else []
        self.repeat_thresholds: list[int] | None = None

    # ------------------------------------------------------------------ sizes
    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.prompt_len:]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.prompt_len

    @property
    def num_pending_tokens(self) -> int:
        """Tokens not yet in the KV cache (a prefill's remainder; 1 for a decoding sequence)."""
        return self.num_tokens - self.num_computed_tokens

    @property
    def in_prefill(self) -> bool:
        return self.num_pending_tokens > 1 or self.num_computed_tokens == 0

    @property
    def items(self) -> list[MultiModalItem]:
        return self.prompt.items

    def items_in(self, start: int, end: int) -> list[int]:
        """Indices of the items whose placeholder runs overlap tokens [start, end)."""
        return [k for k, it in enumerate(self.prompt.items) if it.offset < end and it.end > start]

    # ------------------------------------------------------------------ step inputs
    def positions(self, start: int, end: int) -> torch.Tensor:
        """Rope positions [P, end - start] for tokens [start, end): the prompt's own, then
        (index + rope_delta) on every row for output tokens (re-fed after a preemption)."""
        p = min(end, self.prompt_len)
        parts = []
        if start < p:
            parts.append(self.prompt.positions[:, start:p])
        if end > self.prompt_len:
            lo = max(start, self.prompt_len)
            tail = torch.arange(lo, end, dtype=torch.int64) + self.prompt.rope_delta
            parts.append(tail.expand(self.prompt.positions.shape[0], -1))
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)

    def drop_unresolved(self) -> None:
        """Forget the sampled ids not read yet (engine/step.py's UNRESOLVED_TOKEN at the tail):
        the request ended while a step that sampled for it was in flight."""
        while self.token_ids and self.token_ids[-1] == UNRESOLVED_TOKEN and len(self.token_ids) > self.prompt_len:
            self.token_ids.pop()

    # ------------------------------------------------------------------ preemption
    def reset_for_recompute(self) -> None:
        """Preempted: its KV blocks are gone (the block manager freed them); prompt and output so
        far are re-fed as one prefill when it is scheduled again (recompute, vLLM's default)."""
        self.num_computed_tokens = 0
        self.status = SequenceStatus.WAITING
        self.metrics.num_preemptions += 1

    def __repr__(self) -> str:
        return (f"Sequence({self.seq_id}, {self.request_id!r}, {self.status.value}, prompt={self.prompt_len}, "
                f"out={self.num_output_tokens}, computed={self.num_computed_tokens}, blocks={len(self.block_table)})")
