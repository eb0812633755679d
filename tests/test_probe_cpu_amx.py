"""The CPU probe (backends/cpu_amx/probe.py): cpuinfo parsing, the oneDNN verbose parser, and the
AMX gate — the cpu_amx row needs oneDNN's evidence that the encoder's own bf16 matmuls run on AMX
kernels. Every test asserts what the CPU at hand can show (AVX2-only, AVX-512 or AMX); the
AVX2-only case is also simulated (FD_CPUINFO + ONEDNN_MAX_CPU_ISA=AVX2 + ATEN_CPU_CAPABILITY=avx2)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch

from backends.cpu_amx import CpuAmxRunner, probe as cpu_probe
from backends.cpu_amx.probe import (AmxEvidence, amx_evidence_for_encoder, encoder_matmul_shapes,
                                    onednn_amx_evidence, parse_cpuinfo, parse_onednn_verbose, probe_cpu,
                                    probe_cpu_amx)
from fastdeploy_ext.plan import PlanRequest

ROOT = Path(__file__).resolve().parents[1]
AVX2_EPYC_CPUINFO = ROOT / "tests" / "data" / "cpuinfo_avx2_epyc.txt"

AMX_CPUINFO = """\
processor\t: 0
vendor_id\t: GenuineIntel
model name\t: Intel(R) Xeon(R) Platinum 8480+
physical id\t: 0
core id\t\t: 0
flags\t\t: fpu sse sse2 avx avx2 avx512f avx512bw avx512_bf16 avx512_fp16 amx_bf16 amx_tile amx_int8

