"""The one-launch softmax top-k router tail (ops/triton/moe_routing.py, triton_moe's ``route``)
against ATen's ``softmax(-1).topk(k)`` (aten_moe's).

CPU: the kernel runs in the Triton interpreter (``test_interp_*`` in a child process started
with TRITON_INTERPRET=1, as tests/test_triton_moe.py). CUDA (cuda/unit leg): the released
router shape (64 experts, top 6) at decode and prefill sizes, with libdevice's exp, and a CUDA
graph replay under the sync guard.
"""
from __future__ import annotations

import pytest
import torch

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
    from fastdeploy_ext.ops.triton.moe_routing import softmax_topk
    w, ids = softmax_topk(logits, k, scale)
    ref_w, ref_ids = aten_route(logits, k, scale)
    assert ids.dtype == ref_ids.dtype == torch.int64 and w.dtype == torch.float32
    assert torch.equal(ids, ref_ids)
    # the softmax's exp and sum order differ from ATen's: a few ulps of fp32 at most
    torch.testing.assert_close(w, ref_w, rtol=exp_ulps * 2 ** -23, atol=1e-30)
    assert (w[:, :-1] >= w[:, 1:]).all()                 # descending, as topk's


def test_the_triton_backend_routes_with_the_kernel_and_aten_with_torch_ops():
    by_name = {b.name: b for b in BUILTIN_MOE_BACKENDS}
    assert by_name["aten_moe"].route is aten_route
    assert by_name["triton_moe"].route is not aten_route
    assert "top-k in one launch" in by_name["triton_moe"].what


def test_aten_route_skips_the_multiply_for_a_unit_scale_and_applies_any_other():
    logits = _logits(5, 64)
    w1, i1 = aten_route(logits, 6, 1.0)
    w2, i2 = aten_route(logits, 6, 2.5)
    ref_w, ref_i = logits.softmax(-1).topk(6, -1)
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
    from fastdeploy_ext.ops.triton.moe_routing import softmax_topk
    _check_against_aten(_logits(9, 64, seed=3), 6, 2.5, exp_ulps=8)
    with pytest.raises(ValueError, match="k=65"):
        softmax_topk(_logits(2, 64), 65)
    with pytest.raises(ValueError, match="fp32"):
        softmax_topk(_logits(2, 64).half(), 6)
    w, ids = softmax_topk(_logits(0, 64), 6)
    assert w.shape == ids.shape == (0, 6)


def test_interpreter_subprocess():
    if rt.TRITON_INTERPRETED:
        pytest.skip("this process is the interpreter run")
    out = run_interp_tests(__file__, timeout=600).stdout
    assert "5 passed" in out.splitlines()[-1], out[-2000:]


@cuda
@pytest.mark.parametrize("t", [1, 64, 256, 4096])
def test_cuda_softmax_topk_equals_aten_at_the_released_router_shape(t):
    _check_against_aten(_logits(t, 64, seed=t, device="cuda"), 6, 1.0, exp_ulps=4)


@cuda
def test_cuda_softmax_topk_makes_no_host_sync_and_replays_in_a_graph():
    """Under torch's sync debug mode (error on a sync), then captured in a CUDA graph and
    replayed on new logits: equal to an eager call on them bitwise."""
    from fastdeploy_ext.ops.triton.moe_routing import softmax_topk
    static = _logits(64, 64, seed=1, device="cuda")
    softmax_topk(static, 6)                               # compile outside the checks
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        softmax_topk(static, 6)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        w, ids = softmax_topk(static, 6)
    static.copy_(_logits(64, 64, seed=2, device="cuda"))
    graph.replay()
    ref_w, ref_ids = softmax_topk(static.clone(), 6)
    assert torch.equal(ids, ref_ids) and torch.equal(w, ref_w)
