"""The engine's delta outputs through the real server (tiny model, loopback, the real `openai`
client): a stream with logprobs sends each token's logprobs once, a stream with a stop string
joins to the non-streamed answer (nothing held back leaks), and the sampling values that used
to kill the step loop are a 400 naming the field or a clean greedy answer, the server healthy."""
from __future__ import annotations

import httpx
import openai
import pytest

from .server_harness import ServerProc, chat, data_url, ref_images, tiny_vl

GREEDY = {"temperature": 0, "extra_body": {"ignore_eos": True}}


@pytest.fixture(scope="module")
def srv():
    s = ServerProc("--max-model-len", "1024")
    try:
        yield s.wait_healthy()
    finally:
        assert s.stop() == 0, s.output


@pytest.fixture(scope="module")
def client(srv):
    return openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def msgs():
    return chat(data_url(ref_images()[1]))["messages"]


def test_a_stream_with_logprobs_sends_each_token_once(client, msgs):
    base = dict(model=str(tiny_vl()), messages=msgs, max_tokens=8, logprobs=True, top_logprobs=2, **GREEDY)
    plain = client.chat.completions.create(**base).choices[0].logprobs.content
    chunks = [c for c in client.chat.completions.create(**base, stream=True, stream_options={"include_usage": True})]
    # each chunk carries the records of its own tokens only (re-sent records would add up past 8)
    streamed = [e for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert chunks[-1].usage.completion_tokens == 8 == len(streamed) == len(plain)
    assert [(e.token, e.logprob) for e in streamed] == [(e.token, e.logprob) for e in plain]


def test_a_streamed_stop_string_joins_to_the_plain_answer(client, msgs):
    base = dict(model=str(tiny_vl()), messages=msgs, max_tokens=12, **GREEDY)
    text = client.chat.completions.create(**base).choices[0].message.content
    # a 2-character stop string from the middle of the greedy text
    at = next(i for i in range(3, len(text) - 1) if text[i:i + 2].strip() == text[i:i + 2] and text[i:i + 2] not in text[:i])
    stop = text[at:at + 2]
    plain = client.chat.completions.create(**base, stop=[stop]).choices[0]
    chunks = list(client.chat.completions.create(**base, stop=[stop], stream=True))
    joined = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert plain.finish_reason == "stop" and plain.message.content == text[:at] == joined


@pytest.mark.parametrize("body,field", [({"top_k": 2**63}, "top_k"), ({"seed": 2**64}, "seed"),
                                        ({"repetition_penalty": 1e-40, "temperature": 1.0}, "repetition_penalty"),
                                        ({"top_k": -5}, "top_k")])
def test_killer_sampling_values_are_400s_naming_the_field(srv, body, field):
    r = httpx.post(srv.url + "/v1/chat/completions", json=chat(data_url(ref_images()[0]), max_tokens=2) | body,
                   timeout=60)
    assert r.status_code == 400 and field in r.json()["error"]["message"], r.text
    assert httpx.get(srv.url + "/health", timeout=10).status_code == 200


def test_temperature_1e_46_and_top_p_0_are_greedy(client, msgs, srv):
    base = dict(model=str(tiny_vl()), messages=msgs, max_tokens=6, extra_body={"ignore_eos": True})
    greedy = client.chat.completions.create(**base, temperature=0).choices[0].message.content
    assert client.chat.completions.create(**base, temperature=1e-46).choices[0].message.content == greedy
    assert client.chat.completions.create(**base, temperature=1.0, top_p=0).choices[0].message.content == greedy
    assert httpx.get(srv.url + "/health", timeout=10).json()["status"] == "ok"
