"""The Triton grouped-GEMM MoE (ops/triton/grouped_moe.py, backend ``triton_moe``) against the
ATen experts (``aten_moe``), its device-side grouping, and the plan's choice of it.

CPU: the grouping is plain torch (checked here directly, and on the meta device under the sync
guard); the kernels run in the Triton interpreter, which needs TRITON_INTERPRET=1 before triton
is first imported, so the ``test_interp_*`` tests run in a child process started with it
(``test_interpreter_subprocess``), on tiny shapes in fp32 (exact dots there). CUDA
(``test_cuda_*``, the cuda/unit leg): bf16 at the released shape, and a CUDA graph capture.
"""
from __future__ import annotations


import pytest
import torch

from fastdeploy_ext.ops.moe import BUILTIN_MOE_BACKENDS, aten_experts
from fastdeploy_ext.ops.triton import grouped_moe as gm
from fastdeploy_ext.ops.triton import runtime as rt
from fastdeploy_ext.sync_guard import HostSyncError, HostSyncGuard
from .triton_interpreter import run_interp_tests

interp = pytest.mark.skipif(not rt.TRITON_INTERPRETED,
                            reason="interpreter test: runs in test_interpreter_subprocess")
cuda = pytest.mark.skipif(not torch.cuda.is_available() or rt.triton is None or bool(rt.TRITON_INTERPRETED),
                          reason="needs a CUDA device and compiled triton")


def _routing(t: int, k: int, e: int, seed: int = 0, device="cpu", every_token_to: int | None = None):
    """Router-like routing: k distinct experts per token from a softmax, weights not renormalised
    (``every_token_to``: that expert among each token's k)."""
    g = torch.Generator().manual_seed(seed)
    probs = torch.randn(t, e, generator=g).softmax(-1)
    favoured = probs.clone()
    if every_token_to is not None:
        favoured[:, every_token_to] += 2.0
    idx = favoured.topk(k, -1).indices
    return probs.gather(1, idx).to(device), idx.to(device)


