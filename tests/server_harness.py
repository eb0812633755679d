"""Helpers for the server tests: the REAL server as a subprocess on a free loopback port, a
loopback HTTP image server whose responses the test controls, and request/image builders."""
from __future__ import annotations

import base64
import io
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx

from fastdeploy_ext.conformance.references import Manifest

TINY_ARGS = ["--device", "cpu", "--dtype", "float32", "--kv-cache-memory", "16MiB", "--host", "127.0.0.1"]


def wait_until_healthy(url: str, deadline_s: float, exited=lambda: None) -> str | None:
    """Poll ``url``/health until it answers 200: None; otherwise why not (``exited()``'s reason
    once the server process is gone, or the deadline)."""
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        why = exited()
        if why is not None:
            return why
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return None
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    return f"server not healthy after {deadline_s:g} s"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProc:
    """`python -m fastdeploy_ext.entrypoints.openai.api_server ...` on a free port."""

    def __init__(self, *args: str, env: dict | None = None, metrics_port: bool = False, model_dir: str | None = None):
        self.port = free_port()
        self.metrics_port = free_port() if metrics_port else None
        cmd = [sys.executable, "-m", "fastdeploy_ext.entrypoints.openai.api_server", "--model", model_dir or str(tiny_vl()),
               *TINY_ARGS, "--port", str(self.port), *args]
        if self.metrics_port:
            cmd += ["--metrics-port", str(self.metrics_port)]
        self.log = io.BytesIO()
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})})
        self._reader = threading.Thread(target=self._drain_output, daemon=True)
        self._reader.start()
        self.url = f"http://127.0.0.1:{self.port}"

    def _drain_output(self):
        for line in self.proc.stdout:
            self.log.write(line)

    @property
    def output(self) -> str:
        return self.log.getvalue().decode(errors="replace")

    def wait_output(self, text: str, deadline_s: float = 30) -> str:
        """The output once it holds ``text``: the server's lines reach it through a pipe and a
        reader thread, so a line logged just before a response may still be on its way."""
        end = time.monotonic() + deadline_s
        while text not in self.output and time.monotonic() < end and self.exited() is None:
            time.sleep(0.02)
        return self.output

    def wait_healthy(self, deadline_s: float = 180) -> "ServerProc":
        why = wait_until_healthy(self.url, deadline_s, self.exited)
        if why is not None:
            raise AssertionError(f"{why}:\n{self.output}")
        return self

    def exited(self) -> str | None:
        return None if self.proc.poll() is None else f"server exited with {self.proc.returncode}"

    def metric(self, name: str, port: int | None = None) -> float:
        text = httpx.get(f"http://127.0.0.1:{port or self.port}/metrics", timeout=10).text
        m = re.search(rf"^{re.escape(name)}(?:{{[^}}]*}})? (\S+)$", text, re.M)
        assert m, f"{name} not in /metrics"
        return float(m.group(1))

    def wait_metric(self, name: str, value: float, deadline_s: float = 60) -> float:
        end = time.monotonic() + deadline_s
        while True:
            v = self.metric(name)
            if v == value or time.monotonic() > end:
                return v
            time.sleep(0.05)

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._reader.join(5)
        return self.proc.returncode


def tiny_vl():
    return Manifest.load().path("tiny_vl")


def ref_images() -> list[bytes]:
    return [p.read_bytes() for p in Manifest.load().files("images")]


def data_url(png: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(png).decode()


def png_bytes(w: int, h: int, seed: int = 0) -> bytes:
    import numpy as np
    from PIL import Image
    rng = np.random.default_rng(seed)
    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)).save(buf, format="PNG")
    return buf.getvalue()


def chat(image_url: str | None, text: str = "OCR:", **kw) -> dict:
    content = ([{"type": "image_url", "image_url": {"url": image_url}}] if image_url else []) + \
        [{"type": "text", "text": text}]
    return {"model": str(tiny_vl()), "messages": [{"role": "user", "content": content}], **kw}


class ImageHost:
    """A loopback HTTP server: /img.png serves `png`; /hold.png waits until `release` is set;
    /huge.png claims more bytes than the cap; /redirect?to=URL answers 302 to URL; anything else
    is 404. `hits` lists the paths requested."""

    def __init__(self, png: bytes):
        self.png = png
        self.release = threading.Event()
        self.held = threading.Semaphore(0)      # released once per request that reached /hold.png
        self.hits: list[str] = []               # every path requested, in order
        host = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *a):
                pass

            def do_GET(self):
                host.hits.append(self.path)
                if self.path == "/hold.png":
                    host.held.release()
                    host.release.wait(120)
                if self.path.startswith("/redirect?to="):
                    self.send_response(302)
                    self.send_header("Location", self.path[len("/redirect?to="):])
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                if self.path in ("/img.png", "/hold.png"):
                    body = host.png
                elif self.path == "/huge.png":
                    self.send_response(200)
                    self.send_header("Content-Type", "image/png")
                    self.end_headers()       # no Content-Length: the cap must stop the stream
                    try:
                        for _ in range(64):
                            self.wfile.write(b"\0" * 65536)
                    except OSError:
                        pass
                    return
                else:
                    self.send_error(404)
                    return
                self.send_response(200)
                self.send_header("Content-Type", "image/png")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

        class Quiet(ThreadingHTTPServer):
            def handle_error(self, request, client_address):
                pass      # clients that give up (size cap, timeouts) break pipes on purpose

        self.server = Quiet(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self):
        self.release.set()
        self.server.shutdown()
