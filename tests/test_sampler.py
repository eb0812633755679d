"""ops/sampler.py and the host-side stop checks (engine/output_processor.py)."""
from __future__ import annotations

import pytest
import torch

from fastdeploy_ext.engine.output_processor import OutputProcessor
from fastdeploy_ext.engine.sampling_params import RepetitionGuard, SamplingParams
from fastdeploy_ext.engine.sequence import ProcessedPrompt, Sequence
from fastdeploy_ext.ops.sampler import SampleRequest, sample, sample_async

from .engine_fakes import FakeTokenizer


def logits(n=4, v=50, seed=0):
    return torch.randn(n, v, generator=torch.Generator().manual_seed(seed))


def test_greedy_is_argmax_and_top_k1_top_p_tiny_are_greedy():
    x = logits()
    ref = x.argmax(-1).tolist()
    assert sample(x.clone(), [SampleRequest()] * 4).token_ids == ref
    assert sample(x.clone(), [SampleRequest(temperature=1.0, top_k=1)] * 4).token_ids == ref
    assert sample(x.clone(), [SampleRequest(temperature=1.0, top_p=1e-6)] * 4).token_ids == ref


def test_top_k_and_top_p_filters_match_transformers():
    tr = pytest.importorskip("transformers.generation.logits_process")
    from fastdeploy_ext.ops.sampler import _filter_top_k_top_p
    x = logits(3, 40)
    ours = _filter_top_k_top_p(x.clone(), torch.tensor([5, 5, 5]), torch.tensor([0.7] * 3), True, True)
    ref = tr.TopPLogitsWarper(0.7)(None, tr.TopKLogitsWarper(5)(None, x.clone()))
    assert torch.equal(torch.isinf(ours), torch.isinf(ref))


def test_seeded_sampling_is_reproducible_and_batch_independent():
    x = logits(3, 50)
    def draw(seed, rows):
        gens = [torch.Generator().manual_seed(seed) for _ in rows]
        return [sample(x[rows].clone(), [SampleRequest(temperature=1.0, generator=g) for g in gens]).token_ids
                for _ in range(1)][0]
    a = [draw(7, [1])[0] for _ in range(3)]
    assert a[0] == a[1] == a[2]
    g1 = torch.Generator().manual_seed(7)
    alone = [sample(x[1:2].clone(), [SampleRequest(temperature=1.0, generator=g1)]).token_ids[0] for _ in range(20)]
    g2 = torch.Generator().manual_seed(7)
    batched = [sample(x.clone(), [SampleRequest(temperature=1.0), SampleRequest(temperature=1.0, generator=g2),
                                  SampleRequest()]).token_ids[1] for _ in range(20)]
    assert alone == batched
    assert len(set(alone)) > 1       # it does sample


def test_repetition_penalty_matches_transformers():
    tr = pytest.importorskip("transformers.generation.logits_process")
    x = logits(1, 30)
    hist = [3, 5, 5, 7, 20]
    ref = tr.RepetitionPenaltyLogitsProcessor(1.3)(torch.tensor([hist]), x.clone())
    ours = x.clone()
    res = sample(ours, [SampleRequest(repetition_penalty=1.3, history=hist)])
    assert res.token_ids == ref.argmax(-1).tolist()
    assert torch.allclose(ours, ref)


def test_logprobs_are_the_raw_distribution():
    x = logits(2, 20)
    res = sample(x.clone(), [SampleRequest(num_logprobs=3), SampleRequest()])
    lp = x[0].log_softmax(-1)
    d = res.logprobs[0]
    assert d["token_id"] == res.token_ids[0] and d["rank"] == 1
    assert abs(d["logprob"] - lp.max().item()) < 1e-6
    assert [t for t, _ in d["top"]] == lp.topk(3).indices.tolist()
    assert res.logprobs[1] is None


