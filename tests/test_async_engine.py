"""The async engine API the server uses (COORD contract), on the fake runner."""
from __future__ import annotations

import asyncio

import pytest

from fastdeploy_ext.engine.async_engine import AsyncLLMEngine
from fastdeploy_ext.engine.config import EngineConfig
from fastdeploy_ext.engine.errors import EngineDead, InvalidRequest
from fastdeploy_ext.engine.input_processor import InputLimits, InputProcessor
from fastdeploy_ext.engine.sampling_params import SamplingParams
from fastdeploy_ext.plan import PlanRequest
from fastdeploy_ext.models.paddleocr_vl.processor import ImageProcessor

from .engine_fakes import FakePromptBuilder, FakeRunner
from .test_engine_scheduler import TINY_PP, prompts


def make_async(runner=None, **kw):
    cfg = EngineConfig(max_model_len=256, num_kv_blocks=512, preprocess_workers=2, **kw)
    proc = InputProcessor(FakePromptBuilder(), ImageProcessor(TINY_PP), InputLimits(1, cfg.max_encoder_patches, 256))
    return AsyncLLMEngine(cfg, runner=runner or FakeRunner(), input_processor=proc)


P = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)


async def collect(eng, rid, prompt, params=P):
    outs = [o async for o in eng.generate(rid, prompt, params)]
    return outs


def test_generate_streams_concurrently_and_matches_sync():
    async def main():
        eng = make_async()
        await eng.start()
        assert eng.ready and eng.healthy
        results = await asyncio.gather(*[collect(eng, str(i), p) for i, p in enumerate(prompts(4))])
        for outs in results:
            assert outs[-1].finish_reason == "length" and all(o.finish_reason is None for o in outs[:-1])
            assert sum((o.delta_token_ids for o in outs), []) == outs[-1].token_ids
            assert "".join(o.delta_text for o in outs) == outs[-1].text
        st = eng.stats()
        assert st.kv_blocks_used == 0 and st.num_running == 0 and st.num_finished == 4
        await eng.shutdown(drain=True)
        return [r[-1].token_ids for r in results]
    tokens = asyncio.run(main())
    from .test_engine_scheduler import make_engine, run_all
    assert tokens == [o.token_ids for o in run_all(make_engine(), prompts(4), P)]


def test_invalid_request_raises_and_engine_stays_healthy():
    async def main():
        eng = make_async()
        await eng.start()
        with pytest.raises(InvalidRequest, match="image 0"):
            await collect(eng, "bad", {"prompt": "x", "images": [b"junk"]})
        assert eng.healthy
        outs = await collect(eng, "ok", prompts(1)[0])
        assert outs[-1].finished
        await eng.shutdown()
    asyncio.run(main())


def test_abort_and_client_disconnect_free_blocks():
    async def main():
        eng = make_async()
        await eng.start()
        long = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
        agen = eng.generate("a", prompts(1)[0], long)
        first = await agen.__anext__()
        assert first.finish_reason is None
        await eng.abort("a")
        rest = [o async for o in agen]
        assert rest[-1].finish_reason == "abort"
        # a consumer that stops iterating aborts its request
        agen2 = eng.generate("b", prompts(1)[0], long)
        await agen2.__anext__()
        await agen2.aclose()
        for _ in range(200):
            st = eng.stats()
            if st.num_running == 0 and st.num_waiting == 0:
                break
            await asyncio.sleep(0.01)
        assert eng.stats().kv_blocks_used == 0 and eng.stats().num_aborted == 2
        await eng.shutdown(drain=False)
        with pytest.raises(EngineDead):
            await collect(eng, "late", prompts(1)[0])
    asyncio.run(main())


def _submit_all(eng, items, timeout=30):
    """``submit`` each (rid, prompt, params); returns {rid: (output, error, thread name)} once all ended."""
    import threading
    got, lock, done = {}, threading.Lock(), threading.Event()

    def cb_for(rid):
        def cb(out, err):
            with lock:
                assert rid not in got, "a callback called twice"
                got[rid] = (out, err, threading.current_thread().name)
                if len(got) == len(items):
                    done.set()
        return cb
    for rid, prompt, params in items:
        eng.submit(rid, prompt, params, 0, cb_for(rid))
    assert done.wait(timeout), f"ended: {sorted(got)}"
    return got


def test_submit_calls_back_once_with_the_final_output_of_generate():
    """The loop-free face: one callback per request, on the step loop's thread, carrying the same
    tokens and text as a streamed generate; nothing streamed per token."""
    async def main():
        eng = make_async()
        await eng.start()
        streamed = await asyncio.gather(*[collect(eng, f"g{i}", p) for i, p in enumerate(prompts(3))])
        loop = asyncio.get_running_loop()
        got = await loop.run_in_executor(None, _submit_all, eng, [(f"s{i}", p, P) for i, p in enumerate(prompts(3))])
        for i in range(3):
            out, err, thread = got[f"s{i}"]
            assert err is None and thread == "fdx-step-loop"
            assert out.finish_reason == "length" and out.token_ids == streamed[i][-1].token_ids
            assert out.text == streamed[i][-1].text and out.delta_token_ids == out.token_ids
        assert eng.stats().kv_blocks_used == 0 and not eng._callbacks
        await eng.shutdown()
    asyncio.run(main())


