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


def _decode_step(rows):
    from fastdeploy_ext.engine.step import SeqStep, StepBatch
    return StepBatch(False, [SeqStep(i, [tok], start, table, None, rope_delta=delta)
                             for i, (tok, start, table, delta) in enumerate(rows)])


def test_staged_inputs_equal_the_eager_step_inputs():
    """What a replay uploads (host staging, numpy writes) equals what the eager step builds, and
    rows past the batch are padding (scratch slot and block, context 1) even where a larger batch
    left real values there before."""
    dg = _graphs()
    bs, scratch = dg.r.block_size, dg.scratch
    big = _decode_step([(5, 40, [3, 1, 6], -7), (9, 3, [2], 0), (11, 17, [7, 0], -2), (12, 33, [4, 5, 0], 1)])
    dg.stage(big, 4)
    step = _decode_step([(21, 20, [6, 2], -4), (22, 47, [1, 3, 5], 3)])
    dg.stage(step, 4)                       # rows 2, 3 held big's values
    ref = dg.r.build_inputs(step)
    assert dg.h_scalars[0, :2].tolist() == ref.token_ids.tolist()
    assert dg.h_scalars[1, :2].tolist() == ref.positions.tolist()
    assert dg.h_scalars[2, :2].tolist() == ref.meta.slot_mapping.tolist() == [2 * bs + 4, 5 * bs + 15]
    assert dg.h_ctx[:2].tolist() == ref.meta.context_lens.tolist() == [21, 48]
    for i, n in enumerate((2, 3)):
        assert dg.h_tables[i, :n].tolist() == ref.meta.block_tables[i, :n].tolist()
    assert dg.h_scalars[:, 2:4].tolist() == [[0, 0], [0, 0], [scratch * bs] * 2]
    assert dg.h_ctx[2:4].tolist() == [1, 1] and dg.h_tables[2:4, 0].tolist() == [scratch] * 2


class _CountingGraph:
    """Stands in for a captured graph: each replay overwrites the bucket's static output with the
    replay's number, as a real replay overwrites it with that step's logits."""

    def __init__(self, out: torch.Tensor):
        self.out, self.n = out, 0

    def replay(self):
        self.n += 1
        self.out.fill_(self.n)


def _with_counting_graphs(dg: DecodeGraphs) -> DecodeGraphs:
    for b in dg.sizes:
        dg.out[b] = torch.zeros(b, 64)
        dg.graphs[b] = _CountingGraph(dg.out[b])
    return dg


def _kept_logits(dg: DecodeGraphs, borrow: bool) -> list[float]:
    kept = []
    for k in range(3):
        step = _decode_step([(5, 10 + k, [3], 0), (6, 20 + k, [1, 2], 0)])
        step.borrow_logits = borrow
        kept.append(dg.run(step))
    return [t[0, 0].item() for t in kept]


def test_logits_kept_across_steps_are_each_steps_own():
    """A caller that keeps a step's logits past the next replay (the conformance suite's
    teacher-forced text check does) gets a copy; the engine, which samples before its next step,
    borrows the static output (views of one buffer: all read the last replay)."""
    dg = _with_counting_graphs(_graphs())
    assert _kept_logits(dg, borrow=False) == [1.0, 2.0, 3.0]
    assert _kept_logits(dg, borrow=True) == [6.0, 6.0, 6.0]


def test_returning_views_to_every_caller_is_caught(monkeypatch):
    """Mutation: run() handing out the static output to every caller (the bug the cuda
    conformance leg found) makes the kept logits all equal the last replay's."""
    dg = _with_counting_graphs(_graphs())
    real = DecodeGraphs.run

    def always_borrow(self, step):
        step.borrow_logits = True
        return real(self, step)
    monkeypatch.setattr(DecodeGraphs, "run", always_borrow)
    assert _kept_logits(dg, borrow=False) != [1.0, 2.0, 3.0]
