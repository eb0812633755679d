"""ops/rotary.py: the half-width rotary formulation is bit-identical to transformers' formula."""
from __future__ import annotations

import pytest
import torch

from fastdeploy_ext.ops.rotary import rotary_in_place, rotary_out_of_place, rotary_reference


def _case(dtype, n=37, h=3, d=72, distinct_halves=False, seed=0):
    g = torch.Generator().manual_seed(seed)
    qkv = (torch.randn(n, 3 * h * d, generator=g) * 4).to(dtype)
    ang = torch.randn(n, d // 2, generator=g) * 50
    if distinct_halves:
        ang2 = torch.randn(n, d // 2, generator=g) * 50
        cos, sin = torch.cat([ang.cos(), ang2.cos()], -1), torch.cat([ang.sin(), ang2.sin()], -1)
    else:   # the encoder's layout: [h, w, h, w]
        cos, sin = torch.cat([ang.cos()] * 2, -1), torch.cat([ang.sin()] * 2, -1)
    return qkv, cos, sin


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("distinct", [False, True])
def test_rotary_bitwise_vs_reference(dtype, distinct):
    qkv, cos, sin = _case(dtype, distinct_halves=distinct)
    q, k, v = qkv.view(qkv.shape[0], 3, 3, 72).unbind(1)      # strided views
    ref_q, ref_k = rotary_reference(q, cos, sin), rotary_reference(k, cos, sin)
    assert torch.equal(rotary_out_of_place(q, cos, sin), ref_q)
    assert rotary_out_of_place(q, cos, sin).is_contiguous()
    before_v = v.clone()
    assert rotary_in_place(q, cos, sin) is q and rotary_in_place(k, cos, sin) is k
    assert torch.equal(q, ref_q) and torch.equal(k, ref_k)
    assert torch.equal(v, before_v)                            # the neighbouring heads are untouched


def test_rotary_mutation_swapped_sign_is_caught():
    """The reference comparison above would catch a sign slip in either half."""
    qkv, cos, sin = _case(torch.float32)
    q = qkv.view(qkv.shape[0], 3, 3, 72)[:, 0]
    assert not torch.equal(rotary_out_of_place(q, cos, -sin), rotary_reference(q, cos, sin))
