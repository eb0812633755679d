"""MetaX MACA cards through MetaX's Python binding ``pymxsml`` (ships with the MACA SDK, e.g.
/opt/maca/share/mxsml; not on PyPI), imported lazily and optional. Never raises.

``probe_metax(mxsml_module=None, ex_module=None, *, emulate=False, torch_module=None)`` reads the
cards through whichever of MetaX's two APIs works, in this order (both modules are imported
lazily when not injected; an injected module is the only one used):

1. **mxsml** (``import pymxsml``), in either of the calling conventions MetaX has published:

   * the SDK's raw ctypes module: every call returns an ``mxSmlReturn`` status (0 = success) and
     fills out-parameters — ``mxSmlInit()``, ``mxSmlGetMacaVersion(buf, byref(size))`` (a char
     buffer and its size, 64 bytes), ``mxSmlGetDeviceCount()`` -> count,
     ``mxSmlGetDeviceInfo(id, byref(MxSmlDeviceInfo()))`` (``deviceName``: char[32]),
     ``mxSmlGetMemoryInfo(id, byref(MxSmlMemoryInfo()))`` (``vramTotal`` in KiB),
     ``mxSmlGetErrorString(status)`` -> bytes. Recognised by its ``MxSmlDeviceInfo`` structure.
   * the packaged wrapper (``pymxsml/mxsml.py``): calls raise ``MXSMLError`` and return values —
     ``mxSmlInit()``, ``mxSmlGetMacaVersion()`` -> str, ``mxSmlGetDeviceCount()`` -> int,
     ``mxSmlGetDeviceInfo(id)`` / ``mxSmlGetMemoryInfo(id)`` -> structures as above.

   ``mxSmlGetPfDeviceCount()`` is used when ``mxSmlGetDeviceCount`` is missing. There is no
   shutdown call in this API.
2. **mxsml_extension** (``import pymxsml.mxsml_extension``, NVML-like): ``mxSmlExInit()``,
   ``mxSmlExSystemGetDriverVersion()`` -> str, ``mxSmlExDeviceGetCount()`` -> int,
   ``mxSmlExDeviceGetHandleByIndex(i)`` -> handle, ``mxSmlExDeviceGetName(handle)`` -> str,
   ``mxSmlExDeviceGetMemoryInfo(handle).total`` (bytes), ``mxSmlExShutdown()``; failures raise
   ``MXSMLEXError``.

When the first API fails (init error, no library) the second is tried; the reason names both.
``details["mxsml_api"]`` says which one answered. Family: ``metax_<name>`` ("MetaX C500" ->
``metax_c500``; a bare "X201" -> ``metax_x201``). A card is usable when torch can reach it (MACA's
torch exposes it as ``cuda``).

Emulation: a module with ``__fdx_emulated__ = True`` (backends/metax/fake_pymxsml.py, installed
by ``MetaxRunner.emulation()``), or ``emulate=True``, marks the result emulated: the reason and
summary say EMULATED, and the runner runs on whatever torch device exists.
"""
# Probes must never raise, whatever a vendor library throws: blind excepts are the point here.
# ruff: noqa: BLE001, S110
from __future__ import annotations

import ctypes
from typing import Any

from fastdeploy_ext.platforms import (DeviceInfo, ProbeResult, c_text, devices_text, error_text, import_quietly,
                                      never_raises, slug)

from backends.torch_cuda import torch_cuda_view

__all__ = ["MACA_VERSION_BUFFER_SIZE", "metax_family", "probe_metax"]

MACA_VERSION_BUFFER_SIZE = 64      # MXSML_VERSION_INFO_SIZE in MetaX's binding


def metax_family(name: str) -> str:
    """"MetaX C500" -> "metax_c500"; a bare part name ("X201") is prefixed: "metax_x201"."""
    s = slug(name)
    if not s:
        return "metax"
    return s if s == "metax" or s.startswith("metax_") else f"metax_{s}"


