"""Faults in the step loop, on the fake runner: a host-side failure of one request fails that
request alone (its blocks freed, the other 7 of a batch of 8 complete with the right tokens);
a fault of the shared step kills the loop (healthy False at once); a step that runs past
--step-timeout marks the engine stuck (the first, warm-up step not counted)."""
from __future__ import annotations

import asyncio
import threading

import pytest
import torch

from fastdeploy_ext.engine.async_engine import AsyncLLMEngine
from fastdeploy_ext.engine.config import EngineConfig
from fastdeploy_ext.engine.errors import EngineDead, RequestFailed
from fastdeploy_ext.engine.input_processor import InputLimits, InputProcessor
from fastdeploy_ext.engine.sampling_params import SamplingParams
from fastdeploy_ext.models.paddleocr_vl.processor import ImageProcessor

from .engine_fakes import FakePromptBuilder, FakeRunner
from .test_engine_scheduler import TINY_PP, make_engine, prompts, run_all
from .test_llm_api import make_llm

P = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
BAD = "5"                       # the request that fails; seq ids follow arrival, so its seq_id is 5


class PoisonRunner(FakeRunner):
    """Logits of one sequence turn NaN from its third token on (a model fault on one row)."""

    def __init__(self, seq_id: int):
        super().__init__()
        self.seq_id, self.calls = seq_id, 0

    def execute(self, step):
        rows = super().execute(step)
        for row, s in zip(rows, [s for s in step.seqs if s.need_logits]):
            if s.seq_id == self.seq_id:
                self.calls += 1
                if self.calls >= 3:
                    row[7] = float("nan")
        return rows


def _raise_for(target, rid_of, after: int = 2):
    """Wrap target(seq, ...) to raise for request BAD (offline-BAD in the LLM API) once it has
    `after` output tokens."""
    def wrapped(*args, **kw):
        seq = rid_of(*args)
        if seq.request_id in (BAD, f"offline-{BAD}") and seq.num_output_tokens >= after:
            raise RuntimeError("injected host failure")
        return target(*args, **kw)
    return wrapped


INJECTIONS = {
    # the request's own host work, one place at a time
    "detokenize": lambda eng: setattr(eng.output_processor, "_detokenize",
                                      _raise_for(eng.output_processor._detokenize, lambda seq: seq)),
    "stop_check": lambda eng: setattr(eng.output_processor, "_check_stop",
                                      _raise_for(eng.output_processor._check_stop, lambda seq, *a: seq)),
    "make_output": lambda eng: setattr(eng.output_processor, "make_output",
                                       _raise_for(eng.output_processor.make_output, lambda seq, *a: seq)),
    "sample_request": lambda eng: setattr(eng, "_sample_request",
                                          _raise_for(eng._sample_request, lambda seq: seq)),
}


@pytest.mark.parametrize("where", [*INJECTIONS, "nan_logits"])
def test_a_host_failure_of_one_request_fails_it_alone(where):
    ref = [o.token_ids for o in run_all(make_engine(), prompts(8), P)]
    eng = make_engine(runner=PoisonRunner(int(BAD)) if where == "nan_logits" else None)
    if where in INJECTIONS:
        INJECTIONS[where](eng)
    for i, p in enumerate(prompts(8)):
        eng.add_request(str(i), p, P, stream=True)       # streamed: every step detokenizes and outputs
    done, steps = {}, 0
    while eng.has_unfinished():
        done.update({o.request_id: o for o in eng.step() if o.finished})
        steps += 1
        assert steps < 1000
    bad = done.pop(BAD)
    assert bad.finish_reason == "error" and bad.error
    assert ("injected host failure" in bad.error) if where in INJECTIONS else ("not finite" in bad.error)
    assert {rid: o.token_ids for rid, o in done.items()} == {str(i): ref[i] for i in range(8) if str(i) != BAD}
    assert all(o.finish_reason == "length" for o in done.values())
    st = eng.stats()
    assert st.kv_blocks_used == 0 and st.num_running == 0 and st.num_failed == 1 and st.num_finished == 7
    # the engine serves on
    eng.add_request("after", prompts(1)[0], P)
    while eng.has_unfinished():
        done.update({o.request_id: o for o in eng.step()})
    assert done["after"].token_ids == ref[0]


def make_async(runner=None, **kw):
    cfg = EngineConfig(max_model_len=256, num_kv_blocks=512, preprocess_workers=2, **kw)
    proc = InputProcessor(FakePromptBuilder(), ImageProcessor(TINY_PP), InputLimits(1, cfg.max_encoder_patches, 256))
    return AsyncLLMEngine(cfg, runner=runner or FakeRunner(), input_processor=proc)


async def _final(eng, rid, prompt):
    out = None
    async for out in eng.generate(rid, prompt, P):
        pass
    return out


def test_async_consumers_of_a_batch_of_8_see_7_complete_and_one_request_failed():
    ref = [o.token_ids for o in run_all(make_engine(), prompts(8), P)]

    async def main():
        eng = make_async()
        await eng.start()
        INJECTIONS["detokenize"](eng.engine)
        res = await asyncio.gather(*[_final(eng, str(i), p) for i, p in enumerate(prompts(8))],
                                   return_exceptions=True)
        healthy, st = eng.healthy, eng.stats()
        await eng.shutdown()
        return res, healthy, st
    res, healthy, st = asyncio.run(main())
    failed = res[int(BAD)]
    assert isinstance(failed, RequestFailed) and failed.request_id == BAD
    assert "injected host failure" in str(failed)
    assert [r.token_ids for i, r in enumerate(res) if i != int(BAD)] == [t for i, t in enumerate(ref) if i != int(BAD)]
    assert healthy and st.kv_blocks_used == 0 and st.num_failed == 1


