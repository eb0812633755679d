"""The resolver of the deformable attention kind: a detector's multi-scale deformable sampling."""
from __future__ import annotations

from .choice import KernelChoice, KindContext, forced_entry
from .kinds import Decision, PlanError
from .table import DeformableAttentionEntry

#: the built-in backends of the kind and whether they run here (ATen's grid_sample runs everywhere)
BUILTIN_DEFORMABLE: dict[str, tuple[bool, str]] = {"aten_grid_sample": (True, "ATen grid_sample: every device")}


def resolve_deformable_attention(ctx: KindContext) -> KernelChoice:
    """The row's preference order filtered by dtype and presence (``ctx.available``: name ->
    (present, reason)); a forced one that cannot run is a PlanError."""
    row = ctx.row

    def usable(e: DeformableAttentionEntry) -> str | None:
        if ctx.dtype not in e.dtypes:
            return f"dtype {ctx.dtype} not in {list(e.dtypes)}"
        ok, why = ctx.available.get(e.backend, (False, "not registered"))
        return None if ok else f"kernel unavailable: {why}"

    entries = ctx.entries
    if ctx.forced is not None:
        e = forced_entry(row, entries, ctx.forced, "deformable attention backend", usable)
        return KernelChoice(e, Decision(e.backend, "requested"))
    skipped = []
    for e in entries:
        why = usable(e)
        if why is None:
            return KernelChoice(e, Decision(e.backend, f"first usable in row {row.name} deformable preference order"))
        skipped.append(f"{e.backend}: {why}")
        ctx.notes.append(f"deformable attention {e.backend} skipped: {why}; falling back")
    raise PlanError(f"row {row.name}: no deformable attention backend can run here ({'; '.join(skipped)})")
