"""Decode CUDA graphs per batch-size bucket: replay equals eager (CUDA only: graphs need a GPU).

The decoder has the released shapes per layer (16 query / 2 KV heads of 128, hidden 1024) but
two layers and a small vocab, bf16, over the Triton paged backend.
"""
from __future__ import annotations

import pytest
import torch

from fastdeploy_ext.engine.step import SeqStep, StepBatch
from fastdeploy_ext.models.paddleocr_vl.config import TextConfig
from fastdeploy_ext.models.paddleocr_vl.text import ErnieTextModel
from fastdeploy_ext.ops.triton import runtime as ta
from fastdeploy_ext.ops.attention.paged import PAGED_ATTENTION_BACKENDS
from fastdeploy_ext.text_runner import DecodeGraphs, TextStepRunner

pytestmark = pytest.mark.skipif(not torch.cuda.is_available() or ta.TRITON_INTERPRETED,
                                reason="decode graphs need a CUDA device (compiled Triton)")


def _runner(block_size=64, num_blocks=64):
    cfg = TextConfig(num_hidden_layers=2, vocab_size=2048)
    torch.manual_seed(0)
    model = ErnieTextModel(cfg, tied=False)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.05)
    model = model.to("cuda", torch.bfloat16).eval()
    r = TextStepRunner(model, PAGED_ATTENTION_BACKENDS["triton_paged"], block_size=block_size,
                       device=torch.device("cuda"), dtype=torch.bfloat16, image_token_id=2047)
    r.init_kv_cache(num_blocks)
    return r


def _prefill(r, n_seqs, g):
    """Prefill n_seqs prompts of different lengths; return (prompt lens, block tables)."""
    lens = [17 + 29 * i for i in range(n_seqs)]
    tables, nxt = [], 0
    for i, n in enumerate(lens):
        nb = (n + 40 + r.block_size - 1) // r.block_size
        tables.append(list(range(nxt, nxt + nb))[::-1])       # non-contiguous order
        nxt += nb
        ids = torch.randint(0, 2000, (n,), generator=g).tolist()
        r.execute(StepBatch(True, [SeqStep(i, ids, 0, tables[i], None, rope_delta=-3)]))
    return lens, tables


@pytest.mark.parametrize("batch", [1, 3, 8])
def test_graph_replay_equals_eager(batch):
    r = _runner()
    g = torch.Generator().manual_seed(batch)
    lens, tables = _prefill(r, batch, g)
    steps = []
    for k in range(4):
        toks = torch.randint(0, 2000, (batch,), generator=g).tolist()
        steps.append(StepBatch(False, [SeqStep(i, [toks[i]], lens[i] + k, tables[i], None, -3)
                                       for i in range(batch)]))
    kv_k, kv_v = r.kv.k.clone(), r.kv.v.clone()
    eager = [r.execute(s) for s in steps]
    r.kv.k.copy_(kv_k)
    r.kv.v.copy_(kv_v)
    graphs = DecodeGraphs(r, (1, 4, 8), max_model_len=1024)
    info = graphs.capture()
    assert info["sizes"] == [1, 4, 8]
    r.graphs = graphs
    replay = [r.execute(s) for s in steps]
    assert r.graph_hits == len(steps) and r.graph_fallbacks == 0
    for e, p in zip(eager, replay):
        assert e.shape == p.shape == (batch, 2048) and e.dtype == torch.float32
        assert (e - p).abs().max().item() <= 2e-2 * e.abs().max().item()
        assert torch.equal(e.argmax(-1), p.argmax(-1))
    big = StepBatch(False, [SeqStep(i, [1], lens[i % batch] + 4, tables[i % batch], None) for i in range(9)])
    assert graphs.run(big) is None             # above the largest bucket: eager fallback


def test_graph_replay_equals_eager_as_the_batch_shrinks_and_grows():
    """Buckets 8, 4, 1, 8 in a row: rows a larger batch filled must read as padding in a smaller
    one (the staged uploads reset them), and a sequence's positions advance one per step."""
    r = _runner()
    g = torch.Generator().manual_seed(11)
    lens, tables = _prefill(r, 8, g)
    done = [0] * 8
    steps = []
    for members in (range(8), range(3), range(1), range(8)):
        toks = torch.randint(0, 2000, (8,), generator=g).tolist()
        steps.append(StepBatch(False, [SeqStep(i, [toks[i]], lens[i] + done[i], tables[i], None, -3)
                                       for i in members]))
        for i in members:
            done[i] += 1
    kv_k, kv_v = r.kv.k.clone(), r.kv.v.clone()
    eager = [r.execute(s) for s in steps]
    r.kv.k.copy_(kv_k)
    r.kv.v.copy_(kv_v)
    r.graphs = DecodeGraphs(r, (1, 4, 8), max_model_len=1024)
    r.graphs.capture()
    replay = [r.execute(s) for s in steps]
    assert r.graph_hits == len(steps)
    for e, p in zip(eager, replay):
        assert e.shape == p.shape
        assert (e - p).abs().max().item() <= 2e-2 * e.abs().max().item()
        assert torch.equal(e.argmax(-1), p.argmax(-1))
