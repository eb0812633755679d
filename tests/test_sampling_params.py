"""SamplingParams.validate, the one validation the server, the offline LLM and the CLI share:
every value is either refused with InvalidRequest naming its field, or sampled by the real
sampler without error (a property test over arbitrary JSON-like values), and the values that
used to kill the step loop (top_k >= 2^63, temperature 1e-46, repetition_penalty 1e-40) are
refused or made harmless."""
from __future__ import annotations

import math

import pytest
import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from fastdeploy_ext.engine.errors import InvalidRequest
from fastdeploy_ext.engine.sampling_params import RepetitionGuard, SamplingParams
from fastdeploy_ext.engine.sequence import Sequence
from fastdeploy_ext.ops.sampler import sample

from .engine_fakes import FakePromptBuilder
from .test_engine_scheduler import make_engine, prompts, run_all

VOCAB = FakePromptBuilder.vocab_size


def refused(field: str, **kw) -> str:
    with pytest.raises(InvalidRequest) as e:
        SamplingParams(**kw).validate(VOCAB)
    assert field in str(e.value), str(e.value)
    return str(e.value)


@pytest.mark.parametrize("field,value", [
    ("seed", 2**63), ("seed", -2**63 - 1), ("seed", 2**64), ("seed", 1.5), ("seed", True), ("seed", "7"),
    ("top_k", 2**63), ("top_k", 9223372036854775808), ("top_k", -2), ("top_k", 5.0), ("top_k", None),
    ("temperature", math.nan), ("temperature", math.inf), ("temperature", -1e-46), ("temperature", 1e5),
    ("temperature", 2**1100), ("temperature", "0"),
    ("top_p", math.nan), ("top_p", -0.0001), ("top_p", 1.5), ("top_p", None),
    ("repetition_penalty", 1e-40), ("repetition_penalty", 0), ("repetition_penalty", -1.0),
    ("repetition_penalty", 101.0), ("repetition_penalty", math.inf), ("repetition_penalty", math.nan),
    ("max_tokens", 0), ("max_tokens", 2.0), ("min_tokens", -1), ("n", 2), ("logprobs", 21), ("logprobs", -1),
    ("stop", [""]), ("stop", 5), ("stop", ["x"] * 33), ("stop", ["x" * 1025]), ("stop", [None]),
    ("stop_token_ids", [VOCAB]), ("stop_token_ids", [-1]), ("stop_token_ids", {"a": 1}),
    ("stop_token_ids", list(range(60)) * 20),
    ("ignore_eos", "yes"), ("skip_special_tokens", 1), ("include_stop_str_in_output", None),
    ("repetition_guard", {"max_period": 513}), ("repetition_guard", {"max_period": 10**7, "enabled": False}),
    ("repetition_guard", {"min_repeats": 0}), ("repetition_guard", {"min_span": 2**21}),
    ("repetition_guard", {"enabled": "no"}), ("repetition_guard", {"bogus": 1}), ("repetition_guard", 3),
])
def test_out_of_range_values_are_refused_naming_the_field(field, value):
    refused(field, **{field: value})


def test_min_tokens_above_max_tokens_is_refused():
    assert "max_tokens" in refused("min_tokens", min_tokens=5, max_tokens=4)


@pytest.mark.parametrize("kw,expect", [
    ({"temperature": 1e-46}, {"temperature": 0.0}),            # 0 in float32: greedy, not NaN
    ({"temperature": 9.9e-6}, {"temperature": 0.0}),
    ({"temperature": 1e-5}, {"temperature": 0.01}),            # vLLM's floor for tiny temperatures
    ({"temperature": 0.5}, {"temperature": 0.5}),
    ({"top_k": -1}, {"top_k": 0}),
    ({"top_k": VOCAB}, {"top_k": 0}),                          # >= vocab: off
    ({"top_k": 2**63 - 1}, {"top_k": 0}),
    ({"top_k": VOCAB - 1}, {"top_k": VOCAB - 1}),
    ({"top_p": 0}, {"top_p": 0.0}),                            # PaddleX's fastdeploy-server client
    ({"seed": -2**63}, {"seed": -2**63}), ({"seed": 2**63 - 1}, {"seed": 2**63 - 1}),
    ({"repetition_penalty": 0.01}, {"repetition_penalty": 0.01}),
    ({"repetition_penalty": 100}, {"repetition_penalty": 100.0}),
])
def test_edge_values_are_normalized_as_vllm_does(kw, expect):
    p = SamplingParams(**kw)
    p.validate(VOCAB)
    assert {k: getattr(p, k) for k in expect} == expect
    p.validate(VOCAB)                                          # idempotent
    assert {k: getattr(p, k) for k in expect} == expect


def test_a_disabled_guard_allocates_no_per_request_state():
    eng = make_engine()
    off = SamplingParams(repetition_guard=RepetitionGuard(enabled=False, max_period=512))
    on = SamplingParams(repetition_guard=RepetitionGuard(max_period=512))
    seq_off = eng.process_request("a", prompts(1)[0], off)
    seq_on = eng.process_request("b", prompts(1)[0], on)
    assert isinstance(seq_off, Sequence) and seq_off.repeat_runs == [] and len(seq_on.repeat_runs) == 512