def make_seq(params, prompt=(1, 5, 6)):
    pp = ProcessedPrompt(list(prompt), torch.arange(len(prompt)).expand(3, -1), 0)
    params.validate(64)
    return Sequence(0, "r", pp, params, params.max_tokens or 100, eos_token_ids=(2,))


def feed(seq, tokens, proc=None):
    proc = proc or OutputProcessor(FakeTokenizer())
    for t in tokens:
        proc.append_token(seq, t, None, 0.0)
        if seq.finish_reason is not None:
            break
    return seq


def test_stop_conditions():
    s = feed(make_seq(SamplingParams(max_tokens=10)), [7, 8, 2, 9])
    assert s.finish_reason.value == "stop" and s.output_token_ids == [7, 8, 2] and s.stop_reason is None
    s = feed(make_seq(SamplingParams(max_tokens=10, ignore_eos=True)), [7, 2, 9, 9])
    assert s.finish_reason is None and s.num_output_tokens == 4
    s = feed(make_seq(SamplingParams(max_tokens=3, ignore_eos=True)), [7, 2, 9, 9])
    assert s.finish_reason.value == "length" and s.num_output_tokens == 3
    s = feed(make_seq(SamplingParams(max_tokens=10, stop_token_ids=[9])), [7, 9, 10])
    assert s.finish_reason.value == "stop" and s.stop_reason == 9
    # stop string: tokens 7,8,9 decode to "hij"; "ij" stops, text cut before it
    s = feed(make_seq(SamplingParams(max_tokens=10, stop=["ij"])), [7, 8, 9, 10])
    assert s.finish_reason.value == "stop" and s.stop_reason == "ij" and s.text == "h"
    s = feed(make_seq(SamplingParams(max_tokens=10, stop=["ij"], include_stop_str_in_output=True)), [7, 8, 9])
    assert s.text == "hij"
    s = feed(make_seq(SamplingParams(max_tokens=10, min_tokens=3)), [2, 7, 8, 2])
    assert s.num_output_tokens == 4 and s.finish_reason.value == "stop"


def test_repetition_guard_fires_and_can_be_disabled():
    guard = RepetitionGuard(max_period=4, min_repeats=5, min_span=12)
    loop = [11, 12, 13] * 10
    s = feed(make_seq(SamplingParams(max_tokens=100, repetition_guard=guard)), [20, 21] + loop)
    assert s.finish_reason.value == "repetition" and s.stop_reason == "repetition"
    assert s.num_output_tokens == 2 + 15     # period 3 x 5 repeats >= span 12: fires at the 15th loop token
    off = RepetitionGuard(enabled=False)
    s = feed(make_seq(SamplingParams(max_tokens=100, repetition_guard=off)), [20, 21] + loop)
    assert s.finish_reason is None
    # varied text never fires
    s = feed(make_seq(SamplingParams(max_tokens=100, repetition_guard=guard)), list(range(3, 60)))
    assert s.finish_reason is None


def _fires_by_definition(out: list[int], g: RepetitionGuard) -> bool:
    """The guard's rule from its docstring, by brute force over the output so far."""
    for p in range(1, g.max_period + 1):
        span = g.span_needed(p)
        if len(out) >= span and all(out[-i] == out[-i - p] for i in range(1, span - p + 1)):
            return True
    return False


@pytest.mark.parametrize("vocab", [3, 8, 200])
def test_repetition_guard_equals_its_definition(vocab):
    """The incremental run counters (and their shortcut when the token is new to the window)
    fire exactly where the brute-force rule does, on streams that loop, break and loop again."""
    import random
    g = RepetitionGuard(max_period=6, min_repeats=3, min_span=10)
    rng = random.Random(vocab)
    for trial in range(40):
        toks, pattern = [], [rng.randrange(3, 3 + vocab) for _ in range(rng.randint(1, 6))]
        while len(toks) < 80:
            if rng.random() < 0.15:                    # break the loop with a fresh token
                toks.append(rng.randrange(3, 3 + vocab))
                pattern = [rng.randrange(3, 3 + vocab) for _ in range(rng.randint(1, 6))]
            else:
                toks.append(pattern[len(toks) % len(pattern)])
        expect = next((i + 1 for i in range(len(toks)) if _fires_by_definition(toks[:i + 1], g)), None)
        s = feed(make_seq(SamplingParams(max_tokens=100, ignore_eos=True, repetition_guard=g)), toks)
        got = s.num_output_tokens if s.finish_reason is not None else None
        assert got == expect, (trial, toks)


