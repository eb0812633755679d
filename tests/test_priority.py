"""Request priority (vLLM's rule: lower runs earlier, default 0, FIFO among equals) from the
scheduler's queues up through the engine, the offline LLM API, the async engine and the real
server (tiny model, loopback, the `openai` client): admission by (priority, arrival), a preempted
request resuming before newer requests of its priority, the lowest-priority newest request as the
preemption victim, and bad values refused naming the field."""
from __future__ import annotations

import asyncio
import threading
import time

import httpx
import openai
import pytest
import torch

from fastdeploy_ext import LLM
from fastdeploy_ext.engine.async_engine import AsyncLLMEngine
from fastdeploy_ext.engine.block_manager import BlockManager
from fastdeploy_ext.engine.config import EngineConfig
from fastdeploy_ext.engine.encoder_cache import EncoderCache
from fastdeploy_ext.engine.errors import InvalidRequest
from fastdeploy_ext.engine.input_processor import InputLimits, InputProcessor
from fastdeploy_ext.engine.sampling_params import SamplingParams
from fastdeploy_ext.engine.scheduler import Scheduler, SchedulerConfig, SchedulerError, check_priority
from fastdeploy_ext.engine.sequence import ProcessedPrompt, Sequence
from fastdeploy_ext.models.paddleocr_vl.processor import ImageProcessor

from .engine_fakes import FakePromptBuilder, FakeRunner
from .test_engine_scheduler import GREEDY, TINY_PP, make_engine, prompts, run_all

PRIORITIES = [0, 3, -1, 3, 0, -1, 2, 0]
BY_KEY = sorted(range(8), key=lambda i: (PRIORITIES[i], i))       # [2, 5, 0, 4, 7, 6, 1, 3]


# ---------------------------------------------------------------------- the scheduler's queues
def text_seq(i: int, priority: int = 0, n: int = 4) -> Sequence:
    pp = ProcessedPrompt(list(range(3, 3 + n)), torch.zeros(3, n, dtype=torch.int64), 0)
    return Sequence(i, f"r{i}", pp, SamplingParams(max_tokens=100), 100, priority=priority)


def ran(out) -> None:
    """What a step does to its rows: tokens in the cache, one new token per row that samples."""
    for s in out.scheduled:
        s.seq.num_computed_tokens = s.end
        if s.completes_prefill or not out.is_prefill:
            s.seq.token_ids.append(7)


def grow(seq: Sequence, n: int) -> None:
    """n more decoded tokens (without running steps): the next decode step needs their blocks."""
    seq.token_ids += [7] * n
    seq.num_computed_tokens = seq.num_tokens - 1


def test_victim_is_lowest_priority_then_newest_and_resume_keeps_the_key():
    bm = BlockManager(6, 4)
    sch = Scheduler(SchedulerConfig(), bm, EncoderCache(64))
    a, b, c = text_seq(0, 0), text_seq(1, 5), text_seq(2, 0)
    for s in (a, b, c):
        sch.add(s)
    out = sch.schedule()
    assert out.is_prefill and [s.seq for s in out.scheduled] == [a, c, b]     # key order, not arrival
    ran(out)
    assert sch.running == [a, c, b]
    for s in (a, b, c):
        grow(s, 4)                                   # 9 tokens each: 3 blocks, 9 needed, 6 in the pool
    out = sch.schedule()
    # a needs a third block: the victim is b (priority 5), not c (the newest, what "newest first"
    # without priorities would take); c then gets the block b freed
    assert not out.is_prefill and [s.seq for s in out.scheduled] == [a, c]
    assert b in sch.waiting and b.num_computed_tokens == 0 and sch.num_preemptions == 1
    d, e = text_seq(3, 5), text_seq(4, 0)
    sch.add(d)
    sch.add(e)
    assert list(sch.waiting) == [e, b, d]            # b (preempted) before d: same priority, older
    sch.finish(a)                                    # 3 blocks free: e (1 block) fits, then b (3) does not
    out = sch.schedule()
    assert [s.seq for s in out.scheduled] == [e], "d fits but must not jump over b"
    ran(out)
    sch.finish(c)
    out = sch.schedule()
    assert [s.seq for s in out.scheduled] == [b, d]
    assert sch.running == [e, b, d]


def test_a_request_queued_twice_is_an_engine_bug():
    sch = Scheduler(SchedulerConfig(), BlockManager(4, 4), EncoderCache(64))
    s = text_seq(0)
    sch.add(s)
    with pytest.raises(SchedulerError, match="already added"):
        sch.add(s)
    with pytest.raises(SchedulerError, match="already waiting"):
        sch.waiting.push(s, (0, 99))                 # the heap's own check, below the scheduler's
    sch.finish(s)
    assert len(sch.waiting) == 0 and s not in sch.waiting


