"""One request's state inside the engine (nano-vllm's Sequence): its prompt (token ids with the
image placeholders expanded, mrope positions, rope_delta), its preprocessed images with their
host grid_thw, its output, its status and its KV block table.

A sequence is owned by the step-loop thread; nothing here touches the device.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field

import torch

from .sampling_params import SamplingParams


class SequenceStatus(enum.Enum):
    PREPROCESSING = "preprocessing"
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
class ImageInput:
    """One preprocessed image of a prompt."""
    pixel_values: torch.Tensor          # host float32 patches [t*h*w, C, P, P]
    grid_thw: tuple[int, int, int]      # host ints from the preprocessor: all metadata derives from these
    offset: int                         # index in the prompt of its first placeholder token
    num_tokens: int                     # t*h*w / merge^2 placeholder tokens
    source: str = ""

    @property
    def num_patches(self) -> int:
        t, h, w = self.grid_thw
        return t * h * w


@dataclass
class ProcessedPrompt:
    """What preprocessing (in the worker pool) hands to the step loop: ready host data."""
    prompt_token_ids: list[int]
    positions: torch.Tensor              # int64 [3, len(prompt_token_ids)] mrope positions
    rope_delta: int
    images: list[ImageInput] = field(default_factory=list)
    prompt_text: str | None = None
    preprocess_s: float = 0.0

    def validate(self) -> None:
        n = len(self.prompt_token_ids)
        if tuple(self.positions.shape) != (3, n):
            raise ValueError(f"positions must be [3, {n}], got {list(self.positions.shape)}")


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
                 max_tokens: int, eos_token_ids: tuple[int, ...] = (), arrival: float = 0.0):
        self.seq_id = seq_id
        self.request_id = request_id
        self.prompt = prompt
        self.params = params
        self.max_tokens = max_tokens                 # resolved (max_model_len - prompt when unset)
        self.eos_token_ids = eos_token_ids
        self.prompt_len = len(prompt.prompt_token_ids)
        self.token_ids: list[int] = list(prompt.prompt_token_ids)   # prompt + output
        self.status = SequenceStatus.WAITING
        self.stream = False                          # report every new token, not only the last
        self.block_table: list[int] = []
        self.num_computed_tokens = 0                 # tokens whose K/V are in the cache
        self.image_features: torch.Tensor | None = None   # chunked prefill: all images' rows, kept
                                                          # from the first chunk to the last
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
    def is_finished(self) -> bool:
        return self.status == SequenceStatus.FINISHED

    @property
    def num_patches(self) -> int:
        return sum(im.num_patches for im in self.prompt.images)

    @property
    def images_end(self) -> int:
        """Prompt index after the last image token (0 without images)."""
        return max((im.offset + im.num_tokens for im in self.prompt.images), default=0)

    # ------------------------------------------------------------------ step inputs
    def positions(self, start: int, end: int) -> torch.Tensor:
        """mrope positions [3, end - start] for tokens [start, end): the prompt's own, then
        (index + rope_delta) on all axes for output tokens (re-fed after a preemption)."""
        p = min(end, self.prompt_len)
        parts = []
        if start < p:
            parts.append(self.prompt.positions[:, start:p])
        if end > self.prompt_len:
            lo = max(start, self.prompt_len)
            tail = torch.arange(lo, end, dtype=torch.int64) + self.prompt.rope_delta
            parts.append(tail.expand(3, -1))
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)

    def image_tokens_before(self, pos: int) -> int:
        """Image-placeholder tokens at prompt indices < pos (rows of the feature table used)."""
        return sum(min(max(pos - im.offset, 0), im.num_tokens) for im in self.prompt.images)

    def image_range(self, start: int, end: int) -> tuple[int, int]:
        """Rows of this sequence's concatenated image features that tokens [start, end) need."""
        return self.image_tokens_before(start), self.image_tokens_before(end)

    # ------------------------------------------------------------------ preemption
    def reset_for_recompute(self) -> None:
        """Preempted: its KV blocks are gone (the block manager freed them); prompt and output so
        far are re-fed as one prefill when it is scheduled again (recompute, vLLM's default)."""
        self.num_computed_tokens = 0
        self.image_features = None
        self.status = SequenceStatus.WAITING
        self.metrics.num_preemptions += 1

    def __repr__(self) -> str:
        return (f"Sequence({self.seq_id}, {self.request_id!r}, {self.status.value}, prompt={self.prompt_len}, "
                f"out={self.num_output_tokens}, computed={self.num_computed_tokens}, blocks={len(self.block_table)})")
