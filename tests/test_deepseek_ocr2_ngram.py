"""The n-gram blocker (SamplingParams.ngram_blocker: DeepSeek-OCR's NGramPerReqLogitsProcessor
with its size, window and whitelist) against a custom logits processor on transformers' side,
through `LLM.generate` (overlapped and synchronous scheduling) and the real server with the
`openai` client, on the tiny random DeepSeek-OCR-2."""
from __future__ import annotations

import io
import random

import pytest
import torch
from PIL import Image

pytest.importorskip("transformers.models.deepseek_ocr2")

from fastdeploy_ext import LLM, SamplingParams  # noqa: E402
from fastdeploy_ext.engine.config import EngineConfig  # noqa: E402
from fastdeploy_ext.engine.errors import InvalidRequest  # noqa: E402
from fastdeploy_ext.engine.llm_engine import LLMEngine  # noqa: E402
from fastdeploy_ext.engine.sampling_params import NGramBlocker  # noqa: E402
from fastdeploy_ext.models.deepseek_ocr2 import tiny  # noqa: E402
from fastdeploy_ext.plan import PlanRequest  # noqa: E402

MAX_TOKENS = 16
BLOCKER = {"size": 2, "window": 12, "whitelist": [61]}


def deepseek_rule(out: list[int], n: int, window: int, whitelist) -> set[int]:
    """DeepSeek's rule written out: every n-gram in the window whose first n-1 tokens are the
    output's last n-1 bans its last token."""
    if len(out) < n:
        return set()
    tail = tuple(out[len(out) - (n - 1):])
    return {out[i + n - 1] for i in range(max(0, len(out) - window), len(out) - n + 1)
            if tuple(out[i:i + n - 1]) == tail} - set(whitelist)


def test_banned_ids_follow_deepseeks_rule():
    rng = random.Random(0)
    for _ in range(400):
        n = rng.randint(2, 5)
        b = NGramBlocker(n, rng.randint(n, 40), tuple(rng.sample(range(6), rng.randint(0, 2))))
        out = [rng.randrange(6) for _ in range(rng.randint(0, 60))]
        assert b.banned(out) == sorted(deepseek_rule(out, b.size, b.window, b.whitelist)), (b, out)
    assert NGramBlocker(3, 90).banned([1, 2, 9, 1, 2]) == [9]
    assert NGramBlocker(3, 3).banned([1, 2, 9, 1, 2]) == []            # the n-gram left the window
    assert NGramBlocker(3, 90, (9,)).banned([1, 2, 9, 1, 2]) == []     # whitelisted


@pytest.mark.parametrize("blocker, field", [
    ({"size": 1, "window": 90}, "ngram_blocker.size"), ({"size": 30, "window": 10}, "ngram_blocker.window"),
    ({"size": 3, "window": 9, "whitelist": [256]}, "ngram_blocker.whitelist"),
    ({"size": 3, "window": 9, "whitelist": [True]}, "ngram_blocker.whitelist"),
    ({"size": 3}, "ngram_blocker")])
def test_bad_blocker_is_refused_naming_the_field(blocker, field):
    with pytest.raises(InvalidRequest, match=field.replace(".", r"\.")):
        SamplingParams(ngram_blocker=blocker).validate(vocab_size=256)


# ------------------------------------------------------------------ against transformers
@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return tiny.write_checkpoint(tmp_path_factory.mktemp("dsocr2_ngram") / "tiny", seed=0)


@pytest.fixture(scope="module")
def page():
    g = torch.Generator().manual_seed(1)
    return Image.fromarray((torch.rand(500, 600, 3, generator=g) * 255).to(torch.uint8).numpy())


