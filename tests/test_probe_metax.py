"""The MetaX probe (backends/metax/probe.py) against fakes that mirror MetaX's published pymxsml
binding in both APIs (mxsml, in its raw ctypes and wrapper conventions, and mxsml_extension), the
emulation hook, and `info --device metax` under FD_EMULATE."""
from __future__ import annotations

import ctypes
import json
import sys
import types

import pytest

from backends.metax import MetaxRunner
from backends.metax import fake_pymxsml as fake
from backends.metax.probe import metax_family, probe_metax
from fastdeploy_ext.entrypoints.cli import main
from fastdeploy_ext.platforms import DeviceInfo

GiB = 1024 ** 3
C500 = DeviceInfo(0, "MetaX C500", 64 * GiB, None, "metax_c500")


def fake_torch(cuda_available: bool):
    cuda = types.SimpleNamespace(is_available=lambda: cuda_available, device_count=lambda: 1)
    return types.SimpleNamespace(__version__="2.13.0+fake", version=types.SimpleNamespace(cuda=None), cuda=cuda)


def real(module):
    """The same fake without the emulation marker: what a real binding looks like to the probe."""
    del module.__fdx_emulated__
    return module


# ------------------------------------------------------------------- the fakes mirror the binding
def test_raw_fake_has_the_published_out_parameter_signatures():
    mx = fake.make_mxsml(convention="raw")
    with pytest.raises(TypeError):
        mx.mxSmlGetMacaVersion()                       # the version query takes a buffer and its size
    buf, size = ctypes.create_string_buffer(64), ctypes.c_uint(64)
    assert mx.mxSmlGetMacaVersion(buf, ctypes.byref(size)) == 0 and buf.value.startswith(b"2.32")
    small, n = ctypes.create_string_buffer(4), ctypes.c_uint(4)
    assert mx.mxSmlGetMacaVersion(small, ctypes.byref(n)) == fake.MXSML_ERROR_INSUFFICIENT_SIZE
    info = mx.MxSmlDeviceInfo()
    assert mx.mxSmlGetDeviceInfo(0, ctypes.byref(info)) == 0 and info.deviceName == b"MetaX C500"
    assert mx.mxSmlGetDeviceInfo(5, ctypes.byref(info)) == fake.MXSML_ERROR_INVALID_DEVICE_ID
    with pytest.raises(TypeError):
        mx.mxSmlGetMemoryInfo(0, ctypes.byref(info))    # wrong structure: refused as ctypes would


def test_wrapper_and_extension_fakes_raise_their_binding_errors():
    mx = fake.make_mxsml(convention="wrapper", init_status=fake.MXSML_ERROR_LOAD_DLL_FAILURE)
    with pytest.raises(mx.MXSMLError, match="Load dll failure"):
        mx.mxSmlInit()
    ex = fake.make_mxsml_extension()
    with pytest.raises(ex.MXSMLEXError):
        ex.mxSmlExDeviceGetCount()                     # before mxSmlExInit: uninitialised


# ------------------------------------------------------------------------- the probe, each API
@pytest.mark.parametrize("api", ["raw", "wrapper", "extension"])
def test_each_api_flavour_reads_the_card(api):
    kwargs = ({"ex_module": fake.make_mxsml_extension()} if api == "extension"
              else {"mxsml_module": fake.make_mxsml(convention=api)})
    r = probe_metax(**kwargs)
    assert r.kind == "metax" and r.present and r.usable and r.emulated
    assert r.devices == (C500,)
    assert r.details["mxsml_api"] == {"raw": "mxsml (raw ctypes)", "wrapper": "mxsml",
                                      "extension": "mxsml_extension"}[api]
    assert r.driver_version == ("2.14.6 (EMULATED)" if api == "extension" else "2.32.0.6 (EMULATED)")
    assert "(EMULATED)" in r.reason and "(EMULATED)" in r.summary()
    json.dumps(r.to_dict())


def test_two_cards_bytes_names_and_a_card_torch_cannot_reach():
    cards = (fake.FakeCard("MetaX C500"), fake.FakeCard("MetaX C550-PCIe", 32 * 1024 * 1024))
    mx = real(fake.make_mxsml(cards, convention="raw"))
    r = probe_metax(mxsml_module=mx, torch_module=fake_torch(False))
    assert r.present and not r.usable and not r.emulated and "cannot reach" in r.reason
    assert [(d.name, d.family, d.total_memory_bytes) for d in r.devices] == [
        ("MetaX C500", "metax_c500", 64 * GiB), ("MetaX C550-PCIe", "metax_c550_pcie", 32 * GiB)]
    r = probe_metax(mxsml_module=mx, torch_module=fake_torch(True))
    assert r.usable and not r.emulated and "MACA build" in r.reason
    assert probe_metax(mxsml_module=mx, emulate=True).emulated