def test_bad_sampling_params_name_the_field():
    from fastdeploy_ext.engine.errors import InvalidRequest
    for kw, word in [({"temperature": -1}, "temperature"), ({"top_p": 1.5}, "top_p"), ({"top_k": -2}, "top_k"),
                     ({"max_tokens": 0}, "max_tokens"), ({"stop_token_ids": [99]}, "stop_token_ids"),
                     ({"logprobs": 50}, "logprobs"), ({"repetition_guard": {"max_period": 0}}, "max_period")]:
        with pytest.raises(InvalidRequest, match=word):
            SamplingParams(**kw).validate(64)


def test_top_p_zero_keeps_exactly_the_most_likely_token():
    """top_p=0 (PaddleX's fastdeploy-server client sends it) is the argmax, not a float cumulative
    sum: over a near-uniform 152k vocabulary the transformers-style filter keeps several tokens."""
    from fastdeploy_ext.ops.sampler import _filter_top_k_top_p
    x = torch.randn(4, 151936, generator=torch.Generator().manual_seed(0)) * 1e-3
    kept = (_filter_top_k_top_p(x.clone(), torch.zeros(4, dtype=torch.long), torch.zeros(4), False, True)
            > float("-inf")).sum(-1)
    assert kept.max() > 1                         # the cumsum edge case this guards against
    ref = x.argmax(-1).tolist()
    for seed in range(8):
        g = torch.Generator().manual_seed(seed)
        reqs = [SampleRequest(temperature=1.0, top_p=0.0), SampleRequest(temperature=1.0, top_p=0.0, generator=g),
                SampleRequest(temperature=2.0, top_p=0.0, top_k=50), SampleRequest(temperature=0.0)]
        assert sample(x.clone(), reqs).token_ids == ref


@pytest.mark.parametrize("poison", ["nan", "posinf", "all_neginf"])
@pytest.mark.parametrize("mode", ["greedy", "sampled", "logprobs"])
def test_a_row_with_non_finite_logits_fails_alone(poison, mode):
    """The sampler's last line of defence: the poisoned row gets an error, never reaches
    multinomial (a NaN there raises on the CPU, asserts on CUDA); the other rows sample as they
    would without it."""
    x = logits(4, 50, seed=3)
    bad = x.clone()
    if poison == "nan":
        bad[2, 7] = float("nan")
    elif poison == "posinf":
        bad[2, 7] = float("inf")
    else:
        bad[2] = float("-inf")

    def reqs():
        kw = {"greedy": dict(temperature=0.0), "sampled": dict(temperature=0.8, top_p=0.9),
              "logprobs": dict(temperature=0.8, num_logprobs=3)}[mode]
        return [SampleRequest(generator=torch.Generator().manual_seed(i), **kw) for i in range(4)]
    res = sample(bad, reqs())
    clean = sample(x.clone(), reqs())
    # unseeded rows share one multinomial call: the poisoned row must not break it either
    free = sample(bad.clone(), [SampleRequest(temperature=0.8, top_k=10) for _ in range(4)])
    assert free.errors[2] is not None and free.errors.count(None) == 3
    assert res.errors[2] is not None and "not finite" in res.errors[2]
    assert [res.errors[i] for i in (0, 1, 3)] == [None] * 3
    assert [res.token_ids[i] for i in (0, 1, 3)] == [clean.token_ids[i] for i in (0, 1, 3)]
    if mode == "logprobs":
        assert res.logprobs[2] is None and [res.logprobs[i] for i in (0, 1, 3)] == [clean.logprobs[i] for i in (0, 1, 3)]


