"""Device probes: is a device family here, and what is it.

Every probe returns a :class:`ProbeResult` and never raises; ``reason`` always says, in words,
why the result is what it is. Nothing is probed or cached at import time and there is no
module-level mutable state: call the probes when you need an answer (tests inject fakes).

``probe_nvidia(nvml_module=None, torch_module=None)``
    Through NVML (``pynvml``, package ``nvidia-ml-py``), imported lazily. Calls ``nvmlInit``,
    ``nvmlSystemGetDriverVersion``, ``nvmlDeviceGetCount``, and per device
    ``nvmlDeviceGetHandleByIndex``, ``nvmlDeviceGetName`` (bytes or str),
    ``nvmlDeviceGetMemoryInfo(h).total``, ``nvmlDeviceGetCudaComputeCapability(h)`` -> (major,
    minor); optionally ``nvmlSystemGetCudaDriverVersion`` (only if the module has it); finally
    ``nvmlShutdown``. ``present`` = NVML sees at least one GPU; ``usable`` = present and torch can
    use CUDA (``torch.cuda.is_available()``). Family: ``cuda_sm<major><minor>`` (cc 9.0 ->
    ``cuda_sm90``).

``probe_metax(mxsml_module=None, emulate=False, torch_module=None)``
    Through ``pymxsml`` (ships with the MACA SDK under /opt/maca/share/mxsml, not on PyPI),
    imported lazily with ``importlib.import_module("pymxsml")``. The probe calls, in order:

    * ``mxSmlInit()`` — required. Raising, or returning a non-zero integer status, means "no
      driver". (A ``(status, value)`` tuple return is also understood for every call below.)
    * ``mxSmlGetDeviceCount()`` — required (``mxSmlGetPfDeviceCount()`` is tried if the former
      is missing) -> int.
    * ``mxSmlGetDeviceInfo(i)`` — required -> object with ``deviceName`` (str or bytes; the
      attributes ``name`` / ``device_name`` are accepted as fallbacks).
    * ``mxSmlGetMemoryInfo(i)`` — optional -> object with ``vramTotal`` in KiB (total memory is
      ``None`` if missing or failing).
    * ``mxSmlGetMacaVersion()`` — optional, only if present -> str/bytes (``driver_version``).
    * ``mxSmlShutdown()`` — optional, only if present.

    A fake module with ``__fdx_emulated__ = True`` (the conformance suite's
    ``fastdeploy_ext/conformance/fake_pymxsml.py``), or ``emulate=True``, marks the result
    ``emulated=True``: reason and summary then say "(emulated)", and the result is usable (the
    MetaX runner then runs on whatever torch device exists). A real card is usable when torch can
    reach it (MACA's torch exposes the card as ``cuda``). Family: ``metax_<name>``, lowercase,
    non-alphanumerics -> ``_`` ("MetaX C500" -> ``metax_c500``; "X201" -> ``metax_x201``).

``probe_cpu(cpuinfo_text=None, cpuinfo_path="/proc/cpuinfo")``
    Flags and model from /proc/cpuinfo (or the given text); py-cpuinfo's
    ``get_cpu_info()['flags']`` when the file cannot be read (e.g. macOS). ``has_amx`` =
    ``amx_tile`` and ``amx_bf16`` in the flags; family ``cpu_amx`` or ``cpu``. Also reports torch's
    view: ``torch.backends.cpu.get_cpu_capability()`` (in torch 2.13 one of DEFAULT, VSX,
    "Z VECTOR", "NO AVX", AVX2, AVX512, SVE256 — there is no "AMX" value, so it cannot tell AMX
    apart from plain AVX-512) and ``torch.backends.mkldnn.is_available()``.

``onednn_amx_evidence(timeout_s=60, max_cpu_isa=None)``
    Proves whether AMX kernels actually *run*: a subprocess with ``ONEDNN_VERBOSE=1`` (and
    ``DNNL_VERBOSE=1``) runs small bf16 ``F.linear``/matmul/conv2d (torch dispatches bf16 CPU
    GEMMs to oneDNN's matmul when mkldnn is available) and the verbose lines are parsed by
    :func:`parse_onednn_verbose`. The oneDNN ISA banner is only the CPU's ceiling; ``amx_used`` is
    true only when an *executed* primitive's implementation is an AMX one (e.g.
    ``brg_matmul:avx512_core_amx``). ``ONEDNN_MAX_CPU_ISA`` in the environment is passed through;
    ``max_cpu_isa`` sets it (and ``DNNL_MAX_CPU_ISA``) for the subprocess only.

``probe_all()`` -> ``{"cuda": ..., "metax": ..., "cpu": ...}``.
"""
# Probes must never raise, whatever a vendor library throws: blind excepts are the point here.
# ruff: noqa: BLE001, S110
from __future__ import annotations

