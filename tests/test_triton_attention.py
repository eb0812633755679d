"""Tests for fastdeploy_ext.ops.triton.varlen_attention (one-launch varlen attention in Triton)
and the Triton attention backends built on it (ops/attention/varlen.py).

CPU: the kernel runs under the Triton interpreter.  The interpreter only works when
TRITON_INTERPRET=1 is set before triton is first imported in the process (triton decorates its
own tl.zeros & co. at import), so setting it here would either come too late or turn other test
modules' kernels into interpreted ones.  Hence: the ``test_interp_*`` tests run in-process only
when the process was started with TRITON_INTERPRET=1; otherwise ``test_interpreter_subprocess``
re-runs them in a child ``python -m pytest`` with the variable set (isolated from this process).

The interpreter computes tl.dot with numpy matmul: fp32 dots are exact fp32 ("ieee"), fp16 dots
take fp16 operands with fp32 accumulation, and bf16 dots are NOT supported by it (it multiplies
the raw uint16 bit patterns), so bf16 is only tested on CUDA.

CUDA (when present, compiled mode): ``test_cuda_*`` check bf16/fp16 at realistic sizes.
"""

from __future__ import annotations


import pytest
import torch

pytest.importorskip("triton")

from fastdeploy_ext.ops.attention.varlen import get_backend
from fastdeploy_ext.ops.rotary import rotary_qk_in_place_torch
from fastdeploy_ext.ops.triton import runtime as rt
from fastdeploy_ext.ops.triton import varlen_attention as ta
from .triton_interpreter import run_interp_tests

SEQ_LENS = [5, 17, 64, 3]
H = 2

interp = pytest.mark.skipif(
    not rt.TRITON_INTERPRETED,
    reason="interpreter test: runs in test_interpreter_subprocess (needs TRITON_INTERPRET=1 before import)",
)


@pytest.fixture
def compiled():
    if rt.TRITON_INTERPRETED or not torch.cuda.is_available():
        pytest.skip("needs a CUDA device and triton in compiled mode")
    yield


def _packed_qkv(n, h, d, dtype, device="cpu", seed=0):
    g = torch.Generator(device="cpu").manual_seed(seed)
    qkv = torch.randn(n, 3 * h * d, generator=g, dtype=torch.float32).to(device=device, dtype=dtype)
    q, k, v = qkv.view(n, 3, h, d).unbind(1)
    return qkv, q, k, v


def _reference(q, k, v, seq_lens, scale):
    """float64 per-sequence softmax(q k^T * scale) v, [N, H, D]."""
    outs, s = [], 0
    for n in seq_lens:
        qq, kk, vv = (t[s:s + n].double().transpose(0, 1) for t in (q, k, v))
        att = torch.softmax(qq @ kk.transpose(1, 2) * scale, dim=-1)
        outs.append((att @ vv).transpose(0, 1))
        s += n
    return torch.cat(outs)


def _rotate_half(x):
    h = x.shape[-1] // 2
    return torch.cat([-x[..., h:], x[..., :h]], dim=-1)


