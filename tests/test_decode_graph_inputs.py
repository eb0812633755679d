"""Decode graphs read only buffers that outlive the capture (runs on any CPU).

A CUDA graph replays raw device addresses. A tensor built for one capture and then dropped goes
back to the caching allocator, is handed out again, and the replay then reads whatever the new
owner wrote there: on the H200 the engine's decode steps at batch > 1 hit index asserts that way
(the logits-row index was a fresh `arange` per capture). This checks the invariant structurally:
every tensor of every bucket's graph inputs is a view of one of DecodeGraphs' persistent buffers.
"""
from __future__ import annotations

import dataclasses

import pytest
import torch

from fastdeploy_ext.models.paddleocr_vl.config import TextConfig
from fastdeploy_ext.models.paddleocr_vl.text import ErnieTextModel
from fastdeploy_ext.ops.attention.paged import PAGED_ATTENTION_BACKENDS
from fastdeploy_ext.text_runner import DecodeGraphs, StepInputs, TextStepRunner


def _graphs(sizes=(1, 2, 4, 8)) -> DecodeGraphs:
    cfg = TextConfig(num_hidden_layers=1, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                     num_key_value_heads=2, head_dim=16, vocab_size=64,
                     mrope_section=(2, 3, 3))
    model = ErnieTextModel(cfg, tied=True).eval()
    r = TextStepRunner(model, PAGED_ATTENTION_BACKENDS["sdpa_paged"], block_size=16, device=torch.device("cpu"),
                       dtype=torch.float32, image_token_id=63)
    r.init_kv_cache(8)
    return DecodeGraphs(r, sizes, max_model_len=64)


def _tensors(inp: StepInputs):
    for obj in (inp, inp.meta):
        for f in dataclasses.fields(obj):
            v = getattr(obj, f.name)
            if isinstance(v, torch.Tensor):
                yield f"{type(obj).__name__}.{f.name}", v
    for k, v in inp.meta.extras.items():
        if isinstance(v, torch.Tensor):
            yield f"extras[{k}]", v


def _transient(dg: DecodeGraphs, b: int) -> list[str]:
    keep = dg.persistent_storages()
    return [name for name, t in _tensors(dg._inputs(b)) if t.untyped_storage().data_ptr() not in keep]


@pytest.mark.parametrize("b", [1, 2, 4, 8])
def test_graph_inputs_are_views_of_persistent_buffers(b):
    assert _transient(_graphs(), b) == []


def test_check_fires_on_a_per_capture_tensor(monkeypatch):
    """The mutation: a logits-row index made per capture (the bug the H200 showed)."""
    dg = _graphs()
    orig = DecodeGraphs._inputs

    def per_capture_rows(self, b):
        return dataclasses.replace(orig(self, b), logits_index=torch.arange(b))
    monkeypatch.setattr(DecodeGraphs, "_inputs", per_capture_rows)
    assert _transient(dg, 4) == ["StepInputs.logits_index"]
