"""Capability row + kernel facts + the model's components + user flags -> RunPlan.

The model's components drive the resolution: each kind it declares runs that kind's resolver
(KIND_RESOLVERS) over the row's list for the kind; then the decisions no single kind owns
(plan/decisions.py) read the kernels chosen.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Any, Callable, Mapping, Sequence

from .choice import KernelChoice, KindContext
from .decisions import (resolve_decode_graphs, resolve_detector_graphs, resolve_detector_masks, resolve_dtype,
                        resolve_encoder_graphs, resolve_fused_layers, resolve_grid_source, resolve_qkv_layout,
                        resolve_view_graph_overlap, resolve_view_graphs)
from .kinds import Component, ComponentKind, Decision, PlanError, components_by_kind
from .deformable_attention import (BUILTIN_DENSE, BUILTIN_DEFORMABLE, resolve_dense_attention,
                                   resolve_deformable_attention)
from .paged_attention import resolve_paged_attention
from .request import PlanRequest, RunPlan
from .table import CapabilityRow, KernelFacts
from .tower_kinds import BUILTIN_TOWER, TOWER_KINDS, resolve_tower_kind, resolve_tower_qkv_layout
from .vision_attention import VisionKernels, resolve_vision_attention

#: one resolver per kernel kind, run in this order for the kinds the model declares
KIND_RESOLVERS: dict[ComponentKind, Callable[[KindContext], KernelChoice]] = {
    ComponentKind.VISION_VARLEN_ATTENTION: resolve_vision_attention,
    ComponentKind.PAGED_DECODER_ATTENTION: resolve_paged_attention,
    ComponentKind.DEFORMABLE_ATTENTION: resolve_deformable_attention,
    ComponentKind.DENSE_ATTENTION: resolve_dense_attention,
    **{kind: resolve_tower_kind for kind in TOWER_KINDS},
}


def _paged_availability(device: str) -> dict[str, tuple[bool, str]]:
    """The built-in paged backends probed on ``device`` (a name torch does not know: only the
    portable backend)."""
    import torch

    from ..ops.kernels import builtin_kernels
    try:
        dev = torch.device(device)
    except RuntimeError:
        dev = None
    backends = builtin_kernels().backends(ComponentKind.PAGED_DECODER_ATTENTION)
    return {n: b.available(dev) if dev is not None else (n == "sdpa_paged", f"device {device!r} is unknown to torch")
            for n, b in backends.items()}


def resolve_for_components(row: CapabilityRow, request: PlanRequest, components: Sequence[Component], *,
                           device: str, kernels: Mapping[str, KernelFacts], emulated: bool = False,
                           row_reason: str = "", text_available: Mapping[str, tuple[bool, str]] | None = None,
                           consumers_needing_dense: tuple[str, ...] = (),
                           deformable_available: Mapping[str, tuple[bool, str]] | None = None,
                           dense_available: Mapping[str, tuple[bool, str]] | None = None,
                           tower_available: Mapping[ComponentKind, Mapping[str, tuple[bool, bool, str]]] | None = None
                           ) -> RunPlan:
    """The plan for a model's declared components. ``kernels``: vision attention backend name ->
    its facts and presence on this device (the backend objects': KernelRegistry.facts); a
    listed backend missing there is unavailable. ``text_available`` the same for the paged
    decoder backends, (present, reason) each (None: probe the built-ins on ``device``).
    ``consumers_needing_dense``: anything between the qkv projection and the kernel that needs
    contiguous q/k/v (e.g. an in-place q/k norm); non-empty forbids the strided layout.
    ``deformable_available`` / ``dense_available``: the deformable and dense attention backends,
    (present, reason) each (None: the built-in ATen ones). A model with deformable attention is a
    layout detector: its graphs and masks are decided too. ``tower_available``: per kind of
    DeepSeek-OCR-2's (plan/tower_kinds.py), its backends' (present, reads_strides, reason) (None:
    the built-in ATen ones); a model with windowed rel-pos attention and no varlen attention has
    its qkv layout decided by that kernel."""
    request.validate()
    notes: list[str] = [f"row {row.name}: {row_reason}"] if row_reason else []
    by_kind = components_by_kind(components)
    unresolved = [k for k in by_kind if k not in KIND_RESOLVERS]
    if unresolved:
        raise PlanError(f"no resolver for kernel kind {', '.join(map(str, unresolved))} "
                        f"(the model's {', '.join(by_kind[k].name for k in unresolved)})")
    gc = request.graph_config
    dtype = resolve_dtype(row, request.dtype)
    available: dict[ComponentKind, Mapping[str, Any]] = {
        ComponentKind.VISION_VARLEN_ATTENTION: kernels,
        ComponentKind.PAGED_DECODER_ATTENTION: _paged_availability(device) if text_available is None
        else text_available,
        ComponentKind.DEFORMABLE_ATTENTION: BUILTIN_DEFORMABLE if deformable_available is None
        else deformable_available,
        ComponentKind.DENSE_ATTENTION: BUILTIN_DENSE if dense_available is None else dense_available,
    }
    available |= {kind: (BUILTIN_TOWER if tower_available is None else tower_available).get(kind, {})
                  for kind in TOWER_KINDS}
    chosen = {kind: resolve(KindContext(row, kind, by_kind[kind], request, dtype.value, available[kind], notes))
              for kind, resolve in KIND_RESOLVERS.items() if kind in by_kind}
    vision = chosen.get(ComponentKind.VISION_VARLEN_ATTENTION)
    text = chosen.get(ComponentKind.PAGED_DECODER_ATTENTION)
    deformable = chosen.get(ComponentKind.DEFORMABLE_ATTENTION)
    dense = chosen.get(ComponentKind.DENSE_ATTENTION)
    is_detector = ComponentKind.DEFORMABLE_ATTENTION in by_kind
    vision_component = by_kind.get(ComponentKind.VISION_VARLEN_ATTENTION)
    vk = VisionKernels(row, kernels, vision_component.head_dim if vision_component else 0, dtype.value)
    windowed = chosen.get(ComponentKind.RELPOS_WINDOW_ATTENTION)
    if vision is None and windowed is not None:
        qkv = resolve_tower_qkv_layout(row, windowed, available[ComponentKind.RELPOS_WINDOW_ATTENTION],
                                       request.qkv_layout)
    else:
        qkv = resolve_qkv_layout(vk, vision, request.qkv_layout, consumers_needing_dense)

    def kernel(kind: ComponentKind, absent: str) -> Decision:
        return chosen[kind].decision if kind in chosen else Decision(None, absent)
    grid = resolve_grid_source(row, request.grid_thw)
    overlap = RunPlan.graph_overlap
    if vision is None and windowed is not None:     # a tower over fixed-size views (DeepSeek-OCR-2's)
        graphs = resolve_view_graphs(row, {str(k): chosen[k].entry.backend for k in TOWER_KINDS
                                           if k in chosen and k is not ComponentKind.MOE_EXPERTS}, grid, gc)
        overlap = resolve_view_graph_overlap(graphs, gc)
    else:
        graphs = resolve_encoder_graphs(vk, vision, grid, gc)
    fused = resolve_fused_layers(row, request.fused_layers, kernels, notes)
    return RunPlan(runner=row.runner, row=row.name, device=device, emulated=emulated, dtype=dtype,
                   attention=vision.decision if vision else Decision(None, "the model has no vision varlen attention"),
                   attention_fallbacks=vision.fallbacks if vision else (), qkv_layout=qkv, grid_thw=grid,
                   graphs=graphs, fused_layers=fused,
                   text_attention=text.decision if text else Decision(None, "the model has no paged decoder attention"),
                   kv_block_size=Decision(row.kv_block_size, f"row {row.name}"),
                   decode_graphs=resolve_decode_graphs(row, gc, text), notes=tuple(notes),
                   deformable_attention=deformable.decision if deformable
                   else Decision(None, "the model has no deformable attention"),
                   dense_attention=dense.decision if dense else Decision(None, "the model has no dense attention"),
                   detector_graphs=resolve_detector_graphs(row, gc, is_detector),
                   detector_masks=resolve_detector_masks(request.detector_masks, is_detector),
                   relpos_window_attention=kernel(ComponentKind.RELPOS_WINDOW_ATTENTION,
                                                  "the model has no windowed rel-pos attention"),
                   relpos_global_attention=kernel(ComponentKind.RELPOS_GLOBAL_ATTENTION,
                                                  "the model has no global rel-pos attention"),
                   prefix_causal_attention=kernel(ComponentKind.PREFIX_CAUSAL_ATTENTION,
                                                  "the model has no prefix-causal attention"),
                   moe_experts=kernel(ComponentKind.MOE_EXPERTS, "the model has no MoE"),
                   graph_split_oversize=gc.encoder_split_oversize_batches, graph_overlap=overlap,
                   components=tuple(components))


def resolve_plan(row: CapabilityRow, request: PlanRequest, *, device: str, head_dim: int,
                 kernels: Mapping[str, KernelFacts], emulated: bool = False,
                 consumers_needing_dense: tuple[str, ...] = (), row_reason: str = "",
                 text_head_dim: int = 128, text_available: Mapping[str, tuple[bool, str]] | None = None) -> RunPlan:
    """resolve_for_components for a model with one vision varlen attention of ``head_dim`` and
    one paged decoder attention of ``text_head_dim`` (tests and the conformance suite resolve
    rows this way); the plan records no components."""
    components = (Component("vision.attention", ComponentKind.VISION_VARLEN_ATTENTION, head_dim, 0),
                  Component("text.attention", ComponentKind.PAGED_DECODER_ATTENTION, text_head_dim, 0))
    plan = resolve_for_components(row, request, components, device=device, kernels=kernels, emulated=emulated,
                                  row_reason=row_reason, text_available=text_available,
                                  consumers_needing_dense=consumers_needing_dense)
    return replace(plan, components=())
