"""The fused-layer path: Triton residual+bias+LayerNorm and one-launch q/k rotary kernels
against their ATen references (under the Triton interpreter on CPU, compiled on CUDA), the fused
encoder forward against the eager one, and the plan's fused_layers decision."""
from __future__ import annotations


import pytest
import torch
import torch.nn.functional as F

from fastdeploy_ext.models.paddleocr_vl.config import VisionConfig
from fastdeploy_ext.models.paddleocr_vl.metadata import MetadataBuilder
from fastdeploy_ext.models.paddleocr_vl.vision import VisionEncoder, VisionExecution
from fastdeploy_ext.capabilities import capability_table
from fastdeploy_ext.ops import norm, rotary
from fastdeploy_ext.ops.attention.varlen import get_backend
from fastdeploy_ext.ops.triton import runtime as rt
from fastdeploy_ext.plan import PlanError, PlanRequest, resolve_plan

from .plan_facts import ALL_PRESENT, absent
from .triton_interpreter import run_interp_tests

interp = pytest.mark.skipif(not rt.TRITON_INTERPRETED, reason="runs in test_fused_interpreter_subprocess")


def _device():
    return "cuda" if (torch.cuda.is_available() and not rt.TRITON_INTERPRETED) else "cpu"


# ----------------------------------------------------------------------- kernels vs references
def _check_add_ln(device, dtype, n=37, hidden=144, tol=0.0):
    g = torch.Generator().manual_seed(1)
    x, d = (torch.randn(n, hidden, generator=g).to(device, dtype) for _ in range(2))
    b, w, lb = (torch.randn(hidden, generator=g).to(device, dtype) for _ in range(3))
    ref_r, ref_y = norm.add_layer_norm_torch(x, d, b, w, lb, 1e-6)
    xr = x.clone()
    r, y = norm.add_layer_norm(xr, d, b, w, lb, 1e-6, out=xr)      # residual updated in place
    assert r.data_ptr() == xr.data_ptr()
    # fp32: same value; half types: the kernel sums x + d + b in fp32 before one rounding,
    # ATen rounds after each add -> at most one unit of the last place apart
    assert torch.allclose(r.float(), ref_r.float(), rtol=0, atol=tol * ref_r.float().abs().max().item() + 1e-6)
    assert torch.allclose(y.float(), ref_y.float(), rtol=0, atol=max(tol, 1e-5) * 8)
    r2, y2 = norm.add_layer_norm(x, None, None, w, lb, 1e-6)          # plain LayerNorm
    assert r2 is x
    assert torch.allclose(y2.float(), F.layer_norm(x, (hidden,), w, lb, 1e-6).float(), rtol=0,
                          atol=max(tol, 1e-5) * 8)


def _check_rotary(device, dtype, n=29, heads=3, d=72):
    g = torch.Generator().manual_seed(2)
    qkv = torch.randn(n, 3 * heads * d, generator=g).to(device, dtype)
    cos, sin = (torch.randn(n, d, generator=g).to(device) for _ in range(2))
    ref = qkv.clone()
    v_before = qkv[:, 2 * heads * d:].clone()
    rotary.rotary_qk_in_place(qkv[:, :2 * heads * d].view(n, 2 * heads, d), cos, sin)
    rotary.rotary_qk_in_place_torch(ref[:, :2 * heads * d].view(n, 2 * heads, d), cos, sin)
    assert torch.equal(qkv[:, 2 * heads * d:], v_before), "v must not be touched"
    # fp32 math then one rounding on both sides; the compiled kernel may contract to FMA
    assert torch.allclose(qkv.float(), ref.float(), rtol=0, atol=1e-5 if dtype == torch.float32 else 2e-2)
    if device == "cpu":     # interpreter: numpy, no FMA -> the exact same bits
        assert torch.equal(qkv, ref)


