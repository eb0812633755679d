"""Triton paged decode / prefill kernels against the SDPA paged backend.

CPU: the kernels run in the Triton interpreter, which needs TRITON_INTERPRET=1 before triton is
first imported; as in test_triton_attention.py, the ``test_interp_*`` tests run in a child
process started with it (``test_interpreter_subprocess``). The interpreter has no bf16 dots, so
bf16 is covered by ``test_cuda_*`` on a GPU; fp32 (exact dots) and fp16 run here.
"""
from __future__ import annotations

import random

import pytest
import torch

pytest.importorskip("triton")

from fastdeploy_ext.ops.triton import runtime as ta
from fastdeploy_ext.ops.attention.paged import KVCache, PagedStepMeta, sdpa_decode, sdpa_prefill
from .triton_interpreter import run_interp_tests

interp = pytest.mark.skipif(not ta.TRITON_INTERPRETED,
                            reason="interpreter test: runs in test_interpreter_subprocess")


def _setup(hq, hkv, d, bs, lens, dtype, device="cpu", num_blocks=40, seed=0):
    """A cache with random contents, shuffled block tables covering ``lens`` tokens."""
    g = torch.Generator().manual_seed(seed)
    kc = torch.randn(num_blocks, bs, hkv, d, generator=g).to(device, dtype)
    vc = torch.randn(num_blocks, bs, hkv, d, generator=g).to(device, dtype)
    free = list(range(num_blocks))
    random.Random(seed).shuffle(free)
    max_blocks = max((n + bs - 1) // bs for n in lens)
    tables = torch.zeros(len(lens), max_blocks, dtype=torch.int32)
    for i, n in enumerate(lens):
        for j in range((n + bs - 1) // bs):
            tables[i, j] = free.pop()
    return kc, vc, tables.to(device), torch.tensor(lens, dtype=torch.int32, device=device)


def _decode_case(hq, hkv, d, dtype, device="cpu", part_tokens=32, graph_max=None):
    from fastdeploy_ext.ops.triton.paged_attention import DecodeTiles, paged_decode
    bs, lens = 16, [1, 37, 70, 16]
    kc, vc, tables, ctx = _setup(hq, hkv, d, bs, lens, dtype, device)
    q = torch.randn(len(lens), hq, d, generator=torch.Generator().manual_seed(1)).to(device, dtype)
    scale = d ** -0.5
    got = paged_decode(q, kc, vc, tables, ctx, scale, max_context_len=graph_max or max(lens),
                       tiles=DecodeTiles(part_tokens=part_tokens))
    meta = PagedStepMeta(False, torch.zeros(0), tables, ctx, [1] * len(lens), [n - 1 for n in lens], bs,
                         max_context_len=max(lens))
    want = sdpa_decode(q.float(), kc.float(), vc.float(), meta, scale)
    return got, want


def _prefill_case(hq, hkv, d, dtype, device="cpu", block_m=16):
    from fastdeploy_ext.ops.triton.paged_attention import paged_prefill
    bs = 16
    starts, qlens = [0, 13, 40], [20, 9, 33]
    lens = [s + n for s, n in zip(starts, qlens)]
    kc, vc, tables, ctx = _setup(hq, hkv, d, bs, lens, dtype, device, seed=2)
    g = torch.Generator().manual_seed(3)
    q = torch.randn(sum(qlens), hq, d, generator=g).to(device, dtype)
    cu = torch.tensor([0, 20, 29, 62], dtype=torch.int32, device=device)
    scale = d ** -0.5
    got = paged_prefill(q, kc, vc, tables, cu, ctx, max(qlens), scale, block_m=block_m)
    meta = PagedStepMeta(True, torch.zeros(0), tables, ctx, qlens, starts, bs, max_context_len=max(lens))
    want = sdpa_prefill(q.float(), kc.float(), vc.float(), meta, scale)
    return got, want


def test_interpreter_subprocess():
    if ta.TRITON_INTERPRETED:
        pytest.skip("already in interpreter mode: the test_interp_* tests run in this process")
    run_interp_tests(__file__, timeout=900)


@interp
@pytest.mark.parametrize("hq,hkv,d,dtype,tol", [(16, 2, 128, torch.float32, 1e-5),     # the released shapes
                                               (10, 10, 128, torch.float32, 1e-5),    # DeepSeek-OCR-2: MHA, groups of 1
                                               (4, 2, 32, torch.float16, 3e-3)])    # half precision (small: interpreter time)
def test_interp_decode_matches_sdpa(hq, hkv, d, dtype, tol):
    got, want = _decode_case(hq, hkv, d, dtype)
    assert got.dtype == dtype and (got.float() - want).abs().max().item() <= tol


@interp
def test_interp_decode_fixed_graph_grid_and_one_partition_agree():
    """Padding the partition grid to a max_model_len (as a captured graph does) or using one
    partition per sequence gives the same result: partitions past a length contribute nothing."""
    a, want = _decode_case(4, 2, 32, torch.float32, part_tokens=32, graph_max=512)
    b, _ = _decode_case(4, 2, 32, torch.float32, part_tokens=128)
    assert (a - want).abs().max().item() <= 1e-5 and (b - want).abs().max().item() <= 1e-5


@interp
def test_interp_paged_decode_bench_runs_every_column_against_sdpa(tmp_path, monkeypatch, capsys):
    """The tiles sweep bench (CPU smoke run, tiny shape, fp32): the SDPA reference, the default
    tiles and the extra ones, each matching SDPA, into its JSON."""
    import json
    from fastdeploy_ext.bench import paged_decode as bench
    monkeypatch.setenv("OUT", str(tmp_path))
    assert bench.main(["--device", "cpu", "--dtype", "float32", "--batch", "2", "--context", "70",
                       "--heads", "4", "--kv-heads", "2", "--head-dim", "32", "--block-size", "16",
                       "--tiles", "32,4,3;64,8,2", "--warmup", "0", "--iters", "1"]) == 0
    rows = json.loads((tmp_path / "paged_decode.json").read_text())["rows"]
    assert [r["column"] for r in rows] == ["sdpa", "ours 256,4,3 (default)", "ours 32,4,3", "ours 64,8,2"]
    assert all(r["max_diff"] <= 1e-5 for r in rows[1:])
    assert "sdpa/ours" in capsys.readouterr().out


@interp
@pytest.mark.parametrize("hq,hkv,d,dtype,tol", [(16, 2, 128, torch.float32, 1e-5),     # the released shapes
                                               (4, 2, 32, torch.float16, 3e-3)])    # half precision (small: interpreter time)
def test_interp_prefill_matches_sdpa(hq, hkv, d, dtype, tol):
    got, want = _prefill_case(hq, hkv, d, dtype)
    assert got.dtype == dtype and (got.float() - want).abs().max().item() <= tol


@interp
def test_interp_prefill_causality_is_checked():
    """Mutation check: shifting the queries' positions (a wrong start) changes the output."""
    got, want = _prefill_case(4, 2, 32, torch.float32)
    from fastdeploy_ext.ops.triton.paged_attention import paged_prefill
    bs = 16
    kc, vc, tables, ctx = _setup(4, 2, 32, bs, [20, 22, 73], torch.float32, seed=2)
    q = torch.randn(62, 4, 32, generator=torch.Generator().manual_seed(3))
    cu = torch.tensor([0, 20, 29, 62], dtype=torch.int32)
    wrong = paged_prefill(q, kc, vc, tables, cu, torch.tensor([20, 23, 73], dtype=torch.int32), 33, 32 ** -0.5,
                          block_m=16)
    assert (wrong - want).abs().max().item() > 1e-2


def test_kv_cache_write_uses_slots():
    """The cache write is the step's only scatter: slot s = block * block_size + offset."""
    kv = KVCache.allocate(1, 4, 16, 2, 8, torch.float32, torch.device("cpu"))
    k = torch.randn(3, 2, 8)
    kv.write(0, k, -k, torch.tensor([5, 16 * 3 + 15, 16]))
    assert torch.equal(kv.k[0, 0, 5], k[0]) and torch.equal(kv.k[0, 3, 15], k[1]) and torch.equal(kv.v[0, 1, 0], -k[2])
    assert kv.k.count_nonzero() == k.count_nonzero()     # nothing else written


# ------------------------------------------------------------------------------- CUDA (compiled)
@pytest.fixture
def cuda():
    if ta.TRITON_INTERPRETED or not torch.cuda.is_available():
        pytest.skip("needs a CUDA device and triton in compiled mode")


@pytest.mark.parametrize("hq,hkv", [(16, 2), (10, 10)], ids=["gqa", "mha"])     # PaddleOCR-VL, DeepSeek-OCR-2
@pytest.mark.parametrize("dtype,tol", [(torch.bfloat16, 2e-2), (torch.float16, 3e-3), (torch.float32, 1e-4)])
def test_cuda_decode_and_prefill_match_sdpa(cuda, dtype, tol, hq, hkv):
    got, want = _decode_case(hq, hkv, 128, dtype, device="cuda", part_tokens=256)
    assert (got.float() - want).abs().max().item() <= tol
    got, want = _prefill_case(hq, hkv, 128, dtype, device="cuda", block_m=64)
    assert (got.float() - want).abs().max().item() <= tol


@interp
def test_interp_text_runner_with_triton_paged_equals_sdpa_paged():
    """The runner's step path (metadata, cache writes, chunked prefill, batched decode) gives the
    same logits with the Triton backend as with SDPA: the kernels read the same metadata."""
    from fastdeploy_ext.engine.step import SeqStep, StepBatch
    from fastdeploy_ext.models.paddleocr_vl.config import TextConfig
    from fastdeploy_ext.models.paddleocr_vl.text import ErnieTextModel
    from fastdeploy_ext.ops.attention.paged import PAGED_ATTENTION_BACKENDS
    from fastdeploy_ext.text_runner import TextStepRunner
    cfg = TextConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2, head_dim=32, vocab_size=50, mrope_section=(4, 6, 6))
    torch.manual_seed(0)
    model = ErnieTextModel(cfg, tied=True).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.2)
    outs = {}
    for name in ("sdpa_paged", "triton_paged"):
        r = TextStepRunner(model, PAGED_ATTENTION_BACKENDS[name], block_size=16, device=torch.device("cpu"),
                           dtype=torch.float32, image_token_id=49)
        r.init_kv_cache(12)
        a, b = list(range(1, 30)), list(range(3, 14))
        got = [r.execute(StepBatch(True, [SeqStep(0, a[:20], 0, [7, 2], None, need_logits=False),
                                          SeqStep(1, b, 0, [5], None)]))]
        got.append(r.execute(StepBatch(True, [SeqStep(0, a[20:], 20, [7, 2], None)])))
        for k in range(3):
            got.append(r.execute(StepBatch(False, [SeqStep(0, [k + 1], 29 + k, [7, 2, 9], None, 0),
                                                   SeqStep(1, [k + 2], 11 + k, [5], None, 0)])))
        outs[name] = torch.cat(got)
    assert outs["sdpa_paged"].shape == (1 + 1 + 6, 50)
    assert (outs["sdpa_paged"] - outs["triton_paged"]).abs().max().item() <= 1e-4


