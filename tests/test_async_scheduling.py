"""Overlapped ("async") scheduling on the fake runner: with the step loop building step N+1
before it reads step N's ids, every request's outputs (token ids, finish and stop reasons, text,
logprobs, streamed deltas) equal the synchronous loop's over a mixed batch — stop strings and
ids, min_tokens, seeded sampling, logprobs, the repetition penalty and guard — including
preemption in a tiny KV pool and aborts in flight; the extra token of a request that finished
one step earlier than the host knew is never reported nor counted. Planted bugs (the host's stale
id fed instead of the device's, the extra token reported, a penalty step not waiting) are seen."""
from __future__ import annotations

import argparse

import pytest

from fastdeploy_ext.engine import llm_engine
from fastdeploy_ext.engine.config import EngineConfig
from fastdeploy_ext.engine.llm_engine import LLMEngine
from fastdeploy_ext.engine.sampling_params import RepetitionGuard, SamplingParams
from fastdeploy_ext.engine.scheduler import ScheduledSeq, SchedulerOutput
from fastdeploy_ext.engine.step import UNRESOLVED_TOKEN
from fastdeploy_ext.entrypoints.args import add_engine_args

from .engine_fakes import FakeRunner, ScriptedRunner
from .test_engine_faults import PoisonRunner
from .test_engine_scheduler import make_engine, prompts

MIXED = [
    SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
    SamplingParams(temperature=0, max_tokens=20, min_tokens=6),                 # eos allowed after 6
    SamplingParams(temperature=0, max_tokens=30, stop=["qm", "hu"]),            # a stop string
    SamplingParams(temperature=0, max_tokens=10, logprobs=3, ignore_eos=True),
    SamplingParams(temperature=0.9, top_k=8, seed=7, max_tokens=14, logprobs=0),  # seeded sampling
    SamplingParams(temperature=0, max_tokens=10, repetition_penalty=1.5),       # forces a wait
    SamplingParams(temperature=0, max_tokens=25, stop_token_ids=[9, 17, 33]),
    SamplingParams(temperature=0.7, top_p=0.9, seed=3, max_tokens=8),
]
STREAM = {2, 6, 7}


def _summary(o):
    return (o.token_ids, o.finish_reason, o.stop_reason, o.text,
            [(d["token_id"], round(d["logprob"], 5), d["rank"], d["top"]) for d in o.logprobs] if o.logprobs else None)


def run(eng, params=MIXED, n=8, abort_at: dict[int, str] | None = None):
    """All requests queued at once, stepped to the end; aborts sent before the given step
    numbers. Returns {request: [every output]} and the steps the runner saw."""
    for i, p in enumerate(prompts(n)):
        eng.add_request(str(i), p, params[i % len(params)], stream=i in STREAM)
    outs: dict[str, list] = {}
    steps = 0
    while eng.has_unfinished():
        if abort_at and steps in abort_at:
            eng.abort_request(abort_at[steps])
        for o in eng.step():
            outs.setdefault(o.request_id, []).append(o)
        steps += 1
        assert steps < 5000
    assert eng.block_manager.num_used == 0 and eng.scheduler.num_running == 0
    return outs


def finals(outs):
    """Each request's final output (exactly one), its streamed deltas joined checked against it."""
    res = {}
    for rid, os_ in outs.items():
        done = [o for o in os_ if o.finished]
        assert len(done) == 1 and os_[-1] is done[0], f"request {rid}: {len(done)} final outputs"
        assert [t for o in os_ for t in o.delta_token_ids] == done[0].token_ids
        assert "".join(o.delta_text for o in os_) == done[0].text
        res[rid] = _summary(done[0])
    return res


def device_rows(runner) -> int:
    return sum(s.prev_row is not None for st in runner.steps for s in st.seqs)


POOLS = {"roomy": {}, "tiny": dict(num_kv_blocks=26, max_model_len=96, max_num_batched_tokens=64),
         "tiny-chunked": dict(num_kv_blocks=26, max_model_len=96, max_num_batched_tokens=7, enable_max_prefill=False)}


@pytest.mark.parametrize("pool", POOLS)
def test_mixed_batch_equal_with_async_on_and_off(pool):
    kw = POOLS[pool]
    got, stats = {}, {}
    for on in (False, True):
        runner = FakeRunner()
        eng = make_engine(runner, async_scheduling=on, **kw)
        assert eng.async_scheduling.value is on
        got[on] = finals(run(eng))
        stats[on] = eng.stats()
        assert (device_rows(runner) > 0) is on, "async on: decode rows read the previous step's ids on the device"
        if pool != "roomy":
            assert eng.scheduler.num_preemptions > 0
        if on and pool != "roomy":   # a prefill's sampled id fed the first decode step on the device (roomy:
            # the one prefill step holds the penalty request, so the decode after it waits instead)
            assert any(a.is_prefill and not b.is_prefill and any(
                s.prev_row is not None and s.seq_id in {x.seq_id for x in a.seqs if x.need_logits} for s in b.seqs)
                for a, b in zip(runner.steps, runner.steps[1:]))
    assert got[True] == got[False]
    reasons = {v[1] for v in got[True].values()}
    assert {"stop", "length"} <= reasons
    assert any(isinstance(v[2], str) for v in got[True].values()), "a stop string ended a request"
    # the dropped extra tokens are not counted; the penalty request made some steps wait
    assert stats[True].generation_tokens == stats[False].generation_tokens == sum(len(v[0]) for v in got[True].values())
    assert stats[True].num_sync_steps > 0 and stats[False].num_sync_steps == 0
    assert stats[True].async_scheduling and not stats[False].async_scheduling


