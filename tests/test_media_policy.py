"""The image fetch policy (server-side request forgery) and local media files.

Unit part: `MediaFetcher` with a stubbed resolver and a recording httpx transport, so that
private, link-local and multicast targets are checked without any traffic leaving loopback
(the transport records every request: "no connection attempted" is an empty record).
Server part: the REAL server on loopback with the DEFAULT policy: image URLs naming the
loopback image host in every spelling, the server's own /metrics and a FIFO under
--allowed-local-media-path are refused with one message, the host sees no request, /health
keeps answering."""
from __future__ import annotations

import asyncio
import ipaddress
import os
import threading

import httpx
import pytest

from fastdeploy_ext.entrypoints.openai import media
from fastdeploy_ext.entrypoints.openai.errors import APIError
from fastdeploy_ext.entrypoints.openai.media import MediaFetcher, MediaPolicy, address_refusal, parse_ip_literal

from .server_harness import ImageHost, ServerProc, chat, ref_images

UNIFORM = "image 0: the image URL could not be fetched"
PUBLIC = "93.184.216.34"


class Recorder(httpx.AsyncBaseTransport):
    """Answers from a table of url -> (status, headers, body); records every request."""

    def __init__(self, routes: dict[str, tuple[int, dict, bytes]] | None = None):
        self.routes = routes or {}
        self.requests: list[httpx.Request] = []

    async def handle_async_request(self, request):
        self.requests.append(request)
        status, headers, body = self.routes.get(str(request.url), (404, {}, b""))
        return httpx.Response(status, headers=headers, stream=httpx.ByteStream(body))


def stub_resolver(table: dict[str, list[str]], calls: list | None = None):
    async def resolve(host, port):
        if calls is not None:
            calls.append(host)
        if host not in table:
            raise OSError(f"stub: no such host {host}")
        return list(table[host])
    return resolve


def fetcher(resolver=None, transport=None, **policy) -> MediaFetcher:
    return MediaFetcher(MediaPolicy(max_bytes=1 << 20, fetch_timeout=5, allowed_local_path=None, **policy),
                        resolver=resolver or stub_resolver({}), transport=transport or Recorder())


def fetch(f: MediaFetcher, url: str):
    return asyncio.run(f.fetch(url, "image 0"))


def refused(f: MediaFetcher, url: str) -> str:
    with pytest.raises(APIError) as e:
        fetch(f, url)
    assert e.value.status == 400 and e.value.code == "image_fetch_failed"
    return e.value.message


PNG = ref_images()[0]

# name -> what the stub resolver answers
NAMES = {"localhost": ["127.0.0.1"], "intranet.example": ["10.1.2.3"], "home.example": ["192.168.0.10"],
         "corp.example": ["172.16.5.5"], "metadata.example": ["169.254.169.254"], "ula.example": ["fd00::1"],
         "ll6.example": ["fe80::1"], "mcast.example": ["224.0.0.251"], "mcast6.example": ["ff02::1"],
         "cgnat.example": ["100.64.1.1"], "zero.example": ["0.0.0.0"], "mixed.example": [PUBLIC, "10.0.0.1"],
         "images.example": [PUBLIC]}

BLOCKED_URLS = [
    "http://127.0.0.1/a.png", "http://localhost/a.png", "http://2130706433/a.png", "http://0x7f.1/a.png",
    "http://0177.0.0.1/a.png", "http://127.1/a.png", "http://0.0.0.0/a.png", "http://0/a.png",
    "http://[::1]/a.png", "http://[::ffff:127.0.0.1]/a.png", "http://[::]/a.png", "http://10.0.0.1/a.png",
    "http://intranet.example/a.png", "http://home.example/a.png", "http://corp.example/a.png",
    "http://metadata.example/latest/meta-data/", "http://169.254.169.254/", "http://ula.example/a.png",
    "http://ll6.example/a.png", "http://mcast.example/a.png", "http://mcast6.example/a.png",
    "http://224.0.0.1/a.png", "http://cgnat.example/a.png", "http://zero.example/a.png",
    "http://mixed.example/a.png", "http://240.0.0.1/a.png", "http://255.255.255.255/a.png",
    "https://LOCALHOST./a.png", "http://no-such-host.example/a.png",
]


@pytest.mark.parametrize("url", BLOCKED_URLS)
def test_inside_addresses_are_refused_before_any_connection(url):
    transport = Recorder()
    f = fetcher(stub_resolver(NAMES), transport)
    assert refused(f, url) == UNIFORM
    assert transport.requests == []