@pytest.mark.parametrize("bad", [True, 1.0, "1", None, 2**63, -2**63 - 1])
def test_check_priority_refuses_non_int64(bad):
    with pytest.raises(InvalidRequest, match="priority"):
        check_priority(bad)


def test_check_priority_takes_the_int64_range():
    assert check_priority(-2**63) == -2**63 and check_priority(2**63 - 1) == 2**63 - 1


# ---------------------------------------------------------------------- the engine
def admission_order(runner: FakeRunner) -> list[int]:
    """seq ids in the order their first prefill step ran."""
    seen: list[int] = []
    for st in runner.steps:
        if st.is_prefill:
            seen += [s.seq_id for s in st.seqs if s.seq_id not in seen]
    return seen


def test_engine_admits_lower_first_fifo_among_equals_same_tokens():
    runner = FakeRunner()
    eng = make_engine(runner, max_num_seqs=1)
    reqs = prompts()
    for i, p in enumerate(reqs):                     # seq ids follow these calls: seq i is request i
        eng.add_request(str(i), p, GREEDY, priority=PRIORITIES[i])
    done = {}
    while eng.has_unfinished():
        done.update({o.request_id: o for o in eng.step() if o.finished})
    assert admission_order(runner) == BY_KEY
    assert [done[str(i)].token_ids for i in range(8)] == [o.token_ids for o in run_all(make_engine(), reqs)]


@pytest.mark.parametrize("max_prefill", [True, False])
def test_preemption_with_mixed_priorities_keeps_tokens_and_frees_the_pool(max_prefill):
    # the tiny pool of test_tiny_pool_preempts_and_keeps_tokens: victims are now chosen by key,
    # so they can be older than the sequence that needs the blocks
    runner = FakeRunner()
    eng = make_engine(runner, num_kv_blocks=26, max_model_len=96, enable_max_prefill=max_prefill,
                      max_num_batched_tokens=64)
    reqs = prompts()
    for i, p in enumerate(reqs):
        eng.add_request(str(i), p, GREEDY, priority=PRIORITIES[::-1][i])
    done = {}
    while eng.has_unfinished():
        done.update({o.request_id: o for o in eng.step() if o.finished})
    assert eng.scheduler.num_preemptions > 0
    assert [done[str(i)].token_ids for i in range(8)] == [run_all(make_engine(), [p])[0].token_ids for p in reqs]
    assert eng.block_manager.num_used == 0 and len(eng.scheduler.waiting) == 0


def test_engine_refuses_a_bad_priority_before_queueing():
    eng = make_engine()
    with pytest.raises(InvalidRequest, match="priority must be an integer"):
        eng.add_request("x", prompts(1)[0], GREEDY, priority=1.5)
    fut = eng.submit("y", prompts(1)[0], GREEDY, priority=2**64)
    with pytest.raises(InvalidRequest, match="64-bit"):
        fut.result()
    assert not eng.has_unfinished()


# ---------------------------------------------------------------------- the offline LLM API
class GatedRunner(FakeRunner):
    """Its first step waits until the engine has every request queued (none preprocessing), so
    every request after the first admitted one is chosen by the scheduler among all of them."""
    engine = None

    def execute(self, step):
        while len(self.steps) == 0 and self.engine.stats().num_preprocessing:
            time.sleep(0.002)
        return super().execute(step)


def test_llm_generate_and_chat_take_priorities():
    runner = GatedRunner()
    proc = InputProcessor(FakePromptBuilder(), ImageProcessor(TINY_PP), InputLimits(1, 65536, 256))
    llm = LLM(runner=runner, input_processor=proc, max_model_len=256, num_kv_blocks=512, max_num_seqs=1,
              preprocess_workers=1)                  # one worker: arrival = input order
    runner.engine = llm.engine
    convs = [p["messages"] for p in prompts()]
    outs = llm.chat(convs, GREEDY, use_tqdm=False, priority=PRIORITIES)
    first = admission_order(runner)[0]               # admitted before the rest arrived: any of them
    order = sorted(range(8), key=lambda i: outs[i].metrics.first_scheduled)
    assert order[0] == first and order[1:] == [i for i in BY_KEY if i != first]
    assert [o.outputs[0].token_ids for o in outs] == [o.token_ids for o in run_all(make_engine(), prompts())]
    one = llm.generate([{"prompt": "x"}, {"prompt": "y"}], GREEDY, use_tqdm=False, priority=-3)
    assert [o.outputs[0].finish_reason for o in one] == ["length", "length"]
    with pytest.raises(ValueError, match="2 priorities for 8 prompts"):
        llm.chat(convs, GREEDY, use_tqdm=False, priority=[0, 1])
    with pytest.raises(InvalidRequest, match="prompt 1: priority must be an integer"):
        llm.generate([{"prompt": "x"}, {"prompt": "y"}], GREEDY, use_tqdm=False, priority=[0, "high"])
    assert llm.engine.block_manager.num_used == 0 and not llm.engine.has_unfinished()


