"""The offline LLM API (vLLM's shape) on the fake runner: ordering, chat/generate forms, errors
that leave the engine clean."""
from __future__ import annotations

import pytest

from fastdeploy_ext import LLM
from fastdeploy_ext.engine.errors import InvalidRequest
from fastdeploy_ext.engine.input_processor import InputLimits, InputProcessor
from fastdeploy_ext.models.paddleocr_vl.processor import ImageProcessor

from .engine_fakes import FakePromptBuilder, FakeRunner
from .test_engine_scheduler import GREEDY, TINY_PP, make_engine, pil, prompts, run_all


def make_llm(**kw):
    proc = InputProcessor(FakePromptBuilder(), ImageProcessor(TINY_PP), InputLimits(1, 65536, 256))
    return LLM(runner=FakeRunner(), input_processor=proc, max_model_len=256, num_kv_blocks=512,
               preprocess_workers=2, **kw)


def test_chat_and_generate_match_the_engine_in_input_order():
    llm = make_llm()
    ref = [o.token_ids for o in run_all(make_engine(), prompts(5))]
    convs = [p["messages"] for p in prompts(5)]
    outs = llm.chat(convs, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == ref
    assert all(o.outputs[0].finish_reason == "length" and o.prompt_token_ids for o in outs)
    one = llm.chat(convs[2], GREEDY, use_tqdm=False)
    assert len(one) == 1 and one[0].outputs[0].token_ids == ref[2]
    gen = llm.generate([{"prompt": "OCR 0:", "multi_modal_data": {"image": pil(0)}}], GREEDY, use_tqdm=False)
    assert gen[0].outputs[0].token_ids == ref[0]
    assert gen[0].outputs[0].text == FakePromptBuilder.tokenizer.decode(ref[0])
    assert llm.engine.block_manager.num_used == 0


def test_bad_prompt_raises_names_it_and_leaves_the_engine_clean():
    llm = make_llm()
    reqs = [{"prompt": "a", "multi_modal_data": {"image": pil(1)}}, {"prompt": "b", "images": [b"junk"]}]
    with pytest.raises(InvalidRequest, match="prompt 1"):
        llm.generate(reqs, GREEDY, use_tqdm=False)
    assert not llm.engine.has_unfinished() and llm.engine.block_manager.num_used == 0
    assert len(llm.generate(reqs[:1], GREEDY, use_tqdm=False)) == 1


def test_needs_a_model_or_dummy():
    with pytest.raises(ValueError, match="load_format='dummy'"):
        LLM()
