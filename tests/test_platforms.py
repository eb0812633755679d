"""The framework's probe types and never-raise helpers (fastdeploy_ext/platforms.py), the layout
rule that the framework names no vendor SDK and imports no backend (each vendor's probe lives in
backends/<vendor>/probe.py: tests/test_probe_cuda.py, test_probe_metax.py, test_probe_cpu_amx.py),
and every registered backend's real probe on this machine (it must answer, never raise)."""
from __future__ import annotations

import ast
import dataclasses
import json
import re
import types
from pathlib import Path

import pytest

import backends.cpu_amx.probe
import backends.cuda.probe
import backends.metax.probe
from fastdeploy_ext import platforms
from backends.torch_cuda import torch_cuda_view
from fastdeploy_ext.platforms import DeviceInfo, ProbeResult, c_text, error_text, never_raises, slug
from fastdeploy_ext.runner import available_backends

ROOT = Path(__file__).resolve().parents[1]
FRAMEWORK = ROOT / "fastdeploy_ext"

# Python bindings of vendor management/driver SDKs (NVIDIA NVML, MetaX MXSML, and their pip names)
VENDOR_SDK = re.compile(r"pynvml|nvidia[-_]ml[-_]py|\bnvml|pymxsml|mxsml|mxSml", re.IGNORECASE)


def vendor_sdk_mentions(text: str) -> list[str]:
    return sorted({m.group(0) for m in VENDOR_SDK.finditer(text)})


def backend_imports(source: str) -> list[str]:
    """Imports of the top-level ``backends`` package (absolute, or importlib with a literal)."""
    out = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            out += [a.name for a in node.names if a.name == "backends" or a.name.startswith("backends.")]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module and (
                node.module == "backends" or node.module.startswith("backends.")):
            out.append(node.module)
        elif (isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", "")) ==
              "import_module" and node.args and isinstance(node.args[0], ast.Constant)
              and str(node.args[0].value).split(".")[0] == "backends"):
            out.append(str(node.args[0].value))
    return out


def test_the_layout_checks_fire_on_what_they_look_for():
    assert vendor_sdk_mentions("import pynvml\nx = pymxsml.mxSmlInit()") == ["mxSml", "pymxsml", "pynvml"]
    assert vendor_sdk_mentions("nvmlDeviceGetCount, nvidia-ml-py") == ["nvidia-ml-py", "nvml"]
    assert vendor_sdk_mentions("a CUDA-style device; MetaX MACA; oneDNN") == []
    src = "import backends.cuda\nfrom backends.metax import probe\nimportlib.import_module('backends.cpu_amx')\n"
    assert backend_imports(src) == ["backends.cuda", "backends.metax", "backends.cpu_amx"]
    assert backend_imports("from .runner import x\nimport fastdeploy_ext.backends_table\n") == []


def test_the_framework_names_no_vendor_sdk_and_imports_no_backend():
    files = [p for p in FRAMEWORK.rglob("*") if p.suffix in (".py", ".yaml", ".yml", ".txt") and p.is_file()]
    assert len(files) > 30
    sdk = {str(p.relative_to(ROOT)): vendor_sdk_mentions(p.read_text()) for p in files}
    assert {k: v for k, v in sdk.items() if v} == {}
    imports = {str(p.relative_to(ROOT)): backend_imports(p.read_text()) for p in files if p.suffix == ".py"}
    assert {k: v for k, v in imports.items() if v} == {}


def test_each_vendor_probe_lives_with_its_backend():
    assert "probe_nvidia" in vars(backends.cuda.probe) and "pynvml" in Path(backends.cuda.probe.__file__).read_text()
    assert "probe_metax" in vars(backends.metax.probe)
    assert "pymxsml" in Path(backends.metax.probe.__file__).read_text()
    assert "onednn_amx_evidence" in vars(backends.cpu_amx.probe)
    for name in ("probe_nvidia", "probe_metax", "probe_cpu", "onednn_amx_evidence", "AmxEvidence"):
        assert not hasattr(platforms, name), name
    # no backend imports another (the MetaX runner no longer borrows the CUDA runner's helpers);
    # torch's view of CUDA-style devices, which NVIDIA's and MetaX's torch builds share, is no vendor's
    for vendor in ("cuda", "metax", "cpu_amx"):
        for p in (ROOT / "backends" / vendor).glob("*.py"):
            others = [m for m in backend_imports(p.read_text())
                      if not m.startswith(f"backends.{vendor}") and m != "backends.torch_cuda"]
            relative_escape = re.findall(r"^from \.\.\w", p.read_text(), re.M)
            assert not others and not relative_escape, (p, others, relative_escape)


# --------------------------------------------------------------------------------- the types
def test_probe_result_summary_and_json():
    dev = DeviceInfo(0, "Acme A1", 8 * platforms.GiB, (1, 2), "acme_a1")
    assert dev.describe() == "#0 Acme A1 [acme_a1, cc 1.2, 8 GiB]"
    r = ProbeResult("acme", True, False, "driver too old", (dev,), "1.0", {"seen": {"b", "a"}, "obj": object()})
    assert r.summary() == "acme: present, NOT usable — driver too old"
    d = json.loads(json.dumps(r.to_dict()))
    assert d["details"]["seen"] == ["a", "b"] and d["devices"][0]["compute_capability"] == [1, 2]
    e = ProbeResult("acme", True, True, "fake SDK", emulated=True)
    assert e.summary() == "acme: present, usable (EMULATED) — fake SDK"
    assert ProbeResult("acme", False, False, "no driver").summary() == "acme: not present — no driver"


def test_helpers():
    assert c_text(b"MetaX C500\0\0garbage") == "MetaX C500" and c_text("  X201 ") == "X201"
    assert error_text(RuntimeError("boom")) == "RuntimeError: boom" and error_text(KeyError()) == "KeyError"
    assert slug("MetaX  C550-PCIe") == "metax_c550_pcie"
    view = torch_cuda_view(types.SimpleNamespace(__version__="9", version=types.SimpleNamespace(cuda="13.0"),
                                                 cuda=types.SimpleNamespace(is_available=lambda: 1 / 0)))
    assert view["torch_cuda_available"] is False and "ZeroDivisionError" in view["torch_error"]


def test_never_raises_turns_an_exception_into_a_reason():
    @never_raises("acme")
    def probe():
        raise OSError("libacme.so: cannot open shared object file")
    r = probe()
    assert r.kind == "acme" and not r.present and not r.usable
    assert "acme probe failed unexpectedly: OSError: libacme.so" in r.reason


@pytest.mark.parametrize("module", [platforms, backends.cuda.probe, backends.metax.probe, backends.cpu_amx.probe])
def test_no_module_level_mutable_state(module):
    for name, value in vars(module).items():
        if name.startswith("__") or isinstance(value, (types.ModuleType, types.FunctionType, type)):
            continue
        assert not isinstance(value, (list, dict, set)) or dataclasses.is_dataclass(value), name


# ----------------------------------------------------------------- real probes on this machine
def test_every_registered_backend_probe_answers_here():
    seen = {}
    for name, cls in sorted(available_backends().items()):
        r = cls.probe()
        assert isinstance(r, ProbeResult) and r.reason, name
        json.dumps(r.to_dict())
        if not r.present:
            assert not r.usable, name
        seen[name] = r
    assert seen["cpu"].present and seen["cpu_amx"].present and seen["cpu"].kind == "cpu"
