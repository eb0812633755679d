"""Device probes: fakes for pynvml / pymxsml / cpuinfo, the real probes on this machine (which
must answer, never raise), and the oneDNN verbose parser behind the AMX evidence."""
from __future__ import annotations

import json
import sys
import types

import pytest

from fastdeploy_ext import platforms
from fastdeploy_ext.platforms import (
    AmxEvidence,
    DeviceInfo,
    ProbeResult,
    metax_family,
    onednn_amx_evidence,
    parse_cpuinfo,
    parse_onednn_verbose,
    probe_all,
    probe_cpu,
    probe_metax,
    probe_nvidia,
)

GiB = 1024 ** 3


# ---------------------------------------------------------------------------------- fakes
class FakeNVMLError(Exception):
    pass


class FakeNVML:
    """The pynvml calls probe_nvidia makes. Names as bytes (old pynvml) or str (nvidia-ml-py)."""

    def __init__(self, n=2, name=b"NVIDIA H200", total=143771 * 1024 ** 2, cc=(9, 0), init_error=None):
        self.n, self.name, self.total, self.cc, self.init_error = n, name, total, cc, init_error
        self.calls: list[str] = []

    def nvmlInit(self):
        self.calls.append("init")
        if self.init_error:
            raise self.init_error

    def nvmlShutdown(self):
        self.calls.append("shutdown")

    def nvmlSystemGetDriverVersion(self):
        return b"580.159.04" if isinstance(self.name, bytes) else "580.159.04"

    def nvmlDeviceGetCount(self):
        return self.n

    def nvmlDeviceGetHandleByIndex(self, i):
        assert 0 <= i < self.n
        return ("handle", i)

    def nvmlDeviceGetName(self, h):
        return self.name

    def nvmlDeviceGetMemoryInfo(self, h):
        return types.SimpleNamespace(total=self.total, used=0, free=self.total)

    def nvmlDeviceGetCudaComputeCapability(self, h):
        return self.cc


def fake_torch(cuda_available: bool, cuda_version="13.0", count=2):
    cuda = types.SimpleNamespace(is_available=lambda: cuda_available, device_count=lambda: count)
    return types.SimpleNamespace(__version__="2.13.0+fake", version=types.SimpleNamespace(cuda=cuda_version),
                                 cuda=cuda)


def make_fake_pymxsml(name="MetaX C500", vram_kib=64 * 1024 * 1024, n=1, emulated=True, init_status=None):
    """A fake pymxsml implementing exactly the calls documented in platforms' docstring
    (the optional ones, mxSmlGetMacaVersion / mxSmlShutdown, are left out on purpose)."""
    m = types.ModuleType("pymxsml")
    if emulated:
        m.__fdx_emulated__ = True
    m.mxSmlInit = lambda: init_status
    m.mxSmlGetDeviceCount = lambda: n
    m.mxSmlGetDeviceInfo = lambda i: types.SimpleNamespace(deviceName=name, bdfId=f"0000:{i:02x}:00.0")
    m.mxSmlGetMemoryInfo = lambda i: types.SimpleNamespace(vramTotal=vram_kib, vramUse=0)
    return m


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


# --------------------------------------------------------------------------------- NVIDIA
@pytest.mark.parametrize("name", [b"NVIDIA H200", "NVIDIA H200"])
def test_fake_nvml_two_h200(name):
    nvml = FakeNVML(name=name)
    r = probe_nvidia(nvml_module=nvml, torch_module=fake_torch(True))
    assert r.kind == "cuda" and r.present and r.usable
    assert len(r.devices) == 2
    for i, d in enumerate(r.devices):
        assert d == DeviceInfo(i, "NVIDIA H200", 143771 * 1024 ** 2, (9, 0), "cuda_sm90")
    assert r.driver_version == "580.159.04"
    assert "H200" in r.reason and "cuda_sm90" in r.summary()
    assert nvml.calls == ["init", "shutdown"]
    json.dumps(r.to_dict())


