"""The optional FlashAttention-3 backend (ops/attention/fa3.py, the fa3_varlen object in
ops/attention/varlen.py).

CPU tests: the selection logic (plan, per-batch dispatch, capture rule) and the wheel's import
quirk, with a FAKE `fa3_fwd_interface` (a stand-in written to a temp dir that computes
attention with SDPA) where the real wheel cannot exist (no CUDA here). The real kernel is tested
by the CUDA tests at the end, which run on the H200 (ci/gpu_leg.sh fa3).
"""
from __future__ import annotations

import sys
import textwrap

import pytest
import torch
import torch.nn.functional as F

from fastdeploy_ext import envs
from fastdeploy_ext.ops.attention import fa3
from fastdeploy_ext.ops.rotary import rotary_in_place, rotary_out_of_place
from fastdeploy_ext.capabilities import capability_table as load_table
from fastdeploy_ext.plan import PlanRequest, resolve_plan

from .plan_facts import WITH_FA3, absent

FAKE_CONFIG = "CONFIG = {'build_flags': {'FLASHATTENTION_DISABLE_FP16': True}}\n"
# Mirrors the real wheel's quirk: the interface imports `flash_attn_config`, which is not shipped.
FAKE_INTERFACE = textwrap.dedent('''
    """FAKE fa3_fwd_interface for CPU tests: SDPA per segment, same call signature as FA3's."""
    import torch, torch.nn.functional as F
    from flash_attn_config import CONFIG  # noqa: F401  (the real wheel does this lazily)
    CALLS = []
    def flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, max_k, softmax_scale=None, **kw):
        CALLS.append((tuple(q.shape), q.stride(), int(max_q)))
        out = torch.empty_like(q)
        b = cu_q.tolist()
        for s, e in zip(b[:-1], b[1:]):
            o = F.scaled_dot_product_attention(q[s:e].transpose(0, 1)[None], k[s:e].transpose(0, 1)[None],
                                               v[s:e].transpose(0, 1)[None], scale=softmax_scale)
            out[s:e] = o[0].transpose(0, 1)
        return out, None
''')


@pytest.fixture
def fake_fa3(tmp_path, monkeypatch):
    """Put the FAKE wheel modules on sys.path; forget any earlier import attempt."""
    (tmp_path / "fa3_fwd_config.py").write_text(FAKE_CONFIG)
    (tmp_path / "fa3_fwd_interface.py").write_text(FAKE_INTERFACE)
    monkeypatch.syspath_prepend(str(tmp_path))
    for name in (fa3.INTERFACE_MODULE, fa3.CONFIG_MODULE, fa3.CONFIG_ALIAS):
        monkeypatch.delitem(sys.modules, name, raising=False)
    fa3.load_fa3.cache_clear()
    yield tmp_path
    fa3.load_fa3.cache_clear()
    for name in (fa3.INTERFACE_MODULE, fa3.CONFIG_MODULE, fa3.CONFIG_ALIAS):
        sys.modules.pop(name, None)


# ------------------------------------------------------------------------------ plan

def test_plan_prefers_fa3_when_usable_and_says_why_when_not():
    row = load_table()["cuda_sm90"]
    p = resolve_plan(row, PlanRequest(), device="cuda:0", head_dim=72, kernels=WITH_FA3)
    assert p.attention.value == "fa3_varlen" and p.strided_qkv
    assert "triton_rope_varlen" in p.attention_fallbacks
    missing = absent("fa3_fwd_interface not installed (pip install fastdeploy_ext[fa3], i.e. fa3-fwd)", "fa3_varlen")
    p = resolve_plan(row, PlanRequest(), device="cuda:0", head_dim=72, kernels=missing)
    assert p.attention.value == "triton_rope_varlen"
    assert any("fa3_varlen skipped" in n and "not installed" in n for n in p.notes)
    # this build has no fp16 kernels: fp16 plans skip it by the table's dtype list
    p = resolve_plan(row, PlanRequest(dtype="float16"), device="cuda:0", head_dim=72,
                     kernels=WITH_FA3)
    assert p.attention.value == "triton_rope_varlen"
    # graphs need graph-safe backends; fa3_varlen is (FA3 itself is never captured)
    from fastdeploy_ext.ops.attention.varlen import get_backend
    assert get_backend("fa3_varlen").graph_safe is True
    # other rows do not list it
    assert all("fa3_varlen" not in {e.backend for e in load_table()[r].attention} for r in ("cuda_sm80", "cpu_amx"))


# ------------------------------------------------------------------------ import quirk

def test_load_fa3_aliases_the_config_module(fake_fa3):
    mod, why = fa3.load_fa3()
    assert mod is not None, why
    assert "imported from" in why and str(fake_fa3) in why
    assert sys.modules[fa3.CONFIG_ALIAS] is sys.modules[fa3.CONFIG_MODULE]
    assert fa3.fa3_dtypes(mod) == ("bfloat16",)
    # a CPU device is refused with a reason even though the module imports
    ok, why = fa3.fa3_available(torch.device("cpu"))
    assert not ok and "needs a CUDA device" in why


