"""Kernel backend objects per component kind: the framework's built-ins, and a runner's table.

A backend object owns its kernel's facts (ops/attention/varlen.py's VarlenAttention, paged.py's
PagedAttentionBackend); a capability row names backends per kind and the plan picks. The
built-ins are one immutable registry (:func:`builtin_kernels`). A device backend may contribute
kernels of its own (``DeviceRunner.kernel_backends()``); :func:`kernels_for` composes a runner
class's table as the built-ins plus its contributions, a new immutable registry per runner, so a
contributed kernel is visible only to the runner that contributed it — never to another
backend's runner, nor to the next test.
"""
from __future__ import annotations

import functools
from types import MappingProxyType
from typing import Any, Mapping, Sequence

import torch

from ..plan.kinds import ComponentKind


def _kind_types() -> dict[ComponentKind, type]:
    from .attention.deformable import DeformableAttentionBackend
    from .attention.dense import DenseAttentionBackend
    from .attention.paged import PagedAttentionBackend
    from .attention.biased import PrefixCausalAttention, RelPosAttention
    from .attention.varlen import VarlenAttention
    from .moe import MoEExpertsBackend
    return {ComponentKind.VISION_VARLEN_ATTENTION: VarlenAttention,
            ComponentKind.PAGED_DECODER_ATTENTION: PagedAttentionBackend,
            ComponentKind.DEFORMABLE_ATTENTION: DeformableAttentionBackend,
            ComponentKind.DENSE_ATTENTION: DenseAttentionBackend,
            ComponentKind.RELPOS_WINDOW_ATTENTION: RelPosAttention,
            ComponentKind.RELPOS_GLOBAL_ATTENTION: RelPosAttention,
            ComponentKind.PREFIX_CAUSAL_ATTENTION: PrefixCausalAttention,
            ComponentKind.MOE_EXPERTS: MoEExpertsBackend}


class KernelRegistry:
    """Backend objects by kind and name; immutable (composition makes a new registry)."""

    def __init__(self, by_kind: Mapping[ComponentKind, Mapping[str, Any]], origin: Mapping[str, str] | None = None):
        self._by_kind = MappingProxyType({k: MappingProxyType(dict(v)) for k, v in by_kind.items()})
        self._origin = MappingProxyType(dict(origin or {}))      # "kind/name" -> who contributed it

    def backends(self, kind: ComponentKind) -> Mapping[str, Any]:
        """name -> backend object of ``kind`` (read-only)."""
        return self._by_kind.get(kind, MappingProxyType({}))

    def get(self, kind: ComponentKind, name: str) -> Any:
        backends = self.backends(kind)
        if name not in backends:
            raise ValueError(f"unknown {kind} backend {name!r}; known: {', '.join(backends) or 'none'}")
        return backends[name]

    def origin(self, kind: ComponentKind, name: str) -> str:
        """``built-in`` or the backend that contributed it."""
        return self._origin.get(f"{kind}/{name}", "built-in")

    def with_contributions(self, contributed: Mapping[ComponentKind, Sequence[Any]], contributor: str
                           ) -> "KernelRegistry":
        """This registry plus ``contributor``'s backend objects. A kind that is no ComponentKind,
        an object of the wrong type for its kind, or a name already taken is a ValueError naming
        the contributor (a contribution never replaces a built-in)."""
        if not contributed:
            return self
        types = _kind_types()
        merged = {k: dict(v) for k, v in self._by_kind.items()}
        origin = dict(self._origin)
        for kind, objects in contributed.items():
            if not isinstance(kind, ComponentKind):
                raise ValueError(f"backend {contributor}: kernel_backends() key {kind!r} is not a ComponentKind "
                                 f"(known: {', '.join(k.value for k in ComponentKind)})")
            for obj in objects:
                if not isinstance(obj, types[kind]):
                    raise ValueError(f"backend {contributor}: a {kind} backend must be a {types[kind].__name__}, "
                                     f"got {type(obj).__name__}")
                table = merged.setdefault(kind, {})
                if obj.name in table:
                    raise ValueError(f"backend {contributor}: {kind} backend {obj.name!r} is already registered "
                                     f"({origin.get(f'{kind}/{obj.name}', 'built-in')}); give it a name of its own")
                table[obj.name] = obj
                origin[f"{kind}/{obj.name}"] = contributor
        return KernelRegistry(merged, origin)

    def vision_facts(self, device: torch.device):
        """Every vision attention backend's facts with its availability on ``device``: the plan's input."""
        return {n: b.facts(b.available(device)) for n, b in self.backends(ComponentKind.VISION_VARLEN_ATTENTION).items()}

    def paged_availability(self, device: torch.device) -> dict[str, tuple[bool, str]]:
        """Every paged decoder attention backend's (present, reason) on ``device``."""
        return self.availability(ComponentKind.PAGED_DECODER_ATTENTION, device)

    def availability(self, kind: ComponentKind, device: torch.device) -> dict[str, tuple[bool, str]]:
        """Every ``kind`` backend's (present, reason) on ``device`` (kinds whose objects say it
        with ``available(device)``)."""
        return {n: b.available(device) for n, b in self.backends(kind).items()}

    def tower_availability(self, device: torch.device) -> dict[ComponentKind, dict[str, tuple[bool, bool, str]]]:
        """DeepSeek-OCR-2's kinds: per kind, every backend's (present, reads_strides, reason) on
        ``device`` (reads_strides False for kinds that take no q/k/v)."""
        from ..plan.tower_kinds import TOWER_KINDS
        out = {}
        for kind in TOWER_KINDS:
            out[kind] = {}
            for n, b in self.backends(kind).items():
                ok, why = b.available(device)
                out[kind][n] = (ok, bool(getattr(b, "reads_strides", False)), why)
        return out