def test_fake_nvml_but_torch_cannot_use_cuda():
    r = probe_nvidia(nvml_module=FakeNVML(cc=(8, 0), name="NVIDIA A100"),
                     torch_module=fake_torch(False, cuda_version=None))
    assert r.present and not r.usable
    assert r.devices[0].family == "cuda_sm80"
    assert "cannot use CUDA" in r.reason and "NOT usable" in r.summary()


def test_fake_nvml_with_real_torch_here():
    r = probe_nvidia(nvml_module=FakeNVML())
    assert r.present
    import torch
    assert r.usable == torch.cuda.is_available()


def test_nvml_init_failure_is_reported_not_raised():
    nvml = FakeNVML(init_error=FakeNVMLError("Driver Not Loaded"))
    r = probe_nvidia(nvml_module=nvml)
    assert not r.present and not r.usable and r.devices == ()
    assert "Driver Not Loaded" in r.reason and "FakeNVMLError" in r.reason


def test_nvml_zero_gpus_and_partial_failures():
    r = probe_nvidia(nvml_module=FakeNVML(n=0), torch_module=fake_torch(False))
    assert not r.present and "no NVIDIA GPU" in r.reason

    nvml = FakeNVML(n=1)
    nvml.nvmlDeviceGetCudaComputeCapability = lambda h: (_ for _ in ()).throw(FakeNVMLError("Not Supported"))
    r = probe_nvidia(nvml_module=nvml, torch_module=fake_torch(True))
    assert r.present and r.devices[0].compute_capability is None and r.devices[0].family == "cuda"
    assert "Not Supported" in r.reason
    assert nvml.calls[-1] == "shutdown"


