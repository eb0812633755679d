"""EMULATED pymxsml: MetaX's Python binding without a MetaX card (emulation and tests only).

Mirrors the signatures of MetaX's published binding (see backends/metax/probe.py) in its three
shapes, so the probe is exercised exactly as on a real machine:

* ``make_mxsml(convention="raw")``: the SDK's raw ctypes module — calls return an mxSmlReturn
  status and fill ctypes out-parameters (``mxSmlGetMacaVersion(buf, byref(size))`` writes into a
  char buffer and fails with MXSML_ERROR_INSUFFICIENT_SIZE when it is too small;
  ``mxSmlGetDeviceInfo(id, byref(MxSmlDeviceInfo()))``; ``mxSmlGetMemoryInfo(id,
  byref(MxSmlMemoryInfo()))``), with the same structure fields.
* ``make_mxsml(convention="wrapper")``: the packaged wrapper — calls raise ``MXSMLError`` and
  return values (``mxSmlGetMacaVersion()`` -> str, structures from the getters).
* ``make_mxsml_extension()``: ``pymxsml.mxsml_extension`` — ``mxSmlExInit``,
  ``mxSmlExDeviceGetCount``, handles, ``mxSmlExDeviceGetName``, ``mxSmlExDeviceGetMemoryInfo``
  (bytes), ``MXSMLEXError``.

Every module carries ``__fdx_emulated__ = True``: the probe, the plan and every report then say
EMULATED. :func:`installed` puts a fake ``pymxsml`` package (raw mxsml + the extension) into
``sys.modules`` for the duration of a ``with`` block; ``MetaxRunner.emulation()`` returns it.
"""
from __future__ import annotations

import contextlib
import ctypes
import sys
import types
from dataclasses import dataclass

__all__ = ["FakeCard", "installed", "make_mxsml", "make_mxsml_extension"]

MXSML_SUCCESS = 0
MXSML_ERROR_FAILURE = 1
MXSML_ERROR_NO_DEVICE = 2
MXSML_ERROR_INVALID_DEVICE_ID = 6
MXSML_ERROR_INSUFFICIENT_SIZE = 10
MXSML_ERROR_LOAD_DLL_FAILURE = 26
MXSMLEX_ERROR_INVALID_ARGUMENT = 2
MXSMLEX_ERROR_DRIVER_NOT_LOADED = 9
_ERRORS = {MXSML_SUCCESS: b"Success", MXSML_ERROR_FAILURE: b"Failure", MXSML_ERROR_NO_DEVICE: b"No device",
           MXSML_ERROR_INVALID_DEVICE_ID: b"Invalid device id", MXSML_ERROR_INSUFFICIENT_SIZE: b"Insufficient size",
           MXSML_ERROR_LOAD_DLL_FAILURE: b"Load dll failure"}


@dataclass(frozen=True)
class FakeCard:
    name: str = "MetaX C500"
    vram_kib: int = 64 * 1024 * 1024


class MxSmlDeviceInfo(ctypes.Structure):
    _fields_ = [("deviceId", ctypes.c_uint), ("type", ctypes.c_uint), ("bdfId", ctypes.c_char * 32),
                ("gpuId", ctypes.c_uint), ("nodeId", ctypes.c_uint), ("uuid", ctypes.c_char * 96),
                ("brand", ctypes.c_uint), ("mode", ctypes.c_uint), ("deviceName", ctypes.c_char * 32)]


class MxSmlMemoryInfo(ctypes.Structure):
    _fields_ = [("visVramTotal", ctypes.c_long), ("visVramUse", ctypes.c_long), ("vramTotal", ctypes.c_long),
                ("vramUse", ctypes.c_long), ("xttTotal", ctypes.c_long), ("xttUse", ctypes.c_long)]


def _target(ref):
    """The ctypes object behind ``byref(x)`` (or ``pointer(x)``), as the C side would write it."""
    obj = getattr(ref, "_obj", None)
    if obj is None:
        obj = ref.contents
    return obj


def _check_out(ref, cls):
    obj = _target(ref)
    if not isinstance(obj, cls):
        raise TypeError(f"expected a pointer to {cls.__name__}, got {type(obj).__name__}")
    return obj


