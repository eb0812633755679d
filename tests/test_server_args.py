"""`serve` start-up: FastDeploy's launch line, ignored flags, --config FILE.yaml, exit status 2
on bad flags (one clear line), and the engine watchdog (in-process, with the real engine)."""
from __future__ import annotations

import asyncio
import subprocess
import sys

import httpx
import pytest

from fastdeploy_ext.engine.errors import EngineDead
from fastdeploy_ext.entrypoints.openai import api_server, cli_args

from .server_harness import TINY_ARGS, tiny_vl

FASTDEPLOY_LINE = ["--model", "/models/PaddleOCR-VL", "--port", "8185", "--metrics-port", "8186",
                   "--max-model-len", "16384", "--max-num-batched-tokens", "16384",
                   "--gpu-memory-utilization", "0.8", "--max-num-seqs", "256"]


def parse(argv):
    p = api_server.build_parser()
    return p.parse_args(cli_args.expand_config_file(p, argv))


def test_fastdeploy_launch_line_parses_and_ignored_flags_are_named(caplog):
    ns = parse(FASTDEPLOY_LINE + ["--engine-worker-queue-port", "8187", "--enable-mm", "--workers", "2",
                                  "--tensor-parallel-size", "1", "--max-concurrency", "64"])
    assert (ns.port, ns.metrics_port, ns.max_num_seqs, ns.gpu_memory_utilization) == (8185, 8186, 256, 0.8)
    lines = cli_args.notice_ignored_flags(ns)
    assert lines == ["ignoring FastDeploy flag --engine-worker-queue-port=8187: no separate engine worker process",
                     "ignoring FastDeploy flag --workers=2: one API server process (the engine is in-process)",
                     "ignoring FastDeploy flag --enable-mm: multimodal is always on (PaddleOCR-VL)"]
    cfg = cli_args.server_config_from_args(ns, "m")
    assert (cfg.max_concurrency, cfg.request_timeout, cfg.max_body_bytes) == (64, 600.0, 64 * 1024 * 1024)


def test_config_file_keys_and_command_line_wins(tmp_path):
    f = tmp_path / "serve.yaml"
    f.write_text("max_num_seqs: 8\napi-key: from-file\nlimit_mm_per_prompt: {image: 2}\nport: 9000\n"
                 "served_model_name: [a, b]\n")
    ns = parse(["--config", str(f), "--port", "9100", "--load-format", "dummy"])
    assert (ns.max_num_seqs, ns.api_key, ns.port, ns.served_model_name) == (8, "from-file", 9100, ["a", "b"])
    assert ns.limit_mm_per_prompt == '{"image": 2}'          # dicts become the flag's JSON


@pytest.mark.parametrize("argv,needle", [
    (["--max-num-seqs", "abc"], "--max-num-seqs"),
    (["--bogus-flag"], "unrecognized arguments: --bogus-flag"),
    (["--port", "70000"], "port must be in"),
    (["--request-timeout", "0"], "--request-timeout"),
    (["--repetition-guard", "{nope"], "not valid JSON"),
])
def test_argparse_errors_exit_2(capsys, argv, needle):
    with pytest.raises(SystemExit) as e:
        parse(["--load-format", "dummy", *argv])
    assert e.value.code == 2 and needle in capsys.readouterr().err


