"""The plan's vocabulary: its error, its typed choices, the component kinds a model declares and
the Decision every choice is recorded as."""
from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Any, Sequence, TypeVar

DTYPES = ("auto", "float32", "bfloat16", "float16")
QKV_LAYOUTS = ("auto", "strided", "dense")
GRID_SOURCES = ("auto", "host", "device")
SWITCHES = ("auto", "on", "off")
AUTO = "auto"       # a flag left to the row


class PlanError(ValueError):
    """The requested configuration is impossible on this device; names the capability row."""


class _Choice(str, Enum):
    """A plan value that prints and serialises as its plain name (``host``, ``strided``)."""

    def __str__(self) -> str:
        return self.value


class GridSource(_Choice):
    """Where the vision pass's per-batch metadata is derived."""
    HOST = "host"          # from the preprocessor's Python ints: no device->host syncs
    DEVICE = "device"      # from a grid tensor on the device (the reference behaviour)


class QkvLayout(_Choice):
    STRIDED = "strided"    # the kernel reads views of the fused qkv projection
    DENSE = "dense"


class Switch(_Choice):
    """An on/off flag the user may force (``auto`` leaves it to the row)."""
    ON = "on"
    OFF = "off"


C = TypeVar("C", bound=_Choice)


def requested(choice: type[C], value: str) -> C | None:
    """A flag's value as its typed choice, None for ``auto`` (PlanRequest.validate has already
    refused values outside the choice)."""
    return None if value == AUTO else choice(value)


def requested_backend(value: str) -> str | None:
    """A forced kernel backend's name, None for ``auto`` (names are open: backends contribute them)."""
    return None if value == AUTO else value


# --------------------------------------------------------------- what a model declares
class ComponentKind(_Choice):
    """The kernel kinds a model family's components need; the plan resolves one kernel per kind,
    from the row's preference list for that kind (``kernels:`` in a capability row). A new kind
    (detector attention, windowed attention with a relative-position bias, MoE GEMMs) adds a
    member here, an entry parser (plan/table.py) and a resolver (plan/resolve.py)."""
    VISION_VARLEN_ATTENTION = "vision_varlen_attention"     # packed variable-length images, no cache
    PAGED_DECODER_ATTENTION = "paged_decoder_attention"     # the decoder over the paged KV cache
    DEFORMABLE_ATTENTION = "deformable_attention"           # a detector's multi-scale deformable sampling
    DENSE_ATTENTION = "dense_attention"                     # unmasked attention over equal-length sequences
    #                                                         (a detector's AIFI layer: one feature map a page)
    # DeepSeek-OCR-2's vision tower and MoE decoder (equal-length sequences, no cache)
    RELPOS_WINDOW_ATTENTION = "relpos_window_attention"     # windows of a grid with a decomposed
    #                                                         relative-position bias (SAM's windowed layers)
    RELPOS_GLOBAL_ATTENTION = "relpos_global_attention"     # the whole grid with that bias (SAM's global layers)
    PREFIX_CAUSAL_ATTENTION = "prefix_causal_attention"     # a bidirectional prefix, causal queries after it
    #                                                         (an encoder over [visual tokens, learned queries])
    MOE_EXPERTS = "moe_experts"                             # the routed experts' GEMMs of a mixture of experts


@dataclass(frozen=True)
class Component:
    """A part of a model that needs a kernel chosen for it, with the facts the choice reads."""
    name: str                          # e.g. "vision.attention"
    kind: ComponentKind
    head_dim: int
    num_heads: int
    num_kv_heads: int | None = None    # paged decoder attention: heads of the KV cache
    #: what a component that is no attention is, for describe() (MoE experts: their count and
    #: widths); its head_dim / num_heads are 0
    detail: str | None = None


def component_of(components: Sequence[Component], kind: ComponentKind) -> Component:
    """The one component of ``kind`` (a family declares each kind at most once today)."""
    found = [c for c in components if c.kind is kind]
    if len(found) != 1:
        raise PlanError(f"the model declares {len(found)} components of kind {kind} "
                        f"({', '.join(c.name for c in found) or 'none'}); the plan resolves exactly one")
    return found[0]


def components_by_kind(components: Sequence[Component]) -> dict[ComponentKind, Component]:
    """kind -> the model's component of that kind; a kind declared twice is a PlanError (one
    kernel per kind)."""
    out: dict[ComponentKind, Component] = {}
    for c in components:
        if c.kind in out:
            raise PlanError(f"the model declares 2 components of kind {c.kind} ({out[c.kind].name}, {c.name}); "
                            "the plan resolves exactly one")
        out[c.kind] = c
    return out


@dataclass(frozen=True)
class Decision:
    value: Any
    reason: str
