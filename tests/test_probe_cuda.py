"""The NVIDIA probe (backends/cuda/probe.py) against a fake pynvml, and the real one here (which
must answer, never raise)."""
from __future__ import annotations

import json
import sys
import types

import pytest

from backends.cuda.probe import probe_nvidia
from fastdeploy_ext.platforms import DeviceInfo, ProbeResult


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
    assert r.notes == ("GPU 0 compute capability unknown (FakeNVMLError: Not Supported)",)
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


def test_metax_nvml_shim_devices_are_left_to_the_metax_probe():
    r = probe_nvidia(nvml_module=FakeNVML(n=1, name="MetaX C500"), torch_module=fake_torch(True))
    assert not r.present and "MetaX NVML shim" in r.reason


def test_nvml_utilization_reader_for_benchmarks():
    from backends.cuda.probe import nvml_utilization_reader
    nvml = FakeNVML(n=1)
    nvml.nvmlDeviceGetUtilizationRates = lambda h: types.SimpleNamespace(gpu=87 if h == ("handle", 0) else -1, memory=3)
    read = nvml_utilization_reader(0, nvml_module=nvml)
    assert read() == 87 and nvml.calls == ["init"]
    assert nvml_utilization_reader(0, nvml_module=FakeNVML(init_error=FakeNVMLError("Driver Not Loaded"))) is None
    from fastdeploy_ext.bench.generate import GpuBusySampler
    with GpuBusySampler(read, period_s=0.001) as s:
        while not s.samples:
            pass
    assert s.busy_pct == 87
    with GpuBusySampler(None) as s:
        pass
    assert s.busy_pct is None
