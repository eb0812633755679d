"""One message normalizer (fastdeploy_ext/inputs/messages.py) behind every path that reads chat
messages: every accepted content part type is accepted, with the same result, by the engine's
input processor (the offline API's path), by PaddleOCR-VL's prompt builder and by the server's
request parsing + message resolution; a bad part is refused by each naming the field."""
from __future__ import annotations

import asyncio
import io

import pytest
from PIL import Image

from fastdeploy_ext.engine.errors import InvalidRequest
from fastdeploy_ext.engine.input_processor import InputLimits, InputProcessor
from fastdeploy_ext.entrypoints.openai import protocol, serving_chat
from fastdeploy_ext.entrypoints.openai.errors import APIError
from fastdeploy_ext.inputs.messages import IMAGE_PART_TYPES, JSON_IMAGE_PART_TYPES, normalize_messages
from fastdeploy_ext.models.paddleocr_vl.config import PaddleOCRVLConfig
from fastdeploy_ext.models.paddleocr_vl.processor import ImageProcessor
from fastdeploy_ext.models.paddleocr_vl.prompt import PromptError, build_prompt
from fastdeploy_ext.models.paddleocr_vl.tokenizer import load_chat_template, load_tokenizer

from .engine_fakes import FakePromptBuilder
from .server_harness import data_url, png_bytes
from .test_engine_scheduler import TINY_PP

PNG = png_bytes(56, 84, seed=3)
URL = data_url(PNG)
PIL_IMAGE = Image.open(io.BytesIO(PNG)).convert("RGB")

#: one example of every accepted image part: (part type, the part)
PARTS = [
    ("image_url", {"type": "image_url", "image_url": {"url": URL}}),
    ("image_url", {"type": "image_url", "image_url": URL}),                 # vLLM's bare string
    ("input_image", {"type": "input_image", "image_url": URL}),
    ("image", {"type": "image", "image": URL}),
    ("image", {"type": "image", "image": PNG}),
    ("image", {"type": "image", "image": PIL_IMAGE}),
    ("image_pil", {"type": "image_pil", "image_pil": PIL_IMAGE}),
]
IDS = [f"{t}-{type(p[IMAGE_PART_TYPES[t]]).__name__}" for t, p in PARTS]


def messages(part):
    return [{"role": "system", "content": "be exact"},
            {"role": "user", "content": [part, {"type": "text", "text": "OCR:"}]}]


def test_every_part_type_has_an_example_here():
    assert {t for t, _ in PARTS} == set(IMAGE_PART_TYPES)
    assert set(JSON_IMAGE_PART_TYPES) < set(IMAGE_PART_TYPES)


@pytest.fixture(scope="module")
def engine_reference():
    proc = InputProcessor(FakePromptBuilder(), ImageProcessor(TINY_PP), InputLimits(1, 65536, 512))
    return proc, proc.process({"messages": messages({"type": "image", "image": PNG})})


@pytest.mark.parametrize("kind,part", PARTS, ids=IDS)
def test_the_engine_path_accepts_every_part_type(engine_reference, kind, part):
    proc, ref = engine_reference
    got = proc.process({"messages": messages(part)})
    assert got.prompt_token_ids == ref.prompt_token_ids
    assert len(got.items) == 1 and got.items[0].grid == ref.items[0].grid
    assert got.items[0].encoder_inputs.equal(ref.items[0].encoder_inputs)
    assert (got.items[0].offset, got.items[0].num_embeddings) == (ref.items[0].offset, ref.items[0].num_embeddings)


@pytest.mark.parametrize("kind,part", PARTS, ids=IDS)
def test_the_family_prompt_builder_accepts_every_part_type(kind, part):
    cfg = PaddleOCRVLConfig()
    tok, tmpl = load_tokenizer(None, cfg), load_chat_template(None)
    grid = [(1, 4, 6)]
    ref = build_prompt(tok, tmpl, cfg, messages=messages({"type": "image"}), image_grids=grid)
    got = build_prompt(tok, tmpl, cfg, messages=messages(part), image_grids=grid)
    assert got.token_ids == ref.token_ids and got.image_runs == ref.image_runs == [(ref.image_runs[0][0], 6)]


class RecordingFetcher:
    def __init__(self):
        self.urls = []

    async def fetch(self, url, label):
        self.urls.append((url, label))
        return b"fetched:" + url.encode()[:20]


@pytest.mark.parametrize("kind,part", [(t, p) for t, p in PARTS if isinstance(p[IMAGE_PART_TYPES[t]], (str, dict))],
                         ids=[i for i, (t, p) in zip(IDS, PARTS) if isinstance(p[IMAGE_PART_TYPES[t]], (str, dict))])
def test_the_server_path_accepts_every_json_part_type(kind, part):
    assert kind in JSON_IMAGE_PART_TYPES
    req = protocol.parse_chat_request({"model": "m", "messages": messages(part)})
    fetcher = RecordingFetcher()
    got = asyncio.run(serving_chat.resolve_messages(req, fetcher))
    assert fetcher.urls == [(URL, "image 0")]
    assert got == [{"role": "system", "content": [{"type": "text", "text": "be exact"}]},
                   {"role": "user", "content": [{"type": "image", "image": b"fetched:" + URL.encode()[:20]},
                                                {"type": "text", "text": "OCR:"}]}]
    # what the server hands the engine normalizes to itself (the engine reads it unchanged)
    assert normalize_messages(got).messages == normalize_messages(messages({"type": "image"})).messages


def test_a_pil_part_has_no_json_form_and_the_server_says_which():
    with pytest.raises(APIError) as e:
        protocol.parse_chat_request({"model": "m", "messages": messages({"type": "image_pil", "image_pil": URL})})
    assert e.value.status == 400 and "messages.1.content.0" in e.value.message


@pytest.mark.parametrize("part,needle", [
    ({"type": "audio", "audio": "x"}, "messages[1].content[0]: unsupported part type 'audio'"),
    ({"type": "image_url"}, "messages[1].content[0]: a 'image_url' part needs its 'image_url'"),
    ({"type": "image_url", "image_url": {"uri": URL}}, "messages[1].content[0].image_url.url must be a string"),
    ({"type": "text", "text": 5}, "messages[1].content[0].text must be a string"),
])
def test_a_bad_part_is_refused_by_each_path_naming_it(engine_reference, part, needle):
    proc, _ = engine_reference
    with pytest.raises(InvalidRequest) as e:
        proc.process({"messages": messages(part)})
    assert needle in str(e.value)
    cfg = PaddleOCRVLConfig()
    with pytest.raises(PromptError) as e:
        build_prompt(load_tokenizer(None, cfg), load_chat_template(None), cfg, messages=messages(part))
    assert needle in str(e.value)
    with pytest.raises(APIError) as e:
        protocol.parse_chat_request({"model": "m", "messages": messages(part)})
    assert e.value.status == 400 and "messages.1.content.0" in e.value.message


def test_a_bare_image_part_reaching_the_engine_is_refused():
    proc = InputProcessor(FakePromptBuilder(), ImageProcessor(TINY_PP), InputLimits(1, 65536, 512))
    with pytest.raises(InvalidRequest, match="image part 0 of the messages carries no image"):
        proc.process({"messages": messages({"type": "image"})})
