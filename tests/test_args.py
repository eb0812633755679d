"""entrypoints/args.py: the shared flags are defined once and converted to typed values; every
subcommand that builds a runner accepts the same set; benchmarks take the typed values."""
from __future__ import annotations

import json

import pytest

from fastdeploy_ext.entrypoints import args as A
from fastdeploy_ext.entrypoints.cli import build_parser, main
from fastdeploy_ext.plan import PlanRequest
from fastdeploy_ext.runner import ModelSource

SHARED = ["--device", "cpu", "--dtype", "bfloat16", "--attention-backend", "sdpa", "--qkv-layout", "dense",
          "--grid-thw", "device", "--fused-layers", "off",
          "--graph-optimization-config", '{"use_cudagraph": false}']


@pytest.mark.parametrize("argv", [["info"], ["encode", "--image", "x.png", "--output", "o.safetensors"],
                                  ["bench", "vision"]])
def test_every_runner_command_takes_the_shared_flags(argv):
    ns = build_parser().parse_args(argv + SHARED)
    req = A.plan_request_from_args(ns)
    assert req == PlanRequest(device="cpu", dtype="bfloat16", attention_backend="sdpa", qkv_layout="dense",
                              grid_thw="device", fused_layers="off",
                              graph_config=req.graph_config)
    assert req.graph_config.use_cudagraph is False


def test_model_source_conversion(tmp_path):
    p = build_parser()
    ns = p.parse_args(["encode", "--model", str(tmp_path), "--model-format", "paddle", "--image", "x", "--output", "o"])
    assert A.model_source_from_args(ns) == ModelSource(str(tmp_path), "auto", "paddle")
    # a missing or non-directory --model is a CliError naming it (one line, exit 2), before any loading
    ns = p.parse_args(["encode", "--model", "/m", "--image", "x", "--output", "o"])
    with pytest.raises(A.CliError, match="--model /m: does not exist"):
        A.model_source_from_args(ns)
    (tmp_path / "f").write_text("")
    ns = p.parse_args(["encode", "--model", str(tmp_path / "f"), "--image", "x", "--output", "o"])
    with pytest.raises(A.CliError, match="is a file, not a directory"):
        A.model_source_from_args(ns)
    ns = p.parse_args(["encode", "--image", "x", "--output", "o"])
    with pytest.raises(A.CliError, match="--model DIR is required"):
        A.model_source_from_args(ns)
    assert A.model_source_from_args(ns, default_dummy=True) == ModelSource(None, "dummy", "auto")
    ns = p.parse_args(["encode", "--model", "/m", "--load-format", "dummy", "--image", "x", "--output", "o"])
    assert A.model_source_from_args(ns).model_dir is None          # dummy ignores --model


def test_model_source_rejects_bad_values():
    with pytest.raises(ValueError, match="load_format"):
        ModelSource("/m", "pickle")
    with pytest.raises(ValueError, match="model directory"):
        ModelSource(None, "safetensors")


def test_bad_graph_config_is_a_cli_error():
    ns = build_parser().parse_args(["info", "--graph-optimization-config", "{not json"])
    with pytest.raises(A.CliError, match="not valid JSON"):
        A.plan_request_from_args(ns)


@pytest.mark.parametrize("argv", [["info", "--bogus"], ["encode", "--image", "x", "--output", "o", "--bogus", "1"], ["bench", "vision", "--bogus"],
                                  ["info", "--compile"], ["info", "--compile-layers", "on"]])   # removed; no abbreviations
def test_unknown_flags_exit_2(argv, capsys):
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    assert "unrecognized arguments" in capsys.readouterr().err


def test_bench_vision_runs_on_a_tiny_model(tiny_dirs, tmp_path, capsys):
    """bench vision through the CLI on the typed values (no transformers reference: the tiny
    model is not the 0.9B one the reference builder expects)."""
    out = tmp_path / "b.json"
    rc = main(["bench", "vision", "--model", str(tiny_dirs["torch"]), "--device", "cpu", "--workloads", "block8x40",
               "--variants", "strided/host/eager,dense/device/eager", "--iters", "1", "--warmup", "0",
               "--no-reference", "--json-out", str(out)])
    assert rc == 0
    rows = json.loads(out.read_text())["results"]
    assert [(r["variant"], r["workload"]) for r in rows] == [("dense/device/eager", "block8x40"),
                                                           ("strided/host/eager", "block8x40")]
    assert all(r["ms"] > 0 and r["attention"] == "sdpa" for r in rows)


def test_bench_vision_unknown_workload_is_one_line(capsys):
    assert main(["bench", "vision", "--device", "cpu", "--workloads", "page,nope"]) == 2
    assert "unknown workloads ['nope']" in capsys.readouterr().err


def test_encode_takes_a_data_url_image(tiny_dirs, png_files, tmp_path):
    """`encode --image` accepts what every entry point accepts (fastdeploy_ext/inputs): a data:
    URL of a file gives that file's features."""
    import base64

    from safetensors.torch import load_file
    url = "data:image/png;base64," + base64.b64encode(png_files[0].read_bytes()).decode()
    outs = []
    for image in (str(png_files[0]), url):
        out = tmp_path / f"{len(outs)}.safetensors"
        assert main(["encode", "--model", str(tiny_dirs["torch"]), "--image", image, "--device", "cpu",
                     "--output", str(out)]) == 0
        outs.append(load_file(str(out)))
    assert outs[0]["grid_thw"].tolist() == outs[1]["grid_thw"].tolist()
    assert (outs[0]["image_0"] == outs[1]["image_0"]).all()
    assert main(["encode", "--model", str(tiny_dirs["torch"]), "--image", "data:image/png;base64,@@",
                 "--device", "cpu", "--output", str(tmp_path / "bad.safetensors")]) == 2
