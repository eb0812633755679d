"""Per-request sampling parameters, with vLLM's names and meanings."""
from __future__ import annotations

from dataclasses import dataclass, field

from .errors import InvalidRequest


@dataclass
class RepetitionGuard:
    """Ends a request that loops (this model can repeat a phrase until max_tokens).

    Fires when the output's tail is one pattern of `period <= max_period` tokens repeated at least
    `min_repeats` times AND the repeated span covers at least `min_span` tokens: short loops must
    repeat many times, long ones at least `min_repeats` times. Defaults are conservative enough
    for tables and dotted leaders (a 1-token pattern must repeat 128 times)."""
    enabled: bool = True
    max_period: int = 64
    min_repeats: int = 8
    min_span: int = 128

    def validate(self) -> None:
        for name in ("max_period", "min_repeats", "min_span"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise InvalidRequest(f"repetition guard: {name} must be a positive integer, got {v!r}")

    def span_needed(self, period: int) -> int:
        """Length of the periodic tail that fires for this period."""
        return max(self.min_repeats * period, self.min_span)


@dataclass
class SamplingParams:
    n: int = 1
    max_tokens: int | None = None          # None: max_model_len - prompt length
    min_tokens: int = 0
    temperature: float = 1.0               # 0: greedy
    top_p: float = 1.0
    top_k: int = 0                         # 0 or -1: off
    seed: int | None = None
    repetition_penalty: float = 1.0        # transformers' rule over prompt + output tokens
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    logprobs: int | None = None            # None: none; 0: the chosen token's only; k: plus top k
    repetition_guard: RepetitionGuard = field(default_factory=RepetitionGuard)
    detokenize: bool = True

    def __post_init__(self):
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if isinstance(self.repetition_guard, dict):
            self.repetition_guard = RepetitionGuard(**self.repetition_guard)
        if self.top_k == -1:
            self.top_k = 0

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def validate(self, vocab_size: int | None = None) -> None:
        """Raises InvalidRequest naming the bad field."""
        def bad(msg):
            raise InvalidRequest(f"sampling params: {msg}")
        if self.n != 1:
            bad(f"n must be 1 (one completion per request), got {self.n}")
        if self.max_tokens is not None and (isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int)
                                            or self.max_tokens < 1):
            bad(f"max_tokens must be a positive integer, got {self.max_tokens!r}")
        if not isinstance(self.min_tokens, int) or self.min_tokens < 0:
            bad(f"min_tokens must be >= 0, got {self.min_tokens!r}")
        if not isinstance(self.temperature, (int, float)) or not self.temperature >= 0 or self.temperature > 1e4:
            bad(f"temperature must be a number in [0, 1e4], got {self.temperature!r}")
        if not isinstance(self.top_p, (int, float)) or not 0 < self.top_p <= 1:
            bad(f"top_p must be in (0, 1], got {self.top_p!r}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            bad(f"top_k must be a non-negative integer (0 or -1: off), got {self.top_k!r}")
        if not isinstance(self.repetition_penalty, (int, float)) or not self.repetition_penalty > 0:
            bad(f"repetition_penalty must be > 0, got {self.repetition_penalty!r}")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)):
            bad(f"seed must be an integer, got {self.seed!r}")
        if not all(isinstance(s, str) and s for s in self.stop):
            bad(f"stop must be non-empty strings, got {self.stop!r}")
        for t in self.stop_token_ids:
            if isinstance(t, bool) or not isinstance(t, int) or t < 0 or (vocab_size is not None and t >= vocab_size):
                bad(f"stop_token_ids must be token ids in [0, {vocab_size}), got {t!r}")
        if self.logprobs is not None and (isinstance(self.logprobs, bool) or not isinstance(self.logprobs, int)
                                          or not 0 <= self.logprobs <= 20):
            bad(f"logprobs must be an integer in [0, 20], got {self.logprobs!r}")
        if self.repetition_guard.enabled:
            self.repetition_guard.validate()