import dataclasses
import importlib
import os
import re
import subprocess
import sys
import warnings
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "AmxEvidence",
    "DeviceInfo",
    "ProbeResult",
    "cpu_family",
    "cuda_family",
    "metax_family",
    "onednn_amx_evidence",
    "parse_cpuinfo",
    "parse_onednn_verbose",
    "probe_all",
    "probe_cpu",
    "probe_metax",
    "probe_nvidia",
]

GiB = 1024 ** 3


# ------------------------------------------------------------------------------------------ types
@dataclass(frozen=True)
class DeviceInfo:
    index: int
    name: str
    total_memory_bytes: int | None
    compute_capability: tuple[int, int] | None
    family: str

    def to_dict(self) -> dict:
        return {"index": self.index, "name": self.name, "total_memory_bytes": self.total_memory_bytes,
                "compute_capability": list(self.compute_capability) if self.compute_capability else None,
                "family": self.family}

    def describe(self) -> str:
        mem = f", {self.total_memory_bytes / GiB:.0f} GiB" if self.total_memory_bytes else ""
        cc = (f", cc {self.compute_capability[0]}.{self.compute_capability[1]}"
              if self.compute_capability else "")
        return f"#{self.index} {self.name} [{self.family}{cc}{mem}]"


@dataclass(frozen=True)
class ProbeResult:
    kind: str                      # "cuda" | "metax" | "cpu"
    present: bool                  # the device family is on this machine
    usable: bool                   # ... and this process can run on it (e.g. torch sees CUDA)
    reason: str                    # always set, human-readable
    devices: tuple[DeviceInfo, ...] = ()
    driver_version: str | None = None
    details: dict = field(default_factory=dict, hash=False, compare=False)
    emulated: bool = False

    def to_dict(self) -> dict:
        """JSON-ready (``json.dumps(r.to_dict())``)."""
        return {"kind": self.kind, "present": self.present, "usable": self.usable, "reason": self.reason,
                "devices": [d.to_dict() for d in self.devices], "driver_version": self.driver_version,
                "details": _jsonable(self.details), "emulated": self.emulated}

    def summary(self) -> str:
        """One line: state, then the reason (which names the devices)."""
        state = ("present, usable" if self.usable else "present, NOT usable") if self.present else "not present"
        if self.emulated:
            state += " (emulated)"
        return f"{self.kind}: {state} — {self.reason}"


@dataclass(frozen=True)
class AmxEvidence:
    amx_used: bool                 # an executed oneDNN primitive ran an AMX implementation
    isa: str                       # oneDNN's ISA banner (the CPU ceiling it detected), "" if none
    kernels: list[str] = field(default_factory=list)   # distinct implementation names executed
    raw_excerpt: str = ""          # a few verbose lines (ISA + first executions)
    reason: str = ""
    compute_primitives: int = 0    # executed matmul / inner_product / convolution / deconvolution
    amx_primitives: int = 0        # ... of which ran an AMX implementation
    max_cpu_isa: str | None = None  # ONEDNN_MAX_CPU_ISA the subprocess ran under, if any

    def to_dict(self) -> dict:
        return {"amx_used": self.amx_used, "isa": self.isa, "kernels": list(self.kernels),
                "raw_excerpt": self.raw_excerpt, "reason": self.reason,
                "compute_primitives": self.compute_primitives, "amx_primitives": self.amx_primitives,
                "max_cpu_isa": self.max_cpu_isa}


