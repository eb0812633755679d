"""End-to-end `fastdeploy-ext generate --json` on one device and admission mode of the matrix
(FD_ENABLE_MAX_PREFILL from the leg's environment): the command line, the engine's scheduler,
the runner's vision + text paths and the tokenizer, on a tiny PaddleOCR-VL written by
transformers, with two requests in flight. Each request's greedy tokens must equal greedy decoding
of transformers' own forward on the same prompt ids and pixels (fp32, on the leg's device).

The CLI runs in this process (`cli.main`), as in test_encode_smoke.py.
"""
from __future__ import annotations

import json
import logging

import pytest
import torch

from fastdeploy_ext import envs
from fastdeploy_ext.conformance.references import Manifest
from fastdeploy_ext.entrypoints import cli
from fastdeploy_ext.models.paddleocr_vl.processor import ImageProcessor, PreprocessorConfig

MAX_TOKENS = 8


@pytest.fixture(scope="module")
def tiny_vl(tmp_path_factory):
    pytest.importorskip("transformers", reason="the tiny VL model is written by transformers (the test extra)")
    from fastdeploy_ext.conformance.tiny_text_model import write_tiny_vl_model
    return write_tiny_vl_model(tmp_path_factory.mktemp("vl") / "model")


def reference_greedy(model, prompt_ids: list[int], pixels: torch.Tensor, grid: tuple) -> list[int]:
    from fastdeploy_ext.conformance.tiny_text_model import reference_logits
    ids = list(prompt_ids)
    for _ in range(MAX_TOKENS):
        ids.append(int(reference_logits(model, ids, pixels, [grid])[-1].argmax()))
    return ids[len(prompt_ids):]


def test_generate_end_to_end(tiny_vl, plan_variant, plan_flags, caplog, capsys, request):
    backend = request.config.getoption("--fdx-backend")
    assert backend, "the smoke leg needs --fdx-backend"
    images = Manifest.load().files("images")[:2]
    argv = ["generate", "--model", str(tiny_vl), "--prompt", "OCR:", "--max-tokens", str(MAX_TOKENS), "--ignore-eos",
            "--temperature", "0", "--json", "--device", backend, *plan_flags]
    for p in images:
        argv += ["--image", str(p)]
    capsys.readouterr()
    with caplog.at_level(logging.INFO, logger="fastdeploy_ext"):
        rc = cli.main(argv)
    out, err = capsys.readouterr()
    assert rc == 0, err
    print(caplog.text)
    max_prefill = envs.FD_ENABLE_MAX_PREFILL.get()
    assert f"max prefill: {max_prefill}" in caplog.text, "the log must say which admission mode ran"
    results = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    assert len(results) == len(images)

    from fastdeploy_ext.conformance.tiny_text_model import load_reference
    device = "cuda" if backend == "cuda" else "cpu"
    model = load_reference(tiny_vl, device=device)
    proc = ImageProcessor(PreprocessorConfig.from_model_dir(tiny_vl))
    for path, res in zip(images, results):
        assert set(res) >= {"text", "token_ids", "prompt_token_ids"}
        assert len(res["token_ids"]) == MAX_TOKENS
        im = proc.preprocess(path)
        t, h, w = im.grid_thw
        n_image = sum(tok == model.config.image_token_id for tok in res["prompt_token_ids"])
        assert n_image == t * h * w // 4, "the prompt must hold h*w/4 image tokens"
        want = reference_greedy(model, res["prompt_token_ids"], im.pixel_values, tuple(im.grid_thw))
        print(f"{path.name}: ours {res['token_ids']} transformers {want}")
        assert res["token_ids"] == want
