"""Per-request sampling parameters, with vLLM's names and meanings, and the one validation that
the server, the offline LLM and the CLI share (``SamplingParams(...).validate(vocab_size)``).

The accepted ranges are what ops/sampler.py and the kernels can run without overflow or NaN
(vLLM's rules where it has one):

- ``seed``: an integer in [-2^63, 2^63) (a torch generator's range);
- ``temperature``: finite, in [0, 1e4]; below 1e-5 it means greedy, in [1e-5, 1e-2) it is raised
  to 1e-2 (vLLM's _SAMPLING_EPS / _MAX_TEMP: smaller divisors overflow the logits);
- ``top_k``: an integer; -1 or 0 is off, >= the vocabulary is off (clamped), below 2^63;
- ``top_p``: finite, in [0, 1]; 0 keeps only the most likely token (FastDeploy's range: PaddleX's
  fastdeploy-server client sends 0 when unset);
- ``repetition_penalty``: finite, in [0.01, 100] (dividing a logit by less overflows float32);
- every repetition-guard field bounded (``max_period`` <= 512 tokens of state per request);
- NaN and infinity are refused for every float.

A value outside its range raises InvalidRequest naming the field; nothing else escapes.
"""
from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field, fields
from typing import Sequence

from ..ops.sampler import GREEDY_EPS
from .errors import InvalidRequest

log = logging.getLogger(__name__)

# temperature below: greedy (vLLM's _SAMPLING_EPS); the sampler's own rule, one constant for both
SAMPLING_EPS = GREEDY_EPS
MIN_TEMPERATURE = 1e-2            # temperature in [eps, this) is raised to this (vLLM's _MAX_TEMP)
MAX_TEMPERATURE = 1e4
SEED_RANGE = (-2**63, 2**63)      # [lo, hi)
TOP_K_LIMIT = 2**63               # top_k must be below (int64 on the device)
REPETITION_PENALTY_RANGE = (0.01, 100.0)
MAX_LOGPROBS = 20
MAX_STOP_STRINGS, MAX_STOP_LEN = 32, 1024     # per-token stop search is O(count x length)
MAX_STOP_TOKEN_IDS = 1024
GUARD_LIMITS = {"max_period": 512, "min_repeats": 4096, "min_span": 1 << 20}


def _fail(name: str, msg: str):
    raise InvalidRequest(f"sampling params: {name} {msg}")


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def check_int(name: str, v, lo: int | None = None, hi: int | None = None, what: str = "") -> int:
    """An integer (bools refused) in [lo, hi]."""
    if not _is_int(v) or (lo is not None and v < lo) or (hi is not None and v > hi):
        what = what or (f"an integer in [{lo}, {hi}]" if hi is not None else f"an integer >= {lo}")
        _fail(name, f"must be {what}, got {v!r}"[:300])
    return v


def check_float(name: str, v, lo: float, hi: float) -> float:
    """A finite number in [lo, hi] (bools, NaN and infinity refused)."""
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        _fail(name, f"must be a number in [{lo:g}, {hi:g}], got {v!r}"[:300])
    try:
        f = float(v)
    except OverflowError:            # an int too large for a float
        f = math.inf
    if not math.isfinite(f) or not lo <= f <= hi:
        _fail(name, f"must be a finite number in [{lo:g}, {hi:g}], got {v!r}"[:300])
    return f


def check_bool(name: str, v) -> bool:
    if not isinstance(v, bool):
        _fail(name, f"must be true or false, got {v!r}"[:300])
    return v


@dataclass
class RepetitionGuard:
    """Ends a request that loops (this model can repeat a phrase until max_tokens).

    Fires when the output's tail is one pattern of `period <= max_period` tokens repeated at least
    `min_repeats` times AND the repeated span covers at least `min_span` tokens: short loops must
    repeat many times, long ones at least `min_repeats` times. Defaults are conservative enough
    for tables and dotted leaders (a 1-token pattern must repeat 128 times). Per request it keeps
    `max_period` counters (none when disabled), so max_period is bounded (GUARD_LIMITS)."""
    enabled: bool = True
    max_period: int = 64
    min_repeats: int = 8
    min_span: int = 128

    def validate(self) -> None:
        check_bool("repetition_guard.enabled", self.enabled)
        for name, hi in GUARD_LIMITS.items():
            check_int(f"repetition_guard.{name}", getattr(self, name), 1, hi)

    def span_needed(self, period: int) -> int:
        """Length of the periodic tail that fires for this period."""
        return max(self.min_repeats * period, self.min_span)


