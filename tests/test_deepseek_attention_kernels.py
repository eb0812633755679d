"""DeepSeek-OCR-2's attention kernels (ops/triton/biased_attention.py) against the ATen backends
(ops/attention/biased.py), the plan's choice of them per capability row, and the tower's
dispatch through the backends the plan chose.

CPU: the kernels run in the Triton interpreter, which needs TRITON_INTERPRET=1 before triton is
first imported; as in test_triton_paged_attention.py the ``test_interp_*`` tests run in a child
process started with it (``test_interpreter_subprocess``): fp32 on tiny odd shapes (a window
with padding, a global layer with a resized table, GQA prefixes of 0, some and all tokens),
max abs <= 1e-4, and two faults (a dropped bias term, a prefix off by one) that the same
comparison catches. CUDA (``test_cuda_*``, compiled kernels): bf16 / fp16 / fp32 at the real
shapes, the tiny tower end to end, and `info` choosing the kernels.
"""
from __future__ import annotations

import dataclasses
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")

from fastdeploy_ext.capabilities import capability_table  # noqa: E402
from fastdeploy_ext.models.deepseek_ocr2 import vision as V  # noqa: E402
from fastdeploy_ext.models.deepseek_ocr2.config import (DeepseekOCR2Config, EncoderConfig, SamConfig,  # noqa: E402
                                                        TextConfig)
from fastdeploy_ext.models.registry import get_family  # noqa: E402
from fastdeploy_ext.ops.attention.biased import (SDPA_BIAS, SDPA_MASK, TRITON_PREFIX_CAUSAL, TRITON_RELPOS,  # noqa: E402
                                                 SdpaPrefixMask, SdpaRelPos, prefix_mask, rel_pos_table)
from fastdeploy_ext.ops.triton import runtime as ta  # noqa: E402
from fastdeploy_ext.plan import BUILTIN_TOWER, ComponentKind, PlanRequest, QkvLayout, resolve_for_components  # noqa: E402
from .triton_interpreter import run_interp_tests

interp = pytest.mark.skipif(not ta.TRITON_INTERPRETED, reason="interpreter test: runs in test_interpreter_subprocess")
WINDOW, GLOBAL, PREFIX = (ComponentKind.RELPOS_WINDOW_ATTENTION, ComponentKind.RELPOS_GLOBAL_ATTENTION,
                          ComponentKind.PREFIX_CAUSAL_ATTENTION)
FAMILY = get_family("deepseek_ocr2")
TRITON_EXECUTION = V.VisionExecution(strided_qkv=True, window_attention=TRITON_RELPOS, global_attention=TRITON_RELPOS,
                                     prefix_attention=TRITON_PREFIX_CAUSAL)


def _err(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.float() - b.float()).abs().max().item()


def relpos_case(b, h, gh, gw, d, dtype=torch.float32, device="cpu", seed=0):
    """q/k/v as SAM's strided views of one packed qkv [B, N, 3, H, D]; rel_h/rel_w as SAM's
    einsum makes them, from random tables ([B, H, N, grid_h] / [.., grid_w])."""
    g = torch.Generator().manual_seed(seed)
    n = gh * gw
    qkv = torch.randn(b, n, 3, h, d, generator=g).to(device, dtype)
    q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)
    qg = q.reshape(b, h, gh, gw, d)
    th = rel_pos_table(torch.randn(2 * gh - 1, d, generator=g).to(device, dtype), gh)
    tw = rel_pos_table(torch.randn(2 * gw - 1, d, generator=g).to(device, dtype), gw)
    rel_h = torch.einsum("bnhwc,hkc->bnhwk", qg, th).reshape(b, h, n, gh)
    rel_w = torch.einsum("bnhwc,wkc->bnhwk", qg, tw).reshape(b, h, n, gw)
    return q, k, v, rel_h, rel_w