@pytest.mark.parametrize("argv,needle", [
    (["--tensor-parallel-size", "2"], "only 1 is supported"),
    (["--allowed-local-media-path", "/nonexistent/dir"], "not a directory"),
    (["--repetition-guard", '{"min_span": 0}'], "min_span"),
    (["--limit-mm-per-prompt", "{bad"], "limit"),
    (["--max-num-seqs", "0"], "--max-num-seqs must be a positive integer"),
])
def test_bad_values_exit_2_with_one_line(capsys, argv, needle):
    assert api_server.main(["--load-format", "dummy", *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("python -m fastdeploy_ext.entrypoints.openai.api_server: error:")
    assert needle in err[-1]


@pytest.mark.parametrize("argv,needle", [
    (["--config", "/nonexistent.yaml"], "--config /nonexistent.yaml"),
    (["--config", "BAD"], "unknown key 'not_a_flag'"),
])
def test_config_errors_exit_2(tmp_path, capsys, argv, needle):
    (tmp_path / "bad.yaml").write_text("not_a_flag: 1\n")
    argv = [str(tmp_path / "bad.yaml") if a == "BAD" else a for a in argv]
    with pytest.raises(SystemExit) as e:
        parse(["--load-format", "dummy", *argv])
    assert e.value.code == 2 and needle in capsys.readouterr().err


def test_console_script_serve_is_the_same_code_path():
    r = subprocess.run([sys.executable, "-m", "fastdeploy_ext.entrypoints.cli", "serve", "--load-format", "dummy",
                        "--tensor-parallel-size", "4"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2
    assert r.stderr.strip().splitlines()[-1] == (
        "fastdeploy-ext serve: error: --tensor-parallel-size 4: only 1 is supported (one device per server; "
        "run one server per device behind a load balancer)")


def test_watchdog_dead_step_loop_turns_health_503_and_exits_1():
    state = api_server.build_state(parse(["--model", str(tiny_vl()), *TINY_ARGS, "--max-model-len", "512"]))

    async def scenario():
        await state.engine.start()
        state.engine_started = True
        app = api_server.build_app(state)
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
            assert (await c.get("/health")).status_code == 200

            def broken_step():
                raise RuntimeError("injected step failure")
            state.engine.engine.step = broken_step
            with pytest.raises(EngineDead):
                async for _ in state.engine.generate("r1", {"prompt": "OCR:"}, None):
                    pass
            await asyncio.wait_for(api_server._watchdog(state, period=0.01), 30)
            r = await c.get("/health")
            assert r.status_code == 503 and "injected step failure" in r.json()["reason"]
            r = await c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}]})
            assert r.status_code == 503 and r.json()["error"]["code"] == "engine_dead"
        assert state.exit_code == 1
        await state.engine.shutdown(drain=False)
    asyncio.run(scenario())


@pytest.mark.parametrize("flag,env,expected", [
    ("from-flag", {"FD_API_KEY": "fd", "VLLM_API_KEY": "vllm"}, ("from-flag", "--api-key")),
    (None, {"FD_API_KEY": "fd", "VLLM_API_KEY": "vllm"}, ("fd", "FD_API_KEY")),
    (None, {"VLLM_API_KEY": "vllm"}, ("vllm", "VLLM_API_KEY")),
    (None, {"FD_API_KEY": "", "VLLM_API_KEY": "vllm"}, ("vllm", "VLLM_API_KEY")),     # empty = unset
    (None, {}, (None, "none of --api-key, FD_API_KEY, VLLM_API_KEY is set")),
])
def test_api_key_sources_in_order(flag, env, expected):
    ns = parse(["--load-format", "dummy"] + (["--api-key", flag] if flag else []))
    assert cli_args.resolve_api_key(ns, environ=env) == expected


def test_empty_api_key_flag_is_an_error_not_auth_off(monkeypatch):
    with pytest.raises(cli_args.CliError, match="--api-key is empty"):
        cli_args.resolve_api_key(parse(["--load-format", "dummy", "--api-key", ""]), environ={})


def test_api_key_is_redacted_in_the_config_echo(tmp_path, caplog, monkeypatch):
    monkeypatch.delenv("FD_API_KEY", raising=False)
    monkeypatch.delenv("VLLM_API_KEY", raising=False)
    f = tmp_path / "serve.yaml"
    f.write_text("api_key: sk-secret-123\nport: 9000\n")
    with caplog.at_level("INFO"):
        ns = parse(["--config", str(f), "--load-format", "dummy"])
        cfg = cli_args.server_config_from_args(ns, "m")
    assert cfg.api_key == "sk-secret-123"
    assert "sk-secret-123" not in caplog.text
    assert "--api-key <redacted> --port 9000" in caplog.text and "API key: required, from --api-key" in caplog.text
    assert cli_args.redact_argv(["--api-key=k", "--api-key", "k", "--port", "1"]) == [
        "--api-key=<redacted>", "--api-key", "<redacted>", "--port", "1"]
