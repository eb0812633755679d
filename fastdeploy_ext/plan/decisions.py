"""The decisions that are no single kind's kernel: dtype, grid source, qkv layout, encoder,
decoder and detector graphs, fused layers, a detector's masks. Each reads the row, the typed
request and the kernels chosen."""
from __future__ import annotations

from typing import Mapping

from .choice import KernelChoice
from .graph_config import DEFAULT_GRAPH_PATHS, DEFAULT_VIEW_GRAPH_PATHS, GraphOptimizationConfig, ViewGraphPath
from .kinds import AUTO, Decision, GridSource, PlanError, QkvLayout, Switch, requested
from .table import CapabilityRow, KernelFacts
from .vision_attention import VisionKernels


def resolve_dtype(row: CapabilityRow, value: str) -> Decision:
    if value == AUTO:
        return Decision(row.default_dtype, f"default of row {row.name}")
    if value in row.dtypes:
        return Decision(value, "requested")
    raise PlanError(f"row {row.name} does not support dtype {value}; it supports {', '.join(row.dtypes)}")


def resolve_grid_source(row: CapabilityRow, value: str) -> Decision:
    want = requested(GridSource, value)
    if want is GridSource.HOST and not row.host_grid_thw:
        raise PlanError(f"row {row.name} does not support host grid_thw metadata")
    if want is not None:
        return Decision(want, "requested")
    if row.host_grid_thw:
        return Decision(GridSource.HOST, "host ints from the preprocessor: no device->host syncs")
    return Decision(GridSource.DEVICE, f"row {row.name} has no host metadata path")


def resolve_qkv_layout(vk: VisionKernels, chosen: KernelChoice | None, value: str,
                       consumers_needing_dense: tuple[str, ...]) -> Decision:
    """Strided (views of the fused qkv projection) where the chosen vision kernel reads strides,
    the row does not narrow that and no consumer needs dense q/k/v; ``chosen`` None: the model
    has no vision varlen attention."""
    row, want = vk.row, requested(QkvLayout, value)
    blockers = []
    if chosen is None:
        blockers.append("the model has no vision varlen attention")
    elif not vk.facts(chosen.entry).reads_strides:
        blockers.append(f"{chosen.entry.backend} does not read strided q/k/v")
    elif chosen.entry.reads_strides is False:
        blockers.append(f"{chosen.entry.backend}'s strided loads are not verified on row {row.name}")
    blockers += [f"{c} needs dense q/k/v" for c in consumers_needing_dense]
    if want is QkvLayout.STRIDED and blockers:
        raise PlanError(f"row {row.name}: strided qkv impossible: {'; '.join(blockers)}")
    if want is not None:
        return Decision(want, "requested")
    if blockers:
        return Decision(QkvLayout.DENSE, "; ".join(blockers))
    return Decision(QkvLayout.STRIDED, f"{chosen.entry.backend} reads strides and no consumer needs dense q/k/v")


def resolve_encoder_graphs(vk: VisionKernels, chosen: KernelChoice | None, grid: Decision,
                           gc: GraphOptimizationConfig) -> Decision:
    row = vk.row
    if gc.use_encoder_cudagraph and "encoder" not in row.graph_kinds:
        raise PlanError(f"row {row.name} supports no encoder graph capture (graph kinds: {list(row.graph_kinds) or 'none'})")
    want = row.graphs_default if gc.use_encoder_cudagraph is None else gc.use_encoder_cudagraph
    graph_safe = [e for e in row.attention if vk.facts(e).graph_safe and not vk.usable(e)]
    if not want:
        return Decision((), "off by default on row " + row.name if gc.use_encoder_cudagraph is None
                        else "use_encoder_cudagraph=false")
    if chosen is None:
        if gc.use_encoder_cudagraph:
            raise PlanError(f"row {row.name}: encoder graphs requested but the model has no vision varlen attention")
        return Decision((), "the model has no vision varlen attention")
    backend = chosen.entry.backend
    if not vk.facts(chosen.entry).graph_safe:
        if gc.use_encoder_cudagraph:
            raise PlanError(f"row {row.name}: encoder graphs need a graph-safe attention backend "
                            f"({[e.backend for e in graph_safe] or 'none usable'}), plan chose {backend}")
        return Decision((), f"{backend} cannot be replayed over padded budgets")
    if grid.value is not GridSource.HOST:
        if gc.use_encoder_cudagraph:
            raise PlanError("encoder graphs need host grid_thw metadata (metadata is prepared outside the graph)")
        return Decision((), "graphs need host metadata")
    if any(isinstance(p, ViewGraphPath) for p in gc.encoder_graph_paths):
        raise PlanError("encoder_graph_paths: this model's encoder graphs take budgets of patches ({name, min_tokens, "
                        "max_tokens, max_image_tokens, max_segments}), not of views ({name, budgets})")
    return Decision(tuple(gc.encoder_graph_paths),
                    "requested" if gc.use_encoder_cudagraph else f"on by default on row {row.name}")