def test_ip_literal_forms():
    for spelling in ("2130706433", "0x7f.1", "0177.0.0.1", "127.1", "0x7f000001", "[::ffff:7f00:1]"):
        ip = parse_ip_literal(spelling)
        assert ip is not None and address_refusal(ip, False) == "loopback address", spelling
    assert parse_ip_literal("images.example") is None and parse_ip_literal("cafe") is None
    assert address_refusal(ipaddress.ip_address(PUBLIC), False) is None
    # opting in allows the inside unicast ranges, never multicast / unspecified / reserved
    for addr, verdict in (("127.0.0.1", None), ("10.0.0.1", None), ("169.254.1.1", None), ("fd00::1", None),
                          ("224.0.0.1", "multicast address"), ("0.0.0.0", "unspecified address"),
                          ("0.1.2.3", "unspecified address"), ("240.0.0.1", "reserved address")):
        assert address_refusal(ipaddress.ip_address(addr), True) == verdict, addr


def test_public_host_is_fetched_from_the_checked_address():
    """The request goes to the address that was checked (no second DNS lookup can change it),
    with the name in the Host header (and the SNI for https)."""
    transport = Recorder({f"http://{PUBLIC}:8080/p.png": (200, {"content-type": "image/png"}, PNG),
                          f"https://{PUBLIC}/p.png": (200, {}, PNG)})
    calls: list = []
    f = fetcher(stub_resolver(NAMES, calls), transport)
    assert fetch(f, "http://images.example:8080/p.png") == PNG
    assert fetch(f, "https://images.example/p.png") == PNG
    (r1, r2) = transport.requests
    assert r1.url.host == PUBLIC and r1.headers["host"] == "images.example:8080"
    assert r2.headers["host"] == "images.example" and r2.extensions["sni_hostname"] == "images.example"
    assert calls == ["images.example", "images.example"]       # one lookup per hop, the one checked


def test_every_redirect_hop_is_checked():
    transport = Recorder({
        f"http://{PUBLIC}/to-inside": (302, {"location": "http://intranet.example/secret"}, b""),
        f"http://{PUBLIC}/to-literal": (301, {"location": "http://2130706433:8000/metrics"}, b""),
        f"http://{PUBLIC}/to-ftp": (302, {"location": "ftp://images.example/x"}, b""),
        f"http://{PUBLIC}/hop": (307, {"location": "/final.png"}, b""),
        f"http://{PUBLIC}/final.png": (200, {}, PNG),
        f"http://{PUBLIC}/loop": (302, {"location": "/loop"}, b"")})
    f = fetcher(stub_resolver(NAMES), transport)
    for path in ("to-inside", "to-literal", "to-ftp"):
        n = len(transport.requests)
        assert refused(f, f"http://images.example/{path}") == UNIFORM
        assert len(transport.requests) == n + 1               # the inside hop was never requested
    assert fetch(f, "http://images.example/hop") == PNG        # a relative redirect on the same host
    n = len(transport.requests)
    assert refused(f, "http://images.example/loop") == UNIFORM
    assert len(transport.requests) - n == 6                     # max_redirects 5: six requests, then stop


def test_allowed_media_domains_restrict_every_hop():
    transport = Recorder({f"http://{PUBLIC}/ok.png": (200, {}, PNG),
                          f"http://{PUBLIC}/away": (302, {"location": "http://other.example/ok.png"}, b"")})
    calls: list = []
    f = fetcher(stub_resolver(NAMES | {"other.example": [PUBLIC]}, calls), transport,
                allowed_domains=("images.example",))
    assert fetch(f, "http://Images.Example/ok.png") == PNG
    assert refused(f, "http://other.example/ok.png") == UNIFORM
    assert refused(f, "http://images.example/away") == UNIFORM
    assert "other.example" not in calls                         # refused on the name, never resolved


def test_every_fetch_failure_has_the_same_message(caplog):
    """HTTP statuses, not-an-image bodies, oversized bodies, connection errors and policy
    refusals are told apart in the log only."""
    class Failing(Recorder):
        async def handle_async_request(self, request):
            if request.url.path == "/down":
                raise httpx.ConnectError("connection refused")
            if request.url.path == "/slow":
                raise httpx.ReadTimeout("slow")
            return await super().handle_async_request(request)
    transport = Failing({f"http://{PUBLIC}/text": (200, {"content-type": "text/plain"}, b"# HELP metrics"),
                         f"http://{PUBLIC}/500": (500, {}, b"oops"),
                         f"http://{PUBLIC}/big": (200, {}, b"\x89PNG" + b"\0" * (2 << 20)),
                         f"http://{PUBLIC}/big-declared": (200, {"content-length": str(9 << 20)}, PNG)})
    f = fetcher(stub_resolver(NAMES), transport)
    cases = {"text": "is not an image", "500": "HTTP 500", "big": "larger than the 1048576 byte limit",
             "big-declared": "Content-Length 9437184", "down": "ConnectError", "slow": "timed out after 5 s"}
    with caplog.at_level("WARNING", logger="fastdeploy_ext.server"):
        messages = {refused(f, f"http://images.example/{p}") for p in cases}
        messages.add(refused(f, "http://127.0.0.1/x"))
    assert messages == {UNIFORM}
    for why in [*cases.values(), "a loopback address"]:
        assert why in caplog.text


