"""Running a test file's ``test_interp_*`` tests in the Triton interpreter: TRITON_INTERPRET=1
must be set before triton is first imported, so they run in a child pytest (this process has
triton in compiled mode, or none)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def run_interp_tests(test_file: str, timeout: int = 900) -> subprocess.CompletedProcess:
    """The file's ``test_interp_*`` tests with TRITON_INTERPRET=1 in a child pytest; fails unless
    they pass and none is skipped. Returns the run (its stdout for further checks)."""
    env = dict(os.environ, TRITON_INTERPRET="1")
    env["PYTHONPATH"] = os.pathsep.join([str(REPO)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(Path(test_file).resolve()),
           "-k", "test_interp_"]
    res = subprocess.run(cmd, check=False, cwd=str(REPO), env=env, capture_output=True, text=True, timeout=timeout)
    tail = (res.stdout + res.stderr)[-6000:]
    assert res.returncode == 0, f"interpreter tests failed (rc={res.returncode}):\n{tail}"
    assert " passed" in res.stdout and "skipped" not in res.stdout.splitlines()[-1], tail
    return res
