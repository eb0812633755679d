"""Mixed steps: the running requests' decode rows ride in the steps that prefill newcomers, so a
newcomer's vision pass does not stall their next token. Greedy token ids (and the other outputs)
equal the separate prefill/decode loop's with async scheduling on and off, with preemption and
aborts in flight; running requests advance in every step where a newcomer's vision runs (and, off,
they do not); the decision, the flag and the row default; a planted wrong row order is caught.
The tiny model (real TorchRunner, fp32 CPU) gives the same ids mixed or not."""
from __future__ import annotations

import argparse

import pytest

from fastdeploy_ext.engine.config import EngineConfig
from fastdeploy_ext.engine.sampling_params import SamplingParams
from fastdeploy_ext.engine.scheduler import Scheduler
from fastdeploy_ext.entrypoints.args import add_engine_args

from .engine_fakes import FakeRunner
from .test_async_scheduling import MIXED, POOLS, finals
from .test_engine_scheduler import make_engine, prompts


def run_arriving(eng, params=MIXED, n=8, every=3, abort_at: dict[int, str] | None = None,
                 arrivals: list[int] | None = None):
    """Request i queued before step i * every (or arrivals[i]: newcomers arrive while others
    decode), stepped to the end; aborts sent before the given step numbers. Returns ({request:
    [outputs]}, per step the output tokens each request had after it)."""
    at = arrivals or [i * every for i in range(n)]
    reqs = [(at[i], i, p) for i, p in enumerate(prompts(n))]
    outs: dict[str, list] = {}
    counts: list[dict[str, int]] = []
    have: dict[str, int] = {}
    step = 0
    while reqs or eng.has_unfinished():
        while reqs and reqs[0][0] <= step:
            _, i, p = reqs.pop(0)
            eng.add_request(str(i), p, params[i % len(params)], stream=True)
        if abort_at and step in abort_at:
            eng.abort_request(abort_at[step])
        for o in eng.step():
            outs.setdefault(o.request_id, []).append(o)
            have[o.request_id] = o.num_output_tokens
        counts.append(dict(have))
        step += 1
        assert step < 5000
    assert eng.block_manager.num_used == 0 and eng.scheduler.num_running == 0
    return outs, counts


def _mixed_prefills(runner):
    """The runner's prefill steps that ran a vision pass's rows and decode rows together."""
    return [st for st in runner.steps if st.is_prefill and any(s.image_embeds is not None for s in st.seqs)
            and any(s.rope_positions is None and len(s.token_ids) == 1 for s in st.seqs)]


@pytest.mark.parametrize("pool", POOLS)
@pytest.mark.parametrize("async_on", [False, True], ids=["sync", "async"])
def test_outputs_equal_with_mixed_steps_on_and_off(pool, async_on):
    got, stats = {}, {}
    for mixed in (False, True):
        runner = FakeRunner()
        eng = make_engine(runner, async_scheduling=async_on, mixed_steps=mixed, **POOLS[pool])
        assert eng.mixed_steps.value is mixed
        got[mixed] = finals(run_arriving(eng)[0])
        stats[mixed] = eng.stats()
        assert bool(_mixed_prefills(runner)) is mixed, "mixed on: vision and decode rows in one step"
    assert got[True] == got[False]
    assert stats[True].num_mixed_steps > 0 and stats[True].mixed_decode_rows >= stats[True].num_mixed_steps
    assert stats[False].num_mixed_steps == 0 and stats[True].mixed_steps and not stats[False].mixed_steps
    if pool != "roomy":
        assert stats[True].num_preemptions > 0
    assert stats[True].generation_tokens == stats[False].generation_tokens


@pytest.mark.parametrize("async_on", [False, True], ids=["sync", "async"])
def test_aborts_in_flight_of_a_mixed_step(async_on):
    params = [SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)]
    ref = finals(run_arriving(make_engine(mixed_steps=False, async_scheduling=False), params, n=5)[0])
    eng = make_engine(mixed_steps=True, async_scheduling=async_on)
    res = finals(run_arriving(eng, params, n=5, abort_at={4: "0", 11: "2"})[0])
    assert eng.stats().num_mixed_steps > 0
    for rid in ("0", "2"):
        toks, reason = res[rid][:2]
        assert reason == "abort" and 0 < len(toks) < 30 and toks == ref[rid][0][:len(toks)]
    assert {r: res[r] for r in ("1", "3", "4")} == {r: ref[r] for r in ("1", "3", "4")}