def _check_add_ln_row_maps(device, dtype, views=2, side=7, window=5, hidden=40):
    """The window row maps (SAM's partition folded into the pass) against the same pass without
    maps and the layout change done by indexing: the same bits, the padding rows zero; a map
    shifted by one row is caught."""
    from fastdeploy_ext.models.deepseek_ocr2.vision import WindowMaps
    g = torch.Generator().manual_seed(3)
    n = views * side * side
    maps = WindowMaps.build(views, side, window, torch.device(device))
    x = torch.randn(n, hidden, generator=g).to(device, dtype)
    d_win = torch.randn(maps.rows.numel(), hidden, generator=g).to(device, dtype)
    b, w, lb = (torch.randn(hidden, generator=g).to(device, dtype) for _ in range(3))
    # Y in window order: the plain pass, then its rows gathered (zeros where the map says -1)
    _, y_plain = norm.add_layer_norm(x, None, None, w, lb, 1e-6)
    _, y_win = norm.add_layer_norm(x, None, None, w, lb, 1e-6, rows_of_y=maps.rows)
    pad = maps.rows < 0
    assert y_win.shape == (maps.rows.numel(), hidden) and int(pad.sum()) == maps.rows.numel() - n > 0
    assert torch.equal(y_win[~pad], y_plain[maps.rows[~pad].long()]) and not y_win[pad].any()
    # delta in window order added back onto the grid
    r_ref, y_ref = norm.add_layer_norm(x, d_win[maps.delta_rows.long()].contiguous(), b, w, lb, 1e-6)
    xr = x.clone()
    r, y = norm.add_layer_norm(xr, d_win, b, w, lb, 1e-6, out=xr, delta_rows=maps.delta_rows)
    assert r.data_ptr() == xr.data_ptr() and torch.equal(r, r_ref) and torch.equal(y, y_ref)
    # ATen's fallback agrees
    r_t, y_t = norm.add_layer_norm_torch(x, d_win, b, w, lb, 1e-6, None, maps.rows, maps.delta_rows)
    assert torch.allclose(y_t.float(), y_ref[maps.rows.clamp(min=0).long()].float().masked_fill(pad[:, None], 0),
                          rtol=0, atol=1e-4 if dtype == torch.float32 else 8 * 8e-3)   # one rounding vs two, as above
    shifted = torch.roll(maps.delta_rows, 1)
    assert not torch.equal(norm.add_layer_norm(x, d_win, b, w, lb, 1e-6, delta_rows=shifted)[1], y_ref)


@interp
def test_interp_add_layer_norm_row_maps():
    _check_add_ln_row_maps("cpu", torch.float32)


@interp
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_interp_add_layer_norm(dtype):
    _check_add_ln("cpu", dtype, tol=0.0 if dtype == torch.float32 else 1e-3)


@interp
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_interp_rotary_qk(dtype):
    _check_rotary("cpu", dtype)


@pytest.mark.skipif(_device() != "cuda", reason="compiled Triton needs CUDA")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_cuda_kernels(dtype):
    _check_add_ln("cuda", dtype, n=1000, hidden=1152, tol=0.0 if dtype == torch.float32 else 8e-3)
    _check_rotary("cuda", dtype, n=1000, heads=16)
    _check_add_ln_row_maps("cuda", dtype, views=3, side=48, window=14, hidden=768)


def test_fused_interpreter_subprocess():
    """The test_interp_* tests in a child process with TRITON_INTERPRET=1 (set before import)."""
    pytest.importorskip("triton")
    if rt.TRITON_INTERPRETED:
        pytest.skip("already interpreting: the test_interp_* tests run in this process")
    res = run_interp_tests(__file__, timeout=300)
    assert "6 passed" in res.stdout, res.stdout[-4000:]


def test_bad_shapes_are_clear_errors():
    x = torch.randn(4, 8)
    with pytest.raises(ValueError, match="delta must match"):
        norm.add_layer_norm(x, torch.randn(4, 9), None, torch.ones(8), torch.zeros(8), 1e-6)
    with pytest.raises(ValueError, match="weight must be a contiguous \\[8\\]"):
        norm.add_layer_norm(x, None, None, torch.ones(9), torch.zeros(8), 1e-6)
    with pytest.raises(ValueError, match="bias must be a contiguous"):
        norm.add_layer_norm(x, torch.randn(4, 8), torch.ones(16)[::2], torch.ones(8), torch.zeros(8), 1e-6)
    with pytest.raises(ValueError, match="rows_of_y must be a contiguous int32"):
        norm.add_layer_norm(x, None, None, torch.ones(8), torch.zeros(8), 1e-6, rows_of_y=torch.zeros(3))
    with pytest.raises(ValueError, match="delta_rows must be a contiguous int32 \\[4\\]"):
        norm.add_layer_norm(x, torch.randn(9, 8), None, torch.ones(8), torch.zeros(8), 1e-6,
                            delta_rows=torch.zeros(5, dtype=torch.int32))
    with pytest.raises(ValueError, match="delta_rows given without a delta"):
        norm.add_layer_norm(x, None, None, torch.ones(8), torch.zeros(8), 1e-6,
                            delta_rows=torch.zeros(4, dtype=torch.int32))
    with pytest.raises(ValueError, match="cos must be fp32"):
        rotary.rotary_qk_in_place(torch.randn(4, 2, 8), torch.randn(4, 8).double(), torch.randn(4, 8))
    with pytest.raises(ValueError, match="even head dim"):
        rotary.rotary_qk_in_place(torch.randn(4, 2, 7), torch.randn(4, 7), torch.randn(4, 7))