def resolve_view_graphs(row: CapabilityRow, tower: Mapping[str, str], grid: Decision, gc: GraphOptimizationConfig,
                        path_names: tuple[str, ...] = tuple(p.name for p in DEFAULT_VIEW_GRAPH_PATHS)) -> Decision:
    """Encoder graphs of a tower over fixed-size views (DeepSeek-OCR-2's: a `global` and a `local`
    path, budgets over view counts): on where the row captures encoder graphs by default (the
    CUDA rows), ``use_encoder_cudagraph`` forces them on (a PlanError naming the row where it
    cannot) or off. ``tower``: component kind -> the backend chosen (every launch takes its shape
    from the view count alone, so a padded budget replays; they go in the reason). The paths
    are ``encoder_graph_paths`` in the {name, budgets} form, each name one of ``path_names``;
    not given: DEFAULT_VIEW_GRAPH_PATHS."""
    forced = gc.use_encoder_cudagraph
    if forced and "encoder" not in row.graph_kinds:
        raise PlanError(f"row {row.name} supports no encoder graph capture (graph kinds: {list(row.graph_kinds) or 'none'})")
    paths = gc.encoder_graph_paths
    if paths == DEFAULT_GRAPH_PATHS:
        paths = DEFAULT_VIEW_GRAPH_PATHS
    elif not all(isinstance(p, ViewGraphPath) for p in paths):
        raise PlanError("encoder_graph_paths: this model's encoder graphs take budgets of views per path ({name, "
                        f"budgets}} with name in {list(path_names)}), not of patches")
    unknown = [p.name for p in paths if p.name not in path_names]
    if unknown:
        raise PlanError(f"encoder_graph_paths: unknown path {unknown}; this model's paths are {list(path_names)}")
    if forced is False:
        return Decision((), "use_encoder_cudagraph=false")
    if forced is None and "encoder" not in row.graph_kinds:
        return Decision((), f"row {row.name} captures no encoder graphs (graph kinds: "
                            f"{list(row.graph_kinds) or 'none'}): the tower runs eager")
    if forced is None and not row.graphs_default:
        return Decision((), f"off by default on row {row.name} (opt in: use_encoder_cudagraph=true)")
    if grid.value is not GridSource.HOST:
        if forced:
            raise PlanError("encoder graphs need host grid_thw metadata (the views are split by path on the host)")
        return Decision((), "graphs need host metadata")
    kernels = ", ".join(f"{k} {v}" for k, v in tower.items())
    why = "requested" if forced else f"on by default on row {row.name}"
    return Decision(tuple(paths), f"{why}: per path padded to its smallest budget of views ({kernels} launch "
                                  "with shapes fixed by the view count)")


def resolve_view_graph_overlap(graphs: Decision, gc: GraphOptimizationConfig) -> Decision:
    """Whether a view-path tower's paths (``graphs``: resolve_view_graphs') replay side by side,
    the smaller global path on a side stream beside the crops': each path then captures into a
    graph pool of its own (two replays at once must not share intermediates). Off unless
    ``encoder_overlap_paths`` is true: on an H200, 16 six-crop pages took 230.0 ms side by side
    against 227.9 ms one after the other (both paths fill the GPU alone), for 1.1 GiB more of
    graph memory."""
    paths = graphs.value
    if len(paths) < 2:
        return Decision(False, "fewer than two encoder graph paths captured" if paths else "no encoder graphs")
    if not gc.encoder_overlap_paths:
        how = "encoder_overlap_paths=false" if gc.encoder_overlap_paths is False else "off by default"
        return Decision(False, f"{how}: the paths replay one after the other from one graph pool (side by side "
                               "measured no faster on an H200, for a second pool)")
    return Decision(True, "encoder_overlap_paths=true: the paths replay on two streams side by side, a graph "
                          "pool each")


