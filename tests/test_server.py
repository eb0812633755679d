"""The OpenAI-compatible server as a REAL process on a loopback port (tiny model dir, CPU,
fp32), driven by the `openai` client and raw HTTP (httpx): answers, streaming, concurrency,
every error path, disconnect, SIGTERM drain and a 1000-request soak."""
from __future__ import annotations

import asyncio
import json
import signal
import threading

import httpx
import openai
import pytest

from .server_harness import ImageHost, ServerProc, chat, data_url, png_bytes, ref_images, tiny_vl

GREEDY = {"temperature": 0, "ignore_eos": True}
NO_GUARD = {"repetition_guard": {"enabled": False}}    # long generations that must not stop early
# a small guard, so that the test's looping greedy output trips it well before max_tokens
GUARD = '{"enabled": true, "max_period": 8, "min_repeats": 4, "min_span": 24}'


@pytest.fixture(scope="module")
def images():
    return ref_images()


@pytest.fixture(scope="module")
def host(images):
    h = ImageHost(images[0])
    yield h
    h.close()


@pytest.fixture(scope="module")
def media_dir(tmp_path_factory, images):
    d = tmp_path_factory.mktemp("media")
    (d / "page.png").write_bytes(images[1])
    return d


@pytest.fixture(scope="module")
def srv(media_dir):
    """The main server: generous limits, local media allowed under media_dir, a small pixel cap."""
    s = ServerProc("--max-model-len", "4096", "--allowed-local-media-path", str(media_dir),
                   "--media-fetch-timeout", "1", "--repetition-guard", GUARD,
                   "--allow-private-media-fetch",                                 # the image host is loopback
                   "--engine-worker-queue-port", "8187", "--enable-mm",       # FastDeploy flags: ignored
                   env={"FD_MAX_IMAGE_PIXELS": "1000000"}, metrics_port=True)
    try:
        yield s.wait_healthy()
    finally:
        assert s.stop() == 0, s.output


@pytest.fixture(scope="module")
def client(srv):
    return openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def post(srv, body, **kw) -> httpx.Response:
    return httpx.post(srv.url + "/v1/chat/completions", json=body, timeout=120, **kw)


def error_of(r: httpx.Response, status: int) -> str:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    return err["message"]


# --------------------------------------------------------------------------- answers
def test_startup_logs_and_models(srv, client):
    out = srv.output
    assert "ignoring FastDeploy flag --engine-worker-queue-port=8187" in out
    assert "ignoring FastDeploy flag --enable-mm" in out
    assert "FD_ENABLE_MAX_PREFILL=1" in out and "plan:" in out and "KV pool:" in out
    # the default served names: the --model path as typed, then the directory's own name
    assert [m.id for m in client.models.list().data] == [str(tiny_vl()), "tiny_vl"]