# ----------------------------------------------------------------------- fused encoder == eager
def test_fused_encoder_matches_eager():
    """Same weights, same batch: the fused forward (biases moved into the add+LayerNorm passes,
    position embedding as the first pass, GELU with the GEMM) equals the eager one."""
    device = _device()
    cfg = VisionConfig(hidden_size=144, intermediate_size=200, num_hidden_layers=3, num_attention_heads=2,
                       image_size=84)
    torch.manual_seed(0)
    enc = VisionEncoder(cfg).eval()
    with torch.no_grad():
        for p in enc.parameters():
            p.normal_(0, 0.05 if p.ndim == 2 else 0.3)
    enc = enc.to(device)
    mb = MetadataBuilder(head_dim=cfg.head_dim, rope_theta=cfg.rope_theta, merge=2, side=cfg.num_grid_per_side,
                         pos_table=enc.position_embedding.detach(), compute_dtype=torch.float32,
                         device=torch.device(device))
    grids = [(1, 4, 6), (1, 2, 2), (1, 6, 4)]
    meta = mb.build_host(grids)
    px = torch.randn(meta.num_tokens, 3 * 14 * 14, device=device)
    sdpa = get_backend("sdpa")
    with torch.inference_mode():
        eager = enc(px, meta, VisionExecution(sdpa, True, False))
        fused = enc(px, meta, VisionExecution(sdpa, True, True))
        fused_dense = enc(px, meta, VisionExecution(sdpa, False, True))
    assert fused.shape == eager.shape == (meta.num_tokens, cfg.hidden_size)
    assert (fused - eager).abs().max().item() < 1e-4
    assert torch.equal(fused, fused_dense), "strided and dense must stay bit-identical with fused layers"


# ----------------------------------------------------------------------- plan decision
def test_fused_layers_plan_decision():
    t = capability_table()
    p = resolve_plan(t["cuda_sm90"], PlanRequest(), device="cuda:0", head_dim=72, kernels=ALL_PRESENT)
    assert p.fused_layers.value is True and "default of row cuda_sm90" in p.fused_layers.reason
    no_triton = absent("triton not importable", "triton_varlen", "triton_rope_varlen")
    p = resolve_plan(t["cuda_sm90"], PlanRequest(), device="cuda:0", head_dim=72, kernels=no_triton)
    assert p.fused_layers.value is False and "triton not importable" in p.fused_layers.reason
    with pytest.raises(PlanError, match="fused layers need Triton: triton not importable"):
        resolve_plan(t["cuda_sm90"], PlanRequest(fused_layers="on"), device="cuda:0", head_dim=72, kernels=no_triton)
    with pytest.raises(PlanError, match="cpu"):
        resolve_plan(t["cpu"], PlanRequest(fused_layers="on"), device="cpu", head_dim=72, kernels=ALL_PRESENT)
    p = resolve_plan(t["cpu"], PlanRequest(), device="cpu", head_dim=72, kernels={"sdpa": ALL_PRESENT["sdpa"]})
    assert p.fused_layers.value is False


@interp
def test_interp_fused_strided_qkv_are_views_of_the_projection_output():
    """The fused path (Triton in-place q/k rotary, the module-called qkv Linear) hands the kernel
    views of the projection's output and copies nothing dense; the dense plan is caught."""
    from fastdeploy_ext.conformance.qkv_trace import QkvTrace, check_views_of_projection
    cfg = VisionConfig(hidden_size=144, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                       image_size=56)
    torch.manual_seed(0)
    enc = VisionEncoder(cfg).eval()
    mb = MetadataBuilder(head_dim=cfg.head_dim, rope_theta=cfg.rope_theta, merge=2, side=cfg.num_grid_per_side,
                         pos_table=enc.position_embedding.detach(), compute_dtype=torch.float32,
                         device=torch.device("cpu"))
    meta = mb.build_host([(1, 4, 6), (1, 2, 2)])
    px = torch.randn(meta.num_tokens, 3 * 14 * 14)
    sdpa = get_backend("sdpa")

    def traced(strided):
        trace = QkvTrace([layer.qkv.weight for layer in enc.layers])
        backend = VisionExecution(trace.recording(sdpa), strided, True)
        with torch.inference_mode(), trace:
            enc(px, meta, backend)
        return trace
    assert check_views_of_projection(traced(True), cfg.hidden_size, cfg.head_dim) == []
    with pytest.raises(AssertionError, match="copied dense|not a view"):
        check_views_of_projection(traced(False), cfg.hidden_size, cfg.head_dim)
