"""Checkpoint loading: names, layouts, shards, and clear errors on broken model dirs."""
from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from fastdeploy_ext.models.paddleocr_vl.loader import CheckpointError, load_vision

CPU = torch.device("cpu")


def test_both_layouts_give_identical_weights(tiny_dirs):
    a, cfg, ra = load_vision(tiny_dirs["torch"], dtype=torch.float32, device=CPU)
    b, _, rb = load_vision(tiny_dirs["paddle"], dtype=torch.float32, device=CPU)
    assert (ra.layout, rb.layout) == ("torch", "paddle") and len(rb.files) == 2
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for k in sa:
        assert torch.equal(sa[k], sb[k]), k
    # fused qkv is [q; k; v] of the checkpoint's projections
    src = load_file(str(tiny_dirs["torch"] / "model.safetensors"))
    q = src["visual.vision_model.encoder.layers.1.self_attn.q_proj.weight"]
    v = src["visual.vision_model.encoder.layers.1.self_attn.v_proj.weight"]
    d = cfg.vision.hidden_size
    assert torch.equal(sa["encoder.layers.1.qkv.weight"][:d], q)
    assert torch.equal(sa["encoder.layers.1.qkv.weight"][2 * d:], v)


def test_in_memory_transformers_names_are_accepted(tiny_dirs, tmp_path):
    """`model.visual.*` / `model.projector.*` (transformers' module names) load too."""
    src = load_file(str(tiny_dirs["torch"] / "model.safetensors"))
    renamed = {}
    for k, v in src.items():
        if k.startswith("visual."):
            k = "model." + k
        elif k.startswith("mlp_AR."):
            k = "model.projector." + k[len("mlp_AR."):]
        renamed[k] = v
    d = tmp_path / "renamed"
    d.mkdir()
    save_file(renamed, str(d / "model.safetensors"))
    shutil.copy(tiny_dirs["torch"] / "config.json", d)
    m, _, _ = load_vision(d, dtype=torch.float32, device=CPU)
    ref, _, _ = load_vision(tiny_dirs["torch"], dtype=torch.float32, device=CPU)
    for k, v in ref.state_dict().items():
        assert torch.equal(m.state_dict()[k], v)


def test_forced_format_that_contradicts_shapes_is_an_error(tiny_dirs):
    with pytest.raises(CheckpointError, match="--model-format paddle"):
        load_vision(tiny_dirs["torch"], dtype=torch.float32, device=CPU, model_format="paddle")
    m, _, r = load_vision(tiny_dirs["paddle"], dtype=torch.float32, device=CPU, model_format="paddle")
    assert r.layout == "paddle" and "forced" in r.layout_reason


def _copy(src, dst):
    shutil.copytree(src, dst)
    return dst


def test_broken_model_dirs(tiny_dirs, tmp_path):
    with pytest.raises(CheckpointError, match="does not exist"):
        load_vision(tmp_path / "nope", dtype=torch.float32, device=CPU)
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_vision(empty, dtype=torch.float32, device=CPU)
    shutil.copy(tiny_dirs["torch"] / "config.json", empty)
    with pytest.raises(CheckpointError, match="no \\*.safetensors"):
        load_vision(empty, dtype=torch.float32, device=CPU)
    corrupt = _copy(tiny_dirs["torch"], tmp_path / "corrupt")
    (corrupt / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json")
    with pytest.raises(CheckpointError, match="cannot read safetensors"):
        load_vision(corrupt, dtype=torch.float32, device=CPU)
    missing_shard = _copy(tiny_dirs["paddle"], tmp_path / "shard")
    (missing_shard / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(CheckpointError, match="do not exist"):
        load_vision(missing_shard, dtype=torch.float32, device=CPU)
    partial = _copy(tiny_dirs["torch"], tmp_path / "partial")
    t = load_file(str(partial / "model.safetensors"))
    del t["mlp_AR.linear_2.weight"]
    save_file(t, str(partial / "model.safetensors"))
    with pytest.raises(CheckpointError, match="mlp_AR.linear_2.weight"):
        load_vision(partial, dtype=torch.float32, device=CPU)
    wrong = _copy(tiny_dirs["torch"], tmp_path / "wrong")
    cfg = json.loads((wrong / "config.json").read_text())
    cfg["vision_config"]["intermediate_size"] = 128
    (wrong / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="fc1.weight"):
        load_vision(wrong, dtype=torch.float32, device=CPU)


def test_released_config_shape_is_understood(tiny_dirs, tmp_path):
    """Released config.json keeps the text fields at the top level."""
    from fastdeploy_ext.models.paddleocr_vl.config import PaddleOCRVLConfig
    cfg = json.loads((tiny_dirs["torch"] / "config.json").read_text())
    flat = {**cfg.pop("text_config"), **cfg}
    c = PaddleOCRVLConfig.from_dict(flat)
    assert c.text.hidden_size == 64 and c.vision.hidden_size == 144 and c.vision.head_dim == 72
    assert c.text.mrope_section == (16, 24, 24)


def test_dummy_is_the_builtin_09b_vision_config():
    from fastdeploy_ext.models.paddleocr_vl.config import PaddleOCRVLConfig
    c = PaddleOCRVLConfig()
    assert (c.vision.hidden_size, c.vision.intermediate_size, c.vision.num_hidden_layers,
            c.vision.num_attention_heads, c.vision.head_dim) == (1152, 4304, 27, 16, 72)
    assert (c.text.hidden_size, c.text.num_hidden_layers, c.text.num_key_value_heads, c.text.vocab_size) == \
        (1024, 18, 2, 103424)


def test_check_state_dict_names_the_checkpoints_tensor_in_each_failure():
    import torch

    from fastdeploy_ext.models.checkpoint_checks import check_state_dict, decode_byte_tokens
    from fastdeploy_ext.models.interface import CheckpointError
    expected = {"a.w": torch.empty(2, 3), "b.w": torch.empty(4)}
    shown = lambda n: "model." + n  # noqa: E731
    check_state_dict(expected, {"a.w": torch.zeros(2, 3), "b.w": torch.zeros(4)}, "ckpt", shown)
    cases = [({"a.w": torch.zeros(2, 3)}, "ckpt: tensor model.b.w is missing from the checkpoint (1 missing)"),
             ({**expected, "c": torch.zeros(1)}, "ckpt: unexpected tensor model.c"),
             ({"a.w": torch.zeros(3, 2), "b.w": torch.zeros(4)},
              "ckpt: tensor model.a.w has shape [3, 2], config.json implies [2, 3]")]
    for tensors, message in cases:
        with pytest.raises(CheckpointError) as e:
            check_state_dict(expected, tensors, "ckpt", shown)
        assert str(e.value) == message
    # bytes decode as runs; a special is kept or dropped; an unknown id is U+FFFD
    ids = [3 + b for b in "é".encode()] + [1, 999, 3 + ord("x")]
    assert decode_byte_tokens(ids, 3, {1: "</s>"}) == "é\ufffdx"
    assert decode_byte_tokens(ids, 3, {1: "</s>"}, skip_special_tokens=False) == "é</s>\ufffdx"
