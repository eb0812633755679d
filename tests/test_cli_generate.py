"""`fastdeploy-ext generate` (DESIGN.md section 5) and `bench generate` on the shipped tiny
generation model dir. One real subprocess for the JSON contract; the rest runs `cli.main` in
this process (same code path, without paying an interpreter start per case)."""
from __future__ import annotations

import json

import pytest

from fastdeploy_ext.conformance.references import Manifest
from fastdeploy_ext.entrypoints import cli as cli_mod

from .test_cli import cli

SMALL = ["--device", "cpu", "--kv-cache-memory", "16MiB", "--max-model-len", "512"]


@pytest.fixture(scope="module")
def refs():
    return Manifest.load()


def test_generate_json_one_line_per_image_matches_transformers(refs):
    expected = refs.json("generate_greedy")
    imgs = refs.files("images")
    r = cli("generate", "--model", refs.path("tiny_vl"), "--image", imgs[0], "--image", imgs[1], "--prompt", "OCR:",
            "--max-tokens", "8", "--ignore-eos", "--temperature", "0", "--dtype", "float32", "--json", *SMALL)
    objs = [json.loads(line) for line in r.stdout.strip().splitlines()]
    assert len(objs) == 2
    assert all(set(o) == {"source", "text", "token_ids", "prompt_token_ids"} for o in objs)
    assert [o["source"] for o in objs] == [str(imgs[0]), str(imgs[1])]
    assert [o["token_ids"] for o in objs] == expected["token_ids"][:2]
    assert all(isinstance(o["text"], str) and len(o["prompt_token_ids"]) > 8 for o in objs)
    assert "max prefill: True" in r.stderr and "KV pool:" in r.stderr        # choices logged with reasons


@pytest.mark.parametrize("flags, match", [
    (["--max-num-seqs", "0"], "max-num-seqs"),
    (["--kv-cache-memory", "1KiB"], "max-model-len"),
    (["--limit-mm-per-prompt", "{\"video\": 1}"], "limit-mm-per-prompt"),
    (["--top-p", "1.5"], "top_p"),
])
def test_generate_bad_flags_are_one_line_errors(refs, flags, match, capsys):
    argv = ["generate", "--model", str(refs.path("tiny_vl")), "--image", str(refs.files("images")[0]),
            "--prompt", "OCR:", "--device", "cpu", *flags]
    assert cli_mod.main(argv) == 2
    err = capsys.readouterr().err
    assert match in err and "Traceback" not in err


def test_generate_bad_image_names_it(refs, tmp_path, capsys):
    bad = tmp_path / "bad.png"
    bad.write_bytes(b"not a png")
    argv = ["generate", "--model", str(refs.path("tiny_vl")), "--image", str(bad), "--prompt", "OCR:",
            "--max-tokens", "3", *SMALL]
    assert cli_mod.main(argv) == 2
    assert "bad.png" in capsys.readouterr().err


def test_bench_generate_cpu_reports_both_sides(refs, tmp_path, capsys):
    out = tmp_path / "gen.json"
    argv = ["bench", "generate", "--model", str(refs.path("tiny_vl")), "--device", "cpu", "--dtype", "float32",
            "--lines", "4", "--line-tokens", "4", "--page1-tokens", "4", "--kv-cache-memory", "32MiB",
            "--max-model-len", "2048", "--json-out", str(out)]
    assert cli_mod.main(argv) == 0
    rep = json.loads(out.read_text())
    assert set(rep["workloads"]) == {"page1", "lines256"} and rep["reference_weights"] == "same as ours"
    p1 = rep["workloads"]["page1"]
    assert p1["ours"]["ttft_s"] > 0 and p1["reference"]["ttft_s"] > 0 and p1["same_tokens"] is True
    lines = rep["workloads"]["lines256"]
    assert lines["ours"]["requests"] == 4 and lines["same_tokens_fraction"] == 1.0
    assert rep["kv_blocks_used_at_end"] == 0
    # where the time went: the 4 lines are admitted as their preprocessing finishes (1 to 4
    # prefill steps, one packed vision pass each), then at least 3 decode steps (4 tokens, the
    # first from the prefill); the parts add up to the wall
    st, o = lines["ours"]["stages"], lines["ours"]
    assert 1 <= st["prefill_steps"] == st["vision_passes"] <= 4 and st["decode_steps"] >= 3
    assert abs(st["prefill_s"] + st["decode_s"] + st["other_s"] - o["wall_s"]) < 1e-6
    assert st["preprocess_worker_s"] > 0 and 0 < o["ttft_s"] < o["wall_s"]
    printed = capsys.readouterr().out
    assert "page1: TTFT" in printed and "stages: prefill " in printed


