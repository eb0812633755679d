"""What the engine streams, on the scripted fake runner (a known text per request): outputs are
deltas (sizes do not grow with the sequence; a stalled consumer's backlog stays bounded), stop
strings never leak into streams (held back while they may complete; the earliest one wins),
logprobs are streamed once each, preempted requests resume before newer ones, and an abort
that arrives while a request is still preprocessing is not lost."""
from __future__ import annotations

import asyncio
import threading

from fastdeploy_ext.engine.async_engine import AsyncLLMEngine
from fastdeploy_ext.engine.config import EngineConfig
from fastdeploy_ext.engine.input_processor import InputLimits, InputProcessor
from fastdeploy_ext.engine.llm_engine import LLMEngine
from fastdeploy_ext.engine.sampling_params import RepetitionGuard, SamplingParams
from fastdeploy_ext.models.paddleocr_vl.processor import ImageProcessor

from .engine_fakes import FakePromptBuilder, FakeRunner, PieceTokenizer, ScriptedRunner
from .test_engine_scheduler import TINY_PP, make_engine, prompts

LETTER = {10 + i: chr(ord("a") + i) for i in range(26)}       # one character per token
PIECES = {**LETTER, 40: "ov", 41: "cjkoj", 42: "que"}       # several characters per token
NO_GUARD = RepetitionGuard(enabled=False)


def ids(text: str) -> list[int]:
    return [10 + ord(c) - ord("a") for c in text]


def make(script: list[int], asynchronous=False, runner=None, **kw):
    builder = FakePromptBuilder()
    builder.tokenizer = PieceTokenizer(PIECES)
    cfg = EngineConfig(max_model_len=256, preprocess_workers=2, **{"num_kv_blocks": 512, **kw})
    proc = InputProcessor(builder, ImageProcessor(TINY_PP), InputLimits(1, cfg.max_encoder_patches, 256))
    runner = runner or ScriptedRunner(script)
    return (AsyncLLMEngine if asynchronous else LLMEngine)(cfg, runner=runner, input_processor=proc)


def stream(script, params, prompt=None):
    """One request through the async engine; its outputs as the consumer saw them."""
    async def main():
        eng = make(script, asynchronous=True)
        await eng.start()
        outs = [o async for o in eng.generate("r", prompt or {"prompt": "x"}, params)]
        assert eng.stats().kv_blocks_used == 0
        await eng.shutdown()
        return outs
    return asyncio.run(main())


def params(**kw):
    return SamplingParams(**{"temperature": 0, "max_tokens": 10, "ignore_eos": True, "repetition_guard": NO_GUARD,
                             **kw})


# --------------------------------------------------------------------------- stop strings
def stepped(script, params):
    """One streamed request through the synchronous engine: exactly one output per step."""
    eng = make(script)
    eng.add_request("r", {"prompt": "x"}, params, stream=True)
    outs = []
    while eng.has_unfinished():
        outs += eng.step()
    assert eng.block_manager.num_used == 0
    return outs


def test_a_stop_string_never_leaks_into_the_stream():
    outs = stream(ids("ovcjkojque"), params(stop=["jk"]))
    final = outs[-1]
    assert final.finish_reason == "stop" and final.stop_reason == "jk" and final.text == "ovc"
    assert "".join(o.delta_text for o in outs) == "ovc"
    # step by step: one character (len("jk") - 1) held back while the stop string might complete
    assert [o.delta_text for o in stepped(ids("ovcjkojque"), params(stop=["jk"]))] == ["", "o", "v", "c", ""]


def test_streams_join_to_the_final_text_with_and_without_the_stop_string():
    for kw, text in [({"stop": ["jk"], "include_stop_str_in_output": True}, "ovcjk"),
                     ({"stop": ["zz", "ojq"]}, "ovcjk"), ({"stop": ["nothere"]}, "ovcjkojque")]:
        outs = stream(ids("ovcjkojque"), params(**kw))
        assert outs[-1].text == text and "".join(o.delta_text for o in outs) == text, kw


def test_the_earliest_stop_string_in_the_text_wins_whatever_the_list_order():
    # "ov" | "cjkoj" | "que": after the second token both "jk" (at 3) and "oj" (at 5) are in the text
    for stop in (["oj", "jk"], ["jk", "oj"]):
        outs = stream([40, 41, 42], params(stop=stop))
        assert outs[-1].text == "ovc" and outs[-1].stop_reason == "jk", stop
        assert "".join(o.delta_text for o in outs) == "ovc"
    outs = stream([40, 41, 42], params(stop=["oj", "jk"], include_stop_str_in_output=True))
    assert outs[-1].text == "ovcjk" and "".join(o.delta_text for o in outs) == "ovcjk"


# --------------------------------------------------------------------------- deltas
def test_outputs_are_deltas_whose_size_does_not_grow_with_the_sequence():
    outs = stepped(ids("abcdefghij") * 30, params(max_tokens=200, logprobs=2))
    running, final = outs[:-1], outs[-1]
    assert len(running) == 199 and final.finished
    for k, o in enumerate(running):
        # one token, one character, one logprob record each, the running count, nothing cumulative
        assert (len(o.delta_token_ids), len(o.delta_text), len(o.delta_logprobs)) == (1, 1, 1)
        assert o.num_output_tokens == k + 1 and o.token_ids is None and o.text is None and o.logprobs is None
    assert final.token_ids == (ids("abcdefghij") * 30)[:200] and len(final.logprobs) == 200
    assert sum((o.delta_token_ids for o in outs), []) == final.token_ids
    assert "".join(o.delta_text for o in outs) == final.text


