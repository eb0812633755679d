"""PaddleX's PaddleOCR-VL pipeline as a client: its own request code (PaddleX 3.7.2's
`DocVLMGenAIClientPredictor` + `GenAIClient`, unmodified, tests/data/paddlex_client/) sends
each server backend's requests to our real server, which must answer 200 with text.

What PaddleX sends (read from that code, checked here on the wire):
- fastdeploy-server: temperature 1 and top_p 0 when the user sets neither;
- vllm-server / sglang-server: temperature 0, top_p only when set;
- all: `model` = the pipeline config's model name (PaddleOCR-VL-0.9B), max_completion_tokens
  8192, the image as a JPEG data URL, extra_body repetition_penalty / skip_special_tokens when
  set and (vllm-server only) mm_processor_kwargs.min_pixels / max_pixels.
The server is started on a model dir named PaddleOCR-VL-0.9B: the default served names (the
path and the directory's name) must cover PaddleX's model name without --served-model-name."""
from __future__ import annotations

import json
import shutil

import httpx
import pytest

from . import paddlex_stub
from .server_harness import ServerProc, tiny_vl

PADDLEX_MODEL_NAME = "PaddleOCR-VL-0.9B"      # paddlex/configs/pipelines/PaddleOCR-VL.yaml
BACKENDS = ("fastdeploy-server", "vllm-server", "sglang-server")


@pytest.fixture(scope="module")
def paddlex():
    assert paddlex_stub.record_mismatches() == [], "the PaddleX copies differ from the wheel's RECORD"
    genai, predictor = paddlex_stub.load()
    yield genai, predictor
    genai.close_aio_loop()
    paddlex_stub.unload()


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    model_dir = tmp_path_factory.mktemp("models") / PADDLEX_MODEL_NAME
    shutil.copytree(tiny_vl(), model_dir)
    srv = ServerProc(model_dir=str(model_dir)).wait_healthy()      # --max-model-len 16384: room for 8192
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def page(tmp_path_factory):
    from PIL import Image, ImageDraw
    p = tmp_path_factory.mktemp("img") / "page.png"
    im = Image.new("RGB", (96, 64), "white")
    ImageDraw.Draw(im).text((4, 20), "Hello PaddleX", fill="black")
    im.save(p)
    return str(p)


def run_paddlex(paddlex, server, backend: str, page: str, **process_kw):
    """PaddleX's predictor.process() on one image through `backend`; returns (texts, the JSON
    bodies it sent)."""
    genai, predictor = paddlex
    sent = []

    async def capture(request: httpx.Request):
        if request.url.path.endswith("/chat/completions"):
            sent.append(json.loads(request.content))
    http_client = httpx.AsyncClient(event_hooks={"request": [capture]}, timeout=300)
    client = genai.GenAIClient(backend, f"{server.url}/v1", model_name=PADDLEX_MODEL_NAME, http_client=http_client)
    pred = predictor.DocVLMGenAIClientPredictor.__new__(predictor.DocVLMGenAIClientPredictor)
    pred.model_name = PADDLEX_MODEL_NAME          # what the pipeline passes from its config
    pred.genai_client = client
    try:
        out = pred.process([{"image": page, "query": "OCR:"}], **process_kw)
    finally:
        client.close()
    return out["result"], sent


@pytest.mark.parametrize("backend", BACKENDS)
def test_paddlex_defaults_get_text(paddlex, server, page, backend):
    texts, sent = run_paddlex(paddlex, server, backend, page)
    assert len(texts) == 1 and isinstance(texts[0], str) and texts[0], texts
    body = sent[0]
    assert body["model"] == PADDLEX_MODEL_NAME and body["max_completion_tokens"] == 8192
    url = body["messages"][0]["content"][0]["image_url"]["url"]
    assert url.startswith("data:image/jpeg;base64,") and body["messages"][0]["content"][1] == {
        "type": "text", "text": "OCR:"}
    if backend == "fastdeploy-server":
        assert (body["temperature"], body["top_p"]) == (1, 0)       # FastDeploy reads top_p 0 as greedy
    else:
        assert body["temperature"] == 0 and "top_p" not in body
    assert not ({"repetition_penalty", "mm_processor_kwargs", "skip_special_tokens"} & set(body))


@pytest.mark.parametrize("backend", BACKENDS)
def test_paddlex_user_settings_get_text(paddlex, server, page, backend):
    kw = dict(repetition_penalty=1.05, temperature=0.0, top_p=0.9, skip_special_tokens=True, max_new_tokens=16)
    if backend == "vllm-server":
        kw.update(min_pixels=112 * 112, max_pixels=28 * 28 * 256)
    texts, sent = run_paddlex(paddlex, server, backend, page, **kw)
    assert len(texts) == 1 and texts[0], texts
    body = sent[0]
    assert (body["temperature"], body["top_p"], body["max_completion_tokens"]) == (0.0, 0.9, 16)
    assert (body["repetition_penalty"], body["skip_special_tokens"]) == (1.05, True)
    if backend == "vllm-server":
        assert body["mm_processor_kwargs"] == {"min_pixels": 112 * 112, "max_pixels": 28 * 28 * 256}


def test_paddlex_copies_are_checked_against_the_wheel(tmp_path, monkeypatch):
    """The unmodified-copy check fires on a changed byte."""
    src = paddlex_stub.ROOT
    dst = tmp_path / "copy"
    shutil.copytree(src, dst)
    f = dst / "paddlex/inference/models/doc_vlm/constants.py"
    f.write_text(f.read_text().replace("8192", "4096", 1))
    monkeypatch.setattr(paddlex_stub, "ROOT", dst)
    assert paddlex_stub.record_mismatches() == ["paddlex/inference/models/doc_vlm/constants.py"]
