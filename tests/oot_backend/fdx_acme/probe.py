"""The Acme SDK probe: is an N1 here, and what is it. Never raises (a probe answers, in words).

The SDK binding `acme_smi` ships with the Acme driver, not on PyPI, so it is imported lazily,
when the probe runs. Its calls: `init()`, `device_count() -> int`, `device_name(i) -> str`,
`memory_total(i) -> bytes`, `driver_version() -> str`, `shutdown()`. A binding that sets
`EMULATED = True` (fake_smi.py, installed by AcmeRunner.emulation()) marks the result emulated.
"""
# ruff: noqa: BLE001  (whatever the vendor library raises, the probe answers)
from __future__ import annotations

import importlib
import re

from fastdeploy_ext.platforms import DeviceInfo, ProbeResult


def family(name: str) -> str:
    """'Acme N1' -> 'acme_n1'."""
    return re.sub(r"[^a-z0-9]+", "_", name.lower()).strip("_")


def probe_acme(smi=None) -> ProbeResult:
    if smi is None:
        try:
            smi = importlib.import_module("acme_smi")
        except ImportError as e:
            return ProbeResult("acme", False, False, f"acme_smi not importable (Acme driver not installed): {e}")
    emulated = bool(getattr(smi, "EMULATED", False))
    try:
        smi.init()
        try:
            devices = tuple(DeviceInfo(i, smi.device_name(i), smi.memory_total(i), None, family(smi.device_name(i)))
                            for i in range(smi.device_count()))
            driver = smi.driver_version()
        finally:
            smi.shutdown()
    except Exception as e:
        return ProbeResult("acme", False, False, f"acme_smi failed: {type(e).__name__}: {e}", emulated=emulated)
    if not devices:
        return ProbeResult("acme", False, False, "acme_smi sees no device", driver_version=driver, emulated=emulated)
    tag = " (emulated: fake acme_smi, no card)" if emulated else ""
    reason = f"{len(devices)} Acme device(s): " + ", ".join(d.describe() for d in devices) + tag
    return ProbeResult("acme", True, True, reason, devices, driver, emulated=emulated)