def test_submit_reports_refusals_and_aborts_and_a_raising_callback_harms_nobody():
    async def main():
        eng = make_async()
        await eng.start()
        loop = asyncio.get_running_loop()
        got = await loop.run_in_executor(None, _submit_all, eng, [("bad", {"prompt": "x", "images": [b"junk"]}, P)])
        out, err, _ = got["bad"]
        assert out is None and err.startswith("InvalidRequest") and "image 0" in err
        # a callback that raises is logged; the loop and the next request go on
        eng.submit("boom", prompts(1)[0], P, 0, lambda out, err: 1 / 0)
        long = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)

        def abort_soon():
            import threading
            threading.Timer(0.05, eng.abort_nowait, ("long",)).start()
            return _submit_all(eng, [("long", prompts(1)[0], long), ("ok", prompts(1)[0], P)])
        got = await loop.run_in_executor(None, abort_soon)
        assert got["ok"][1] is None and got["ok"][0].finish_reason == "length"
        assert got["long"][1] == "abort" and got["long"][0].finish_reason == "abort"
        assert eng.healthy and eng.stats().kv_blocks_used == 0
        with pytest.raises(InvalidRequest, match="already running"):
            eng.submit("dup", prompts(1)[0], long, 0, lambda *a: None)
            eng.submit("dup", prompts(1)[0], long, 0, lambda *a: None)
        await eng.shutdown(drain=False)
        with pytest.raises(EngineDead):
            eng.submit("late", prompts(1)[0], P, 0, lambda *a: None)
    asyncio.run(main())


def test_submit_learns_that_the_step_loop_died():
    async def main():
        eng = make_async(runner=ExplodingRunner())
        await eng.start()
        got = await asyncio.get_running_loop().run_in_executor(None, _submit_all, eng, [("x", prompts(1)[0], P)])
        assert got["x"][0] is None and "EngineDead" in got["x"][1] and "device lost" in got["x"][1]
        await eng.shutdown(drain=False)
    asyncio.run(main())


class ExplodingRunner(FakeRunner):
    def execute(self, step):
        raise RuntimeError("device lost")


def test_dead_step_loop_is_reported():
    async def main():
        eng = make_async(runner=ExplodingRunner())
        await eng.start()
        with pytest.raises(EngineDead, match="device lost"):
            await collect(eng, "x", prompts(1)[0])
        assert not eng.healthy and "device lost" in eng.error
        await eng.shutdown(drain=False)
    asyncio.run(main())


def test_real_runner_streams_match_offline():
    """The async API on the shipped tiny_vl model (the real runner): streamed deltas add up to
    the offline API's greedy tokens and text; stop strings cut the text."""
    from fastdeploy_ext import LLM
    from fastdeploy_ext.conformance.references import Manifest
    refs = Manifest.load()
    model, imgs = str(refs.path("tiny_vl")), [str(p) for p in refs.files("images")[:3]]
    kw = dict(max_model_len=256, kv_cache_memory=16 << 20)
    offline = LLM(model, device="cpu", dtype="float32", **kw).generate(
        [{"prompt": "OCR:", "images": [p]} for p in imgs], P, use_tqdm=False)

    async def main():
        eng = AsyncLLMEngine(EngineConfig(model=model, plan=PlanRequest(
            device="cpu", dtype="float32"), **kw))
        await eng.start()
        res = await asyncio.gather(*[collect(eng, str(i), {"prompt": "OCR:", "images": [p]})
                                     for i, p in enumerate(imgs)])
        stop_at = "he"          # in image 2's greedy text ("^he...")
        stopped = await collect(eng, "s", {"prompt": "OCR:", "images": [imgs[2]]},
                                SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, stop=[stop_at]))
        assert eng.stats().kv_blocks_used == 0
        await eng.shutdown()
        return res, stopped, stop_at
    res, stopped, stop_at = asyncio.run(main())
    for outs, off in zip(res, offline):
        assert outs[-1].token_ids == off.outputs[0].token_ids
        assert "".join(o.delta_text for o in outs) == outs[-1].text == off.outputs[0].text
    full = offline[2].outputs[0].text
    assert stop_at in full and stopped[-1].finish_reason == "stop" and stopped[-1].stop_reason == stop_at
    assert stopped[-1].text == full[:full.index(stop_at)] and len(stopped[-1].token_ids) < 10