def prefix_case(b, hq, hkv, n, d, dtype=torch.float32, device="cpu", seed=0):
    """q/k/v as the encoder's views of [B, N, H, D] projections."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, n, hq, d, generator=g).to(device, dtype).transpose(1, 2)
    k = torch.randn(b, n, hkv, d, generator=g).to(device, dtype).transpose(1, 2)
    v = torch.randn(b, n, hkv, d, generator=g).to(device, dtype).transpose(1, 2)
    return q, k, v


def masked_reference(q, k, v, n_prefix):
    """The ATen backend's math in fp32, k/v repeated, the boolean mask materialized."""
    return SDPA_MASK(q.float(), k.float(), v.float(), prefix_mask(n_prefix, q.shape[2], q.device))


def randomized(module: torch.nn.Module, seed: int) -> torch.nn.Module:
    """Weights where every tensor moves the outputs (biases too: padded window keys are the qkv
    bias; the rel-pos tables are zeros at init)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            if "norm" in name and name.endswith("weight"):
                p.copy_(1 + 0.1 * noise)
            elif p.ndim == 1 or "rel_pos" in name or "pos_embed" in name:
                p.copy_(0.5 * noise)
            else:
                p.copy_(noise / p[0].numel() ** 0.5)
    return module.eval()


# SAM at tiny width: 2 heads of 16, 5x5 windows, a 12x12 trained grid (rel-pos tables of 23 rows)
SAM = SamConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, mlp_dim=48, image_size=192,
                patch_size=16, window_size=5, global_attn_indexes=(1,), output_channels=16,
                downsample_channels=(24, 48))         # the last one: the encoder width
# the encoder at tiny width: GQA 6 q / 2 kv heads of 8 (the kernel pads the head dim to 16)
ENC = EncoderConfig(hidden_size=48, num_hidden_layers=2, num_attention_heads=6, num_key_value_heads=2,
                    intermediate_size=64)


# ------------------------------------------------------------------ the interpreter (CPU)
def test_interpreter_subprocess():
    if ta.TRITON_INTERPRETED:
        pytest.skip("already in interpreter mode: the test_interp_* tests run in this process")
    if torch.cuda.is_available():
        pytest.skip("a CUDA host runs the compiled kernels (test_cuda_*); cpu/unit runs the interpreter")
    run_interp_tests(__file__, timeout=900)


@interp
@pytest.mark.parametrize("b,h,gh,gw,d,block", [(2, 2, 5, 7, 16, (16, 16)),      # odd non-square grid
                                               (1, 3, 3, 3, 24, (16, 16)),      # head dim padded to 32
                                               (1, 1, 9, 9, 64, None),          # the default blocks, D=64
                                               (1, 2, 3, 32, 16, (16, 16)),     # wide rows: a key block in one row
                                               (2, 2, 4, 16, 32, (32, 16)),     # one key block per grid row
                                               (1, 2, 3, 20, 16, (16, 16)),     # key blocks across rows: gathers
                                               (1, 2, 3, 20, 16, (16, 32))])    # a grid row padded to a key block
def test_interp_relpos_kernel_matches_sdpa_bias(b, h, gh, gw, d, block):
    from fastdeploy_ext.ops.triton.biased_attention import BlockConfig, relpos_attention
    q, k, v, rel_h, rel_w = relpos_case(b, h, gh, gw, d)
    cfg = BlockConfig(*block, 4, 2) if block else None
    got = relpos_attention(q, k, v, rel_h, rel_w, d ** -0.5, cfg)
    assert got.shape == q.shape and got.transpose(1, 2).is_contiguous()    # [B, N, H, D] underneath
    assert _err(got, SDPA_BIAS(q, k, v, rel_h, rel_w)) <= 1e-4


@interp
@pytest.mark.parametrize("window,side,strided", [(5, 7, True), (5, 7, False), (0, 9, True)])
def test_interp_sam_block_with_the_kernel_matches_aten(window, side, strided):
    """A whole SAM block: 7x7 patches in 5x5 windows (padded to 10x10: three of four windows
    hold padding whose keys/values are the qkv bias) and a global layer over 9x9 (its 23-row
    tables resized to 17), q/k/v strided views or contiguous copies."""
    blk = randomized(V.SamBlock(SAM, window), seed=1)
    x = torch.randn(2, side, side, SAM.hidden_size, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        want = blk(x, V.VisionExecution(strided_qkv=strided))
        got = blk(x, dataclasses.replace(TRITON_EXECUTION, strided_qkv=strided))
    assert want.abs().max() > 0.5 and _err(got, want) <= 1e-4


@interp
@pytest.mark.parametrize("b,h,gh,gw,d,strided", [(2, 2, 5, 7, 16, True),       # odd non-square grid
                                                 (1, 3, 14, 14, 24, False),    # a window, head dim padded, dense q
                                                 (1, 1, 9, 9, 64, True)])      # D=64
def test_interp_relpos_projections_match_einsum(b, h, gh, gw, d, strided):
    """Our projections kernel (q read in place) against the reference's einsum over the gathered
    tables, the row table resized (trained for another grid); the row table's offsets reversed
    are caught by the same comparison."""
    from fastdeploy_ext.ops.attention.biased import rel_pos_projections
    g = torch.Generator().manual_seed(5)
    q = torch.randn(b, gh * gw, 3, h, d, generator=g).permute(2, 0, 3, 1, 4)[0]
    q = q if strided else q.contiguous()
    th, tw = torch.randn(2 * gh + 3, d, generator=g), torch.randn(2 * gw - 1, d, generator=g)
    want = rel_pos_projections(q, th, tw, gh, gw, kernel=False)
    got = rel_pos_projections(q, th, tw, gh, gw, kernel=True)
    for a, w in zip(got, want):
        assert a.shape == w.shape and a.is_contiguous() and w.abs().max() > 1 and _err(a, w) <= 1e-4
    assert _err(rel_pos_projections(q, th.flip(0), tw, gh, gw, kernel=True)[0], want[0]) > 1e-2


@interp
@pytest.mark.parametrize("side", [12, 7])     # the trained grid; a crop-like one (positions, global tables resized)
def test_interp_sam_fused_blocks_match_aten(side, monkeypatch):
    """SAM through the fused passes (the window partition in the norms' row maps, the rel-pos
    projections by our kernel) against ATen's blocks: 5x5 windows over 12x12 (padded to 15) and
    7x7 (padded to 10) grids, then a global layer; a window map shifted by one row is caught."""
    sam = randomized(V.Sam(SAM), seed=6)
    views = 2
    patches = torch.randn(views * side * side, 3 * 16 * 16, generator=torch.Generator().manual_seed(7))
    fused = dataclasses.replace(TRITON_EXECUTION, fused_layers=True)
    with torch.no_grad():
        want = sam(patches, views, V.VisionExecution())
        got = sam(patches, views, fused)
        assert got.shape == want.shape and want.abs().max() > 0.5 and _err(got, want) <= 1e-4
        assert len(sam._window_maps) == 1          # made once per shape
        real = V.WindowMaps.build.__func__

        def shifted(cls, *args):
            m = real(cls, *args)
            return cls(m.windows, torch.roll(m.rows, 1), m.delta_rows)
        monkeypatch.setattr(V.WindowMaps, "build", classmethod(shifted))
        sam._window_maps.clear()
        assert _err(sam(patches, views, fused), want) > 1e-2


@interp
@pytest.mark.parametrize("b,hq,hkv,n,n_prefix,d", [(2, 6, 2, 23, 11, 16),     # GQA 3:1, prefix then queries
                                                  (1, 4, 1, 9, 0, 8),        # causal only, head dim padded
                                                  (1, 2, 2, 13, 13, 32),     # all prefix: bidirectional
                                                  (1, 14, 2, 40, 20, 64)])   # the released heads, 20 + 20
def test_interp_prefix_causal_kernel_matches_masked_sdpa(b, hq, hkv, n, n_prefix, d):
    from fastdeploy_ext.ops.triton.biased_attention import BlockConfig, prefix_causal_attention
    q, k, v = prefix_case(b, hq, hkv, n, d)
    got = prefix_causal_attention(q, k, v, n_prefix, d ** -0.5, BlockConfig(16, 16, 4, 2))
    assert _err(got, masked_reference(q, k, v, n_prefix)) <= 1e-4


@interp
def test_interp_query_encoder_with_the_kernel_matches_aten():
    enc = randomized(V.QueryEncoder(ENC), seed=3)
    g = torch.Generator().manual_seed(4)
    visual, queries = torch.randn(2, 10, ENC.hidden_size, generator=g), torch.randn(7, ENC.hidden_size, generator=g)
    with torch.no_grad():
        want = enc(visual, queries, V.VisionExecution())
        got = enc(visual, queries, TRITON_EXECUTION)
    assert want.shape == (2, 7, ENC.hidden_size) and _err(got, want) <= 1e-4


@interp
def test_interp_query_encoder_fused_passes_match_aten(monkeypatch):
    """The encoder through the decoder's fused passes (packed q|k|v with its bias and gate|up,
    q/k rotated in place, add + RMSNorm with the residual in place) against ATen's layers; the
    same path with k left unrotated is caught by the comparison."""
    import fastdeploy_ext.ops.rotary as rotary
    enc = randomized(V.QueryEncoder(ENC), seed=3)
    g = torch.Generator().manual_seed(4)
    visual, queries = torch.randn(2, 10, ENC.hidden_size, generator=g), torch.randn(7, ENC.hidden_size, generator=g)
    fused = dataclasses.replace(TRITON_EXECUTION, fused_layers=True)
    with torch.no_grad():
        want = enc(visual, queries, V.VisionExecution())
        got = enc(visual, queries, fused)
        assert enc.layers[0].self_attn.k_proj.bias.data_ptr() == enc.layers[0].qkv_bias[48:].data_ptr()
        assert want.shape == got.shape == (2, 7, ENC.hidden_size) and _err(got, want) <= 1e-4
        assert _err(enc(visual, queries, V.VisionExecution()), want) == 0       # packing changed no value
        real = rotary.rotary_qk_in_place
        monkeypatch.setattr(rotary, "rotary_qk_in_place",
                            lambda qk, cos, sin: real(qk[:, :ENC.num_attention_heads], cos, sin))
        assert _err(enc(visual, queries, fused), want) > 1e-2


@interp
def test_interp_a_dropped_bias_term_or_an_off_by_one_prefix_fails_the_comparison():
    """The comparisons above can fail: the kernel launched without the column term of the bias,
    or with the prefix one token short or long, is far past 1e-4 from the ATen backend."""
    from fastdeploy_ext.ops.triton.biased_attention import BlockConfig, prefix_causal_attention, relpos_attention
    q, k, v, rel_h, rel_w = relpos_case(2, 2, 5, 7, 16)
    want = SDPA_BIAS(q, k, v, rel_h, rel_w)
    assert _err(relpos_attention(q, k, v, rel_h, torch.zeros_like(rel_w), 16 ** -0.5), want) > 1e-2
    assert _err(relpos_attention(q, k, v, rel_h, rel_w, 16 ** -0.5), want) <= 1e-4     # the same call, unbroken
    q, k, v, rel_h, rel_w = relpos_case(1, 2, 3, 32, 16)           # the row term dropped instead
    want = SDPA_BIAS(q, k, v, rel_h, rel_w)
    blocks = BlockConfig(16, 16, 4, 2)
    assert _err(relpos_attention(q, k, v, torch.zeros_like(rel_h), rel_w, 16 ** -0.5, blocks), want) > 1e-2
    assert _err(relpos_attention(q, k, v, rel_h, rel_w, 16 ** -0.5, blocks), want) <= 1e-4
    q, k, v = prefix_case(2, 6, 2, 23, 16)
    want = masked_reference(q, k, v, 11)
    cfg = BlockConfig(16, 16, 4, 2)
    for wrong in (10, 12):
        assert _err(prefix_causal_attention(q, k, v, wrong, 16 ** -0.5, cfg), want) > 1e-2
    assert _err(prefix_causal_attention(q, k, v, 11, 16 ** -0.5, cfg), want) <= 1e-4


# ------------------------------------------------------------------ launcher checks (no kernel runs)
def test_bad_inputs_name_the_problem():
    from fastdeploy_ext.ops.triton.biased_attention import prefix_causal_attention, relpos_attention
    q, k, v, rel_h, rel_w = relpos_case(1, 2, 3, 4, 16)
    with pytest.raises(ValueError, match="grid_h \\* grid_w == N"):
        relpos_attention(q, k, v, rel_h[..., :2], rel_w, 0.25)
    with pytest.raises(ValueError, match="rel_w dtype torch.float16 does not match"):
        relpos_attention(q, k, v, rel_h, rel_w.half(), 0.25)
    q, k, v = prefix_case(1, 6, 4, 5, 16)
    with pytest.raises(ValueError, match="6 query heads are no multiple of 4 kv heads"):
        prefix_causal_attention(q, k, v, 2, 0.25)
    with pytest.raises(ValueError, match="n_prefix 6 out of range"):
        prefix_causal_attention(q, k, v, 6, 0.25)
    with pytest.raises(ValueError, match="n_prefix must be a host int"):
        prefix_causal_attention(q, k, v, torch.tensor(2), 0.25)


@pytest.mark.parametrize("relpos,dtype,n", [(True, torch.bfloat16, 4096), (True, torch.bfloat16, 2304),
                                           (True, torch.bfloat16, 196), (False, torch.bfloat16, 512),
                                           (True, torch.float32, 196)])
def test_the_compiled_kernel_builds_for_sm90_without_a_gpu(relpos, dtype, n):
    """Triton's compiler down to an sm_90a cubin (its bundled ptxas) with the launcher's default
    blocks: what the interpreter cannot check (constexpr branches, layouts, the wgmma lowering)."""
    if ta.TRITON_INTERPRETED:
        pytest.skip("the interpreter process builds no compiled kernels")
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from fastdeploy_ext.ops.triton import biased_attention as ba
    fn = ba._KERNELS["fwd"]
    grid_w = {4096: 64, 2304: 48, 196: 14}[n] if relpos else None      # a view, a crop, a window
    bm, bn, warps, stages = ba.default_config(n, dtype, grid_w)
    ty = {torch.bfloat16: "*bf16", torch.float32: "*fp32"}[dtype]
    consts = dict(HEADS=12, GROUP=1 if relpos else 7, HEAD_DIM=64, BLOCK_D=64, BLOCK_M=bm, BLOCK_N=bn,
                  ALIGN=16 // (2 if dtype == torch.bfloat16 else 4), RELPOS=relpos,
                  ROW_BLOCKS=relpos and grid_w % bn == 0, ROW_PAD=relpos and bn >= grid_w, PREFIX_CAUSAL=not relpos,
                  DOT_PREC="ieee" if dtype == torch.float32 else "tf32")
    sig = {a: "constexpr" if a in consts else ty if a[0].isupper() else "fp32" if a.endswith("scale") else "i32"
           for a in fn.arg_names}
    attrs = {(i,): [["tt.divisibility", 16]] for i, a in enumerate(fn.arg_names) if a[0].isupper() and a not in consts}
    kernel = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=consts, attrs=attrs),
                            target=GPUTarget("cuda", 90, 32), options={"num_warps": warps, "num_stages": stages})
    ptx = kernel.asm["ptx"]
    assert ".entry _biased_attn_fwd" in ptx and "cp.async" in ptx      # k/v tiles pipelined
    if dtype == torch.bfloat16:
        assert "wgmma" in ptx                                            # Hopper's tensor-core path


def test_default_blocks_hold_one_grid_row_a_key_block():
    """The measured defaults: a key block holding a whole grid row (64 for the 1024 views and the
    48-wide crops, 16 for the 14-wide windows), so the kernel takes its gather-free ROW_PAD path;
    a wider grid a key block dividing its width (ROW_BLOCKS); the encoder (no grid) its own."""
    from fastdeploy_ext.ops.triton.biased_attention import BlockConfig, default_config
    bf16 = torch.bfloat16
    assert default_config(4096, bf16, 64) == BlockConfig(64, 64, 4, 3)
    assert default_config(2304, bf16, 48) == BlockConfig(64, 64, 4, 3)
    assert default_config(196, bf16, 14) == BlockConfig(64, 16, 4, 3)
    assert default_config(96 * 96, bf16, 96) == BlockConfig(64, 32, 4, 3) and 96 % 32 == 0
    assert default_config(512, bf16) == BlockConfig(64, 64, 4, 3)
    assert default_config(4096, torch.float32, 64) == BlockConfig(64, 32, 4, 2)


def test_bench_names_a_bad_workload_or_config(capsys):
    from fastdeploy_ext.bench.deepseek_attention import main
    for argv, msg in ((["--workloads", "global_v16,nope"], "unknown workload(s) nope; known: window_v16"),
                      (["--configs", "64,48,4,3"], "--configs: block_n must be a power of two >= 16, got 48")):
        with pytest.raises(SystemExit) as e:
            main(argv)
        assert e.value.code == 2 and msg in capsys.readouterr().err


# ------------------------------------------------------------------ the plan
ROWS = capability_table(override="")
PAGED = {"triton_paged": (True, "test: here"), "sdpa_paged": (True, "ok")}
COMPONENTS = FAMILY.components(FAMILY.default_config())


def _tower(triton_present: bool):
    tower = {k: dict(v) for k, v in BUILTIN_TOWER.items()}
    if triton_present:
        for kind, name in ((WINDOW, "triton_relpos"), (GLOBAL, "triton_relpos"), (PREFIX, "triton_prefix_causal")):
            tower[kind][name] = (True, True, "test: CUDA and triton here")
    return tower


def _plan(row: str, dtype: str, triton_present: bool):
    return resolve_for_components(ROWS[row], PlanRequest(dtype=dtype), COMPONENTS, device="cuda:0", kernels={},
                                  text_available=PAGED, tower_available=_tower(triton_present))


@pytest.mark.parametrize("row", ["cuda_sm90", "cuda_sm80"])
def test_cuda_rows_prefer_the_triton_kernels_in_half_precision(row):
    plan = _plan(row, "bfloat16", True)
    for kind, name, why in ((WINDOW, "triton_relpos", "test: CUDA and triton here"),
                            (GLOBAL, "triton_relpos", "test: CUDA and triton here"),
                            (PREFIX, "triton_prefix_causal", "test: CUDA and triton here")):
        d = plan.kernel(kind)
        assert d.value == name and d.reason == f"first usable in row {row} {kind.value.rsplit('_', 1)[0]} " \
                                               f"preference order; {why}"
    assert plan.qkv_layout.value is QkvLayout.STRIDED and "triton_relpos reads strided q/k/v" in plan.qkv_layout.reason
    # fp32 (the parity dtype) keeps ATen's math, with the reason
    plan = _plan(row, "float32", True)
    d = plan.kernel(WINDOW)
    assert d.value == "sdpa_bias" and "skipped triton_relpos: dtype float32 not in" in d.reason
    assert plan.kernel(PREFIX).value == "sdpa_mask"


def test_without_triton_the_cuda_rows_fall_back_to_aten_saying_why():
    plan = _plan("cuda_sm90", "bfloat16", False)
    assert plan.kernel(WINDOW).value == plan.kernel(GLOBAL).value == "sdpa_bias"
    assert plan.kernel(PREFIX).value == "sdpa_mask"
    assert "skipped triton_relpos: kernel unavailable: Triton kernels need a CUDA device" in plan.kernel(WINDOW).reason
    assert any(n.startswith("prefix-causal attention triton_prefix_causal skipped: kernel unavailable")
               for n in plan.notes)


@pytest.mark.parametrize("row", ["cpu", "cpu_amx", "metax_c500", "cuda"])
def test_other_rows_keep_aten_even_with_triton_present(row):
    plan = _plan(row, "float32", True)
    assert plan.kernel(WINDOW).value == "sdpa_bias" and plan.kernel(PREFIX).value == "sdpa_mask"


# ------------------------------------------------------------------ the tower dispatches through the plan
class CountingRelPos(SdpaRelPos):
    def __init__(self, name):
        self.name, self.calls = name, []

    def __call__(self, q, k, v, rel_h, rel_w):
        self.calls.append((q.shape[2], rel_h.shape[-1], rel_w.shape[-1]))
        return super().__call__(q, k, v, rel_h, rel_w)


class CountingPrefix(SdpaPrefixMask):
    name = "lab_prefix"

    def __init__(self):
        self.calls = []

    def __call__(self, q, k, v, state):
        self.calls.append((q.shape[1], k.shape[1], q.shape[2]))
        return super().__call__(q, k, v, state)


LAB_ROW = """
rows:
  lab:
    runner: cpu
    match: {}
    dtypes: [float32]
    default_dtype: float32
    kernels:
      vision_varlen_attention:
        - {backend: sdpa, dtypes: [float32]}
      paged_decoder_attention:
        - {backend: sdpa_paged, head_dims: [1, 512], dtypes: [float32]}
      relpos_window_attention:
        - {backend: lab_window, dtypes: [float32]}
        - {backend: sdpa_bias, dtypes: [float32]}
      relpos_global_attention:
        - {backend: lab_global, dtypes: [float32]}
        - {backend: sdpa_bias, dtypes: [float32]}
      prefix_causal_attention:
        - {backend: lab_prefix, dtypes: [float32]}
        - {backend: sdpa_mask, dtypes: [float32]}
      moe_experts:
        - {backend: aten_moe, dtypes: [float32]}
    host_grid_thw: true
    graphs: {kinds: [], default: false}