def _experts(e: int, h: int, i: int, dtype=torch.float32, device="cpu", seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    gate_up = (torch.randn(e, 2 * i, h, generator=g) * h ** -0.5).to(device, dtype)
    down = (torch.randn(e, h, i, generator=g) * i ** -0.5).to(device, dtype)
    return gate_up, down


def _x(t: int, h: int, dtype=torch.float32, device="cpu", seed: int = 2):
    return torch.randn(t, h, generator=torch.Generator().manual_seed(seed)).to(device, dtype)


# ------------------------------------------------------------------ the grouping (plain torch)
@pytest.mark.parametrize("t,k,e,block_m", [(3, 2, 8, 16), (40, 2, 8, 16), (25, 3, 5, 4), (1, 6, 64, 16)])
def test_grouping_puts_each_expert_on_whole_blocks(t, k, e, block_m):
    _, idx = _routing(t, k, e, seed=t, every_token_to=3 if t >= 40 else None)   # 40: one expert > a block
    rows, block_expert = gm.align_by_expert(idx, e, block_m, kernel=False)
    m = t * k
    assert rows.numel() == gm.grouped_capacity(m, e, block_m) and rows.numel() % block_m == 0
    assert block_expert.numel() == rows.numel() // block_m
    flat = idx.reshape(-1)
    real = rows[rows < m]
    assert sorted(real.tolist()) == list(range(m))            # every assignment row exactly once
    for b in range(block_expert.numel()):
        blk = rows[b * block_m:(b + 1) * block_m]
        blk = blk[blk < m]
        if int(block_expert[b]) == e:                          # past the used part: padding only
            assert blk.numel() == 0
        else:
            assert (flat[blk.long()] == int(block_expert[b])).all()
    used = block_expert[block_expert < e]
    assert (used[1:] >= used[:-1]).all()                        # experts in order, each on whole blocks
    counts = torch.bincount(flat, minlength=e)
    for x in range(e):                                          # an expert's blocks: ceil(count / block_m)
        assert int((block_expert == x).sum()) == -(-int(counts[x]) // block_m)


def test_grouping_makes_no_host_sync():
    """Every op of the grouping runs on the meta device under the sync guard without reading a
    value back (the decode step runs it inside CUDA graphs)."""
    _, idx = _routing(64, 6, 64)
    idx = idx.to("meta")
    with torch.inference_mode(), HostSyncGuard({"meta"}) as guard:
        rows, block_expert = gm.align_by_expert(idx, 64, 16, kernel=False)
    assert guard.events == [] and rows.device.type == "meta"
    assert rows.numel() == gm.grouped_capacity(64 * 6, 64, 16)


def test_the_sync_check_sees_a_grouping_that_reads_back(monkeypatch):
    """Mutation: a grouping sized by the largest expert count (a .item()) is caught."""
    real = gm.align_by_expert

    def reads_back(expert_ids, num_experts, block_m):
        int(torch.bincount(expert_ids.reshape(-1), minlength=num_experts).max())
        return real(expert_ids, num_experts, block_m)

    monkeypatch.setattr(gm, "align_by_expert", reads_back)
    _, idx = _routing(8, 2, 8)
    idx = idx.to("meta")
    with pytest.raises(HostSyncError, match="host sync in a path that must not sync: .*(bincount|item|_local_scalar)"):
        with torch.inference_mode(), HostSyncGuard({"meta"}):
            gm.align_by_expert(idx, 8, 16)


def test_bad_inputs_name_the_problem():
    gate_up, down = _experts(4, 32, 16)
    x = _x(5, 32)
    w, idx = _routing(5, 2, 4)
    if rt.triton is None:
        pytest.skip("triton not importable")
    with pytest.raises(ValueError, match=r"expert weights do not fit hidden 32"):
        gm.grouped_moe(x, w, idx, gate_up[:, :, :16], down)
    with pytest.raises(ValueError, match=r"must both be \[T=5, k\]"):
        gm.grouped_moe(x, w[:, :1], idx, gate_up, down)
    with pytest.raises(ValueError, match="must share a dtype"):
        gm.grouped_moe(x.half(), w, idx, gate_up, down)
    with pytest.raises(ValueError, match="expert ids must be int32/int64"):
        gm.grouped_moe(x, w, idx.float(), gate_up, down)


def test_tile_table_is_by_rows_per_expert():
    assert gm.pick_blocks(6, 64).block_m == 16                  # one decode token
    assert gm.pick_blocks(128 * 6, 64).block_m == 16            # a 128-sequence decode batch
    assert gm.pick_blocks(4096 * 6, 64).block_m == 64           # a 4096-token prefill


def test_backends_are_registered_in_preference_order():
    names = [b.name for b in BUILTIN_MOE_BACKENDS]
    assert names == ["triton_moe", "aten_moe"]
    triton_moe = BUILTIN_MOE_BACKENDS[0]
    ok, why = triton_moe.available(torch.device("cpu"))
    assert not ok and "CUDA" in why


def test_kernels_compile_for_hopper_without_a_gpu():
    """The compiled path's kernels lower to sm90 machine code (triton.compile with its bundled
    ptxas: no GPU needed) at the decode tiles in bf16, so a CUDA-only type or layout error shows
    on the CPU CI too; the CUDA tests run them."""
    if rt.triton is None or rt.TRITON_INTERPRETED:
        pytest.skip("needs triton in compiled mode")
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    cfg = gm.pick_blocks(6, 64)
    tiles = {"BM": cfg.block_m, "BN": cfg.block_n, "BK": cfg.block_k, "DOT_PREC": "tf32", "s_wk": 1}
    gemm = {"ROWS": "*i32", "BLOCK_EXPERT": "*i32", "M": "i32", "K": "i32", "N": "i32", "E": "i32",
            "s_we": "i32", "s_wn": "i32", "s_wk": "constexpr", **{k: "constexpr" for k in ("BM", "BN", "BK", "DOT_PREC")}}
    kernels = {
        "gate_up": ({"X": "*bf16", "W": "*bf16", "H": "*bf16", "TOPK": "i32", "s_xt": "i32", "s_ht": "i32", **gemm},
                    tiles, 4),
        "down": ({"H": "*bf16", "W": "*bf16", "RW": "*fp32", "Y": "*bf16", "s_ht": "i32", "s_yt": "i32", **gemm},
                 tiles, 4),
        "align": ({"IDS": "*i64", "ROWS": "*i32", "BLOCK_EXPERT": "*i32", "M": "i32", "CAP": "i32",
                   **{k: "constexpr" for k in ("E", "E_PAD", "BM", "CHUNK")}},
                  {"E": 64, "E_PAD": 64, "BM": cfg.block_m, "CHUNK": gm.ALIGN_CHUNK}, 4),
    }
    for name, (sig, consts, warps) in kernels.items():
        fn = gm._KERNELS[name]
        order = fn.arg_names
        sig = {a: sig[a] for a in order}                     # the kernel's own argument order
        try:
            out = rt.triton.compile(ASTSource(fn=fn, signature=sig, constexprs=consts),
                                    target=GPUTarget("cuda", 90, 32), options={"num_warps": warps, "num_stages": 3})
        except (FileNotFoundError, PermissionError) as e:      # no bundled ptxas in this triton build
            pytest.skip(f"no CUDA toolchain in this triton: {e}")
        assert out.asm.get("cubin"), name


# ------------------------------------------------------------------ the plan
def _plan(row_name: str, dtype: str | None, triton_present: bool):
    from fastdeploy_ext.capabilities import capability_table
    from fastdeploy_ext.models.registry import get_family
    from fastdeploy_ext.plan import BUILTIN_TOWER, ComponentKind, PlanRequest, resolve_for_components
    fam = get_family("deepseek_ocr2")
    tower = {k: dict(v) for k, v in BUILTIN_TOWER.items()}
    if triton_present:
        tower[ComponentKind.MOE_EXPERTS]["triton_moe"] = (True, False, "test: triton with a CUDA device")
    paged = {"triton_paged": (triton_present, "test"), "sdpa_paged": (True, "ok")}
    req = PlanRequest(dtype=dtype) if dtype else PlanRequest()
    return resolve_for_components(capability_table(override="")[row_name], req, fam.components(fam.default_config()),
                                  device="cuda:0" if row_name.startswith("cuda") else "cpu", kernels={},
                                  text_available=paged, tower_available=tower)


@pytest.mark.parametrize("row_name", ["cuda_sm90", "cuda_sm80"])
def test_cuda_rows_pick_the_grouped_gemm_in_half_precision_and_say_why_not_in_fp32(row_name):
    plan = _plan(row_name, None, True)
    assert plan.moe_experts.value == "triton_moe" and f"row {row_name}" in plan.moe_experts.reason
    fp32 = _plan(row_name, "float32", True)
    assert fp32.moe_experts.value == "aten_moe"
    assert "triton_moe: dtype float32 not in ['bfloat16', 'float16']" in fp32.moe_experts.reason
    absent = _plan(row_name, None, False)
    assert absent.moe_experts.value == "aten_moe" and "triton_moe: kernel unavailable" in absent.moe_experts.reason


@pytest.mark.parametrize("row_name", ["cuda_sm90", "cuda_sm80"])
def test_cuda_rows_pick_the_triton_paged_kernels_for_the_mha_decoder(row_name):
    """10 heads x 128, no GQA: head_dim 128 is inside triton_paged's [16, 256] (one query head
    per KV head is a group of 1), so the decoder's paged attention is the Triton kernels."""
    plan = _plan(row_name, None, True)
    assert plan.text_attention.value == "triton_paged"
    assert f"first usable in row {row_name}" in plan.text_attention.reason
    assert plan.decode_graphs.value                          # graph-safe decode: the decode graphs are on


@pytest.mark.parametrize("row_name", ["cpu", "cuda"])
def test_rows_without_the_kernel_keep_aten(row_name):
    assert _plan(row_name, None, True).moe_experts.value == "aten_moe"


# ------------------------------------------------------------------ interpreter (CPU) runs
def test_interpreter_subprocess():
    if rt.TRITON_INTERPRETED:
        pytest.skip("already in interpreter mode: the test_interp_* tests run in this process")
    if rt.triton is None:
        pytest.skip("triton not importable")
    run_interp_tests(__file__, timeout=900)


def _case(t, k, e, h, i, *, all_to=None, seed=0):
    w, idx = _routing(t, k, e, seed=seed, every_token_to=all_to)   # all_to: several blocks of one expert
    gate_up, down = _experts(e, h, i, seed=seed + 1)
    x = _x(t, h, seed=seed + 2)
    return x, w, idx, gate_up, down


CASES = {
    "tokens_below_block": dict(t=3, k=2, e=8, h=32, i=16),          # 6 rows in one 16-row block
    "experts_without_tokens": dict(t=5, k=2, e=16, h=32, i=16),     # at most 10 of 16 experts used
    "one_expert_gets_all": dict(t=40, k=2, e=6, h=32, i=16, all_to=2),   # 40 rows: 3 blocks of one expert
    "unaligned_dims": dict(t=9, k=3, e=4, h=40, i=24),              # H, I not multiples of the tiles
}


@interp
@pytest.mark.parametrize("t,k,e,block_m", [(3, 2, 8, 16), (40, 2, 8, 16), (25, 3, 5, 4), (1, 6, 64, 16),
                                           (50, 6, 20, 16),      # 300 rows: several chunks of the kernel
                                           (200, 6, 64, 4)])     # 348 blocks: several chunks of block owners
def test_interp_grouping_kernel_equals_the_torch_ops(t, k, e, block_m):
    """The grouping kernel (a program per expert and one for the tail) gives the torch grouping's tensors exactly (so the
    torch version's checks above hold for it), and is what decode-sized batches use."""
    _, idx = _routing(t, k, e, seed=t, every_token_to=3 if t >= 40 else None)
    want = gm.align_by_expert(idx, e, block_m, kernel=False)
    got = gm.align_by_expert(idx, e, block_m, kernel=True)
    assert got[0].dtype == want[0].dtype == torch.int32
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    auto = gm.align_by_expert(idx, e, block_m)
    assert torch.equal(auto[0], want[0]) and torch.equal(auto[1], want[1])


@interp
@pytest.mark.parametrize("name", sorted(CASES))
def test_interp_matches_aten_fp32(name):
    x, w, idx, gate_up, down = _case(**CASES[name])
    used = torch.unique(idx).numel()
    if name == "experts_without_tokens":
        assert used < gate_up.shape[0]
    got = gm.grouped_moe(x, w, idx, gate_up, down, gm.MoEBlocks(16, 16, 16))
    want = aten_experts(x, w, idx, gate_up, down)
    assert got.dtype == torch.float32 and got.shape == want.shape
    assert (got - want).abs().max().item() <= 1e-4
    assert want.abs().max().item() > 0.05          # a real signal, not zeros on both sides


@interp
def test_interp_the_added_output_goes_into_the_final_sum():
    """``add`` (the shared experts' output in the model) is summed with the k expert rows: equal
    to ATen's experts + add, and not the same as without it; a wrong shape is refused."""
    x, w, idx, gate_up, down = _case(**CASES["unaligned_dims"])
    add = _x(x.shape[0], x.shape[1], seed=7)
    blocks = gm.MoEBlocks(16, 16, 16)
    got = gm.grouped_moe(x, w, idx, gate_up, down, blocks, add=add)
    assert (got - (aten_experts(x, w, idx, gate_up, down) + add)).abs().max().item() <= 1e-4
    assert torch.equal(aten_experts(x, w, idx, gate_up, down, add=add), aten_experts(x, w, idx, gate_up, down) + add)
    assert (got - gm.grouped_moe(x, w, idx, gate_up, down, blocks)).abs().max().item() > 0.05
    with pytest.raises(ValueError, match="add must be"):
        gm.grouped_moe(x, w, idx, gate_up, down, blocks, add=add[:, :-1])


@interp
def test_interp_default_tiles_and_larger_row_blocks_agree():
    x, w, idx, gate_up, down = _case(t=12, k=6, e=8, h=32, i=32, seed=4)   # 72 rows over 8 experts
    want = aten_experts(x, w, idx, gate_up, down)
    for blocks in (None, gm.MoEBlocks(32, 32, 32), gm.MoEBlocks(64, 16, 32)):
        got = gm.grouped_moe(x, w, idx, gate_up, down, blocks)
        assert (got - want).abs().max().item() <= 1e-4, blocks


@interp
@pytest.mark.parametrize("fault", ["shifted_expert_offsets", "dropped_block", "weights_dropped"])
def test_interp_broken_grouping_or_weights_are_seen(fault, monkeypatch):
    """Mutations: the parity check above fails when blocks point at the wrong expert, when a
    block of rows is skipped, or when the routing weights are not applied."""
    x, w, idx, gate_up, down = _case(**CASES["one_expert_gets_all"])
    want = aten_experts(x, w, idx, gate_up, down)
    real = gm.align_by_expert
    e = gate_up.shape[0]

    def broken(expert_ids, num_experts, block_m):
        rows, block_expert = real(expert_ids, num_experts, block_m)
        if fault == "shifted_expert_offsets":
            block_expert = torch.where(block_expert < e, (block_expert + 1) % e, block_expert)
        else:
            block_expert = block_expert.clone()
            block_expert[0] = e
        return rows, block_expert

    if fault == "weights_dropped":
        got = gm.grouped_moe(x, torch.ones_like(w), idx, gate_up, down, gm.MoEBlocks(16, 16, 16))
    else:
        monkeypatch.setattr(gm, "align_by_expert", broken)
        got = gm.grouped_moe(x, w, idx, gate_up, down, gm.MoEBlocks(16, 16, 16))
    # rows a dropped block never writes hold whatever the allocator left: NaN counts as a difference
    assert not torch.allclose(got, want, rtol=0, atol=1e-2)


@interp
def test_interp_the_model_moe_through_the_triton_backend():
    """DeepSeek-OCR-2's MoE layer (router, routed experts, shared experts) gives the same output
    with the plan's triton_moe as with aten_moe (prefill- and decode-sized batches), eager and
    through the fused decoder pass."""
    from fastdeploy_ext.models.deepseek_ocr2 import text
    from fastdeploy_ext.models.deepseek_ocr2.config import TextConfig
    c = TextConfig(hidden_size=32, moe_intermediate_size=16, n_routed_experts=8, num_experts_per_tok=3,
                   n_shared_experts=2)
    torch.manual_seed(0)
    moe = text.MoE(c)
    with torch.no_grad():
        for p in moe.parameters():
            p.normal_(0, 0.3)
    triton_moe = next(b for b in BUILTIN_MOE_BACKENDS if b.name == "triton_moe")
    moe.pack()
    for t in (2, 20):
        x = _x(t, 32, seed=t)
        with torch.inference_mode():
            want = moe(x)
            moe.backend = triton_moe
            got = moe(x)
            # the fused pass: the shared experts' output summed into the routed experts' combine
            fused = moe.forward_fused(x)
            moe.backend = text.ATEN_MOE
            fused_aten = moe.forward_fused(x)
        assert (got - want).abs().max().item() <= 1e-4
        assert (fused - want).abs().max().item() <= 1e-4 and (fused_aten - want).abs().max().item() <= 1e-5


@interp
def test_interp_the_runner_sets_the_plans_backend_on_the_decoder(tmp_path, monkeypatch):
    """A row listing triton_moe first (an override; the interpreter stands in for CUDA): the plan
    picks it, the loaded decoder's MoE layers run it, and their output equals aten_moe's."""
    from fastdeploy_ext.models.deepseek_ocr2 import text, tiny
    from fastdeploy_ext.plan import PlanRequest
    from fastdeploy_ext.runner import create_runner
    monkeypatch.setattr(rt, "available_on", lambda device: (True, "test: the interpreter on the CPU"))
    caps = tmp_path / "caps.yaml"
    caps.write_text("rows:\n  cpu:\n    kernels:\n      moe_experts:\n"
                    "        - {backend: triton_moe, dtypes: [float32]}\n"
                    "        - {backend: aten_moe, dtypes: [float32]}\n")
    runner = create_runner(PlanRequest(device="cpu", capabilities=str(caps)))
    runner.load_model(str(tiny.write_checkpoint(tmp_path / "tiny", seed=3)), with_text=True)
    assert runner.plan.moe_experts.value == "triton_moe", runner.plan.moe_experts
    moes = [layer.mlp for layer in runner.text_model.layers if isinstance(layer.mlp, text.MoE)]
    assert moes and all(m.backend.name == "triton_moe" for m in moes)
    x = _x(11, runner.cfg.text.hidden_size, seed=5)
    with torch.inference_mode():
        got = moes[0](x)
        moes[0].backend = text.ATEN_MOE
        want = moes[0](x)
    assert (got - want).abs().max().item() <= 1e-4 and want.abs().max().item() > 1e-3


# ------------------------------------------------------------------ CUDA (the cuda/unit leg)
RELEASED = dict(e=64, h=1280, i=896, k=6)


@cuda
@pytest.mark.parametrize("t,with_add", [(1, False), (64, False), (64, True), (4096, False)])
def test_cuda_bf16_released_shape_matches_fp32_aten(t, with_add):
    e, h, i, k = RELEASED["e"], RELEASED["h"], RELEASED["i"], RELEASED["k"]
    dev = torch.device("cuda")
    gate_up, down = _experts(e, h, i, torch.bfloat16, dev)
    x = _x(t, h, torch.bfloat16, dev)
    w, idx = _routing(t, k, e, device=dev)
    add = _x(t, h, torch.bfloat16, dev, seed=5) * 0.05 if with_add else None
    got = gm.grouped_moe(x, w, idx, gate_up, down, add=add)
    want = aten_experts(x.float(), w, idx, gate_up.float(), down.float(), add=None if add is None else add.float())
    assert got.dtype == torch.bfloat16
    err = (got.float() - want).abs().max().item()
    assert err <= 2e-2 * want.abs().max().item(), err
    cos = torch.nn.functional.cosine_similarity(got.float().flatten(), want.flatten(), dim=0).item()
    assert cos >= 0.9995


@cuda
@pytest.mark.parametrize("t", [1, 64, 128, 600])      # 600 x 6 rows: past ALIGN_KERNEL_MAX_ROWS, forced here
def test_cuda_grouping_kernel_equals_the_torch_ops(t):
    e, k = RELEASED["e"], RELEASED["k"]
    _, idx = _routing(t, k, e, seed=t, device="cuda")
    bm = gm.pick_blocks(t * k, e).block_m
    want = gm.align_by_expert(idx, e, bm, kernel=False)
    got = gm.align_by_expert(idx, e, bm, kernel=True)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


@cuda
def test_cuda_fp32_matches_aten():
    dev = torch.device("cuda")
    x, w, idx, gate_up, down = (a.to(dev) for a in _case(**CASES["one_expert_gets_all"]))
    got = gm.grouped_moe(x, w, idx, gate_up, down)
    want = aten_experts(x, w, idx, gate_up, down)
    assert (got - want).abs().max().item() <= 1e-4


@cuda
def test_cuda_grouping_and_kernels_make_no_host_sync_and_replay_in_a_graph():
    """The whole routed-experts call under torch's sync debug mode (error on a sync), then
    captured in a CUDA graph and replayed on new routing: equal to eager bitwise."""
    e, h, i, k = RELEASED["e"], RELEASED["h"], RELEASED["i"], RELEASED["k"]
    dev = torch.device("cuda")
    gate_up, down = _experts(e, h, i, torch.bfloat16, dev)
    x = _x(64, h, torch.bfloat16, dev)
    w, idx = _routing(64, k, e, device=dev)
    gm.grouped_moe(x, w, idx, gate_up, down)          # compile outside the checks
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        gm.grouped_moe(x, w, idx, gate_up, down)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        gm.grouped_moe(x, w, idx, gate_up, down)
    torch.cuda.current_stream().wait_stream(stream)
    with torch.cuda.graph(graph):
        out = gm.grouped_moe(x, w, idx, gate_up, down)
    w2, idx2 = _routing(64, k, e, seed=9, device=dev)
    x2 = _x(64, h, torch.bfloat16, dev, seed=9)
    x.copy_(x2)
    w.copy_(w2)
    idx.copy_(idx2)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, gm.grouped_moe(x2, w2, idx2, gate_up, down))


# ------------------------------------------------------------------ the bench (CPU smoke run)
def test_bench_runs_every_column_on_the_same_weights(capsys):
    """The tiny shape on the CPU: ours is n/a with its reason, ATen and transformers' loop give
    the same layer output (cosine 1), the table has one row per token count."""
    pytest.importorskip("transformers")
    from fastdeploy_ext.bench import moe as bench
    rows = bench.run(bench.TINY, [1, 12], torch.float32, torch.device("cpu"), warmup=0, iters=1, graphs=False)
    assert [r["tokens"] for r in rows] == [1, 12]
    for r in rows:
        assert r["base"] == "aten_moe" and "CUDA" in r["notes"]["ours"]
        assert r["cos_tf_loop"] >= 0.99999 and isinstance(r["aten_moe"], float)
    bench.print_table(rows, bench.TINY, torch.float32, torch.device("cpu"))
    out = capsys.readouterr().out
    assert "8 experts x 32, top-3, 2 shared" in out and "tf_loop/ours" in out
