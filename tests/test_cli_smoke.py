"""Every `fastdeploy-ext` subcommand and every `bench` subcommand, end to end on tiny shapes (the
shipped tiny checkpoints, one small workload, --iters 1), plus the first-hour contract: one-line
errors with exit status 2 (missing model dir, missing extra, unmatched glob), `--version`,
`generate --image` with globs and directories, no "nan" in any report.

Commands covered in other files are named in COVERED_ELSEWHERE; test_every_subcommand_has_a_smoke
fails when a new subcommand appears without one."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap

import pytest

from fastdeploy_ext.conformance.references import Manifest

from .test_cli import cli

TINY = str(Manifest.load().path("tiny_torch"))
TINY_VL = str(Manifest.load().path("tiny_vl"))
CPU = ["--device", "cpu", "--dtype", "float32"]
ENGINE = ["--kv-cache-memory", "16MiB", "--max-model-len", "1024"]

# subcommand -> the test that runs it end to end
COVERED_ELSEWHERE = {
    "info": "tests/test_cli.py::test_info_prints_probe_and_plan_with_reasons",
    "encode": "tests/test_cli.py::test_encode_matches_transformers",
    "generate": "tests/test_cli_generate.py (and test_generate_images_globs_dirs_sources here)",
    "serve": "tests/test_serve_dummy.py, tests/test_server.py",
    "bench serve": "tests/test_bench_serve.py (own server and --base-url)",
    "detect": "tests/test_cli_detect.py",
    "bench detect": "tests/test_bench_detect.py",
    "parse": "tests/test_parse_e2e.py",
    "parse-status": "tests/test_parse_e2e.py::test_the_cli_contract_names_outputs_after_the_input_and_rejects_bad_flags",
    "bench parse": "tests/test_parse_e2e.py::test_bench_parse_command_with_the_stub_vlm_and_real_pdfs",
}
SMOKED_HERE = {"bench vision", "bench gemm", "bench generate", "bench preprocess", "bench attention", "bench layers"}


def test_every_subcommand_has_a_smoke():
    from fastdeploy_ext.entrypoints.cli import build_parser
    p = build_parser()
    sub = next(a for a in p._actions if a.dest == "command")
    names = set()
    for name, sp in sub.choices.items():
        inner = [a for a in sp._actions if a.dest == "bench_target"]
        names |= {f"{name} {n}" for n in inner[0].choices} if inner else {name}
    assert names == set(COVERED_ELSEWHERE) | SMOKED_HERE


def no_nan(text: str) -> None:
    assert not re.search(r"\bnan\b", text, re.I), text


def test_bench_vision_tiny(tmp_path):
    out = tmp_path / "v.json"
    r = cli("bench", "vision", "--model", TINY, *CPU, "--workloads", "block8x40", "--variants", "strided/host/eager",
            "--iters", "1", "--warmup", "0", "--json-out", out)
    no_nan(r.stdout)
    assert "peak n/a (CPU)" in r.stdout                # the reference's line on a CPU
    rows = json.loads(out.read_text())
    rows = rows["results"] if isinstance(rows, dict) else rows
    assert {row["variant"] for row in rows} >= {"transformers", "strided/host/eager"}
    assert all(row["ms"] > 0 for row in rows)


def test_bench_gemm_tiny(tmp_path):
    out = tmp_path / "g.json"
    r = cli("bench", "gemm", "--model", TINY, *CPU, "--tokens", "320", "--workload", "block8x40",
            "--iters", "1", "--warmup", "0", "--json-out", out)
    no_nan(r.stdout)
    res = json.loads(out.read_text())
    assert res["encoder"]["tokens"] == 320 and "320" in res["ceiling"] and res["onednn"]["reason"]
    assert "oneDNN on the encoder shapes (M=320)" in r.stdout


def test_bench_generate_tiny_warms_up_only_requested_shapes(tmp_path):
    out = tmp_path / "gen.json"
    r = cli("bench", "generate", "--model", TINY_VL, *CPU, *ENGINE, "--workloads", "lines256", "--lines", "2",
            "--line-tokens", "2", "--no-reference", "--json-out", out)
    no_nan(r.stdout)
    assert "warm-up with 1 image(s) (line)" in r.stderr
    assert "bench generate: 100%" in r.stderr and "2/2" in r.stderr          # the progress bar on stderr
    rep = json.loads(out.read_text())
    assert rep["workloads"]["lines256"]["ours"]["requests"] == 2 and rep["kv_blocks_used_at_end"] == 0


def test_bench_generate_blocks_and_lines512_tiny(tmp_path):
    """The document-shaped workloads on the CPU at test size, and honest about it: 1 page of the
    first 5 crops (one of each kind) at 5% of the output lengths, 3 line crops x 2 tokens; the
    host device API has no profiler activity, so --profile says n/a rather than a figure."""
    out = tmp_path / "gen.json"
    r = cli("bench", "generate", "--model", TINY_VL, *CPU, "--kv-cache-memory", "16MiB",
            "--max-model-len", "4096",          # the released max_pixels needs this much context
            "--workloads", "blocks,lines512", "--pages", "1", "--crops-per-page", "5", "--block-token-scale", "0.05",
            "--lines512", "3", "--lines512-tokens", "2", "--profile", "--no-reference", "--json-out", out)
    no_nan(r.stdout)
    assert "warm-up with 6 image(s) (blocks, line)" in r.stderr
    rep = json.loads(out.read_text())
    b, ln = rep["workloads"]["blocks"]["ours"], rep["workloads"]["lines512"]["ours"]
    assert b["requests"] == 5 and b["pages"] == 1 and b["crops_per_page"] == 5
    assert {k: (v["requests"], v["tokens"], v["priority"]) for k, v in b["kinds"].items()} == {
        "title": (1, 1, 0), "paragraph": (1, 6, -1), "table": (1, 30, -2), "formula": (1, 3, 0), "caption": (1, 2, 0)}
    assert b["output_tokens"] == 1 + 6 + 30 + 3 + 2 and ln["requests"] == 3 and ln["output_tokens"] == 6
    assert b["pixels"] == "released min_pixels 147384, max_pixels 2822400"
    for o in (b, ln):
        steps = o["steps"]
        assert steps["prefill"]["count"] == o["stages"]["prefill_steps"] >= 1
        assert steps["decode"]["count"] == o["stages"]["decode_steps"] >= 1
        assert steps["prefill"]["total_s"] > 0 and steps["decode"]["median_s"] > 0
        assert o["device_active_fraction"] is None and o["device_active"].startswith("n/a: the host device API")
        assert o["kv_blocks_used_after"] == 0
    assert rep["workloads"]["blocks"]["reference_skipped"].startswith("not run for blocks")
    assert "blocks: 1 pages x 5 crops = 5 req" in r.stdout and "priority: table -2, paragraph -1" in r.stdout
    assert re.search(r"steps: prefill \d+ steps, [\d.]+ s, median [\d.]+ ms \| decode \d+ steps", r.stdout)
    assert rep["kv_blocks_used_at_end"] == 0


def test_block_pages_have_the_parsing_mix():
    from PIL import Image
    import io
    from fastdeploy_ext.bench.generate import block_requests
    reqs = block_requests(2)
    assert len(reqs) == 32
    page = reqs[:16]
    count = {k: sum(r.kind == k for r in page) for k in ("title", "paragraph", "table", "formula", "caption")}
    assert count == {"title": 2, "paragraph": 9, "table": 1, "formula": 2, "caption": 2}
    table = next(r for r in page if r.kind == "table")
    assert (table.prompt, table.tokens, table.priority) == ("Table Recognition:", 600, -2)
    assert Image.open(io.BytesIO(table.image)).size == (1000, 600)
    assert {r.prompt for r in page if r.kind == "formula"} == {"Formula Recognition:"}
    assert sum(r.tokens for r in page) == 2 * 16 + 9 * 120 + 600 + 2 * 60 + 2 * 40
    assert len({r.image for r in reqs}) == 32                 # every crop a different image


def test_device_active_is_the_union_of_device_intervals():
    from types import SimpleNamespace as NS
    from torch.autograd import DeviceType
    from fastdeploy_ext.bench.generate import device_active_s, interval_union_s
    assert interval_union_s([(0, 2), (1, 3), (5, 6), (5.5, 5.7)]) == 4
    ev = lambda dev, a, b: NS(device_type=dev, time_range=NS(start=a, end=b))  # noqa: E731
    prof = NS(events=lambda: [ev(DeviceType.CUDA, 0, 1e6), ev(DeviceType.CUDA, 5e5, 2e6),
                              ev(DeviceType.CPU, 0, 9e6), ev(DeviceType.CUDA, 3e6, 3.5e6)])
    assert device_active_s(prof) == 2.5                       # host events are not device time


def test_warmup_images_follow_the_workloads():
    from PIL import Image
    import io
    from fastdeploy_ext.bench.generate import warmup_images
    sizes = lambda wl: [Image.open(io.BytesIO(imgs[0])).size for imgs in warmup_images(wl)]  # noqa: E731
    assert sizes(("lines256",)) == [Image.open(io.BytesIO(warmup_images(("lines256",))[0][0])).size]
    assert sizes(("lines256",))[0][1] < 200                         # a text line, not a page
    assert sizes(("page1", "pages64")) == [(1920, 1080)]
    assert len(warmup_images(("page1", "lines256"))) == 2


def test_bench_preprocess_tiny():
    r = cli("bench", "preprocess", "--images", "2", "--size", "64x96", "--workers", "1,2", "--iters", "1",
            "--warmup", "0", "--no-reference")
    no_nan(r.stdout)
    assert re.search(r"ours\s+thread-pool\s+workers\s+2:.*images/s", r.stdout), r.stdout


@pytest.mark.parametrize("target", ["attention", "layers"])
def test_cuda_only_benches_say_so_in_one_line_on_cpu(target):
    import torch
    if torch.cuda.is_available():
        pytest.skip("CUDA present: the bench runs (cuda legs)")
    r = cli("bench", target, check=False)
    assert r.returncode == 2
    errors = [ln for ln in r.stderr.splitlines() if "error" in ln]
    assert len(errors) == 1 and "CUDA" in errors[0] and errors[0].startswith(f"fastdeploy-ext bench {target}: error:")
    assert "Traceback" not in r.stderr


def test_version():
    from fastdeploy_ext import __version__
    r = cli("--version")
    assert r.stdout.strip() == f"fastdeploy-ext {__version__}"


@pytest.mark.parametrize("argv", [["generate", "--model", "/nonexistent", "--image", "x.png", "--prompt", "OCR:"],
                                  ["serve", "--model", "/nonexistent"],
                                  ["encode", "--model", "/nonexistent", "--image", "x.png", "--output", "o.st"]])
def test_missing_model_dir_is_one_line_exit_2(argv):
    r = cli(*argv, check=False)
    assert r.returncode == 2, r.stderr
    errors = [ln for ln in r.stderr.splitlines() if ": error:" in ln]
    assert errors == [errors[0]] and "--model /nonexistent: does not exist" in errors[0], r.stderr
    assert "Traceback" not in r.stderr


BLOCKER = textwrap.dedent('''
    import importlib.abc, os, sys
    BLOCKED = os.environ["FDX_BLOCK_MODULES"].split(",")
    class _Block(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in BLOCKED:
                raise ModuleNotFoundError(f"No module named {name!r}", name=name)
    sys.meta_path.insert(0, _Block())
''')


def cli_without(modules: str, *args, tmp_path):
    """The CLI in a subprocess where importing any of ``modules`` fails as if not installed
    (a sitecustomize on PYTHONPATH installs the blocker before anything else runs)."""
    (tmp_path / "sitecustomize.py").write_text(BLOCKER)
    env = {**os.environ, "FDX_BLOCK_MODULES": modules,
           "PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([sys.executable, "-m", "fastdeploy_ext.entrypoints.cli", *map(str, args)],
                          capture_output=True, text=True, timeout=300, env=env)


def test_missing_serve_extra_is_one_line(tmp_path):
    r = cli_without("fastapi,uvicorn,starlette", "serve", "--load-format", "dummy", tmp_path=tmp_path)
    assert r.returncode == 2 and re.fullmatch(
        r"fastdeploy-ext serve: error: needs the \[serve\] extra \((fastapi|uvicorn|starlette) is not installed\): "
        r"pip install 'fastdeploy_ext\[serve\]'", r.stderr.strip()), r.stderr


def test_commands_other_than_serve_need_no_serve_extra(tmp_path):
    # the parser of every subcommand is built up front: serve's flags must not import the server
    r = cli_without("fastapi,uvicorn,starlette", "bench", "parse", "--help", tmp_path=tmp_path)
    assert r.returncode == 0 and "--pages" in r.stdout, r.stderr[-2000:]


def test_missing_transformers_for_bench_vision_is_one_line(tmp_path):
    r = cli_without("transformers", "bench", "vision", "--model", TINY, *CPU, "--workloads", "block8x40",
                    tmp_path=tmp_path)
    assert r.returncode == 2 and r.stderr.strip().splitlines()[-1] == (
        "fastdeploy-ext bench vision: error: needs the [test] extra (transformers is not installed): "
        "pip install 'fastdeploy_ext[test]' (or --no-reference: ours only)"), r.stderr
    assert "Traceback" not in r.stderr


def test_other_missing_module_keeps_its_traceback(tmp_path):
    """Only the extras' modules get the one-line answer; a missing core module is a broken
    install and must show where it failed."""
    r = cli_without("safetensors", "bench", "vision", "--model", TINY, *CPU, "--workloads", "block8x40",
                    "--no-reference", tmp_path=tmp_path)
    assert r.returncode == 1 and "Traceback" in r.stderr and "safetensors" in r.stderr


def _png(path, w, h, color):
    from PIL import Image
    Image.new("RGB", (w, h), color).save(path)
    return str(path)


def test_image_args_expand_in_order_and_literal_names_win(tmp_path):
    from fastdeploy_ext.entrypoints.args import CliError
    from fastdeploy_ext.entrypoints.cli import expand_image_args
    d = tmp_path / "d"
    d.mkdir()
    for n in ("b.png", "a.JPG", "x.txt"):
        (d / n).write_bytes(b"")
    odd = tmp_path / "page[1].png"          # glob characters in a real file's name
    odd.write_bytes(b"")
    assert expand_image_args([str(odd), str(d), "data:image/png;base64,AA==", "missing.png"]) == [
        str(odd), str(d / "a.JPG"), str(d / "b.png"), "data:image/png;base64,AA==", "missing.png"]
    with pytest.raises(CliError, match="the pattern matches no file"):
        expand_image_args([str(tmp_path / "*.tif")])


def test_generate_images_globs_dirs_sources(tmp_path):
    scans = tmp_path / "scans"
    scans.mkdir()
    a = _png(scans / "a.png", 56, 56, "red")
    b = _png(scans / "b.png", 28, 28, "blue")
    (scans / "notes.txt").write_text("not an image")
    c = _png(tmp_path / "c.png", 28, 28, "green")
    r = cli("generate", "--model", TINY_VL, *CPU, *ENGINE, "--prompt", "OCR:", "--max-tokens", "2", "--json",
            "--image", str(tmp_path / "c.png"), str(scans / "*.png"), "--image", str(scans))
    lines = [json.loads(ln) for ln in r.stdout.splitlines()]
    assert [ln["source"] for ln in lines] == [c, a, b, a, b]
    assert all(len(ln["token_ids"]) == 2 and "text" in ln and ln["prompt_token_ids"] for ln in lines)
    assert lines[1]["prompt_token_ids"] == lines[3]["prompt_token_ids"]           # same file, same prompt
    assert lines[1]["prompt_token_ids"] != lines[2]["prompt_token_ids"]           # 4 vs 1 image tokens
    # the progress bar is drawn on a terminal only (tests/test_llm_api.py), never into this pipe
    assert "Processed prompts" not in r.stderr and "5 prompt" not in r.stdout
    r = cli("generate", "--model", TINY_VL, *CPU, "--prompt", "OCR:", "--image", str(tmp_path / "*.jpg"), check=False)
    assert r.returncode == 2 and r.stderr.strip().splitlines()[-1] == (
        f"fastdeploy-ext generate: error: --image {tmp_path / '*.jpg'}: the pattern matches no file")
    empty = tmp_path / "empty"
    empty.mkdir()
    r = cli("generate", "--model", TINY_VL, *CPU, "--prompt", "OCR:", "--image", empty, check=False)
    assert r.returncode == 2 and "directory has no image files" in r.stderr