def test_raw_status_codes_are_named_and_version_failures_are_notes():
    mx = real(fake.make_mxsml(convention="raw", init_status=fake.MXSML_ERROR_NO_DEVICE))
    r = probe_metax(mxsml_module=mx)
    assert not r.present and "mxSmlInit returned status 2 (No device)" in r.reason
    mx = real(fake.make_mxsml(convention="raw", maca_version="x" * 80))     # longer than the 64-byte buffer
    r = probe_metax(mxsml_module=mx, torch_module=fake_torch(True))
    assert r.present and r.driver_version is None
    assert "MACA version unknown" in r.reason and "status 10 (Insufficient size)" in r.reason
    assert len(r.notes) == 1 and r.notes[0].startswith("MACA version unknown")


def test_a_failing_api_falls_back_to_the_other_and_both_failing_names_both():
    broken_mx = fake.make_mxsml(convention="wrapper", init_status=fake.MXSML_ERROR_LOAD_DLL_FAILURE)
    r = probe_metax(mxsml_module=broken_mx, ex_module=fake.make_mxsml_extension())
    assert r.present and r.details["mxsml_api"] == "mxsml_extension" and "Load dll failure" in r.reason
    broken_ex = fake.make_mxsml_extension(init_error=fake.MXSMLEX_ERROR_DRIVER_NOT_LOADED)
    r = probe_metax(mxsml_module=fake.make_mxsml(), ex_module=broken_ex)
    assert r.present and r.details["mxsml_api"] == "mxsml (raw ctypes)"      # mxsml answers first
    r = probe_metax(mxsml_module=broken_mx, ex_module=broken_ex)
    assert not r.present and "mxSmlInit failed" in r.reason and "MXSMLEXError: Driver Not Loaded" in r.reason


def test_broken_and_empty_modules_never_raise():
    r = probe_metax(mxsml_module=types.SimpleNamespace(mxSmlInit=lambda: None))
    assert not r.present and "mxSmlGetDeviceCount" in r.reason

    def boom():
        raise RuntimeError("mxsml: driver not loaded")
    r = probe_metax(mxsml_module=types.SimpleNamespace(mxSmlInit=boom))
    assert not r.present and "driver not loaded" in r.reason
    r = probe_metax(ex_module=fake.make_mxsml_extension(cards=()))
    assert not r.present and "reports no MetaX card" in r.reason


def test_pymxsml_missing_is_reported(monkeypatch):
    monkeypatch.setitem(sys.modules, "pymxsml", None)
    monkeypatch.setitem(sys.modules, "pymxsml.mxsml_extension", None)
    r = probe_metax()
    assert not r.present and not r.emulated and "not importable" in r.reason and "MACA SDK" in r.reason


def test_real_metax_probe_here_answers():
    r = MetaxRunner.probe()
    assert r.kind == "metax" and r.reason
    if "pymxsml" not in sys.modules:          # this machine: no MACA SDK
        assert not r.present and "not importable" in r.reason


@pytest.mark.parametrize("name,family", [("MetaX C500", "metax_c500"), ("MetaX  C550-PCIe", "metax_c550_pcie"),
                                         ("X201", "metax_x201"), ("", "metax")])
def test_metax_family(name, family):
    assert metax_family(name) == family


# -------------------------------------------------------------------------------- emulation hook
def test_emulation_installs_the_fakes_and_restores_sys_modules():
    before = sys.modules.get("pymxsml")
    with MetaxRunner.emulation():
        assert sys.modules["pymxsml"].mxsml_extension is sys.modules["pymxsml.mxsml_extension"]
        r = MetaxRunner.probe()                        # the lazy import finds the fake package
        assert r.present and r.emulated and r.devices == (C500,)
    assert sys.modules.get("pymxsml") is before
    assert not MetaxRunner.probe().emulated


def test_info_device_metax_shows_the_emulated_plan_under_FD_EMULATE(monkeypatch, capsys):
    assert main(["info", "--device", "metax"]) == 2          # no card, no emulation: a clear error
    assert "device not present" in capsys.readouterr().err
    monkeypatch.setenv("FD_EMULATE", "metax")
    assert main(["info", "--device", "metax"]) == 0
    out = capsys.readouterr().out
    assert "plan: runner=metax row=metax_c500" in out and "[EMULATED]" in out
    assert "metax: present, usable (EMULATED)" in out
    assert "pymxsml" not in sys.modules or not getattr(sys.modules["pymxsml"], "__fdx_emulated__", False)


def test_FD_EMULATE_names_a_backend_without_emulation(monkeypatch, capsys):
    monkeypatch.setenv("FD_EMULATE", "cpu")
    assert main(["info", "--device", "cpu"]) == 2
    assert "offers no emulation mode" in capsys.readouterr().err