def _jsonable(x: Any) -> Any:
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple, set, frozenset)):
        items = sorted(x) if isinstance(x, (set, frozenset)) else x
        return [_jsonable(v) for v in items]
    if x is None or isinstance(x, (bool, int, float, str)):
        return x
    return str(x)


# -------------------------------------------------------------------------------------- helpers
def _err(e: BaseException) -> str:
    msg = str(e).strip()
    return f"{type(e).__name__}: {msg}" if msg else type(e).__name__


def _text(v: Any) -> str:
    if isinstance(v, (bytes, bytearray)):
        v = bytes(v).split(b"\0", 1)[0].decode("utf-8", "replace")
    return str(v).strip()


def _slug(name: str) -> str:
    return re.sub(r"[^a-z0-9]+", "_", name.lower()).strip("_")


def cuda_family(cc: tuple[int, int] | None) -> str:
    return f"cuda_sm{cc[0]}{cc[1]}" if cc else "cuda"


def metax_family(name: str) -> str:
    """"MetaX C500" -> "metax_c500"; a bare part name ("X201") is prefixed: "metax_x201"."""
    s = _slug(name)
    if not s:
        return "metax"
    return s if s == "metax" or s.startswith("metax_") else f"metax_{s}"


def cpu_family(flags) -> str:
    return "cpu_amx" if {"amx_tile", "amx_bf16"} <= set(flags) else "cpu"


def _import(name: str):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")      # the legacy `pynvml` shim warns on import
        return importlib.import_module(name)


def _torch_view(torch_module=None) -> dict:
    """What torch says about CUDA-style devices (never raises)."""
    view: dict = {"torch_version": None, "torch_cuda_version": None, "torch_cuda_available": False,
                  "torch_cuda_device_count": 0}
    try:
        torch = torch_module if torch_module is not None else _import("torch")
    except Exception as e:
        view["torch_error"] = f"torch not importable: {_err(e)}"
        return view
    try:
        view["torch_version"] = str(getattr(torch, "__version__", "?"))
        view["torch_cuda_version"] = getattr(getattr(torch, "version", None), "cuda", None)
        view["torch_cuda_available"] = bool(torch.cuda.is_available())
        if view["torch_cuda_available"]:
            view["torch_cuda_device_count"] = int(torch.cuda.device_count())
    except Exception as e:
        view["torch_error"] = f"torch.cuda query failed: {_err(e)}"
    return view


def _devices_text(devices) -> str:
    return "; ".join(d.describe() for d in devices)


# --------------------------------------------------------------------------------------- NVIDIA
def probe_nvidia(nvml_module=None, torch_module=None) -> ProbeResult:
    """NVIDIA GPUs through NVML. ``nvml_module``: a pynvml-like object (None: import pynvml)."""
    try:
        return _probe_nvidia(nvml_module, torch_module)
    except Exception as e:  # belt and braces: a probe never raises
        return ProbeResult("cuda", False, False, f"NVIDIA probe failed unexpectedly: {_err(e)}")


