"""The server's logs, from a real server run: timestamps on every line, one access line per
chat request (id, status, prompt/output tokens, TTFT, e2e) for answered and refused requests,
a periodic stats line while serving, and --log-file carrying the same lines."""
from __future__ import annotations

import asyncio
import re
import time

import openai
import pytest

from fastdeploy_ext.entrypoints.openai import request_log

from .server_harness import ServerProc, chat, data_url, png_bytes, tiny_vl

TS = r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d{3} \[fastdeploy_ext\] (?:INFO|WARNING|ERROR|DEBUG) "
ACCESS = re.compile(TS + r"request (\S+) status=(\d+) prompt_tokens=(\d+) output_tokens=(\d+) "
                         r"ttft=(-|[\d.]+s) e2e=(-|[\d.]+s) finish=(\S+)$", re.M)
STATS = re.compile(TS + r"stats: prompt ([\d.]+) tok/s, generation ([\d.]+) tok/s, finished (\d+) \(([\d.]+) req/s\), "
                        r"running (\d+), waiting (\d+), preprocessing (\d+), KV ([\d.]+)% \((\d+)/(\d+) blocks\), "
                        r"GPU busy (n/a|\d+%)$", re.M)


def _wait_for(pred, what: str, srv, deadline_s: float = 60):
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        if pred():
            return
        time.sleep(0.1)
    raise AssertionError(f"{what} not logged:\n{srv.output}")


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    log_file = tmp_path_factory.mktemp("logs") / "server.log"
    srv = ServerProc("--log-file", str(log_file), "--log-stats-interval", "0.3").wait_healthy()
    yield srv, log_file
    srv.stop()


def test_access_and_stats_lines_from_a_real_run(served):
    srv, log_file = served
    client = openai.OpenAI(base_url=srv.url + "/v1", api_key="x")
    r = client.chat.completions.create(**chat(data_url(png_bytes(64, 48))), max_tokens=5, temperature=0,
                                       extra_body={"ignore_eos": True})
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(**{**chat(None), "model": "no-such-model"}, max_tokens=2)
    # tokens that arrive together may share one chunk (the stream sends what is ready), so the
    # count of tokens comes from the usage chunk, not from the number of chunks
    chunks = list(client.chat.completions.create(**chat(data_url(png_bytes(40, 40, 1))), max_tokens=3,
                                                 temperature=0, stream=True, stream_options={"include_usage": True},
                                                 extra_body={"ignore_eos": True}))
    assert chunks[-1].usage.completion_tokens == 3
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["length"]

    _wait_for(lambda: len(ACCESS.findall(srv.output)) >= 3, "three access lines", srv)
    lines = {m[0]: m for m in ACCESS.findall(srv.output) if m[0] != "-"}
    ok = lines[r.id]
    assert ok[1:4] == ("200", str(r.usage.prompt_tokens), "5") and ok[6] == "length"
    ttft, e2e = float(ok[4][:-1]), float(ok[5][:-1])
    assert 0 < ttft <= e2e
    refused = [m for m in ACCESS.findall(srv.output) if m[0] == "-"]
    assert [m[1:] for m in refused] == [("404", "0", "0", "-", "-", "model_not_found")]
    streamed = [m for k, m in lines.items() if k != r.id]
    assert len(streamed) == 1 and streamed[0][1:4] == ("200", streamed[0][2], "3")

    # the stats line of the interval that saw the traffic: tokens, finished requests, KV pool size
    # both answered requests counted once each over the lines (the 404 never reached the engine)
    _wait_for(lambda: sum(int(m[2]) for m in STATS.findall(srv.output)) >= 2, "stats lines counting 2 requests", srv)
    assert sum(int(m[2]) for m in STATS.findall(srv.output)) == 2
    busy = [m for m in STATS.findall(srv.output) if float(m[1]) > 0 or float(m[0]) > 0]
    assert busy[0][9] != "0" and busy[0][10] == "n/a"                     # KV blocks total; CPU: no busy reader

    # every line of the run is timestamped, and --log-file has the same access lines
    text = log_file.read_text()
    assert ACCESS.findall(text)[:3] == ACCESS.findall(srv.output)[:3]
    for line in text.splitlines():
        assert re.match(TS, line), line


def test_idle_server_logs_one_stats_line_then_stays_quiet(served):
    srv, _ = served
    n = len(STATS.findall(srv.output))
    time.sleep(1.5)                     # five intervals without traffic
    assert len(STATS.findall(srv.output)) - n <= 1


def test_stats_line_fields_and_busy_reader(caplog):
    """The line's arithmetic, and a busy reader that raises reads as n/a (the loop survives)."""
    class S:
        num_running, num_waiting, num_preprocessing, kv_blocks_used, kv_blocks_total, kv_usage = 2, 1, 0, 8, 64, 0.125
        prompt_tokens, generation_tokens, num_finished, num_aborted = 300, 50, 3, 1
    prev = request_log._Snapshot(10.0, 100, 10, 1)
    now = request_log._Snapshot(12.0, 300, 50, 4)
    line = request_log.stats_line(prev, now, S, 37.0)
    assert line == ("stats: prompt 100.0 tok/s, generation 20.0 tok/s, finished 3 (1.5 req/s), running 2, waiting 1, "
                    "preprocessing 0, KV 12.5% (8/64 blocks), GPU busy 37%")

    def boom():
        raise RuntimeError("nvml gone")
    calls = []

    def stats():
        calls.append(1)
        if len(calls) == 3:
            raise asyncio.CancelledError
        return S

    with caplog.at_level("INFO", logger="fastdeploy_ext.stats"), pytest.raises(asyncio.CancelledError):
        asyncio.run(request_log.stats_loop(stats, 0.01, boom))
    msgs = [r.getMessage() for r in caplog.records if r.name == "fastdeploy_ext.stats"]
    assert len(msgs) == 2 and all(m.endswith("GPU busy n/a") for m in msgs)
    assert "finished 4 " in msgs[0] and "finished 0 " in msgs[1]      # cumulative counters -> per-interval deltas


def test_log_file_unwritable_is_one_line_exit_2(tmp_path):
    from .test_cli import cli
    r = cli("serve", "--model", tiny_vl(), "--device", "cpu", "--log-file", tmp_path / "no" / "dir" / "x.log",
            check=False)
    assert r.returncode == 2 and "--log-file" in r.stderr and "Traceback" not in r.stderr
    r = cli("serve", "--load-format", "dummy", "--log-stats-interval", "-1", check=False)
    assert r.returncode == 2 and "--log-stats-interval must be >= 0" in r.stderr