@pytest.fixture(scope="module")
def expected(model_dir, page):
    """transformers' greedy ids without and with the blocker as a custom logits processor."""
    from transformers import DeepseekOcr2ForConditionalGeneration, LogitsProcessor, LogitsProcessorList
    ref = DeepseekOcr2ForConditionalGeneration.from_pretrained(str(model_dir)).eval()
    r = tiny.processor()(images=[page], text="<image>\nFree OCR.", return_tensors="pt")
    plen = r["input_ids"].shape[1]

    class WindowedNoRepeatNGram(LogitsProcessor):
        def __call__(self, input_ids, scores):
            for row in range(input_ids.shape[0]):
                ban = deepseek_rule(input_ids[row, plen:].tolist(), BLOCKER["size"], BLOCKER["window"],
                                    BLOCKER["whitelist"])
                scores[row, sorted(ban)] = float("-inf")
            return scores

    out = {}
    with torch.inference_mode():
        for name, procs in (("plain", []), ("blocked", [WindowedNoRepeatNGram()])):
            g = ref.generate(**r, max_new_tokens=MAX_TOKENS, min_new_tokens=MAX_TOKENS, do_sample=False,
                             logits_processor=LogitsProcessorList(procs))
            out[name] = g[0, plen:].tolist()
    assert out["plain"] != out["blocked"]          # the case exercises the blocker
    return out


def make_llm(model_dir, async_scheduling: bool) -> LLM:
    cfg = EngineConfig(model=str(model_dir), model_family="deepseek_ocr2", plan=PlanRequest(device="cpu", dtype="float32"),
                       kv_cache_memory=16 << 20, max_model_len=1024, async_scheduling=async_scheduling)
    return LLM.from_config(cfg)


@pytest.fixture(scope="module", params=[True, False], ids=["async", "sync"])
def llm(request, model_dir):
    return make_llm(model_dir, request.param)


def run(llm, page, blocker):
    p = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, ngram_blocker=blocker)
    return llm.generate({"prompt": "Free OCR.", "multi_modal_data": {"image": page}}, p)[0].outputs[0].token_ids


def test_blocked_greedy_ids_match_transformers_processor(llm, page, expected):
    assert run(llm, page, None) == expected["plain"]
    assert run(llm, page, dict(BLOCKER)) == expected["blocked"]


def test_blocker_needs_the_previous_ids_on_the_host(model_dir, page, expected, monkeypatch):
    """Overlapped scheduling leaves the last sampled id on the device; a blocker step waits for
    it. Without that wait the blocker sees a placeholder instead of the last token and the ids
    differ from transformers'."""
    llm = make_llm(model_dir, async_scheduling=True)
    monkeypatch.setattr(LLMEngine, "_needs_host_ids", staticmethod(lambda sched: False))
    assert run(llm, page, dict(BLOCKER)) != expected["blocked"]


def test_server_request_body_takes_the_blocker(model_dir, page, expected):
    import openai
    from openai import OpenAI

    from .server_harness import ServerProc, data_url
    buf = io.BytesIO()
    page.save(buf, format="PNG")
    server = ServerProc("--max-model-len", "1024", model_dir=str(model_dir))
    try:
        server.wait_healthy()
        client = OpenAI(base_url=server.url + "/v1", api_key="unused")
        model = client.models.list().data[0].id
        messages = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": data_url(buf.getvalue())}},
                                                 {"type": "text", "text": "Free OCR."}]}]
        kw = dict(model=model, messages=messages, max_tokens=MAX_TOKENS, temperature=0)
        r = client.chat.completions.create(**kw, extra_body={"ignore_eos": True, "ngram_blocker": BLOCKER})
        from fastdeploy_ext.models.deepseek_ocr2.config import DeepseekOCR2Config
        from fastdeploy_ext.models.deepseek_ocr2.prompt import load_tokenizer
        tok = load_tokenizer(model_dir, DeepseekOCR2Config.from_model_dir(model_dir))
        assert tok.decode(expected["blocked"]) != tok.decode(expected["plain"])
        assert r.choices[0].message.content == tok.decode(expected["blocked"])
        assert r.usage.completion_tokens == MAX_TOKENS
        with pytest.raises(openai.BadRequestError, match="ngram_blocker.size"):
            client.chat.completions.create(**kw, extra_body={"ngram_blocker": {"size": 1, "window": 4}})
        assert client.models.list().data[0].id == model          # still healthy
    finally:
        rc = server.stop()
    assert rc == 0, server.output[-3000:]