def _rotary_tables(n, d, seed=1, device="cpu"):
    g = torch.Generator(device="cpu").manual_seed(seed)
    ang = torch.rand(n, d // 2, generator=g, dtype=torch.float64) * 20.0
    ang = torch.cat([ang, ang], dim=-1)
    return ang.cos().float().to(device), ang.sin().float().to(device)


def _apply_rotary(x, cos, sin):
    xf = x.float()
    return (xf * cos[:, None, :] + _rotate_half(xf) * sin[:, None, :]).to(x.dtype)


# ------------------------------------------------------------------------------------ host side


def test_block_table_layout():
    bt = ta.build_block_table(SEQ_LENS, block_m=16, sort=False)
    assert bt.dtype == torch.int32 and bt.device.type == "cpu" and bt.shape == (8, 3)
    expect = [(0, 5, 0), (5, 17, 0), (5, 17, 16), (22, 64, 0), (22, 64, 16), (22, 64, 32), (22, 64, 48),
              (86, 3, 0)]
    assert [tuple(r) for r in bt.tolist()] == expect
    # default: longest sequences first, block order kept within a sequence
    bts = ta.build_block_table(SEQ_LENS, block_m=16)
    assert [tuple(r) for r in bts.tolist()] == expect[3:7] + expect[1:3] + [expect[0], expect[7]]
    # zero-length sequences get no block but still advance nothing
    assert ta.build_block_table([0, 3, 0, 2], block_m=16, sort=False).tolist() == [[0, 3, 0], [3, 2, 0]]
    assert ta.build_block_table([], block_m=16).shape == (0, 3)
    assert ta.build_block_table([300]).shape == (-(-300 // ta.BLOCK_M), 3)
    with pytest.raises(ValueError):
        ta.build_block_table([4], block_m=48)
    with pytest.raises(ValueError):
        ta.build_block_table([-1])


def test_head_dim_chunks():
    assert ta.head_dim_chunks(72) == (64, 16)
    assert ta.head_dim_chunks(64) == (64, 0)
    assert ta.head_dim_chunks(80) == (64, 16)
    assert ta.head_dim_chunks(96) == (64, 32)
    assert ta.head_dim_chunks(8) == (16, 0)
    assert ta.head_dim_chunks(256) == (256, 0)
    assert ta.head_dim_chunks(200) == (128, 128)


def test_triton_available_reports_reason():
    ok, why = rt.triton_available()
    assert isinstance(why, str) and why
    if rt.TRITON_INTERPRETED:
        assert ok and "interpret" in why
    else:
        assert ok == torch.cuda.is_available()


def test_interpreter_subprocess():
    """Run the test_interp_* tests in a child process started with TRITON_INTERPRET=1."""
    if rt.TRITON_INTERPRETED:
        pytest.skip("already in interpreter mode: the test_interp_* tests run in this process")
    run_interp_tests(__file__, timeout=600)


# ----------------------------------------------------------------------- interpreter (CPU) runs


@interp
@pytest.mark.parametrize("head_dim", [72, 64])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_interp_matches_reference_and_dense_bitwise(head_dim, dtype):
    n = sum(SEQ_LENS)
    _, q, k, v = _packed_qkv(n, H, head_dim, dtype)
    assert q.stride() == (3 * H * head_dim, head_dim, 1)
    scale = head_dim ** -0.5
    bt = ta.build_block_table(SEQ_LENS, block_m=16)
    out = torch.full((n, H, head_dim), float("nan"), dtype=dtype)
    # block_m=16 / block_n=16: several query blocks and full + tail key blocks per sequence
    res = ta.varlen_attention(q, k, v, bt, max(SEQ_LENS), scale, out=out, block_m=16, block_n=16)
    assert res is out and res.is_contiguous() and res.shape == (n, H, head_dim)
    assert not torch.isnan(res).any(), "some output elements were not written"
    ref = _reference(q, k, v, SEQ_LENS, scale)
    rel = ((res.double() - ref).abs().max() / ref.abs().max()).item()
    # fp32: exact fp32 dots in the interpreter; fp16: p and output rounded to fp16
    assert rel <= (1e-5 if dtype == torch.float32 else 3e-3), rel

    # dense contiguous inputs, same values -> bit-identical output (same code path, strides only)
    dense = ta.varlen_attention(q.contiguous(), k.contiguous(), v.contiguous(), bt, max(SEQ_LENS), scale,
                                block_m=16, block_n=16)
    assert torch.equal(dense, res)


@interp
def test_interp_default_config_and_unsorted_table():
    """Module defaults (BLOCK_M, default BLOCK_N) and a table in plain sequence order."""
    lens = [40, 129, 7]
    n, d = sum(lens), 72
    _, q, k, v = _packed_qkv(n, H, d, torch.float32, seed=3)
    out = torch.full((n, H, d), float("nan"))
    res = ta.varlen_attention(q, k, v, ta.build_block_table(lens, sort=False), max(lens), 0.1, out=out)
    assert not torch.isnan(res).any()
    ref = _reference(q, k, v, lens, 0.1)
    assert ((res.double() - ref).abs().max() / ref.abs().max()).item() <= 1e-5


@interp
def test_interp_unaligned_strides_and_odd_head_dims():
    """Odd row strides / offsets go through an aligned copy; head dims with padded chunks."""
    for head_dim in (72, 40, 68, 8):
        n = sum(SEQ_LENS)
        g = torch.Generator().manual_seed(head_dim)
        buf = torch.randn(n, 3 * H * head_dim + 1, generator=g)  # odd row stride
        q, k, v = buf[:, 1:].view(n, 3, H, head_dim).unbind(1)  # odd offset too
        bt = ta.build_block_table(SEQ_LENS, block_m=16)
        out = torch.full((n, H, head_dim), float("nan"))
        res = ta.varlen_attention(q, k, v, bt, max(SEQ_LENS), 0.3, out=out, block_m=16, block_n=16)
        assert res is out and not torch.isnan(res).any()
        ref = _reference(q, k, v, SEQ_LENS, 0.3)
        assert ((res.double() - ref).abs().max() / ref.abs().max()).item() <= 1e-5, head_dim


class _Meta:
    def __init__(self, seq_lens, backend, device="cpu"):     # CPU: the interpreter
        self.seq_lens, self.max_seqlen = seq_lens, max(seq_lens)
        self.attention_state = backend.prepare(seq_lens, lambda t: t.to(device))


@interp
@pytest.mark.parametrize(("head_dim", "dtype"), [(72, torch.float32), (64, torch.float16), (72, torch.float16)])
def test_interp_rope_backend_rotates_in_place_then_runs_the_kernel(head_dim, dtype):
    """triton_rope_varlen = q and k rotated in place in the packed buffer (v untouched) by the
    one-launch Triton pass, then the plain kernel: equal to the kernel on ATen-rotated copies
    (the interpreter does not contract to FMA, so bitwise here); triton_varlen leaves q/k alone."""
    n = sum(SEQ_LENS)
    qkv, q, k, v = _packed_qkv(n, H, head_dim, dtype, seed=2)
    cos, sin = _rotary_tables(n, head_dim)
    scale = head_dim ** -0.5
    qr, kr = q.clone(), k.clone()
    rotary_qk_in_place_torch(qr, cos, sin), rotary_qk_in_place_torch(kr, cos, sin)
    v_before = v.clone()
    rope = get_backend("triton_rope_varlen")
    assert rope.applies_rotary and rope.reads_strides and rope.graph_safe
    out = rope(q, k, v, _Meta(SEQ_LENS, rope), scale, cos=cos, sin=sin)
    assert torch.equal(q, qr) and torch.equal(k, kr) and torch.equal(v, v_before)
    bt = ta.build_block_table(SEQ_LENS)
    assert torch.equal(out, ta.varlen_attention(qr.contiguous(), kr.contiguous(), v.contiguous(), bt,
                                                max(SEQ_LENS), scale))
    ref = _reference(qr, kr, v, SEQ_LENS, scale)
    assert ((out.double() - ref).abs().max() / ref.abs().max()).item() <= (1e-5 if dtype == torch.float32 else 3e-3)
    plain = get_backend("triton_varlen")
    assert not plain.applies_rotary
    q_before = q.clone()
    assert torch.equal(plain(q, k, v, _Meta(SEQ_LENS, plain), scale), out)   # q, k already rotated
    assert torch.equal(q, q_before)


def test_bad_inputs_raise():
    n, d = sum(SEQ_LENS), 72
    _, q, k, v = _packed_qkv(n, H, d, torch.float32)
    bt = ta.build_block_table(SEQ_LENS)
    ms = max(SEQ_LENS)
    call = ta.varlen_attention
    with pytest.raises(ValueError, match="3-D"):
        call(q.reshape(n, H * d), k, v, bt, ms, 0.1)
    with pytest.raises(ValueError, match="shape"):
        call(q, k[:, :1], v, bt, ms, 0.1)  # mismatched heads
    with pytest.raises(ValueError, match=r"stride\(-1\)"):
        call(q.transpose(1, 2).contiguous().transpose(1, 2), k, v, bt, ms, 0.1)
    with pytest.raises(ValueError, match=r"stride\(-1\)"):
        call(q, k, v.transpose(1, 2).contiguous().transpose(1, 2), bt, ms, 0.1)
    with pytest.raises(ValueError, match="block_table"):
        call(q, k, v, bt.to("meta"), ms, 0.1)  # block table on another device than q
    with pytest.raises(ValueError, match="block_table"):
        call(q, k, v, bt.long(), ms, 0.1)
    with pytest.raises(ValueError, match="dtype"):
        call(q, k.half(), v, bt, ms, 0.1)
    with pytest.raises(ValueError, match="not supported"):
        call(q.double(), k.double(), v.double(), bt, ms, 0.1)
    with pytest.raises(ValueError, match="scale"):
        call(q, k, v, bt, ms, 0.0)
    with pytest.raises(ValueError, match="num_stages"):
        call(q, k, v, bt, ms, 0.1, num_stages=1)
    with pytest.raises(ValueError, match="block_n"):
        call(q, k, v, bt, ms, 0.1, block_n=48)
    with pytest.raises(ValueError, match="out"):
        call(q, k, v, bt, ms, 0.1, out=torch.empty(n, d, H).transpose(1, 2))


def test_empty_table_is_noop():
    _, q, k, v = _packed_qkv(4, H, 72, torch.float32)
    out = torch.full((4, H, 72), 7.0)
    res = ta.varlen_attention(q, k, v, ta.build_block_table([]), 0, 0.1, out=out)
    assert res is out and bool((res == 7.0).all())


# -------------------------------------------------------------------------- compiled (CUDA) runs


@pytest.mark.parametrize("head_dim", [72, 64])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_cuda_matches_reference(compiled, head_dim, dtype):
    lens = [320, 720, 1, 600, 1024, 129, 5, 77]
    n, h = sum(lens), 16
    _, q, k, v = _packed_qkv(n, h, head_dim, dtype, device="cuda")
    scale = head_dim ** -0.5
    bt = ta.build_block_table(lens).cuda()
    out = torch.full((n, h, head_dim), float("nan"), dtype=dtype, device="cuda")
    res = ta.varlen_attention(q, k, v, bt, max(lens), scale, out=out)
    assert not torch.isnan(res).any()
    ref = _reference(q.cpu(), k.cpu(), v.cpu(), lens, scale)
    err = ((res.cpu().double() - ref).norm() / ref.norm()).item()
    # bf16: p and the output are rounded to bf16 (~2e-3 measured on H200); fp32: exact dots
    assert err < {torch.bfloat16: 5e-3, torch.float16: 1e-3, torch.float32: 1e-5}[dtype], err
    dense = ta.varlen_attention(q.contiguous(), k.contiguous(), v.contiguous(), bt, max(lens), scale)
    assert torch.equal(dense, res)
    # odd strides -> aligned-copy fallback, same values -> same result
    buf = torch.empty(n, 3 * h * head_dim + 1, dtype=dtype, device="cuda")
    qo, ko, vo = buf[:, :3 * h * head_dim].view(n, 3, h, head_dim).unbind(1)
    qo.copy_(q), ko.copy_(k), vo.copy_(v)
    assert torch.equal(ta.varlen_attention(qo, ko, vo, bt, max(lens), scale), res)
    cos, sin = _rotary_tables(n, head_dim, device="cuda")
    qr, kr = _apply_rotary(q, cos, sin), _apply_rotary(k, cos, sin)
    unfused = ta.varlen_attention(qr, kr, v, bt, max(lens), scale)
    ref_r = _reference(qr.cpu(), kr.cpu(), v.cpu(), lens, scale)
    if dtype != torch.float32:     # the backends' dtypes in every row
        # the default CUDA backend: q and k rotated in place in the packed buffer, then the kernel
        scratch = _packed_qkv(n, h, head_dim, dtype, device="cuda")[0]
        qs, ks, vs = scratch.view(n, 3, h, head_dim).unbind(1)
        rope = get_backend("triton_rope_varlen")
        fused = rope(qs, ks, vs, _Meta(lens, rope, "cuda"), scale, cos=cos, sin=sin)
        # FMA contraction may move a rotated element by 1 ulp of the input dtype
        assert ((fused.float() - unfused.float()).abs().max()).item() < 2e-2
        err_r = ((fused.cpu().double() - ref_r).norm() / ref_r.norm()).item()
        assert err_r < {torch.bfloat16: 5e-3, torch.float16: 1e-3}[dtype], err_r


@pytest.mark.parametrize("block_m,block_n,num_warps,num_stages",
                         [(64, 64, 4, 3), (128, 32, 4, 2), (128, 128, 8, 2), (64, 32, 4, 4)])
def test_cuda_other_configs(compiled, block_m, block_n, num_warps, num_stages):
    lens = [600, 1, 129, 300, 5]
    n, h, d = sum(lens), 4, 72
    _, q, k, v = _packed_qkv(n, h, d, torch.bfloat16, device="cuda", seed=5)
    bt = ta.build_block_table(lens, block_m=block_m).cuda()
    res = ta.varlen_attention(q, k, v, bt, max(lens), d ** -0.5, block_m=block_m, block_n=block_n,
                              num_warps=num_warps, num_stages=num_stages)
    ref = _reference(q.cpu(), k.cpu(), v.cpu(), lens, d ** -0.5)
    assert ((res.cpu().double() - ref).norm() / ref.norm()).item() < 5e-3


@interp
def test_interp_padding_rows_of_a_graph_table_are_no_ops():
    """A fixed-size table (as a captured graph uses) padded with (0, 1, BLOCK_M) rows: those
    programs store nothing, the output equals the unpadded table's."""
    n = sum(SEQ_LENS)
    _, q, k, v = _packed_qkv(n, H, 72, torch.float32, seed=9)
    bt = ta.build_block_table(SEQ_LENS, block_m=16)
    padded = torch.cat([bt, ta.noop_block_table(7, "cpu", block_m=16)])
    a = ta.varlen_attention(q, k, v, bt, max(SEQ_LENS), 0.1, block_m=16, block_n=16)
    b = ta.varlen_attention(q, k, v, padded, max(SEQ_LENS), 0.1, block_m=16, block_n=16)
    assert torch.equal(a, b)