def test_bench_generate_pages_of_a_given_size_report_the_decode_batch(refs, tmp_path, capsys):
    out = tmp_path / "pages.json"
    argv = ["bench", "generate", "--model", str(refs.path("tiny_vl")), "--device", "cpu", "--dtype", "float32",
            "--workloads", "pages64", "--pages", "3", "--page-tokens", "8", "--page-size", "224x160",
            "--no-reference", "--kv-cache-memory", "32MiB", "--max-model-len", "2048", "--json-out", str(out)]
    assert cli_mod.main(argv) == 0
    rep = json.loads(out.read_text())
    assert rep["page_size"] == "224x160"
    o = rep["workloads"]["pages64"]["ours"]
    assert o["requests"] == 3 and o["output_tokens"] == 3 * 8
    # every decode step ran the requests running at its start: the 3 pages together once all
    # are prefilled (8 tokens each leaves several decode steps after the last prefill)
    assert o["decode_batch"]["max"] == 3 and 1 <= o["decode_batch"]["median"] <= 3
    assert "decode batch median" in capsys.readouterr().out


@pytest.mark.parametrize("size, match", [("224", "WxH"), ("12x900", "16..10000"), ("axb", "WxH")])
def test_bench_generate_bad_page_size_is_a_usage_error(refs, size, match, capsys):
    argv = ["bench", "generate", "--model", str(refs.path("tiny_vl")), "--device", "cpu", "--workloads", "pages64",
            "--page-size", size, "--no-reference"]
    assert cli_mod.main(argv) == 2
    err = capsys.readouterr().err
    assert "--page-size" in err and match in err and "Traceback" not in err


def test_generate_with_dummy_weights_needs_no_model_dir(refs, tmp_path):
    """Issue 8's "done when" as a fresh clone does it: the released 0.9B shapes with random weights
    and the built-in byte-level tokenizer, on the CPU; the released template's ids around the
    image (start 101305, h*w/4 placeholders 100295, end 101306) and exactly the tokens asked for."""
    from fastdeploy_ext.models.paddleocr_vl.processor import ImageProcessor
    img = refs.files("images")[0]
    r = cli("generate", "--load-format", "dummy", "--image", img, "--prompt", "OCR:", "--max-tokens", "3",
            "--ignore-eos", "--temperature", "0", "--json", "--device", "cpu", "--kv-cache-memory", "128MiB",
            "--max-model-len", "2048")
    (obj,) = [json.loads(line) for line in r.stdout.strip().splitlines()]
    assert len(obj["token_ids"]) == 3 and isinstance(obj["text"], str)
    _, h, w = ImageProcessor().preprocess(img).grid_thw
    ids = obj["prompt_token_ids"]
    start, end = ids.index(101305), ids.index(101306)
    assert ids[start + 1:end] == [100295] * (h * w // 4) and ids[0] == 1


def test_generate_reports_a_failed_image_alone_and_exits_1(refs, monkeypatch, capsys):
    """One image's request fails in the engine (its output step raises): the other image is still
    printed, the failed one is a line on stderr naming it, and the exit status says so."""
    from fastdeploy_ext.engine.output_processor import OutputProcessor
    imgs = refs.files("images")
    real = OutputProcessor.append_token

    def append_token(self, seq, *a, **kw):
        if seq.prompt.items and seq.prompt.items[0].source == str(imgs[1]):
            raise RuntimeError("injected output failure")
        return real(self, seq, *a, **kw)
    monkeypatch.setattr(OutputProcessor, "append_token", append_token)
    argv = ["generate", "--model", str(refs.path("tiny_vl")), "--image", str(imgs[0]), "--image", str(imgs[1]),
            "--prompt", "OCR:", "--max-tokens", "4", "--ignore-eos", "--temperature", "0", "--dtype", "float32",
            "--json", *SMALL]
    assert cli_mod.main(argv) == 1
    out, err = capsys.readouterr()
    objs = [json.loads(line) for line in out.strip().splitlines()]
    assert [o["source"] for o in objs] == [str(imgs[0])]
    assert objs[0]["token_ids"] == refs.json("generate_greedy")["token_ids"][0][:4]
    assert f"error: {imgs[1]}: " in err and "injected output failure" in err