def _probe_nvidia(nvml, torch_module) -> ProbeResult:
    if nvml is None:
        try:
            nvml = _import("pynvml")
        except Exception as e:
            return ProbeResult("cuda", False, False,
                               f"pynvml not importable (pip install nvidia-ml-py): {_err(e)}")
    try:
        nvml.nvmlInit()
    except Exception as e:
        return ProbeResult("cuda", False, False, f"NVML init failed (no NVIDIA driver?): {_err(e)}")
    details: dict = {}
    notes: list[str] = []
    devices: list[DeviceInfo] = []
    driver = None
    try:
        try:
            driver = _text(nvml.nvmlSystemGetDriverVersion())
        except Exception as e:
            notes.append(f"driver version unknown ({_err(e)})")
        get_cuda_drv = getattr(nvml, "nvmlSystemGetCudaDriverVersion", None)
        if get_cuda_drv is not None:
            try:
                v = int(get_cuda_drv())
                details["cuda_driver_api_version"] = f"{v // 1000}.{(v % 1000) // 10}"
            except Exception:
                pass
        try:
            count = int(nvml.nvmlDeviceGetCount())
        except Exception as e:
            return ProbeResult("cuda", False, False, f"NVML initialised but device count failed: {_err(e)}",
                               driver_version=driver, details=details)
        skipped = []
        for i in range(count):
            try:
                h = nvml.nvmlDeviceGetHandleByIndex(i)
                name = _text(nvml.nvmlDeviceGetName(h))
            except Exception as e:
                notes.append(f"GPU {i} unreadable ({_err(e)})")
                continue
            if name.lower().startswith("metax"):     # MACA's NVML shim: leave it to the metax probe
                skipped.append(name)
                continue
            try:
                mem = int(nvml.nvmlDeviceGetMemoryInfo(h).total)
            except Exception as e:
                mem = None
                notes.append(f"GPU {i} memory unknown ({_err(e)})")
            try:
                major, minor = nvml.nvmlDeviceGetCudaComputeCapability(h)
                cc = (int(major), int(minor))
            except Exception as e:
                cc = None
                notes.append(f"GPU {i} compute capability unknown ({_err(e)})")
            devices.append(DeviceInfo(i, name, mem, cc, cuda_family(cc)))
        if skipped:
            notes.append(f"NVML lists non-NVIDIA devices {skipped} (MetaX NVML shim): ignored here")
    finally:
        try:
            nvml.nvmlShutdown()
        except Exception:
            pass

    details["nvml_device_count"] = len(devices)
    tv = _torch_view(torch_module)
    details.update(tv)
    drv = f"driver {driver}" if driver else "driver version unknown"
    note_txt = ("; " + "; ".join(notes)) if notes else ""
    if not devices:
        return ProbeResult("cuda", False, False, f"NVML initialised ({drv}) but reports no NVIDIA GPU{note_txt}",
                           driver_version=driver, details=details)
    head = f"{len(devices)} NVIDIA GPU(s): {_devices_text(devices)}; {drv}"
    if tv["torch_cuda_available"]:
        usable = True
        why = f"torch {tv['torch_version']} (CUDA {tv['torch_cuda_version']}) sees {tv['torch_cuda_device_count']}"
    else:
        usable = False
        if "torch_error" in tv:
            why = f"but torch cannot use CUDA: {tv['torch_error']}"
        elif tv["torch_cuda_version"] is None:
            why = f"but torch {tv['torch_version']} cannot use CUDA (CPU-only build, torch.version.cuda=None)"
        else:
            why = (f"but torch {tv['torch_version']} (CUDA {tv['torch_cuda_version']}) cannot use CUDA "
                   "(torch.cuda.is_available() is False: driver too old for this build, or CUDA_VISIBLE_DEVICES "
                   "hides every GPU?)")
    return ProbeResult("cuda", True, usable, f"{head}; {why}{note_txt}", tuple(devices), driver, details)


# ---------------------------------------------------------------------------------------- MetaX
def _unwrap(ret: Any, what: str) -> Any:
    """pymxsml may return the value, or a ``(status, value)`` pair from the raw bindings."""
    if isinstance(ret, tuple) and len(ret) == 2 and isinstance(ret[0], int) and not isinstance(ret[0], bool):
        if ret[0] != 0:
            raise RuntimeError(f"{what} returned status {ret[0]}")
        return ret[1]
    return ret


def _first_attr(obj: Any, names: tuple[str, ...], what: str) -> Any:
    for n in names:
        v = getattr(obj, n, None)
        if v is not None:
            return v
    if isinstance(obj, dict):
        for n in names:
            if obj.get(n) is not None:
                return obj[n]
    raise AttributeError(f"{what}: none of {', '.join(names)}")


