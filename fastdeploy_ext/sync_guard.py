"""Proof that a code path makes no device->host synchronisation.

``HostSyncGuard(watch)`` fails on every way a path can wait for a device of the watched types:

* data-dependent ops on a watched tensor, whose output size (or value) the host must read back:
  ``nonzero``/``argwhere``/one-argument ``where``, boolean-mask indexing and masked assignment,
  ``masked_select``, ``repeat_interleave`` with tensor repeats and no ``output_size``,
  ``unique``/``unique_consecutive``, ``bincount``, ``one_hot`` without ``num_classes`` — found by
  the ATen tags ``dynamic_output_shape``/``data_dependent_output`` plus the composite ops that
  reach the dispatcher before being decomposed (in inference mode they do);
* reading a watched tensor on the host: ``item``, ``int()``/``bool()``/``float()``, sizes taken
  from tensors (``torch.zeros(t[0])``), ``torch.equal``/``allclose``, ``tolist``, ``numpy``;
* device->host transfers: ``.to("cpu")``, ``.cpu()``, ``copy_`` into a host tensor;
* blocking host->device copies: ``.to(device)`` / ``copy_`` from a host tensor without
  ``non_blocking=True``. On CUDA such a copy waits for the stream's queued work first (torch
  synchronizes the stream after it); ``x[idx] = 0.0`` on a device tensor makes one (torch builds
  the scalar on the host and uploads it blocking), so the step paths pass device values.

It is a TorchDispatchMode (every ATen op, so composite Python helpers cannot hide one) plus a
TorchFunctionMode for the read-backs that never reach the dispatcher (``numpy``). Host tensors
are free: the host metadata path computes on them by design.

Which device to watch: on an accelerator, its own type. On a CPU a ``.to("cpu")`` moves nothing
and host and "device" tensors are indistinguishable, so the checked path runs with its
device-side tensors on ``meta`` and the guard watches ``meta`` (TorchRunner.sync_check_runner).

On CUDA ``torch.cuda.set_sync_debug_mode('error')`` is the second, independent proof
(``cuda_sync_guard``): the driver-level check that fires on whatever this op list misses.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Iterable

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


class HostSyncError(RuntimeError):
    """A path that must not synchronise with the device did; the message names the op."""


@dataclass(frozen=True)
class SyncEvent:
    op: str
    device: str
    why: str


# ops that read a device value back to the host whatever their arguments
READBACK_OPS = frozenset({"item", "_local_scalar_dense", "is_nonzero", "equal", "allclose", "tolist"})
# ops whose output size depends on the data (composites that reach the dispatcher first included)
DATA_DEPENDENT_OPS = frozenset({"nonzero", "argwhere", "nonzero_numpy", "masked_select", "_unique", "_unique2",
                                "unique_dim", "unique_consecutive", "unique_dim_consecutive", "bincount"})
# ops that are data dependent only with some arguments (checked in _conditional)
CONDITIONAL_OPS = frozenset({"index", "index_put", "index_put_", "_index_put_impl_", "repeat_interleave",
                             "one_hot", "where", "tensor_split"})
COPY_OPS = frozenset({"copy_", "_copy_from", "_copy_from_and_resize"})
CONVERT_OPS = frozenset({"to", "_to_copy"})
# Tensor methods that read data without an ATen op on the way (numpy) or whose name is clearer
# than the ATen op they become
FUNCTION_READBACKS = frozenset({"numpy", "__array__", "tolist", "item"})


def _tensors(tree) -> list[torch.Tensor]:
    return [x for x in tree_flatten(tree)[0] if isinstance(x, torch.Tensor)]


def _is_mask(t) -> bool:
    return isinstance(t, torch.Tensor) and t.dtype in (torch.bool, torch.uint8)


def _conditional(name: str, args, kwargs) -> str | None:
    """Why this call of a conditionally data-dependent op must sync, or None."""
    if name in ("index", "index_put", "index_put_", "_index_put_impl_"):
        indices = args[1] if len(args) > 1 else kwargs.get("indices", ())
        if any(_is_mask(i) for i in indices or ()):
            return "boolean-mask indexing (output size = number of true elements)"
    elif name == "repeat_interleave":
        repeats = args[1] if len(args) > 1 else kwargs.get("repeats")
        if isinstance(args[0], torch.Tensor) and args[0].dtype in (torch.int32, torch.int64) and len(args) == 1:
            repeats = args[0]                      # repeat_interleave(repeats) overload
        if isinstance(repeats, torch.Tensor) and kwargs.get("output_size") is None:
            return "repeat_interleave with tensor repeats and no output_size"
    elif name == "one_hot":
        num_classes = args[1] if len(args) > 1 else kwargs.get("num_classes", -1)
        if num_classes == -1:
            return "one_hot without num_classes (reads the maximum)"
    elif name == "where":
        if len(args) + len(kwargs) == 1:
            return "one-argument where (nonzero)"
    elif name == "tensor_split":
        if any(isinstance(a, torch.Tensor) for a in args[1:2]):
            return "tensor_split with tensor indices (read on the host)"
    return None


def _target_device(args, kwargs) -> torch.device | None:
    dev = kwargs.get("device")
    if dev is None:
        for a in args[1:]:
            if isinstance(a, (torch.device, str)):
                try:
                    dev = torch.device(a)
                except RuntimeError:
                    continue
                break
            if isinstance(a, torch.Tensor):        # .to(other)
                dev = a.device
                break
    return torch.device(dev) if dev is not None else None


class _DispatchWatch(TorchDispatchMode):
    def __init__(self, guard: "HostSyncGuard"):
        super().__init__()
        self.guard = guard

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func.overloadpacket.__name__
        watched = [t for t in _tensors((args, kwargs)) if t.device.type in self.guard.watch]
        why, where = None, watched[0].device.type if watched else None      # where: the device named
        blocking = not kwargs.get("non_blocking", False)
        upload = "blocking host->device copy (waits for the device's queued work)"
        if name in CONVERT_OPS and args and isinstance(args[0], torch.Tensor):
            src, dst = args[0].device, _target_device(args, kwargs)
            if src.type in self.guard.watch and dst is not None and dst.type == "cpu":
                why, where = "device->host transfer", src.type
            elif src.type == "cpu" and dst is not None and dst.type in self.guard.watch and blocking:
                why, where = upload, dst.type
        elif name in COPY_OPS and len(args) >= 2:
            dst, src = args[0], args[1]
            blocking = blocking and not (len(args) > 2 and args[2] is True)
            if isinstance(src, torch.Tensor) and src.device.type in self.guard.watch and dst.device.type == "cpu":
                why, where = "device->host copy into a host tensor", src.device.type
            elif isinstance(src, torch.Tensor) and src.device.type == "cpu" and dst.device.type in self.guard.watch \
                    and blocking:
                why, where = upload, dst.device.type
        elif watched:
            if name in READBACK_OPS or torch.Tag.data_dependent_output in func.tags:
                why = "reads a device value on the host"
            elif name in DATA_DEPENDENT_OPS:
                why = "output size depends on the data"
            elif name in CONDITIONAL_OPS:
                why = _conditional(name, args, kwargs)
            elif torch.Tag.dynamic_output_shape in func.tags:
                why = "output size depends on the data"
        if why:
            self.guard.hit(str(func), where, why)
        return func(*args, **kwargs)


class _FunctionWatch(TorchFunctionMode):
    def __init__(self, guard: "HostSyncGuard"):
        super().__init__()
        self.guard = guard

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if name in FUNCTION_READBACKS and args and isinstance(args[0], torch.Tensor) \
                and args[0].device.type in self.guard.watch:
            self.guard.hit(f"Tensor.{name}", args[0].device.type, "reads a device tensor on the host")
        elif name == "__setitem__" and len(args) == 3 and isinstance(args[0], torch.Tensor) \
                and args[0].device.type in self.guard.watch and _scalar_into_advanced_index(args[1], args[2]):
            # on CUDA torch makes the scalar a host tensor and index_put_ uploads it blocking
            # (what a "meta" run cannot show: there the scalar is made on meta)
            self.guard.hit("Tensor.__setitem__", args[0].device.type,
                           "a Python scalar assigned through tensor indices (uploaded blocking)")
        return func(*args, **(kwargs or {}))


def _scalar_into_advanced_index(index, value) -> bool:
    """``t[index] = value`` with a Python number for value and a tensor among the indices."""
    if not isinstance(value, (bool, int, float)):
        return False
    return any(isinstance(i, torch.Tensor) for i in (index if isinstance(index, tuple) else (index,)))


class HostSyncGuard:
    """Context manager: raises HostSyncError at the first sync on a ``watch``ed device type
    (``raise_on_sync=False`` records them in ``events`` instead)."""

    def __init__(self, watch: Iterable[str], raise_on_sync: bool = True):
        self.watch = frozenset(watch)
        if "cpu" in self.watch:
            raise ValueError("the host is not a device to guard: run the checked path with its device tensors "
                             "on 'meta' (TorchRunner.sync_check_runner) and watch 'meta'")
        self.raise_on_sync = raise_on_sync
        self.events: list[SyncEvent] = []
        self._stack: contextlib.ExitStack | None = None

    def hit(self, op: str, device: str, why: str) -> None:
        ev = SyncEvent(op, device, why)
        self.events.append(ev)
        if self.raise_on_sync:
            raise HostSyncError(f"host sync in a path that must not sync: {op} on {device} ({why})")

    def __enter__(self) -> "HostSyncGuard":
        self._stack = contextlib.ExitStack()
        self._stack.enter_context(_FunctionWatch(self))
        self._stack.enter_context(_DispatchWatch(self))
        return self

    def __exit__(self, *exc) -> bool:
        stack, self._stack = self._stack, None
        return bool(stack.__exit__(*exc))


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


@contextlib.contextmanager
def cuda_host_sync_guard(device_type: str = "cuda"):
    """The guard of CUDA-style devices (CUDA, MetaX MACA): the driver-level check plus the
    op-level guard, which names the op when it is one of the known ways to sync."""
    with cuda_sync_guard(), HostSyncGuard(watch={device_type}):
        yield
