"""The resolver of the deformable attention kind: a detector's multi-scale deformable sampling."""
from __future__ import annotations

from .choice import KernelChoice, KindContext, first_usable
from .table import DeformableAttentionEntry

#: the built-in backends of the kind and whether they run here (ATen's grid_sample runs everywhere)
BUILTIN_DEFORMABLE: dict[str, tuple[bool, str]] = {"aten_grid_sample": (True, "ATen grid_sample: every device")}


def resolve_deformable_attention(ctx: KindContext) -> KernelChoice:
    """The row's preference order filtered by dtype and presence (``ctx.available``: name ->
    (present, reason)); a forced one that cannot run is a PlanError."""

    def usable(e: DeformableAttentionEntry) -> str | None:
        if ctx.dtype not in e.dtypes:
            return f"dtype {ctx.dtype} not in {list(e.dtypes)}"
        ok, why = ctx.available.get(e.backend, (False, "not registered"))
        return None if ok else f"kernel unavailable: {why}"

    return first_usable(ctx, usable, "deformable attention", "deformable")