# ---------------------------------------------------------------------- the async engine
class SlowRunner(FakeRunner):
    """2 ms per step: the long request the test aborts is still running when the others queue."""

    def execute(self, step):
        time.sleep(0.002)
        return super().execute(step)


def test_async_engine_admits_by_priority():
    long = SamplingParams(temperature=0, max_tokens=3000, ignore_eos=True)

    async def main():
        # one preprocessing worker: arrival (the FIFO order among equal priorities) = creation order
        cfg = EngineConfig(max_model_len=4096, num_kv_blocks=1100, preprocess_workers=1, max_num_seqs=1)
        proc = InputProcessor(FakePromptBuilder(), ImageProcessor(TINY_PP), InputLimits(1, cfg.max_encoder_patches, 4096))
        eng = AsyncLLMEngine(cfg, runner=SlowRunner(), input_processor=proc)
        await eng.start()
        blocker = eng.generate("blocker", prompts(1)[0], long)
        first = await blocker.__anext__()             # running: every other request now waits
        assert first.finish_reason is None
        reqs = prompts(6)
        prios = [2, 0, -1, 2, 0, -1]
        tasks = [asyncio.create_task(_last(eng, str(i), p, prios[i])) for i, p in enumerate(reqs)]
        while eng.stats().num_waiting < 6:
            await asyncio.sleep(0.01)
        await blocker.aclose()                        # aborts it: the six are admitted one by one
        outs = await asyncio.gather(*tasks)
        with pytest.raises(InvalidRequest, match="priority must be an integer"):
            await _last(eng, "bad", reqs[0], True)
        assert eng.healthy and eng.stats().kv_blocks_used == 0
        await eng.shutdown()
        return outs, prios
    outs, prios = asyncio.run(main())
    order = sorted(range(6), key=lambda i: outs[i].metrics.first_scheduled)
    assert order == sorted(range(6), key=lambda i: (prios[i], i)) == [2, 5, 1, 4, 0, 3]


async def _last(eng, rid, prompt, priority):
    out = None
    async for out in eng.generate(rid, prompt, GREEDY, priority=priority):
        pass
    return out


# ---------------------------------------------------------------------- the real server
@pytest.fixture(scope="module")
def srv():
    from .server_harness import ServerProc
    s = ServerProc("--max-model-len", "2048", "--max-num-seqs", "1")
    try:
        yield s.wait_healthy()
    finally:
        assert s.stop() == 0, s.output


def test_server_admits_by_the_priority_field(srv):
    from .server_harness import tiny_vl
    client = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=300)
    model = str(tiny_vl())
    msgs = [{"role": "user", "content": "OCR:"}]
    blocker = client.chat.completions.create(model=model, messages=msgs, max_tokens=2000, stream=True,
                                             temperature=0, extra_body={"ignore_eos": True})
    next(iter(blocker))                               # it runs: the next requests wait
    finished: list[str] = []

    def one(name, priority):
        r = client.chat.completions.create(model=model, messages=msgs, max_tokens=16, temperature=0,
                                           extra_body={"ignore_eos": True, "priority": priority})
        assert r.choices[0].finish_reason == "length"
        finished.append(name)
    threads = []
    for name, prio in (("late-low", 7), ("mid", 0), ("high", -7)):
        t = threading.Thread(target=one, args=(name, prio))
        t.start()
        threads.append(t)
        assert srv.wait_metric("fastdeploy:num_requests_waiting", len(threads)) == len(threads), srv.output
    blocker.close()                                   # aborted: the three run one at a time
    for t in threads:
        t.join(300)
    assert finished == ["high", "mid", "late-low"]


@pytest.mark.parametrize("value,why", [("1", "valid integer"), (1.5, "valid integer"), (True, "valid integer"),
                                       (2**63, "64-bit range")])
def test_server_refuses_a_bad_priority_naming_it(srv, value, why):
    r = httpx.post(srv.url + "/v1/chat/completions", timeout=60,
                   json={"messages": [{"role": "user", "content": "x"}], "max_tokens": 2, "priority": value})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "priority" and why in err["message"], err
    assert httpx.get(srv.url + "/health", timeout=10).status_code == 200
