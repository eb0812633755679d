"""`fastdeploy-ext generate` (DESIGN.md section 5) and `bench generate`, as real subprocesses on
the shipped tiny generation model dir."""
from __future__ import annotations

import json

import pytest

from fastdeploy_ext.conformance.references import Manifest

from .test_cli import cli


@pytest.fixture(scope="module")
def tiny_vl():
    return Manifest.load().path("tiny_vl")


@pytest.fixture(scope="module")
def ref_images():
    return Manifest.load().files("images")


def test_generate_json_one_line_per_image_matches_transformers(tiny_vl, ref_images):
    expected = Manifest.load().json("generate_greedy")
    r = cli("generate", "--model", tiny_vl, "--image", ref_images[0], "--image", ref_images[1], "--prompt", "OCR:",
            "--max-tokens", "8", "--ignore-eos", "--temperature", "0", "--device", "cpu", "--dtype", "float32",
            "--json", "--kv-cache-memory", "16MiB", "--max-model-len", "512")
    lines = r.stdout.strip().splitlines()
    assert len(lines) == 2
    objs = [json.loads(line) for line in lines]
    assert all(set(o) == {"text", "token_ids", "prompt_token_ids"} for o in objs)
    assert [o["token_ids"] for o in objs] == expected["token_ids"][:2]
    assert all(isinstance(o["text"], str) and len(o["prompt_token_ids"]) > 8 for o in objs)
    assert "max prefill: True" in r.stderr and "KV pool:" in r.stderr        # choices logged with reasons


def test_generate_plain_text_and_errors(tiny_vl, ref_images, tmp_path):
    r = cli("generate", "--model", tiny_vl, "--image", ref_images[2], "--prompt", "OCR:", "--max-tokens", "3",
            "--device", "cpu", "--kv-cache-memory", "16MiB", "--max-model-len", "512")
    assert r.stdout.strip() != "" or r.stdout == "\n"
    bad = tmp_path / "bad.png"
    bad.write_bytes(b"not a png")
    r = cli("generate", "--model", tiny_vl, "--image", bad, "--prompt", "OCR:", "--max-tokens", "3",
            "--device", "cpu", "--kv-cache-memory", "16MiB", "--max-model-len", "512", check=False)
    assert r.returncode == 2 and "bad.png" in r.stderr and "Traceback" not in r.stderr
    r = cli("generate", "--model", tiny_vl, "--image", ref_images[0], "--prompt", "OCR:", "--device", "cpu",
            "--max-num-seqs", "0", check=False)
    assert r.returncode == 2 and "max-num-seqs" in r.stderr and "Traceback" not in r.stderr
    r = cli("generate", "--model", tiny_vl, "--image", ref_images[0], "--prompt", "OCR:", "--device", "cpu",
            "--kv-cache-memory", "1KiB", check=False)
    assert r.returncode == 2 and "max-model-len" in r.stderr


def test_bench_generate_cpu_reports_both_sides(tiny_vl, tmp_path):
    out = tmp_path / "gen.json"
    r = cli("bench", "generate", "--model", tiny_vl, "--device", "cpu", "--dtype", "float32", "--lines", "4",
            "--line-tokens", "4", "--page1-tokens", "4", "--kv-cache-memory", "32MiB", "--max-model-len", "2048",
            "--json-out", out)
    rep = json.loads(out.read_text())
    assert set(rep["workloads"]) == {"page1", "lines256"}
    p1 = rep["workloads"]["page1"]
    assert p1["ours"]["ttft_s"] > 0 and p1["reference"]["ttft_s"] > 0 and p1["same_tokens"] is True
    lines = rep["workloads"]["lines256"]
    assert lines["ours"]["requests"] == 4 and lines["same_tokens_fraction"] == 1.0
    assert rep["kv_blocks_used_at_end"] == 0
    assert "page1: TTFT" in r.stdout and "transformers" in r.stdout
