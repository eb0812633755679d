"""Capability table + probe + user flags -> RunPlan, every decision with its reason.

A user forcing something the device row cannot do gets a PlanError naming the row; a kernel that
is listed but missing at run time falls back to the next one with the reason recorded.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, replace
from enum import Enum
from functools import lru_cache
from typing import Any, ClassVar, Mapping, Sequence

import yaml

DTYPES = ("auto", "float32", "bfloat16", "float16")
QKV_LAYOUTS = ("auto", "strided", "dense")
GRID_SOURCES = ("auto", "host", "device")
SWITCHES = ("auto", "on", "off")


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


# --------------------------------------------------------------- what a model declares
class ComponentKind(_Choice):
    """The kernel kinds a model family's components need; the plan resolves one kernel per kind."""
    VISION_VARLEN_ATTENTION = "vision_varlen_attention"     # packed variable-length images, no cache
    PAGED_DECODER_ATTENTION = "paged_decoder_attention"     # the decoder over the paged KV cache


@dataclass(frozen=True)
class Component:
    """A part of a model that needs a kernel chosen for it, with the facts the choice reads."""
    name: str                          # e.g. "vision.attention"
    kind: ComponentKind
    head_dim: int
    num_heads: int
    num_kv_heads: int | None = None    # paged decoder attention: heads of the KV cache


def component_of(components: Sequence[Component], kind: ComponentKind) -> Component:
    """The one component of ``kind`` (a family declares each kind at most once today)."""
    found = [c for c in components if c.kind is kind]
    if len(found) != 1:
        raise PlanError(f"the model declares {len(found)} components of kind {kind} "
                        f"({', '.join(c.name for c in found) or 'none'}); the plan resolves exactly one")
    return found[0]


# ----------------------------------------------------------------------------- the table
@dataclass(frozen=True)
class AttentionEntry:
    """One attention backend of a row: the row's dtypes for it, and optionally ``reads_strides``:
    false where strided loads are not verified on this device. A row can only narrow what the
    backend object says of its kernel: strided reads need both to say so."""
    backend: str
    dtypes: tuple[str, ...]
    reads_strides: bool | None = None      # None: the backend's own fact


@dataclass(frozen=True)
class KernelFacts:
    """What an attention backend object (ops/attention/) says of its kernel, with its
    availability on the probed device: the plan's view of it."""
    reads_strides: bool
    graph_safe: bool
    head_dims: tuple[int, int]
    present: bool
    reason: str


@dataclass(frozen=True)
class TextAttentionEntry:
    """A paged attention backend of the text decoder (ops/attention/paged.py)."""
    backend: str
    head_dims: tuple[int, int]
    dtypes: tuple[str, ...]
    graph_safe: bool = False      # its decode can be captured in a CUDA graph


# rows that predate the text decoder (e.g. a vendor's own YAML) get the portable backend
DEFAULT_TEXT_ATTENTION = (TextAttentionEntry("sdpa_paged", (1, 512), ("float32", "bfloat16", "float16")),)
DEFAULT_KV_BLOCK_SIZE = 16


@dataclass(frozen=True)
class CapabilityRow:
    name: str
    runner: str
    match: dict
    dtypes: tuple[str, ...]
    default_dtype: str
    attention: tuple[AttentionEntry, ...]
    host_grid_thw: bool
    graph_kinds: tuple[str, ...]
    graphs_default: bool
    fused_supported: bool = False
    fused_default: bool = False
    source: str = field(default="", compare=False)   # the file it came from (fastdeploy_ext/capabilities.py)
    text_attention: tuple[TextAttentionEntry, ...] = DEFAULT_TEXT_ATTENTION
    kv_block_size: int = DEFAULT_KV_BLOCK_SIZE

    @classmethod
    def from_dict(cls, name: str, d: dict) -> "CapabilityRow":
        att = []
        for a in d["attention"]:
            unknown = set(a) - {"backend", "dtypes", "reads_strides"}
            if unknown:
                raise ValueError(f"row {name}: attention entry {a.get('backend')!r} has unknown keys {sorted(unknown)} "
                                 "(a row gives backend, dtypes and optionally reads_strides; head dims and graph "
                                 "safety are the backend object's own facts, fastdeploy_ext/ops/attention/varlen.py)")
            strided = a.get("reads_strides")
            att.append(AttentionEntry(a["backend"], tuple(a["dtypes"]), None if strided is None else bool(strided)))
        return cls(name, d["runner"], dict(d.get("match") or {}), tuple(d["dtypes"]), d["default_dtype"], tuple(att),
                   bool(d["host_grid_thw"]), tuple(d["graphs"]["kinds"]), bool(d["graphs"]["default"]),
                   bool(d.get("fused_layers", {}).get("supported", False)),
                   bool(d.get("fused_layers", {}).get("default", False)),
                   text_attention=tuple(TextAttentionEntry(a["backend"], tuple(a["head_dims"]), tuple(a["dtypes"]),
                                                           bool(a.get("graph_safe", False)))
                                        for a in d["text_attention"]) if d.get("text_attention")
                   else DEFAULT_TEXT_ATTENTION,
                   kv_block_size=int(d.get("kv_block_size", DEFAULT_KV_BLOCK_SIZE)))