def test_load_fa3_missing_and_broken(tmp_path, monkeypatch):
    for name in (fa3.INTERFACE_MODULE, fa3.CONFIG_MODULE, fa3.CONFIG_ALIAS):
        monkeypatch.delitem(sys.modules, name, raising=False)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if "fa3" not in p])
    fa3.load_fa3.cache_clear()
    try:
        if fa3.importlib.util.find_spec(fa3.INTERFACE_MODULE) is None:
            mod, why = fa3.load_fa3()
            assert mod is None and "not installed" in why and "fa3-fwd" in why
        # broken: the interface raises at import (e.g. an ABI mismatch of its _C extension)
        (tmp_path / "fa3_fwd_interface.py").write_text("raise ImportError('undefined symbol: _ZN3c10')\n")
        (tmp_path / "fa3_fwd_config.py").write_text(FAKE_CONFIG)
        monkeypatch.syspath_prepend(str(tmp_path))
        fa3.load_fa3.cache_clear()
        mod, why = fa3.load_fa3()
        assert mod is None and "failed to import" in why and "undefined symbol" in why
        with pytest.raises(RuntimeError, match="FlashAttention-3 unavailable"):
            fa3.fa3_varlen(None, None, None, None, 1, 1.0)
    finally:
        fa3.load_fa3.cache_clear()
        for name in (fa3.INTERFACE_MODULE, fa3.CONFIG_MODULE, fa3.CONFIG_ALIAS):
            sys.modules.pop(name, None)


# ------------------------------------------------------------------------ dispatch

def _dispatch(min_seqlen, calls):
    def long_fn(q, k, v, meta, scale):
        calls.append("long")
        return fa3.fa3_varlen(q, k, v, meta.cu_seqlens, meta.max_seqlen, scale)

    def short_fn(q, k, v, meta, scale, cos=None, sin=None):
        calls.append("short")
        q2, k2 = rotary_out_of_place(q, cos, sin), rotary_out_of_place(k, cos, sin)
        return fa3.fa3_varlen(q2, k2, v, meta.cu_seqlens, meta.max_seqlen, scale)

    def rotate(q, k, cos, sin):
        rotary_in_place(q, cos, sin)
        rotary_in_place(k, cos, sin)
    return fa3.LengthDispatch(long_fn, short_fn, rotate, min_seqlen)


class _Meta:
    def __init__(self, lens):
        self.seq_lens = lens
        self.max_seqlen = max(lens)
        self.cu_seqlens = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32)
        self.attention_state = None


