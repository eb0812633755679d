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


def test_empty_inputs_return_empty_lists():
    llm = make_llm()
    assert llm.generate([], GREEDY, use_tqdm=False) == []
    assert llm.chat([], GREEDY, use_tqdm=False) == []
    assert llm.generate([]) == [] and llm.chat([]) == []


def test_one_lazily_opened_image_shared_by_16_prompts(tmp_path):
    """The same PIL image object (opened lazily from a real PNG, not decoded yet) in 16 prompts
    preprocessed by parallel workers: every prompt gets it whole, every time."""
    from PIL import Image
    path = tmp_path / "page.png"
    pil(3, w=300, h=200).save(path)
    llm = make_llm()
    ref = llm.generate([{"prompt": "OCR:", "multi_modal_data": {"image": Image.open(path).convert("RGB")}}],
                       GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    for _ in range(6):
        im = Image.open(path)                            # lazy: decoded on first use, in the pool
        outs = llm.generate([{"prompt": "OCR:", "multi_modal_data": {"image": im}}] * 16, GREEDY, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == [ref] * 16


def test_progress_bar_counts_finished_prompts_on_a_terminal(monkeypatch, capsys):
    import sys
    llm = make_llm()
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True, raising=False)
    llm.generate([{"prompt": "OCR 0:", "multi_modal_data": {"image": pil(0)}}] * 3, GREEDY)
    err = capsys.readouterr().err
    assert "Processed prompts" in err and "3/3" in err
    monkeypatch.setattr(sys.stderr, "isatty", lambda: False, raising=False)
    llm.generate([{"prompt": "OCR 0:", "multi_modal_data": {"image": pil(0)}}], GREEDY)
    assert "Processed prompts" not in capsys.readouterr().err     # no bar redrawn into a log or pipe


@pytest.mark.parametrize("flags,ok", [(["--top-k", "9223372036854775808"], False), (["--top-k", "-2"], False),
                                      (["--seed", str(2**64)], False), (["--repetition-penalty", "1e-40"], False),
                                      (["--temperature", "1e-46"], True), (["--top-p", "0", "--temperature", "1"], True)])
def test_cli_generate_killer_values_are_a_clean_result_or_a_one_line_error(flags, ok, capsys):
    """Through `generate`, the values that used to kill the engine: refused with exit 2 and a
    one-line error naming the flag's field, or run greedily (temperature 1e-46, top_p 0)."""
    import json

    from fastdeploy_ext.conformance.references import Manifest
    from fastdeploy_ext.entrypoints import cli as cli_mod
    refs = Manifest.load()
    argv = ["generate", "--model", str(refs.path("tiny_vl")), "--image", str(refs.files("images")[0]), "--prompt",
            "OCR:", "--max-tokens", "8", "--ignore-eos", "--dtype", "float32", "--json", "--device", "cpu",
            "--kv-cache-memory", "16MiB", "--max-model-len", "512", *flags]
    rc = cli_mod.main(argv)
    out, err = capsys.readouterr()
    assert "Traceback" not in err
    if ok:
        assert rc == 0
        assert json.loads(out.strip())["token_ids"] == refs.json("generate_greedy")["token_ids"][0]
    else:
        field = flags[0].lstrip("-").replace("-", "_")
        assert rc == 2 and field in err and not out.strip()