@lru_cache(maxsize=None)
def load_table(text: str) -> dict[str, CapabilityRow]:
    """Rows parsed from YAML ``text`` (schema: fastdeploy_ext/capabilities.py, which also
    assembles the table the runners use from every backend's shipped rows)."""
    data = yaml.safe_load(text)
    return {name: CapabilityRow.from_dict(name, d) for name, d in data["rows"].items()}


# ----------------------------------------------------------------- graph configuration
@dataclass(frozen=True)
class EncoderGraphPath:
    """A family of captured encoder graphs for one kind of batch (e.g. small layout blocks)."""
    name: str
    min_tokens: int
    max_tokens: int
    max_image_tokens: int      # images with more patches are not routed to this path
    max_segments: int          # most images (frames) packed into one replay

    @property
    def budgets(self) -> tuple[int, ...]:
        out, b = [], self.min_tokens
        while b < self.max_tokens:
            out.append(b)
            b *= 2
        return tuple(out + [self.max_tokens])

    def validate(self) -> None:
        if not 0 < self.min_tokens <= self.max_tokens:
            raise ValueError(f"graph path {self.name!r}: need 0 < min_tokens <= max_tokens")
        if self.max_image_tokens > self.max_tokens or self.max_segments < 1:
            raise ValueError(f"graph path {self.name!r}: max_image_tokens must be <= max_tokens and max_segments >= 1")


# Graphs pay where launches dominate (one 8x40 block: 13.2 ms eager -> 3.5 ms replayed on the
# H200); a whole page padded to a budget lost to eager (69.2 vs 65.1 ms), so by default only small
# batches are captured. A "pages" path can be configured.
DEFAULT_GRAPH_PATHS = (
    EncoderGraphPath("blocks", min_tokens=512, max_tokens=4096, max_image_tokens=2048, max_segments=64),
)


# Decode graphs per batch-size bucket (a batch pads to the smallest bucket that holds it): dense
# where batches are small, coarser above, up to the default max_num_seqs.
DEFAULT_CAPTURE_SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256)


@dataclass(frozen=True)
class GraphOptimizationConfig:
    """`--graph-optimization-config` JSON. FastDeploy's keys keep FastDeploy's meaning:
    ``use_cudagraph`` (decoder graphs) and ``cudagraph_capture_sizes`` (the decode batch sizes
    captured). The vision encoder's graphs have their own keys: ``use_encoder_cudagraph``,
    ``encoder_graph_paths`` (list of {name, min_tokens, max_tokens, max_image_tokens,
    max_segments}) and ``encoder_split_oversize_batches`` (pack batches larger than every budget
    into several replays instead of one eager pass). None: the row's default."""
    use_cudagraph: bool | None = None
    cudagraph_capture_sizes: tuple[int, ...] = DEFAULT_CAPTURE_SIZES
    use_encoder_cudagraph: bool | None = None
    encoder_graph_paths: tuple[EncoderGraphPath, ...] = DEFAULT_GRAPH_PATHS
    encoder_split_oversize_batches: bool = False

    KEYS = ("use_cudagraph", "cudagraph_capture_sizes", "use_encoder_cudagraph", "encoder_graph_paths",
            "encoder_split_oversize_batches")

    @classmethod
    def from_json(cls, text: str | None) -> "GraphOptimizationConfig":
        if not text:
            return cls()
        try:
            d = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"--graph-optimization-config is not valid JSON: {e}") from None
        if not isinstance(d, dict):
            raise ValueError("--graph-optimization-config must be a JSON object")
        unknown = set(d) - set(cls.KEYS)
        if unknown:
            raise ValueError(f"--graph-optimization-config: unknown keys {sorted(unknown)}; known: {sorted(cls.KEYS)}")
        paths = DEFAULT_GRAPH_PATHS
        if "encoder_graph_paths" in d:
            try:
                paths = tuple(EncoderGraphPath(**p) for p in d["encoder_graph_paths"])
            except TypeError as e:
                raise ValueError(f"--graph-optimization-config encoder_graph_paths: {e}") from None
            for p in paths:
                p.validate()
        sizes = DEFAULT_CAPTURE_SIZES
        if "cudagraph_capture_sizes" in d:
            sizes = d["cudagraph_capture_sizes"]
            if (not isinstance(sizes, list) or not sizes
                    or not all(isinstance(x, int) and not isinstance(x, bool) and x > 0 for x in sizes)):
                raise ValueError("--graph-optimization-config cudagraph_capture_sizes must be a non-empty list of "
                                 f"positive integers, got {sizes!r}")
            sizes = tuple(sorted(set(sizes)))

        def switch(key):
            return None if d.get(key) is None else bool(d[key])
        return cls(switch("use_cudagraph"), sizes, switch("use_encoder_cudagraph"), paths,
                   bool(d.get("encoder_split_oversize_batches", False)))


