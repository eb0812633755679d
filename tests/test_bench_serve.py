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


def test_bench_serve_base_url_measures_a_running_server(tmp_path):
    """--base-url: the same workloads against a server this test started (no server of its
    own, no reference side); the model name comes from the server's /v1/models; then the same
    server as --reference-url too, so both sides and the ratio appear."""
    from .server_harness import ServerProc
    srv = ServerProc("--served-model-name", "ocr-tiny", "--max-model-len", "1024").wait_healthy()
    try:
        out = tmp_path / "remote.json"
        r = cli("bench", "serve", "--base-url", srv.url + "/", "--workloads", "single,c32", "--single-requests", "2",
                "--c32-requests", "4", "--output-tokens", "3", "--image-size", "64x48", "--json-out", out)
        rep = json.loads(out.read_text())
        assert rep["base_url"] == srv.url and rep["model"] == "ocr-tiny" and rep["reference"] is None
        for wl, n in (("single", 2), ("c32", 4)):
            res = rep["workloads"][wl]
            assert set(res) == {"ours"}
            assert (res["ours"]["requests"], res["ours"]["failed"], res["ours"]["short_outputs"]) == (n, 0, 0)
            assert res["ours"]["ttft_avg_s"] > 0
        assert f"server {srv.url}" in r.stdout
        # every request the bench sent reached the server (its access lines): 2 + 4 timed, one
        # warm-up per workload
        assert srv.output.count("status=200 ") == 2 + 4 + 2
        r = cli("bench", "serve", "--base-url", srv.url, "--reference-url", srv.url, "--workloads", "single",
                "--single-requests", "1", "--output-tokens", "2", "--image-size", "64x48", "--model-name", "ocr-tiny")
        assert "reference:" in r.stdout and "ours / reference: x" in r.stdout
    finally:
        srv.stop()


def test_bench_serve_base_url_errors_exit_2():
    r = cli("bench", "serve", "--reference-url", "http://127.0.0.1:1", check=False)
    assert r.returncode == 2 and "--reference-url needs --base-url" in r.stderr
    r = cli("bench", "serve", "--base-url", "127.0.0.1:8000", check=False)
    assert r.returncode == 2 and "--base-url must be an http(s) URL" in r.stderr
    r = cli("bench", "serve", "--base-url", "http://127.0.0.1:1", "--workloads", "single", check=False)
    assert r.returncode == 2 and "/v1/models: cannot read a model id" in r.stderr
