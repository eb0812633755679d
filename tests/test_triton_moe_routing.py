"""The one-launch router (ops/triton/moe_routing.py, triton_moe's ``route``: the fp32 GEMM fused
at decode sizes, the softmax top-k tail alone past them) against ATen's
``F.linear(x.float(), gate).softmax(-1).topk(k)`` (aten_moe's).

CPU: the kernel runs in the Triton interpreter (``test_interp_*`` in a child process started
with TRITON_INTERPRET=1, as tests/test_triton_moe.py). CUDA (cuda/unit leg): the released
router shape (64 experts, top 6) at decode and prefill sizes, with libdevice's exp, and a CUDA
graph replay under the sync guard.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from fastdeploy_ext.ops.moe import BUILTIN_MOE_BACKENDS, aten_route
from fastdeploy_ext.ops.triton import runtime as rt
from .triton_interpreter import run_interp_tests

interp = pytest.mark.skipif(not rt.TRITON_INTERPRETED,
                            reason="interpreter test: runs in test_interpreter_subprocess")
cuda = pytest.mark.skipif(not torch.cuda.is_available() or rt.triton is None or bool(rt.TRITON_INTERPRETED),
                          reason="needs a CUDA device and compiled triton")


def _logits(t: int, e: int, seed: int = 0, device="cpu") -> torch.Tensor:
    """Router-like logits: a spread of a few units, so the top k are separated by far more than an
    ulp (no ties: the ids must then match exactly)."""
    return (torch.randn(t, e, generator=torch.Generator().manual_seed(seed)) * 3).to(device)


def _check_against_aten(logits: torch.Tensor, k: int, scale: float, exp_ulps: float) -> None:
    """The tail alone on given logits: ids exactly ATen's, weights within a few ulps."""
    from fastdeploy_ext.ops.triton.moe_routing import softmax_topk
    w, ids = softmax_topk(logits, k, scale)
    ref_w, ref_ids = logits.softmax(-1).topk(k, -1)
    assert ids.dtype == ref_ids.dtype == torch.int64 and w.dtype == torch.float32
    assert torch.equal(ids, ref_ids)
    # the softmax's exp and sum order differ from ATen's: a few ulps of fp32 at most
    torch.testing.assert_close(w, ref_w * scale, rtol=exp_ulps * 2 ** -23, atol=1e-30)
    assert (w[:, :-1] >= w[:, 1:]).all()                 # descending, as topk's


def _router_case(t: int, h: int, e: int, seed: int, device="cpu", x_dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, h, generator=g).to(device, x_dtype)
    gate = (torch.randn(e, h, generator=g) * h ** -0.5 * 3).to(device)      # fp32, as the loader keeps it
    return x, gate


def _check_router_against_aten(x: torch.Tensor, gate: torch.Tensor, k: int, scale: float) -> None:
    """The whole router: the exp differs from ATen's by a few ulps; ids must equal ATen's on
    every row whose top k + 1 probabilities are apart by more than that (nearly all: asserted, so
    a kernel that picks wrong cannot pass on a vacuous set)."""
    from fastdeploy_ext.ops.triton.moe_routing import router_topk
    w, ids = router_topk(x, gate, k, scale)
    ref_w, ref_ids = aten_route(x, gate, k, scale)
    assert ids.dtype == torch.int64 and w.dtype == torch.float32 and ids.shape == ref_ids.shape
    top = F.linear(x.float(), gate.float()).softmax(-1).topk(k + 1, -1).values
    clear = ((top[:, :-1] - top[:, 1:]) > 1e-5 * top[:, :1]).all(1)
    assert clear.float().mean() > 0.9, "the case has too many near-ties to test the ids"
    assert torch.equal(ids[clear], ref_ids[clear])
    torch.testing.assert_close(w[clear], ref_w[clear], rtol=1e-5, atol=1e-7)
    assert (w[:, :-1] >= w[:, 1:]).all()


def test_the_triton_backend_routes_with_the_kernel_and_aten_with_torch_ops():
    by_name = {b.name: b for b in BUILTIN_MOE_BACKENDS}
    assert by_name["aten_moe"].route is aten_route
    assert by_name["triton_moe"].route is not aten_route
    assert "top-k in one launch" in by_name["triton_moe"].what