def test_the_killer_values_run_in_a_batch_and_top_p_zero_is_greedy():
    """The values that killed the step loop, in one batch with ordinary requests: all finish."""
    eng = make_engine()
    greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    ref = [o.token_ids for o in run_all(make_engine(), prompts(4), greedy)]
    killers = [SamplingParams(temperature=1e-46, max_tokens=6, ignore_eos=True),
               SamplingParams(temperature=1.0, top_k=2**63 - 1, max_tokens=6, ignore_eos=True, seed=2**63 - 1),
               SamplingParams(temperature=1.0, top_p=0, max_tokens=6, ignore_eos=True, seed=-2**63),
               SamplingParams(temperature=0.7, repetition_penalty=0.01, max_tokens=6, ignore_eos=True, seed=3)]
    for i, (p, params) in enumerate(zip(prompts(4), killers)):
        eng.add_request(str(i), p, params)
    done = {}
    while eng.has_unfinished():
        done.update({o.request_id: o for o in eng.step()})
    assert [done[str(i)].finish_reason for i in range(4)] == ["length"] * 4
    assert done["0"].token_ids == ref[0] and done["2"].token_ids == ref[2]     # greedy, exactly
    assert eng.block_manager.num_used == 0


# --------------------------------------------------------------------------- the property
_FIELDS = ["n", "max_tokens", "min_tokens", "temperature", "top_p", "top_k", "seed", "repetition_penalty",
           "stop", "stop_token_ids", "ignore_eos", "include_stop_str_in_output", "skip_special_tokens",
           "logprobs", "repetition_guard", "detokenize"]
_EDGES = [0, 1, -1, 2, 5, 20, 21, VOCAB - 1, VOCAB, 511, 512, 513, 2**31, 2**63 - 1, 2**63, -2**63, -2**63 - 1, 2**64,
          2**70, -2**70, 0.0, -0.0, 1.0, 0.5, 1e-46, 1e-40, 5e-6, 1e-5, 0.009, 0.01, 100.0, 100.5, 1e4, 1e5, 1e308,
          math.nan, math.inf, -math.inf]
_scalars = (st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.sampled_from(_EDGES)
            | st.floats(allow_nan=True, allow_infinity=True) | st.text(max_size=4))
_json = st.recursive(_scalars, lambda inner: st.lists(inner, max_size=3)
                     | st.dictionaries(st.text(max_size=12), inner, max_size=3), max_leaves=6)
_guard = st.fixed_dictionaries({}, optional={"enabled": st.booleans(), "max_period": st.integers(1, 512),
                                             "min_repeats": st.integers(1, 64), "min_span": st.integers(1, 256)})
_plausible = {"n": st.just(1), "temperature": st.floats(0, 2), "top_p": st.floats(0, 1),
              "top_k": st.integers(-1, 2 * VOCAB), "repetition_penalty": st.floats(0.01, 100),
              "seed": st.none() | st.integers(-2**63, 2**63 - 1), "logprobs": st.none() | st.integers(0, 20),
              "max_tokens": st.none() | st.integers(4, 8), "min_tokens": st.integers(0, 3),
              "stop": st.lists(st.text(min_size=1, max_size=3), max_size=2),
              "stop_token_ids": st.lists(st.integers(0, VOCAB - 1), max_size=3), "repetition_guard": _guard,
              **{f: st.booleans() for f in ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens",
                                            "detokenize")}}
_wild = _json | st.sampled_from(_EDGES)
# plausible values for some fields, then now and then one or two fields set to anything at all:
# the sampler sees many valid combinations and the validation many kinds of bad value
_params = st.builds(lambda base, wild: {**base, **wild},
                    st.fixed_dictionaries({}, optional=_plausible),
                    st.dictionaries(st.sampled_from(_FIELDS), _wild, max_size=2))


_ENGINE = None


def _engine():
    global _ENGINE
    if _ENGINE is None:
        _ENGINE = make_engine()
    return _ENGINE


@settings(max_examples=200, derandomize=True, database=None, deadline=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(_params)
def test_every_value_is_refused_naming_its_field_or_sampled_without_error(kw):
    eng = _engine()
    try:
        params = SamplingParams(**kw)
        seq = eng.process_request("p", {"prompt": "x"}, params)
    except InvalidRequest as e:
        named = [f for f in kw if f in str(e)]
        assert named or "max-model-len" in str(e), (kw, str(e))
        event("refused")
        return
    event("sampled")
    # the engine's own SampleRequest, on the real sampler, next to an ordinary row, with and
    # without output history (the repetition penalty), with min_tokens bans
    logits = torch.randn(2, VOCAB, generator=torch.Generator().manual_seed(0)) * 8
    for out in ([], [5, 6, 5]):
        seq.token_ids = seq.token_ids[:seq.prompt_len] + out
        reqs = [eng._sample_request(seq), eng._sample_request(eng.process_request("q", {"prompt": "y"}))]
        res = sample(logits.clone(), reqs)
        assert res.errors == [None, None], (kw, res.errors)
        assert all(0 <= t < VOCAB for t in res.token_ids)
        if params.logprobs is not None:
            lp = res.logprobs[0]
            assert math.isfinite(lp["logprob"]) and len(lp["top"]) == params.logprobs