# ------------------------------------------------------------------------ the request
@dataclass(frozen=True)
class PlanRequest:
    """What the user asked for (CLI flags); "auto" leaves the choice to the row."""
    device: str = "auto"
    dtype: str = "auto"
    attention_backend: str = "auto"
    qkv_layout: str = "auto"
    grid_thw: str = "auto"
    fused_layers: str = "auto"
    graph_config: GraphOptimizationConfig = field(default_factory=GraphOptimizationConfig)
    capabilities: str | None = None      # --capabilities FILE.yaml: rows overriding the shipped ones
    text_attention_backend: str = "auto"

    def validate(self) -> None:
        for name, value, allowed in (("dtype", self.dtype, DTYPES), ("qkv_layout", self.qkv_layout, QKV_LAYOUTS),
                                     ("grid_thw", self.grid_thw, GRID_SOURCES),
                                     ("fused_layers", self.fused_layers, SWITCHES)):
            if value not in allowed:
                raise PlanError(f"--{name.replace('_', '-')} must be one of {', '.join(allowed)}, got {value!r}")


@dataclass(frozen=True)
class Decision:
    value: Any
    reason: str


@dataclass(frozen=True)
class RunPlan:
    runner: str
    row: str
    device: str
    emulated: bool
    dtype: Decision
    attention: Decision
    attention_fallbacks: tuple[str, ...]
    qkv_layout: Decision
    grid_thw: Decision
    graphs: Decision             # value: tuple of EncoderGraphPath, () when off
    fused_layers: Decision = Decision(False, "not requested")
    text_attention: Decision = Decision("sdpa_paged", "default")
    kv_block_size: Decision = Decision(DEFAULT_KV_BLOCK_SIZE, "default")
    decode_graphs: Decision = Decision((), "off")     # value: decode batch sizes captured, () when off
    notes: tuple[str, ...] = ()
    graph_split_oversize: bool = False

    components: tuple[Component, ...] = ()    # what the plan was resolved for (the model's)

    @property
    def strided_qkv(self) -> bool:
        return self.qkv_layout.value is QkvLayout.STRIDED

    @property
    def host_metadata(self) -> bool:
        return self.grid_thw.value is GridSource.HOST

    def decisions(self) -> dict[str, Decision]:
        return {"dtype": self.dtype, "attention": self.attention, "qkv_layout": self.qkv_layout,
                "grid_thw": self.grid_thw, "graphs": self.graphs,
                "fused_layers": self.fused_layers, "text_attention": self.text_attention,
                "kv_block_size": self.kv_block_size, "decode_graphs": self.decode_graphs}

    def describe(self) -> str:
        tag = " [EMULATED]" if self.emulated else ""
        lines = [f"plan: runner={self.runner} row={self.row} device={self.device}{tag}"]
        for k, d in self.decisions().items():
            v = d.value
            if k == "graphs":
                v = ", ".join(f"{p.name}{list(p.budgets)}" for p in v) if v else "off"
            elif k == "decode_graphs":
                v = f"batch sizes {list(v)}" if v else "off"
            lines.append(f"  {k:<15} = {v!s:<28} ({d.reason})")
        if self.attention_fallbacks:
            lines.append(f"  attention fallbacks: {', '.join(self.attention_fallbacks)}")
        for c in self.components:
            kv = f", {c.num_kv_heads} KV heads" if c.num_kv_heads is not None else ""
            lines.append(f"  component {c.name:<17} {c.kind}: {c.num_heads} heads of {c.head_dim}{kv}")
        lines += [f"  note: {n}" for n in self.notes]
        return "\n".join(lines)

    def to_dict(self) -> dict:
        d = asdict(self)
        d["graphs"]["value"] = [asdict(p) for p in self.graphs.value]
        return d


