"""The resolver of the paged decoder attention kind: the text decoder over the paged KV cache."""
from __future__ import annotations

from .choice import KernelChoice, KindContext, first_usable
from .table import TextAttentionEntry


def resolve_paged_attention(ctx: KindContext) -> KernelChoice:
    """The row's preference order filtered by head_dim, dtype and run-time presence (a forced
    one that cannot run is a PlanError). ``ctx.available``: name -> (present, reason)."""
    head_dim = ctx.component.head_dim

    def usable(e: TextAttentionEntry) -> str | None:
        if not e.head_dims[0] <= head_dim <= e.head_dims[1]:
            return f"head_dim {head_dim} outside {list(e.head_dims)}"
        if ctx.dtype not in e.dtypes:
            return f"dtype {ctx.dtype} not in {list(e.dtypes)}"
        ok, why = ctx.available.get(e.backend, (False, "not registered"))
        return None if ok else f"kernel unavailable: {why}"

    return first_usable(ctx, usable, "text attention", "text")
