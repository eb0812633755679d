"""The Triton GEMM with the erf GELU epilogue (ops/triton/gemm_gelu.py) against ATen's
addmm + GELU, and SAM's fused blocks using it.

CPU: the kernel runs in the Triton interpreter, which needs TRITON_INTERPRET=1 before triton is
first imported, so the ``test_interp_*`` tests run in a child process started with it
(``test_interpreter_subprocess``), on tiny shapes in fp32 (exact dots there). CUDA
(``test_cuda_*``, the cuda/unit leg): bf16 at SAM's width, against ATen within a unit of bf16's
last place.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from fastdeploy_ext.ops.triton import gemm_gelu as gg
from fastdeploy_ext.ops.triton import runtime as rt
from .triton_interpreter import run_interp_tests

interp = pytest.mark.skipif(not rt.TRITON_INTERPRETED,
                            reason="interpreter test: runs in test_interpreter_subprocess")
cuda = pytest.mark.skipif(not torch.cuda.is_available() or rt.triton is None or bool(rt.TRITON_INTERPRETED),
                          reason="needs a CUDA device and compiled triton")


def _operands(m: int, n: int, k: int, dtype=torch.float32, device="cpu", seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g).to(device, dtype)
    w = (torch.randn(n, k, generator=g) * k ** -0.5).to(device, dtype)
    b = torch.randn(n, generator=g).to(device, dtype)
    return x, w, b


def _reference(x, w, b, approximate: str = "none"):
    y = x.double() @ w.double().t()
    if b is not None:
        y = y + b.double()
    return F.gelu(y, approximate=approximate)


def test_interpreter_subprocess():
    if rt.TRITON_INTERPRETED:
        pytest.skip("already in interpreter mode: the test_interp_* tests run in this process")
    if rt.triton is None:
        pytest.skip("triton not importable")
    run_interp_tests(__file__, timeout=600)


def test_tiles_follow_the_batch():
    assert gg.pick_tiles(286720, 3072, 768) == gg.GemmTiles(128, 256, 64, 8, 8, 3)
    assert gg.pick_tiles(2048, 3072, 768).block_n == 128
    assert gg.pick_tiles(16, 3072, 768).block_m == 64


@interp
@pytest.mark.parametrize("m,n,k,bias", [
    (37, 24, 32, True),       # rows and columns past the tiles (wrapped loads, masked store)
    (16, 16, 40, True),       # K not a multiple of the K tile: the masked reduction
    (70, 33, 16, False),      # no bias
])
def test_interp_matches_erf_gelu(m, n, k, bias):
    x, w, b = _operands(m, n, k, seed=m)
    b = b if bias else None
    got = gg.linear_gelu_erf(x, w, b, tiles=gg.GemmTiles(16, 16, 16, group_m=2))
    want = _reference(x, w, b)
    torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)
    # the erf GELU, not the tanh one: they differ by up to ~5e-4 near |x| = 2
    tanh = _reference(x, w, b, "tanh")
    assert (got.double() - tanh).abs().max() > 1e-5


@interp
def test_interp_writes_into_out_and_takes_empty_batches():
    x, w, b = _operands(20, 16, 16)
    out = torch.full((20, 16), float("nan"))
    got = gg.linear_gelu_erf(x, w, b, tiles=gg.GemmTiles(16, 16, 16), out=out)
    assert got.data_ptr() == out.data_ptr() and not torch.isnan(out).any()
    empty = gg.linear_gelu_erf(x[:0], w, b)
    assert empty.shape == (0, 16)


def test_bad_operands_are_refused_clearly():
    x, w, b = _operands(4, 8, 16)
    if not rt.TRITON_INTERPRETED and not torch.cuda.is_available():
        with pytest.raises(RuntimeError, match="needs triton"):
            gg.linear_gelu_erf(x, w, b)
        return
    dev = "cpu" if rt.TRITON_INTERPRETED else "cuda"
    x, w, b = x.to(dev), w.to(dev), b.to(dev)
    with pytest.raises(ValueError, match="do not multiply"):
        gg.linear_gelu_erf(x, w[:, :8], b)
    with pytest.raises(ValueError, match="contiguous rows"):
        gg.linear_gelu_erf(x.t().contiguous().t(), w, b)


@cuda
@pytest.mark.parametrize("m", [1, 300, 9216])
def test_cuda_bf16_matches_aten_within_an_ulp(m):
    x, w, b = _operands(m, 3072, 768, torch.bfloat16, "cuda", seed=m)
    got = gg.linear_gelu_erf(x, w, b)
    aten = F.gelu(F.linear(x, w, b))
    exact = _reference(x, w, b).to(torch.bfloat16)
    # ours rounds once (after the GELU), ATen twice: ours is no farther from the exact value
    err_ours = (got.double() - _reference(x, w, b)).abs().max().item()
    err_aten = (aten.double() - _reference(x, w, b)).abs().max().item()
    assert err_ours <= err_aten * 1.01 + 1e-6
    torch.testing.assert_close(got, exact, atol=0.02, rtol=0.016)


@cuda
def test_cuda_replay_equals_eager_bitwise():
    x, w, b = _operands(4096, 3072, 768, torch.bfloat16, "cuda")
    eager = gg.linear_gelu_erf(x, w, b)
    out = torch.empty_like(eager)
    gg.linear_gelu_erf(x, w, b, out=out)            # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        gg.linear_gelu_erf(x, w, b, out=out)
    out.zero_()
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, eager)


@cuda
@pytest.mark.parametrize("kernel_on", [True, False])
def test_cuda_sam_fused_blocks_run_fc1_through_the_kernel(monkeypatch, kernel_on):
    """With the epilogue kernel chosen, SAM's fused blocks on CUDA take it once per block (not
    ATen's GELU); unchosen (the default: cuBLAS measured faster), never. The tower's output stays
    ATen's within bf16 noise either way."""
    import dataclasses

    from fastdeploy_ext.ops import activation
    from fastdeploy_ext.models.deepseek_ocr2 import vision as V
    monkeypatch.setattr(activation, "ERF_EPILOGUE_KERNEL", kernel_on)
    from .test_deepseek_attention_kernels import SAM, TRITON_EXECUTION, randomized
    sam = randomized(V.Sam(SAM), seed=6).to("cuda", torch.bfloat16)
    views, side = 2, 12
    patches = torch.randn(views * side * side, 3 * 16 * 16, generator=torch.Generator().manual_seed(7))
    patches = patches.to("cuda", torch.bfloat16)
    calls = []
    real = gg.linear_gelu_erf
    monkeypatch.setattr(gg, "linear_gelu_erf", lambda *a, **k: calls.append(a[0].shape) or real(*a, **k))
    with torch.no_grad():
        want = sam(patches, views, V.VisionExecution()).float()
        got = sam(patches, views, dataclasses.replace(TRITON_EXECUTION, fused_layers=True)).float()
    assert len(calls) == (len(sam.blocks) if kernel_on else 0)
    assert all(s[0] == views * side * side for s in calls)
    assert F.cosine_similarity(got.flatten(), want.flatten(), dim=0).item() >= 0.999