def _inputs(lens, h=2, d=8):
    n = sum(lens)
    g = torch.Generator().manual_seed(0)
    qkv = torch.randn(n, 3 * h * d, generator=g)
    ang = torch.randn(n, d // 2, generator=g)
    cos, sin = torch.cat([ang.cos()] * 2, -1), torch.cat([ang.sin()] * 2, -1)
    return qkv, cos, sin


def _reference(qkv, cos, sin, lens, h=2, d=8):
    q, k, v = qkv.view(-1, 3, h, d).unbind(1)
    q, k = rotary_out_of_place(q, cos, sin), rotary_out_of_place(k, cos, sin)
    out, s = [], 0
    for n in lens:
        o = F.scaled_dot_product_attention(q[s:s + n].transpose(0, 1)[None], k[s:s + n].transpose(0, 1)[None],
                                           v[s:s + n].transpose(0, 1)[None], scale=d ** -0.5)
        out.append(o[0].transpose(0, 1))
        s += n
    return torch.cat(out)


@pytest.mark.parametrize("lens,min_seqlen,expect", [
    ([40, 24, 64], 64, "long"),     # longest == threshold: FA3
    ([40, 24, 63], 64, "short"),    # one token short: the Triton kernel
    ([5], 1, "long"),
])
def test_dispatch_routes_by_longest_sequence_and_both_paths_agree(fake_fa3, lens, min_seqlen, expect):
    qkv, cos, sin = _inputs(lens)
    ref = _reference(qkv, cos, sin, lens)
    calls = []
    d = _dispatch(min_seqlen, calls)
    q, k, v = qkv.clone().view(-1, 3, 2, 8).unbind(1)        # strided views, as the encoder passes
    out = d(q, k, v, _Meta(lens), 8 ** -0.5, cos=cos, sin=sin)
    assert calls == [expect]
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    iface = sys.modules[fa3.INTERFACE_MODULE]
    assert iface.CALLS[-1][0] == (sum(lens), 2, 8) and iface.CALLS[-1][2] == max(lens)
    if expect == "long":   # FA3 got the strided views of the packed buffer, not copies
        assert iface.CALLS[-1][1] == (3 * 2 * 8, 8, 1)


def test_choose_reasons_and_capture_rule():
    d = fa3.LengthDispatch(None, None, None, min_seqlen=512)
    c = d.choose(10764, capturing=False)
    assert c.kernel == "long" and "10764 >= 512" in c.reason
    c = d.choose(320, capturing=False)
    assert c.kernel == "short" and "320 < 512" in c.reason
    c = d.choose(10764, capturing=True)   # never captured, whatever the length
    assert c.kernel == "short" and "graph capture" in c.reason


def test_min_seqlen_env(monkeypatch):
    assert fa3.fa3_min_seqlen() == 512
    monkeypatch.setenv("FD_FA3_MIN_SEQLEN", "2048")
    assert fa3.fa3_min_seqlen() == 2048
    monkeypatch.setenv("FD_FA3_MIN_SEQLEN", "0")
    with pytest.raises(ValueError, match="FD_FA3_MIN_SEQLEN"):
        fa3.fa3_min_seqlen()
    assert envs.FD_FA3_MIN_SEQLEN in envs.ALL


# ------------------------------------------------------------------ CUDA (H200)

def _real_fa3():
    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("needs a Hopper GPU (runs in ci/gpu_leg.sh on the H200)")
    fa3.load_fa3.cache_clear()
    ok, why = fa3.fa3_available(torch.device("cuda"))
    if not ok:
        pytest.skip(f"fa3 unavailable: {why}")


CUDA_LENS = {"page-like": [3000], "blocks": [320, 720, 600, 540, 900, 500, 1024, 576]}


@pytest.mark.parametrize("case", list(CUDA_LENS))
def test_cuda_fa3_strided_equals_dense_and_matches_reference(case):
    _real_fa3()
    from fastdeploy_ext.ops.attention.varlen import get_backend
    from fastdeploy_ext.ops.triton.varlen_attention import build_block_table
    lens, h, d = CUDA_LENS[case], 16, 72
    n = sum(lens)
    g = torch.Generator(device="cpu").manual_seed(3)
    qkv = torch.randn(n, 3 * h * d, generator=g).to("cuda", torch.bfloat16)
    ang = torch.randn(n, d // 2, generator=g)
    cos, sin = (torch.cat([ang.cos()] * 2, -1).cuda(), torch.cat([ang.sin()] * 2, -1).cuda())
    meta = _Meta(lens)
    meta.cu_seqlens = meta.cu_seqlens.cuda()
    meta.attention_state = build_block_table(lens).cuda()
    be = get_backend("fa3_varlen")
    a = qkv.clone()
    q, k, v = a.view(n, 3, h, d).unbind(1)
    strided = be(q, k, v, meta, d ** -0.5, cos=cos, sin=sin)
    q, k, v = (t.contiguous() for t in qkv.clone().view(n, 3, h, d).unbind(1))
    dense = be(q, k, v, meta, d ** -0.5, cos=cos, sin=sin)
    assert torch.equal(strided, dense)
    ref = _reference(qkv.float().cpu(), cos.cpu(), sin.cpu(), lens, h, d)
    cosine = F.cosine_similarity(strided.float().cpu().flatten(), ref.flatten(), dim=0).item()
    assert cosine >= 0.9999, cosine
    # the page-like batch took FA3, the blocks too (longest 1024 >= 512): FA3's output differs
    # from the Triton kernel's (other accumulation order) but both match the reference
    tri = get_backend("triton_rope_varlen")(*(t.contiguous() for t in qkv.clone().view(n, 3, h, d).unbind(1)),
                                               meta, d ** -0.5, cos=cos, sin=sin)
    assert F.cosine_similarity(tri.float().flatten(), strided.float().flatten(), dim=0).item() >= 0.9999


def test_cuda_fa3_backend_under_graph_capture_uses_triton():
    _real_fa3()
    from fastdeploy_ext.ops.attention.varlen import get_backend
    from fastdeploy_ext.ops.triton.varlen_attention import build_block_table
    lens, h, d = [1024, 512], 16, 72
    n = sum(lens)
    qkv = torch.randn(n, 3 * h * d, device="cuda", dtype=torch.bfloat16)
    cos = torch.ones(n, d, device="cuda")
    sin = torch.zeros(n, d, device="cuda")
    meta = _Meta(lens)
    meta.cu_seqlens = meta.cu_seqlens.cuda()
    meta.attention_state = build_block_table(lens).cuda()
    be = get_backend("fa3_varlen")
    work = qkv.clone()
    q, k, v = work.view(n, 3, h, d).unbind(1)
    be(q, k, v, meta, d ** -0.5, cos=cos, sin=sin)        # warm-up (Triton compile) outside capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = be(q, k, v, meta, d ** -0.5, cos=cos, sin=sin)
    work.copy_(qkv)
    graph.replay()
    torch.cuda.synchronize()
    q2, k2, v2 = qkv.clone().view(n, 3, h, d).unbind(1)
    tri = get_backend("triton_rope_varlen")(q2, k2, v2, meta, d ** -0.5, cos=cos, sin=sin)
    assert torch.equal(out, tri)   # the captured path is the Triton kernel, bit for bit
