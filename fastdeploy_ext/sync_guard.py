"""Proof that a code path makes no device->host synchronisation.

On CUDA the proof is ``torch.cuda.set_sync_debug_mode('error')`` (CudaSyncGuard). Elsewhere a
TorchFunctionMode records explicit read-backs (item, tolist, cpu, numpy, __bool__, __int__,
__index__, __float__) on tensors of the watched device, plus the ops known to sync implicitly
when their inputs live on an accelerator (nonzero, unique, boolean-mask indexing,
repeat_interleave without output_size, ...). The recorder cannot see every implicit sync, so the
host path avoids those ops by construction; the recorder catches regressions.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
from torch.overrides import TorchFunctionMode

EXPLICIT_READBACKS = frozenset({"item", "tolist", "cpu", "numpy", "__bool__", "__int__", "__index__", "__float__"})
IMPLICIT_SYNC_OPS = frozenset({"nonzero", "unique", "unique_consecutive", "masked_select", "argwhere",
                               "nonzero_static", "repeat_interleave", "bincount", "histc"})


class HostSyncError(RuntimeError):
    pass


@dataclass
class SyncEvent:
    op: str
    device: str


def _tensor_devices(args, kwargs) -> set[str]:
    out = set()
    for a in list(args) + list((kwargs or {}).values()):
        if isinstance(a, torch.Tensor):
            out.add(a.device.type)
        elif isinstance(a, (list, tuple)):
            out |= {x.device.type for x in a if isinstance(x, torch.Tensor)}
    return out


class SyncRecorder(TorchFunctionMode):
    """Records (and optionally raises on) host syncs on tensors of ``watch`` device types.

    ``watch=None`` watches every device: on a CPU-only runner there is no real sync, but the
    same read-backs would be syncs on an accelerator, so they are flagged all the same.
    """

    def __init__(self, watch: set[str] | None = None, raise_on_sync: bool = False):
        super().__init__()
        self.watch, self.raise_on_sync = watch, raise_on_sync
        self.events: list[SyncEvent] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        devices = _tensor_devices(args, kwargs)
        hit = None
        if name in EXPLICIT_READBACKS:
            hit = devices
        elif name in IMPLICIT_SYNC_OPS and not (name == "repeat_interleave" and (kwargs or {}).get("output_size")):
            hit = devices - {"cpu"}
        elif name == "__getitem__" and len(args) > 1 and isinstance(args[1], torch.Tensor) \
                and args[1].dtype == torch.bool:
            hit = devices - {"cpu"}
        elif name == "tensor" and (kwargs or {}).get("device") not in (None, "cpu") \
                and torch.device((kwargs or {})["device"]).type != "cpu":
            hit = {torch.device(kwargs["device"]).type}
        if hit:
            hit = hit if self.watch is None else hit & self.watch
        if hit:
            ev = SyncEvent(name, ",".join(sorted(hit)))
            self.events.append(ev)
            if self.raise_on_sync:
                raise HostSyncError(f"host sync in a path that must not sync: {name} on {ev.device}")
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def cuda_sync_guard():
    """torch.cuda.set_sync_debug_mode('error') for the duration: any synchronising CUDA call
    raises. Restores the previous mode."""
    prev = torch.cuda.get_sync_debug_mode()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode(prev)