# --------------------------------------------------------------------------- resolve
def _forced_entry(row: CapabilityRow, entries, requested: str, what: str, usable):
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


def resolve_text_attention(row: CapabilityRow, requested: str, *, dtype: str, head_dim: int,
                           available: dict[str, tuple[bool, str]], notes: list[str]) -> Decision:
    """The paged attention backend of the text decoder: the row's preference order filtered by
    head_dim, dtype and run-time presence (a forced one that cannot run is a PlanError)."""
    def usable(e: TextAttentionEntry) -> str | None:
        if not e.head_dims[0] <= head_dim <= e.head_dims[1]:
            return f"head_dim {head_dim} outside {list(e.head_dims)}"
        if dtype not in e.dtypes:
            return f"dtype {dtype} not in {list(e.dtypes)}"
        ok, why = available.get(e.backend, (False, "not registered"))
        return None if ok else f"kernel unavailable: {why}"

    if requested != "auto":
        _forced_entry(row, row.text_attention, requested, "text attention backend", usable)
        return Decision(requested, "requested")
    skipped = []
    for e in row.text_attention:
        why = usable(e)
        if why is None:
            reason = f"first usable in row {row.name} text preference order"
            return Decision(e.backend, reason + (f" (skipped {'; '.join(skipped)})" if skipped else ""))
        skipped.append(f"{e.backend}: {why}")
        notes.append(f"text attention {e.backend} skipped: {why}; falling back")
    raise PlanError(f"row {row.name}: no text attention backend can run here ({'; '.join(skipped)})")


def resolve_decode_graphs(row: CapabilityRow, gc: GraphOptimizationConfig, text_backend: str) -> Decision:
    """Decoder CUDA graphs per batch-size bucket: on where the row lists the `decoder` graph kind
    (by default when the row's graphs are on by default) and the text backend's decode is graph
    safe; ``use_cudagraph`` forces them on (a PlanError naming the row where impossible) or off."""
    forced = gc.use_cudagraph
    if forced and "decoder" not in row.graph_kinds:
        raise PlanError(f"row {row.name} supports no decoder graph capture "
                        f"(graph kinds: {list(row.graph_kinds) or 'none'})")
    if forced is False:
        return Decision((), "use_cudagraph=false")
    if forced is None and not ("decoder" in row.graph_kinds and row.graphs_default):
        return Decision((), f"row {row.name} has no decoder graphs by default (eager decode)")
    entry = next(e for e in row.text_attention if e.backend == text_backend)
    if not entry.graph_safe:
        if forced:
            raise PlanError(f"row {row.name}: decoder graphs need a graph-safe text attention backend, "
                            f"plan chose {text_backend}")
        return Decision((), f"{text_backend} decode cannot be captured (its grid depends on the step)")
    why = "requested" if forced else f"on by default on row {row.name}: decode is launch-bound (18 layers eager)"
    return Decision(tuple(gc.cudagraph_capture_sizes), why)


@dataclass(frozen=True)
class _VisionKernels:
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


def resolve_dtype(row: CapabilityRow, requested: str) -> Decision:
    if requested == "auto":
        return Decision(row.default_dtype, f"default of row {row.name}")
    if requested in row.dtypes:
        return Decision(requested, "requested")
    raise PlanError(f"row {row.name} does not support dtype {requested}; it supports {', '.join(row.dtypes)}")