def make_mxsml(cards=(FakeCard(),), *, convention: str = "raw", init_status: int = MXSML_SUCCESS,
               maca_version: str = "2.32.0.6 (EMULATED)") -> types.ModuleType:
    """A fake ``pymxsml`` (mxsml API) in MetaX's raw ctypes or wrapper calling convention."""
    if convention not in ("raw", "wrapper"):
        raise ValueError(f"convention must be raw or wrapper, got {convention!r}")
    m = types.ModuleType("pymxsml")
    m.__fdx_emulated__ = True
    m.__path__ = []                         # a package: pymxsml.mxsml_extension may live under it
    cards = tuple(cards)

    def device_info(i: int) -> MxSmlDeviceInfo:
        info = MxSmlDeviceInfo()
        info.deviceId, info.deviceName = i, cards[i].name.encode()[:31]
        info.bdfId = f"0000:{i + 1:02x}:00.0".encode()
        return info

    def memory_info(i: int) -> MxSmlMemoryInfo:
        mem = MxSmlMemoryInfo()
        mem.vramTotal = mem.visVramTotal = cards[i].vram_kib
        return mem

    if convention == "raw":
        m.MxSmlDeviceInfo, m.MxSmlMemoryInfo = MxSmlDeviceInfo, MxSmlMemoryInfo

        def mxSmlInit():
            return init_status

        def mxSmlGetErrorString(status):
            return _ERRORS.get(int(status), b"Unknown error")

        def mxSmlGetMacaVersion(buf, size_ref):        # (char *version, unsigned *size)
            size = _check_out(size_ref, ctypes.c_uint)
            data = maca_version.encode()
            if len(data) + 1 > size.value or len(data) + 1 > len(buf):
                size.value = len(data) + 1
                return MXSML_ERROR_INSUFFICIENT_SIZE
            buf.value = data
            size.value = len(data) + 1
            return MXSML_SUCCESS

        def mxSmlGetDeviceCount():
            return len(cards) if init_status == MXSML_SUCCESS else 0

        def mxSmlGetDeviceInfo(device_id, info_ref):
            if not 0 <= device_id < len(cards):
                return MXSML_ERROR_INVALID_DEVICE_ID
            ctypes.pointer(_check_out(info_ref, MxSmlDeviceInfo))[0] = device_info(device_id)
            return MXSML_SUCCESS

        def mxSmlGetMemoryInfo(device_id, mem_ref):
            if not 0 <= device_id < len(cards):
                return MXSML_ERROR_INVALID_DEVICE_ID
            ctypes.pointer(_check_out(mem_ref, MxSmlMemoryInfo))[0] = memory_info(device_id)
            return MXSML_SUCCESS

        fns = (mxSmlInit, mxSmlGetErrorString, mxSmlGetMacaVersion, mxSmlGetDeviceCount, mxSmlGetDeviceInfo,
               mxSmlGetMemoryInfo)
    else:
        class MXSMLError(Exception):
            def __init__(self, value):
                super().__init__(value)
                self.value = value

            def __str__(self):
                return _ERRORS.get(self.value, b"MXSML Error").decode()

        m.MXSMLError = MXSMLError

        def check(status):
            if status != MXSML_SUCCESS:
                raise MXSMLError(status)

        def mxSmlInit():
            check(init_status)

        def mxSmlGetMacaVersion():
            return maca_version

        def mxSmlGetDeviceCount():
            return len(cards) if init_status == MXSML_SUCCESS else 0

        def mxSmlGetDeviceInfo(device_id):
            if not 0 <= device_id < len(cards):
                raise MXSMLError(MXSML_ERROR_INVALID_DEVICE_ID)
            return device_info(device_id)

        def mxSmlGetMemoryInfo(device_id):
            if not 0 <= device_id < len(cards):
                raise MXSMLError(MXSML_ERROR_INVALID_DEVICE_ID)
            return memory_info(device_id)

        fns = (mxSmlInit, mxSmlGetMacaVersion, mxSmlGetDeviceCount, mxSmlGetDeviceInfo, mxSmlGetMemoryInfo)
    for fn in fns:
        setattr(m, fn.__name__, fn)
    return m


def make_mxsml_extension(cards=(FakeCard(),), *, init_error: int | None = None,
                         driver_version: str = "2.14.6 (EMULATED)") -> types.ModuleType:
    """A fake ``pymxsml.mxsml_extension`` (the NVML-like mxSmlEx* API)."""
    m = types.ModuleType("pymxsml.mxsml_extension")
    m.__fdx_emulated__ = True
    cards = tuple(cards)
    state = {"initialised": False}

    class MXSMLEXError(Exception):
        _names = {MXSMLEX_ERROR_INVALID_ARGUMENT: "Invalid Argument",
                  MXSMLEX_ERROR_DRIVER_NOT_LOADED: "Driver Not Loaded"}

        def __init__(self, value):
            super().__init__(value)
            self.value = value

        def __str__(self):
            return self._names.get(self.value, f"MXSMLEX Error with code {self.value}")

    class _Handle:
        def __init__(self, index):
            self.index = index

    def need_init():
        if not state["initialised"]:
            raise MXSMLEXError(1)                   # MXSMLEX_ERROR_UNINITIALIZED

    def mxSmlExInit():
        if init_error is not None:
            raise MXSMLEXError(init_error)
        state["initialised"] = True

    def mxSmlExShutdown():
        need_init()
        state["initialised"] = False

    def mxSmlExSystemGetDriverVersion():
        need_init()
        return driver_version

    def mxSmlExDeviceGetCount():
        need_init()
        return len(cards)

    def mxSmlExDeviceGetHandleByIndex(index):
        need_init()
        if not 0 <= index < len(cards):
            raise MXSMLEXError(MXSMLEX_ERROR_INVALID_ARGUMENT)
        return _Handle(index)

    def mxSmlExDeviceGetName(handle):
        need_init()
        return cards[handle.index].name

    def mxSmlExDeviceGetMemoryInfo(handle, version=None):
        need_init()
        total = cards[handle.index].vram_kib * 1024
        return types.SimpleNamespace(total=total, free=total, used=0)

    m.MXSMLEXError = MXSMLEXError
    for fn in (mxSmlExInit, mxSmlExShutdown, mxSmlExSystemGetDriverVersion, mxSmlExDeviceGetCount,
               mxSmlExDeviceGetHandleByIndex, mxSmlExDeviceGetName, mxSmlExDeviceGetMemoryInfo):
        setattr(m, fn.__name__, fn)
    return m


@contextlib.contextmanager
def installed(cards=(FakeCard(),)):
    """``sys.modules`` holds a fake ``pymxsml`` package (raw mxsml + mxsml_extension) inside the
    block; whatever was there before (a real binding, or nothing) is restored afterwards."""
    names = ("pymxsml", "pymxsml.mxsml_extension")
    saved = {n: sys.modules.get(n) for n in names}
    mx, ex = make_mxsml(cards), make_mxsml_extension(cards)
    mx.mxsml_extension = ex
    sys.modules.update({"pymxsml": mx, "pymxsml.mxsml_extension": ex})
    try:
        yield mx
    finally:
        for n, mod in saved.items():
            if mod is None:
                sys.modules.pop(n, None)
            else:
                sys.modules[n] = mod