class _ApiFailed(Exception):
    """This API cannot answer (no library, init failed, no count): try the next one."""


def _is_raw(mx) -> bool:
    """The SDK's raw ctypes module (status codes + out-parameters), not the raising wrapper."""
    return hasattr(mx, "MxSmlDeviceInfo")


def _check(mx, status: Any, what: str) -> None:
    """Raw convention: a non-zero mxSmlReturn is an error; name it with mxSmlGetErrorString."""
    if status is None or int(status) == 0:
        return
    text = ""
    try:
        text = f" ({c_text(mx.mxSmlGetErrorString(int(status)))})"
    except Exception:
        pass
    raise RuntimeError(f"{what} returned status {int(status)}{text}")


def _read_mxsml(mx, notes: list[str]) -> tuple[list[DeviceInfo], str | None, str]:
    raw = _is_raw(mx)
    api = "mxsml (raw ctypes)" if raw else "mxsml"
    try:
        status = mx.mxSmlInit()
        if raw:
            _check(mx, status, "mxSmlInit")
    except Exception as e:
        raise _ApiFailed(f"{api}: mxSmlInit failed (no MetaX driver?): {error_text(e)}") from None
    driver = None
    get_ver = getattr(mx, "mxSmlGetMacaVersion", None)
    if get_ver is not None:
        try:
            if raw:
                buf = ctypes.create_string_buffer(MACA_VERSION_BUFFER_SIZE)
                size = ctypes.c_uint(MACA_VERSION_BUFFER_SIZE)
                _check(mx, get_ver(buf, ctypes.byref(size)), "mxSmlGetMacaVersion")
                driver = c_text(buf.value) or None
            else:
                driver = c_text(get_ver()) or None
        except Exception as e:
            notes.append(f"MACA version unknown ({error_text(e)})")
    get_count = getattr(mx, "mxSmlGetDeviceCount", None) or getattr(mx, "mxSmlGetPfDeviceCount", None)
    if get_count is None:
        raise _ApiFailed(f"{api}: neither mxSmlGetDeviceCount nor mxSmlGetPfDeviceCount")
    try:
        count = int(get_count())
    except Exception as e:
        raise _ApiFailed(f"{api}: device count failed: {error_text(e)}") from None
    devices = []
    for i in range(count):
        try:
            if raw:
                info = mx.MxSmlDeviceInfo()
                _check(mx, mx.mxSmlGetDeviceInfo(i, ctypes.byref(info)), "mxSmlGetDeviceInfo")
            else:
                info = mx.mxSmlGetDeviceInfo(i)
            name = c_text(info.deviceName)
        except Exception as e:
            notes.append(f"card {i} unreadable ({error_text(e)})")
            continue
        mem = None
        try:
            if raw:
                meminfo = mx.MxSmlMemoryInfo()
                _check(mx, mx.mxSmlGetMemoryInfo(i, ctypes.byref(meminfo)), "mxSmlGetMemoryInfo")
            else:
                meminfo = mx.mxSmlGetMemoryInfo(i)
            mem = int(meminfo.vramTotal) * 1024         # KiB
        except Exception as e:
            notes.append(f"card {i} memory unknown ({error_text(e)})")
        devices.append(DeviceInfo(i, name or "MetaX", mem, None, metax_family(name)))
    return devices, driver, api


