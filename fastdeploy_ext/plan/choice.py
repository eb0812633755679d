"""What every kind's resolver reads (KindContext) and returns (KernelChoice)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping

from .kinds import Component, ComponentKind, Decision, PlanError, requested_backend
from .request import PlanRequest
from .table import CapabilityRow, KernelEntry


@dataclass(frozen=True)
class KindContext:
    """One kernel kind's resolution: the row, the user's request, the compute dtype, the model's
    component of this kind, and what each of the kind's backends says on this device."""
    row: CapabilityRow
    kind: ComponentKind
    component: Component
    request: PlanRequest
    dtype: str
    available: Mapping[str, Any]      # backend name -> its facts here (the kind's own type)
    notes: list[str]                  # the plan's notes (skipped backends are recorded here)

    @property
    def entries(self) -> tuple[KernelEntry, ...]:
        """The row's backends for this kind; a row that lists none cannot run the component."""
        entries = self.row.entries(self.kind)
        if not entries:
            raise PlanError(f"row {self.row.name} lists no backend for kernel kind {self.kind} "
                            f"(the model's {self.component.name} needs one): add kernels.{self.kind} to the row")
        return entries

    @property
    def forced(self) -> str | None:
        """The backend the user forced for this kind, None for auto."""
        return requested_backend(self.request.backend_for(self.kind))


@dataclass(frozen=True)
class KernelChoice:
    """A kind's resolution: the row entry chosen, the decision (value: its backend name) and the
    usable backends it was preferred over."""
    entry: KernelEntry
    decision: Decision
    fallbacks: tuple[str, ...] = ()


def forced_entry(row: CapabilityRow, entries, requested: str, what: str,
                 usable: Callable[[Any], str | None]) -> KernelEntry:
    """The row's entry named ``requested`` (a backend the user forced), or a PlanError saying
    that the row does not list it or why it cannot run here."""
    e = next((e for e in entries if e.backend == requested), None)
    if e is None:
        raise PlanError(f"row {row.name} does not list {what} {requested!r}; "
                        f"it lists {', '.join(e.backend for e in entries)}")
    why = usable(e)
    if why:
        raise PlanError(f"row {row.name}: {what} {requested} cannot run here: {why}")
    return e


def first_usable(ctx: KindContext, usable: Callable[[Any], str | None], what: str, order: str) -> KernelChoice:
    """The entry a kind with one kernel per step resolves to: the backend the user forced (a
    PlanError when the row lacks it or it cannot run), else the first of the row's preference
    order that ``usable`` accepts (None, or why not); each skipped one is noted as a fallback."""
    row, entries = ctx.row, ctx.entries
    if ctx.forced is not None:
        e = forced_entry(row, entries, ctx.forced, f"{what} backend", usable)
        return KernelChoice(e, Decision(e.backend, "requested"))
    skipped = []
    for e in entries:
        why = usable(e)
        if why is None:
            reason = f"first usable in row {row.name} {order} preference order"
            return KernelChoice(e, Decision(e.backend, reason + (f" (skipped {'; '.join(skipped)})" if skipped else "")))
        skipped.append(f"{e.backend}: {why}")
        ctx.notes.append(f"{what} {e.backend} skipped: {why}; falling back")
    raise PlanError(f"row {row.name}: no {what} backend can run here ({'; '.join(skipped)})")
