"""A vendor backend from outside this repository passes the conformance suite.

tests/oot_backend/ is a sample vendor package (fdx-acme-backend: runner hooks, SDK probe, its own
capability row as package data, an emulation mode, one entry point). These tests install it the
way a vendor's CI would — `pip install --no-deps` into a temporary target directory put on
PYTHONPATH — and run fastdeploy_ext's conformance suite against it in a subprocess. Nothing in
fastdeploy_ext/ or backends/ knows it. Runs in the matrix's cpu/oot-backend leg.
"""
from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "tests" / "oot_backend"


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> dict:
    """Environment of a process that has the vendor package installed (and emulated: no card)."""
    tmp = tmp_path_factory.mktemp("oot")
    src = shutil.copytree(PACKAGE, tmp / "src", ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__"))
    target = tmp / "site"
    # --no-deps: the framework is the one under test, already importable. The build uses this
    # environment's setuptools when it has one (no index needed); a Python without setuptools
    # (3.12+ venvs) lets pip fetch it into an isolated build environment, as `pip install -e .` does.
    isolation = [] if importlib.util.find_spec("setuptools") is None else ["--no-build-isolation"]
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", *isolation,
                    "--disable-pip-version-check", "--target", str(target), str(src)], check=True)
    assert (target / "fdx_acme" / "capabilities.yaml").is_file(), "the row must ship as package data"
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(target), str(ROOT)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    return env


def run(env, *args, **kw):
    return subprocess.run([sys.executable, *args], env=env, cwd=ROOT, capture_output=True, text=True, **kw)


def test_the_framework_does_not_know_the_vendor():
    hits = [str(p.relative_to(ROOT)) for d in ("fastdeploy_ext", "backends") for p in (ROOT / d).rglob("*")
            if p.is_file() and p.suffix in (".py", ".yaml", ".json", ".txt") and "acme" in p.read_text(errors="ignore").lower()]
    assert hits == []
    # and without the install, there is no such backend
    r = run(dict(os.environ, PYTHONPATH=str(ROOT)), "-m", "fastdeploy_ext.entrypoints.cli", "info", "--device", "acme")
    assert r.returncode == 2 and "unknown device/backend 'acme'" in r.stderr


def test_entry_point_registers_the_backend_and_its_own_row(installed):
    env = dict(installed, FD_EMULATE="acme")
    r = run(env, "-m", "fastdeploy_ext.entrypoints.cli", "info", "--device", "acme")
    assert r.returncode == 0, r.stderr
    out = r.stdout + r.stderr
    assert "plan: runner=acme row=acme_n1 device=cpu [EMULATED]" in out
    assert "row from fdx_acme/capabilities.yaml" in out
    # the vendor's own kernel (contributed by AcmeRunner.kernel_backends) is the one chosen
    r = run(env, "-m", "fastdeploy_ext.entrypoints.cli", "info", "--device", "acme", "--json")
    assert r.returncode == 0, r.stderr
    plan = json.loads(r.stdout)["plan"]
    assert plan["attention"] == {"value": "acme_sdpa", "reason": "first usable in row acme_n1 preference order"}
    assert plan["qkv_layout"]["value"] == "dense" and "acme_sdpa does not read strided q/k/v" in plan["qkv_layout"]["reason"]
    assert {c["component"]: c["backend"] for c in plan["component_kernels"]} == {
        "vision.attention": "acme_sdpa", "text.attention": "sdpa_paged"}
    # without the emulation the probe says, in words, that no card is there
    r = run(installed, "-m", "fastdeploy_ext.entrypoints.cli", "info", "--device", "acme")
    assert r.returncode == 2 and "acme_smi not importable" in r.stderr


def test_the_vendor_backend_passes_the_conformance_suite(installed, tmp_path):
    junit = tmp_path / "acme.xml"
    r = run(installed, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--pyargs", "fastdeploy_ext.conformance",
            "--fdx-backend", "acme", f"--junitxml={junit}", timeout=900)
    print(r.stdout[-3000:])
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-2000:]
    suite = ET.parse(junit).getroot()
    suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
    counts = {k: int(suite.get(k)) for k in ("tests", "failures", "errors", "skipped")}
    assert counts["failures"] == counts["errors"] == counts["skipped"] == 0 and counts["tests"] >= 20, counts
    # the parity checks against transformers passed with the vendor's own kernel chosen
    parity = [{p.get("name"): p.get("value") for p in case.iter("property")} for case in suite.iter("testcase")
              if case.get("name", "").startswith("test_encode_matches_transformers")]
    assert parity and all(p["attention_backend"] == "acme_sdpa" for p in parity), parity
    assert "backend=acme" in r.stdout and "row=acme_n1" in r.stdout and "EMULATED" in r.stdout
