"""`fastdeploy-ext bench serve --workloads parse` end to end on the CPU with tiny models (2 jobs x
2 pages): the in-process bench parse, then our server through the job API, the report's fields
and the printed lines. Nothing here checks a speed; the figures must exist and add up."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from . import pp_doclayout_fixture as fx
from .server_harness import tiny_vl

TINY_PARSE = "--max-new-tokens 8 --block-max-pixels 12544 --render-workers 1 --max-pages-in-flight 4 " \
             "--max-model-len 1024 --kv-cache-memory 16MiB"


def test_bench_serve_parse_reports_both_sides_and_their_ratio(tmp_path):
    fx.write_model(tmp_path / "layout")
    out = tmp_path / "report.json"
    cmd = [sys.executable, "-m", "fastdeploy_ext.entrypoints.cli", "bench", "serve", "--workload", "parse",
           "--model", str(tiny_vl()), "--device", "cpu", "--dtype", "float32", "--layout-model",
           str(tmp_path / "layout"), "--parse-jobs", "2", "--parse-pages", "2", "--parse-in-process-pages", "3",
           "--parse-args", TINY_PARSE,
           "--startup-timeout", "300", "--json-out", str(out)]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=800, cwd=tmp_path,
                       env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-5000:]
    rep = json.loads(out.read_text())
    assert (rep["workload"], rep["jobs"], rep["pages_per_job"], rep["concurrency"], rep["in_process_pages"]) == \
        ("parse", 2, 2, 2, 3)
    r = rep["workloads"]["parse"]
    served, inproc = r["ours"], r["in_process"]
    assert (served["jobs"], served["pages"], served["failed"]) == (2, 4, 0), served
    assert (inproc["pages"], inproc["failed"]) == (3, 0), inproc       # the first 3 of the 2 x 2 pages
    assert served["pages_per_s"] == pytest.approx(4 / served["wall_s"], rel=1e-2)
    assert 0 < served["wall_s"] <= served["client_wall_s"]
    assert r["ratio_served_over_in_process"] == pytest.approx(served["pages_per_s"] / inproc["pages_per_s"])
    assert "served (job API, server clock):" in p.stdout and "in-process (bench parse):" in p.stdout
    assert f"served / in-process: {r['ratio_served_over_in_process']:.3f}" in p.stdout
    # both logs are next to the report; the server's shows the jobs it ran (2 + the warm-up)
    server_log = (tmp_path / "bench_serve_parse_server.log").read_text()
    assert server_log.count("jobs: accepted") == 3 and (tmp_path / "bench_serve_parse_in_process.log").is_file()


def test_parse_runs_alone_and_needs_our_server(capsys):
    from fastdeploy_ext.entrypoints.cli import main
    assert main(["bench", "serve", "--workloads", "parse,c32", "--load-format", "dummy"]) != 0
    assert "parse runs alone" in capsys.readouterr().err
    assert main(["bench", "serve", "--workloads", "parse", "--base-url", "http://127.0.0.1:1"]) != 0
    assert "cannot be used with --base-url" in capsys.readouterr().err
    assert main(["bench", "serve", "--workloads", "parse", "--load-format", "dummy", "--parse-jobs", "0"]) != 0
    assert "--parse-jobs must be >= 1" in capsys.readouterr().err