def probe_metax(mxsml_module=None, emulate: bool = False, torch_module=None) -> ProbeResult:
    """MetaX MACA GPUs through pymxsml (None: ``importlib.import_module("pymxsml")``).

    ``emulate=True`` (or a module with ``__fdx_emulated__ = True``) marks the result emulated.
    """
    emulated = bool(emulate) or bool(getattr(mxsml_module, "__fdx_emulated__", False))
    try:
        return _probe_metax(mxsml_module, emulate, torch_module)
    except Exception as e:
        return ProbeResult("metax", False, False, f"MetaX probe failed unexpectedly: {_err(e)}", emulated=emulated)


def _probe_metax(mx, emulate: bool, torch_module) -> ProbeResult:
    if mx is None:
        try:
            mx = importlib.import_module("pymxsml")
        except Exception as e:
            return ProbeResult("metax", False, False,
                               f"pymxsml not importable (MACA SDK not installed): {_err(e)}", emulated=bool(emulate))
    emulated = bool(emulate) or bool(getattr(mx, "__fdx_emulated__", False))
    tag = " (emulated)" if emulated else ""

    def absent(msg: str, **kw) -> ProbeResult:
        return ProbeResult("metax", False, False, msg + tag, emulated=emulated, **kw)

    try:
        st = mx.mxSmlInit()
        if isinstance(st, int) and not isinstance(st, bool) and st != 0:
            raise RuntimeError(f"mxSmlInit returned status {st}")
    except Exception as e:
        return absent(f"pymxsml.mxSmlInit failed (no MetaX driver?): {_err(e)}")
    devices: list[DeviceInfo] = []
    notes: list[str] = []
    driver = None
    try:
        get_count = getattr(mx, "mxSmlGetDeviceCount", None) or getattr(mx, "mxSmlGetPfDeviceCount", None)
        if get_count is None:
            return absent("pymxsml has neither mxSmlGetDeviceCount nor mxSmlGetPfDeviceCount")
        try:
            count = int(_unwrap(get_count(), "mxSmlGetDeviceCount"))
        except Exception as e:
            return absent(f"pymxsml device count failed: {_err(e)}")
        get_ver = getattr(mx, "mxSmlGetMacaVersion", None)
        if get_ver is not None:
            try:
                driver = _text(_unwrap(get_ver(), "mxSmlGetMacaVersion")) or None
            except Exception as e:
                notes.append(f"MACA version unknown ({_err(e)})")
        for i in range(count):
            try:
                info = _unwrap(mx.mxSmlGetDeviceInfo(i), "mxSmlGetDeviceInfo")
                name = _text(_first_attr(info, ("deviceName", "name", "device_name"), "mxSmlGetDeviceInfo"))
            except Exception as e:
                notes.append(f"card {i} unreadable ({_err(e)})")
                continue
            mem = None
            try:
                meminfo = _unwrap(mx.mxSmlGetMemoryInfo(i), "mxSmlGetMemoryInfo")
                mem = int(_first_attr(meminfo, ("vramTotal", "vram_total"), "mxSmlGetMemoryInfo")) * 1024  # KiB
            except Exception as e:
                notes.append(f"card {i} memory unknown ({_err(e)})")
            devices.append(DeviceInfo(i, name or "MetaX", mem, None, metax_family(name)))
    finally:
        shutdown = getattr(mx, "mxSmlShutdown", None)
        if shutdown is not None:
            try:
                shutdown()
            except Exception:
                pass

    note_txt = ("; " + "; ".join(notes)) if notes else ""
    details: dict = {"mxsml_device_count": len(devices)}
    if not devices:
        return absent(f"pymxsml initialised but reports no MetaX card{note_txt}", driver_version=driver,
                      details=details)
    tv = _torch_view(torch_module)
    details.update(tv)
    head = f"{len(devices)} MetaX card(s){tag}: {_devices_text(devices)}"
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
    return ProbeResult("metax", True, usable, f"{head}; {why}{note_txt}", tuple(devices), driver, details, emulated)


# ------------------------------------------------------------------------------------------ CPU
_CPU_FLAGS_OF_INTEREST = ("amx_tile", "amx_bf16", "amx_int8", "amx_fp16", "avx512_bf16", "avx512_fp16",
                          "avx512f", "avx512_vnni", "avx2")


