"""`fastdeploy-ext bench serve` smoke run: both servers (ours and transformers behind the same
request stream) answer every request with exactly the requested output length; JSON written."""
from __future__ import annotations

import json

from .server_harness import tiny_vl
from .test_cli import cli


def test_bench_serve_smoke_both_sides(tmp_path):
    out = tmp_path / "serve.json"
    r = cli("bench", "serve", "--model", tiny_vl(), "--workloads", "single,c32", "--single-requests", "1",
            "--c32-requests", "4",
            "--output-tokens", "3", "--image-size", "320x180", "--server-args", "--max-model-len 1024",
            "--json-out", out)
    rep = json.loads(out.read_text())
    assert rep["output_tokens_per_request"] == 3 and rep["reference"].startswith("transformers generate")
    for wl, n in (("single", 1), ("c32", 4)):
        for side in ("ours", "reference"):
            res = rep["workloads"][wl][side]
            assert (res["requests"], res["failed"], res["short_outputs"]) == (n, 0, 0), res
            assert res["e2e_p95_s"] >= res["e2e_p50_s"] > 0 and res["ttft_avg_s"] > 0
        assert rep["workloads"][wl]["speedup_requests_per_s"] > 0
    assert "ours / transformers" in r.stdout


def test_bench_serve_bad_options_exit_2():
    r = cli("bench", "serve", "--workloads", "c64", "--load-format", "dummy", check=False)
    assert r.returncode == 2 and "unknown workload(s) ['c64']" in r.stderr
    r = cli("bench", "serve", check=False)
    assert r.returncode == 2 and "--model DIR is required" in r.stderr
