"""Next-token sampling for one engine step, on the device, its host read queued at the end.

Per request: greedy (temperature 0), temperature, top_k, top_p (applied in transformers' order:
repetition penalty, temperature, top-k, top-p), a seed (a per-request generator, so a request's
samples do not depend on its batch mates), repetition_penalty (transformers' rule over prompt
and output tokens), min_tokens (end tokens masked until reached), logprobs/top_logprobs of the
model's raw distribution (vLLM's default).

The last line of defence against values that slipped past SamplingParams.validate (or a model
that produced NaN): a row whose logits are not finite where they matter (NaN or +inf anywhere,
or nothing left to sample after the penalties, bans and filters) is never handed to
``multinomial`` (a NaN there raises on the CPU and is a device assert on CUDA); it gets
``SampleResult.errors[i]`` and the engine fails that request alone. The check is computed on the
device and travels in the step's single host transfer.

``sample_async`` returns a :class:`PendingSample`: the sampled ids stay on the device (the next
decode step reads them there) and the host copy of everything the engine needs (ids, the finite
flags, logprobs) is queued through the device API (``start_host_read``: pinned memory and an
event on CUDA); ``result()`` waits for it. The engine's overlapped loop calls it one step later;
``sample`` is the synchronous ``sample_async(...).result()``.
"""
from __future__ import annotations

import sys
from dataclasses import dataclass, field
from typing import Callable
from typing import Sequence as Seq

import torch

from ..device_api import HostRead, device_api_for


@dataclass
class SampleRequest:
    """One row of the logits and how to sample it."""
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    repetition_penalty: float = 1.0
    history: Seq[int] = ()                      # prompt + output ids (for the repetition penalty)
    generator: torch.Generator | None = None    # seeded requests only
    num_logprobs: int | None = None             # None: no logprobs
    banned_ids: Seq[int] = ()                   # min_tokens not reached: eos / stop ids masked


@dataclass
class SampleResult:
    token_ids: list[int]
    logprobs: list[dict | None] = field(default_factory=list)   # {"logprob", "rank"?, "top": [(id, lp)]}
    errors: list[str | None] = field(default_factory=list)      # per row: why it could not be sampled

    def __post_init__(self):
        # one entry per row always (a caller building a result by hand may leave these out)
        n = len(self.token_ids)
        self.logprobs = self.logprobs or [None] * n
        self.errors = self.errors or [None] * n


@dataclass
class PendingSample:
    """One step's samples: ``token_ids`` on the device now (int64 [n], the next decode step's
    inputs), the host's SampleResult once ``result()`` has waited for the queued host read."""
    token_ids: torch.Tensor
    read: HostRead
    decode: Callable[[tuple[torch.Tensor, ...]], SampleResult]

    def result(self) -> SampleResult:
        return self.decode(self.read.get())

    @classmethod
    def done(cls, result: SampleResult, device: torch.device | str = "cpu") -> "PendingSample":
        """A result already on the host (its ids uploaded for the next step): tests and callers
        that replace the sampler."""
        ids = torch.tensor(result.token_ids, dtype=torch.int64, device=device)
        return cls(ids, HostRead(()), lambda _host: result)


GREEDY_EPS = 1e-5        # a temperature below samples greedily (vLLM's _SAMPLING_EPS; SamplingParams.validate
                         # maps such temperatures to 0 with this same constant)