@pytest.mark.parametrize("async_on", [False, True], ids=["sync", "async"])
def test_running_requests_advance_in_every_step_a_newcomer_is_encoded(async_on):
    """Request 0 decodes while requests 1..5 arrive and are encoded: with mixed steps it gains
    exactly one token in every step from its first to its last (async: each read one step late,
    still one per step); without, the steps that prefill a newcomer give it none."""
    params = [SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)]
    gaps = {}
    for mixed in (False, True):
        runner = FakeRunner()
        eng = make_engine(runner, async_scheduling=async_on, mixed_steps=mixed)
        _, counts = run_arriving(eng, params, n=6, every=4)
        first = next(i for i, c in enumerate(counts) if c.get("0"))
        last = next(i for i, c in enumerate(counts) if c.get("0") == 40)
        per_step = [counts[i]["0"] - counts[i - 1]["0"] for i in range(first + 1, last + 1)]
        gaps[mixed] = per_step
        assert sum(per_step) == 39
        assert len(_mixed_prefills(runner)) == (5 if mixed else 0)
    assert set(gaps[True]) == {1}, "mixed: one token per step, the steps encoding newcomers included"
    assert gaps[False].count(0) == 5, "separate steps: each newcomer's prefill stalls request 0 once"


class EncodeStepRunner(FakeRunner):
    """Records the index of the step each vision pass belongs to (it runs just before it)."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self.encoded_in: list[int] = []

    def encode_images(self, batch):
        self.encoded_in.append(len(self.steps))
        return super().encode_images(batch)


def test_a_mixed_steps_encoder_budget_spreads_a_burst_of_newcomers():
    """Request 0 decodes when seven arrive at once: with a mixed budget of 20 patches (each image
    costs 16-48) every mixed step encodes one newcomer (the first admission may exceed the budget),
    without it (the default budget) one mixed step encodes all seven; outputs are equal."""
    params = [SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)]
    arrivals = [0] + [2] * 7
    images, got = {}, {}
    for budget in (None, 20):
        runner = FakeRunner()
        eng = make_engine(runner, mixed_steps=True, mixed_encoder_patches=budget)
        got[budget] = finals(run_arriving(eng, params, n=8, arrivals=arrivals)[0])
        images[budget] = [sum(s.image_embeds is not None for s in st.seqs) for st in _mixed_prefills(runner)]
        assert eng.scheduler.config.mixed_encoder_cost == (budget or 16384)
    assert images[None] == [7] and images[20] == [1] * 7
    assert got[20] == got[None]
    # chunked: an item costlier than the mixed budget still runs while others decode (full budget
    # when nothing fits), never waiting for the decodes to end
    ref = finals(run_arriving(make_engine(mixed_steps=False, enable_max_prefill=False, max_num_batched_tokens=9),
                              params, n=8, arrivals=arrivals)[0])
    runner = EncodeStepRunner()
    eng = make_engine(runner, mixed_steps=True, mixed_encoder_patches=1, enable_max_prefill=False,
                      max_num_batched_tokens=9)
    assert finals(run_arriving(eng, params, n=8, arrivals=arrivals)[0]) == ref
    decoding = [any(s.rope_positions is None for s in runner.steps[i].seqs) for i in runner.encoded_in]
    assert any(decoding), "images were encoded in steps that also decoded"
    d = EngineConfig(mixed_encoder_patches=100_000).mixed_encoder_budget()
    assert d.value == 65536 and "capped at --max-encoder-patches" in d.reason
    with pytest.raises(ValueError, match="--mixed-encoder-patches must be a positive integer"):
        EngineConfig(mixed_encoder_patches=0).validate()


def test_a_decode_row_after_a_prefill_chunk_is_refused(monkeypatch):
    """The sampler reads logits rows in scheduling order and the batch is built decode rows
    first: a scheduler that put them after the chunks (the planted bug) is an error, not
    tokens given to the wrong requests."""
    mixed = Scheduler._schedule_mixed

    def reversed_rows(self):
        out = mixed(self)
        if out is not None and out.num_decode_rows:
            out.scheduled.reverse()
        return out
    monkeypatch.setattr(Scheduler, "_schedule_mixed", reversed_rows)
    with pytest.raises(RuntimeError, match="decode rows must precede"):
        run_arriving(make_engine(mixed_steps=True, async_scheduling=False),
                     [SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)], n=3)


def test_the_decision_the_flag_and_the_row_default(caplog):
    with caplog.at_level("INFO", logger="fastdeploy_ext.engine.llm_engine"):
        make_engine()
    assert "mixed steps: on (default: running requests get their next token" in caplog.text
    p = argparse.ArgumentParser()
    add_engine_args(p)
    assert p.parse_args([]).mixed_steps is None
    assert p.parse_args(["--mixed-steps"]).mixed_steps is True
    assert p.parse_args(["--no-mixed-steps"]).mixed_steps is False
    assert p.parse_args(["--mixed-encoder-patches", "64"]).mixed_encoder_patches == 64
    assert "--no-mixed-steps" in EngineConfig(mixed_steps=False).mixed_decision(FakeRunner()).reason

    class SeparateStepsRunner(FakeRunner):
        takes_mixed_steps = False
    d = EngineConfig(mixed_steps=True).mixed_decision(SeparateStepsRunner())
    assert d.value is False and "cannot take decode rows in a prefill step" in d.reason
    runner = SeparateStepsRunner()
    eng = make_engine(runner)
    finals(run_arriving(eng, [SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)], n=4)[0])
    assert not _mixed_prefills(runner) and eng.stats().num_mixed_steps == 0

    from dataclasses import replace as dc_replace

    from fastdeploy_ext.capabilities import capability_table
    table = capability_table()
    assert not table["cuda_sm90"].mixed_steps_default and not table["metax_c500"].mixed_steps_default
    assert table["cpu"].mixed_steps_default

    class RowRunner(FakeRunner):
        row = dc_replace(table["cpu"], mixed_steps_default=False)
    d = EngineConfig().mixed_decision(RowRunner())
    assert d.value is False and "mixed_steps.default is false" in d.reason
    assert EngineConfig(mixed_steps=True).mixed_decision(RowRunner()).value is True


# ---------------------------------------------------------------------- the tiny model
@pytest.fixture(scope="module")
def tiny():
    from fastdeploy_ext.conformance.references import Manifest
    from fastdeploy_ext.plan import PlanRequest
    from fastdeploy_ext.runner import create_runner
    refs = Manifest.load()
    model_dir = str(refs.path("tiny_vl"))
    runner = create_runner(PlanRequest(device="cpu", dtype="float32"))
    runner.load_model(model_dir, with_text=True)
    return runner, model_dir, [str(p) for p in refs.files("images")]


def test_tiny_model_ids_equal_with_mixed_steps_on_and_off(tiny):
    """fp32 greedy on the real runner: newcomers arriving every 3 steps while others decode;
    their decode rows through the paged prefill path (and, async, fed on the device) give the
    ids of separate prefill and decode steps."""
    from fastdeploy_ext.engine.llm_engine import LLMEngine
    runner, model_dir, images = tiny
    greedy = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, detokenize=False)
    got = {}
    for mixed in (False, True):
        for async_on in (False, True):
            eng = LLMEngine(EngineConfig(model=model_dir, max_model_len=256, kv_cache_memory=16 << 20,
                                         preprocess_workers=1, mixed_steps=mixed, async_scheduling=async_on),
                            runner=runner)
            pending = [(i, {"prompt": "OCR:", "images": [img]}) for i, img in enumerate(images)]
            done, step = {}, 0
            while pending or eng.has_unfinished():
                while pending and pending[0][0] * 3 <= step:
                    i, p = pending.pop(0)
                    eng.add_request(str(i), p, greedy)
                for o in eng.step():
                    if o.finished:
                        done[o.request_id] = o.token_ids
                step += 1
            assert (eng.stats().num_mixed_steps > 0) is mixed
            got[mixed, async_on] = [done[str(i)] for i in range(len(images))]
            eng.shutdown()
    assert all(len(ids) == 10 for ids in got[False, False])
    assert got[True, False] == got[True, True] == got[False, True] == got[False, False]


# ---------------------------------------------------------------------- bench generate --itl
def test_inter_token_gaps_split_at_prefill_steps():
    from fastdeploy_ext.bench.generate import inter_token_gaps
    g = inter_token_gaps({"a": [1.0, 2.0, 4.0, 4.5], "b": [3.0, 3.25]}, prefill_ends=[3.0, 6.0])
    assert g["all"]["count"] == 4 and g["all"]["max_ms"] == 2000.0 and g["all"]["p50_ms"] == 1000.0
    # a's gap (2, 4] holds the prefill step that ended at 3; b's (3, 3.25] none (3 is its start)
    assert g["spanning_prefill"]["count"] == 1 and g["spanning_prefill"]["max_ms"] == 2000.0
    assert inter_token_gaps({"a": [1.0]}, [])["all"] == {"count": 0, "p50_ms": None, "p99_ms": None, "max_ms": None}


@pytest.mark.parametrize("mixed", [False, True], ids=["separate", "mixed"])
def test_bench_run_reports_the_gaps_of_every_request(mixed):
    """run_requests(itl=True) on the fake engine: every request streamed, one gap per token after
    its first (none lost or doubled when tokens arrive in the steps that prefill newcomers)."""
    from fastdeploy_ext.bench.generate import BenchRequest, line_pngs, run_requests
    eng = make_engine(mixed_steps=mixed)
    reqs = [BenchRequest(png, "OCR:", 12) for png in line_pngs(6)]
    res = run_requests(eng, reqs, itl=True)
    gaps = res["inter_token_gaps"]
    assert gaps["all"]["count"] == 6 * 11 and res["output_tokens"] == 72
    assert gaps["spanning_prefill"]["count"] <= gaps["all"]["count"]
    if not mixed:
        assert res["mixed_steps"] == 0
