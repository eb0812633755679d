"""The ERNIE decoder and the paged execute path against transformers 5.24 on tiny random models.

fp32 logits parity (max abs error <= 1e-4): text-only and with an image, tied and untied LM
heads, torch and Paddle layouts; paged execution (prefill in chunks + decode steps over
arbitrary block tables, several sequences batched) equals transformers' full forward.
"""
from __future__ import annotations

import random

import numpy as np
import pytest
import torch

pytest.importorskip("transformers")

from fastdeploy_ext.conformance.tiny_text_model import (load_reference, reference_logits, write_tiny_vl_model,
                                                        write_tiny_vl_paddle_twin)
from fastdeploy_ext.engine.step import SeqStep, StepBatch
from fastdeploy_ext.models.paddleocr_vl.processor import ImageProcessor, PreprocessorConfig
from fastdeploy_ext.plan import PlanRequest
from fastdeploy_ext.runner import ImageBatch, get_backend_class

TOL = 1e-4


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("gen")
    tied = write_tiny_vl_model(root / "tied", tied=True, seed=0)
    untied = write_tiny_vl_model(root / "untied", tied=False, seed=1)
    return {"tied": tied, "untied": untied, "paddle": write_tiny_vl_paddle_twin(untied, root / "paddle")}


@pytest.fixture(scope="module")
def refs(dirs):
    return {"tied": load_reference(dirs["tied"]), "untied": load_reference(dirs["untied"])}


def build_prompt(r, **kw):
    """The loaded family's prompt builder, over the runner's tokenizer and chat template."""
    return r.family.build_prompt(r.tokenizer, r.chat_template, r.cfg, **kw)


def make_runner(model_dir, **req):
    cls = get_backend_class("cpu")
    r = cls.create(PlanRequest(device="cpu", dtype="float32", **req))
    r.load_model(model_dir, with_text=True)
    return r


@pytest.fixture(scope="module")
def runners(dirs):
    return {k: make_runner(d) for k, d in dirs.items()}


@pytest.fixture(scope="module")
def image(dirs, tmp_path_factory):
    from PIL import Image
    rng = np.random.default_rng(0)
    p = tmp_path_factory.mktemp("img") / "page.png"
    Image.fromarray(rng.integers(0, 256, (56, 112, 3), dtype=np.uint8)).save(p)   # no resize: grid 4x8
    return ImageProcessor(PreprocessorConfig.from_model_dir(dirs["tied"])).preprocess(p)


