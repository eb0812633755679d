"""End-to-end `fastdeploy-ext generate --json` on one device and admission mode of the matrix
(FD_ENABLE_MAX_PREFILL from the leg's environment): the command line, the engine's scheduler,
the runner's vision + text paths and the tokenizer, on the tiny PaddleOCR-VL the conformance suite
ships (tiny_vl), four requests in flight. Each request's greedy tokens must equal transformers'
greedy generate of that request alone, shipped with the suite (generate_greedy, fp32; no
transformers needed here).

The CLI runs in this process (`cli.main`), as in test_encode_smoke.py.
"""
from __future__ import annotations

import json
import logging

from fastdeploy_ext import envs
from fastdeploy_ext.conformance.references import Manifest
from fastdeploy_ext.entrypoints import cli
from fastdeploy_ext.models.paddleocr_vl.processor import ImageProcessor, PreprocessorConfig


def test_generate_end_to_end(plan_variant, plan_flags, caplog, capsys, request):
    backend = request.config.getoption("--fdx-backend")
    assert backend, "the smoke leg needs --fdx-backend"
    refs = Manifest.load()
    model = refs.path("tiny_vl")
    expected = refs.json("generate_greedy")
    images = {p.name: p for p in refs.files("images")}
    paths = [images[name] for name in expected["images"]]
    argv = ["generate", "--model", str(model), "--prompt", expected["prompt"], "--max-tokens", str(expected["max_tokens"]),
            "--ignore-eos", "--temperature", "0", "--json", "--device", backend, *plan_flags]
    for p in paths:
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
    assert len(results) == len(paths)

    image_token = json.loads((model / "config.json").read_text())["image_token_id"]
    proc = ImageProcessor(PreprocessorConfig.from_model_dir(model))
    for path, res, want in zip(paths, results, expected["token_ids"]):
        assert set(res) >= {"text", "token_ids", "prompt_token_ids"}
        t, h, w = proc.preprocess(path).grid_thw
        assert sum(tok == image_token for tok in res["prompt_token_ids"]) == t * h * w // 4, \
            "the prompt must hold h*w/4 image tokens"
        print(f"{path.name}: ours {res['token_ids']} transformers {want}")
        assert res["token_ids"] == want