def resolve_decode_graphs(row: CapabilityRow, gc: GraphOptimizationConfig, text: KernelChoice | None) -> Decision:
    """Decoder CUDA graphs per batch-size bucket: on where the row lists the `decoder` graph kind
    (by default when the row's graphs are on by default) and the paged backend's decode is graph
    safe; ``use_cudagraph`` forces them on (a PlanError naming the row where impossible) or off.
    ``text`` None: the model has no paged decoder attention."""
    forced = gc.use_cudagraph
    if forced and "decoder" not in row.graph_kinds:
        raise PlanError(f"row {row.name} supports no decoder graph capture "
                        f"(graph kinds: {list(row.graph_kinds) or 'none'})")
    if forced is False:
        return Decision((), "use_cudagraph=false")
    if forced is None and not ("decoder" in row.graph_kinds and row.graphs_default):
        return Decision((), f"row {row.name} has no decoder graphs by default (eager decode)")
    if text is None:
        if forced:
            raise PlanError(f"row {row.name}: decoder graphs requested but the model has no paged decoder attention")
        return Decision((), "the model has no paged decoder attention")
    if not text.entry.graph_safe:
        if forced:
            raise PlanError(f"row {row.name}: decoder graphs need a graph-safe text attention backend, "
                            f"plan chose {text.entry.backend}")
        return Decision((), f"{text.entry.backend} decode cannot be captured (its grid depends on the step)")
    why = "requested" if forced else f"on by default on row {row.name}: decode is launch-bound (18 layers eager)"
    return Decision(tuple(gc.cudagraph_capture_sizes), why)


def resolve_fused_layers(row: CapabilityRow, value: str, kernels: Mapping[str, KernelFacts],
                         notes: list[str]) -> Decision:
    """Fused residual/bias/LayerNorm + rotary passes (Triton) and the GEMM's GELU epilogue."""
    want = requested(Switch, value)
    if want is Switch.ON and not row.fused_supported:
        raise PlanError(f"row {row.name} does not support fused layers (they need Triton on CUDA)")
    # the fused passes are Triton kernels: usable exactly where the Triton attention kernel is
    triton = kernels.get("triton_varlen")
    ok, why = (triton.present, triton.reason) if triton else (False, "triton_varlen not registered")
    if want is Switch.OFF:
        return Decision(False, "requested")
    if want is Switch.ON:
        if not ok:
            raise PlanError(f"row {row.name}: fused layers need Triton: {why}")
        return Decision(True, "requested")
    if not row.fused_default:
        return Decision(False, f"off by default on row {row.name}")
    if not ok:
        notes.append(f"fused layers skipped: {why}")
        return Decision(False, f"Triton unusable here: {why}")
    return Decision(True, f"default of row {row.name}")


#: the graph kind a row lists when it can capture a layout detector's forward
DETECTOR_GRAPH_KIND = "detector"


def resolve_detector_graphs(row: CapabilityRow, gc: GraphOptimizationConfig, is_detector: bool) -> Decision:
    """A layout detector's forward captured per batch-size bucket at its fixed input (a batch
    pads to the smallest bucket holding it): on where the row lists the `detector` graph kind
    and its graphs are on by default; ``use_detector_cudagraph`` forces them on (a PlanError
    naming the row where impossible) or off. Value: the buckets, () when off."""
    forced = gc.use_detector_cudagraph
    if not is_detector:
        if forced:
            raise PlanError(f"row {row.name}: detector graphs requested but the model is no detector")
        return Decision((), "the model is no detector")
    if forced and DETECTOR_GRAPH_KIND not in row.graph_kinds:
        raise PlanError(f"row {row.name} supports no detector graph capture "
                        f"(graph kinds: {list(row.graph_kinds) or 'none'})")
    if forced is False:
        return Decision((), "off: use_detector_cudagraph=false")
    if forced is None and DETECTOR_GRAPH_KIND not in row.graph_kinds:
        return Decision((), f"off: row {row.name} has no detector graph capture "
                            f"(graph kinds: {list(row.graph_kinds) or 'none'})")
    if forced is None and not row.graphs_default:
        return Decision((), f"off: row {row.name}'s graphs are off by default")
    why = ("requested" if forced else f"on by default on row {row.name}: the input is fixed, so one graph per "
           "batch-size bucket replays the whole forward (a batch pads to its bucket)")
    return Decision(tuple(gc.detector_capture_sizes), why)


def resolve_detector_masks(asked: bool, is_detector: bool) -> Decision:
    """Whether the detector computes its per-query mask outputs: off unless asked, since
    parsing needs boxes and reading order only (the encoder's mask prototypes that place the
    initial boxes are part of the detection itself and always run)."""
    if not is_detector:
        return Decision(None, "the model is no detector")
    if asked:
        return Decision(True, "requested")
    return Decision(False, "off unless asked: parsing needs boxes and reading order only")
