"""The resolvers of DeepSeek-OCR-2's kernel kinds — SAM's attention with a decomposed
relative-position bias (windowed and global layers), the Qwen2 encoder's prefix-causal attention,
the MoE's routed expert GEMMs — and the vision tower's qkv layout. Each kind picks the row's
first backend that takes the compute dtype and runs on this device: the CUDA rows prefer our
Triton kernels for the attention kinds in half precision (the rel-pos bias added per tile, the
prefix mask as index arithmetic), every other row and dtype ATen's SDPA with a materialized bias
/ mask; a row whose Triton kernel cannot run (no triton, no CUDA) falls back to ATen with the
reason noted."""
from __future__ import annotations

import dataclasses
from typing import Mapping

from .choice import KernelChoice, KindContext, first_usable
from .kinds import ComponentKind, Decision, PlanError, QkvLayout, requested
from .table import CapabilityRow

TOWER_KINDS = (ComponentKind.RELPOS_WINDOW_ATTENTION, ComponentKind.RELPOS_GLOBAL_ATTENTION,
               ComponentKind.PREFIX_CAUSAL_ATTENTION, ComponentKind.MOE_EXPERTS)

_TRITON_UNPROBED = "Triton kernels need a CUDA device (the runner probes its own)"
_RELPOS = {"triton_relpos": (False, True, _TRITON_UNPROBED),
           "sdpa_bias": (True, True, "ATen SDPA with an additive bias: every device")}

#: per kind, the built-in backends as (present, reads_strides, reason) without a device: ATen's
#: run everywhere, the Triton kernels (ops/attention/biased.py) only where a runner finds CUDA
#: and triton; the runner passes what its kernel registry's backends say on its device instead
#: (KernelRegistry.tower_availability)
BUILTIN_TOWER: dict[ComponentKind, dict[str, tuple[bool, bool, str]]] = {
    ComponentKind.RELPOS_WINDOW_ATTENTION: dict(_RELPOS),
    ComponentKind.RELPOS_GLOBAL_ATTENTION: dict(_RELPOS),
    ComponentKind.PREFIX_CAUSAL_ATTENTION: {"triton_prefix_causal": (False, True, _TRITON_UNPROBED),
                                            "sdpa_mask": (True, True, "ATen SDPA with a boolean mask: every device")},
    ComponentKind.MOE_EXPERTS: {"triton_moe": (False, False, "Triton kernels need a CUDA device"),
                                "aten_moe": (True, False, "ATen matmuls: every device")},
}

_WHAT = {ComponentKind.RELPOS_WINDOW_ATTENTION: ("windowed rel-pos attention", "relpos_window"),
         ComponentKind.RELPOS_GLOBAL_ATTENTION: ("global rel-pos attention", "relpos_global"),
         ComponentKind.PREFIX_CAUSAL_ATTENTION: ("prefix-causal attention", "prefix_causal"),
         ComponentKind.MOE_EXPERTS: ("MoE experts", "moe_experts")}


def resolve_tower_kind(ctx: KindContext) -> KernelChoice:
    """The row's preference order filtered by dtype and presence (``ctx.available``: name ->
    (present, reads_strides, reason)); a forced one that cannot run is a PlanError."""

    def usable(e) -> str | None:
        if ctx.dtype not in e.dtypes:
            return f"dtype {ctx.dtype} not in {list(e.dtypes)}"
        ok, _, why = ctx.available.get(e.backend, (False, False, "not registered"))
        return None if ok else f"kernel unavailable: {why}"

    what, order = _WHAT[ctx.kind]
    choice = first_usable(ctx, usable, what, order)
    # the chosen backend's own word on this device (which kernel, what it needs) joins the reason
    here = ctx.available[choice.entry.backend][2]
    return dataclasses.replace(choice, decision=Decision(choice.decision.value, f"{choice.decision.reason}; {here}"))


def resolve_tower_qkv_layout(row: CapabilityRow, windowed: KernelChoice,
                             available: Mapping[str, tuple[bool, bool, str]], value: str) -> Decision:
    """SAM's q/k/v are views of its fused qkv projection: strided (no copy) where the kernel
    chosen for its windowed layers reads strides and the row does not narrow that, dense (each
    copied contiguous first) otherwise; the global layers use the same backend kind's list, the
    Qwen2 encoder has separate q/k/v projections (nothing to choose)."""
    want = requested(QkvLayout, value)
    backend = windowed.entry.backend
    _, reads, _ = available.get(backend, (False, False, ""))
    blockers = []
    if not reads:
        blockers.append(f"{backend} does not read strided q/k/v")
    elif windowed.entry.reads_strides is False:
        blockers.append(f"{backend}'s strided loads are not verified on row {row.name}")
    if want is QkvLayout.STRIDED and blockers:
        raise PlanError(f"row {row.name}: strided qkv impossible: {'; '.join(blockers)}")
    if want is not None:
        return Decision(want, "requested")
    if blockers:
        return Decision(QkvLayout.DENSE, "; ".join(blockers) + ": SAM's q/k/v copied contiguous")
    aten = " (ATen SDPA: it takes views of any strides, copying internally only where its kernel must)" \
        if backend.startswith("sdpa") else ""
    return Decision(QkvLayout.STRIDED, f"{backend} reads strided q/k/v{aten}: SAM's fused qkv projection is "
                                       "passed as views")