def test_aten_route_skips_the_multiply_for_a_unit_scale_and_applies_any_other():
    x, gate = _router_case(5, 32, 64, seed=0)
    w1, i1 = aten_route(x, gate, 6, 1.0)
    w2, i2 = aten_route(x, gate, 6, 2.5)
    ref_w, ref_i = (x @ gate.t()).softmax(-1).topk(6, -1)
    assert torch.equal(w1, ref_w) and torch.equal(i1, ref_i) and torch.equal(i2, ref_i)
    assert torch.equal(w2, ref_w * 2.5)


@interp
@pytest.mark.parametrize("t,e,k", [(1, 64, 6), (37, 64, 6), (16, 8, 2), (5, 20, 20)])
def test_interp_softmax_topk_equals_aten(t, e, k):
    """Decode (1 token), a partial block of tokens (37 = 2 x 16 + 5), a tiny router, and every
    expert chosen (k = E, E not a power of two: padded columns must never be picked)."""
    _check_against_aten(_logits(t, e, seed=t), k, 1.0, exp_ulps=8)


@interp
def test_interp_softmax_topk_applies_the_scale_and_rejects_bad_input():
    from fastdeploy_ext.ops.triton.moe_routing import router_topk, softmax_topk
    _check_against_aten(_logits(9, 64, seed=3), 6, 2.5, exp_ulps=8)
    with pytest.raises(ValueError, match="k=65"):
        softmax_topk(_logits(2, 64), 65)
    with pytest.raises(ValueError, match="fp32"):
        softmax_topk(_logits(2, 64).half(), 6)
    with pytest.raises(ValueError, match="share H"):
        router_topk(torch.zeros(2, 32), torch.zeros(64, 16), 6)
    w, ids = softmax_topk(_logits(0, 64), 6)
    assert w.shape == ids.shape == (0, 6)
    w, ids = router_topk(torch.zeros(0, 32), torch.zeros(64, 32), 6)
    assert w.shape == ids.shape == (0, 6)


@interp
@pytest.mark.parametrize("t,h,e,k,dtype", [(1, 80, 64, 6, torch.float32), (7, 48, 20, 3, torch.bfloat16)])
def test_interp_router_topk_equals_aten(t, h, e, k, dtype):
    """Decode (1 token), and a partial block of bf16 tokens over a router of E not a power of two."""
    x, gate = _router_case(t, h, e, seed=t, x_dtype=dtype)
    _check_router_against_aten(x, gate, k, 1.0 if t == 1 else 2.5)


def test_interpreter_subprocess():
    if rt.TRITON_INTERPRETED:
        pytest.skip("this process is the interpreter run")
    out = run_interp_tests(__file__, timeout=600).stdout
    assert "7 passed" in out.splitlines()[-1], out[-2000:]


@cuda
@pytest.mark.parametrize("t", [1, 64, 256, 4096])
def test_cuda_softmax_topk_equals_aten_at_the_released_router_shape(t):
    _check_against_aten(_logits(t, 64, seed=t, device="cuda"), 6, 1.0, exp_ulps=4)


@cuda
@pytest.mark.parametrize("t", [1, 64, 512, 4096])
def test_cuda_router_topk_at_the_released_shape(t):
    """bf16 tokens, H 1280, 64 experts, top 6."""
    x, gate = _router_case(t, 1280, 64, seed=t, device="cuda", x_dtype=torch.bfloat16)
    _check_router_against_aten(x, gate, 6, 1.0)


@cuda
def test_cuda_softmax_topk_makes_no_host_sync_and_replays_in_a_graph():
    """Under torch's sync debug mode (error on a sync), then captured in a CUDA graph and
    replayed on new tokens: equal to an eager call on them bitwise."""
    from fastdeploy_ext.ops.triton.moe_routing import router_topk
    static, gate = _router_case(64, 1280, 64, seed=1, device="cuda", x_dtype=torch.bfloat16)
    router_topk(static, gate, 6)         # compile outside the checks
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        router_topk(static, gate, 6)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        w, ids = router_topk(static, gate, 6)
    static.copy_(_router_case(64, 1280, 64, seed=2, device="cuda", x_dtype=torch.bfloat16)[0])
    graph.replay()
    ref_w, ref_ids = router_topk(static.clone(), gate, 6)
    assert torch.equal(ids, ref_ids) and torch.equal(w, ref_w)