"""


def test_the_tower_runs_the_backends_the_runners_plan_chose():
    """A runner whose row prefers contributed backends for the three kinds hands them to the
    tower through its execution; SAM's windowed layer, its global layer and every encoder layer
    call them (the global view's 64x64 grid in 14x14 windows), with ATen's results (the plan is
    re-resolved for the family as load_model does)."""
    from backends.cpu_amx import CpuRunner
    from fastdeploy_ext.plan import load_table
    window, glob, prefix = CountingRelPos("lab_window"), CountingRelPos("lab_global"), CountingPrefix()

    class LabRunner(CpuRunner):
        name = "lab"
        forced_row = "lab"

        @classmethod
        def kernel_backends(cls):
            return {WINDOW: [window], GLOBAL: [glob], PREFIX: [prefix]}

    runner = LabRunner.create(PlanRequest(device="cpu"), table=load_table(LAB_ROW))
    runner.plan_for_model(FAMILY, FAMILY.default_config())      # as load_model re-resolves for its family
    assert (runner.plan.relpos_window_attention.value, runner.plan.relpos_global_attention.value,
            runner.plan.prefix_causal_attention.value) == ("lab_window", "lab_global", "lab_prefix")
    ex = runner.execution
    assert ex.window_attention is window and ex.global_attention is glob and ex.prefix_attention is prefix

    cfg = DeepseekOCR2Config(sam=dataclasses.replace(SAM, image_size=1024, window_size=14), encoder=ENC,
                             text=TextConfig(hidden_size=40))
    tower = randomized(V.DeepseekOCR2Vision(cfg), seed=5)
    meta = V.VisionMetadataBuilder(cfg, device=torch.device("cpu")).build_host([(1, 1, 1)])
    pixels = torch.randn(meta.num_tokens, cfg.patch_dim, generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        got = tower(pixels, meta, ex)
        want = tower(pixels, meta, V.VisionExecution(strided_qkv=ex.strided_qkv))
    assert window.calls == [(196, 14, 14)] and glob.calls == [(4096, 64, 64)]
    assert prefix.calls == [(6, 2, 512)] * ENC.num_hidden_layers       # 256 visual + 256 queries, kv unrepeated
    assert torch.equal(got, want)


# ------------------------------------------------------------------ CUDA (compiled)
@pytest.fixture
def cuda():
    if ta.TRITON_INTERPRETED or not torch.cuda.is_available():
        pytest.skip("needs a CUDA device and triton in compiled mode")


# (abs, rel) against an fp32 reference on the same rounded inputs: the output's own rounding to
# the dtype (rel: half an ulp, 2^-8 bf16 / 2^-11 fp16) plus P rounded to the dtype before P @ V
TOL = {torch.bfloat16: (1e-2, 2 ** -8), torch.float16: (2e-3, 2 ** -11), torch.float32: (1e-4, 0.0)}


def _close(got: torch.Tensor, want: torch.Tensor) -> bool:
    atol, rtol = TOL[got.dtype]
    return bool(((got.float() - want).abs() <= atol + rtol * want.abs()).all())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("b,side", [(50, 14), (2, 64), (3, 48)])     # windows, a 1024 view, 768 crops
def test_cuda_relpos_matches_sdpa_bias_at_the_real_shapes(cuda, dtype, b, side):
    q, k, v, rel_h, rel_w = relpos_case(b, 12, side, side, 64, dtype=dtype, device="cuda")
    got = TRITON_RELPOS(q, k, v, rel_h, rel_w)
    want = SDPA_BIAS(q.float(), k.float(), v.float(), rel_h.float(), rel_w.float())
    assert got.dtype == dtype and _close(got, want), _err(got, want)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("b,n_visual", [(16, 256), (8, 144), (3, 100)])
def test_cuda_prefix_causal_matches_masked_sdpa_at_the_real_shapes(cuda, dtype, b, n_visual):
    q, k, v = prefix_case(b, 14, 2, 2 * n_visual, 64, dtype=dtype, device="cuda")
    got = TRITON_PREFIX_CAUSAL(q, k, v, TRITON_PREFIX_CAUSAL.prepare(n_visual, 2 * n_visual, q.device))
    want = masked_reference(q, k, v, n_visual)
    assert got.dtype == dtype and _close(got, want), _err(got, want)


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_cuda_tiny_tower_with_the_kernels_matches_aten(cuda, dtype, fused):
    """The tower at the real geometry (a global view and two crops: 64x64 and 48x48 grids in
    14x14 windows, 256 + 144 queries), tiny widths: the Triton execution (with the encoder's
    fused passes or not) against ATen's."""
    cfg = DeepseekOCR2Config(sam=dataclasses.replace(SAM, image_size=1024, window_size=14), encoder=ENC,
                             text=TextConfig(hidden_size=40))
    tower = randomized(V.DeepseekOCR2Vision(cfg), seed=5).to("cuda", dtype)
    meta = V.VisionMetadataBuilder(cfg, device=torch.device("cuda")).build_host([(3, 1, 2)])
    pixels = torch.randn(meta.num_tokens, cfg.patch_dim, generator=torch.Generator().manual_seed(6)).to("cuda", dtype)
    with torch.no_grad():
        want = tower(pixels, meta, V.VisionExecution(strided_qkv=True)).float()
        got = tower(pixels, meta, dataclasses.replace(TRITON_EXECUTION, fused_layers=fused)).float()
    if dtype == torch.float32:
        assert _err(got, want) <= 1e-4
    else:
        assert F.cosine_similarity(got.flatten(), want.flatten(), dim=0).item() >= 0.999


def test_cuda_info_chooses_the_kernels(cuda):
    out = subprocess.run([sys.executable, "-m", "fastdeploy_ext.entrypoints.cli", "info", "--model-family",
                          "deepseek_ocr2", "--device", "cuda"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    for line in ("relpos_window_attention = triton_relpos", "relpos_global_attention = triton_relpos",
                 "prefix_causal_attention = triton_prefix_causal", "qkv_layout              = strided"):
        assert line in out.stdout, out.stdout
