"""No silent fallbacks: where a run takes another path than its plan's decisions promise, it is
known before the first batch, written into the plan's notes and logged once per process.

Today's fallbacks:
* fused layers planned, but the Triton passes cannot run on the tensors' device (e.g. the
  Triton interpreter with CUDA tensors): q/k rotary and residual+LayerNorm run as ATen ops;
* fused layers on CUDA with a torch lacking the private ``_addmm_activation``: fc1's tanh GELU
  is its own kernel instead of cuBLASLt's epilogue (the device API's fallback_notes: the CUDA
  backend's says so);
* bf16 on a CPU where oneDNN's linear with a GELU post-op does not run: fc1's GELU is its own
  ATen op;
* whatever the device probe could not find out (e.g. the GPU driver-version query failing):
  the probe's ``notes``.

The op that takes a fallback at run time logs the same message through ``log_once``, so a
caller that never made a plan (a benchmark, a test) is told too — once.
"""
from __future__ import annotations

import functools
import logging

import torch

from .device_api import device_api_for

log = logging.getLogger(__name__)


@functools.cache
def log_once(message: str) -> None:
    """Log ``message`` at WARNING the first time this process sees it (functools.cache: the
    memo of what was said is the only state)."""
    log.warning("%s", message)


def onednn_gelu_unfused_note(why: str) -> str:
    return f"bf16 on CPU: fc1's GELU runs as its own ATen op, not oneDNN's GEMM post-op ({why})"


@functools.cache
def onednn_linear_gelu_usable(dtype: torch.dtype) -> tuple[bool, str]:
    """Whether oneDNN's linear with a GELU post-op runs here in ``dtype`` (tried once per process
    on a tiny problem: a CPU without native bf16 may lack the primitive)."""
    op = getattr(getattr(torch.ops, "mkldnn", None), "_linear_pointwise", None)
    if op is None or not torch.backends.mkldnn.is_available():
        return False, "this torch has no oneDNN linear_pointwise op"
    try:
        x = torch.ones(4, 16, dtype=dtype)
        op(x, torch.ones(8, 16, dtype=dtype), torch.zeros(8, dtype=dtype), "gelu", [], "tanh")
    except RuntimeError as e:
        return False, f"oneDNN refused a {dtype} linear+GELU here ({str(e).splitlines()[0][:120]})"
    return True, "oneDNN linear with a GELU post-op"


def rotary_aten_note(why: str) -> str:
    return f"fused layers: q/k rotary and residual+LayerNorm run as ATen ops, not the Triton passes ({why})"


GELU_UNFUSED_NOTE = ("fused layers: fc1's tanh GELU runs as its own kernel, not cuBLASLt's epilogue "
                     "(this torch has no torch._addmm_activation)")


def triton_passes_usable(device: torch.device) -> tuple[bool, str]:
    from .ops.triton import runtime
    if runtime.kernels_usable(torch.empty(0, device=device)):
        return True, "Triton passes run on this device"
    if runtime.triton is None:
        return False, "triton is not importable"
    if runtime.TRITON_INTERPRETED:
        return False, f"Triton runs interpreted (TRITON_INTERPRET=1): CPU tensors only, the device is {device.type}"
    return False, f"Triton kernels need a CUDA device, the device is {device.type}"


def fused_passes_usable(t: torch.Tensor) -> bool:
    """Whether the Triton layer passes run on ``t``; when not, the rotary fallback is logged
    (once) by the op that takes it."""
    usable, why = triton_passes_usable(t.device)
    if not usable:
        log_once(rotary_aten_note(why))
    return usable


def addmm_activation_available() -> bool:
    """torch has the private op ops.activation.linear_gelu fuses the GELU with (looked up at
    call time there too)."""
    return getattr(torch, "_addmm_activation", None) is not None


def fallback_notes(device: torch.device, fused_layers: bool, probe=None, dtype: torch.dtype | None = None
                   ) -> tuple[str, ...]:
    """The fallbacks a runner on ``device`` with this plan will take, as plan notes (each
    logged once)."""
    notes: list[str] = []
    if device.type == "cpu" and dtype == torch.bfloat16:
        usable, why = onednn_linear_gelu_usable(dtype)
        if not usable:
            notes.append(onednn_gelu_unfused_note(why))
    if fused_layers:
        usable, why = triton_passes_usable(device)
        if not usable:
            notes.append(rotary_aten_note(why))
    notes += device_api_for(device).fallback_notes(fused_layers)
    notes += [f"probe: {n}" for n in getattr(probe, "notes", ())]
    for n in notes:
        log_once(n)
    return tuple(notes)