def parse_cpuinfo(text: str) -> dict:
    """/proc/cpuinfo text -> {"flags": sorted list, "model_name": str|None, "logical_cpus": int,
    "physical_cores": int|None}. Flags come from the first ``flags`` (x86) / ``Features`` (arm)."""
    flags: list[str] | None = None
    model = None
    processors = 0
    cores: set[tuple[str, str]] = set()
    phys = core = None
    for line in text.splitlines():
        key, sep, val = line.partition(":")
        if not sep:
            continue
        key, val = key.strip().lower(), val.strip()
        if key == "processor":
            processors += 1
            phys = core = None
        elif key in ("flags", "features") and flags is None:
            flags = val.split()
        elif key == "model name" and model is None:
            model = val
        elif key == "physical id":
            phys = val
        elif key == "core id":
            core = val
        if phys is not None and core is not None:
            cores.add((phys, core))
            phys = core = None
    return {"flags": sorted(set(flags or ())), "model_name": model, "logical_cpus": processors or None,
            "physical_cores": len(cores) or None}


def _mem_total_bytes() -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) * 1024
    except Exception:
        pass
    return None


def probe_cpu(cpuinfo_text: str | None = None, cpuinfo_path: str = "/proc/cpuinfo") -> ProbeResult:
    """The host CPU: flags (AMX...), model, cores, and torch's CPU view. ``cpuinfo_text``: parse
    this /proc/cpuinfo text instead of reading ``cpuinfo_path``."""
    try:
        return _probe_cpu(cpuinfo_text, cpuinfo_path)
    except Exception as e:
        return ProbeResult("cpu", True, True, f"CPU probe failed ({_err(e)}); assuming a plain CPU",
                           (DeviceInfo(0, "cpu", None, None, "cpu"),))


def _probe_cpu(cpuinfo_text: str | None, cpuinfo_path: str) -> ProbeResult:
    notes: list[str] = []
    given = cpuinfo_text is not None
    source = "given text" if given else "none"
    mem = None
    if cpuinfo_text is None:
        try:
            with open(cpuinfo_path) as f:
                cpuinfo_text = f.read()
            source = cpuinfo_path
            mem = _mem_total_bytes()
        except Exception as e:
            notes.append(f"{cpuinfo_path} unreadable ({_err(e)})")
    parsed = parse_cpuinfo(cpuinfo_text) if cpuinfo_text is not None else {
        "flags": [], "model_name": None, "logical_cpus": None, "physical_cores": None}
    if not parsed["flags"] and not given:
        try:
            info = _import("cpuinfo").get_cpu_info()
            parsed["flags"] = sorted(set(info.get("flags") or ()))
            parsed["model_name"] = parsed["model_name"] or info.get("brand_raw")
            source = "py-cpuinfo"
        except Exception as e:
            notes.append(f"py-cpuinfo failed ({_err(e)})")
    flags = parsed["flags"]
    model = parsed["model_name"]
    if not model:
        import platform
        model = platform.processor() or platform.machine() or "unknown CPU"

    details: dict = {"flags_source": source if flags else "none", "flags": flags, "model_name": model,
                     "os_cpu_count": os.cpu_count(), "logical_cpus": parsed["logical_cpus"],
                     "physical_cores": parsed["physical_cores"]}
    try:
        details["affinity_cpus"] = len(os.sched_getaffinity(0))
    except Exception:
        details["affinity_cpus"] = None
    fl = set(flags)
    for f in _CPU_FLAGS_OF_INTEREST:
        details[f] = f in fl
    has_amx = {"amx_tile", "amx_bf16"} <= fl
    details["has_amx"] = has_amx
    try:
        torch = _import("torch")
        details["torch_num_threads"] = int(torch.get_num_threads())
        details["torch_cpu_capability"] = str(torch.backends.cpu.get_cpu_capability())
        details["mkldnn_available"] = bool(torch.backends.mkldnn.is_available())
    except Exception as e:
        details.update(torch_num_threads=None, torch_cpu_capability=None, mkldnn_available=False)
        notes.append(f"torch's CPU view unavailable ({_err(e)})")

    family = cpu_family(fl)
    dev = DeviceInfo(0, model, mem, None, family)
    if not flags:
        isa = "CPU flags unknown"
    elif has_amx:
        amx = "+".join(f for f in ("amx_tile", "amx_bf16", "amx_int8", "amx_fp16") if f in fl)
        isa = f"AMX ({amx})"
    else:
        missing = "/".join(f for f in ("amx_tile", "amx_bf16") if f not in fl)
        simd = "AVX-512" if "avx512f" in fl else ("AVX2" if "avx2" in fl else "no AVX-512/AVX2")
        isa = f"no AMX ({missing} missing), {simd}" + (", avx512_bf16" if "avx512_bf16" in fl else "")
    cores = details["affinity_cpus"] or details["os_cpu_count"]
    torch_txt = (f"torch capability {details['torch_cpu_capability']}, oneDNN "
                 f"{'available' if details['mkldnn_available'] else 'unavailable'}, "
                 f"{details['torch_num_threads']} threads") if details.get("torch_cpu_capability") else "torch n/a"
    reason = f"{model} [{family}], {cores} CPUs: {isa}; {torch_txt}"
    if notes:
        reason += "; " + "; ".join(notes)
    return ProbeResult("cpu", True, True, reason, (dev,), None, details)


