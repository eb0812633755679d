"""The resolvers of the detector's kernel kinds: multi-scale deformable attention (the decoder's
cross-attention) and dense attention (the hybrid encoder's AIFI layer). Both pick the row's first
backend that takes the compute dtype and runs on this device."""
from __future__ import annotations

from .choice import KernelChoice, KindContext, first_usable

#: the built-in backends of each kind and whether they run here (ATen's run everywhere); the
#: runner passes what its kernel registry's backends say on its device instead
BUILTIN_DEFORMABLE: dict[str, tuple[bool, str]] = {"aten_grid_sample": (True, "ATen grid_sample: every device")}
BUILTIN_DENSE: dict[str, tuple[bool, str]] = {"sdpa": (True, "ATen scaled_dot_product_attention: every device")}


def _by_dtype_and_presence(ctx: KindContext, what: str, order: str) -> KernelChoice:
    """The row's preference order filtered by dtype and presence (``ctx.available``: name ->
    (present, reason)); a forced one that cannot run is a PlanError."""

    def usable(e) -> str | None:
        if ctx.dtype not in e.dtypes:
            return f"dtype {ctx.dtype} not in {list(e.dtypes)}"
        ok, why = ctx.available.get(e.backend, (False, "not registered"))
        return None if ok else f"kernel unavailable: {why}"

    return first_usable(ctx, usable, what, order)


def resolve_deformable_attention(ctx: KindContext) -> KernelChoice:
    return _by_dtype_and_presence(ctx, "deformable attention", "deformable")


def resolve_dense_attention(ctx: KindContext) -> KernelChoice:
    return _by_dtype_and_presence(ctx, "dense attention", "dense")