def test_media_fetch_off():
    transport = Recorder()
    f = fetcher(stub_resolver(NAMES), transport, fetch_enabled=False)
    with pytest.raises(APIError) as e:
        fetch(f, "http://images.example/a.png")
    assert "--media-fetch off" in e.value.message and transport.requests == []


def test_guard_broken_on_purpose_lets_the_inside_request_through(monkeypatch):
    """The address check is what stops an inside URL: without it the same URL is requested."""
    monkeypatch.setattr(media, "address_refusal", lambda ip, allow_private: None)
    transport = Recorder({"http://10.1.2.3/a.png": (200, {}, PNG)})
    assert fetch(fetcher(stub_resolver(NAMES), transport), "http://intranet.example/a.png") == PNG
    assert [str(r.url) for r in transport.requests] == ["http://10.1.2.3/a.png"]


# --------------------------------------------------------------------------- the real server
@pytest.fixture(scope="module")
def host():
    h = ImageHost(PNG)
    yield h
    h.close()


@pytest.fixture(scope="module")
def media_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("media")
    (d / "page.png").write_bytes(PNG)
    os.mkfifo(d / "pipe.png")
    os.mkdir(d / "sub.png")
    return d


@pytest.fixture(scope="module")
def srv(media_dir):
    s = ServerProc("--max-model-len", "1024", "--allowed-local-media-path", str(media_dir),
                   "--media-fetch-timeout", "5")
    try:
        yield s.wait_healthy()
    finally:
        s.proc.kill()       # a FIFO test that failed would hold a worker thread forever
        s.proc.wait()


def post(srv, body) -> httpx.Response:
    return httpx.post(srv.url + "/v1/chat/completions", json=body, timeout=60)


def test_server_refuses_loopback_in_every_spelling(srv, host):
    port = host.url.rsplit(":", 1)[1]
    urls = [f"http://{h}:{port}/img.png" for h in
            ("127.0.0.1", "localhost", "2130706433", "0x7f.1", "0177.0.0.1", "127.1", "[::1]",
             "[::ffff:127.0.0.1]", "0.0.0.0")]
    urls += [f"{srv.url}/metrics", f"{srv.url}/health", f"{host.url}/redirect?to=http://127.0.0.1:{port}/img.png",
             f"http://127.0.0.1:{port}/missing.png", "http://127.0.0.1:1/closed-port.png"]
    answers = set()
    for url in urls:
        r = post(srv, chat(url, max_tokens=2))
        assert r.status_code == 400, (url, r.text)
        answers.add(r.json()["error"]["message"])
    assert answers == {UNIFORM}
    assert host.hits == []                                     # not one request reached the host
    assert "a loopback address (refused" in srv.wait_output("a loopback address (refused")
    assert httpx.get(srv.url + "/health").status_code == 200


def test_fifo_and_directory_are_refused_and_health_answers(srv, media_dir):
    results: dict = {}

    def ask(name):
        results[name] = post(srv, chat(str(media_dir / name), max_tokens=2))
    threads = [threading.Thread(target=ask, args=(n,)) for n in ("pipe.png", "sub.png")]
    for t in threads:
        t.start()
    assert httpx.get(srv.url + "/health", timeout=10).status_code == 200
    for t in threads:
        t.join(60)
    assert "not a regular file" in results["pipe.png"].json()["error"]["message"]
    assert "is a directory" in results["sub.png"].json()["error"]["message"]
    assert post(srv, chat(str(media_dir / "page.png"), max_tokens=2)).status_code == 200


def test_local_file_read_refuses_a_fifo_even_when_stat_said_regular(media_dir, monkeypatch):
    """The second line of defence: a path swapped for a FIFO after the stat is opened without
    blocking (O_NONBLOCK) and refused on fstat."""
    import stat as stat_module
    calls: list = []
    real_is_reg = stat_module.S_ISREG

    def first_says_regular(mode):           # the stat check is fooled; the fstat check is real
        calls.append(mode)
        return len(calls) == 1 or real_is_reg(mode)
    monkeypatch.setattr(media.stat, "S_ISREG", first_says_regular)
    f = MediaFetcher(MediaPolicy(1 << 20, 5, media_dir.resolve()))
    with pytest.raises(APIError) as e:
        asyncio.run(asyncio.wait_for(f.fetch(str(media_dir / "pipe.png"), "image 0"), 20))
    assert "not a regular file" in e.value.message and len(calls) == 2
