"""Fuzz the OpenAI server on loopback: every known bad input, random mutations of valid requests,
streaming disconnects and slow clients, against a running tiny-model server (started here, or
--base-url). Bounded: --requests and --max-seconds; max_tokens <= 64 on every request.

Fails (exit 1) on: any 5xx answer (no drain is ever started, so a 503 counts too), the server
process exiting, /health not 200 afterwards, the server's RSS growing more than 5 % between
requests 1,000 and 5,000 (when the run reaches 5,000), and /metrics not back to 0 KV blocks
used, 0 running and 0 waiting at the end. --short (<= 500 requests, <= 90 s) is the CI form.

    python ci/fuzz_server.py --short                       # CI (tests/test_fuzz_short.py)
    python ci/fuzz_server.py --requests 6000 --concurrency 16
    python ci/fuzz_server.py --requests 2000 --concurrency 16 --images \\
        --model-args "--load-format dummy --device cuda --dtype bfloat16"          # the H200 run

--killers: afterwards, 16 valid streaming requests in flight while the sampler-killer requests
are sent; the 16 must complete, each killer get 400 (200 for temperature 1e-46: that is greedy),
/health stay 200. Only loopback is ever contacted: the SSRF cases name inside addresses the
server must refuse before connecting (its fetch policy), and the image host is loopback."""
from __future__ import annotations

import argparse
import asyncio
import base64
import collections
import io
import json
import os
import random
import re
import shlex
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.server_harness import free_port, png_bytes, ref_images, tiny_vl, wait_until_healthy  # noqa: E402

MAX_TOKENS = 64
API_KEY = "fuzz-key"
SHORT_REQUESTS, SHORT_SECONDS = 500, 90
RSS_FROM, RSS_TO, RSS_GROWTH = 1000, 5000, 0.05


# --------------------------------------------------------------------------- requests
@dataclass
class Case:
    """One request: a JSON body (or raw bytes / a raw-socket action) and the statuses it may get."""
    kind: str
    body: object = None                  # dict -> JSON; bytes -> sent as is
    expect: tuple = (200,)
    stream: bool = False
    headers: dict = field(default_factory=dict)
    action: str = "post"                 # post | stream_disconnect | slow_reader | client_timeout | raw
    raw: bytes = b""                     # for action raw: what to send before waiting for the server


def png16() -> bytes:
    import numpy as np
    from PIL import Image
    a = (np.arange(64 * 64, dtype=np.uint16).reshape(64, 64) * 16)
    buf = io.BytesIO()
    Image.fromarray(a).save(buf, format="PNG")           # uint16 -> mode I;16
    return buf.getvalue()


