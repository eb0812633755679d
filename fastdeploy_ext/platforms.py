"""What every device probe returns, and the never-raise helpers probes share.

The probes themselves live with their backend — ``backends/<vendor>/probe.py`` talks to that
vendor's SDK (or, for the CPU, /proc/cpuinfo and oneDNN) — and this module names none. A
probe returns a :class:`ProbeResult` and never raises: ``reason`` always says, in words, why the
result is what it is. Nothing is probed or cached at import time and there is no module-level
mutable state here.

Helpers: :func:`error_text` (an exception as one line), :func:`c_text` (bytes/str from a C
binding -> clean str), :func:`slug`, :func:`import_quietly` (lazy SDK import, warnings muted),
:func:`devices_text`, :func:`jsonable`, :func:`never_raises` (wrap a probe so an unexpected
exception becomes a not-present result naming it).
"""
# Probes must never raise, whatever a vendor library throws: blind excepts are the point here.
# ruff: noqa: BLE001
from __future__ import annotations

import functools
import importlib
import re
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable

__all__ = ["DeviceInfo", "GiB", "ProbeResult", "c_text", "devices_text", "error_text", "import_quietly", "jsonable",
           "never_raises", "slug"]

GiB = 1024 ** 3


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
    kind: str                      # the device kind: "cuda", "metax", "cpu", or a vendor's own
    present: bool                  # the device family is on this machine
    usable: bool                   # ... and this process can run on it (e.g. torch sees CUDA)
    reason: str                    # always set, human-readable
    devices: tuple[DeviceInfo, ...] = ()
    driver_version: str | None = None
    details: dict = field(default_factory=dict, hash=False, compare=False)
    emulated: bool = False
    notes: tuple[str, ...] = ()    # what the probe could not find out (also in reason); the plan's notes

    def to_dict(self) -> dict:
        """JSON-ready (``json.dumps(r.to_dict())``)."""
        return {"kind": self.kind, "present": self.present, "usable": self.usable, "reason": self.reason,
                "devices": [d.to_dict() for d in self.devices], "driver_version": self.driver_version,
                "details": jsonable(self.details), "emulated": self.emulated,
                "notes": list(self.notes)}

    def summary(self) -> str:
        """One line: state, then the reason (which names the devices)."""
        state = ("present, usable" if self.usable else "present, NOT usable") if self.present else "not present"
        if self.emulated:
            state += " (EMULATED)"
        return f"{self.kind}: {state} — {self.reason}"


def jsonable(x: Any) -> Any:
    if isinstance(x, dict):
        return {str(k): jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple, set, frozenset)):
        items = sorted(x) if isinstance(x, (set, frozenset)) else x
        return [jsonable(v) for v in items]
    if x is None or isinstance(x, (bool, int, float, str)):
        return x
    return str(x)


def error_text(e: BaseException) -> str:
    msg = str(e).strip()
    return f"{type(e).__name__}: {msg}" if msg else type(e).__name__


def c_text(v: Any) -> str:
    """A name or version from a C binding: bytes (NUL-terminated) or str -> stripped str."""
    if isinstance(v, (bytes, bytearray)):
        v = bytes(v).split(b"\0", 1)[0].decode("utf-8", "replace")
    return str(v).strip()


def slug(name: str) -> str:
    return re.sub(r"[^a-z0-9]+", "_", name.lower()).strip("_")


def import_quietly(name: str):
    """importlib.import_module with import-time warnings muted (legacy SDK shims warn)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return importlib.import_module(name)


def devices_text(devices) -> str:
    return "; ".join(d.describe() for d in devices)


def never_raises(kind: str) -> Callable[[Callable[..., ProbeResult]], Callable[..., ProbeResult]]:
    """Decorator for probes: an unexpected exception becomes ``ProbeResult(kind, present=False,
    ...)`` whose reason names it (belt and braces: the probe body already catches what its SDK
    is known to raise)."""
    def wrap(fn: Callable[..., ProbeResult]) -> Callable[..., ProbeResult]:
        @functools.wraps(fn)
        def probe(*args, **kwargs) -> ProbeResult:
            try:
                return fn(*args, **kwargs)
            except Exception as e:
                return ProbeResult(kind, False, False, f"{kind} probe failed unexpectedly: {error_text(e)}")
        return probe
    return wrap
