"""The scheduler side of the engine against a fake runner that keeps a real paged cache
(tests/engine_fakes.py): batching, both prefill modes, chunking, preemption and aborts must not
change greedy tokens, and the KV pool ends empty."""
from __future__ import annotations

import numpy as np
import pytest
from PIL import Image

from fastdeploy_ext.engine.block_manager import BlockError, BlockManager
from fastdeploy_ext.engine.config import EngineConfig
from fastdeploy_ext.engine.errors import InvalidRequest
from fastdeploy_ext.engine.input_processor import InputLimits, InputProcessor
from fastdeploy_ext.engine.llm_engine import LLMEngine
from fastdeploy_ext.engine.sampling_params import SamplingParams
from fastdeploy_ext.models.paddleocr_vl.processor import ImageProcessor, PreprocessorConfig

from .engine_fakes import FakePromptBuilder, FakeRunner

TINY_PP = PreprocessorConfig(min_pixels=28 * 28, max_pixels=28 * 28 * 64, image_mean=(0.5,) * 3, image_std=(0.5,) * 3)


def make_engine(runner=None, max_model_len=256, **kw):
    runner = runner or FakeRunner()
    cfg = EngineConfig(max_model_len=max_model_len, preprocess_workers=2, **{"num_kv_blocks": 512, **kw})
    proc = InputProcessor(FakePromptBuilder(), ImageProcessor(TINY_PP),
                          InputLimits(cfg.limit_mm_per_prompt["image"], cfg.max_encoder_patches, cfg.max_model_len))
    return LLMEngine(cfg, runner=runner, input_processor=proc)


def pil(i, w=56, h=56):
    rng = np.random.default_rng(i)
    return Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8))


SIZES = [(56, 56), (84, 56), (28, 112), (112, 84), (56, 28), (84, 84), (140, 56), (28, 28)]


def prompts(n=8):
    return [{"messages": [{"role": "user", "content": [{"type": "image", "image": pil(i, *SIZES[i % 8])},
                                                        {"type": "text", "text": f"OCR {i}:"}]}]} for i in range(n)]


GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


def run_all(engine, reqs, params=GREEDY):
    for i, p in enumerate(reqs):
        engine.add_request(str(i), p, params)
    done = {}
    steps = 0
    while engine.has_unfinished():
        for o in engine.step():
            done[o.request_id] = o
        steps += 1
        assert steps < 10000
    return [done[str(i)] for i in range(len(reqs))]


@pytest.fixture(scope="module")
def alone():
    """Each request run alone (one at a time, fresh engine each): the reference."""
    out = []
    for p in prompts():
        out.append(run_all(make_engine(), [p])[0].token_ids)
    return out


def test_block_manager_allocate_free_and_double_free():
    bm = BlockManager(4, 16)

    class S:
        seq_id, block_table = 7, []
    s = S()
    bm.allocate(s, 17)
    assert s.block_table == [0, 1] and bm.num_used == 2 and bm.usage == 0.5
    bm.allocate(s, 32)                  # no boundary crossed: no new block
    assert len(s.block_table) == 2
    bm.free(s)
    assert bm.num_free == 4 and s.block_table == []
    s.block_table = [0]                 # mutation: a stale table must not be freed twice
    with pytest.raises(BlockError):
        bm.free(s)


def test_concurrent_equals_alone_max_prefill(alone):
    runner = FakeRunner()
    eng = make_engine(runner, enable_max_prefill=True)
    outs = run_all(eng, prompts())
    assert [o.token_ids for o in outs] == alone
    assert all(len(o.token_ids) == 12 and o.finish_reason == "length" for o in outs)
    assert runner.encode_calls[0] == 8, "all 8 admitted images in one packed vision pass"
    assert eng.block_manager.num_used == 0


