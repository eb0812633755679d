"""Bounded work before admission: what one client can make the server allocate or hold.

Unit part: the engine's input checks run before the work they bound (the tokenizer sees a
bounded prefix of a huge text or none of it; an oversized min_pixels never builds a processor;
an image over the patch cap is refused from its header); each with its check broken on purpose.
Server part: the REAL server on loopback: huge min_pixels and huge text answered 400 with the
server's RSS within a bound and /health answering; images counted before any fetch; the bytes
held across requests capped (429); half-sent headers and slow bodies closed (408)."""
from __future__ import annotations

import json
import socket
import subprocess
import sys
import threading

import httpx
import pytest

from fastdeploy_ext.engine import input_processor as ip
from fastdeploy_ext.engine.errors import InvalidRequest
from fastdeploy_ext.engine.input_processor import InputLimits, InputProcessor, bounded_token_count
from fastdeploy_ext.inputs.images import ImageInputError
from fastdeploy_ext.models.paddleocr_vl.processor import ImageProcessor, PreprocessorConfig

from .engine_fakes import FakePromptBuilder, FakeTokenizer
from .server_harness import ImageHost, ServerProc, chat, png_bytes, ref_images

PP = PreprocessorConfig(min_pixels=28 * 28, max_pixels=28 * 28 * 64)


class RecordingTokenizer(FakeTokenizer):
    def __init__(self):
        self.seen: list[int] = []          # the length of every text given to encode

    def encode(self, text):
        self.seen.append(len(text))
        return super().encode(text)


class RecordingImageProcessor(ImageProcessor):
    built: list = []

    def __init__(self, cfg=None):
        super().__init__(cfg)
        RecordingImageProcessor.built.append(self.cfg)


def processor(max_model_len=1000, max_patches=4096):
    builder = FakePromptBuilder()
    builder.tokenizer = RecordingTokenizer()
    RecordingImageProcessor.built = []
    return InputProcessor(builder, RecordingImageProcessor(PP), InputLimits(1, max_patches, max_model_len))


def text_prompt(text, **kw):
    return {"messages": [{"role": "user", "content": text}], **kw}


# --------------------------------------------------------------------------- text
def test_huge_text_is_refused_on_its_length_without_tokenizing():
    p = processor()
    with pytest.raises(InvalidRequest, match=r"16000000 bytes, more than --max-model-len 1000 tokens"):
        p.process(text_prompt("x" * 16_000_000))
    assert p.builder.tokenizer.seen == []


def test_huge_text_byte_check_broken_on_purpose_reaches_the_tokenizer(monkeypatch):
    monkeypatch.setattr(ip, "MAX_TEXT_BYTES_PER_TOKEN", 10 ** 6)
    p = processor()
    with pytest.raises(InvalidRequest, match="more than 1000 tokens"):
        p.process(text_prompt("x" * 2_000_000))
    assert p.builder.tokenizer.seen and max(p.builder.tokenizer.seen) < 20_000   # still only a prefix


def test_text_within_the_byte_bound_is_tokenized_only_as_far_as_the_limit():
    p = processor(max_model_len=1000)
    text = "word " * 6000                   # 30000 bytes < 32000: passes the length check, 30000 tokens
    with pytest.raises(InvalidRequest, match="more than 1000 tokens; --max-model-len 1000"):
        p.process(text_prompt(text))
    seen = p.builder.tokenizer.seen
    assert seen == [4004] and sum(seen) < len(text) / 7       # one prefix cut before a space, not 30000


def test_bounded_token_count_is_exact_under_the_limit_and_breaks_without_the_prefixes(monkeypatch):
    tok = RecordingTokenizer()
    assert bounded_token_count(tok.encode, "ab cd " * 300, 5000) == 1800 and tok.seen == [1800]
    tok.seen.clear()
    assert bounded_token_count(tok.encode, "ab cd " * 300, 100) > 100 and max(tok.seen) <= 404
    # the prefix cut is what bounds it: without it the whole text reaches the tokenizer
    monkeypatch.setattr(ip, "bounded_token_count", lambda encode, text, limit: len(encode(text)))
    p = processor(max_model_len=1000)
    with pytest.raises(InvalidRequest):
        p.process(text_prompt("word " * 6000))
    assert p.builder.tokenizer.seen == [30000]