def test_stop_strings_and_the_repetition_guard_end_at_the_same_token():
    """Every request generates 5 6 5 6 ... ("fgfg"): the guard, a stop string and eos end them at
    known tokens; async on, each ran one extra (dropped) step."""
    guard = RepetitionGuard(max_period=4, min_repeats=3, min_span=6)
    params = [SamplingParams(temperature=0, max_tokens=40, repetition_guard=guard),
              SamplingParams(temperature=0, max_tokens=40, stop=["gfg"], repetition_guard=RepetitionGuard(False)),
              SamplingParams(temperature=0, max_tokens=40, stop_token_ids=[6], min_tokens=3,
                             repetition_guard=RepetitionGuard(False))]
    got = {}
    for on in (False, True):
        runner = ScriptedRunner([5, 6])
        got[on] = finals(run(make_engine(runner, async_scheduling=on), params, n=3))
        if on:   # each request was sampled once more than it reports (its finish known one step late)
            assert all(runner.emitted[i] == len(got[on][str(i)][0]) + 1 for i in range(3))
    assert got[True] == got[False]
    assert got[True]["0"][1:3] == ("repetition", "repetition") and len(got[True]["0"][0]) == 6
    assert got[True]["1"][:4] == ([5, 6, 5, 6], "stop", "gfg", "f")
    # min_tokens 3 bans the stop id at the second token (the script's 6 becomes the argmax of the rest, 0)
    assert got[True]["2"][:3] == ([5, 0, 5, 6], "stop", 6)


def test_aborts_in_flight_end_the_request_and_leave_the_others_unchanged():
    params = [SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)]
    ref = finals(run(make_engine(async_scheduling=False), params, n=4))
    for on in (False, True):
        eng = make_engine(async_scheduling=on)
        seen_in_flight = {}
        step = eng.step

        def spy():         # at an abort: was the request's token of the step before still on the device?
            for rid in eng._abort_pending:
                seen_in_flight[rid] = eng._inflight is not None and any(
                    seq.request_id == rid for seq, _ in eng._inflight.rows)
            return step()
        eng.step = spy
        outs = run(eng, params, n=4, abort_at={4: "1", 9: "3"})
        res = finals(outs)
        assert seen_in_flight == {"1": on, "3": on}
        for rid in ("1", "3"):
            toks, reason = res[rid][:2]
            assert reason == "abort" and 0 < len(toks) < 40 and toks == ref[rid][0][:len(toks)]
        assert {r: res[r] for r in ("0", "2")} == {r: ref[r] for r in ("0", "2")}
        assert eng.stats().generation_tokens == sum(len(v[0]) for v in res.values())


def test_a_row_whose_logits_are_not_finite_fails_alone_in_both_modes():
    params = [SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)]
    ref = finals(run(make_engine(), params))
    for on in (False, True):
        res = finals(run(make_engine(PoisonRunner(5), async_scheduling=on), params))
        bad = res.pop("5")
        assert bad[1] == "error" and len(bad[0]) == 2, "its two finite tokens, then the NaN row failed it"
        assert res == {r: v for r, v in ref.items() if r != "5"}


# ---------------------------------------------------------------------- planted bugs
def test_planted_stale_host_id_is_caught(monkeypatch):
    """The mutation: decode rows fed the last id the host knows instead of the device's."""
    ref = finals(run(make_engine(async_scheduling=False)))
    build = LLMEngine._build_batch

    def stale(self, sched, prev=None):
        batch = build(self, sched, prev)
        for st, s in zip(batch.seqs, sched.scheduled):
            if st.prev_row is not None:
                st.prev_row, st.token_ids = None, [next(t for t in reversed(s.seq.token_ids) if t != UNRESOLVED_TOKEN)]
        return batch
    monkeypatch.setattr(LLMEngine, "_build_batch", stale)
    assert finals(run(make_engine(async_scheduling=True))) != ref


def test_planted_report_of_the_extra_token_is_caught(monkeypatch):
    """The mutation: a request that ended keeps its in-flight token (reported, counted)."""
    monkeypatch.setattr(LLMEngine, "_is_live", staticmethod(lambda seq: True))
    with pytest.raises(AssertionError, match="final outputs"):
        finals(run(make_engine(async_scheduling=True)))