def test_values_past_validation_cannot_overflow_the_sampler():
    """top_k beyond the vocabulary and a 0-in-float32 temperature, handed straight to the
    sampler (not through SamplingParams): clamped and greedy, no error."""
    x = logits(2, 50, seed=4)
    res = sample(x.clone(), [SampleRequest(temperature=1.0, top_k=2**63 - 1, generator=torch.Generator().manual_seed(0)),
                             SampleRequest(temperature=1e-46, top_k=5)])
    assert res.errors == [None, None] and res.token_ids[1] == int(x[1].argmax())


@pytest.mark.parametrize("byteorder", ["little", "big"])
def test_packed_ids_and_finite_flags_read_back_exactly(monkeypatch, byteorder):
    """The greedy path's single transfer: ids next to the row maxima's raw float32 bits. Every
    kind of value (negative, -0.0, subnormal, huge, +-inf, NaN) and ids up to 2**31 - 1 come
    back as they went in; the fallback without the bit trick agrees."""
    from fastdeploy_ext.ops import sampler as sampler_mod
    monkeypatch.setattr(sampler_mod.sys, "byteorder", byteorder)
    values = torch.tensor([-3.5, -0.0, 1e-42, 3.0e38, float("inf"), float("-inf"), float("nan"), 7.0])
    ids = torch.tensor([0, 1, 2**31 - 1, 12345, 5, 6, 2**20, 99], dtype=torch.int64)
    got_ids, bad = sampler_mod._ids_and_nonfinite(ids, values)
    assert got_ids == ids.tolist()
    assert bad == [False, False, False, False, True, True, True, False]


@pytest.mark.parametrize("greedy", [True, False])
def test_banned_ids_are_masked_on_the_device_without_a_host_sync(greedy):
    """Every row bans ids (a family's never-sampled ids, min_tokens' eos): the masked write must
    not make the host wait for the device. Device tensors on meta, under the sync guard (which
    also fires on the Python-scalar form of that write: tests/test_sync_guard.py); then the same
    on the host, where the banned ids must never be picked."""
    from fastdeploy_ext.sync_guard import HostSyncGuard
    reqs = [SampleRequest(temperature=0.0 if greedy else 0.7, banned_ids=(3, 5)) for _ in range(4)]
    logits = torch.zeros(4, 8, device="meta")
    with HostSyncGuard({"meta"}):
        sample_async(logits, reqs)
    host = torch.zeros(4, 8)
    host[:, 3] = host[:, 5] = 10.0          # the banned ids are the most likely ones
    out = sample(host, [SampleRequest(temperature=0.0 if greedy else 0.7, banned_ids=(3, 5),
                                      generator=torch.Generator().manual_seed(i)) for i in range(4)])
    assert not {3, 5} & set(out.token_ids) and all(e is None for e in out.errors)


@pytest.mark.parametrize("chunks", [4, 8, 32])
def test_row_max_in_pieces_equals_one_pass(chunks):
    """The two-reduction row max (CUDA's greedy path) against logits.max(-1): random rows, a tie
    across pieces (the first occurrence wins), a row of -inf, a NaN row (NaN is the maximum)."""
    from fastdeploy_ext.ops.sampler import row_chunks, row_max
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 1024, generator=g)
    logits[1, 7] = logits[1, 900] = logits[1, 300] = 50.0           # ties in three pieces
    logits[2] = float("-inf")
    logits[3, 513] = float("nan")
    want_v, want_i = logits.max(dim=-1)
    got_v, got_i = row_max(logits, chunks)
    assert torch.equal(got_i, want_i) and got_i[1] == 7
    assert torch.equal(got_v[~want_v.isnan()], want_v[~want_v.isnan()]) and got_v[3].isnan()
    assert row_chunks(129280) == 128 and row_chunks(1000) is None