# ------------------------------------------------------------------------- oneDNN AMX evidence
_VERBOSE_MARKERS = ("onednn_verbose", "dnnl_verbose")
_COMPUTE_PRIMITIVES = frozenset({"matmul", "inner_product", "convolution", "deconvolution", "brgemm"})


def _is_amx_impl(impl: str) -> bool:
    return "amx" in impl.lower()


def parse_onednn_verbose(text: str) -> AmxEvidence:
    """Parse ONEDNN_VERBOSE / DNNL_VERBOSE output (oneDNN 2.x and 3.x formats, with or without
    the ``v1`` and timestamp fields). Only ``exec`` lines of primitives count as evidence; the
    ``isa:`` banner is reported but is only the CPU's ceiling."""
    isa = ""
    isa_line = ""
    kernels: list[str] = []
    compute_lines: list[str] = []
    other_lines: list[str] = []
    compute = amx = 0
    for raw in text.splitlines():
        pos = min((raw.find(m) for m in _VERBOSE_MARKERS if m in raw), default=-1)
        if pos < 0:
            continue
        line = raw[pos:].strip()
        tokens = line.split(",")
        if not isa and "isa:" in line and "info" in tokens[:4]:
            isa = line[line.index("isa:") + 4:].strip()
            isa_line = line
            continue
        head = tokens[:5]
        if "exec" not in head or "graph" in head:
            continue
        i = head.index("exec")
        if len(tokens) < i + 4:
            continue
        _engine, prim, impl = tokens[i + 1], tokens[i + 2], tokens[i + 3].strip()
        if not impl:
            continue
        if impl not in kernels:
            kernels.append(impl)
        if prim in _COMPUTE_PRIMITIVES:
            compute += 1
            if _is_amx_impl(impl):
                amx += 1
        (compute_lines if prim in _COMPUTE_PRIMITIVES else other_lines).append(
            line if len(line) <= 300 else line[:297] + "...")
    amx_used = any(_is_amx_impl(k) for k in kernels)
    isa_has_amx = "amx" in isa.lower()
    if amx_used:
        reason = (f"oneDNN executed AMX kernels ({', '.join(k for k in kernels if _is_amx_impl(k))}); "
                  f"{amx} of {compute} compute primitives ran on AMX")
    elif not isa and not kernels:
        reason = ("no oneDNN verbose output: nothing was dispatched to oneDNN (torch without oneDNN, or "
                  "oneDNN's ISA, possibly capped by ONEDNN_MAX_CPU_ISA, lacks the bf16 support torch requires)")
    elif isa_has_amx:
        reason = (f"oneDNN's ISA ceiling includes AMX but none of {compute} executed compute primitives "
                  f"used an AMX kernel (executed: {', '.join(kernels) or 'none'})")
    else:
        reason = (f"oneDNN ISA is {isa or 'unknown'!r} (no AMX); {compute} compute primitives, none on AMX; "
                  f"executed kernels: {', '.join(kernels) or 'none'}")
    shown = compute_lines[:5] + other_lines[:max(0, 5 - len(compute_lines))]
    excerpt = "\n".join(([isa_line] if isa_line else []) + shown)
    return AmxEvidence(amx_used, isa, kernels, excerpt, reason, compute, amx)


