"""ci/fuzz_server.py's short form as a test: a tiny-model server on loopback gets every known
bad-input kind, random mutations of valid requests (fixed seed), streaming disconnects and slow
clients (<= 500 requests, <= 90 s); no 5xx, no dropped connection, no crash, /health 200 and
the KV blocks / running / waiting back to 0 afterwards."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_fuzz_short(tmp_path):
    out = tmp_path / "fuzz.json"
    p = subprocess.run([sys.executable, str(ROOT / "ci" / "fuzz_server.py"), "--short", "--seed", "0",
                        "--json-out", str(out)], capture_output=True, text=True, timeout=400,
                       env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert p.returncode == 0, p.stdout[-6000:] + p.stderr[-3000:]
    summary = json.loads(out.read_text())
    assert summary["failures"] == [] and summary["after"]["health"] == 200
    assert summary["bad_input_kinds"] >= 30 and summary["requests"] == 500
    assert not any(k.startswith("5") for k in summary["status_histogram"])
