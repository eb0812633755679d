"""The resolver of the vision varlen attention kind: packed variable-length images, no cache."""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Mapping

from .choice import KernelChoice, KindContext, forced_entry
from .kinds import Decision, PlanError
from .table import AttentionEntry, CapabilityRow, KernelFacts


@dataclass(frozen=True)
class VisionKernels:
    """The row's vision attention entries as this device sees them (facts + presence)."""
    row: CapabilityRow
    kernels: Mapping[str, KernelFacts]
    head_dim: int
    dtype: str

    MISSING: ClassVar[KernelFacts] = KernelFacts(False, False, (0, 0), False, "not registered")

    def facts(self, e: AttentionEntry) -> KernelFacts:
        return self.kernels.get(e.backend, self.MISSING)

    def usable(self, e: AttentionEntry) -> str | None:
        f = self.facts(e)
        if e.backend in self.kernels and not f.head_dims[0] <= self.head_dim <= f.head_dims[1]:
            return f"head_dim {self.head_dim} outside {list(f.head_dims)}"
        if self.dtype not in e.dtypes:
            return f"dtype {self.dtype} not in {list(e.dtypes)}"
        return None if f.present else f"kernel unavailable: {f.reason}"

    @classmethod
    def of(cls, ctx: KindContext) -> "VisionKernels":
        return cls(ctx.row, ctx.available, ctx.component.head_dim, ctx.dtype)


def resolve_vision_attention(ctx: KindContext) -> KernelChoice:
    """The row's preference list filtered by head_dim, dtype and presence (graph-safe first when
    encoder graphs are requested); the usable ones not chosen are the fallbacks."""
    vk, row = VisionKernels.of(ctx), ctx.row
    entries = ctx.entries
    if ctx.forced is not None:
        e = forced_entry(row, entries, ctx.forced, "attention backend", vk.usable)
        return KernelChoice(e, Decision(e.backend, "requested"))
    candidates, skipped = [], []
    for e in entries:
        why = vk.usable(e)
        if why:
            skipped.append(f"attention {e.backend} skipped: {why}; falling back")
        else:
            candidates.append(e)
    ctx.notes.extend(skipped)
    if not candidates:
        raise PlanError(f"row {row.name}: no attention backend can run here ({'; '.join(skipped)})")
    chosen = candidates[0]
    reason = f"first usable in row {row.name} preference order"
    graph_safe = [e for e in candidates if vk.facts(e).graph_safe]
    if ctx.request.graph_config.use_encoder_cudagraph and not vk.facts(chosen).graph_safe and graph_safe:
        # graphs explicitly requested (e.g. the MetaX opt-in): the replay needs a fixed grid
        chosen = graph_safe[0]
        reason = f"encoder graphs requested: first graph-safe backend of row {row.name}"
    return KernelChoice(chosen, Decision(chosen.backend, reason), tuple(e.backend for e in candidates if e is not chosen))