def data_url(png: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(png).decode()


class Requests:
    """Builds the cases; `rng` is the only source of randomness (fixed seed)."""

    def __init__(self, rng: random.Random, model: str | None, images: bool, media_dir: Path,
                 server_port: int, image_host: str, exclude: set[str] = frozenset()):
        self.rng, self.model, self.images, self.exclude = rng, model, images, exclude
        self.media_dir, self.server_port, self.image_host = media_dir, server_port, image_host
        self.pngs = [data_url(p) for p in ref_images()]
        self.png16 = data_url(png16())

    def valid(self, stream: bool | None = None) -> dict:
        r = self.rng
        text = r.choice(["OCR:", "Table Recognition:", "Formula Recognition:", "Chart Recognition:", "hello"])
        content = [{"type": "text", "text": text}]
        if self.images and r.random() < 0.8:
            content.insert(0, {"type": "image_url", "image_url": {"url": r.choice(self.pngs)}})
        body = {"messages": [{"role": "user", "content": content}], "max_tokens": r.randint(1, MAX_TOKENS)}
        if self.model:
            body["model"] = self.model
        if r.random() < 0.5:
            body["temperature"] = r.choice([0, 0.5, 1.0, 1.3])
        if r.random() < 0.3:
            body["top_p"] = r.choice([0.5, 0.9, 1.0])
        if r.random() < 0.3:
            body["top_k"] = r.choice([-1, 0, 1, 5, 50])
        if r.random() < 0.2:
            body["seed"] = r.randint(0, 2 ** 31)
        if r.random() < 0.2:
            body["logprobs"], body["top_logprobs"] = True, r.randint(0, 3)
        if r.random() < 0.2:
            body["stop"] = [r.choice(["a", "\n", "jk", "the"])]
        if stream if stream is not None else r.random() < 0.4:
            body["stream"] = True
            if r.random() < 0.5:
                body["stream_options"] = {"include_usage": True}
        return body

    def mutate(self) -> Case:
        """A valid request with one field replaced by a random value of a random type."""
        r = self.rng
        body = self.valid(stream=False)
        weird = [None, "", "x" * r.randint(1, 50), -1, 0, 1.5, [], [1, "a"], {}, {"a": {"b": []}}, True,
                 "\ud800", "\x00", "😀" * 3]
        if "mutation_overflow" not in self.exclude:  # values past int64 / float32 (the sampler's types)
            weird += [2 ** 63, -(2 ** 63) - 1, 2 ** 64, 1e308, -1e-300, 1e-46]
        keys = ["messages", "max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "n", "logprobs",
                "top_logprobs", "stream", "stream_options", "repetition_penalty", "min_tokens", "stop_token_ids",
                "ignore_eos", "mm_processor_kwargs", "repetition_guard", "max_completion_tokens", "model",
                "skip_special_tokens", "include_stop_str_in_output", "bogus_" + str(r.randint(0, 9))]
        how = r.random()
        if how < 0.6:
            body[r.choice(keys)] = r.choice(weird)
        elif how < 0.8:
            body["messages"][0][r.choice(["role", "content", "name", "extra"])] = r.choice(weird)
        else:
            part = body["messages"][0]["content"][-1]
            part[r.choice(["type", "text", "image_url"])] = r.choice(weird)
        for k in ("max_tokens", "max_completion_tokens"):      # keep every accepted request short
            v = body.get(k)
            if isinstance(v, int) and not isinstance(v, bool) and v > MAX_TOKENS:
                body[k] = MAX_TOKENS
        if "max_tokens" not in body or not isinstance(body["max_tokens"], int):
            body.setdefault("max_completion_tokens", MAX_TOKENS)   # no unbounded default either
        return Case("mutation", body, expect=(200, 400, 404))

    def with_image(self, url: str, **kw) -> dict:
        body = self.valid(stream=False)
        body["messages"][0]["content"] = [{"type": "image_url", "image_url": {"url": url}},
                                          {"type": "text", "text": "OCR:"}]
        body.update(kw)
        return body

    def killers(self) -> list[Case]:
        """The requests that killed the step loop before the shared sampling validation."""
        b = lambda **kw: self.valid(stream=False) | {"max_tokens": 8} | kw   # noqa: E731
        return [Case("killer_top_k_2^63", b(top_k=2 ** 63), expect=(400,)),
                Case("killer_temperature_1e-46", b(temperature=1e-46), expect=(200, 400)),
                Case("killer_repetition_penalty_1e-40", b(repetition_penalty=1e-40, temperature=1.0),
                     expect=(400,))]

    def bad(self) -> list[Case]:
        """Every bad-input kind, one case each (the caller picks among them)."""
        v = lambda **kw: self.valid(stream=False) | kw       # noqa: E731
        host_port = self.image_host.rsplit(":", 1)[1]
        nested = b'{"messages": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"

        def non_finite(literal: str) -> bytes:          # JSON has no NaN; Python's parser reads it
            body = v()
            body.pop("temperature", None)
            return json.dumps(body).replace('"max_tokens"', f'"temperature": {literal}, "max_tokens"').encode()
        many = v()
        many["messages"][0]["content"] = [{"type": "image_url", "image_url": {"url": f"{self.image_host}/img.png?{i}"}}
                                          for i in range(40)] + [{"type": "text", "text": "OCR:"}]
        two_images = v()
        two_images["messages"][0]["content"] = [{"type": "image_url", "image_url": {"url": u}}
                                                for u in self.pngs[:2]] + [{"type": "text", "text": "OCR:"}]
        bad_png = self.pngs[0].split(",", 1)[1]
        cases = [
            *self.killers(),
            Case("nested_json_100k", nested, expect=(400,)),
            Case("seed_2^64", v(seed=2 ** 64), expect=(400,)),
            Case("seed_-2^63-1", v(seed=-(2 ** 63) - 1), expect=(400,)),
            Case("lone_surrogate", v(messages=[{"role": "user", "content": "abc \ud800 def"}]), expect=(400,)),
            Case("lone_surrogate_part", self.with_image(self.pngs[0]) | {"messages": [{"role": "user", "content": [
                {"type": "text", "text": "\udfff"}]}]}, expect=(400,)),
            Case("png_16bit", self.with_image(self.png16, max_tokens=4), expect=(200,)),
            Case("stop_strings_stream", v(stop=["jk", "a", "\n"], stream=True, temperature=1.0, seed=5), stream=True),
            Case("stop_100_strings", v(stop=[f"s{i}" for i in range(100)]), expect=(200, 400)),
            Case("api_key_missing", v(), expect=(401,), headers={"Authorization": ""}),
            Case("api_key_wrong", v(), expect=(401,), headers={"Authorization": "Bearer nope"}),
            Case("top_k_float", v(top_k=1.5), expect=(400,)),
            Case("top_k_negative", v(top_k=-7), expect=(400,)),
            Case("temperature_negative", v(temperature=-1), expect=(400,)),
            Case("temperature_nan", non_finite("NaN"), expect=(400,)),
            Case("temperature_inf", non_finite("Infinity"), expect=(200, 400)),
            Case("top_p_zero", v(top_p=0), expect=(200, 400)),          # vLLM: 400; ours: 0 = argmax
            Case("max_tokens_negative", v(max_tokens=-1), expect=(400,)),
            Case("max_tokens_2^70", v(max_tokens=2 ** 70), expect=(400,)),
            Case("n_2", v(n=2), expect=(400,)),
            Case("top_logprobs_without_logprobs", v(logprobs=False, top_logprobs=2), expect=(400,)),
            Case("repetition_guard_max_period_1e7", v(repetition_guard={"enabled": False, "max_period": 10 ** 7}),
                 expect=(200, 400)),
            Case("stop_token_ids_huge", v(stop_token_ids=[2 ** 62]), expect=(200, 400)),
            Case("unknown_param", v(frobnicate=1), expect=(400,)),
            Case("unknown_model", v(model="gpt-4"), expect=(404,)),
            Case("invalid_json", b"{nope", expect=(400,)),
            Case("json_list", b"[1, 2]", expect=(400,)),
            Case("json_number", b"7", expect=(400,)),
            Case("messages_empty", v(messages=[]), expect=(400,)),
            Case("role_bad", v(messages=[{"role": "robot", "content": "x"}]), expect=(400,)),
            Case("min_pixels_5e7", v(mm_processor_kwargs={"min_pixels": 50_000_000}), expect=(400,)),
            Case("min_pixels_4e8", self.with_image(self.pngs[0], mm_processor_kwargs={"min_pixels": 400_000_000}),
                 expect=(400,)),
            Case("max_pixels_4e8", self.with_image(self.pngs[0], mm_processor_kwargs={"max_pixels": 400_000_000}),
                 expect=(400,)),
            Case("min_over_max_pixels", self.with_image(self.pngs[0],
                                                        mm_processor_kwargs={"min_pixels": 10 ** 6, "max_pixels": 10}),
                 expect=(400,)),
            Case("huge_text_16MB", v(messages=[{"role": "user", "content": "a" * 16_000_000}]), expect=(400,)),
            Case("long_text_over_context", v(messages=[{"role": "user", "content": "word " * 20_000}]),
                 expect=(400,)),
            Case("image_urls_40_over_limit", many, expect=(400,)),
            Case("images_2_over_limit", two_images, expect=(400,)),
            Case("body_over_limit_declared", action="raw", expect=(413,),
                 raw=b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 999999999999\r\n\r\n"),
            Case("slow_body", action="raw", expect=(408,),
                 raw=b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 500\r\n\r\n{\"me"),
            Case("half_sent_headers", action="raw", expect=(408,),
                 raw=b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Le"),
            Case("fifo_path", self.with_image(str(self.media_dir / "pipe.png")), expect=(400,)),
            Case("directory_path", self.with_image(str(self.media_dir)), expect=(400,)),
            Case("path_outside", self.with_image("/etc/passwd"), expect=(400,)),
            Case("dotdot_path", self.with_image(str(self.media_dir / ".." / "x.png")), expect=(400,)),
            Case("corrupt_image", self.with_image("data:image/png;base64," + bad_png[:200]), expect=(400,)),
            Case("not_base64", self.with_image("data:image/png;base64,@@@"), expect=(400,)),
            Case("empty_data_url", self.with_image("data:image/png;base64,"), expect=(400,)),
            Case("one_pixel", self.with_image(data_url(png_bytes(1, 1))), expect=(400,)),
            Case("aspect_402x2", self.with_image(data_url(png_bytes(402, 2))), expect=(400,)),
            Case("scheme_ftp", self.with_image("ftp://example.com/a.png"), expect=(400,)),
        ]
        for i, host in enumerate([f"127.0.0.1:{self.server_port}/metrics", f"2130706433:{host_port}/img.png",
                                  f"0x7f.1:{host_port}/img.png", f"[::1]:{host_port}/img.png",
                                  f"0.0.0.0:{host_port}/img.png", f"localhost:{self.server_port}/health",
                                  "169.254.169.254/latest/meta-data/", "10.0.0.1/a.png", "[fe80::1]/a.png",
                                  "224.0.0.1/a.png", f"127.0.0.1:{host_port}/redirect?to=http://10.0.0.1/"]):
            cases.append(Case(f"ssrf_{i}", self.with_image(f"http://{host}"), expect=(400,)))
        return cases

    def behaviour(self) -> Case:
        """Clients that misbehave on valid requests."""
        r = self.rng.random()
        if r < 0.4:
            return Case("stream_disconnect", self.valid(stream=True) | {"max_tokens": MAX_TOKENS},
                        action="stream_disconnect")
        if r < 0.7:
            return Case("slow_reader", self.valid(stream=True) | {"max_tokens": 16}, action="slow_reader")
        return Case("client_timeout", self.valid(stream=False) | {"max_tokens": MAX_TOKENS}, action="client_timeout")


# --------------------------------------------------------------------------- sending
class Runner:
    def __init__(self, base_url: str, api_key: str | None):
        self.base = base_url.rstrip("/")
        self.auth = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        u = httpx.URL(self.base)
        self.host, self.port = u.host, u.port or 80

    async def run(self, client: httpx.AsyncClient, case: Case):
        headers = {**self.auth, **case.headers}
        headers = {k: v for k, v in headers.items() if v}
        url = self.base + "/v1/chat/completions"
        if case.action == "raw":
            return await self._raw(case.raw)
        content = case.body if isinstance(case.body, bytes) else json.dumps(case.body).encode()
        headers["Content-Type"] = "application/json"
        if case.action == "client_timeout":
            try:
                r = await client.post(url, content=content, headers=headers,
                                      timeout=httpx.Timeout(60, read=0.05))
                return r.status_code
            except httpx.ReadTimeout:
                return "client_gave_up"
        if case.action in ("stream_disconnect", "slow_reader") or case.stream:
            async with client.stream("POST", url, content=content, headers=headers, timeout=120) as r:
                if r.status_code != 200:
                    await r.aread()
                    return r.status_code
                n = 0
                async for line in r.aiter_lines():
                    if line.startswith("data: {") and '"error"' in line[:20]:
                        return "stream_error"
                    n += 1
                    if case.action == "stream_disconnect" and n >= 3:
                        return "disconnected"
                    if case.action == "slow_reader":
                        await asyncio.sleep(0.02)
                return r.status_code
        r = await client.post(url, content=content, headers=headers, timeout=120)
        return r.status_code

    async def _raw(self, data: bytes):
        """Send a partial request and read what the server answers before it closes."""
        if self.auth and b"\r\n" in data:
            line, rest = data.split(b"\r\n", 1)
            data = line + b"\r\nAuthorization: " + self.auth["Authorization"].encode() + b"\r\n" + rest
        reader, writer = await asyncio.open_connection(self.host, self.port)
        try:
            writer.write(data)
            await writer.drain()
            answer = await asyncio.wait_for(reader.read(4096), timeout=120)
            m = re.match(rb"HTTP/1\.1 (\d{3})", answer)
            return int(m.group(1)) if m else "closed"
        finally:
            writer.close()


# --------------------------------------------------------------------------- the server
class Server:
    def __init__(self, model_args: list[str], media_dir: Path, image_host: str):
        self.port = free_port()
        uses_dummy = "dummy" in " ".join(model_args)
        model = [] if uses_dummy or "--model" in model_args else ["--model", str(tiny_vl())]
        device = [] if model_args else ["--device", "cpu", "--dtype", "float32", "--kv-cache-memory", "16MiB"]
        self.cmd = [sys.executable, "-m", "fastdeploy_ext.entrypoints.openai.api_server", *model, *device,
                    *model_args, "--host", "127.0.0.1", "--port", str(self.port), "--api-key", API_KEY,
                    "--max-model-len", "2048", "--allowed-local-media-path", str(media_dir),
                    "--header-timeout", "3", "--body-timeout", "3", "--media-fetch-timeout", "5",
                    "--max-concurrency", "64", "--max-request-body-bytes", str(20 << 20)]
        self.log = tempfile.NamedTemporaryFile(prefix="fuzz_server_", suffix=".log", delete=False)
        self.proc = subprocess.Popen(self.cmd, stdout=self.log, stderr=subprocess.STDOUT,
                                     env={**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")})
        self.url = f"http://127.0.0.1:{self.port}"
        self.model = None if uses_dummy else str(tiny_vl())

    def wait_healthy(self, deadline_s: float = 300) -> None:
        why = wait_until_healthy(self.url, deadline_s, lambda: None if self.proc.poll() is None
                                 else f"server exited with {self.proc.returncode}")
        if why is not None:
            raise SystemExit(f"{why}; log: {self.log.name}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def rss_bytes(pid: int | None) -> int | None:
    if pid is None:
        return None
    try:
        with open(f"/proc/{pid}/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))
    except (OSError, StopIteration):
        return None


def metric(base: str, name: str) -> float | None:
    text = httpx.get(base + "/metrics", timeout=10).text
    m = re.search(rf"^{re.escape(name)}(?:{{[^}}]*}})? (\S+)$", text, re.M)
    return float(m.group(1)) if m else None


def start_image_host(png: bytes):
    from tests.server_harness import ImageHost
    return ImageHost(png)


# --------------------------------------------------------------------------- the run
@dataclass
class Tally:
    statuses: collections.Counter = field(default_factory=collections.Counter)
    by_kind: dict = field(default_factory=lambda: collections.defaultdict(collections.Counter))
    unexpected: list = field(default_factory=list)
    failures: list = field(default_factory=list)
    rss: dict = field(default_factory=dict)
    done: int = 0

    def record(self, case: Case, status) -> None:
        self.done += 1
        self.statuses[status] += 1
        self.by_kind[case.kind][status] += 1
        if isinstance(status, int) and status >= 500:
            self.failures.append(f"request {self.done} ({case.kind}): HTTP {status}")
        elif status == "stream_error":
            self.failures.append(f"request {self.done} ({case.kind}): an error event inside a 200 stream")
        elif case.action in ("post", "raw") and status not in case.expect and len(self.unexpected) < 50:
            self.unexpected.append(f"{case.kind}: got {status}, expected one of {case.expect}")


def plan(reqs: Requests, n: int, rng: random.Random, exclude: set[str]) -> list[Case]:
    """n cases: every bad kind at least once (the first len(bad) requests), then a mix of valid
    requests (40 %), mutations (30 %), bad kinds (20 %) and misbehaving clients (10 %)."""
    bad = [c for c in reqs.bad() if c.kind not in exclude]
    heavy = {"huge_text_16MB", "nested_json_100k", "slow_body", "half_sent_headers"}
    out: list[Case] = list(bad)
    while len(out) < n:
        x = rng.random()
        if x < 0.4:
            b = reqs.valid()
            out.append(Case("valid", b, stream=bool(b.get("stream"))))
        elif x < 0.7:
            out.append(reqs.mutate())
        elif x < 0.9:
            c = rng.choice(bad)
            if c.kind in heavy and rng.random() < 0.8:
                c = rng.choice([c2 for c2 in bad if c2.kind not in heavy])
            out.append(c)
        else:
            out.append(reqs.behaviour())
    return out[:n]


async def run_cases(runner: Runner, cases: list[Case], concurrency: int, deadline: float, tally: Tally,
                    pid: int | None, proc: subprocess.Popen | None) -> None:
    queue = collections.deque(cases)
    checkpoints = {1, RSS_FROM, 2000, 3000, 4000, RSS_TO, len(cases)}

    async def worker(client):
        while queue and time.monotonic() < deadline:
            if proc is not None and proc.poll() is not None:
                return
            case = queue.popleft()
            try:
                status = await runner.run(client, case)
            except (httpx.TransportError, OSError, asyncio.TimeoutError) as e:
                status = "transport_error" if case.action != "raw" else "closed"
                if case.action not in ("raw", "stream_disconnect", "slow_reader", "client_timeout"):
                    # a valid or bad POST must get an answer: a dropped connection is a failure
                    tally.failures.append(f"request {tally.done + 1} ({case.kind}): {type(e).__name__}: {e}")
            tally.record(case, status)
            if tally.done in checkpoints:
                tally.rss[tally.done] = rss_bytes(pid)
    limits = httpx.Limits(max_connections=concurrency * 2, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(limits=limits) as client:
        await asyncio.gather(*[worker(client) for _ in range(concurrency)])


async def killers_while_streaming(runner: Runner, reqs: Requests) -> list[str]:
    """16 valid streams in flight while the killers are sent: the 16 complete with [DONE],
    the killers get their statuses, /health stays 200."""
    problems: list[str] = []
    async with httpx.AsyncClient(limits=httpx.Limits(max_connections=40)) as client:
        started = asyncio.Event()
        n_started = 0

        async def stream_one(i):
            nonlocal n_started
            body = reqs.valid(stream=True) | {"max_tokens": MAX_TOKENS, "ignore_eos": True,
                                              "repetition_guard": {"enabled": False}}
            headers = {**runner.auth, "Content-Type": "application/json"}
            lines = []
            async with client.stream("POST", runner.base + "/v1/chat/completions", content=json.dumps(body),
                                     headers=headers, timeout=300) as r:
                if r.status_code != 200:
                    return f"stream {i}: HTTP {r.status_code}"
                async for line in r.aiter_lines():
                    if line:
                        lines.append(line)
                        if len(lines) == 2:
                            n_started += 1
                            if n_started == 16:
                                started.set()
            return None if lines and lines[-1] == "data: [DONE]" else f"stream {i}: ended without [DONE]"
        streams = [asyncio.create_task(stream_one(i)) for i in range(16)]
        try:
            await asyncio.wait_for(started.wait(), 120)
        except asyncio.TimeoutError:
            problems.append("the 16 streams did not all start within 120 s")
        in_flight = sum(not t.done() for t in streams)
        killers = reqs.killers() * 3
        statuses = await asyncio.gather(*[runner.run(client, c) for c in killers])   # all at once, mid-stream
        for case, status in zip(killers, statuses):
            if status not in case.expect:
                problems.append(f"{case.kind}: got {status}, expected one of {case.expect}")
        h = (await client.get(runner.base + "/health", timeout=10)).status_code
        if h != 200:
            problems.append(f"/health answered {h} after the killers")
        for res in await asyncio.gather(*streams, return_exceptions=True):
            if res is not None:
                problems.append(str(res))
        print(f"killers while streaming: {in_flight} of 16 streams in flight when the {len(killers)} killers "
              f"were sent; killer statuses {collections.Counter(statuses)}")
        if in_flight == 0:
            problems.append("no stream was still in flight when the killers were sent (nothing was tested)")
    return problems


def wait_idle(base: str, deadline_s: float = 60) -> dict:
    names = ("fastdeploy_ext:kv_blocks_used", "fastdeploy:num_requests_running", "fastdeploy:num_requests_waiting")
    end = time.monotonic() + deadline_s
    while True:
        vals = {n: metric(base, n) for n in names}
        if all(v == 0 for v in vals.values()) or time.monotonic() > end:
            return vals
        time.sleep(0.2)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base-url", default=None, help="a running server (default: start one here)")
    ap.add_argument("--api-key", default=None, help="with --base-url: its API key")
    ap.add_argument("--server-pid", type=int, default=None, help="with --base-url: its pid, for the RSS check")
    ap.add_argument("--requests", type=int, default=5000)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-seconds", type=float, default=1800)
    ap.add_argument("--short", action="store_true", help=f"the CI form: <= {SHORT_REQUESTS} requests, "
                                                         f"<= {SHORT_SECONDS} s")
    ap.add_argument("--model-args", default="", help='server flags, e.g. "--load-format dummy --device cuda '
                                                     '--dtype bfloat16"')
    ap.add_argument("--images", action="store_true", help="include images in valid requests")
    ap.add_argument("--killers", action="store_true", help="then the killers-while-streaming scenario")
    ap.add_argument("--exclude", default="", help="comma-separated kinds not to send (e.g. to run on a branch "
                                                  "that lacks a fix); mutation_overflow: no int64/float32 "
                                                  "overflowing values in mutations")
    ap.add_argument("--json-out", default=None)
    a = ap.parse_args(argv)
    if a.short:
        a.requests, a.max_seconds = min(a.requests, SHORT_REQUESTS), min(a.max_seconds, SHORT_SECONDS)
    exclude = {k for k in a.exclude.split(",") if k}
    rng = random.Random(a.seed)

    media_dir = Path(tempfile.mkdtemp(prefix="fuzz_media_"))
    os.mkfifo(media_dir / "pipe.png")
    host = start_image_host(ref_images()[0])
    server = None
    try:
        if a.base_url is None:
            server = Server(shlex.split(a.model_args), media_dir, host.url)
            server.wait_healthy()
            base, api_key, pid, model = server.url, API_KEY, server.proc.pid, server.model
        else:
            base, api_key, pid, model = a.base_url, a.api_key, a.server_pid, None
        port = httpx.URL(base).port
        reqs = Requests(rng, model, a.images, media_dir, port, host.url, exclude)
        cases = plan(reqs, a.requests, rng, exclude)
        runner = Runner(base, api_key)
        tally = Tally()
        t0 = time.monotonic()
        asyncio.run(run_cases(runner, cases, a.concurrency, t0 + a.max_seconds, tally, pid,
                              server.proc if server else None))
        duration = time.monotonic() - t0
        killer_problems = asyncio.run(killers_while_streaming(runner, reqs)) if a.killers else []
        alive = server is None or server.proc.poll() is None
        failures = list(tally.failures)
        if not alive:
            failures.append(f"the server exited with status {server.proc.returncode} (log: {server.log.name})")
        health = None
        idle = {}
        if alive:
            try:
                health = httpx.get(base + "/health", timeout=10).status_code
                idle = wait_idle(base)
            except httpx.HTTPError as e:
                failures.append(f"/health or /metrics unreachable afterwards: {e}")
            if health != 200:
                failures.append(f"/health answered {health} afterwards")
            if idle and not all(v == 0 for v in idle.values()):
                failures.append(f"not idle afterwards: {idle}")
        failures += [f"killers while streaming: {p}" for p in killer_problems]
        growth = None
        if tally.rss.get(RSS_FROM) and tally.rss.get(RSS_TO):
            growth = tally.rss[RSS_TO] / tally.rss[RSS_FROM] - 1
            if growth > RSS_GROWTH:
                failures.append(f"RSS grew {growth:.1%} between requests {RSS_FROM} and {RSS_TO} "
                                f"(limit {RSS_GROWTH:.0%})")
        if tally.done < len(cases) and not a.short and alive:
            failures.append(f"only {tally.done} of {len(cases)} requests within --max-seconds {a.max_seconds:g}")
        kinds = sorted(tally.by_kind)
        bad_kinds = [k for k in kinds if k not in ("valid", "mutation", "stream_disconnect", "slow_reader",
                                                   "client_timeout")]
        summary = {
            "requests": tally.done, "planned": len(cases), "duration_s": round(duration, 1),
            "requests_per_s": round(tally.done / duration, 1) if duration else None,
            "concurrency": a.concurrency, "seed": a.seed, "images": a.images, "model_args": a.model_args,
            "kinds": len(kinds), "bad_input_kinds": len(bad_kinds),
            "status_histogram": {str(k): v for k, v in sorted(tally.statuses.items(), key=lambda kv: str(kv[0]))},
            "by_kind": {k: {str(s): n for s, n in v.items()} for k, v in sorted(tally.by_kind.items())},
            "rss_mib": {str(k): round(v / 2 ** 20, 1) for k, v in sorted(tally.rss.items()) if v},
            "rss_growth_1000_5000": None if growth is None else round(growth, 4),
            "after": {"health": health, **idle}, "killers": None if not a.killers else (killer_problems or "ok"),
            "unexpected_statuses": tally.unexpected, "failures": failures[:50], "excluded": sorted(exclude),
        }
        print(f"fuzz_server: {tally.done} requests in {duration:.1f} s, {len(kinds)} kinds "
              f"({len(bad_kinds)} bad-input), concurrency {a.concurrency}, seed {a.seed}")
        print("status histogram:", json.dumps(summary["status_histogram"]))
        print("RSS (MiB) at request:", json.dumps(summary["rss_mib"]),
              "" if growth is None else f"growth {RSS_FROM}->{RSS_TO}: {growth:+.2%}")
        print("after:", json.dumps(summary["after"]))
        for k, v in summary["by_kind"].items():
            print(f"  {k:40s} {v}")
        if tally.unexpected:
            print(f"{len(tally.unexpected)} unexpected (non-5xx) statuses, e.g.:", *tally.unexpected[:10], sep="\n  ")
        if a.killers:
            print("killers while streaming:", "ok" if not killer_problems else killer_problems)
        if a.json_out:
            Path(a.json_out).write_text(json.dumps(summary, indent=1))
        if failures:
            print("FAILED:", *failures[:30], sep="\n  ")
            if server is not None:
                print(f"server log: {server.log.name}")
            return 1
        print("OK")
        return 0
    finally:
        if server is not None:
            server.stop()
        host.close()


if __name__ == "__main__":
    sys.exit(main())