# ----------------------------------------------------------------- fused decoder layer passes
@interp
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.float16, 2e-3)])
def test_interp_fused_passes_match_aten(dtype, tol):
    from fastdeploy_ext.models.paddleocr_vl.text import MRope, RMSNorm, apply_rotary
    from fastdeploy_ext.ops.triton.decoder_passes import add_rms_norm, rope_and_cache, silu_mul
    g = torch.Generator().manual_seed(0)
    t, hidden, hq, hkv, d = 5, 96, 4, 2, 32
    norm = RMSNorm(hidden, 1e-5)
    with torch.no_grad():
        norm.weight.normal_(1, 0.1, generator=g)
    norm = norm.to(dtype)
    res, delta = (torch.randn(t, hidden, generator=g).to(dtype) for _ in range(2))
    want_res = res + delta
    want = norm(want_res)
    r = res.clone()
    got = add_rms_norm(delta, r, norm.weight, 1e-5)
    assert torch.equal(r, want_res) and (got.float() - want.float()).abs().max().item() <= tol * 4
    assert (add_rms_norm(None, want_res.clone(), norm.weight, 1e-5).float() - want.float()).abs().max() <= tol * 4

    rope = MRope(d, 5e5, (4, 6, 6))
    cos, sin = rope(torch.randint(0, 300, (3, t), generator=g), dtype)
    qkv = torch.randn(t, (hq + 2 * hkv) * d, generator=g).to(dtype)
    q, k, v = qkv.split([hq * d, hkv * d, hkv * d], -1)
    want_q = apply_rotary(q.reshape(t, hq, d), cos, sin)
    want_k = apply_rotary(k.reshape(t, hkv, d), cos, sin)
    kv_a = KVCache.allocate(1, 3, 16, hkv, d, dtype, torch.device("cpu"))
    kv_b = KVCache.allocate(1, 3, 16, hkv, d, dtype, torch.device("cpu"))
    slots = torch.tensor([3, 17, 40, 41, 0])
    kv_a.write(0, want_k, v.reshape(t, hkv, d), slots)
    buf = qkv.clone()
    rope_and_cache(buf, cos, sin, kv_b.k[0], kv_b.v[0], slots, hq, hkv, d)
    assert (buf[:, :hq * d].reshape(t, hq, d).float() - want_q.float()).abs().max().item() <= tol
    assert torch.equal(buf[:, hq * d:], qkv[:, hq * d:])          # k and v are not touched in the buffer
    assert (kv_b.k - kv_a.k).abs().max().item() <= tol and torch.equal(kv_b.v, kv_a.v)

    gu = torch.randn(t, 2 * 80, generator=g).to(dtype)
    want = torch.nn.functional.silu(gu[:, :80]) * gu[:, 80:]
    assert (silu_mul(gu).float() - want.float()).abs().max().item() <= tol * 4