_AMX_CHILD = r"""
import torch, torch.nn.functional as F
print("fdx: torch", torch.__version__, "mkldnn", torch.backends.mkldnn.is_available(), flush=True)
torch.manual_seed(0)
a = torch.randn(256, 256).to(torch.bfloat16)
w = torch.randn(256, 256).to(torch.bfloat16)
F.linear(a, w)
a @ w
x = torch.randn(1, 16, 32, 32).to(torch.bfloat16)
k = torch.randn(16, 16, 3, 3).to(torch.bfloat16)
F.conv2d(x, k)
print("fdx: done", flush=True)
"""


def onednn_amx_evidence(timeout_s: float = 60, max_cpu_isa: str | None = None) -> AmxEvidence:
    """Run small bf16 linear/matmul/conv2d in a subprocess with ONEDNN_VERBOSE=1 and report
    whether oneDNN executed AMX kernels. Never raises. ``max_cpu_isa`` caps oneDNN's ISA
    (ONEDNN_MAX_CPU_ISA, e.g. "AVX512_CORE_BF16"); otherwise the caller's environment passes through."""
    env = dict(os.environ)
    env["ONEDNN_VERBOSE"] = "1"
    env["DNNL_VERBOSE"] = "1"
    if max_cpu_isa:
        env["ONEDNN_MAX_CPU_ISA"] = max_cpu_isa
        env["DNNL_MAX_CPU_ISA"] = max_cpu_isa
    cap = env.get("ONEDNN_MAX_CPU_ISA") or env.get("DNNL_MAX_CPU_ISA") or None
    cap_txt = f" [ONEDNN_MAX_CPU_ISA={cap}]" if cap else ""
    try:
        proc = subprocess.run([sys.executable, "-c", _AMX_CHILD], check=False, env=env, capture_output=True, text=True,
                              timeout=timeout_s)
    except subprocess.TimeoutExpired as e:
        out = e.stdout.decode("utf-8", "replace") if isinstance(e.stdout, bytes) else (e.stdout or "")
        ev = parse_onednn_verbose(out)
        return _with(ev, reason=f"oneDNN probe timed out after {timeout_s}s{cap_txt}; {ev.reason}",
                     max_cpu_isa=cap)
    except Exception as e:
        return AmxEvidence(False, "", [], "", f"could not start the oneDNN probe subprocess: {_err(e)}",
                           max_cpu_isa=cap)
    ev = parse_onednn_verbose(proc.stdout + "\n" + proc.stderr)
    if "fdx: torch" in proc.stdout and " mkldnn False" in proc.stdout:
        ev = _with(ev, reason="torch.backends.mkldnn.is_available() is False in this torch build; " + ev.reason)
    if proc.returncode != 0:
        tail = " | ".join((proc.stderr or proc.stdout).strip().splitlines()[-3:])
        return _with(ev, reason=f"oneDNN probe subprocess exited {proc.returncode}{cap_txt}: {tail}; {ev.reason}",
                     max_cpu_isa=cap)
    return _with(ev, reason=ev.reason + cap_txt, max_cpu_isa=cap)


def _with(ev: AmxEvidence, **kw) -> AmxEvidence:
    return dataclasses.replace(ev, **kw)


# ------------------------------------------------------------------------------------------ all
def probe_all() -> dict[str, ProbeResult]:
    """All three probes, freshly (no caching)."""
    return {"cuda": probe_nvidia(), "metax": probe_metax(), "cpu": probe_cpu()}