def full_logits(runner, ids, positions, image_embeds=None, num_blocks=64, block_table=None):
    """All-position logits of one prefill over the paged cache (a fresh cache)."""
    text = runner.text
    text.init_kv_cache(num_blocks)
    bt = block_table or list(range((len(ids) + text.block_size - 1) // text.block_size))
    inp = text.build_inputs(StepBatch(True, [SeqStep(0, ids, 0, bt, positions, image_embeds=image_embeds)]))
    inp.logits_index = torch.arange(len(ids))
    with torch.inference_mode():
        return text.forward(inp)


@pytest.mark.parametrize("kind,ref", [("tied", "tied"), ("untied", "untied"), ("paddle", "untied")])
def test_text_only_logits_match_transformers(runners, refs, kind, ref):
    r = runners[kind]
    assert (r.text_model.lm_head is None) == (kind == "tied")
    p = build_prompt(r, messages=[{"role": "user", "content": "The quick brown fox, hello page."}])
    assert p.rope_delta == 0 and torch.equal(p.positions, torch.arange(len(p.token_ids)).expand(3, -1))
    got = full_logits(r, p.token_ids, p.positions)
    want = reference_logits(refs[ref], p.token_ids)
    assert (got - want).abs().max().item() <= TOL


@pytest.mark.parametrize("kind,ref", [("tied", "tied"), ("paddle", "untied")])
def test_image_prompt_logits_match_transformers(runners, refs, image, kind, ref):
    r = runners[kind]
    p = build_prompt(r, prompt="ocr", image_grids=[image.grid_thw])
    assert p.num_image_tokens == image.grid_thw[1] * image.grid_thw[2] // 4
    feats = r.encode_images(ImageBatch.from_images([image]))[0]
    got = full_logits(r, p.token_ids, p.positions, image_embeds=feats)
    want = reference_logits(refs[ref], p.token_ids, image.pixel_values, [list(image.grid_thw)])
    assert (got - want).abs().max().item() <= TOL
    # a wrong scatter (image features at the wrong rows) is visible at this tolerance
    bad = full_logits(r, p.token_ids, p.positions, image_embeds=feats.flip(0))
    assert (bad - want).abs().max().item() > 100 * TOL


def test_untied_head_is_used(runners, refs):
    """The untied checkpoint's lm_head differs from its embeddings: using the wrong one fails."""
    r = runners["untied"]
    assert not torch.equal(r.text_model.lm_head.weight, r.text_model.embed_tokens.weight)
    p = build_prompt(r, prompt="Hello")
    h = r.text_model.embed_tokens.weight
    tied_logits = torch.nn.functional.linear(torch.randn(1, h.shape[1]), h)
    assert tied_logits.shape[1] == r.text_model.lm_head.weight.shape[0]
    assert (full_logits(r, p.token_ids, p.positions) - reference_logits(refs["untied"], p.token_ids)).abs().max() <= TOL


def _run_paged(r, seqs, chunk, decode_steps, num_blocks=48, seed=0):
    """Prefill each (ids, positions, delta, embeds) in chunks of ``chunk`` tokens over shuffled block
    tables, then ``decode_steps`` batched decode steps feeding the given continuation tokens.
    Returns per seq: [logits of the last prompt token, then each decode step]."""
    text = r.text
    bs = text.block_size
    text.init_kv_cache(num_blocks)
    free = list(range(num_blocks))
    random.Random(seed).shuffle(free)
    tables, outs = [], [[] for _ in seqs]
    for prompt_ids, cont, pos, delta, emb in seqs:
        total = len(prompt_ids) + len(cont)
        tables.append([free.pop() for _ in range((total + bs - 1) // bs)])
    for i, (ids, cont, pos, delta, emb) in enumerate(seqs):
        img_rows = [j for j, t in enumerate(ids) if t == r.cfg.image_token_id]
        for s in range(0, len(ids), chunk):
            e = min(s + chunk, len(ids))
            rows = [j for j in img_rows if s <= j < e]
            ce = emb[rows[0] - img_rows[0]: rows[-1] - img_rows[0] + 1] if rows else None
            step = StepBatch(True, [SeqStep(i, ids[s:e], s, tables[i], pos[:, s:e], delta, ce, need_logits=e == len(ids))])
            out = r.execute(step)
            assert out.shape[0] == (1 if e == len(ids) else 0)
            if e == len(ids):
                outs[i].append(out[0])
    for k in range(decode_steps):
        batch = [SeqStep(i, [cont[k]], len(ids) + k, tables[i], None, delta)
                 for i, (ids, cont, pos, delta, emb) in enumerate(seqs)]
        out = r.execute(StepBatch(False, batch))
        assert out.dtype == torch.float32 and out.shape[0] == len(seqs)
        for i in range(len(seqs)):
            outs[i].append(out[i])
    return outs


def test_paged_chunked_prefill_and_batched_decode_match_full_forward(runners, refs, image):
    r, ref = runners["tied"], refs["tied"]
    feats = r.encode_images(ImageBatch.from_images([image]))[0]
    img = build_prompt(r, prompt="Table Recognition:", image_grids=[image.grid_thw])
    txt = build_prompt(r, prompt="Invoice number 12345, total 67.89 EUR. The quick brown fox.")
    assert img.rope_delta < 0
    g = torch.Generator().manual_seed(0)
    seqs = []
    for p, emb in ((img, feats), (txt, None)):
        cont = torch.randint(6, 300, (5,), generator=g).tolist()
        seqs.append((p.token_ids, cont, p.positions, p.rope_delta, emb))
    # chunks of 7 split the image's tokens across chunks and blocks (block_size 16)
    outs = _run_paged(r, seqs, chunk=7, decode_steps=5)
    for (ids, cont, pos, delta, emb), got in zip(seqs, outs):
        full = ids + cont
        if emb is not None:
            want = reference_logits(ref, full, image.pixel_values, [list(image.grid_thw)])
        else:
            want = reference_logits(ref, full)
        want = want[len(ids) - 1: len(ids) - 1 + len(got)]
        assert (torch.stack(got) - want).abs().max().item() <= TOL


def test_decode_rope_position_uses_the_delta(runners, refs, image):
    """Mutation check: decoding at the KV slot instead of slot + rope_delta changes the logits."""
    r, ref = runners["tied"], refs["tied"]
    feats = r.encode_images(ImageBatch.from_images([image]))[0]
    p = build_prompt(r, prompt="ocr", image_grids=[image.grid_thw])
    want = reference_logits(ref, p.token_ids + [7], image.pixel_values, [list(image.grid_thw)])[-1]
    good = _run_paged(r, [(p.token_ids, [7], p.positions, p.rope_delta, feats)], chunk=1000, decode_steps=1)[0][-1]
    bad = _run_paged(r, [(p.token_ids, [7], p.positions, 0, feats)], chunk=1000, decode_steps=1)[0][-1]
    assert (good - want).abs().max().item() <= TOL
    # a shift of 4 positions moves the logits by ~4e-3 here: 40x the tolerance
    assert (bad - want).abs().max().item() > 10 * TOL


def test_kv_spec_profile_and_step_errors(runners):
    """The runner's generation surface: KV spec from the row, a positive peak estimate that grows
    with the step, and every StepBatch guard firing with a message naming the sequence."""
    from fastdeploy_ext.text_runner import StepError
    r = runners["tied"]
    spec = r.kv_cache_spec()
    assert (spec.block_size, spec.num_layers, spec.num_kv_heads, spec.head_dim, spec.dtype) == (16, 2, 2, 32, torch.float32)
    assert spec.bytes_per_block == 2 * 2 * 16 * 2 * 32 * 4
    small, big = r.profile_peak_memory(256, 1024), r.profile_peak_memory(4096, 1024)
    assert 0 < small < big
    r.free_kv_cache()
    with pytest.raises(RuntimeError, match="init_kv_cache"):
        r.execute(StepBatch(True, [SeqStep(0, [1, 2], 0, [0], None)]))
    r.init_kv_cache(4)
    bad = {
        "no tokens": StepBatch(True, [SeqStep(3, [], 0, [0], None)]),
        "exactly one token": StepBatch(False, [SeqStep(3, [1, 2], 5, [0], None)]),
        "need 2 blocks": StepBatch(True, [SeqStep(3, list(range(20)), 0, [0], None)]),
        "outside the pool": StepBatch(True, [SeqStep(3, [1, 2], 0, [9], None)]),
        "rope_positions must be": StepBatch(True, [SeqStep(3, [1, 2], 0, [0], torch.zeros(3, 5, dtype=torch.long))]),
        "image placeholder tokens": StepBatch(True, [SeqStep(3, [1, 3, 3], 0, [0], None,
                                                             image_embeds=torch.zeros(3, 64))]),
        "empty StepBatch": StepBatch(True, []),
    }
    for msg, step in bad.items():
        with pytest.raises(StepError, match=msg):
            r.execute(step)
    # and the runner is still healthy
    assert r.execute(StepBatch(True, [SeqStep(0, [1, 2], 0, [0], None)])).shape == (1, 320)
    with pytest.raises(ValueError, match="at least one block"):
        r.init_kv_cache(0)
