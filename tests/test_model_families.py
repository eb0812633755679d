"""The model-family registry and the runner/family seam: built-ins come from the entry-point
group ``fastdeploy_ext.models`` (with a fallback table that must agree with setup.py), a model dir
is matched to its family by config.json's model_type (--model-family overrides), and the plan is
resolved for the components of the config actually read, not for the default model's."""
from __future__ import annotations

import ast
import json
import shutil
from pathlib import Path

import pytest
import torch

from backends.cpu_amx import CpuRunner
from fastdeploy_ext.conformance.references import REFERENCE_ROOT
from fastdeploy_ext.models import registry
from fastdeploy_ext.models.paddleocr_vl.family import PaddleOCRVLFamily
from fastdeploy_ext.models.registry import (BUILTIN_FAMILIES, DEFAULT_FAMILY, available_families, detect_family,
                                            get_family, register_family)
from fastdeploy_ext.plan import Component, ComponentKind, PlanError, PlanRequest, TextAttentionEntry, component_of
from fastdeploy_ext.runner import ImageBatch, ModelSource

REPO = Path(__file__).resolve().parents[1]
TINY = REFERENCE_ROOT / "tiny_vl"        # a shipped tiny PaddleOCR-VL with its tokenizer: text head_dim 32


def _setup_entry_points(group: str) -> dict[str, str]:
    tree = ast.parse((REPO / "setup.py").read_text())
    call = next(n for n in ast.walk(tree) if isinstance(n, ast.Call) and getattr(n.func, "id", "") == "setup")
    eps = ast.literal_eval(next(k.value for k in call.keywords if k.arg == "entry_points"))
    return dict(e.replace(" ", "").split("=", 1) for e in eps[group])


def test_builtin_fallback_agrees_with_setup_py():
    assert _setup_entry_points(registry.ENTRY_POINT_GROUP) == BUILTIN_FAMILIES
    assert DEFAULT_FAMILY in BUILTIN_FAMILIES
    assert available_families()["paddleocr_vl"] is PaddleOCRVLFamily
    assert isinstance(get_family("paddleocr_vl"), PaddleOCRVLFamily)


def test_unknown_family_lists_what_is_registered():
    with pytest.raises(ValueError, match=r"unknown model family 'nope'; registered: .*paddleocr_vl"):
        get_family("nope")


def _model_dir(tmp_path: Path, config: dict) -> Path:
    d = tmp_path / "m"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(config))
    return d


