"""toy_vlm through the engine: `generate`, `serve` (the real server and the `openai` client) and the
conformance suite's generation tests, each against the family's float64 reference greedy ids.

They prove the engine<->runner contract is the family's, not PaddleOCR-VL's: prompts built by
``runner.family.build_prompt`` with its placeholder runs, 1-row positions (1D rope), a fixed
number of embeddings per item and the family's own eos and vocabulary. Runs in the matrix's
cpu/toy-family leg.
"""
from __future__ import annotations

import json
import sys

import pytest
from openai import OpenAI

from .server_harness import ServerProc, data_url
from .test_toy_family import _suite, env_with, installed_toy, passed_names, run

SMALL = ["--device", "cpu", "--dtype", "float32", "--kv-cache-memory", "16MiB", "--max-model-len", "256"]


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    return installed_toy(tmp_path_factory)


@pytest.fixture(scope="module")
def case(site, tmp_path_factory):
    """The toy's generation case: model dir, images and greedy ids of its reference."""
    sys.path.insert(0, str(site))
    try:
        from fdx_toy.conformance import ToyConformance
        fx = ToyConformance(tmp_path_factory.mktemp("toy_fixture"))
        c = fx.generate_case()
        from fdx_toy.prompt import load_tokenizer
        return c, load_tokenizer(fx.reference.cfg)
    finally:
        sys.path.remove(str(site))


def test_the_suites_generation_tests_pass_on_the_toy_family(site, tmp_path):
    r, counts = _suite(env_with(site), tmp_path, "--fdx-family", "toy_vlm", "-k", "test_generate")
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]
    assert counts["failures"] == counts["errors"] == counts["skipped"] == 0 and counts["tests"] == 9, counts   # 4 generation tests x async scheduling on/off + bf16
    assert {"test_greedy_matches_transformers_generate[async]", "test_greedy_matches_transformers_generate[sync]"} \
        <= passed_names(tmp_path / "toy.xml")


def test_generate_cli_gives_the_reference_greedy_ids(site, case):
    c, _ = case
    r = run(env_with(site), "-m", "fastdeploy_ext.entrypoints.cli", "generate", "--model", str(c.model_dir),
            "--image", str(c.images[0]), "--image", str(c.images[1]), "--prompt", c.prompt,
            "--max-tokens", str(c.max_tokens), "--ignore-eos", "--temperature", "0", "--json", *SMALL, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    objs = [json.loads(line) for line in r.stdout.strip().splitlines()]
    assert [o["token_ids"] for o in objs] == c.expected[:2]
    assert "model family toy_vlm" in r.stderr


def test_serve_answers_the_openai_client_with_the_reference_tokens(site, case):
    c, tok = case
    server = ServerProc(env=env_with(site), model_dir=str(c.model_dir))
    try:
        server.wait_healthy()
        client = OpenAI(base_url=server.url + "/v1", api_key="unused")
        model = client.models.list().data[0].id
        messages = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": data_url(c.images[0].read_bytes())}},
                                                 {"type": "text", "text": c.prompt}]}]
        kw = dict(model=model, messages=messages, max_tokens=c.max_tokens, temperature=0,
                  extra_body={"ignore_eos": True})
        r = client.chat.completions.create(**kw)
        assert r.choices[0].message.content == tok.decode(c.expected[0])
        assert r.usage.completion_tokens == c.max_tokens and r.choices[0].finish_reason == "length"
        chunks = list(client.chat.completions.create(**kw, stream=True))
        assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == tok.decode(c.expected[0])
    finally:
        rc = server.stop()
    assert rc == 0, server.output[-3000:]