_GUARD_FIELDS = {f.name for f in fields(RepetitionGuard)}

NGRAM_LIMITS = {"size": 1024, "window": 1 << 16, "whitelist": 1024}


@dataclass
class NGramBlocker:
    """DeepSeek-OCR's per-request no-repeat n-gram rule (its ``NGramPerReqLogitsProcessor``,
    which vLLM runs over the output tokens): at each step, a token that would complete an n-gram
    of ``size`` tokens already present among the last ``window`` output tokens is banned, unless
    it is in ``whitelist``. The prompt is not searched. DeepSeek's recommended setting is size 30,
    window 90, whitelist (128821, 128822) (the table cell tags). transformers'
    ``no_repeat_ngram_size`` is the same rule without the window and the whitelist.

    Applied on the host (the step's banned ids: one masked write on the device, no read back);
    a request with a blocker has its previous token read before its next step is sampled, as a
    repetition_penalty request has."""
    size: int
    window: int
    whitelist: tuple[int, ...] = ()

    def __post_init__(self):
        if isinstance(self.whitelist, list):
            self.whitelist = tuple(self.whitelist)

    def validate(self, vocab_size: int | None = None) -> None:
        check_int("ngram_blocker.size", self.size, 2, NGRAM_LIMITS["size"])
        check_int("ngram_blocker.window", self.window, self.size if _is_int(self.size) else 2, NGRAM_LIMITS["window"],
                  f"an integer in [size, {NGRAM_LIMITS['window']}]")
        wl = self.whitelist
        if not isinstance(wl, tuple) or len(wl) > NGRAM_LIMITS["whitelist"]:
            _fail("ngram_blocker.whitelist", f"must be a list of at most {NGRAM_LIMITS['whitelist']} token ids, "
                                             f"got {wl!r}"[:300])
        hi = (vocab_size - 1) if vocab_size is not None else None
        for tok in wl:
            check_int("ngram_blocker.whitelist", tok, 0, hi,
                      f"token ids in [0, {vocab_size})" if hi is not None else "token ids >= 0")

    def banned(self, output_ids: Sequence[int]) -> list[int]:
        """The ids banned for the next token after ``output_ids`` (the request's output so far)."""
        n, out = self.size, output_ids
        if len(out) < n:
            return []
        last, prefix = out[-1], list(out[len(out) - n + 1:])
        hits = set()
        # an n-gram out[i:i+n] blocks out[i+n-1] when its first n-1 tokens are the current tail;
        # its (n-1)-th token must then be the last one: that cheap test first
        for i in range(max(0, len(out) - self.window), len(out) - n + 1):
            if out[i + n - 2] == last and list(out[i:i + n - 1]) == prefix:
                hits.add(int(out[i + n - 1]))
        return sorted(hits.difference(self.whitelist))


_NGRAM_FIELDS = {f.name for f in fields(NGramBlocker)}