def test_pynvml_missing(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", None)
    r = probe_nvidia()
    assert not r.present and "pynvml not importable" in r.reason


def test_real_nvidia_probe_here_answers():
    r = probe_nvidia()
    assert isinstance(r, ProbeResult) and r.kind == "cuda" and r.reason
    if not r.present:      # this machine: no driver
        assert not r.usable and r.devices == ()
    json.dumps(r.to_dict())


# ---------------------------------------------------------------------------------- MetaX
def test_fake_pymxsml_c500_emulated(monkeypatch):
    monkeypatch.setitem(sys.modules, "pymxsml", make_fake_pymxsml())
    r = probe_metax()                       # lazy import finds the fake
    assert r.kind == "metax" and r.present and r.usable and r.emulated
    assert r.devices == (DeviceInfo(0, "MetaX C500", 64 * GiB, None, "metax_c500"),)
    assert "(emulated)" in r.reason and "(emulated)" in r.summary()
    json.dumps(r.to_dict())


def test_conformance_fake_pymxsml_if_present(monkeypatch):
    fake = pytest.importorskip("fastdeploy_ext.conformance.fake_pymxsml")
    if not hasattr(fake, "mxSmlInit"):
        pytest.skip("conformance fake_pymxsml not written yet")
    monkeypatch.setitem(sys.modules, "pymxsml", fake)
    r = probe_metax()
    assert r.present and r.emulated and r.devices[0].family == "metax_c500"


def test_pymxsml_injected_not_emulated_and_emulate_flag():
    mx = make_fake_pymxsml(emulated=False, n=2, name=b"MetaX C500\0\0")
    r = probe_metax(mxsml_module=mx, torch_module=fake_torch(False))
    assert r.present and not r.emulated and not r.usable      # a "real" card torch cannot reach
    assert [d.name for d in r.devices] == ["MetaX C500", "MetaX C500"]
    assert "cannot reach" in r.reason
    r = probe_metax(mxsml_module=mx, torch_module=fake_torch(True))
    assert r.usable and not r.emulated
    r = probe_metax(mxsml_module=mx, emulate=True)
    assert r.emulated and "(emulated)" in r.summary()


def test_pymxsml_missing(monkeypatch):
    monkeypatch.setitem(sys.modules, "pymxsml", None)
    r = probe_metax()
    assert not r.present and not r.usable and not r.emulated
    assert "pymxsml not importable" in r.reason and "MACA SDK" in r.reason


def test_pymxsml_init_failure_and_broken_module():
    r = probe_metax(mxsml_module=make_fake_pymxsml(init_status=7))
    assert not r.present and "status 7" in r.reason and "(emulated)" in r.reason
    broken = types.SimpleNamespace(mxSmlInit=lambda: None)          # no device-count call at all
    r = probe_metax(mxsml_module=broken)
    assert not r.present and "mxSmlGetDeviceCount" in r.reason

    def boom():
        raise RuntimeError("mxsml: driver not loaded")
    r = probe_metax(mxsml_module=types.SimpleNamespace(mxSmlInit=boom))
    assert not r.present and "driver not loaded" in r.reason


def test_pymxsml_optional_calls_and_tuple_returns():
    mx = make_fake_pymxsml(emulated=False)
    mx.mxSmlGetDeviceInfo = lambda i: (0, types.SimpleNamespace(deviceName="X201"))   # raw (status, value)
    del mx.mxSmlGetMemoryInfo
    mx.mxSmlGetMacaVersion = lambda: b"3.3.0.4"
    shut = []
    mx.mxSmlShutdown = lambda: shut.append(1)
    r = probe_metax(mxsml_module=mx, torch_module=fake_torch(False))
    assert r.present and r.devices[0].family == "metax_x201" and r.devices[0].total_memory_bytes is None
    assert r.driver_version == "3.3.0.4" and shut == [1]


@pytest.mark.parametrize("name,family", [("MetaX C500", "metax_c500"), ("MetaX  C550-PCIe", "metax_c550_pcie"),
                                         ("X201", "metax_x201"), ("", "metax")])
def test_metax_family(name, family):
    assert metax_family(name) == family


# ------------------------------------------------------------------------------------ CPU
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


# ---------------------------------------------------------------------------------- probe_all
def test_probe_all_keys_and_injected_fakes_are_seen(monkeypatch):
    res = probe_all()
    assert set(res) == {"cuda", "metax", "cpu"}
    assert all(isinstance(v, ProbeResult) and v.kind == k and v.reason for k, v in res.items())
    monkeypatch.setitem(sys.modules, "pymxsml", make_fake_pymxsml())
    assert probe_all()["metax"].emulated            # nothing cached between calls


def test_no_module_level_mutable_state():
    import dataclasses
    for name, value in vars(platforms).items():
        if name.startswith("__") or isinstance(value, (types.ModuleType, types.FunctionType, type)):
            continue
        assert not isinstance(value, (list, dict, set)) or dataclasses.is_dataclass(value), name


# ----------------------------------------------------------------------------- oneDNN verbose
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


def test_onednn_amx_evidence_real_subprocess():
    import torch
    cpu = probe_cpu()
    ev = onednn_amx_evidence(timeout_s=120)
    assert isinstance(ev, AmxEvidence) and ev.reason
    if torch.backends.mkldnn.is_available():
        assert ev.isa and ev.kernels and ev.compute_primitives >= 3, ev.reason
    if not cpu.details["has_amx"]:
        assert not ev.amx_used             # this machine: no AMX
        assert "amx" not in ev.isa.lower()


def test_onednn_amx_evidence_isa_cap_and_failures(monkeypatch):
    # capped below AMX: even an AMX machine must then report no AMX kernels
    ev = onednn_amx_evidence(max_cpu_isa="AVX512_CORE")
    assert not ev.amx_used and ev.max_cpu_isa == "AVX512_CORE" and "ONEDNN_MAX_CPU_ISA=AVX512_CORE" in ev.reason
    assert "amx" not in ev.isa.lower() and not any("amx" in k for k in ev.kernels)
    # the caller's environment passes through
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")
    ev = onednn_amx_evidence()
    assert not ev.amx_used and ev.max_cpu_isa == "AVX2" and "AVX-512" not in ev.isa
    # a broken interpreter: reported, never raised
    monkeypatch.setattr(platforms.sys, "executable", "/nonexistent/python")
    ev = onednn_amx_evidence()
    assert not ev.amx_used and "could not start" in ev.reason
