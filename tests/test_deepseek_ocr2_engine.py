"""DeepSeek-OCR-2 through the engine: `LLM.generate` greedy ids against transformers' `generate`
on the tiny random model (tests/test_deepseek_ocr2.py's), the KV cache sized by the family, and
`encode` writing ``num_crops`` instead of ``grid_thw``.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from PIL import Image

pytest.importorskip("transformers.models.deepseek_ocr2")

from fastdeploy_ext import LLM, SamplingParams  # noqa: E402
from fastdeploy_ext.models.deepseek_ocr2 import tiny  # noqa: E402
from fastdeploy_ext.models.deepseek_ocr2.config import DeepseekOCR2Config  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
MAX_TOKENS = 10


def image(w: int, h: int, seed: int) -> Image.Image:
    g = torch.Generator().manual_seed(seed)
    return Image.fromarray((torch.rand(h, w, 3, generator=g) * 255).to(torch.uint8).numpy())


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return tiny.write_checkpoint(tmp_path_factory.mktemp("dsocr2_engine") / "tiny", seed=1)


@pytest.fixture(scope="module")
def images():
    return [image(600, 500, 1), image(1000, 1600, 2)]          # no crops; 2x3 crops


@pytest.fixture(scope="module")
def expected(model_dir, images):
    """transformers' greedy ids, one prompt at a time (no padding effects)."""
    from transformers import DeepseekOcr2ForConditionalGeneration
    ref = DeepseekOcr2ForConditionalGeneration.from_pretrained(str(model_dir)).eval()
    proc = tiny.processor()
    out = []
    with torch.inference_mode():
        for im in images:
            r = proc(images=[im], text="<image>\nFree OCR.", return_tensors="pt")
            g = ref.generate(**r, max_new_tokens=MAX_TOKENS, min_new_tokens=MAX_TOKENS, do_sample=False)
            out.append(g[0, r["input_ids"].shape[1]:].tolist())
    return out


def test_llm_generate_matches_transformers_greedy(model_dir, images, expected):
    llm = LLM(str(model_dir), model_family="deepseek_ocr2", device="cpu", dtype="float32",
              kv_cache_memory="16MiB", max_model_len=2048)
    assert llm.engine.runner.family.name == "deepseek_ocr2"
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outs = llm.generate([{"prompt": "Free OCR.", "multi_modal_data": {"image": im}} for im in images], params)
    got = [o.outputs[0].token_ids for o in outs]
    assert got == expected
    assert len(outs[1].prompt_token_ids) == 3 + 6 * 144 + 257     # BOS + image rows + "Free OCR."


def test_kv_cache_is_sized_by_the_family_60_kib_per_token_released():
    """The runner sizes KV from the decoder the family loads: 12 layers x (k, v) x 10 heads x 128
    x 2 bytes (bf16) = 60 KiB per token at the released size (built on meta: no weights)."""
    from fastdeploy_ext.models.deepseek_ocr2.text import DeepseekOCR2Decoder
    from fastdeploy_ext.text_runner import TextStepRunner
    with torch.device("meta"):
        dec = DeepseekOCR2Decoder(DeepseekOCR2Config().text)
    tr = TextStepRunner(dec, None, block_size=16, device=torch.device("cpu"), dtype=torch.bfloat16,
                        image_token_id=128815, position_rows=1)
    assert tr.kv_cache_spec().bytes_per_block == 16 * 60 * 1024


def test_encode_writes_num_crops(model_dir, images, tmp_path):
    from safetensors.torch import load_file
    paths = []
    for i, im in enumerate(images):
        paths += ["--image", str(tmp_path / f"im{i}.png")]
        im.save(paths[-1])
    out = tmp_path / "feats.safetensors"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
           "OMP_NUM_THREADS": "1"}
    r = subprocess.run([sys.executable, "-m", "fastdeploy_ext.entrypoints.cli", "encode", "--model", str(model_dir),
                        *paths, "--output", str(out), "--device", "cpu", "--dtype", "float32"],
                       capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    got = load_file(str(out))
    assert sorted(got) == ["image_0", "image_1", "num_crops"]
    assert got["num_crops"].dtype == torch.int64 and got["num_crops"].tolist() == [0, 6]
    assert list(got["image_0"].shape) == [257, 64] and list(got["image_1"].shape) == [6 * 144 + 257, 64]
    assert "num_crops [0, 6]" in r.stdout
    # the rows are the tower's, in the token order (crops, global, separator): the last is the separator
    from safetensors import safe_open
    with safe_open(str(model_dir / "model.safetensors"), "pt") as h:
        sep = h.get_tensor("model.view_seperator")
    assert torch.equal(got["image_0"][-1], sep) and torch.equal(got["image_1"][-1], sep)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_device_views_generate_what_host_views_do(model_dir, images):
    """--preprocess-device device on CUDA: the workers hand the engine views made on the GPU
    (the same bytes), so greedy generation gives the host path's ids."""
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    got = {}
    for where in ("host", "device"):
        llm = LLM(str(model_dir), model_family="deepseek_ocr2", device="cuda", dtype="float32", max_model_len=2048,
                  gpu_memory_utilization=0.3, preprocess_device=where)
        try:
            proc = llm.engine.input_processor.image_processor
            assert (proc.device is not None and proc.device.type == "cuda") == (where == "device")
            outs = llm.generate([{"prompt": "Free OCR.", "multi_modal_data": {"image": im}} for im in images], params)
            got[where] = [o.outputs[0].token_ids for o in outs]
        finally:
            llm.shutdown()
    assert got["device"] == got["host"] and all(len(ids) == MAX_TOKENS for ids in got["host"])
