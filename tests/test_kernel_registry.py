"""Kernels contributed by a backend (DeviceRunner.kernel_backends) join that runner's table only:
its rows may name them and the plan chooses them; another backend's runner, the built-in
registry and the next test never see them."""
from __future__ import annotations

import pytest
import torch

from backends.cpu_amx import CpuRunner
from fastdeploy_ext.capabilities import capability_table
from fastdeploy_ext.conformance.references import REFERENCE_ROOT
from fastdeploy_ext.ops.attention.paged import PAGED_ATTENTION_BACKENDS
from fastdeploy_ext.ops.attention.varlen import ATTENTION_BACKENDS, SdpaLoop
from fastdeploy_ext.ops.kernels import builtin_kernels, kernels_for
from fastdeploy_ext.plan import ComponentKind, PlanError, PlanRequest, load_table
from fastdeploy_ext.runner import ImageBatch

VISION = ComponentKind.VISION_VARLEN_ATTENTION
TINY = REFERENCE_ROOT / "tiny_vl"

LAB_ROW = """
rows:
  lab:
    runner: cpu
    match: {}
    dtypes: [float32]
    default_dtype: float32
    kernels:
      vision_varlen_attention:
        - {backend: lab_sdpa, dtypes: [float32]}
        - {backend: sdpa, dtypes: [float32]}
      paged_decoder_attention:
        - {backend: sdpa_paged, head_dims: [1, 512], dtypes: [float32]}
    host_grid_thw: true
    graphs: {kinds: [], default: false}
"""


class CountingSdpa(SdpaLoop):
    """The portable SDPA loop under a name of its own, counting its calls."""

    def __init__(self):
        super().__init__("lab_sdpa", None, head_dims=(1, 512), cuda_only=False)
        self.calls = 0

    def __call__(self, *a, **kw):
        self.calls += 1
        return super().__call__(*a, **kw)


def _runners():
    lab_kernel = CountingSdpa()

    class LabRunner(CpuRunner):
        name = "lab"
        forced_row = "lab"

        @classmethod
        def kernel_backends(cls):
            return {VISION: [lab_kernel]}

    class PlainRunner(CpuRunner):      # the same row, no contribution
        name = "plain"
        forced_row = "lab"
    return lab_kernel, LabRunner, PlainRunner


def test_a_contributed_kernel_is_chosen_and_runs_for_its_runner_only():
    lab_kernel, LabRunner, PlainRunner = _runners()
    table = load_table(LAB_ROW)
    lab = LabRunner.create(PlanRequest(device="cpu"), table=table)
    assert lab.plan.attention.value == "lab_sdpa" and "first usable in row lab" in lab.plan.attention.reason
    assert lab.kernels.get(VISION, "lab_sdpa") is lab_kernel and lab.execution.attention is lab_kernel
    assert lab.kernels.origin(VISION, "lab_sdpa") == "lab" and lab.kernels.origin(VISION, "sdpa") == "built-in"

    # another backend's runner on the same row: the name is not registered there, so it falls back
    plain = PlainRunner.create(PlanRequest(device="cpu"), table=table)
    assert plain.plan.attention.value == "sdpa"
    assert any("lab_sdpa skipped: kernel unavailable: not registered" in n for n in plain.plan.notes)
    with pytest.raises(PlanError, match="row lab: attention backend lab_sdpa cannot run here"):
        PlainRunner.create(PlanRequest(device="cpu", attention_backend="lab_sdpa"), table=table)
    with pytest.raises(ValueError, match="unknown vision_varlen_attention backend 'lab_sdpa'"):
        plain.kernels.get(VISION, "lab_sdpa")
    # nothing leaked into the built-ins (no global was written)
    assert "lab_sdpa" not in builtin_kernels().backends(VISION) and "lab_sdpa" not in ATTENTION_BACKENDS
    assert "lab_sdpa" not in CpuRunner.create(PlanRequest(device="cpu")).kernels.backends(VISION)

    # the contributed kernel is what runs, with the built-in's results (same SDPA underneath)
    lab.load_model(str(TINY))
    plain.load_model(str(TINY))
    torch.manual_seed(0)
    batch = ImageBatch(torch.randn(32, 3, 14, 14), [(1, 4, 4), (1, 4, 4)])
    ours, theirs = lab.encode_images(batch), plain.encode_images(batch)
    assert lab_kernel.calls > 0
    assert all(torch.equal(a, b) for a, b in zip(ours, theirs))


def test_contributions_are_checked():
    base = builtin_kernels()
    with pytest.raises(ValueError, match="backend vendor: vision_varlen_attention backend 'sdpa' is already "
                                         r"registered \(built-in\)"):
        base.with_contributions({VISION: [SdpaLoop("sdpa", None, (1, 512), False)]}, "vendor")
    with pytest.raises(ValueError, match="a vision_varlen_attention backend must be a VarlenAttention"):
        base.with_contributions({VISION: [PAGED_ATTENTION_BACKENDS["sdpa_paged"]]}, "vendor")
    with pytest.raises(ValueError, match="key 'vision_varlen_attention' is not a ComponentKind"):
        base.with_contributions({"vision_varlen_attention": [CountingSdpa()]}, "vendor")
    # two contributors of one name: the second is refused, naming the first
    one = base.with_contributions({VISION: [CountingSdpa()]}, "first")
    with pytest.raises(ValueError, match=r"'lab_sdpa' is already registered \(first\)"):
        one.with_contributions({VISION: [CountingSdpa()]}, "second")


def test_the_shipped_backends_contribute_nothing_and_see_the_builtins():
    from fastdeploy_ext.runner import available_backends
    for name, cls in available_backends().items():
        if name == "acme":          # the sample vendor contributes one (tests/test_oot_backend.py)
            continue
        table = kernels_for(cls)
        assert dict(table.backends(VISION)) == dict(ATTENTION_BACKENDS), name
        assert dict(table.backends(ComponentKind.PAGED_DECODER_ATTENTION)) == dict(PAGED_ATTENTION_BACKENDS), name
    # every backend a shipped row names exists in the built-ins
    for row in capability_table(override="").values():
        for kind, entries in row.kernels:
            assert {e.backend for e in entries} <= set(builtin_kernels().backends(kind)), (row.name, kind)