def resolve_vision_attention(vk: _VisionKernels, request: PlanRequest, notes: list[str]
                             ) -> tuple[AttentionEntry, Decision, tuple[str, ...]]:
    """The vision varlen attention backend: the row's preference list filtered by head_dim,
    dtype and presence (graph-safe first when encoder graphs are requested); the fallbacks."""
    row, gc = vk.row, request.graph_config
    if request.attention_backend != "auto":
        e = _forced_entry(row, row.attention, request.attention_backend, "attention backend", vk.usable)
        return e, Decision(e.backend, "requested"), ()
    candidates = []
    for e in row.attention:
        why = vk.usable(e)
        if why:
            notes.append(f"attention {e.backend} skipped: {why}; falling back")
        else:
            candidates.append(e)
    if not candidates:
        raise PlanError(f"row {row.name}: no attention backend can run here ({'; '.join(notes)})")
    chosen = candidates[0]
    reason = f"first usable in row {row.name} preference order"
    graph_safe = [e for e in candidates if vk.facts(e).graph_safe]
    if gc.use_encoder_cudagraph and not vk.facts(chosen).graph_safe and graph_safe:
        # graphs explicitly requested (e.g. the MetaX opt-in): the replay needs a fixed grid
        chosen = graph_safe[0]
        reason = f"encoder graphs requested: first graph-safe backend of row {row.name}"
    return chosen, Decision(chosen.backend, reason), tuple(e.backend for e in candidates if e is not chosen)


def resolve_qkv_layout(vk: _VisionKernels, chosen: AttentionEntry, requested: str,
                       consumers_needing_dense: tuple[str, ...]) -> Decision:
    row = vk.row
    blockers = []
    if not vk.facts(chosen).reads_strides:
        blockers.append(f"{chosen.backend} does not read strided q/k/v")
    elif chosen.reads_strides is False:
        blockers.append(f"{chosen.backend}'s strided loads are not verified on row {row.name}")
    blockers += [f"{c} needs dense q/k/v" for c in consumers_needing_dense]
    if requested == "strided" and blockers:
        raise PlanError(f"row {row.name}: strided qkv impossible: {'; '.join(blockers)}")
    if requested != "auto":
        return Decision(QkvLayout(requested), "requested")
    if blockers:
        return Decision(QkvLayout.DENSE, "; ".join(blockers))
    return Decision(QkvLayout.STRIDED, f"{chosen.backend} reads strides and no consumer needs dense q/k/v")


def resolve_grid_source(row: CapabilityRow, requested: str) -> Decision:
    if requested == "host" and not row.host_grid_thw:
        raise PlanError(f"row {row.name} does not support host grid_thw metadata")
    if requested != "auto":
        return Decision(GridSource(requested), "requested")
    if row.host_grid_thw:
        return Decision(GridSource.HOST, "host ints from the preprocessor: no device->host syncs")
    return Decision(GridSource.DEVICE, f"row {row.name} has no host metadata path")


def resolve_encoder_graphs(vk: _VisionKernels, chosen: AttentionEntry, grid: Decision,
                           gc: GraphOptimizationConfig) -> Decision:
    row = vk.row
    if gc.use_encoder_cudagraph and "encoder" not in row.graph_kinds:
        raise PlanError(f"row {row.name} supports no encoder graph capture (graph kinds: {list(row.graph_kinds) or 'none'})")
    want = row.graphs_default if gc.use_encoder_cudagraph is None else gc.use_encoder_cudagraph
    graph_safe = [e for e in row.attention if vk.facts(e).graph_safe and not vk.usable(e)]
    if not want:
        return Decision((), "off by default on row " + row.name if gc.use_encoder_cudagraph is None
                        else "use_encoder_cudagraph=false")
    if not vk.facts(chosen).graph_safe:
        if gc.use_encoder_cudagraph:
            raise PlanError(f"row {row.name}: encoder graphs need a graph-safe attention backend "
                            f"({[e.backend for e in graph_safe] or 'none usable'}), plan chose {chosen.backend}")
        return Decision((), f"{chosen.backend} cannot be replayed over padded budgets")
    if grid.value is not GridSource.HOST:
        if gc.use_encoder_cudagraph:
            raise PlanError("encoder graphs need host grid_thw metadata (metadata is prepared outside the graph)")
        return Decision((), "graphs need host metadata")
    return Decision(tuple(gc.encoder_graph_paths),
                    "requested" if gc.use_encoder_cudagraph else f"on by default on row {row.name}")