@dataclass
class SamplingParams:
    n: int = 1
    max_tokens: int | None = None          # None: max_model_len - prompt length
    min_tokens: int = 0
    temperature: float = 1.0               # < 1e-5: greedy
    top_p: float = 1.0                     # 0: only the most likely token
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
    ngram_blocker: NGramBlocker | None = None      # DeepSeek-OCR's no-repeat n-gram rule
    detokenize: bool = True

    def __post_init__(self):
        # only shape conversions that cannot fail: anything else is for validate() to refuse
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        elif self.stop is None or isinstance(self.stop, tuple):
            self.stop = list(self.stop or [])
        if self.stop_token_ids is None or isinstance(self.stop_token_ids, tuple):
            self.stop_token_ids = list(self.stop_token_ids or [])
        g = self.repetition_guard
        if isinstance(g, dict) and all(isinstance(k, str) for k in g) and set(g) <= _GUARD_FIELDS:
            self.repetition_guard = RepetitionGuard(**g)
        b = self.ngram_blocker
        if isinstance(b, dict) and all(isinstance(k, str) for k in b) and set(b) <= _NGRAM_FIELDS \
                and {"size", "window"} <= set(b):
            self.ngram_blocker = NGramBlocker(**b)
        if _is_int(self.top_k) and self.top_k == -1:
            self.top_k = 0

    @property
    def greedy(self) -> bool:
        return self.temperature < SAMPLING_EPS

    def validate(self, vocab_size: int | None = None) -> None:
        """Raises InvalidRequest naming the bad field; normalizes in place what vLLM normalizes
        (greedy below 1e-5, the temperature floor, top_k -1 or >= vocab -> 0). Idempotent."""
        check_int("n", self.n, 1, 1, "1 (one completion per request)")
        if self.max_tokens is not None:
            check_int("max_tokens", self.max_tokens, 1)
        check_int("min_tokens", self.min_tokens, 0)
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            _fail("min_tokens", f"({self.min_tokens}) must be <= max_tokens ({self.max_tokens})")
        t = check_float("temperature", self.temperature, 0.0, MAX_TEMPERATURE)
        if t < SAMPLING_EPS:
            t = 0.0
        elif t < MIN_TEMPERATURE:
            log.debug("temperature %g raised to %g (smaller divisors overflow the logits)", t, MIN_TEMPERATURE)
            t = MIN_TEMPERATURE
        self.temperature = t
        self.top_p = check_float("top_p", self.top_p, 0.0, 1.0)
        k = check_int("top_k", self.top_k, -1, TOP_K_LIMIT - 1,
                      f"an integer in [-1, {TOP_K_LIMIT - 1}] (-1 or 0: off; values >= the vocabulary are off)")
        if k == -1 or (vocab_size is not None and k >= vocab_size):
            k = 0
        self.top_k = k
        self.repetition_penalty = check_float("repetition_penalty", self.repetition_penalty,
                                              *REPETITION_PENALTY_RANGE)
        if self.seed is not None:
            check_int("seed", self.seed, SEED_RANGE[0], SEED_RANGE[1] - 1)
        if not isinstance(self.stop, list) or len(self.stop) > MAX_STOP_STRINGS or not all(
                isinstance(s, str) and 0 < len(s) <= MAX_STOP_LEN for s in self.stop):
            _fail("stop", f"must be at most {MAX_STOP_STRINGS} non-empty strings of at most {MAX_STOP_LEN} "
                          f"characters, got {self.stop!r}"[:300])
        hi = (vocab_size - 1) if vocab_size is not None else None
        if not isinstance(self.stop_token_ids, list) or len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            _fail("stop_token_ids", f"must be a list of at most {MAX_STOP_TOKEN_IDS} token ids, "
                                    f"got {self.stop_token_ids!r}"[:300])
        for tok in self.stop_token_ids:
            check_int("stop_token_ids", tok, 0, hi, f"token ids in [0, {vocab_size})" if hi is not None else "token ids >= 0")
        for name in ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens", "detokenize"):
            check_bool(name, getattr(self, name))
        if self.logprobs is not None:
            check_int("logprobs", self.logprobs, 0, MAX_LOGPROBS)
        if not isinstance(self.repetition_guard, RepetitionGuard):
            g = self.repetition_guard
            _fail("repetition_guard", f"must be an object with {', '.join(sorted(_GUARD_FIELDS))}, got {g!r}"[:300])
        self.repetition_guard.validate()
        if self.ngram_blocker is not None:
            if not isinstance(self.ngram_blocker, NGramBlocker):
                _fail("ngram_blocker", f"must be an object with size, window and optionally whitelist, "
                                       f"got {self.ngram_blocker!r}"[:300])
            self.ngram_blocker.validate(vocab_size)