def test_text_under_the_limit_is_built_as_before():
    p = processor(max_model_len=1000)
    out = p.process(text_prompt("hello world"))
    assert out.prompt_token_ids[1:12] == FakeTokenizer().encode("user: hello")
    assert p.builder.tokenizer.seen == []        # 11 bytes cannot be more than 1000 tokens: no extra pass
    with pytest.raises(InvalidRequest, match="more than 1000 tokens"):
        p.process(text_prompt("word " * 250))    # 1250 bytes could be: counted first (1250 tokens here)
    assert p.builder.tokenizer.seen == [1250]


# --------------------------------------------------------------------------- pixels
@pytest.mark.parametrize("kwargs,needle", [
    ({"min_pixels": 50_000_000}, "mm_processor_kwargs.min_pixels = 50000000 is above this server's limit of 784000"),
    ({"min_pixels": 400_000_000}, "min_pixels = 400000000"),
    ({"max_pixels": 400_000_000}, "max_pixels = 400000000"),
    ({"min_pixels": 0}, "positive integer"),
    ({"max_pixels": 5000, "min_pixels": 6000}, "min_pixels (6000) must be <= max_pixels (5000)"),
    ({"size": 3}, "unsupported ['size']"),
])
def test_mm_processor_kwargs_are_checked_before_any_image_work(kwargs, needle):
    p = processor()                          # max_model_len 1000: 1000 tokens of 28x28 = 784000 pixels
    with pytest.raises(InvalidRequest) as e:
        p.process({"messages": [{"role": "user", "content": [{"type": "image", "image": png_bytes(40, 40)},
                                                             {"type": "text", "text": "OCR:"}]}],
                   "mm_processor_kwargs": kwargs})
    assert needle in str(e.value)
    assert RecordingImageProcessor.built == [PP]            # no processor was built for the request


def test_mm_processor_kwargs_cap_broken_on_purpose_builds_the_upscaling_processor(monkeypatch):
    monkeypatch.setattr(ImageProcessor, "request_pixel_cap", lambda self, max_patches, max_model_len: 10 ** 12)
    p = processor()
    proc = p.processor_for({"min_pixels": 50_000_000})
    assert proc.cfg.min_pixels == 50_000_000                # what the cap stops: a 50 MP upscale


def test_a_request_min_pixels_alone_lifts_max_pixels_with_it():
    proc = processor().processor_for({"min_pixels": 28 * 28 * 100})
    assert (proc.cfg.min_pixels, proc.cfg.max_pixels) == (78400, 78400)


def test_patch_cap_is_checked_from_the_header_before_decoding():
    big = png_bytes(400, 400)
    proc = ImageProcessor(PreprocessorConfig(min_pixels=28 * 28, max_pixels=400 * 400))
    with pytest.raises(ImageInputError, match="above --max-encoder-patches 100"):
        proc.preprocess(big, max_patches=100)
    assert proc.preprocess(big).num_patches > 100          # without the cap it is processed


def test_image_count_is_checked_before_decoding_any():
    p = processor()
    parts = [{"type": "image", "image": b"not decoded"} for _ in range(40)]
    with pytest.raises(InvalidRequest, match="40 images in one prompt; --limit-mm-per-prompt allows 1"):
        p.process({"messages": [{"role": "user", "content": parts}]})


# --------------------------------------------------------------------------- the real server
MAX_BODY, INFLIGHT = 17_000_000, 18_000_000
HOLD_PAD = 16_500_000


@pytest.fixture(scope="module")
def host():
    h = ImageHost(ref_images()[0])
    yield h
    h.close()


@pytest.fixture(scope="module")
def big_host():
    h = ImageHost(png_bytes(800, 800, seed=3))      # ~1.9 MB of noise
    yield h
    h.close()