processor\t: 1
vendor_id\t: GenuineIntel
model name\t: Intel(R) Xeon(R) Platinum 8480+
physical id\t: 0
core id\t\t: 1
flags\t\t: fpu sse sse2 avx avx2 avx512f avx512bw avx512_bf16 avx512_fp16 amx_bf16 amx_tile amx_int8
"""
NO_AMX_CPUINFO = AMX_CPUINFO.replace(" amx_bf16 amx_tile amx_int8", "")


# ------------------------------------------------------------------------------- cpuinfo
def test_cpuinfo_with_amx():
    r = probe_cpu(cpuinfo_text=AMX_CPUINFO)
    assert r.kind == "cpu" and r.present and r.usable and not r.emulated
    d = r.details
    assert d["has_amx"] and d["amx_tile"] and d["amx_bf16"] and d["amx_int8"] and d["avx512_bf16"] and d["avx512f"]
    assert r.devices[0].family == "cpu_amx" and r.devices[0].name == "Intel(R) Xeon(R) Platinum 8480+"
    assert "amx_tile" in d["flags"] and d["flags_source"] == "given text"
    assert d["logical_cpus"] == 2 and d["physical_cores"] == 2
    assert "AMX (amx_tile+amx_bf16+amx_int8)" in r.reason
    json.dumps(r.to_dict())


def test_cpuinfo_without_amx():
    r = probe_cpu(cpuinfo_text=NO_AMX_CPUINFO)
    assert not r.details["has_amx"] and not r.details["amx_tile"] and r.details["avx512_bf16"]
    assert r.devices[0].family == "cpu"
    assert "no AMX" in r.reason


def test_amx_tile_alone_is_not_amx():
    r = probe_cpu(cpuinfo_text="processor : 0\nflags : avx512f amx_tile\n")
    assert not r.details["has_amx"] and r.devices[0].family == "cpu"


def test_parse_cpuinfo_arm_features():
    p = parse_cpuinfo("processor : 0\nFeatures : fp asimd sve\n\nprocessor : 1\nFeatures : fp asimd sve\n")
    assert p["flags"] == ["asimd", "fp", "sve"] and p["logical_cpus"] == 2 and p["model_name"] is None


def test_cpuinfo_unreadable_falls_back_to_py_cpuinfo(monkeypatch, tmp_path):
    fake = types.ModuleType("cpuinfo")
    fake.get_cpu_info = lambda: {"flags": ["avx2", "amx_tile", "amx_bf16"], "brand_raw": "Fake Xeon"}
    monkeypatch.setitem(sys.modules, "cpuinfo", fake)
    r = probe_cpu(cpuinfo_path=str(tmp_path / "missing"))
    assert r.details["flags_source"] == "py-cpuinfo" and r.details["has_amx"]
    assert r.devices[0].name == "Fake Xeon" and "unreadable" in r.reason


def test_real_cpu_probe_is_consistent():
    import os

    import torch
    r = probe_cpu()
    d = r.details
    assert r.present and r.usable and len(r.devices) == 1
    assert d["has_amx"] == ({"amx_tile", "amx_bf16"} <= set(d["flags"]))
    assert r.devices[0].family == ("cpu_amx" if d["has_amx"] else "cpu")
    for f in ("amx_tile", "amx_bf16", "amx_int8", "avx512_bf16", "avx512f"):
        assert d[f] == (f in d["flags"])
    assert d["os_cpu_count"] == os.cpu_count()
    assert d["torch_num_threads"] == torch.get_num_threads()
    assert d["torch_cpu_capability"] == torch.backends.cpu.get_cpu_capability()
    assert d["mkldnn_available"] == torch.backends.mkldnn.is_available()
    assert r.summary().startswith("cpu: present, usable")
    json.dumps(r.to_dict())


def test_cpuinfo_file_comes_from_FD_CPUINFO(monkeypatch):
    monkeypatch.setenv("FD_CPUINFO", str(AVX2_EPYC_CPUINFO))
    r = probe_cpu()
    assert r.details["flags_source"] == str(AVX2_EPYC_CPUINFO)
    assert r.details["avx2"] and not r.details["avx512f"] and not r.details["has_amx"]
    assert "AMD EPYC" in r.devices[0].name and "no AMX" in r.reason and "AVX2" in r.reason


# ------------------------------------------------------------------------ the encoder's own shapes
def test_evidence_shapes_are_the_encoders_own_linear_layers():
    from fastdeploy_ext.models.paddleocr_vl.config import PaddleOCRVLConfig
    from fastdeploy_ext.models.paddleocr_vl.loader import build_vision_model
    with torch.device("meta"):
        model = build_vision_model(PaddleOCRVLConfig())
    linears = {(m.in_features, m.out_features) for m in model.modules() if isinstance(m, torch.nn.Linear)}
    shapes = encoder_matmul_shapes(tokens=256)
    assert {(k, n) for _, k, n in shapes} == linears
    assert (256, 1152, 3456) in shapes and (256, 1152, 4304) in shapes and (256, 4304, 1152) in shapes
    assert (64, 4608, 4608) in shapes            # the projector runs on the 2x2-merged tokens


def _evidence(impl: str, shapes=None, skip=()) -> AmxEvidence:
    shapes = shapes or encoder_matmul_shapes()
    problems = {f"{m}x{k}:{k}x{n}": impl for i, (m, k, n) in enumerate(shapes) if i not in skip}
    amx = "amx" in impl
    return AmxEvidence(amx, "recorded", [impl], "", f"recorded: {impl}", len(problems),
                       len(problems) if amx else 0, problems=problems)


# --------------------------------------------------------------- the gate, with recorded evidence
def test_amx_flags_and_amx_evidence_choose_the_cpu_amx_row():
    probe = probe_cpu_amx(cpuinfo_text=AMX_CPUINFO, evidence=_evidence("brg_matmul:avx10_1_512_amx"))
    assert probe.details["amx_proven"] and probe.devices[0].family == "cpu_amx"
    plan = CpuAmxRunner.create(PlanRequest(device="cpu_amx"), probe=probe).plan
    assert plan.row == "cpu_amx" and plan.dtype.value == "bfloat16"
    assert any("all 7 of the encoder's bf16 matmuls on AMX" in n for n in plan.notes)


@pytest.mark.parametrize("evidence,why", [
    (_evidence("brg_matmul:avx512_core_bf16"), "brg_matmul:avx512_core_bf16"),          # oneDNN capped
    (_evidence("brg_matmul:avx10_1_512_amx", skip=(3,)), "not executed by oneDNN"),      # one shape missing
    (AmxEvidence(False, "", [], "", "no oneDNN verbose output"), "no oneDNN verbose output"),
])
def test_amx_flags_without_evidence_fall_back_to_the_cpu_row_with_the_reason(evidence, why):
    probe = probe_cpu_amx(cpuinfo_text=AMX_CPUINFO, evidence=evidence)
    assert probe.details["has_amx"] and not probe.details["amx_proven"]
    assert probe.devices[0].family == "cpu"
    plan = CpuAmxRunner.create(PlanRequest(device="cpu_amx"), probe=probe).plan
    assert plan.row == "cpu" and plan.dtype.value == "float32"
    note = next(n for n in plan.notes if n.startswith("row cpu:"))
    assert "AMX flags present but oneDNN did not run" in note and why in note


def test_no_amx_flags_need_no_evidence():
    sentinel = AmxEvidence(True, "must not be used", [], "", "")
    probe = probe_cpu_amx(cpuinfo_text=NO_AMX_CPUINFO, evidence=sentinel)
    assert "amx_evidence" not in probe.details
    plan = CpuAmxRunner.create(PlanRequest(device="cpu_amx"), probe=probe).plan
    assert plan.row == "cpu" and any("has no AMX" in n for n in plan.notes)


def test_evidence_is_cached_per_process_and_per_isa_cap(monkeypatch):
    calls = []
    monkeypatch.setattr(cpu_probe, "onednn_amx_evidence",
                        lambda max_cpu_isa=None: calls.append(max_cpu_isa) or _evidence("x"))
    cpu_probe._cached_encoder_evidence.cache_clear()
    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA", raising=False)
    monkeypatch.delenv("DNNL_MAX_CPU_ISA", raising=False)
    first = amx_evidence_for_encoder()
    assert amx_evidence_for_encoder() is first and calls == [None]
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")
    assert amx_evidence_for_encoder() is not first and calls == [None, "AVX2"]
    cpu_probe._cached_encoder_evidence.cache_clear()


# ------------------------------------------------------ real oneDNN, asserting what this CPU can show
def test_real_evidence_agrees_with_this_cpu():
    cpu = probe_cpu()
    ev = amx_evidence_for_encoder()
    shapes = encoder_matmul_shapes()
    assert isinstance(ev, AmxEvidence) and ev.reason
    if ev.amx_used:                               # AMX kernels ran: the CPU must say it has AMX
        assert cpu.details["has_amx"], (ev.reason, cpu.reason)
    if not cpu.details["has_amx"]:
        assert not ev.amx_used and "amx" not in ev.isa.lower()
    if ev.compute_primitives:                    # oneDNN ran the matmuls: each shape is accounted for
        assert ev.isa and set(ev.problems) >= {f"{m}x{k}:{k}x{n}" for m, k, n in shapes}, ev.problems
    probe = CpuAmxRunner.probe()
    if cpu.details["has_amx"]:
        assert probe.details["amx_proven"] == (not ev.non_amx(shapes))
    plan = CpuAmxRunner.create(PlanRequest(device="cpu_amx"), probe=probe).plan
    assert plan.row == ("cpu_amx" if probe.details.get("amx_proven") else "cpu")


@pytest.mark.parametrize("cap", ["AVX512_CORE_BF16", "AVX2"])
def test_capping_onednn_below_amx_never_shows_amx(cap):
    ev = onednn_amx_evidence(max_cpu_isa=cap)
    assert not ev.amx_used and ev.max_cpu_isa == cap and f"ONEDNN_MAX_CPU_ISA={cap}" in ev.reason
    assert "amx" not in ev.isa.lower() and not any("amx" in k for k in ev.kernels)
    if cap == "AVX2":
        assert "AVX-512" not in ev.isa
    probe = probe_cpu_amx(evidence=ev)
    assert not probe.details.get("amx_proven")
    assert CpuAmxRunner.create(PlanRequest(device="cpu_amx"), probe=probe).plan.row == "cpu"


def test_caller_environment_passes_through_and_a_broken_interpreter_is_reported(monkeypatch):
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")
    ev = onednn_amx_evidence()
    assert not ev.amx_used and ev.max_cpu_isa == "AVX2"
    monkeypatch.setattr(cpu_probe.sys, "executable", "/nonexistent/python")
    ev = onednn_amx_evidence()
    assert not ev.amx_used and "could not start" in ev.reason


SIMULATION = r"""
import json, torch
from fastdeploy_ext.runner import get_backend_class
from fastdeploy_ext.plan import PlanRequest
cls = get_backend_class("cpu_amx")
probe = cls.probe()
plan = cls.create(PlanRequest(device="cpu_amx"), probe=probe).plan
print(json.dumps({"row": plan.row, "dtype": plan.dtype.value, "notes": plan.notes,
                  "capability": torch.backends.cpu.get_cpu_capability(), "flags": probe.details["flags"]}))
