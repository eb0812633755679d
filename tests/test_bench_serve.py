"""`fastdeploy-ext bench serve` smoke run: both servers (ours and transformers behind the same
request stream) answer every request with exactly the requested output length; JSON written;
the client-side inter-token gaps (their computation on synthetic arrival times too); our server
twice with --compare-server-args."""
from __future__ import annotations

import json

import pytest

from fastdeploy_ext.bench.serve import Sample, _summary, chunk_token_counts, compare_ratios, token_gaps

from .server_harness import tiny_vl
from .test_cli import cli


def _assert_itl(res: dict, requests: int, tokens: int) -> None:
    """Every request's tokens but its first leave one gap; the figures ordered and non-negative.
    All of them may be 0: a server that delivers a request's few tokens in one chunk (the tiny
    model outrunning a busy client) leaves zero gaps, which token_gaps counts as such."""
    assert res["itl_gaps"] == requests * (tokens - 1), res
    assert 0 <= res["itl_p50_ms"] <= res["itl_p95_ms"] <= res["itl_p99_ms"] <= res["itl_max_ms"], res


def test_token_gaps_single_and_multi_token_chunks():
    # chunks at 1.0 (1 token), 1.5 (3 tokens), 1.6 (1), 2.6 (2): the 3-token chunk is one 0.5 s gap
    # and two zero gaps, the last one 1.0 s and one zero
    gaps = token_gaps([1.0, 1.5, 1.6, 2.6], [1, 3, 1, 2])
    assert gaps == pytest.approx([0.5, 0.0, 0.0, 0.1, 1.0, 0.0])
    assert len(gaps) == 7 - 1
    # a first chunk of 2 tokens: one zero gap, nothing before it (its wait is the TTFT)
    assert token_gaps([3.0, 3.25], [2, 1]) == pytest.approx([0.0, 0.25])
    # a chunk with no token (a bare finish chunk) is skipped: the next gap runs from the last token
    assert token_gaps([0.0, 0.1, 0.4], [1, 0, 1]) == pytest.approx([0.4])
    assert token_gaps([], []) == [] and token_gaps([5.0], [1]) == []


def test_chunk_token_counts_from_usage_or_reconciled_with_the_total():
    # running usage on every chunk: the differences
    assert chunk_token_counts([1, 4, 5, 7], 7) == [1, 3, 1, 2]
    # no per-chunk usage: one token each, the final total's surplus on the last chunk ...
    assert chunk_token_counts([None, None, None], 5) == [1, 1, 3]
    # ... which gives the same gaps as the surplus anywhere else
    t = [0.0, 0.2, 0.5]
    assert sorted(token_gaps(t, [1, 1, 3])) == pytest.approx(sorted(token_gaps(t, [3, 1, 1])))
    # more chunks than tokens: the trailing ones hold none
    assert chunk_token_counts([None, None, None], 2) == [1, 1, 0]
    # no total: one each; mixed usage (some chunks without) falls back too
    assert chunk_token_counts([None, None], None) == [1, 1]
    assert chunk_token_counts([1, None, 3], 3) == [1, 1, 1]


def test_summary_pools_gaps_and_ratios():
    s = [Sample(True, 1.0, 0.1, 3, gaps_s=[0.01, 0.02], counts_from_usage=True),
         Sample(True, 1.0, 0.1, 3, gaps_s=[0.0, 0.3], counts_from_usage=False)]
    out = _summary(s, 2.0, 3)
    assert out["itl_gaps"] == 4 and out["itl_max_ms"] == pytest.approx(300.0)
    assert out["itl_p50_ms"] == pytest.approx(20.0) and out["itl_token_counts"].startswith("chunks")
    assert "itl_gaps" not in _summary([Sample(False, 1.0, None, 0, "boom")], 1.0, 3)
    assert compare_ratios({"requests_per_s": 2.0, "itl_p99_ms": 0.0}, {"requests_per_s": 3.0, "itl_p99_ms": 5.0}) \
        == {"requests_per_s": 1.5}


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
            _assert_itl(res, n, 3)
        # the reference sends each chunk's running usage (continuous_usage_stats)
        assert rep["workloads"][wl]["reference"]["itl_token_counts"] == "usage"
        assert rep["workloads"][wl]["speedup_requests_per_s"] > 0
    assert "ours / transformers" in r.stdout and "ITL P50/P95/P99/max" in r.stdout


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
            _assert_itl(res["ours"], n, 3)
        assert f"server {srv.url}" in r.stdout
        # every request the bench sent reached the server (its access lines): 2 + 4 timed, one
        # warm-up per workload
        assert srv.output.count("status=200 ") == 2 + 4 + 2
        r = cli("bench", "serve", "--base-url", srv.url, "--reference-url", srv.url, "--workloads", "single",
                "--single-requests", "1", "--output-tokens", "2", "--image-size", "64x48", "--model-name", "ocr-tiny")
        assert "reference:" in r.stdout and "ours / reference: x" in r.stdout
    finally:
        srv.stop()


def test_bench_serve_compare_server_args_runs_ours_twice(tmp_path):
    """--compare-server-args: our server once with --server-args, once with the extra flags (each
    server's own log shows its mixed-steps decision), both sides' figures and the ratios b / a."""
    out = tmp_path / "cmp.json"
    r = cli("bench", "serve", "--model", tiny_vl(), "--no-reference", "--workloads", "c32", "--c32-requests", "4",
            "--output-tokens", "4", "--image-size", "64x48", "--server-args", "--max-model-len 1024 --no-mixed-steps",
            "--compare-server-args=--mixed-steps", "--json-out", out)
    rep = json.loads(out.read_text())
    assert rep["compare_server_args"] == ["--mixed-steps"] and rep["reference"] is None
    res = rep["workloads"]["c32"]
    assert set(res) == {"ours", "ours_b", "ratios_b_over_a"}
    for side in ("ours", "ours_b"):
        assert (res[side]["requests"], res[side]["failed"], res[side]["short_outputs"]) == (4, 0, 0)
        _assert_itl(res[side], 4, 4)
    ratios = res["ratios_b_over_a"]
    assert ratios["requests_per_s"] == pytest.approx(res["ours_b"]["requests_per_s"] / res["ours"]["requests_per_s"])
    assert "itl_p99_ms" in ratios and "ours_b / ours: requests_per_s x" in r.stdout
    assert "--no-mixed-steps:" in (tmp_path / "bench_serve_ours.log").read_text()
    b_log = (tmp_path / "bench_serve_ours_b.log").read_text()
    assert "--mixed-steps:" in b_log and "--no-mixed-steps:" not in b_log


def test_bench_serve_base_url_errors_exit_2():
    r = cli("bench", "serve", "--reference-url", "http://127.0.0.1:1", check=False)
    assert r.returncode == 2 and "--reference-url needs --base-url" in r.stderr
    r = cli("bench", "serve", "--base-url", "127.0.0.1:8000", check=False)
    assert r.returncode == 2 and "--base-url must be an http(s) URL" in r.stderr
    r = cli("bench", "serve", "--base-url", "http://127.0.0.1:1", "--workloads", "single", check=False)
    assert r.returncode == 2 and "/v1/models: cannot read a model id" in r.stderr
    r = cli("bench", "serve", "--base-url", "http://127.0.0.1:1", "--compare-server-args=--mixed-steps", check=False)
    assert r.returncode == 2 and "cannot be used with --base-url" in r.stderr
    r = cli("bench", "serve", "--load-format", "dummy", "--compare-server-args", " ", check=False)
    assert r.returncode == 2 and "--compare-server-args is empty" in r.stderr
