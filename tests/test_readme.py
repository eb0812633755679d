"""The README's Quick start runs as written: every fenced block marked ``bash runnable``,
``bash runnable-server`` or ``python runnable`` is executed, in order, in a directory holding
what the README says it holds (`PaddleOCR-VL/`, `page.png`, `scans/`).

The substitution rule (docs/TESTING.md, "The README's runnable examples"):
- `PaddleOCR-VL/` is the shipped tiny model dir (conformance/reference_data/tiny_vl), `page.png`
  a small rendered text line, `scans/` two small PNGs;
- every `max_tokens` / `--max-tokens` number becomes 8 (tiny outputs, same code path);
- port 8000 becomes a free loopback port;
- `fastdeploy-ext` is this checkout's CLI (`python -m fastdeploy_ext.entrypoints.cli`).
A `runnable-server` block is started in the background and must answer /health before the next
block runs; it is stopped (SIGTERM, drained) at the end. Nothing else is rewritten."""
from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

from .server_harness import free_port, tiny_vl

REPO = Path(__file__).resolve().parents[1]
FENCE = re.compile(r"^```(\w+) (runnable|runnable-server)\n(.*?)^```$", re.M | re.S)


def runnable_blocks(text: str) -> list[tuple[str, str, str]]:
    return [(m.group(1), m.group(2), m.group(3)) for m in FENCE.finditer(text)]


def substitute(code: str, port: int) -> str:
    code = re.sub(r"""(max[-_]tokens["']?\s*[=:]?\s*)\d+""", r"\g<1>8", code)
    return re.sub(r"\b8000\b", str(port), code)


def workdir(tmp: Path) -> Path:
    from PIL import Image, ImageDraw
    shutil.copytree(tiny_vl(), tmp / "PaddleOCR-VL")
    im = Image.new("RGB", (120, 40), "white")
    ImageDraw.Draw(im).text((4, 12), "Quick start", fill="black")
    im.save(tmp / "page.png")
    (tmp / "scans").mkdir()
    for i, size in enumerate([(56, 56), (84, 28)]):
        Image.new("RGB", size, (40 * i, 200, 90)).save(tmp / "scans" / f"p{i}.png")
    bin_dir = tmp / "bin"
    bin_dir.mkdir()
    shim = bin_dir / "fastdeploy-ext"
    shim.write_text(f'#!/bin/sh\nexec "{sys.executable}" -m fastdeploy_ext.entrypoints.cli "$@"\n')
    shim.chmod(0o755)
    return tmp


def run_block(lang: str, code: str, cwd: Path, env: dict) -> subprocess.CompletedProcess:
    cmd = ["bash", "-euo", "pipefail", "-c", code] if lang == "bash" else [sys.executable, "-c", code]
    r = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, f"README block failed (rc {r.returncode}):\n{code}\nstdout:\n{r.stdout}\nstderr:\n{r.stderr}"
    return r


def test_readme_marks_the_quick_start_examples_runnable():
    blocks = runnable_blocks((REPO / "README.md").read_text())
    joined = "\n".join(code for _, _, code in blocks)
    assert [kind for _, kind, _ in blocks].count("runnable-server") == 1
    for must in ("fastdeploy-ext generate", "curl ", "from openai import OpenAI", "LLM(model=", 'device="auto"',
                 "Image.open("):
        assert must in joined, f"no runnable README block has {must!r}"


def test_substitution_rule():
    code = 'x --max-tokens 1024 "max_tokens": 512, max_tokens=64 localhost:8000 --port 8000 18000'
    assert substitute(code, 5555) == 'x --max-tokens 8 "max_tokens": 8, max_tokens=8 localhost:5555 --port 5555 18000'


def test_readme_quick_start_runs_as_written(tmp_path):
    cwd = workdir(tmp_path)
    port = free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PATH": f"{cwd / 'bin'}{os.pathsep}{os.environ['PATH']}",
           "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    server, outputs = None, []
    try:
        for lang, kind, code in runnable_blocks((REPO / "README.md").read_text()):
            code = substitute(code, port)
            if kind == "runnable-server":
                server = subprocess.Popen(["bash", "-c", "exec " + code.strip()], cwd=cwd, env=env,
                                          stdout=subprocess.DEVNULL, stderr=open(cwd / "server.log", "w"))
                end = time.monotonic() + 300
                while True:
                    assert server.poll() is None, (cwd / "server.log").read_text()
                    try:
                        if httpx.get(f"http://localhost:{port}/health", timeout=2).status_code == 200:
                            break
                    except httpx.HTTPError:
                        pass
                    assert time.monotonic() < end, (cwd / "server.log").read_text()
                    time.sleep(0.3)
                continue
            outputs.append((code, run_block(lang, code, cwd, env)))
    finally:
        if server is not None and server.poll() is None:
            server.send_signal(signal.SIGTERM)
            server.wait(60)
    assert server is not None and server.returncode == 0          # drained and exited cleanly
    by = {next(k for k in ("LLM(", "OpenAI(", "curl", "generate") if k in code): r for code, r in outputs}
    # generate: the text of page.png on stdout; --json: one line per scan with its source
    rows = [json.loads(ln) for ln in (cwd / "results.jsonl").read_text().splitlines()]
    assert [r["source"] for r in rows] == ["scans/p0.png", "scans/p1.png"] and all(len(r["token_ids"]) == 8 for r in rows)
    body = json.loads(by["curl"].stdout)
    assert body["object"] == "chat.completion" and body["usage"]["completion_tokens"] <= 8
    assert body["model"] == "PaddleOCR-VL" and isinstance(body["choices"][0]["message"]["content"], str)
    assert by["OpenAI("].stdout.strip() == body["choices"][0]["message"]["content"].strip()   # greedy, same image
    last = by["LLM("].stdout.strip().splitlines()[-1]
    assert re.fullmatch(r"(stop|length|repetition) \d+ \[[\d, ]*\]", last), last
    assert "request chatcmpl-" in (cwd / "server.log").read_text()   # the server's access lines
