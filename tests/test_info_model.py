"""`fastdeploy-ext info --model DIR` (and `--load-format dummy --model-family NAME`): the plan per
component of that model, from its config.json alone; without a model, the default family's."""
from __future__ import annotations

import json
import shutil

import pytest

from fastdeploy_ext.conformance.references import REFERENCE_ROOT
from fastdeploy_ext.entrypoints.cli import main

TINY = REFERENCE_ROOT / "tiny_vl"      # vision head_dim 72, text head_dim 32 with 2 KV heads


def _info_json(capsys, *args) -> dict:
    assert main(["info", "--device", "cpu", "--json", *args]) == 0
    return json.loads(capsys.readouterr().out)      # --json: the whole of stdout is one object


def _per_component(info: dict) -> dict:
    return {c["component"]: (c["kind"], c["head_dim"], c["num_kv_heads"], c["backend"])
            for c in info["plan"]["component_kernels"]}


@pytest.fixture
def config_only(tmp_path):
    """The tiny model's config.json alone: no weights, no tokenizer."""
    d = tmp_path / "model"
    d.mkdir()
    shutil.copy(TINY / "config.json", d / "config.json")
    return d


def test_info_model_shows_the_plan_per_component_from_config_json_alone(capsys, config_only):
    info = _info_json(capsys, "--model", str(config_only))
    assert info["model"] == {"family": "paddleocr_vl", "reason": "config.json model_type 'paddleocr_vl'",
                             "config": f"{config_only}/config.json"}
    assert _per_component(info) == {"vision.attention": ("vision_varlen_attention", 72, None, "sdpa"),
                                    "text.attention": ("paged_decoder_attention", 32, 2, "sdpa_paged")}
    assert info["plan"]["row"] == "cpu" and info["plan"]["attention"]["value"] == "sdpa"
    assert main(["info", "--device", "cpu", "--model", str(config_only)]) == 0
    out = capsys.readouterr().out
    assert "model: paddleocr_vl family (config.json model_type 'paddleocr_vl')" in out
    assert "component text.attention    paged_decoder_attention: 4 heads of 32, 2 KV heads -> sdpa_paged" in out


def test_info_without_a_model_and_with_dummy_weights_show_the_default_familys_plan(capsys):
    default = _info_json(capsys)
    dummy = _info_json(capsys, "--load-format", "dummy", "--model-family", "paddleocr_vl")
    assert default["model"]["family"] == dummy["model"]["family"] == "paddleocr_vl"
    assert default["model"]["config"] == dummy["model"]["config"] == "built-in"
    assert dummy["model"]["reason"] == "--model-family paddleocr_vl"
    assert default["plan"] == dummy["plan"]
    # the built-in 0.9B config: text head_dim 128, vision 72
    assert _per_component(default)["text.attention"][1:3] == (128, 2)
    assert _per_component(default)["vision.attention"][1] == 72


def test_info_model_errors_name_the_problem(capsys, tmp_path, config_only):
    assert main(["info", "--device", "cpu", "--model", str(tmp_path / "nope")]) == 2
    assert "nope: not a directory" in capsys.readouterr().err
    assert main(["info", "--device", "cpu", "--model", str(tmp_path)]) == 2
    assert "no config.json in the model directory" in capsys.readouterr().err
    assert main(["info", "--device", "cpu", "--load-format", "dummy", "--model-family", "no_such"]) == 2
    assert "unknown model family 'no_such'" in capsys.readouterr().err
    # a component no kernel of the row can serve: a PlanError naming the row, from config.json alone
    cfg = json.loads((config_only / "config.json").read_text())
    cfg["vision_config"].update(hidden_size=1200, num_attention_heads=1)
    (config_only / "config.json").write_text(json.dumps(cfg))
    assert main(["info", "--device", "cpu", "--model", str(config_only)]) == 2
    err = capsys.readouterr().err
    assert "row cpu: no attention backend can run here" in err and "head_dim 1200 outside [1, 512]" in err