def _read_mxsml_ex(ex, notes: list[str]) -> tuple[list[DeviceInfo], str | None, str]:
    api = "mxsml_extension"
    try:
        ex.mxSmlExInit()
    except Exception as e:
        raise _ApiFailed(f"{api}: mxSmlExInit failed (no MetaX driver?): {error_text(e)}") from None
    driver = None
    devices = []
    try:
        try:
            driver = c_text(ex.mxSmlExSystemGetDriverVersion()) or None
        except Exception as e:
            notes.append(f"driver version unknown ({error_text(e)})")
        try:
            count = int(ex.mxSmlExDeviceGetCount())
        except Exception as e:
            raise _ApiFailed(f"{api}: mxSmlExDeviceGetCount failed: {error_text(e)}") from None
        for i in range(count):
            try:
                handle = ex.mxSmlExDeviceGetHandleByIndex(i)
                name = c_text(ex.mxSmlExDeviceGetName(handle))
            except Exception as e:
                notes.append(f"card {i} unreadable ({error_text(e)})")
                continue
            mem = None
            try:
                mem = int(ex.mxSmlExDeviceGetMemoryInfo(handle).total)     # bytes
            except Exception as e:
                notes.append(f"card {i} memory unknown ({error_text(e)})")
            devices.append(DeviceInfo(i, name or "MetaX", mem, None, metax_family(name)))
    finally:
        try:
            ex.mxSmlExShutdown()
        except Exception:
            pass
    return devices, driver, api


@never_raises("metax")
def probe_metax(mxsml_module=None, ex_module=None, *, emulate: bool = False, torch_module=None) -> ProbeResult:
    """MetaX cards through pymxsml's mxsml API, else its mxsml_extension API (see module doc)."""
    apis: list[tuple[Any, Any]] = []
    missing: list[str] = []
    if mxsml_module is None and ex_module is None:
        for name, reader in (("pymxsml", _read_mxsml), ("pymxsml.mxsml_extension", _read_mxsml_ex)):
            try:
                apis.append((import_quietly(name), reader))
            except Exception as e:
                missing.append(f"{name} not importable: {error_text(e)}")
    else:
        apis = [(m, r) for m, r in ((mxsml_module, _read_mxsml), (ex_module, _read_mxsml_ex)) if m is not None]
    emulated = bool(emulate) or any(getattr(m, "__fdx_emulated__", False) for m, _ in apis)
    tag = " (EMULATED)" if emulated else ""
    if not apis:
        return ProbeResult("metax", False, False, f"pymxsml not importable (MACA SDK not installed): "
                           f"{'; '.join(missing)}{tag}", emulated=emulated)

    failures: list[str] = []
    for module, reader in apis:
        notes: list[str] = []
        try:
            devices, driver, api = reader(module, notes)
        except _ApiFailed as e:
            failures.append(str(e))
            continue
        return _result(devices, driver, api, notes + failures, emulated, tag, torch_module)
    return ProbeResult("metax", False, False, "; ".join(failures) + tag, emulated=emulated)


def _result(devices, driver, api, notes, emulated, tag, torch_module) -> ProbeResult:
    note_txt = ("; " + "; ".join(notes)) if notes else ""
    details: dict = {"mxsml_device_count": len(devices), "mxsml_api": api}
    if not devices:
        return ProbeResult("metax", False, False, f"pymxsml ({api}) initialised but reports no MetaX card"
                           f"{note_txt}{tag}", driver_version=driver, details=details, emulated=emulated)
    tv = torch_cuda_view(torch_module)
    details.update(tv)
    head = f"{len(devices)} MetaX card(s){tag} via {api}: {devices_text(devices)}"
    if driver:
        head += f"; MACA {driver}"
    if emulated:
        usable = True
        why = ("fake pymxsml, no MetaX card: the MetaX runner runs on "
               + ("torch's cuda device" if tv["torch_cuda_available"] else "the CPU"))
    elif tv["torch_cuda_available"]:
        usable = True
        why = f"torch {tv['torch_version']} sees {tv['torch_cuda_device_count']} device(s) as cuda (MACA build)"
    else:
        usable = False
        why = (f"but torch {tv['torch_version']} cannot reach it (torch.cuda.is_available() is False: "
               "not the MACA torch build?)" + (f"; {tv['torch_error']}" if "torch_error" in tv else ""))
    return ProbeResult("metax", True, usable, f"{head}; {why}{note_txt}", tuple(devices), driver, details, emulated,
                       notes=tuple(notes))
