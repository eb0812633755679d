"""`fastdeploy-ext bench detect` on the CPU with the conformance suite's tiny detector: the table's
columns, one row per batch size, and ours and transformers' model (same weights, same pixels)
producing the same detections; PP-DocLayoutV2 (``--model-family pp_doclayout_v2``) through its own
reference hook, masks off on both sides."""
from __future__ import annotations

import json

import pytest

from fastdeploy_ext.conformance.references import Manifest
from fastdeploy_ext.entrypoints import cli
from fastdeploy_ext.bench.detect import COLUMNS


def test_bench_detect_prints_both_sides_per_batch_and_the_same_detections(tmp_path, capsys):
    model = Manifest.load().path("tiny_detector")
    out = tmp_path / "bench.json"
    rc = cli.main(["bench", "detect", "--model", str(model), "--device", "cpu", "--dtype", "float32",
                   "--batch-sizes", "1,2", "--iters", "1", "--warmup", "0", "--json-out", str(out)])
    text = capsys.readouterr().out
    assert rc == 0, text
    lines = text.strip().splitlines()
    header = next(i for i, ln in enumerate(lines) if ln.split()[:2] == ["batch", "ours_ms"])
    assert lines[header].split() == list(COLUMNS)
    rows = [ln.split() for ln in lines[header + 1:]]
    assert [r[0] for r in rows] == ["1", "2"] and all(len(r) == len(COLUMNS) for r in rows)
    assert all(float(x) > 0 for r in rows for x in r[1:])
    assert "same detections as the reference: True" in text
    result = json.loads(out.read_text())
    assert result["same_detections"] is True and result["label_agreement"] == 1.0
    assert result["masks"] == "on (both sides)"
    assert [r["batch"] for r in result["rows"]] == [1, 2]
    for r in result["rows"]:
        assert r["speedup"] == pytest.approx(r["ref_ms"] / r["ours_ms"])
        assert r["ours_pages_s"] == pytest.approx(r["batch"] / r["ours_ms"] * 1000)


def test_bench_detect_refuses_bad_flags(capsys):
    assert cli.main(["bench", "detect", "--load-format", "dummy", "--batch-sizes", "1,x"]) == 2
    assert "--batch-sizes must be a comma list of integers" in capsys.readouterr().err
    assert cli.main(["bench", "detect"]) == 2
    assert "--model DIR or --load-format dummy" in capsys.readouterr().err


def test_the_dummy_reference_holds_our_weights():
    """--load-format dummy: our random weights written under save_pretrained's names and read by
    transformers give the same outputs (the tiny config: the default one takes minutes here)."""
    import torch

    from fastdeploy_ext.models.pp_doclayout_v3.reference import reference_with_our_weights
    from fastdeploy_ext.models.pp_doclayout_v3 import tiny as td
    from fastdeploy_ext.models.pp_doclayout_v3.config import PPDocLayoutV3Config
    from fastdeploy_ext.models.pp_doclayout_v3.loader import load_detector
    cfg = PPDocLayoutV3Config.from_dict(dict(td.TINY) | {"backbone_config": td.BACKBONE})
    model, _ = load_detector(None, dtype=torch.float32, device=torch.device("cpu"), cfg=cfg)
    ref = reference_with_our_weights(model, cfg)
    px = torch.rand(1, 3, td.IMAGE, td.IMAGE, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        a, b = model(px), ref(pixel_values=px)
    for k in ("logits", "pred_boxes", "order_logits"):
        assert (getattr(a, k) - getattr(b, k)).abs().max().item() <= 1e-5, k


def test_bench_detect_runs_pp_doclayout_v2_against_its_reference(tmp_path, capsys):
    """V2's family hook: transformers' PPDocLayoutV2 with the same weights; V2 has no mask head, so
    both sides run without masks (auto), and asking for them is refused."""
    from fastdeploy_ext.models.pp_doclayout_v2 import tiny as v2tiny
    model = v2tiny.write_model(tmp_path / "v2")
    out = tmp_path / "bench.json"
    rc = cli.main(["bench", "detect", "--model", str(model), "--model-family", "pp_doclayout_v2", "--device", "cpu",
                   "--dtype", "float32", "--batch-sizes", "1", "--iters", "1", "--warmup", "0",
                   "--threshold", str(v2tiny.DETECT_THRESHOLD), "--json-out", str(out)])
    text = capsys.readouterr().out
    assert rc == 0, text
    assert "bench detect: pp_doclayout_v2" in text and "same detections as the reference: True" in text
    result = json.loads(out.read_text())
    assert result["family"] == "pp_doclayout_v2" and result["masks"] == "off on both sides (the family has no mask head)"
    assert result["same_detections"] is True and not result["detections_checked"].endswith(": 0 ours, 0 reference")
    assert cli.main(["bench", "detect", "--model", str(model), "--masks", "on", "--device", "cpu"]) == 2
    assert "detector family pp_doclayout_v2 has no mask head" in capsys.readouterr().err


def test_the_v2_dummy_reference_holds_our_weights():
    """--load-format dummy for V2: the family's transformers_reference without a checkpoint gives
    the same outputs as our random-weights module (the tiny config; the default one takes minutes here)."""
    import torch

    from fastdeploy_ext.models.pp_doclayout_v2 import tiny as v2tiny
    from fastdeploy_ext.models.pp_doclayout_v2.config import PPDocLayoutV2Config
    from fastdeploy_ext.models.registry import get_family
    family = get_family("pp_doclayout_v2")
    cfg = PPDocLayoutV2Config.from_dict(v2tiny.config_dict())
    model, _ = family.load_detector(None, dtype=torch.float32, device=torch.device("cpu"), cfg=cfg)
    ref = family.transformers_reference(None, model, cfg)
    px = torch.rand(1, 3, v2tiny.IMAGE, v2tiny.IMAGE, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        a, b = model(px), ref(pixel_values=px)
    for k in ("logits", "pred_boxes", "order_logits"):
        assert (getattr(a, k) - getattr(b, k)).abs().max().item() <= 1e-5, k