def test_a_penalty_step_waits_for_the_ids_its_history_needs(monkeypatch):
    """The sampler never sees a placeholder in a repetition-penalty history; with the wait
    removed (the mutation) it does."""
    histories = []
    sample = llm_engine.sample_async

    def recording(logits, reqs, start_read=None):
        histories.extend(list(r.history) for r in reqs if r.repetition_penalty != 1.0)
        return sample(logits, reqs, start_read)
    monkeypatch.setattr(llm_engine, "sample_async", recording)
    params = [SamplingParams(temperature=0, max_tokens=10, repetition_penalty=1.5)]
    run(make_engine(async_scheduling=True), params, n=3)
    assert histories and all(UNRESOLVED_TOKEN not in h for h in histories)
    histories.clear()
    monkeypatch.setattr(LLMEngine, "_needs_host_ids", staticmethod(lambda sched: False))
    with pytest.raises((RuntimeError, IndexError)):      # the penalty gathers logits at index -1
        run(make_engine(async_scheduling=True), params, n=3)
    assert any(UNRESOLVED_TOKEN in h for h in histories)


# ---------------------------------------------------------------------- guards and the decision
def test_a_placeholder_never_reaches_a_prefill_or_an_unknown_decode_row():
    eng = make_engine()
    seq = eng.process_request("x", prompts(1)[0], SamplingParams(max_tokens=4))
    seq.token_ids.append(UNRESOLVED_TOKEN)
    with pytest.raises(RuntimeError, match="prefill chunk"):
        eng._build_batch(SchedulerOutput(True, [ScheduledSeq(seq, 0, seq.num_tokens)]))
    with pytest.raises(RuntimeError, match="not in the step in flight"):
        eng._build_batch(SchedulerOutput(False, [ScheduledSeq(seq, seq.num_tokens - 1, 1)]))


def test_the_flag_and_a_runner_without_device_ids_decide_it(caplog):
    with caplog.at_level("INFO", logger="fastdeploy_ext.engine.llm_engine"):
        make_engine()
    assert "async scheduling: on (default: step N+1" in caplog.text
    p = argparse.ArgumentParser()
    add_engine_args(p)
    assert p.parse_args([]).async_scheduling is None                 # unset: the device's row decides
    assert p.parse_args(["--async-scheduling"]).async_scheduling is True
    assert p.parse_args(["--no-async-scheduling"]).async_scheduling is False

    class HostIdsRunner(FakeRunner):
        takes_device_token_ids = False
    d = EngineConfig().async_decision(HostIdsRunner())
    assert d.value is False and "cannot take device-resident input ids" in d.reason
    assert "--no-async-scheduling" in EngineConfig(async_scheduling=False).async_decision(FakeRunner()).reason
    runner = HostIdsRunner()
    eng = make_engine(runner)
    res = finals(run(eng, [SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)], n=3))
    assert device_rows(runner) == 0 and all(len(v[0]) == 6 for v in res.values())
    assert all(t >= 0 for v in res.values() for t in v[0])


def test_serve_config_file_turns_it_off(tmp_path):
    """`async_scheduling: false` in serve's --config FILE.yaml is --no-async-scheduling (a false
    switch is otherwise dropped, which would leave this default-on flag on)."""
    from fastdeploy_ext.entrypoints.openai import api_server, cli_args
    f = tmp_path / "serve.yaml"
    p = api_server.build_parser()
    for text, want in (("async_scheduling: false\n", False), ("async_scheduling: true\n", True), ("{}\n", None)):
        f.write_text(text)
        assert p.parse_args(cli_args.expand_config_file(p, ["--config", str(f)])).async_scheduling is want


def test_the_capability_row_decides_when_the_user_does_not():
    """A row with ``async_scheduling: {default: false}`` (the GPU rows until their card has run
    the overlapped loop) turns it off unless --async-scheduling is given; the shipped rows say
    so, and a row without the key keeps it on."""
    from dataclasses import replace as dc_replace

    from fastdeploy_ext.capabilities import capability_table
    table = capability_table()
    assert not table["cuda_sm90"].async_scheduling_default and not table["metax_c500"].async_scheduling_default
    assert table["cpu"].async_scheduling_default

    class RowRunner(FakeRunner):
        row = dc_replace(table["cpu"], name="gpu_like", async_scheduling_default=False)
    off = EngineConfig().async_decision(RowRunner())
    assert off.value is False and "row gpu_like" in off.reason and "--async-scheduling turns it on" in off.reason
    assert EngineConfig(async_scheduling=True).async_decision(RowRunner()).value is True
    on = EngineConfig().async_decision(type("CpuRowRunner", (FakeRunner,), {"row": table["cpu"]})())
    assert on.value is True and "row cpu" in on.reason
