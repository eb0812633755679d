"""The resolver of the paged decoder attention kind: the text decoder over the paged KV cache."""
from __future__ import annotations

from .choice import KernelChoice, KindContext, forced_entry
from .kinds import Decision, PlanError
from .table import TextAttentionEntry


def resolve_paged_attention(ctx: KindContext) -> KernelChoice:
    """The row's preference order filtered by head_dim, dtype and run-time presence (a forced
    one that cannot run is a PlanError). ``ctx.available``: name -> (present, reason)."""
    row, head_dim = ctx.row, ctx.component.head_dim

    def usable(e: TextAttentionEntry) -> str | None:
        if not e.head_dims[0] <= head_dim <= e.head_dims[1]:
            return f"head_dim {head_dim} outside {list(e.head_dims)}"
        if ctx.dtype not in e.dtypes:
            return f"dtype {ctx.dtype} not in {list(e.dtypes)}"
        ok, why = ctx.available.get(e.backend, (False, "not registered"))
        return None if ok else f"kernel unavailable: {why}"

    entries = ctx.entries
    if ctx.forced is not None:
        e = forced_entry(row, entries, ctx.forced, "text attention backend", usable)
        return KernelChoice(e, Decision(e.backend, "requested"))
    skipped = []
    for e in entries:
        why = usable(e)
        if why is None:
            reason = f"first usable in row {row.name} text preference order"
            return KernelChoice(e, Decision(e.backend, reason + (f" (skipped {'; '.join(skipped)})" if skipped else "")))
        skipped.append(f"{e.backend}: {why}")
        ctx.notes.append(f"text attention {e.backend} skipped: {why}; falling back")
    raise PlanError(f"row {row.name}: no text attention backend can run here ({'; '.join(skipped)})")