@pytest.fixture(scope="module")
def srv():
    s = ServerProc("--max-model-len", "2048", "--max-request-body-bytes", str(MAX_BODY),
                   "--max-inflight-body-bytes", str(INFLIGHT), "--header-timeout", "1", "--body-timeout", "1",
                   "--allow-private-media-fetch", "--allowed-media-domains", "127.0.0.1",
                   "--media-fetch-timeout", "60")
    try:
        yield s.wait_healthy()
    finally:
        s.stop()


def rss(srv) -> int:
    with open(f"/proc/{srv.proc.pid}/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))


def post(srv, body, **kw) -> httpx.Response:
    return httpx.post(srv.url + "/v1/chat/completions", json=body, timeout=120, **kw)


def error_of(r, status) -> str:
    assert r.status_code == status, r.text
    return r.json()["error"]["message"]


def health(srv) -> int:
    return httpx.get(srv.url + "/health", timeout=10).status_code


def test_huge_min_pixels_is_400_with_no_allocation(srv, host):
    before = rss(srv)
    for kwargs in ({"min_pixels": 50_000_000}, {"min_pixels": 400_000_000}, {"max_pixels": 400_000_000}):
        msg = error_of(post(srv, chat(host.url + "/img.png", max_tokens=2, mm_processor_kwargs=kwargs)), 400)
        assert f"{next(iter(kwargs))} = {next(iter(kwargs.values()))} is above this server's limit" in msg
    assert host.hits == []                                  # refused before the image was fetched
    assert rss(srv) - before < 50 << 20                     # a 5e7 upscale alone is +1 GB
    assert health(srv) == 200


def test_huge_text_is_400_naming_max_model_len_with_bounded_memory(srv):
    before = rss(srv)
    msg = error_of(post(srv, chat(None, text="a" * 16_000_000, max_tokens=2)), 400)
    assert "16000000 bytes, more than --max-model-len 2048 tokens" in msg
    # tokenizing it whole cost 5.3 GB; parsing the JSON body keeps a few 16 MB copies at most
    assert rss(srv) - before < 300 << 20
    msg = error_of(post(srv, chat(None, text="word " * 12000, max_tokens=2)), 400)   # 60 KB: tokenized, bounded
    assert "more than 2048 tokens; --max-model-len 2048" in msg
    assert health(srv) == 200


def test_images_are_counted_before_any_is_fetched(srv, host):
    body = chat(None, max_tokens=2)
    body["messages"][0]["content"][:0] = [{"type": "image_url", "image_url": {"url": f"{host.url}/img.png?{i}"}}
                                          for i in range(40)]
    assert "40 images in one prompt; --limit-mm-per-prompt allows 1" in error_of(post(srv, body), 400)
    assert host.hits == []


def test_allowed_media_domains_on_every_hop(srv, host):
    port = host.url.rsplit(":", 1)[1]
    assert "could not be fetched" in error_of(post(srv, chat(f"http://localhost:{port}/img.png")), 400)
    redirect = f"{host.url}/redirect?to=http://localhost:{port}/img.png"
    assert "could not be fetched" in error_of(post(srv, chat(redirect)), 400)
    assert host.hits == ["/redirect?to=http://localhost:" + port + "/img.png"]     # the first hop only
    refused = "host 'localhost' is not in --allowed-media-domains (redirect 1"
    assert refused in srv.wait_output(refused)
    ok = post(srv, chat(host.url + "/img.png", max_tokens=2))
    assert ok.status_code == 200 and host.hits[-1] == "/img.png"
    host.hits.clear()


def _raw(srv, data: bytes) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", srv.port), timeout=30)
    s.sendall(data)
    return s


def _read_all(s: socket.socket) -> bytes:
    out = b""
    while True:
        chunk = s.recv(65536)
        if not chunk:
            return out
        out += chunk


def test_bytes_in_flight_are_capped_across_requests(srv, host, big_host):
    """One request holds 16.5 MB (its body, while its image fetch waits): a second declaring as
    much gets 429 before sending a byte of body; a small one whose image would pass the cap gets
    429 from its fetch; once the first is done both fit again."""
    held: list = []
    body = json.dumps(chat(host.url + "/hold.png", max_tokens=2)).encode()
    body += b" " * (HOLD_PAD - len(body))
    host.release.clear()
    t = threading.Thread(target=lambda: held.append(httpx.post(srv.url + "/v1/chat/completions", content=body,
                                                               timeout=120)))
    t.start()
    try:
        assert host.held.acquire(timeout=60)                # holding its 16.5 MB
        s = _raw(srv, b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                      b"Content-Length: %d\r\n\r\n" % HOLD_PAD)
        answer = _read_all(s).decode()
        s.close()
        assert answer.startswith("HTTP/1.1 429") and f"--max-inflight-body-bytes {INFLIGHT}" in answer
        msg = error_of(post(srv, chat(big_host.url + "/img.png", max_tokens=2)), 429)
        assert "--max-inflight-body-bytes" in msg
        assert big_host.hits == ["/img.png"]                # counted while it streamed in
    finally:
        host.release.set()
        t.join(120)
    assert held[0].status_code == 200, held[0].text
    assert post(srv, chat(big_host.url + "/img.png", max_tokens=2)).status_code == 200
    host.hits.clear()


def test_half_sent_headers_and_slow_bodies_are_closed(srv):
    partial = [_raw(srv, b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-") for _ in range(40)]
    silent = [_raw(srv, b"") for _ in range(5)]
    slow = _raw(srv, b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\n{\"mo")
    assert health(srv) == 200                               # while they are open
    for s in partial + silent:
        answer = _read_all(s)                               # the server closes it (EOF), 408 first
        assert answer.startswith(b"HTTP/1.1 408") and b"--header-timeout" in answer
        s.close()
    answer = _read_all(slow)
    assert answer.startswith(b"HTTP/1.1 408") and b"--body-timeout" in answer
    slow.close()
    assert health(srv) == 200


def test_keep_alive_connection_times_out_its_next_request_headers(srv):
    """After one complete request on a kept-alive connection, a half-sent next one is closed too."""
    s = _raw(srv, b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
    first = b""
    while b'{"status":"ok"}' not in first:              # the whole first response (it may come in parts)
        chunk = s.recv(65536)
        assert chunk, first
        first += chunk
    assert first.startswith(b"HTTP/1.1 200")
    s.sendall(b"GET /health HTTP/1.1\r\nHo")
    assert _read_all(s).startswith(b"HTTP/1.1 408")
    s.close()


def test_help_states_the_default_host_and_the_new_flags():
    out = subprocess.run([sys.executable, "-m", "fastdeploy_ext.entrypoints.openai.api_server", "--help"],
                         capture_output=True, text=True, timeout=120).stdout
    flat = " ".join(out.split())
    assert "the default 0.0.0.0 is every interface of the machine" in flat
    for flag in ("--max-inflight-body-bytes", "--header-timeout", "--body-timeout", "--media-fetch {on,off}",
                 "--allowed-media-domains", "--allow-private-media-fetch"):
        assert flag in flat, flag


def test_lone_surrogate_is_refused_before_the_tokenizer():
    p = processor()
    with pytest.raises(InvalidRequest, match=r"lone surrogate '\\ud800' at character 4"):
        p.process(text_prompt("abc \ud800"))
    assert p.builder.tokenizer.seen == []


def test_inflight_ledger_counts_across_requests_and_gives_back():
    from fastdeploy_ext.entrypoints.openai import inflight
    from fastdeploy_ext.entrypoints.openai.errors import APIError
    budget = inflight.ByteBudget(100)
    a, b = inflight.Ledger(budget), inflight.Ledger(budget)
    a.take(60)
    b.take(40)
    with pytest.raises(APIError) as e:
        b.take(1)                                           # 101 > 100 across the two requests
    assert e.value.status == 429 and "--max-inflight-body-bytes 100" in e.value.message
    assert (budget.used, a.held, b.held) == (100, 60, 40)
    a.release()
    b.take(60)                                              # a's bytes came back
    assert budget.used == 100
    inflight.charge(10 ** 9)                                # outside a request: nothing to count
    token = inflight.current_ledger.set(b)
    try:
        with pytest.raises(APIError):
            inflight.charge(1)
    finally:
        inflight.current_ledger.reset(token)