def row_chunks(vocab: int) -> int | None:
    """How many equal pieces :func:`row_max` cuts a row of ``vocab`` into: the divisor giving
    pieces nearest 1024 wide, from 16 pieces up (None: a narrow or indivisible row, one pass)."""
    ds = [d for d in range(16, vocab // 256 + 1) if vocab % d == 0]
    return min(ds, key=lambda d: abs(vocab // d - 1024)) if ds else None


def row_max(logits: torch.Tensor, chunks: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(max, index of its first occurrence) of each row of [n, vocab], as ``logits.max(-1)``
    (NaN the maximum). On CUDA a wide row goes in two reductions, the pieces' then theirs:
    ATen's one-pass reduction of 64 rows of 129,280 logits spreads over too few blocks (40 us
    on the H200, a percent of a decode step). ``chunks``: the pieces (None: ``row_chunks``
    on CUDA, one pass elsewhere)."""
    n, vocab = logits.shape
    if chunks is None:
        chunks = row_chunks(vocab) if logits.device.type == "cuda" else None
    if not chunks or chunks == 1 or vocab % chunks or not logits.is_contiguous():
        return logits.max(dim=-1)
    width = vocab // chunks
    piece_max, piece_idx = logits.view(n, chunks, width).max(dim=-1)
    top, piece = piece_max.max(dim=-1)          # ties: the first piece, and within it the first index
    return top, piece * width + piece_idx.gather(1, piece[:, None]).squeeze(1)


def _is_greedy(r: "SampleRequest") -> bool:
    """Greedy: no temperature, or top_p 0 (only the most likely token survives the filter; taken
    as the argmax here, exactly, not through a float cumulative sum that can keep two)."""
    return r.temperature < GREEDY_EPS or r.top_p <= 0.0


def _row_errors(rows_bad: list[bool], reqs: list["SampleRequest"]) -> list[str | None]:
    return [f"cannot sample: the logits are not finite (NaN or inf) or nothing is left to sample after the "
            f"penalties and filters (temperature={r.temperature:g}, top_p={r.top_p:g}, top_k={r.top_k}, "
            f"repetition_penalty={r.repetition_penalty:g})" if b else None for b, r in zip(rows_bad, reqs)]


_FLOAT32_EXPONENT = 0x7F800000      # all exponent bits set: +-inf or NaN


def _pack_ids_and_bits(ids: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """One device tensor for the host to read: the int64 ids viewed as int32 pairs (low word
    first on every little-endian device; ids < 2**31) next to the float32 values' raw bits, whose
    exponent says inf/NaN (one concatenation, one transfer)."""
    if sys.byteorder != "little":          # no supported device is big-endian; stay correct anyway
        return torch.stack([ids, (~torch.isfinite(values)).to(ids.dtype)])
    return torch.cat([ids.contiguous().view(torch.int32), values.float().contiguous().view(torch.int32)])


def _unpack_ids_and_bits(packed: torch.Tensor, n: int) -> tuple[list[int], list[bool]]:
    """Host ids and "value is not finite" per row from _pack_ids_and_bits' tensor (on the host)."""
    if packed.dim() == 2:
        ids_host, bad_host = packed.tolist()
        return ids_host, [bool(b) for b in bad_host]
    flat = packed.tolist()
    return flat[0:2 * n:2], [(b & _FLOAT32_EXPONENT) == _FLOAT32_EXPONENT for b in flat[2 * n:]]


def _ids_and_nonfinite(ids: torch.Tensor, values: torch.Tensor) -> tuple[list[int], list[bool]]:
    """Host ids and "value is not finite" per row, in one transfer."""
    return _unpack_ids_and_bits(_pack_ids_and_bits(ids, values).cpu(), ids.shape[0])


def _apply_repetition_penalty(logits: torch.Tensor, rows: list[int], reqs: list[SampleRequest]) -> None:
    for i in rows:
        r = reqs[i]
        ids = torch.as_tensor(list(r.history), dtype=torch.long).to(logits.device, non_blocking=True)
        score = logits[i].gather(0, ids)
        score = torch.where(score < 0, score * r.repetition_penalty, score / r.repetition_penalty)
        logits[i].scatter_(0, ids, score)


def _filter_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                        use_k: bool, use_p: bool) -> torch.Tensor:
    """logits [n, V] already divided by the temperature; top_k 0 = off, top_p 1 = off."""
    vocab = logits.shape[-1]
    if use_k:
        k = torch.where(top_k > 0, top_k, torch.full_like(top_k, vocab)).clamp(max=vocab)
        sorted_desc = logits.sort(dim=-1, descending=True).values
        kth = sorted_desc.gather(1, (k - 1).unsqueeze(1))
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if use_p:
        # transformers' TopPLogitsWarper: drop the low tail whose cumulative mass is <= 1 - top_p,
        # always keeping the most likely token
        sorted_logits, idx = logits.sort(dim=-1, descending=False)
        cum = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
        remove = cum <= (1 - top_p).unsqueeze(1)
        remove[:, -1] = False
        logits = logits.masked_fill(remove.scatter(1, idx, remove), float("-inf"))
    return logits


def sample(logits: torch.Tensor, reqs: list[SampleRequest]) -> SampleResult:
    """logits: float32 [len(reqs), V] on the device (rows may be modified in place); waits for
    the host read."""
    return sample_async(logits, reqs).result()


def sample_async(logits: torch.Tensor, reqs: list[SampleRequest],
                 start_read: Callable[[tuple[torch.Tensor, ...]], HostRead] | None = None) -> PendingSample:
    """Sample on the device and queue the host read (``start_read``: the device API's
    start_host_read by default) without waiting for it."""
    n = logits.shape[0]
    if n != len(reqs):
        raise ValueError(f"sampler: {n} logits rows for {len(reqs)} requests")
    start_read = start_read or device_api_for(logits.device).start_host_read
    if n == 0:
        return PendingSample(torch.empty(0, dtype=torch.long, device=logits.device), HostRead(()),
                             lambda _host: SampleResult([], [], []))
    logits = logits.float()
    want_lp = [i for i, r in enumerate(reqs) if r.num_logprobs is not None]
    raw_logprobs = logits.log_softmax(dim=-1) if want_lp else None
    penal = [i for i, r in enumerate(reqs) if r.repetition_penalty != 1.0 and r.history]
    if penal:
        _apply_repetition_penalty(logits, penal, reqs)
    bans: dict[tuple, list[int]] = {}
    for i, r in enumerate(reqs):
        if r.banned_ids:
            bans.setdefault(tuple(r.banned_ids), []).append(i)
    # -inf as a device tensor: `logits[i, j] = float("-inf")` would have torch upload the scalar
    # with a blocking copy, a wait for the whole step's kernels on every step (the family's
    # never-sampled ids make a ban list on every row)
    neg_inf = torch.full((), float("-inf"), dtype=logits.dtype, device=logits.device) if bans else None
    for ids, rows in bans.items():       # one masked write per distinct ban list (usually one)
        idx = torch.tensor(rows, dtype=torch.long).to(logits.device, non_blocking=True)
        cols = torch.tensor(ids, dtype=torch.long).to(logits.device, non_blocking=True)
        logits.index_put_((idx.unsqueeze(1), cols.unsqueeze(0)), neg_inf)

    vocab = logits.shape[-1]
    greedy = all(_is_greedy(r) for r in reqs)
    # max propagates NaN (a NaN is the maximum) and picks +inf over any finite value, and the
    # maximum is -inf only when the whole row is: the row's maximum alone says whether the row is
    # finite. It comes out of the same reduction as the argmax; on the greedy path it travels to
    # the host as raw bits next to the ids and is checked there (no extra kernels on the step:
    # isfinite alone is five launches on CUDA, ~8 % of a batch-1 decode step on the H200)
    top_values, next_ids = row_max(logits)
    if greedy and not want_lp:
        def decode_greedy(host):
            ids_host, bad_host = _unpack_ids_and_bits(host[0], n)
            return SampleResult(ids_host, [None] * n, _row_errors(bad_host, reqs))
        return PendingSample(next_ids, start_read((_pack_ids_and_bits(next_ids, top_values),)), decode_greedy)
    bad = ~torch.isfinite(top_values)
    if not greedy:
        dev = logits.device
        temp = torch.tensor([1.0 if _is_greedy(r) else r.temperature for r in reqs], dtype=torch.float32)
        top_k = torch.tensor([min(max(r.top_k, 0), vocab) for r in reqs], dtype=torch.long)
        top_p = torch.tensor([r.top_p for r in reqs], dtype=torch.float32)
        scaled = logits / temp.to(dev, non_blocking=True).unsqueeze(1)
        scaled = _filter_top_k_top_p(scaled, top_k.to(dev, non_blocking=True), top_p.to(dev, non_blocking=True),
                                     any(r.top_k > 0 for r in reqs), any(r.top_p < 1.0 for r in reqs))
        bad |= ~torch.isfinite(scaled.amax(dim=-1))
        # a bad row samples from a harmless uniform row; its token is thrown away with the error
        scaled = scaled.masked_fill(bad.unsqueeze(1), 0.0)
        probs = scaled.softmax(dim=-1)
        rand_rows = [i for i, r in enumerate(reqs) if not _is_greedy(r)]
        unseeded = [i for i in rand_rows if reqs[i].generator is None]
        sampled = next_ids.clone()
        if unseeded:
            idx = torch.tensor(unseeded, dtype=torch.long).to(dev, non_blocking=True)
            sampled.index_copy_(0, idx, torch.multinomial(probs.index_select(0, idx), 1).squeeze(1))
        for i in rand_rows:
            if reqs[i].generator is not None:
                sampled[i] = torch.multinomial(probs[i], 1, generator=reqs[i].generator)[0]
        next_ids = sampled

    ids_and_bad = torch.stack([next_ids, bad.to(next_ids.dtype)])
    if not want_lp:
        def decode_plain(host):
            ids_host, bad_host = host[0].tolist()
            return SampleResult(ids_host, [None] * n, _row_errors(bad_host, reqs))
        return PendingSample(next_ids, start_read((ids_and_bad,)), decode_plain)
    # one host read for the ids and everything logprobs need
    kmax = max(reqs[i].num_logprobs for i in want_lp)
    lp_rows = raw_logprobs.index_select(0, torch.tensor(want_lp, dtype=torch.long).to(logits.device))
    chosen_ids = next_ids.index_select(0, torch.tensor(want_lp, dtype=torch.long).to(logits.device))
    chosen = lp_rows.gather(1, chosen_ids.unsqueeze(1)).squeeze(1)
    rank = (lp_rows > chosen.unsqueeze(1)).sum(dim=1) + 1
    top = lp_rows.topk(kmax, dim=-1) if kmax > 0 else None
    tensors = (ids_and_bad, chosen, rank) + ((top.values, top.indices) if top is not None else ())

    def decode_logprobs(host):
        ids_host, bad_host = host[0].tolist()
        chosen_h, rank_h = host[1].tolist(), host[2].tolist()
        top_v, top_i = (host[3].tolist(), host[4].tolist()) if top is not None else (None, None)
        out: list[dict | None] = [None] * n
        for j, i in enumerate(want_lp):
            if bad_host[i]:
                continue
            k = reqs[i].num_logprobs
            out[i] = {"token_id": ids_host[i], "logprob": chosen_h[j], "rank": rank_h[j],
                      "top": list(zip(top_i[j][:k], top_v[j][:k])) if k else []}
        return SampleResult(ids_host, out, _row_errors(bad_host, reqs))
    return PendingSample(next_ids, start_read(tensors), decode_logprobs)