def test_chunked_prefill_equals_alone(alone):
    runner = FakeRunner()
    eng = make_engine(runner, enable_max_prefill=False, max_num_batched_tokens=7)
    outs = run_all(eng, prompts())
    assert [o.token_ids for o in outs] == alone
    assert max(st.num_tokens for st in runner.steps) <= 7
    # images split across chunks: some image's placeholder tokens straddle a chunk boundary
    assert any(st.is_prefill and s.image_embeds is not None and 0 < len(s.image_embeds) < 16
               for st in runner.steps for s in st.seqs)
    assert all(n == 1 for n in runner.encode_calls), "per-request encoding in chunked mode"
    assert len(runner.encode_calls) == 8, "each request's images are encoded once, kept across chunks"
    assert eng.block_manager.num_used == 0


@pytest.mark.parametrize("max_prefill", [True, False])
def test_tiny_pool_preempts_and_keeps_tokens(alone, max_prefill):
    # 26 blocks x 4 = 104 tokens: one sequence (<= 96 tokens) fits, 8 do not
    eng = make_engine(num_kv_blocks=26, max_model_len=96, enable_max_prefill=max_prefill,
                      max_num_batched_tokens=64)
    outs = run_all(eng, prompts())
    assert [o.token_ids for o in outs] == alone
    assert eng.scheduler.num_preemptions > 0
    assert eng.block_manager.num_used == 0


def test_max_num_seqs_bounds_running():
    runner = FakeRunner()
    eng = make_engine(runner, max_num_seqs=3)
    outs = run_all(eng, prompts())
    assert len(outs) == 8
    assert max(len(st.seqs) for st in runner.steps) <= 3


def test_abort_frees_blocks_and_reports():
    eng = make_engine()
    for i, p in enumerate(prompts(4)):
        eng.add_request(str(i), p, SamplingParams(temperature=0, max_tokens=50, ignore_eos=True))
    eng.step()
    eng.step()
    assert eng.block_manager.num_used > 0
    eng.abort_request("1")
    outs = eng.step()
    aborted = [o for o in outs if o.request_id == "1"]
    assert aborted and aborted[0].finish_reason == "abort"
    while eng.has_unfinished():
        eng.step()
    assert eng.block_manager.num_used == 0


def test_invalid_requests_raise_before_queueing():
    eng = make_engine(max_model_len=64)
    bad = [
        ({"messages": "hi"}, SamplingParams()),
        ({"prompt": "x", "images": [pil(0), pil(1)]}, SamplingParams()),       # limit_mm_per_prompt 1
        ({"prompt": "x", "images": [b"not an image"]}, SamplingParams()),
        ({"prompt": "x" * 80}, SamplingParams()),                              # beyond max_model_len
        ({"prompt": "x"}, SamplingParams(max_tokens=500)),
        ({"prompt": "x"}, SamplingParams(top_p=1.5)),
        ({"prompt": "x", "images": ["https://example.com/a.png"]}, SamplingParams()),
    ]
    for prompt, params in bad:
        with pytest.raises(InvalidRequest):
            eng.add_request("bad", prompt, params)
    assert not eng.has_unfinished()


def test_submit_pool_and_streaming_deltas():
    eng = make_engine()
    futs = [eng.submit(str(i), p, GREEDY, stream=True) for i, p in enumerate(prompts(3))]
    bad = eng.submit("bad", {"prompt": "x", "images": [b"junk"]}, GREEDY)
    for f in futs:
        f.result()
    with pytest.raises(InvalidRequest):
        bad.result()
    deltas: dict[str, list] = {}
    final = {}
    while eng.has_unfinished():
        for o in eng.step():
            deltas.setdefault(o.request_id, []).extend(o.delta_token_ids)
            if o.finished:
                final[o.request_id] = o
    assert set(final) == {"0", "1", "2"}
    for rid, o in final.items():
        assert deltas[rid] == o.token_ids
    assert eng.block_manager.num_used == 0


def test_pool_too_small_for_max_model_len_is_an_error():
    with pytest.raises(ValueError, match="max-model-len"):
        make_engine(num_kv_blocks=10, max_model_len=64)