@interp
def test_interp_fused_decoder_equals_aten_decoder():
    """The whole step path with the fused passes equals the ATen path (fp32), over chunked
    prefill and decode steps."""
    from fastdeploy_ext.engine.step import SeqStep, StepBatch
    from fastdeploy_ext.models.paddleocr_vl.config import TextConfig
    from fastdeploy_ext.models.paddleocr_vl.text import ErnieTextModel
    from fastdeploy_ext.ops.attention.paged import PAGED_ATTENTION_BACKENDS
    from fastdeploy_ext.text_runner import TextStepRunner
    cfg = TextConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2, head_dim=32, vocab_size=50, mrope_section=(4, 6, 6))
    torch.manual_seed(0)
    model = ErnieTextModel(cfg, tied=False).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.2)
    outs = {}
    for fused in (False, True):
        model.fused = fused
        r = TextStepRunner(model, PAGED_ATTENTION_BACKENDS["sdpa_paged"], block_size=16, device=torch.device("cpu"),
                           dtype=torch.float32, image_token_id=49)
        r.init_kv_cache(8)
        pos = torch.stack([torch.arange(20), torch.arange(20) // 3, torch.arange(20) % 5])
        got = [r.execute(StepBatch(True, [SeqStep(0, list(range(1, 13)), 0, [6, 1], pos[:, :12], -4, need_logits=False)])),
               r.execute(StepBatch(True, [SeqStep(0, list(range(13, 21)), 12, [6, 1], pos[:, 12:], -4)]))]
        for k in range(3):
            got.append(r.execute(StepBatch(False, [SeqStep(0, [k + 2], 20 + k, [6, 1], None, -4)])))
        outs[fused] = torch.cat(got)
    assert outs[True].shape == (4, 50)
    assert (outs[True] - outs[False]).abs().max().item() <= 1e-4


def _deepseek_decoder_logits(fused: bool, device: str, dtype: torch.dtype) -> torch.Tensor:
    """DeepSeek-OCR-2's decoder (a dense layer then MoE layers, MHA, 1D rope) through the step
    runner over chunked prefill and batched decode steps: its logits with or without the fused
    passes."""
    from fastdeploy_ext.engine.step import SeqStep, StepBatch
    from fastdeploy_ext.models.deepseek_ocr2.config import TextConfig
    from fastdeploy_ext.models.deepseek_ocr2.text import DeepseekOCR2Decoder
    from fastdeploy_ext.ops.attention.paged import PAGED_ATTENTION_BACKENDS
    from fastdeploy_ext.text_runner import TextStepRunner
    cfg = TextConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
                     num_key_value_heads=4, vocab_size=50, n_routed_experts=8, num_experts_per_tok=3,
                     n_shared_experts=2, moe_intermediate_size=24, first_k_dense=1)
    torch.manual_seed(0)
    model = DeepseekOCR2Decoder(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.2)
    model = model.to(device, dtype)
    model.fused = fused
    r = TextStepRunner(model, PAGED_ATTENTION_BACKENDS["sdpa_paged"], block_size=16, device=torch.device(device),
                       dtype=dtype, image_token_id=49, position_rows=1)
    r.init_kv_cache(8)
    a, b = list(range(1, 25)), list(range(5, 16))
    with torch.no_grad():
        got = [r.execute(StepBatch(True, [SeqStep(0, a[:16], 0, [6, 1], torch.arange(16)[None], need_logits=False),
                                          SeqStep(1, b, 0, [3], torch.arange(11)[None])])),
               r.execute(StepBatch(True, [SeqStep(0, a[16:], 16, [6, 1], torch.arange(16, 24)[None])]))]
        for k in range(3):
            got.append(r.execute(StepBatch(False, [SeqStep(0, [k + 2], 24 + k, [6, 1], None),
                                                   SeqStep(1, [k + 7], 11 + k, [3], None)])))
    return torch.cat(got).float().cpu()


@interp
def test_interp_deepseek_fused_decoder_equals_its_aten_decoder(monkeypatch):
    """DeepSeek-OCR-2's decoder with the fused passes (packed q|k|v and gate|up, add + RMSNorm,
    rope into the cache) gives its ATen path's logits (fp32); a fused path that drops the rotary
    of k (k written to the cache unrotated) is caught by the same comparison."""
    eager = _deepseek_decoder_logits(False, "cpu", torch.float32)
    fused = _deepseek_decoder_logits(True, "cpu", torch.float32)
    assert fused.shape == (1 + 1 + 6, 50)
    assert (fused - eager).abs().max().item() <= 1e-4

    import fastdeploy_ext.text_runner as tr
    from fastdeploy_ext.models.eager_decoder import apply_rotary

    def write_unrotated(self, layer, qkv, cos, sin):      # q rotated, k written to the cache as it is
        hq, hkv, d = self.heads
        n = qkv.shape[0]
        q, k, v = qkv.split([hq * d, hkv * d, hkv * d], -1)
        q.copy_(apply_rotary(q.reshape(n, hq, d), cos, sin).reshape(n, -1))
        self.kv.write(layer, k.reshape(n, hkv, d), v.reshape(n, hkv, d), self.meta.slot_mapping)
    monkeypatch.setattr(tr.PagedAttention, "write_rotated", write_unrotated)
    broken = _deepseek_decoder_logits(True, "cpu", torch.float32)
    assert (broken - eager).abs().max().item() > 1e-2


def test_deepseek_fused_packing_keeps_the_checkpoints_parameters_as_views():
    """Packing makes q/k/v and gate/up weights views of one tensor each (no second copy), with
    the same values, and the eager forward is unchanged by it."""
    from fastdeploy_ext.models.deepseek_ocr2.config import TextConfig
    from fastdeploy_ext.models.deepseek_ocr2.text import DecoderLayer
    cfg = TextConfig(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=2,
                     num_key_value_heads=2, vocab_size=20, n_routed_experts=4, num_experts_per_tok=2,
                     n_shared_experts=1, moe_intermediate_size=8, first_k_dense=1)
    layer = DecoderLayer(cfg, 1)
    before = {k: v.clone() for k, v in layer.state_dict().items()}
    layer.pack()
    a, sh = layer.self_attn, layer.mlp.shared_experts
    assert a.q_proj.weight.data_ptr() == layer.qkv_weight.data_ptr()
    assert a.v_proj.weight.data_ptr() == layer.qkv_weight[64:].data_ptr()
    assert sh.up_proj.weight.data_ptr() == sh.gate_up_weight[8:].data_ptr()
    assert all(torch.equal(before[k], v) for k, v in layer.state_dict().items())
    assert set(layer.state_dict()) == set(before)          # the packed tensors are not new state


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-4), (torch.bfloat16, 0.1)])
def test_cuda_deepseek_fused_decoder_matches_its_aten_decoder(dtype, tol):
    if ta.TRITON_INTERPRETED or not torch.cuda.is_available():
        pytest.skip("needs a CUDA device and triton in compiled mode")
    eager = _deepseek_decoder_logits(False, "cuda", dtype)
    fused = _deepseek_decoder_logits(True, "cuda", dtype)
    assert (fused - eager).abs().max().item() <= tol
    assert torch.nn.functional.cosine_similarity(fused.flatten(), eager.flatten(), dim=0).item() >= 0.9999