def test_a_stream_sends_each_logprob_once():
    outs = stream(ids("ovcjkojque"), params(logprobs=2))
    final = outs[-1]
    for o in outs:
        assert len(o.delta_logprobs) == len(o.delta_token_ids)
        assert [r["token_id"] for r in o.delta_logprobs] == o.delta_token_ids
    assert sum((o.delta_logprobs for o in outs), []) == final.logprobs
    assert [r["token_id"] for r in final.logprobs] == ids("ovcjkojque")


def test_a_stalled_consumer_has_one_coalesced_output_queued():
    """A consumer that stops reading: later outputs fold into the unread one (deltas appended),
    so its backlog stays at one output; reading again returns everything it missed."""
    async def main():
        eng = make(ids("abcdefghij"), asynchronous=True)
        await eng.start()
        agen = eng.generate("r", {"prompt": "x"}, params(max_tokens=120, logprobs=1))
        first = await agen.__anext__()
        backlog = []
        for _ in range(2000):                     # the engine runs on while nobody reads
            backlog.append(eng.backlog("r"))
            if eng.stats().num_finished == 1 and backlog[-1] >= 1:
                break
            await asyncio.sleep(0.005)
        await asyncio.sleep(0.05)                 # every delivery has landed
        backlog.append(eng.backlog("r"))
        rest = [o async for o in agen]
        await eng.shutdown()
        return first, backlog, rest
    first, backlog, rest = asyncio.run(main())
    assert max(backlog) == 1 and len(rest) <= 2 and rest[-1].finish_reason == "length"
    outs = [first, *rest]
    assert sum((o.delta_token_ids for o in outs), []) == rest[-1].token_ids == (ids("abcdefghij") * 12)
    assert "".join(o.delta_text for o in outs) == rest[-1].text == "abcdefghij" * 12
    assert sum((o.delta_logprobs for o in outs), []) == rest[-1].logprobs
    assert len(rest[0].delta_token_ids) >= 100       # what it missed, in one output


# --------------------------------------------------------------------------- scheduling
def test_a_preempted_request_resumes_before_newer_waiting_requests():
    """64 blocks of 4 tokens, two running at most: B (the newest running) is preempted when A and
    B outgrow the pool; it must be re-admitted before C, which arrived after it."""
    runner = FakeRunner()
    eng = make_engine(runner=runner, num_kv_blocks=64, max_num_seqs=2)
    long = SamplingParams(temperature=0, max_tokens=150, ignore_eos=True, repetition_guard=NO_GUARD)
    for rid in "ABC":
        eng.add_request(rid, {"prompt": "x"}, long)
    done = {}
    while eng.has_unfinished():
        done.update({o.request_id: o for o in eng.step() if o.finished})
    assert eng.scheduler.num_preemptions >= 1 and done["B"].metrics.num_preemptions >= 1
    # seq ids follow arrival: A=0, B=1, C=2; the first prefill after B's preemption is B's again
    prefills = [[s.seq_id for s in st.seqs] for st in runner.steps if st.is_prefill]
    assert prefills[0] == [0, 1]
    assert prefills[1][0] == 1, prefills
    assert all(o.finish_reason == "length" for o in done.values()) and eng.block_manager.num_used == 0


def test_an_abort_while_preprocessing_ends_the_request_with_abort():
    eng = make_engine()
    gate, entered = threading.Event(), threading.Event()
    process = eng.input_processor.process

    def slow(prompt):
        entered.set()
        assert gate.wait(30)
        return process(prompt)
    eng.input_processor.process = slow
    fut = eng.submit("slow", prompts(1)[0], params(max_tokens=50))
    assert entered.wait(30)
    eng.abort_request("slow")
    for _ in range(3):
        assert eng.step() == []                       # still in the pool: nothing to run yet
    gate.set()
    fut.result(30)
    outs = []
    while eng.has_unfinished():
        outs += eng.step()
    assert [(o.request_id, o.finish_reason) for o in outs] == [("slow", "abort")]
    assert eng.block_manager.num_used == 0 and eng.stats().num_aborted == 1


def test_an_async_abort_while_preprocessing_ends_the_stream_with_abort():
    async def main():
        eng = make(ids("abc"), asynchronous=True)
        await eng.start()
        # another request keeps the step loop busy meanwhile (an idle loop takes no steps)
        busy = eng.generate("busy", {"prompt": "x"}, params(max_tokens=200))
        await busy.__anext__()
        gate, entered = threading.Event(), threading.Event()
        process = eng.engine.input_processor.process
        eng.engine.input_processor.process = lambda p: (entered.set(), gate.wait(30), process(p))[2]
        task = asyncio.ensure_future(_collect(eng, "r", params(max_tokens=50)))
        while not entered.is_set():                   # it is in the worker pool now
            await asyncio.sleep(0.005)
        await eng.abort("r")
        steps = eng.engine.num_steps
        while eng.engine.num_steps < steps + 3:       # the loop has stepped past the abort
            await asyncio.sleep(0.005)
        gate.set()
        outs = await task
        await busy.aclose()
        st = eng.stats()
        await eng.shutdown()
        return outs, st
    outs, st = asyncio.run(main())
    assert outs[-1].finish_reason == "abort" and len(outs[-1].token_ids) == 0 and st.num_aborted == 1


async def _collect(eng, rid, p):
    return [o async for o in eng.generate(rid, {"prompt": "x"}, p)]