@functools.cache
def builtin_kernels() -> KernelRegistry:
    """The framework's own backends (built once: the registry is immutable)."""
    from .attention.deformable import BUILTIN_DEFORMABLE_BACKENDS
    from .attention.dense import BUILTIN_DENSE_BACKENDS
    from .attention.paged import BUILTIN_PAGED_BACKENDS
    from .attention.biased import BUILTIN_PREFIX_BACKENDS, BUILTIN_RELPOS_BACKENDS
    from .attention.varlen import BUILTIN_VARLEN_BACKENDS
    from .moe import BUILTIN_MOE_BACKENDS
    return KernelRegistry({ComponentKind.VISION_VARLEN_ATTENTION: {b.name: b for b in BUILTIN_VARLEN_BACKENDS},
                           ComponentKind.PAGED_DECODER_ATTENTION: {b.name: b for b in BUILTIN_PAGED_BACKENDS},
                           ComponentKind.DEFORMABLE_ATTENTION: {b.name: b for b in BUILTIN_DEFORMABLE_BACKENDS},
                           ComponentKind.DENSE_ATTENTION: {b.name: b for b in BUILTIN_DENSE_BACKENDS},
                           ComponentKind.RELPOS_WINDOW_ATTENTION: {b.name: b for b in BUILTIN_RELPOS_BACKENDS},
                           ComponentKind.RELPOS_GLOBAL_ATTENTION: {b.name: b for b in BUILTIN_RELPOS_BACKENDS},
                           ComponentKind.PREFIX_CAUSAL_ATTENTION: {b.name: b for b in BUILTIN_PREFIX_BACKENDS},
                           ComponentKind.MOE_EXPERTS: {b.name: b for b in BUILTIN_MOE_BACKENDS}})


def kernels_for(runner_cls) -> KernelRegistry:
    """The kernel table of a runner class: the built-ins plus its ``kernel_backends()``."""
    return builtin_kernels().with_contributions(runner_cls.kernel_backends(), getattr(runner_cls, "name", "?"))