def test_the_offline_llm_keeps_the_other_results_and_marks_the_failed_one():
    llm = make_llm()
    ref = [o.token_ids for o in run_all(make_engine(), prompts(8), P)]
    INJECTIONS["stop_check"](llm.engine)
    outs = llm.chat([p["messages"] for p in prompts(8)], P, use_tqdm=False)
    assert [o.outputs[0].finish_reason for o in outs] == ["length"] * 5 + ["error"] + ["length"] * 2
    assert "injected host failure" in outs[int(BAD)].error
    assert [o.outputs[0].token_ids for i, o in enumerate(outs) if i != int(BAD)] == \
        [t for i, t in enumerate(ref) if i != int(BAD)]
    assert llm.engine.block_manager.num_used == 0


class ExplodingSampler(FakeRunner):
    """A shared-step fault: the whole batch's logits are the wrong shape (the sampler refuses)."""

    def execute(self, step):
        rows = super().execute(step)
        return torch.cat([rows, rows]) if len(self.steps) >= 2 else rows


def test_a_shared_step_fault_kills_the_loop_and_health_is_false_at_once():
    async def main():
        eng = make_async(runner=ExplodingSampler())
        await eng.start()
        with pytest.raises(EngineDead, match="logits rows"):
            await asyncio.gather(*[_final(eng, str(i), p) for i, p in enumerate(prompts(3))])
        seen = (eng.healthy, eng.status, eng.reason)
        await eng.shutdown(drain=False)
        return seen
    healthy, status, reason = asyncio.run(main())
    assert not healthy and status == "dead" and "logits rows" in reason


class GatedRunner(FakeRunner):
    """execute blocks on `gate` at the chosen call (1-based), announcing it on `entered`."""

    def __init__(self, block_at: int):
        super().__init__()
        self.block_at, self.calls = block_at, 0
        self.gate, self.entered = threading.Event(), threading.Event()

    def execute(self, step):
        self.calls += 1
        if self.calls == self.block_at:
            self.entered.set()
            assert self.gate.wait(30)
        return super().execute(step)


@pytest.mark.parametrize("block_at,stuck", [(3, True), (1, False)])
def test_a_step_past_the_step_timeout_marks_the_engine_stuck(block_at, stuck):
    """--step-timeout 0.1: a step blocked past it (after the first) turns status to "stuck" and
    healthy False; the first step (compilation, warm-up) may take as long as it needs."""
    async def main():
        runner = GatedRunner(block_at)
        eng = make_async(runner=runner, step_timeout=0.1)
        await eng.start()
        task = asyncio.ensure_future(_final(eng, "r", prompts(1)[0]))
        while not runner.entered.is_set():
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.3)                      # blocked 3x the timeout
        seen = []
        for _ in range(500):
            seen.append((eng.status, eng.healthy))
            if seen[-1][0] == "stuck" or not stuck:
                break
            await asyncio.sleep(0.01)
        reason = eng.reason
        runner.gate.set()
        out = await task
        await eng.shutdown()
        return seen[-1], reason, out
    (status, healthy), reason, out = asyncio.run(main())
    if stuck:
        assert status == "stuck" and not healthy and "--step-timeout 0.1" in reason
    else:
        assert status == "ready" and healthy and reason is None
    assert out.finish_reason == "length"


def test_step_timeout_must_be_positive():
    for bad in (0, -1, float("nan"), float("inf"), "5"):
        with pytest.raises(ValueError, match="--step-timeout"):
            EngineConfig(step_timeout=bad).validate()


def test_step_timeout_flag_reaches_the_engine_config_of_generate_and_serve():
    from fastdeploy_ext.entrypoints import args as A
    from fastdeploy_ext.entrypoints.cli import build_parser
    from fastdeploy_ext.entrypoints.openai.api_server import build_parser as serve_parser
    from fastdeploy_ext.plan import PlanRequest
    from fastdeploy_ext.runner import ModelSource
    src = ModelSource(None, "dummy", "auto")
    gen = build_parser().parse_args(["generate", "--image", "x.png", "--prompt", "OCR:", "--step-timeout", "12.5"])
    assert A.engine_config_from_args(gen, src, PlanRequest()).step_timeout == 12.5
    srv = serve_parser().parse_args(["--load-format", "dummy"])
    assert A.engine_config_from_args(srv, src, PlanRequest()).step_timeout == 300.0     # the default
    bad = build_parser().parse_args(["generate", "--image", "x.png", "--prompt", "OCR:", "--step-timeout", "0"])
    with pytest.raises(A.CliError, match="--step-timeout"):
        A.engine_config_from_args(bad, src, PlanRequest())


@pytest.mark.parametrize("status,reason,failed", [
    ("stuck", "engine stuck: a step has run for more than --step-timeout 0.1 s", "engine stuck"),
    ("dead", "step loop died: RuntimeError: device lost", "engine loop died: step loop died")])
def test_the_server_watchdog_exits_1_for_a_stuck_or_dead_engine(status, reason, failed):
    from types import SimpleNamespace

    from fastdeploy_ext.entrypoints.openai.api_server import _watchdog
    engine = SimpleNamespace(healthy=True, status="ready", reason=None, error=None)
    exits = []
    state = SimpleNamespace(engine=engine, engine_failed=None, request_exit=exits.append)

    async def main():
        task = asyncio.ensure_future(_watchdog(state, period=0.01))
        await asyncio.sleep(0.05)
        assert not task.done() and state.engine_failed is None        # healthy: it keeps watching
        engine.healthy, engine.status, engine.reason = False, status, reason
        engine.error = reason if status == "dead" else None
        await asyncio.wait_for(task, 10)
    asyncio.run(main())
    assert exits == [1] and state.engine_failed.startswith(failed)