"""


def test_simulated_avx2_only_cpu_gets_the_cpu_row():
    """An AMD EPYC without AVX-512 (CI machines): its cpuinfo, oneDNN capped at AVX2 and ATen's
    kernels at AVX2, in a subprocess."""
    env = dict(os.environ, FD_CPUINFO=str(AVX2_EPYC_CPUINFO), ONEDNN_MAX_CPU_ISA="AVX2", ATEN_CPU_CAPABILITY="avx2",
               PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    out = subprocess.run([sys.executable, "-c", SIMULATION], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    host_has_avx2 = "avx2" in probe_cpu(cpuinfo_path="/proc/cpuinfo").details["flags"]
    assert got["capability"] == ("AVX2" if host_has_avx2 else "DEFAULT")      # ATen capped at (at most) AVX2
    assert "avx512f" not in got["flags"] and "avx2" in got["flags"]
    assert got["row"] == "cpu" and got["dtype"] == "float32"
    assert any("has no AMX" in n for n in got["notes"])


# ------------------------------------------------------------------------- oneDNN verbose
AMX_VERBOSE = """\
onednn_verbose,v1,info,oneDNN v3.7.1 (commit 8d263e693366ef8db40acc569cc7d8edf644556d)
onednn_verbose,v1,info,cpu,runtime:OpenMP,nthr:16
onednn_verbose,v1,info,cpu,isa:Intel AVX-512 with Intel DL Boost and bfloat16 support and Intel AMX with bfloat16 and 8-bit integer support
onednn_verbose,v1,info,gpu,runtime:none
onednn_verbose,v1,primitive,info,template:operation,engine,primitive,implementation,prop_kind,memory_descriptors,attributes,auxiliary,problem_desc,exec_time
onednn_verbose,v1,primitive,create:dispatch,matmul,cpu,matmul,brg_matmul:avx10_1_512_amx_fp16,undef,src:bf16::blocked:ab::f0 wei:bf16::blocked:ab::f0 dst:bf16::blocked:ab::f0,,,256x256:256x256,unsupported isa,src/cpu/x64/matmul/brgemm_matmul.cpp:101
onednn_verbose,v1,primitive,exec,cpu,matmul,brg_matmul:avx512_core_amx,undef,src:bf16::blocked:ab::f0 wei:bf16:a:blocked:AB16b64a2b::f0 dst:bf16::blocked:ab::f0,,,256x256:256x256,0.0410156
onednn_verbose,v1,primitive,exec,cpu,reorder,jit:uni,undef,src:bf16::blocked:abcd::f0 dst:bf16::blocked:aBcd16b::f0,attr-scratchpad:user,,1x16x32x32,0.0151367
onednn_verbose,v1,primitive,exec,cpu,convolution,brg_conv_fwd:avx512_core_amx,forward_training,src:bf16:a:blocked:acdb::f0 wei:bf16:a:blocked:AcdB16b16a2b::f0 bia:undef::undef::: dst:bf16:a:blocked:acdb::f0,attr-scratchpad:user,alg:convolution_direct,mb1_ic16oc16_ih32oh30kh3sh1dh0ph0_iw32ow30kw3sw1dw0pw0,0.0229492
onednn_verbose,v1,primitive,exec,cpu,matmul,brg_matmul:avx512_core_amx,undef,src:bf16::blocked:ab::f0 wei:bf16:a:blocked:AB16b64a2b::f0 dst:bf16::blocked:ab::f0,,,256x256:256x256,0.0209961
"""

# oneDNN 3.12 on this (AVX-512, no AMX) machine, as torch 2.13 printed it
NO_AMX_VERBOSE = """\
onednn_verbose,v1,info,oneDNN v3.12.0 (commit 80afa71049cd69a3df32adcccb623b12cd7baa22)
onednn_verbose,v1,info,cpu,runtime:OpenMP,nthr:2
onednn_verbose,v1,info,cpu,isa:Intel AVX-512 with Intel DL Boost
onednn_verbose,v1,primitive,exec,cpu,matmul,gemm:jit:bf16,undef,src:bf16::blocked:ab::f0 wei:bf16::blocked:ba::f0 dst:bf16::blocked:ab::f0,attr-scratchpad:user,,256x256:256x256,25.614
onednn_verbose,v1,primitive,exec,cpu,convolution,jit_bf16:avx512_core,forward_training,src:bf16:a:blocked:aBcd16b::f0 wei:bf16:a:blocked:ABcd8b16a2b::f0 bia:undef::undef::: dst:bf16:a:blocked:aBcd16b::f0,attr-scratchpad:user,alg:convolution_direct,mb1_ic16oc16_ih32oh30kh3sh1dh0ph0_iw32ow30kw3sw1dw0pw0,0.0869141
"""

# oneDNN 2.x format (no "v1"/"primitive" fields), DNNL_VERBOSE marker, ISA ceiling has AMX but the
# kernels executed are not AMX ones
OLD_FORMAT_VERBOSE = """\
dnnl_verbose,info,oneDNN v2.7.3 (commit 6dbeffbae1f23cbbeae17adb7b5b13f1f37c080e)
dnnl_verbose,info,cpu,isa:Intel AVX-512 with float16, Intel DL Boost and bfloat16 support and Intel AMX with bfloat16 and 8-bit integer support
dnnl_verbose,exec,cpu,inner_product,brgemm:avx512_core_bf16,forward_inference,src_bf16::blocked:ab:f0,,,mb256ic256oc256,0.05
"""


def test_parse_verbose_amx():
    ev = parse_onednn_verbose(AMX_VERBOSE)
    assert isinstance(ev, AmxEvidence) and ev.amx_used
    assert ev.isa.startswith("Intel AVX-512 with Intel DL Boost") and "Intel AMX" in ev.isa
    assert ev.kernels == ["brg_matmul:avx512_core_amx", "jit:uni", "brg_conv_fwd:avx512_core_amx"]
    assert "avx10_1_512_amx_fp16" not in " ".join(ev.kernels)     # create:dispatch lines are not executions
    assert ev.compute_primitives == 3 and ev.amx_primitives == 3
    assert "brg_matmul:avx512_core_amx" in ev.raw_excerpt and "isa:" in ev.raw_excerpt
    assert "3 of 3" in ev.reason
    json.dumps(ev.to_dict())


def test_parse_verbose_no_amx():
    ev = parse_onednn_verbose(NO_AMX_VERBOSE)
    assert not ev.amx_used and ev.isa == "Intel AVX-512 with Intel DL Boost"
    assert ev.kernels == ["gemm:jit:bf16", "jit_bf16:avx512_core"]
    assert ev.compute_primitives == 2 and ev.amx_primitives == 0
    assert "no AMX" in ev.reason


def test_parse_verbose_old_format_ceiling_is_not_evidence():
    ev = parse_onednn_verbose(OLD_FORMAT_VERBOSE)
    assert "Intel AMX" in ev.isa and not ev.amx_used
    assert ev.kernels == ["brgemm:avx512_core_bf16"]
    assert "ceiling" in ev.reason


# oneDNN 3.10 (torch 2.11+cu130) on the GPU host's 16-core Xeon (amx_tile/amx_bf16/amx_int8), as printed
H200_HOST_VERBOSE = """\
onednn_verbose,v1,info,cpu,isa:Intel AVX-512 with float16, Intel DL Boost and bfloat16 support and Intel AMX with bfloat16 and 8-bit integer support
onednn_verbose,v1,primitive,exec,cpu,matmul,brg_matmul:avx10_1_512_amx,undef,src:bf16::blocked:ab::f0 wei:bf16::blocked:ba::f0 dst:bf16::blocked:ab::f0,attr-scratchpad:user,,256x256:256x256,0.668945
onednn_verbose,v1,primitive,exec,cpu,reorder,jit:uni,undef,src:bf16::blocked:abcd::f0 dst:bf16::blocked:acdb::f0,attr-scratchpad:user,,1x16x32x32,0.0891113
onednn_verbose,v1,primitive,exec,cpu,convolution,brg_conv_fwd:avx10_1_512_amx,forward_training,src:bf16:a:blocked:acdb::f0 wei:bf16:a:blocked:AcdB16a2b::f0 bia:undef::undef::: dst:bf16:a:blocked:acdb::f0,attr-scratchpad:user,alg:convolution_direct,mb1_ic16oc16_ih32oh30kh3sh1dh0ph0_iw32ow30kw3sw1dw0pw0,0.02
"""


def test_parse_verbose_h200_host_avx10_names():
    ev = parse_onednn_verbose(H200_HOST_VERBOSE)
    assert ev.amx_used and ev.amx_primitives == ev.compute_primitives == 2
    assert ev.kernels == ["brg_matmul:avx10_1_512_amx", "jit:uni", "brg_conv_fwd:avx10_1_512_amx"]
    assert ev.isa.endswith("Intel AMX with bfloat16 and 8-bit integer support")


def test_parse_verbose_timestamps_interleaved_and_empty():
    text = ("some other output\n"
            "noise onednn_verbose,v1,1712345678.123,primitive,exec,cpu,matmul,brg_matmul:avx10_1_512_amx,undef,"
            "src:bf16::blocked:ab::f0,,,64x128:128x256,0.01\n"
            "onednn_verbose,v1,graph,exec,cpu,100002,sdp,,,,,,dnnl_backend,0.1\n")
    ev = parse_onednn_verbose(text)
    assert ev.amx_used and ev.kernels == ["brg_matmul:avx10_1_512_amx"] and ev.isa == ""
    ev = parse_onednn_verbose("")
    assert not ev.amx_used and ev.kernels == [] and "no oneDNN verbose output" in ev.reason


def test_what_the_probe_could_not_find_out_reaches_the_plans_notes(tmp_path, monkeypatch):
    fake = types.ModuleType("cpuinfo")
    fake.get_cpu_info = lambda: {"flags": ["avx2"], "brand_raw": "Fake EPYC"}
    monkeypatch.setitem(sys.modules, "cpuinfo", fake)
    probe = probe_cpu(cpuinfo_path=str(tmp_path / "missing"))
    assert len(probe.notes) == 1 and "unreadable" in probe.notes[0]
    from backends.cpu_amx import CpuRunner
    plan = CpuRunner.create(PlanRequest(device="cpu"), probe=probe).plan
    assert f"probe: {probe.notes[0]}" in plan.notes


def test_bench_gemm_reads_kernel_evidence_through_the_backend_hook():
    """bench gemm names no vendor library: it hands the backend a `run(env)` and the cpu_amx
    backend turns oneDNN's log on and parses it; a backend without the hook is said to read none."""
    from backends.cpu_amx import CpuAmxRunner
    from fastdeploy_ext.bench.gemm import kernel_evidence

    from fastdeploy_ext.torch_runner import TorchRunner
    seen = []
    runner_cls = type("Recorded", (CpuAmxRunner,), {"name": "recorded"})
    ev = runner_cls.matmul_kernel_evidence(lambda env: seen.append(env) or AMX_VERBOSE)
    assert seen == [{"ONEDNN_VERBOSE": "1", "DNNL_VERBOSE": "1"}]
    assert ev == {k: getattr(parse_onednn_verbose(AMX_VERBOSE), k) for k in
                  ("amx_used", "kernels", "isa", "reason", "compute_primitives", "amx_primitives")}
    plain = type("NoLog", (TorchRunner,), {"name": "nolog"})
    assert kernel_evidence(plain, 8, "float32", {"qkv": (4, 4)}) == {
        "amx_used": False, "reason": "the nolog backend reads no kernel log"}
