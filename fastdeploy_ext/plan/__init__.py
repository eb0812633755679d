"""Capability table + probe + the model's components + user flags -> RunPlan, every decision
with its reason.

A user forcing something the device row cannot do gets a PlanError naming the row; a kernel that
is listed but missing at run time falls back to the next one with the reason recorded.

Modules: kinds.py (the vocabulary: choices, component kinds, Decision), table.py (a capability
row: per kernel kind, backends in preference order), graph_config.py, request.py (PlanRequest,
RunPlan), one resolver per kernel kind (vision_attention.py, paged_attention.py, over
choice.py's KindContext), decisions.py (dtype, grid source, qkv layout, graphs, fused layers)
and resolve.py (the model's components drive which resolvers run).
"""
from .choice import KernelChoice, KindContext
from .decisions import (DETECTOR_GRAPH_KIND, resolve_decode_graphs, resolve_detector_graphs, resolve_detector_masks,
                        resolve_dtype, resolve_encoder_graphs, resolve_fused_layers, resolve_grid_source, resolve_view_graphs,
                        resolve_qkv_layout)
from .graph_config import DEFAULT_CAPTURE_SIZES, DEFAULT_DETECTOR_CAPTURE_SIZES, DEFAULT_GRAPH_PATHS, DEFAULT_VIEW_GRAPH_PATHS, EncoderGraphPath, GraphOptimizationConfig, ViewGraphPath
from .kinds import (AUTO, DTYPES, GRID_SOURCES, QKV_LAYOUTS, SWITCHES, Component, ComponentKind, Decision, GridSource,
                    PlanError, QkvLayout, Switch, component_of, components_by_kind, requested)
from .paged_attention import resolve_paged_attention
from .request import PlanRequest, RunPlan
from .resolve import KIND_RESOLVERS, resolve_for_components, resolve_plan
from .deformable_attention import BUILTIN_DENSE, BUILTIN_DEFORMABLE, resolve_dense_attention, resolve_deformable_attention
from .table import (DEFAULT_KV_BLOCK_SIZE, DEFAULT_TEXT_ATTENTION, ENTRY_PARSERS, LEGACY_KEYS, AttentionEntry,
                    CapabilityRow, DeformableAttentionEntry, DenseAttentionEntry, KernelEntry, TowerKernelEntry, KernelFacts, TextAttentionEntry, load_table, normalize_kernels)
from .tower_kinds import BUILTIN_TOWER, TOWER_KINDS, resolve_tower_kind, resolve_tower_qkv_layout
from .vision_attention import VisionKernels, resolve_vision_attention

__all__ = [
    "BUILTIN_TOWER", "TOWER_KINDS", "TowerKernelEntry", "resolve_tower_kind", "resolve_tower_qkv_layout",
    "AUTO", "BUILTIN_DENSE", "BUILTIN_DEFORMABLE", "DEFAULT_DETECTOR_CAPTURE_SIZES", "DETECTOR_GRAPH_KIND",
    "DeformableAttentionEntry", "DenseAttentionEntry", "resolve_dense_attention", "resolve_deformable_attention",
    "resolve_detector_graphs", "resolve_detector_masks", "DTYPES", "GRID_SOURCES", "QKV_LAYOUTS", "SWITCHES", "AttentionEntry", "CapabilityRow", "Component",
    "ComponentKind", "DEFAULT_CAPTURE_SIZES", "DEFAULT_GRAPH_PATHS", "DEFAULT_VIEW_GRAPH_PATHS", "ViewGraphPath", "DEFAULT_KV_BLOCK_SIZE", "DEFAULT_TEXT_ATTENTION",
    "Decision", "ENTRY_PARSERS", "EncoderGraphPath", "GraphOptimizationConfig", "GridSource", "KIND_RESOLVERS",
    "KernelChoice", "KernelEntry", "KernelFacts", "KindContext", "LEGACY_KEYS", "PlanError", "PlanRequest",
    "QkvLayout", "RunPlan", "Switch", "TextAttentionEntry", "VisionKernels", "component_of", "components_by_kind",
    "load_table", "normalize_kernels", "requested", "resolve_decode_graphs", "resolve_dtype",
    "resolve_encoder_graphs", "resolve_view_graphs", "resolve_for_components", "resolve_fused_layers", "resolve_grid_source",
    "resolve_paged_attention", "resolve_plan", "resolve_qkv_layout", "resolve_vision_attention",
]
