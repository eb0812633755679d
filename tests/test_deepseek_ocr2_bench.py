"""`bench vision` and `bench generate` on DeepSeek-OCR-2's tiny model (CPU, one iteration, a few
tokens): ours and transformers' DeepseekOcr2ForConditionalGeneration on the same weights (the
dir save_pretrained wrote) — the vision features agree (cosine), the greedy tokens are the same.
No time is asserted; the full-size run is ci/gpu_bench.sh's `deepseek` step on the H200."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("transformers.models.deepseek_ocr2")

from fastdeploy_ext.models.deepseek_ocr2 import tiny  # noqa: E402

ENV = dict(os.environ, OMP_NUM_THREADS="1")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return tiny.write_checkpoint(tmp_path_factory.mktemp("dsocr2_bench") / "tiny", seed=0)


def cli(*args, timeout=600):
    return subprocess.run([sys.executable, "-m", "fastdeploy_ext.entrypoints.cli", *args], capture_output=True,
                          text=True, timeout=timeout, env=ENV)


def test_bench_vision_ours_vs_transformers_same_weights(model_dir, tmp_path):
    out = tmp_path / "vision.json"
    r = cli("bench", "vision", "--model", str(model_dir), "--device", "cpu", "--workloads", "nocrop",
            "--variants", "strided/host/eager", "--iters", "1", "--warmup", "0", "--profile", "5",
            "--json-out", str(out))
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads(out.read_text())
    assert res["family"] == "deepseek_ocr2"
    by = {row["variant"]: row for row in res["results"]}
    assert set(by) == {"transformers", "strided/host/eager"}
    ours = by["strided/host/eager"]
    assert ours["workload"] == "nocrop" and ours["rows"] == 257 and ours["row"] == "cpu"
    assert ours["cosine_vs_ref"] >= 0.99999 and ours["speedup_vs_ref"] > 0
    assert "qkv=strided window=sdpa_bias global=sdpa_bias encoder=sdpa_mask" in r.stdout
    # --profile: the stage breakdown covers every layer of the tower once (a no-crop page: the
    # global path only), and the top kernels of one call
    from fastdeploy_ext.models.deepseek_ocr2.config import DeepseekOCR2Config
    cfg = DeepseekOCR2Config.from_model_dir(model_dir)
    stages = {row["stage"]: row for row in ours["stages"]}
    assert {row["path"] for row in ours["stages"]} == {"global"}
    assert (stages["sam windowed blocks"]["count"] + stages["sam global blocks"]["count"]
            == cfg.sam.num_hidden_layers)
    assert stages["sam global blocks"]["count"] == len(cfg.sam.global_attn_indexes)
    assert stages["qwen2 encoder"]["count"] == cfg.encoder.num_hidden_layers
    assert all(row["ms"] > 0 for row in ours["stages"])
    assert 1 <= len(ours["profile"]) <= 5 and "stages (eager, each timed alone" in r.stdout


def test_bench_vision_refuses_a_variant_the_family_lacks(model_dir):
    r = cli("bench", "vision", "--model", str(model_dir), "--device", "cpu", "--workloads", "nocrop",
            "--variants", "strided/host/graph+fused", "--no-reference")
    assert r.returncode != 0
    assert ("deepseek_ocr2 has the variants strided/host/eager, dense/host/eager, strided/host/graph, "
            "dense/host/graph, strided/host/graph+overlap, dense/host/graph+overlap only") in r.stderr + r.stdout


def test_bench_generate_ours_vs_transformers_same_tokens(model_dir, tmp_path):
    out = tmp_path / "generate.json"
    r = cli("bench", "generate", "--model", str(model_dir), "--device", "cpu", "--workloads", "page1",
            "--page1-tokens", "3", "--json-out", str(out))
    assert r.returncode == 0, r.stderr[-3000:]
    rep = json.loads(out.read_text())
    page = rep["workloads"]["page1"]
    assert rep["reference_weights"] == "same as ours"
    assert page["same_tokens"] is True
    assert page["ours"]["decode_tokens_per_s"] > 0 and page["reference"]["ttft_s"] > 0
