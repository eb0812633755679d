"""Text decoder numerics on this backend: the paged step path (vision features scattered at the
image tokens, prefill in chunks over a shuffled block table, then decode steps) against the
family's reference logits (PaddleOCR-VL: transformers' for the shipped tiny VL checkpoint).

fp32: max abs error <= 1e-4 per row. bf16: cosine >= 0.999 per row against the fp32 reference.
On rows with decoder graphs the decode steps replay captured graphs (checked by the hit count).
For PaddleOCR-VL the reference is the copy shipped with the suite (reference_data/expected/
text_logits, computed by transformers 5.24 in fp32 on the CPU) and, where transformers is
installed, a live one too; positions are the family's ([3, n] mrope there, [1, n] for 1D rope).
"""
from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F

from ..engine.step import SeqStep, StepBatch

CHUNK = 5          # prefill chunk: splits the image's tokens across chunks and KV blocks
FP32_TOL = 1e-4
BF16_MIN_COS = 0.999
SHIPPED_VS_LIVE_MAX_ABS = 5e-5      # logits reach ~30 here: 1.7e-5 seen between 1 and 2 threads


@pytest.fixture(scope="module")
def text_ref(family_fixture):
    case = family_fixture.text_case()
    refs = case.expected
    assert refs and all(r.shape[0] == len(case.continuation) + 1 for r in refs.values())
    if "live" in refs and "shipped" in refs:
        err = (refs["live"] - refs["shipped"]).abs().max().item()
        print(f"text logits: shipped vs live reference max abs {err:.3g}")
        # the same fp32 computation in another process / thread count: reduction order only
        assert err <= SHIPPED_VS_LIVE_MAX_ABS, err
    return case


def _row(backend_cls):
    from ..capabilities import capability_table
    return backend_cls.select_row(backend_cls.probe(), capability_table())[0]


def _run(runner, case) -> torch.Tensor:
    """Logits of the last prompt token, then of each decode step (teacher-forced)."""
    cont = case.continuation
    feats = runner.encode_images(case.image)[0]
    spec = runner.kv_cache_spec()
    bs = spec.block_size
    total = len(case.token_ids) + len(cont)
    nblk = (total + bs - 1) // bs
    runner.init_kv_cache(nblk + 5)
    table = list(range(nblk + 5))
    random.Random(0).shuffle(table)
    table = table[:nblk]
    if runner.plan.decode_graphs.value:
        runner.capture_decode_graphs(max_num_seqs=4, max_model_len=nblk * bs)
    ids, img = case.token_ids, runner.family.image_token_id(runner.cfg)
    assert tuple(case.positions.shape) == (runner.family.position_rows, len(ids))
    img_rows = [j for j, t in enumerate(ids) if t == img]
    rows = []
    for s in range(0, len(ids), CHUNK):
        e = min(s + CHUNK, len(ids))
        mine = [j for j in img_rows if s <= j < e]
        emb = feats[mine[0] - img_rows[0]: mine[-1] - img_rows[0] + 1] if mine else None
        out = runner.execute(StepBatch(True, [SeqStep(0, ids[s:e], s, table, case.positions[:, s:e],
                                                      case.rope_delta, emb, need_logits=e == len(ids))]))
        if e == len(ids):
            rows.append(out[0])
    for k, tok in enumerate(cont):
        out = runner.execute(StepBatch(False, [SeqStep(0, [tok], len(ids) + k, table, None, case.rope_delta)]))
        rows.append(out[0])
    got = torch.stack(rows).float().cpu()
    if runner.plan.decode_graphs.value:
        assert runner.text.graph_hits == len(cont), "decode steps did not replay the captured graphs"
    runner.free_kv_cache()
    return got


@pytest.mark.fdx_extended          # the core suite's fp32 decoder check: greedy ids against the reference's
def test_text_logits_fp32(backend_cls, make_runner, text_ref):
    if "float32" not in _row(backend_cls).dtypes:
        pytest.fail(f"row {_row(backend_cls).name} has no float32: the fp32 parity check cannot run")
    runner = make_runner(text_ref.model_dir, dtype="float32", with_text=True)
    got = _run(runner, text_ref)
    print(f"text plan: {runner.plan.text_attention.value}, block {runner.plan.kv_block_size.value}, "
          f"decode graphs {list(runner.plan.decode_graphs.value) or 'off'}")
    for name, ref in text_ref.expected.items():
        err = (got - ref).abs().max().item()
        print(f"text logits fp32 vs {name}: max abs {err:.3g}")
        assert err <= FP32_TOL, (name, err)


@pytest.mark.fdx_extended          # the core suite's bf16 decoder check: test_generate's teacher-forced logits
def test_text_logits_bf16(backend_cls, make_runner, text_ref):
    row = _row(backend_cls)
    if "bfloat16" not in row.dtypes:
        pytest.fail(f"row {row.name} has no bfloat16")
    runner = make_runner(text_ref.model_dir, dtype="bfloat16", with_text=True)
    got = _run(runner, text_ref)
    refs = text_ref.expected
    cos = F.cosine_similarity(got, refs["shipped"] if "shipped" in refs else refs["live"], dim=-1)
    print(f"text logits bf16: cosine per row min {cos.min().item():.5f}")
    assert cos.min().item() >= BF16_MIN_COS
