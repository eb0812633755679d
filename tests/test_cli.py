"""The `fastdeploy-ext` command line, run as a real subprocess (the contract of DESIGN.md s5)."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from fastdeploy_ext.conformance.tiny_model import reference_image_features
from fastdeploy_ext.models.paddleocr_vl.processor import ImageProcessor, PreprocessorConfig


def cli(*args, check=True, env=None):
    import os
    r = subprocess.run([sys.executable, "-m", "fastdeploy_ext.entrypoints.cli", *map(str, args)],
                       capture_output=True, text=True, timeout=300, env={**os.environ, **(env or {})})
    if check and r.returncode != 0:
        raise AssertionError(f"rc={r.returncode}\nstdout:{r.stdout}\nstderr:{r.stderr}")
    return r


@pytest.mark.parametrize("layout", ["torch", "paddle"])
def test_encode_matches_transformers(layout, tiny_dirs, png_files, tmp_path):
    out = tmp_path / "feats.safetensors"
    r = cli("encode", "--model", tiny_dirs[layout], *sum([["--image", p] for p in png_files], []),
            "--device", "cpu", "--dtype", "float32", "--output", out)
    assert "row=cpu" in r.stderr and "qkv_layout" in r.stderr          # plan printed at start-up
    got = load_file(str(out))
    assert sorted(got) == ["grid_thw", "image_0", "image_1", "image_2"]
    proc = ImageProcessor(PreprocessorConfig.from_model_dir(tiny_dirs[layout]))
    imgs = [proc.preprocess(p) for p in png_files]
    grids = [im.grid_thw for im in imgs]
    assert got["grid_thw"].dtype == torch.int64 and got["grid_thw"].tolist() == [list(g) for g in grids]
    ref = reference_image_features(tiny_dirs["torch"], torch.cat([im.pixel_values for im in imgs]), grids)
    for i, r_i in enumerate(ref):
        o = got[f"image_{i}"]
        assert o.dtype == torch.float32 and o.shape == r_i.shape == (grids[i][1] * grids[i][2] // 4, 64)
        assert float((o - r_i).abs().max()) <= 1e-4


def test_encode_bf16_writes_compute_dtype(tiny_dirs, png_files, tmp_path):
    out = tmp_path / "bf16.safetensors"
    cli("encode", "--model", tiny_dirs["torch"], "--image", png_files[0], "--device", "cpu", "--dtype", "bfloat16",
        "--output", out)
    assert load_file(str(out))["image_0"].dtype == torch.bfloat16


@pytest.mark.parametrize("kind", ["missing", "empty", "corrupt", "tiny_aspect"])
def test_encode_bad_image_is_one_clear_line(kind, tiny_dirs, tmp_path):
    from PIL import Image
    bad = tmp_path / f"{kind}.png"
    if kind == "empty":
        bad.write_bytes(b"")
    elif kind == "corrupt":
        bad.write_bytes(b"\x89PNG\r\n\x1a\nthis is not a png")
    elif kind == "tiny_aspect":
        Image.new("RGB", (1, 300)).save(bad)
    r = cli("encode", "--model", tiny_dirs["torch"], "--image", bad, "--device", "cpu", "--output",
            tmp_path / "x.safetensors", check=False)
    assert r.returncode == 2
    assert "Traceback" not in r.stderr
    assert bad.name in r.stderr and "error" in r.stderr
    assert not (tmp_path / "x.safetensors").exists()


def test_encode_needs_model_or_dummy(png_files, tmp_path):
    r = cli("encode", "--image", png_files[0], "--output", tmp_path / "x.safetensors", check=False)
    assert r.returncode == 2 and "--model" in r.stderr and "Traceback" not in r.stderr


def test_unknown_flag_and_bad_choice_are_usage_errors(tmp_path):
    assert cli("encode", "--bogus", check=False).returncode == 2
    r = cli("info", "--dtype", "float64", check=False)
    assert r.returncode == 2 and "invalid choice" in r.stderr


def test_absent_device_is_a_clear_error():
    r = cli("info", "--device", "cuda", check=False)
    if torch.cuda.is_available():
        pytest.fail("this test expects a machine without CUDA")
    assert r.returncode == 2 and "not present" in r.stderr and "Traceback" not in r.stderr


def test_impossible_plan_names_the_row():
    r = cli("info", "--device", "cpu", "--graph-optimization-config", '{"use_cudagraph": true}', check=False)
    assert r.returncode == 2 and "row cpu" in r.stderr
    r = cli("info", "--device", "cpu", "--graph-optimization-config", '{"use_cudagraf": true}', check=False)
    assert r.returncode == 2 and "unknown keys" in r.stderr


def test_fused_layers_flag():
    r = cli("info", "--device", "cpu", "--fused-layers", "on", check=False)
    assert r.returncode == 2 and "row cpu does not support fused layers" in r.stderr
    r = cli("info", "--device", "cpu", "--fused-layers", "sometimes", check=False)
    assert r.returncode == 2 and "invalid choice" in r.stderr
    r = cli("info", "--device", "cpu", "--fused-layers", "off")
    assert "fused_layers    = False" in r.stdout and "(requested)" in r.stdout


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="checks the no-GPU message")
def test_micro_benchmarks_without_a_gpu_say_so():
    for target in ("layers", "attention"):
        r = cli("bench", target, check=False)
        assert r.returncode == 2 and "CUDA" in r.stderr, (target, r.stderr)
    r = cli("bench", "layers", "--tokens", "1,x", check=False)
    assert r.returncode == 2 and "--tokens" in r.stderr
    r = cli("bench", "attention", "--workloads", "page,nope", check=False)
    assert r.returncode == 2 and "unknown workloads ['nope']" in r.stderr


def test_info_prints_probe_and_plan_with_reasons():
    text = cli("info", "--device", "cpu_amx").stdout
    assert "probes:" in text and "plan: runner=cpu_amx" in text
    r = cli("info", "--device", "cpu_amx", "--json")
    last = json.loads(r.stdout)           # --json: the whole of stdout is one JSON object
    probe = last["probe"]["details"]
    if probe["has_amx"]:          # the AMX evidence (oneDNN on the encoder's matmuls) is in the probe line
        assert "of the encoder's bf16 matmuls on AMX" in text
        assert "of the encoder's bf16 matmuls on AMX" in last["probes"]["cpu_amx"]
    plan = last["plan"]
    assert plan["row"] in ("cpu", "cpu_amx")
    for k in ("dtype", "attention", "qkv_layout", "grid_thw", "graphs", "fused_layers"):
        assert plan[k]["reason"]
    assert plan["row"] == ("cpu_amx" if probe.get("amx_proven") else "cpu")
    if plan["row"] == "cpu":
        assert "no AMX" in text or "oneDNN did not run" in text
    assert set(last["backends"]) >= {"cpu", "cpu_amx"} and last["version"] and "FD_LOG_LEVEL" in last["environment"]


def test_encode_dummy_weights_builtin_config(tmp_path):
    """--load-format dummy: 0.9B config, code-default preprocessing, one small image."""
    from PIL import Image
    img = tmp_path / "small.png"
    Image.new("RGB", (56, 56), (200, 10, 10)).save(img)
    out = tmp_path / "d.safetensors"
    cli("encode", "--load-format", "dummy", "--image", img, "--device", "cpu", "--output", out)
    got = load_file(str(out))
    t, h, w = got["grid_thw"][0].tolist()
    assert got["image_0"].shape == (h * w // 4, 1024)   # code default min_pixels upsizes to 384x384-ish
    assert torch.isfinite(got["image_0"]).all()


def test_auto_device_picks_the_best_present_one():
    r = cli("info")
    if torch.cuda.is_available():
        pytest.fail("this test expects a machine without CUDA")
    assert "plan: runner=cpu_amx" in r.stdout
    assert "device cpu_amx chosen (auto" in r.stderr and "cuda:" in r.stderr   # skipped devices named


def test_image_above_the_pixel_cap_is_refused_before_decoding(tiny_dirs, png_files, tmp_path):
    r = cli("encode", "--model", tiny_dirs["torch"], "--image", png_files[0], "--device", "cpu",
            "--output", tmp_path / "x.safetensors", check=False, env={"FD_MAX_IMAGE_PIXELS": "1000"})
    assert r.returncode == 2 and png_files[0].name in r.stderr and "Traceback" not in r.stderr
    assert not (tmp_path / "x.safetensors").exists()


def test_bench_preprocess_reports_rates_and_bitwise_parity(tmp_path, capsys):
    """`bench preprocess` on small images: ours at 1 and 2 workers, the PIL reference, torchvision
    said unavailable when it cannot be imported; our first image is bitwise equal to the PIL one."""
    from fastdeploy_ext.entrypoints.cli import main
    out = tmp_path / "pre.json"
    assert main(["bench", "preprocess", "--images", "2", "--size", "100x150", "--workers", "1,2", "--iters", "1",
                 "--warmup", "0", "--json-out", str(out)]) == 0
    assert "bitwise_equal_pil: True" in capsys.readouterr().out
    d = json.loads(out.read_text())
    assert d["bitwise_equal_pil"] is True and d["images"] == 2 and d["size"] == [100, 150]
    ours = {(x["mode"], x["workers"]) for x in d["rows"] if x["processor"] == "ours"}
    assert ours == {("serial", 1), ("thread-pool", 2)}
    assert any(x["processor"] == "transformers-pil" and x.get("workers") == 2 for x in d["rows"])
    assert set(d["speedup"]) >= {"transformers-pil@1", "transformers-pil@2"}
    tv = [x for x in d["rows"] if x["processor"] == "transformers-torchvision"]
    try:
        import torchvision  # noqa: F401
    except Exception:  # noqa: BLE001 - torchvision does not import beside torch 2.13 CPU here
        assert tv and tv[0]["note"].startswith("unavailable")
    else:
        assert any(x.get("workers") == 1 for x in tv)


@pytest.mark.parametrize("argv,match", [
    (["bench", "preprocess", "--no-reference", "--size", "10x"], "--size must be HxW"),
    (["bench", "preprocess", "--no-reference", "--workers", "1,0"], "--workers must be positive"),
    (["bench", "preprocess", "--no-reference", "--images", "0"], "--images and --iters"),
    # a misspelt variant among valid ones used to be dropped silently (a row went missing)
    (["bench", "vision", "--device", "cpu", "--variants", "strided/host/eager,dense/host/eager"],
     "unknown variants ['dense/host/eager']"),
    (["bench", "vision", "--device", "cpu", "--workloads", "page,scan,pages4,img1536,nope"],
     "unknown workloads ['nope']"),
    (["bench", "gemm", "--tokens", "0"], "--tokens must be positive"),
    (["bench", "gemm", "--workload", "nope"], "unknown workload 'nope'"),
])
def test_bench_bad_flags_in_process(argv, match, capsys):
    """In-process (no interpreter start per case): exit status 2 and one clear line."""
    from fastdeploy_ext.entrypoints.cli import main
    assert main(argv) == 2
    assert match in capsys.readouterr().err


def test_a_reader_that_goes_away_ends_the_command_quietly(monkeypatch, capsys):
    """`fastdeploy-ext info | head`: the closed pipe ends the command with SIGPIPE's status and no
    traceback; with a reader there the same command prints its plan and succeeds."""
    import io

    from fastdeploy_ext.entrypoints import cli

    class ClosedPipe(io.StringIO):
        def write(self, text):
            raise BrokenPipeError(32, "Broken pipe")
    monkeypatch.setattr(sys, "stdout", ClosedPipe())
    assert cli.main(["info", "--device", "cpu"]) == cli.EXIT_BROKEN_PIPE
    monkeypatch.setattr(sys, "stdout", io.StringIO())
    assert cli.main(["info", "--device", "cpu"]) == 0 and "plan:" in sys.stdout.getvalue()
