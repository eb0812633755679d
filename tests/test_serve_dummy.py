"""Issue 9's "done when", as a fresh clone does it: `fastdeploy-ext serve --load-format dummy`
(the released 0.9B shapes, random weights, the built-in byte-level tokenizer, no model dir) on
the CPU answers the `openai` client, plain and streamed, and drains on SIGTERM."""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time

import httpx
from openai import OpenAI

from .server_harness import data_url, free_port, ref_images


def _serve_command(port: int, metrics_port: int) -> list[str]:
    exe = shutil.which("fastdeploy-ext")          # the console script README's users type
    head = [exe] if exe else [sys.executable, "-m", "fastdeploy_ext.entrypoints.cli"]
    return [*head, "serve", "--load-format", "dummy", "--host", "127.0.0.1", "--port", str(port),
            "--metrics-port", str(metrics_port), "--max-model-len", "2048"]


def test_dummy_server_answers_the_openai_client():
    port, mport = free_port(), free_port()
    proc = subprocess.Popen(_serve_command(port, mport), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            env={**os.environ, "OMP_NUM_THREADS": "2"}, text=True)
    try:
        end = time.monotonic() + 300
        while True:
            assert proc.poll() is None, proc.stdout.read()
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < end, "not healthy in 300 s"
            time.sleep(0.5)
        client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused")
        assert [m.id for m in client.models.list().data] == ["dummy"]
        messages = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": data_url(ref_images()[0])}},
                                                 {"type": "text", "text": "OCR:"}]}]
        extra = {"ignore_eos": True}            # random weights: the length is what is checked
        r = client.chat.completions.create(model="dummy", messages=messages, max_tokens=3, temperature=0,
                                           extra_body=extra)
        assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 3
        assert r.usage.prompt_tokens > 4 and isinstance(r.choices[0].message.content, str)
        chunks = list(client.chat.completions.create(model="dummy", messages=messages, max_tokens=3, temperature=0,
                                                     stream=True, stream_options={"include_usage": True},
                                                     extra_body=extra))
        assert chunks[-1].usage.completion_tokens == 3 and chunks[-1].usage.prompt_tokens == r.usage.prompt_tokens
        assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
        metrics = httpx.get(f"http://127.0.0.1:{mport}/metrics", timeout=10).text
        assert 'fastdeploy:request_success_total{model_name="dummy"} 2.0' in metrics
    finally:
        proc.send_signal(signal.SIGTERM)
        out = proc.communicate(timeout=120)[0]
    assert proc.returncode == 0, out
    assert "drained; exiting" in out
