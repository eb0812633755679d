"""A request that fails inside the engine fails alone, through the real server: the app that
`serve` builds (tiny model, loopback, uvicorn in a thread so the test can reach into its engine)
answers 8 concurrent `openai` clients while one request's host-side work raises; that one gets
a 500 naming `request_failed` (plain) or an error event (streamed), the other 7 get the same
tokens as without the fault, /health stays 200, no KV block is left behind, and the engine
serves on. With the isolation removed (the step loop re-raises), the same test fails."""
from __future__ import annotations

import asyncio
import threading
import time

import httpx
import openai
import pytest

from fastdeploy_ext.entrypoints.openai import api_server

from .server_harness import TINY_ARGS, chat, data_url, free_port, ref_images, tiny_vl, wait_until_healthy

POISON_MAX_TOKENS = 7          # the request whose detokenization raises (the others ask for 8)
GREEDY = {"temperature": 0, "extra_body": {"ignore_eos": True}}


class InThreadServer:
    def __init__(self, extra: list[str] = ()):
        self.port = free_port()
        ns = api_server.build_parser().parse_args(["--model", str(tiny_vl()), *TINY_ARGS, "--port", str(self.port),
                                                   "--max-model-len", "1024", *extra])
        self.state = api_server.build_state(ns)
        self.rc: list[int] = []
        self.thread = threading.Thread(target=lambda: self.rc.append(asyncio.run(api_server._serve(self.state))),
                                       daemon=True)
        self.thread.start()
        self.url = f"http://127.0.0.1:{self.port}"
        why = wait_until_healthy(self.url, 180, lambda: None if self.thread.is_alive() else "the server thread ended")
        assert why is None, why

    def stop(self) -> int:
        self.state.request_exit(0)
        self.thread.join(30)
        return self.rc[0] if self.rc else -1


@pytest.fixture(scope="module")
def srv():
    s = InThreadServer()
    try:
        yield s
    finally:
        assert s.stop() == 0


def _poison(state, monkeypatch):
    """Detokenization raises for the poisoned request once it has 2 tokens (its own host work)."""
    proc = state.engine.engine.output_processor
    real = proc._detokenize

    def detokenize(seq):
        if seq.params.max_tokens == POISON_MAX_TOKENS and seq.num_output_tokens >= 2:
            raise RuntimeError("injected detokenizer failure")
        return real(seq)
    monkeypatch.setattr(proc, "_detokenize", detokenize)


def _client(srv) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=120)


async def _ask(client, msgs, max_tokens: int, stream: bool):
    kw = dict(model=str(tiny_vl()), messages=msgs, max_tokens=max_tokens, **GREEDY)
    if not stream:
        return (await client.chat.completions.create(**kw)).choices[0].message.content
    text, error = "", None
    try:
        async for c in await client.chat.completions.create(**kw, stream=True):
            if c.choices:
                text += c.choices[0].delta.content or ""
    except openai.APIError as e:       # the error event the server sends mid-stream
        error = e
    return error if error is not None else text


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "streamed"])
def test_one_failing_request_of_8_fails_alone(srv, monkeypatch, stream):
    msgs = chat(data_url(ref_images()[1]))["messages"]

    async def batch():        # a client per event loop: its connection pool belongs to the loop
        client = _client(srv)
        return await asyncio.gather(*[_ask(client, msgs, POISON_MAX_TOKENS if i == 3 else 8, stream)
                                      for i in range(8)], return_exceptions=True)

    async def one():
        return await _ask(_client(srv), msgs, 8, stream)
    want = asyncio.run(one())           # before the fault: the reference answer
    _poison(srv.state, monkeypatch)
    got = asyncio.run(batch())
    bad = got.pop(3)
    if stream:
        assert isinstance(bad, openai.APIError) and "injected detokenizer failure" in str(bad), bad
    else:
        assert isinstance(bad, openai.InternalServerError), bad
        assert bad.status_code == 500 and bad.body["code"] == "request_failed"
        assert "injected detokenizer failure" in bad.body["message"]
    assert got == [want] * 7
    assert httpx.get(srv.url + "/health").json() == {"status": "ok"}
    st = srv.state.engine.stats()
    assert st.kv_blocks_used == 0 and st.num_running == 0 and st.num_failed >= 1
    assert asyncio.run(one()) == want         # serves on


def test_a_step_past_the_step_timeout_is_health_503_stuck_then_exit_1():
    srv = InThreadServer(["--step-timeout", "1"])
    runner = srv.state.engine.engine.runner
    release, real = threading.Event(), runner.execute

    def execute(batch):                 # the decode steps of this request hang (a wedged kernel)
        if batch.is_prefill is False:
            release.wait(30)
        return real(batch)
    runner.execute = execute
    msgs = chat(data_url(ref_images()[1]))["messages"]
    body = {"model": str(tiny_vl()), "messages": msgs, "max_tokens": 4, "temperature": 0}
    sender = threading.Thread(target=lambda: httpx.post(srv.url + "/v1/chat/completions", json=body, timeout=60),
                              daemon=True)
    sender.start()
    seen, end = None, time.monotonic() + 30
    while time.monotonic() < end:
        r = httpx.get(srv.url + "/health", timeout=5)
        if r.status_code == 503:
            seen = r.json()
            break
        time.sleep(0.05)
    release.set()
    srv.thread.join(30)
    assert seen is not None and seen["status"] == "stuck" and "--step-timeout 1" in seen["reason"], seen
    assert srv.rc == [1]                # the watchdog exits for a restart