def test_detection_by_model_type_and_its_errors(tmp_path):
    choice = detect_family(str(TINY))
    assert isinstance(choice.family, PaddleOCRVLFamily) and "model_type 'paddleocr_vl'" in choice.reason
    assert "no model directory" in detect_family(None).reason
    unknown = _model_dir(tmp_path, {"model_type": "deepseek_vl_v9"})
    with pytest.raises(ValueError, match=r"model_type 'deepseek_vl_v9' belongs to no registered model family; "
                                         r"known: .*paddleocr_vl \(model_type paddleocr_vl\).*--model-family"):
        detect_family(str(unknown))
    assert detect_family(str(unknown), "paddleocr_vl").reason == "--model-family paddleocr_vl"   # override wins
    with pytest.raises(ValueError, match="unknown model family 'nope'"):
        detect_family(str(TINY), "nope")
    untyped = tmp_path / "untyped"
    untyped.mkdir()
    (untyped / "config.json").write_text("{}")
    assert "has no model_type: the default family paddleocr_vl" in detect_family(str(untyped)).reason
    (untyped / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        detect_family(str(untyped))


class ToyFamily(PaddleOCRVLFamily):
    """An out-of-tree family as the registry sees it (here reusing PaddleOCR-VL's modules)."""
    name = "toy_vl"
    model_types = ("toy_vl",)


def test_a_registered_family_is_detected_and_loaded(tmp_path):
    register_family("toy_vl", ToyFamily)
    try:
        d = tmp_path / "toy"
        shutil.copytree(TINY, d)
        cfg = json.loads((d / "config.json").read_text())
        (d / "config.json").write_text(json.dumps({**cfg, "model_type": "toy_vl"}))
        runner = CpuRunner.create(PlanRequest(device="cpu"))
        ModelSource(str(d)).load_into(runner)
        assert type(runner.family) is ToyFamily and "toy_vl family" in runner.describe()
        out = runner.encode_images(ImageBatch(torch.randn(16, 3, 14, 14), [(1, 4, 4)]))
        assert out[0].shape == (4, cfg["text_config"]["hidden_size"])
    finally:
        registry._REGISTRY.pop("toy_vl", None)


def test_plan_is_resolved_for_the_config_read():
    runner = CpuRunner.create(PlanRequest(device="cpu"))
    text = component_of(runner.plan.components, ComponentKind.PAGED_DECODER_ATTENTION)
    assert text.head_dim == 128 and text.num_kv_heads == 2            # the default family's built-in config
    runner.load_model(str(TINY), with_text=True)
    text = component_of(runner.plan.components, ComponentKind.PAGED_DECODER_ATTENTION)
    vision = component_of(runner.plan.components, ComponentKind.VISION_VARLEN_ATTENTION)
    assert (text.head_dim, text.num_kv_heads, vision.head_dim) == (32, 2, 72)
    assert "text.attention    paged_decoder_attention: 4 heads of 32, 2 KV heads" in runner.describe()
    assert runner.kv_cache_spec().head_dim == 32


def _narrow_text_row(runner):
    """The cpu row with a text backend that takes head_dim 64..256 only (the tiny model has 32)."""
    entry = runner.row.text_attention[0]
    return runner.row.with_entries(ComponentKind.PAGED_DECODER_ATTENTION,
                                   (TextAttentionEntry(entry.backend, (64, 256), entry.dtypes),))


def test_a_model_outside_the_kernels_facts_is_refused_at_load():
    """The default config (128) fits the narrowed row, the tiny model (32) does not: the error comes
    from resolving for the config read (create's runner), or from the fit check of a runner built
    without its resolution inputs; with the re-resolution removed the load would pass silently."""
    base = CpuRunner.create(PlanRequest(device="cpu"))
    row = _narrow_text_row(base)
    created = CpuRunner.create(PlanRequest(device="cpu"), table={row.name: row})
    with pytest.raises(PlanError, match=r"row cpu: no text attention backend can run here .*head_dim 32 outside \[64, 256\]"):
        created.load_model(str(TINY), with_text=True)
    direct = CpuRunner(base.plan, base.probe_result, row)
    with pytest.raises(PlanError, match=r"text attention backend sdpa_paged supports head_dim 64..256, the model has 32"):
        direct.load_model(str(TINY), with_text=True)


def test_the_refusal_depends_on_re_resolution(monkeypatch):
    """Mutation: without _plan_for_model's resolution the narrowed row's runner loads the model
    (the plan stays the default model's) — the check above is what refuses it."""
    from fastdeploy_ext.torch_runner import TorchRunner
    base = CpuRunner.create(PlanRequest(device="cpu"))
    row = _narrow_text_row(base)
    monkeypatch.setattr(TorchRunner, "_plan_for_model", lambda self, family, cfg: setattr(self, "family", family))
    runner = CpuRunner.create(PlanRequest(device="cpu"), table={row.name: row})
    runner.load_model(str(TINY), with_text=True)
    assert component_of(runner.plan.components, ComponentKind.PAGED_DECODER_ATTENTION).head_dim == 128


def test_component_lookup_names_the_problem():
    comps = (Component("a", ComponentKind.VISION_VARLEN_ATTENTION, 72, 16),
             Component("b", ComponentKind.VISION_VARLEN_ATTENTION, 64, 8))
    with pytest.raises(PlanError, match="declares 2 components of kind vision_varlen_attention \\(a, b\\)"):
        component_of(comps, ComponentKind.VISION_VARLEN_ATTENTION)
    with pytest.raises(PlanError, match="declares 0 components of kind paged_decoder_attention \\(none\\)"):
        component_of(comps, ComponentKind.PAGED_DECODER_ATTENTION)


def test_model_family_flag_reaches_the_model_source():
    from fastdeploy_ext.entrypoints import args as A
    import argparse
    p = argparse.ArgumentParser()
    A.add_model_args(p)
    assert A.model_source_from_args(p.parse_args(["--model", str(TINY), "--model-family", "toy_vl"])).model_family == "toy_vl"
    assert A.model_source_from_args(p.parse_args(["--load-format", "dummy"])).model_family is None


def test_a_broken_family_is_skipped_with_a_warning(monkeypatch, caplog):
    from importlib.metadata import EntryPoint
    broken = EntryPoint("broken_vl", "no_such_module_for_fdx:Family", registry.ENTRY_POINT_GROUP)
    # installed metadata without the built-in's entry point, and nothing loaded yet: the fallback table serves it
    monkeypatch.setattr(registry, "entry_points", lambda group: [broken] if group == registry.ENTRY_POINT_GROUP else [])
    monkeypatch.setattr(registry, "_REGISTRY", {})
    with caplog.at_level("WARNING", logger=registry.__name__):
        families = available_families()
    assert "broken_vl" not in families and families["paddleocr_vl"] is PaddleOCRVLFamily
    assert "model family broken_vl (no_such_module_for_fdx:Family) failed to load" in caplog.text
