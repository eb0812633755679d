"""Prompt building: chat template rendering, placeholder expansion, mrope positions equal to
transformers' get_rope_index, the built-in byte tokenizer, clear errors."""
from __future__ import annotations

import pytest
import torch

from fastdeploy_ext.models.paddleocr_vl.config import PaddleOCRVLConfig
from fastdeploy_ext.models.paddleocr_vl.prompt import PromptError, TASK_PROMPTS, build_prompt, rope_index
from fastdeploy_ext.models.paddleocr_vl.tokenizer import (ByteTokenizer, TokenizerError, load_chat_template, load_tokenizer)

CFG = PaddleOCRVLConfig()
RELEASED_RENDER = "<|begin_of_sentence|>User: <|IMAGE_START|><|IMAGE_PLACEHOLDER|><|IMAGE_END|>OCR:\nAssistant: "


def test_builtin_template_renders_the_released_prompt():
    t = load_chat_template(None)
    msgs = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "OCR:"}]}]
    assert t.render(msgs) == RELEASED_RENDER
    assert set(TASK_PROMPTS.values()) == {"OCR:", "Table Recognition:", "Formula Recognition:", "Chart Recognition:"}


def test_byte_tokenizer_maps_specials_to_config_ids_and_round_trips():
    tok = load_tokenizer(None, CFG)
    ids = tok.encode(RELEASED_RENDER)
    assert ids[:4] == [1] + [3 + b for b in b"Use"]
    assert [100295, 101306] == [ids[i] for i in (ids.index(101305) + 1, ids.index(101305) + 2)]
    assert tok.decode(ids, skip_special_tokens=False) == RELEASED_RENDER
    assert tok.decode(ids) == RELEASED_RENDER.replace("<|begin_of_sentence|>", "").replace(
        "<|IMAGE_START|><|IMAGE_PLACEHOLDER|><|IMAGE_END|>", "")
    assert tok.decode(tok.encode("héllo <b> 表")) == "héllo <b> 表"
    assert tok.decode([50000]) == "\ufffd"          # a random model's id outside bytes and specials
    with pytest.raises(TokenizerError, match="collide"):
        ByteTokenizer({"<x>": 5})


def _hf_rope_index(ids, grids):
    pytest.importorskip("transformers")
    from transformers import PaddleOCRVLConfig as HFConfig
    from transformers.models.paddleocr_vl.modeling_paddleocr_vl import PaddleOCRVLModel
    t = torch.tensor([ids])
    return PaddleOCRVLModel.get_rope_index(
        type("M", (), {"config": HFConfig(), "get_vision_position_ids": PaddleOCRVLModel.get_vision_position_ids})(),
        t, mm_token_type_ids=(t == CFG.image_token_id).int(), image_grid_thw=torch.tensor(grids))


@pytest.mark.parametrize("grids", [[(1, 4, 8)], [(1, 10, 6)], [(1, 6, 6), (1, 2, 14)]])
def test_build_prompt_positions_equal_transformers(grids):
    tok, tmpl = load_tokenizer(None, CFG), load_chat_template(None)
    p = build_prompt(tok, tmpl, CFG, prompt="ocr", image_grids=grids)
    assert sum(1 for t in p.token_ids if t == CFG.image_token_id) == sum(h * w // 4 for _, h, w in grids)
    assert p.num_image_tokens == sum(h * w // 4 for _, h, w in grids)
    pos, delta = _hf_rope_index(p.token_ids, grids)
    assert p.positions.dtype == torch.int64 and torch.equal(p.positions, pos[:, 0])
    assert p.rope_delta == int(delta) and p.rope_delta < 0
    # the first image token after s text positions is (s, s, s); the last is (s, s+h/2-1, s+w/2-1)
    s, n = p.image_runs[0]
    e = s + n
    _, h, w = grids[0]
    assert p.positions[:, s].tolist() == [s] * 3
    assert p.positions[:, e - 1].tolist() == [s, s + h // 2 - 1, s + w // 2 - 1]
    assert p.positions[0, e] == s + max(h, w) // 2


def test_text_only_prompt_uses_1d_positions():
    p = build_prompt(load_tokenizer(None, CFG), load_chat_template(None), CFG,
                     messages=[{"role": "user", "content": "Hello"}])
    n = len(p.token_ids)
    assert p.rope_delta == 0 and torch.equal(p.positions, torch.arange(n).expand(3, -1))


def test_prompt_errors_are_clear():
    tok, tmpl = load_tokenizer(None, CFG), load_chat_template(None)
    with pytest.raises(PromptError, match="1 image part"):
        build_prompt(tok, tmpl, CFG, messages=[{"role": "user", "content": [{"type": "image"}]}], image_grids=[])
    with pytest.raises(PromptError, match=r"messages\[0\].content\[0\]: unsupported part type 'audio'"):
        build_prompt(tok, tmpl, CFG, messages=[{"role": "user", "content": [{"type": "audio"}]}])
    with pytest.raises(PromptError, match="needs 8 image tokens"):
        rope_index([5] + [CFG.image_token_id] * 7, CFG.image_token_id, [(1, 4, 8)], 2)
    with pytest.raises(PromptError, match="2 image"):
        rope_index([CFG.image_token_id] * 8, CFG.image_token_id, [(1, 4, 8), (1, 4, 8)], 2)


def test_model_dir_tokenizer_and_template(tmp_path):
    pytest.importorskip("tokenizers")
    from fastdeploy_ext.conformance.tiny_text_model import TINY_VL_IDS, write_tokenizer_files
    d = write_tokenizer_files(tmp_path / "m")
    cfg = PaddleOCRVLConfig(**{k: v for k, v in TINY_VL_IDS.items() if k != "video_token_id"})
    tok = load_tokenizer(d, cfg)
    p = build_prompt(tok, load_chat_template(d), cfg, prompt="OCR:", image_grids=[(1, 4, 4)])
    assert p.token_ids[0] == 1 and p.token_ids.count(3) == 4
    assert tok.decode(p.token_ids) == "User: OCR:\nAssistant: "
    # a tokenizer whose image token id disagrees with config.json is refused, naming both
    with pytest.raises(TokenizerError, match="config.json says 100295"):
        load_tokenizer(d, PaddleOCRVLConfig())
    (d / "chat_template.jinja").unlink()
    with pytest.raises(TokenizerError, match="no chat template"):
        load_chat_template(d)