def resolve_fused_layers(row: CapabilityRow, requested: str, kernels: Mapping[str, KernelFacts],
                         notes: list[str]) -> Decision:
    """Fused residual/bias/LayerNorm + rotary passes (Triton) and the GEMM's GELU epilogue."""
    if requested == "on" and not row.fused_supported:
        raise PlanError(f"row {row.name} does not support fused layers (they need Triton on CUDA)")
    # the fused passes are Triton kernels: usable exactly where the Triton attention kernel is
    triton = kernels.get("triton_varlen")
    ok, why = (triton.present, triton.reason) if triton else (False, "triton_varlen not registered")
    if requested == "off":
        return Decision(False, "requested")
    if requested == "on":
        if not ok:
            raise PlanError(f"row {row.name}: fused layers need Triton: {why}")
        return Decision(True, "requested")
    if not row.fused_default:
        return Decision(False, f"off by default on row {row.name}")
    if not ok:
        notes.append(f"fused layers skipped: {why}")
        return Decision(False, f"Triton unusable here: {why}")
    return Decision(True, f"default of row {row.name}")


def _paged_availability(device: str) -> dict[str, tuple[bool, str]]:
    """The text decoder's paged backends probed on ``device`` (a name torch does not know: only
    the portable backend)."""
    import torch

    from .ops.attention.paged import PAGED_ATTENTION_BACKENDS
    try:
        dev = torch.device(device)
    except RuntimeError:
        dev = None
    return {n: b.available(dev) if dev is not None else (n == "sdpa_paged", f"device {device!r} is unknown to torch")
            for n, b in PAGED_ATTENTION_BACKENDS.items()}


def resolve_plan(row: CapabilityRow, request: PlanRequest, *, device: str, head_dim: int,
                 kernels: Mapping[str, KernelFacts], emulated: bool = False,
                 consumers_needing_dense: tuple[str, ...] = (), row_reason: str = "",
                 text_head_dim: int = 128, text_available: dict[str, tuple[bool, str]] | None = None) -> RunPlan:
    """``kernels``: vision backend name -> its facts and presence on this device (from the
    backend objects: ops.attention.varlen.kernel_facts); a listed backend missing there is
    unavailable. ``text_available`` the same for the text decoder's paged backends (None: probe
    them here on ``device``). ``head_dim`` / ``text_head_dim``: the facts of the vision varlen and
    paged decoder attention components (resolve_for_components reads them from a family's).
    ``consumers_needing_dense``: anything between the qkv projection and the kernel that needs
    contiguous q/k/v (e.g. an in-place q/k norm); non-empty forbids the strided layout."""
    request.validate()
    notes: list[str] = [f"row {row.name}: {row_reason}"] if row_reason else []
    gc = request.graph_config
    dtype = resolve_dtype(row, request.dtype)
    vk = _VisionKernels(row, kernels, head_dim, dtype.value)
    chosen, attention, fallbacks = resolve_vision_attention(vk, request, notes)
    qkv = resolve_qkv_layout(vk, chosen, request.qkv_layout, consumers_needing_dense)
    grid = resolve_grid_source(row, request.grid_thw)
    graphs = resolve_encoder_graphs(vk, chosen, grid, gc)
    fused = resolve_fused_layers(row, request.fused_layers, kernels, notes)
    text_att = resolve_text_attention(row, request.text_attention_backend, dtype=dtype.value, head_dim=text_head_dim,
                                      available=_paged_availability(device) if text_available is None
                                      else text_available, notes=notes)
    return RunPlan(runner=row.runner, row=row.name, device=device, emulated=emulated, dtype=dtype,
                   attention=attention, attention_fallbacks=fallbacks, qkv_layout=qkv, grid_thw=grid,
                   graphs=graphs, fused_layers=fused, text_attention=text_att,
                   kv_block_size=Decision(row.kv_block_size, f"row {row.name}"),
                   decode_graphs=resolve_decode_graphs(row, gc, text_att.value), notes=tuple(notes),
                   graph_split_oversize=gc.encoder_split_oversize_batches)


def resolve_for_components(row: CapabilityRow, request: PlanRequest, components: Sequence[Component], *,
                           device: str, kernels: Mapping[str, KernelFacts], emulated: bool = False,
                           row_reason: str = "", text_available: dict[str, tuple[bool, str]] | None = None) -> RunPlan:
    """The plan for a model's declared components: each kernel kind's choice reads the facts of
    that kind's component (the vision varlen attention's head_dim, the paged decoder
    attention's), and the plan records what it was resolved for."""
    vision = component_of(components, ComponentKind.VISION_VARLEN_ATTENTION)
    decoder = component_of(components, ComponentKind.PAGED_DECODER_ATTENTION)
    plan = resolve_plan(row, request, device=device, head_dim=vision.head_dim, kernels=kernels, emulated=emulated,
                        row_reason=row_reason, text_head_dim=decoder.head_dim, text_available=text_available)
    return replace(plan, components=tuple(components))