def test_plain_and_streaming_agree_with_usage_and_logprobs(srv, client, images):
    msgs = chat(data_url(images[0]))["messages"]
    plain = client.chat.completions.create(model=str(tiny_vl()), messages=msgs, max_tokens=8, temperature=0,
                                           logprobs=True, top_logprobs=2, extra_body={"ignore_eos": True})
    ch = plain.choices[0]
    assert ch.finish_reason == "length"
    assert plain.usage.completion_tokens == 8 and plain.usage.prompt_tokens > 8
    assert plain.usage.total_tokens == plain.usage.prompt_tokens + 8
    assert len(ch.logprobs.content) == 8
    for e in ch.logprobs.content:
        assert len(e.top_logprobs) == 2 and e.logprob == e.top_logprobs[0].logprob <= 0   # greedy: top-1 chosen
        assert e.top_logprobs[0].logprob >= e.top_logprobs[1].logprob

    stream = client.chat.completions.create(model=str(tiny_vl()), messages=msgs, max_tokens=8, temperature=0,
                                            stream=True, stream_options={"include_usage": True},
                                            extra_body={"ignore_eos": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert text == ch.message.content and finishes == ["length"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 8
    assert chunks[-1].usage.prompt_tokens == plain.usage.prompt_tokens


def test_sse_wire_format(srv, images):
    with httpx.stream("POST", srv.url + "/v1/chat/completions", timeout=60,
                      json=chat(data_url(images[0]), max_tokens=3, stream=True, **GREEDY)) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = [line for line in r.iter_lines() if line]
    assert all(e.startswith("data: ") for e in events) and events[-1] == "data: [DONE]"
    objs = [json.loads(e[6:]) for e in events[:-1]]
    assert all(o["object"] == "chat.completion.chunk" and "usage" not in o for o in objs)  # no include_usage
    assert len({o["id"] for o in objs}) == 1


def test_sampling_parameters(srv, client, images):
    msgs = chat(data_url(images[1]))["messages"]
    base = dict(model=str(tiny_vl()), messages=msgs, max_tokens=12)
    greedy = client.chat.completions.create(**base, temperature=0, extra_body={"ignore_eos": True})
    # seeded sampling is reproducible; top_k=1 is greedy whatever the temperature
    s1 = client.chat.completions.create(**base, temperature=1.0, top_p=0.9, seed=7, extra_body={"ignore_eos": True})
    s2 = client.chat.completions.create(**base, temperature=1.0, top_p=0.9, seed=7, extra_body={"ignore_eos": True})
    assert s1.choices[0].message.content == s2.choices[0].message.content
    k1 = client.chat.completions.create(**base, temperature=1.0, extra_body={"top_k": 1, "ignore_eos": True})
    assert k1.choices[0].message.content == greedy.choices[0].message.content
    # max_completion_tokens wins over max_tokens (OpenAI's newer name)
    r = post(srv, chat(data_url(images[1]), max_tokens=12, max_completion_tokens=3, **GREEDY)).json()
    assert r["usage"]["completion_tokens"] == 3
    # a stop string taken from the greedy text ends the answer before it
    text = greedy.choices[0].message.content
    stop = text[4:6]
    if stop.strip():
        r = client.chat.completions.create(**base, temperature=0, stop=[stop], extra_body={"ignore_eos": True})
        assert r.choices[0].finish_reason == "stop" and stop not in r.choices[0].message.content
        assert text.startswith(r.choices[0].message.content)
    # repetition_penalty changes the greedy answer's distribution (accepted and applied)
    rp = client.chat.completions.create(**base, temperature=0, extra_body={"repetition_penalty": 5.0,
                                                                            "ignore_eos": True})
    assert rp.choices[0].finish_reason in ("length", "stop")


def test_mm_processor_kwargs_bound_the_image_tokens(srv, images):
    big = post(srv, chat(data_url(images[0]), max_tokens=1, **GREEDY)).json()["usage"]["prompt_tokens"]
    small = post(srv, chat(data_url(images[0]), max_tokens=1, mm_processor_kwargs={"max_pixels": 28 * 28 * 4},
                           **GREEDY)).json()["usage"]["prompt_tokens"]
    assert small < big
    msg = error_of(post(srv, chat(data_url(images[0]), mm_processor_kwargs={"min_pixels": 10 ** 6,
                                                                              "max_pixels": 10})), 400)
    assert "min_pixels" in msg
    assert "bogus" in error_of(post(srv, chat(data_url(images[0]), mm_processor_kwargs={"bogus": 1})), 400)


def test_concurrent_greedy_equals_single(srv, images):
    bodies = [chat(data_url(images[i % len(images)]), text=["OCR:", "Table Recognition:"][i % 2],
                   max_tokens=10, **GREEDY) for i in range(8)]
    alone = [post(srv, b).json()["choices"][0]["message"]["content"] for b in bodies]

    async def together():
        async with httpx.AsyncClient(timeout=120) as c:
            rs = await asyncio.gather(*[c.post(srv.url + "/v1/chat/completions", json=b) for b in bodies])
        return [r.json()["choices"][0]["message"]["content"] for r in rs]
    assert asyncio.run(together()) == alone
    assert len(set(alone)) > 1          # the requests really differ


def test_repetition_guard_finishes_with_stop(srv, images):
    r = post(srv, chat(data_url(images[0]), max_tokens=400, **GREEDY)).json()
    ch = r["choices"][0]
    assert ch["finish_reason"] == "stop" and ch["stop_reason"] == "repetition", r
    assert r["usage"]["completion_tokens"] < 400
    # the per-request override turns it off: the same request runs to max_tokens
    r = post(srv, chat(data_url(images[0]), max_tokens=400, **GREEDY, **NO_GUARD)).json()
    assert r["choices"][0]["finish_reason"] == "length" and r["usage"]["completion_tokens"] == 400
    assert "min_span" in error_of(post(srv, chat(data_url(images[0]), repetition_guard={"min_span": 0})), 400)


# --------------------------------------------------------------------------- media
def test_image_urls_http_and_local(srv, host, images, media_dir):
    ref = post(srv, chat(data_url(images[0]), max_tokens=5, **GREEDY)).json()["choices"][0]["message"]
    got = post(srv, chat(host.url + "/img.png", max_tokens=5, **GREEDY)).json()["choices"][0]["message"]
    assert got == ref                                   # fetched bytes == the data URL's bytes
    local = post(srv, chat(str(media_dir / "page.png"), max_tokens=5, **GREEDY)).json()
    as_file = post(srv, chat("file://" + str(media_dir / "page.png"), max_tokens=5, **GREEDY)).json()
    inline = post(srv, chat(data_url(images[1]), max_tokens=5, **GREEDY)).json()
    assert local["choices"][0]["message"] == as_file["choices"][0]["message"] == inline["choices"][0]["message"]


@pytest.mark.parametrize("case", ["404", "timeout", "outside", "dotdot", "scheme"])
def test_image_url_refusals(srv, host, media_dir, case):
    url, needle = {
        "404": (host.url + "/missing.png", "the image URL could not be fetched"),      # the same for
        "timeout": (host.url + "/hold.png", "the image URL could not be fetched"),     # every fetch failure
        "outside": ("/etc/hostname", "outside --allowed-local-media-path"),
        "dotdot": (str(media_dir / ".." / "x.png"), "outside --allowed-local-media-path"),
        "scheme": ("ftp://example.com/a.png", "unsupported URL scheme"),
    }[case]
    assert needle in error_of(post(srv, chat(url, max_tokens=2)), 400)
    detail = {"404": "HTTP 404", "timeout": "timed out after 1 s"}.get(case)
    if detail:                                           # the reason is in the server's log only
        assert f"fetching {url} failed: {detail}" in srv.wait_output(f"fetching {url} failed: {detail}")
    if case == "timeout":
        assert host.held.acquire(timeout=10)           # consume this request's mark on the host


# --------------------------------------------------------------------------- errors
def _bad_images():
    good = ref_images()[0]
    return {
        "corrupt": (data_url(b"\x89PNG\r\n\x1a\n" + bytes(range(256)) * 4), "image 0"),
        "truncated": (data_url(good[: len(good) // 2]), "image 0"),
        "empty": ("data:image/png;base64,", "empty"),
        "not_base64": ("data:image/png;base64,@@@", "base64"),
        "one_pixel": (data_url(png_bytes(1, 1)), "image 0"),
        "aspect": (data_url(png_bytes(402, 2)), "aspect"),
        "over_pixel_cap": (data_url(png_bytes(1100, 1000)), "pixels"),
    }


@pytest.mark.parametrize("case", list(_bad_images()))
def test_bad_images_are_400_and_server_keeps_serving(srv, images, case):
    url, needle = _bad_images()[case]
    assert needle in error_of(post(srv, chat(url, max_tokens=2)), 400)
    ok = post(srv, chat(data_url(images[0]), max_tokens=2, **GREEDY))
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 2


@pytest.mark.parametrize("body,needle,param", [
    ({"max_token": 5, "foo": 1}, "unknown parameters: foo, max_token", "foo"),
    ({"temperature": "hot"}, "temperature", "temperature"),
    ({"temperature": -1}, "temperature", None),
    ({"top_p": 1.5}, "top_p", None),
    ({"top_logprobs": 3}, "top_logprobs needs logprobs", "top_logprobs"),
    ({"n": 2}, "n must be 1", None),
    ({"messages": []}, "messages", "messages"),
    ({"messages": [{"role": "robot", "content": "x"}]}, "role", None),
])
def test_bad_parameters_are_400(srv, images, body, needle, param):
    err = post(srv, chat(data_url(images[0]), max_tokens=2) | body).json()["error"]
    assert needle in err["message"] and err["type"] == "invalid_request_error"
    if param:
        assert err["param"].startswith(param)


def test_other_request_errors(srv, images):
    assert "not valid JSON" in error_of(httpx.post(srv.url + "/v1/chat/completions", content=b"{nope", timeout=30), 400)
    assert "does not exist" in error_of(post(srv, chat(data_url(images[0])) | {"model": "gpt-4"}), 404)
    two = chat(data_url(images[0]))
    two["messages"][0]["content"].insert(0, {"type": "image_url", "image_url": {"url": data_url(images[1])}})
    assert "--limit-mm-per-prompt" in error_of(post(srv, two), 400)
    assert "--max-model-len" in error_of(post(srv, chat(None, text="a " * 5000)), 400)
    assert error_of(httpx.get(srv.url + "/v1/nothing", timeout=30), 404)


def test_openai_client_raises_typed_errors(client, images):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=str(tiny_vl()), messages=chat(data_url(images[0]))["messages"],
                                       extra_body={"bogus_param": 1})
    assert "bogus_param" in e.value.message


# --------------------------------------------------------------------------- lifecycle
def test_every_json_image_part_type_gives_the_same_answer(client, images):
    """The server accepts each image part type of the one normalizer (inputs/messages.py) that
    JSON can carry; greedy output does not depend on how the image was wrapped."""
    url = data_url(images[0])
    answers = []
    for part in ({"type": "image_url", "image_url": {"url": url}}, {"type": "image_url", "image_url": url},
                 {"type": "input_image", "image_url": url}, {"type": "image", "image": url}):
        r = client.chat.completions.create(model=str(tiny_vl()), max_tokens=6, temperature=0,
                                           messages=[{"role": "user", "content": [part, {"type": "text", "text": "OCR:"}]}],
                                           extra_body={"ignore_eos": True})
        answers.append((r.choices[0].message.content, r.usage.prompt_tokens))
    assert len(set(answers)) == 1 and answers[0][1] > 10, answers


def test_disconnect_frees_kv_blocks(srv, images):
    assert srv.wait_metric("fastdeploy_ext:kv_blocks_used", 0) == 0
    with httpx.stream("POST", srv.url + "/v1/chat/completions", timeout=60,
                      json=chat(data_url(images[0]), max_tokens=4000, stream=True, **GREEDY, **NO_GUARD)) as r:
        lines = r.iter_lines()
        for _ in range(5):
            next(lines)
        assert srv.metric("fastdeploy_ext:kv_blocks_used") > 0
        assert srv.metric("fastdeploy:num_requests_running") == 1
    # the client closed the stream: the request is aborted and its blocks come back
    assert srv.wait_metric("fastdeploy_ext:kv_blocks_used", 0) == 0
    assert srv.wait_metric("fastdeploy:num_requests_running", 0) == 0
    assert srv.metric("fastdeploy:gpu_cache_usage_perc") == 0

    # the same for a non-streaming request whose client gives up
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(srv.url + "/v1/chat/completions", json=chat(data_url(images[0]), max_tokens=4000, **GREEDY, **NO_GUARD),
                   timeout=httpx.Timeout(60, read=1.0))
    assert srv.wait_metric("fastdeploy_ext:kv_blocks_used", 0) == 0
    assert srv.wait_metric("fastdeploy_ext:server_requests_in_flight", 0) == 0


def test_metrics_on_both_ports(srv, images):
    post(srv, chat(data_url(images[0]), max_tokens=2, **GREEDY))
    for port in (srv.port, srv.metrics_port):
        text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
        for name in ("fastdeploy:num_requests_running", "fastdeploy:num_requests_waiting",
                     "fastdeploy:time_to_first_token_seconds_bucket", "fastdeploy:e2e_request_latency_seconds_count",
                     "fastdeploy:time_per_output_token_seconds_count", "fastdeploy:gpu_cache_usage_perc",
                     "fastdeploy_ext:preprocess_time_seconds_count", "fastdeploy_ext:vision_encode_time_seconds_count",
                     "fastdeploy_ext:decoder_graph_hits_total", "fastdeploy_ext:decoder_graph_fallbacks_total",
                     "fastdeploy_ext:encoder_graph_hits_total", "fastdeploy_ext:encoder_graph_fallbacks_total",
                     'fastdeploy_ext:requests_total{status="bad_request"}'):
            assert name in text, name
    assert srv.metric("fastdeploy:request_success_total") > 0
    assert httpx.get(f"http://127.0.0.1:{srv.metrics_port}/v1/models", timeout=10).status_code == 404
    # the encoder cache: max(--max-num-batched-tokens 16384, --max-model-len 4096) rows, empty
    # between requests, every image encoded into it once
    assert srv.metric("fastdeploy_ext:encoder_cache_rows_total") == 16384
    assert srv.wait_metric("fastdeploy_ext:encoder_cache_rows_used", 0) == 0
    assert srv.metric("fastdeploy_ext:encoder_items_encoded_total") >= 1


def test_soak_1000_short_requests_at_16_concurrency(srv, images):
    before = srv.metric("fastdeploy:request_success_total")
    bodies = [chat(data_url(images[i % len(images)]), max_tokens=2, **GREEDY) for i in range(1000)]
    results: list = [None] * len(bodies)

    async def run():
        sem = asyncio.Semaphore(16)
        async with httpx.AsyncClient(timeout=120, limits=httpx.Limits(max_connections=16)) as c:
            async def one(i):
                async with sem:
                    r = await c.post(srv.url + "/v1/chat/completions", json=bodies[i])
                    results[i] = (r.status_code, r.json())
            await asyncio.gather(*[one(i) for i in range(len(bodies))])
    asyncio.run(run())
    assert all(st == 200 for st, _ in results), [r for r in results if r[0] != 200][:3]
    assert all(b["usage"]["completion_tokens"] == 2 and b["choices"][0]["finish_reason"] == "length"
               for _, b in results)
    assert len({b["id"] for _, b in results}) == 1000
    assert srv.metric("fastdeploy:request_success_total") == before + 1000
    assert srv.wait_metric("fastdeploy_ext:kv_blocks_used", 0) == 0


# --------------------------------------------------------------------------- limits server
@pytest.fixture(scope="module")
def strict(tmp_path_factory):
    """Limits from a --config file (the command line overrides one of its keys)."""
    cfg = tmp_path_factory.mktemp("cfg") / "serve.yaml"
    cfg.write_text("api_key: sk-test\nmax-concurrency: 5\nrequest_timeout: 2\nmax_request_body_bytes: 100000\n"
                   "max_model_len: 4608\n")
    s = ServerProc("--config", str(cfg), "--max-concurrency", "2", "--allow-private-media-fetch")
    try:
        yield s.wait_healthy()
    finally:
        s.stop()


KEY = {"Authorization": "Bearer sk-test"}


def test_api_key(strict, images):
    body = chat(data_url(images[2]), max_tokens=2, **GREEDY)
    assert "API key" in error_of(post(strict, body), 401)
    assert error_of(post(strict, body, headers={"Authorization": "Bearer wrong"}), 401)
    assert post(strict, body, headers=KEY).status_code == 200
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=strict.url + "/v1", api_key="wrong", max_retries=0).models.list()
    assert openai.OpenAI(base_url=strict.url + "/v1", api_key="sk-test", max_retries=0).models.list().data
    assert httpx.get(strict.url + "/health").status_code == 200          # probes need no key


def test_body_limit_413(strict, images):
    big = chat(data_url(png_bytes(300, 300)), max_tokens=2)            # ~360 KB of base64 > 100000
    assert "100000 bytes" in error_of(post(strict, big, headers=KEY), 413)

    def chunks():                                                      # no Content-Length: counted
        for _ in range(30):
            yield b"x" * 10000
    r = httpx.post(strict.url + "/v1/chat/completions", content=chunks(), headers=KEY, timeout=30)
    assert error_of(r, 413)
    assert post(strict, chat(data_url(images[2]), max_tokens=2), headers=KEY).status_code == 200


def test_fetched_image_over_cap_is_400(strict, host):
    assert "could not be fetched" in error_of(post(strict, chat(host.url + "/huge.png", max_tokens=2),
                                                   headers=KEY), 400)
    assert "body is larger than the 100000 byte limit" in strict.output


def test_queue_full_429_and_timeout_504(strict, host, images):
    """Two requests held in their image fetch fill --max-concurrency 2: the third gets 429; the
    held ones pass --request-timeout 2 and get 504."""
    held: list = []
    threads = [threading.Thread(target=lambda: held.append(post(strict, chat(host.url + "/hold.png", max_tokens=2),
                                                                headers=KEY))) for _ in range(2)]
    for t in threads:
        t.start()
    for _ in range(2):
        assert host.held.acquire(timeout=60)           # both requests are inside their fetch
    assert "--max-concurrency 2" in error_of(post(strict, chat(data_url(images[2]), max_tokens=2), headers=KEY), 429)
    with pytest.raises(openai.RateLimitError):
        openai.OpenAI(base_url=strict.url + "/v1", api_key="sk-test", max_retries=0).chat.completions.create(
            model=str(tiny_vl()), messages=chat(data_url(images[2]))["messages"], max_tokens=2)
    for t in threads:
        t.join(60)
    assert [r.status_code for r in held] == [504, 504]
    assert "request timed out" in held[0].json()["error"]["message"]
    # a generation longer than the timeout: 504 and its KV blocks are freed
    long = post(strict, chat(data_url(images[2]), max_tokens=4500, **GREEDY, **NO_GUARD), headers=KEY)
    assert "request timed out after 2 s" in error_of(long, 504)
    assert strict.wait_metric("fastdeploy_ext:kv_blocks_used", 0) == 0
    assert post(strict, chat(data_url(images[2]), max_tokens=2), headers=KEY).status_code == 200


# --------------------------------------------------------------------------- drain
def test_sigterm_drains_then_exits_zero(host, images):
    s = ServerProc("--max-model-len", "1024", "--media-fetch-timeout", "60",
                   "--allow-private-media-fetch").wait_healthy()
    try:
        held: list = []
        t_held = threading.Thread(target=lambda: held.append(post(s, chat(host.url + "/hold.png", max_tokens=3,
                                                                           **GREEDY))))
        streamed: list = []
        first_chunk = threading.Event()

        def stream():
            with httpx.stream("POST", s.url + "/v1/chat/completions", timeout=120,
                              json=chat(data_url(images[1]), max_tokens=200, stream=True, **GREEDY,
                                        **NO_GUARD)) as r:
                for line in r.iter_lines():
                    if line:
                        streamed.append(line)
                        first_chunk.set()
        host.release.clear()
        t_held.start()
        assert host.held.acquire(timeout=60)           # in flight (fetching its image)
        t_stream = threading.Thread(target=stream)
        t_stream.start()
        assert first_chunk.wait(60)                    # in flight (generating)
        s.proc.send_signal(signal.SIGTERM)
        # new requests are refused while the held one keeps the server draining
        for _ in range(200):
            r = post(s, chat(data_url(images[0]), max_tokens=2))
            if r.status_code == 503:
                break
        assert "draining" in error_of(r, 503)
        assert httpx.get(s.url + "/health").status_code == 503
        host.release.set()
        t_held.join(120)
        t_stream.join(120)
        assert s.proc.wait(120) == 0, s.output
        assert held[0].status_code == 200 and held[0].json()["usage"]["completion_tokens"] == 3
        assert streamed[-1] == "data: [DONE]"
        finish = [json.loads(x[6:])["choices"][0]["finish_reason"] for x in streamed[:-1]]
        assert finish[-1] == "length"
        assert "drained; exiting" in s.output
    finally:
        host.release.set()
        s.stop()
