"""A capability row as the plan reads it: per kernel kind, the row's backends in preference order.

YAML schema and override rules: fastdeploy_ext/capabilities.py. A row lists its kernels under
``kernels:``, one list per :class:`ComponentKind`; the keys rows used before that
(``attention:`` for the vision varlen attention, ``text_attention:`` for the paged decoder
attention) still read as the same lists (:func:`normalize_kernels`), so vendors' and users'
files keep working.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from functools import lru_cache
from typing import Callable, Union

import yaml

from .kinds import ComponentKind


@dataclass(frozen=True)
class AttentionEntry:
    """One vision varlen attention backend of a row: the row's dtypes for it, and optionally
    ``reads_strides``: false where strided loads are not verified on this device. A row can only
    narrow what the backend object says of its kernel: strided reads need both to say so."""
    backend: str
    dtypes: tuple[str, ...]
    reads_strides: bool | None = None      # None: the backend's own fact


@dataclass(frozen=True)
class KernelFacts:
    """What a vision attention backend object (ops/attention/varlen.py) says of its kernel,
    with its availability on the probed device: the plan's view of it."""
    reads_strides: bool
    graph_safe: bool
    head_dims: tuple[int, int]
    present: bool
    reason: str


@dataclass(frozen=True)
class TextAttentionEntry:
    """A paged decoder attention backend of a row (ops/attention/paged.py)."""
    backend: str
    head_dims: tuple[int, int]
    dtypes: tuple[str, ...]
    graph_safe: bool = False      # its decode can be captured in a CUDA graph


@dataclass(frozen=True)
class DeformableAttentionEntry:
    """A multi-scale deformable attention backend of a row (a detector's cross-attention:
    bilinear sampling of per-level value maps at predicted points)."""
    backend: str
    dtypes: tuple[str, ...]


@dataclass(frozen=True)
class DenseAttentionEntry:
    """A dense attention backend of a row (a detector's AIFI encoder layer: every page one
    unmasked sequence of the same length, so a batch is one [B, H, N, Dh] call)."""
    backend: str
    dtypes: tuple[str, ...]


@dataclass(frozen=True)
class TowerKernelEntry:
    """A backend of one of DeepSeek-OCR-2's kinds (a biased / prefix-masked attention, the MoE
    experts' GEMMs): the row's dtypes for it, and for the attention kinds optionally
    ``reads_strides: false`` where strided q/k/v loads are not verified on this device (a row can
    only narrow what the backend object says)."""
    backend: str
    dtypes: tuple[str, ...]
    reads_strides: bool | None = None      # None: the backend's own fact


KernelEntry = Union[AttentionEntry, TextAttentionEntry, DeformableAttentionEntry, DenseAttentionEntry,
                    TowerKernelEntry]


def _vision_entry(row: str, a: dict) -> AttentionEntry:
    unknown = set(a) - {"backend", "dtypes", "reads_strides"}
    if unknown:
        raise ValueError(f"row {row}: {ComponentKind.VISION_VARLEN_ATTENTION} entry {a.get('backend')!r} has unknown "
                         f"keys {sorted(unknown)} (a row gives backend, dtypes and optionally reads_strides; head "
                         "dims and graph safety are the backend object's own facts, ops/attention/varlen.py)")
    strided = a.get("reads_strides")
    return AttentionEntry(a["backend"], tuple(a["dtypes"]), None if strided is None else bool(strided))


def _paged_entry(row: str, a: dict) -> TextAttentionEntry:
    unknown = set(a) - {"backend", "head_dims", "dtypes", "graph_safe"}
    if unknown:
        raise ValueError(f"row {row}: {ComponentKind.PAGED_DECODER_ATTENTION} entry {a.get('backend')!r} has unknown "
                         f"keys {sorted(unknown)} (known: backend, head_dims, dtypes, graph_safe)")
    return TextAttentionEntry(a["backend"], tuple(a["head_dims"]), tuple(a["dtypes"]), bool(a.get("graph_safe", False)))


def _backend_dtypes_entry(kind: ComponentKind, cls):
    """The parser of a kind whose entries give a backend and its dtypes only."""
    def parse(row: str, a: dict):
        unknown = set(a) - {"backend", "dtypes"}
        if unknown:
            raise ValueError(f"row {row}: {kind} entry {a.get('backend')!r} has unknown keys {sorted(unknown)} "
                             "(known: backend, dtypes)")
        return cls(a["backend"], tuple(a["dtypes"]))
    return parse


_deformable_entry = _backend_dtypes_entry(ComponentKind.DEFORMABLE_ATTENTION, DeformableAttentionEntry)
_dense_entry = _backend_dtypes_entry(ComponentKind.DENSE_ATTENTION, DenseAttentionEntry)


def _tower_entry(kind: ComponentKind, strided_key: bool):
    """The parser of a DeepSeek-OCR-2 kind: backend, dtypes (and reads_strides for attention)."""
    keys = {"backend", "dtypes"} | ({"reads_strides"} if strided_key else set())

    def parse(row: str, a: dict) -> TowerKernelEntry:
        unknown = set(a) - keys
        if unknown:
            raise ValueError(f"row {row}: {kind} entry {a.get('backend')!r} has unknown keys {sorted(unknown)} "
                             f"(known: {', '.join(sorted(keys))})")
        strided = a.get("reads_strides")
        return TowerKernelEntry(a["backend"], tuple(a["dtypes"]), None if strided is None else bool(strided))
    return parse


#: how a row's entry of each kind is read (a new kind adds its parser here)
ENTRY_PARSERS: dict[ComponentKind, Callable[[str, dict], KernelEntry]] = {
    ComponentKind.VISION_VARLEN_ATTENTION: _vision_entry,
    ComponentKind.PAGED_DECODER_ATTENTION: _paged_entry,
    ComponentKind.DEFORMABLE_ATTENTION: _deformable_entry,
    ComponentKind.DENSE_ATTENTION: _dense_entry,
    ComponentKind.RELPOS_WINDOW_ATTENTION: _tower_entry(ComponentKind.RELPOS_WINDOW_ATTENTION, True),
    ComponentKind.RELPOS_GLOBAL_ATTENTION: _tower_entry(ComponentKind.RELPOS_GLOBAL_ATTENTION, True),
    ComponentKind.PREFIX_CAUSAL_ATTENTION: _tower_entry(ComponentKind.PREFIX_CAUSAL_ATTENTION, True),
    ComponentKind.MOE_EXPERTS: _tower_entry(ComponentKind.MOE_EXPERTS, False),
}

#: the keys rows used before ``kernels:``, and the kind each one lists
LEGACY_KEYS = {"attention": ComponentKind.VISION_VARLEN_ATTENTION,
               "text_attention": ComponentKind.PAGED_DECODER_ATTENTION}

# rows of the old form without a text decoder list (they predate it) get the portable backend
DEFAULT_TEXT_ATTENTION = (TextAttentionEntry("sdpa_paged", (1, 512), ("float32", "bfloat16", "float16")),)
_DEFAULT_TEXT_ATTENTION_RAW = [{"backend": "sdpa_paged", "head_dims": [1, 512],
                                "dtypes": ["float32", "bfloat16", "float16"]}]
DEFAULT_KV_BLOCK_SIZE = 16


def normalize_kernels(name: str, raw: dict, *, old_form_defaults: bool = True) -> dict:
    """``raw`` (a row's YAML mapping, possibly partial: an override) with the old keys folded into
    ``kernels:`` (``attention`` -> vision_varlen_attention, ``text_attention`` ->
    paged_decoder_attention). A kind given both ways, or a kind no parser knows, is an error.
    ``old_form_defaults``: a complete row of the old form without ``text_attention`` gets the
    portable paged backend, as such rows always did (an override's partial row gets nothing)."""
    out = dict(raw)
    old_form = "kernels" not in out and any(k in out for k in LEGACY_KEYS)
    kernels = out.pop("kernels", None) or {}
    if not isinstance(kernels, dict):
        raise ValueError(f"row {name}: kernels must map a kernel kind to its list of backends, "
                         f"got {type(kernels).__name__}")
    kernels = dict(kernels)
    for key, kind in LEGACY_KEYS.items():
        if key in out:
            if kind.value in kernels:
                raise ValueError(f"row {name}: gives both {key} and kernels.{kind}: they are the same list")
            kernels[kind.value] = out.pop(key)
    known = {k.value for k in ENTRY_PARSERS}
    for kind in kernels:
        if kind not in known:
            raise ValueError(f"row {name}: kernels: unknown kernel kind {kind!r}; known: {', '.join(sorted(known))}")
        if not isinstance(kernels[kind], list):
            raise ValueError(f"row {name}: kernels.{kind} must be a list of backends in preference order")
    if old_form and old_form_defaults and ComponentKind.PAGED_DECODER_ATTENTION.value not in kernels:
        kernels[ComponentKind.PAGED_DECODER_ATTENTION.value] = _DEFAULT_TEXT_ATTENTION_RAW
    if kernels or "kernels" in raw or old_form:
        out["kernels"] = kernels
    return out


@dataclass(frozen=True)
class CapabilityRow:
    name: str
    runner: str
    match: dict
    dtypes: tuple[str, ...]
    default_dtype: str
    #: per kernel kind, the row's backends in preference order (kinds in ComponentKind order)
    kernels: tuple[tuple[ComponentKind, tuple[KernelEntry, ...]], ...]
    host_grid_thw: bool
    graph_kinds: tuple[str, ...]
    graphs_default: bool
    fused_supported: bool = False
    fused_default: bool = False
    source: str = field(default="", compare=False)   # the file it came from (fastdeploy_ext/capabilities.py)
    kv_block_size: int = DEFAULT_KV_BLOCK_SIZE
    #: overlapped ("async") scheduling when the user does not choose (engine/config.py's decision)
    async_scheduling_default: bool = True
    #: mixed steps (decode rows in prefill steps) when the user does not choose (engine/config.py)
    mixed_steps_default: bool = True

    def entries(self, kind: ComponentKind) -> tuple[KernelEntry, ...]:
        """The row's backends for ``kind`` in preference order (empty: the row lists none)."""
        return next((e for k, e in self.kernels if k is kind), ())

    @property
    def attention(self) -> tuple[AttentionEntry, ...]:
        """The vision varlen attention list (the name rows used for it before ``kernels:``)."""
        return self.entries(ComponentKind.VISION_VARLEN_ATTENTION)

    @property
    def text_attention(self) -> tuple[TextAttentionEntry, ...]:
        """The paged decoder attention list (the name rows used for it before ``kernels:``)."""
        return self.entries(ComponentKind.PAGED_DECODER_ATTENTION)

    def with_entries(self, kind: ComponentKind, entries: tuple[KernelEntry, ...]) -> "CapabilityRow":
        """This row with ``kind``'s list replaced."""
        lists = dict(self.kernels) | {kind: tuple(entries)}
        return replace(self, kernels=tuple((k, lists[k]) for k in ComponentKind if k in lists))

    @classmethod
    def from_dict(cls, name: str, d: dict) -> "CapabilityRow":
        d = normalize_kernels(name, d)
        kernels = d.get("kernels")
        if not kernels:
            raise KeyError("kernels")
        lists = {ComponentKind(k): tuple(ENTRY_PARSERS[ComponentKind(k)](name, a) for a in v) for k, v in kernels.items()}
        return cls(name, d["runner"], dict(d.get("match") or {}), tuple(d["dtypes"]), d["default_dtype"],
                   tuple((k, lists[k]) for k in ComponentKind if k in lists),
                   bool(d["host_grid_thw"]), tuple(d["graphs"]["kinds"]), bool(d["graphs"]["default"]),
                   bool(d.get("fused_layers", {}).get("supported", False)),
                   bool(d.get("fused_layers", {}).get("default", False)),
                   kv_block_size=int(d.get("kv_block_size", DEFAULT_KV_BLOCK_SIZE)),
                   async_scheduling_default=bool(d.get("async_scheduling", {}).get("default", True)),
                   mixed_steps_default=bool(d.get("mixed_steps", {}).get("default", True)))


@lru_cache(maxsize=None)
def load_table(text: str) -> dict[str, CapabilityRow]:
    """Rows parsed from YAML ``text`` (schema: fastdeploy_ext/capabilities.py, which also
    assembles the table the runners use from every backend's shipped rows)."""
    data = yaml.safe_load(text)
    return {name: CapabilityRow.from_dict(name, d) for name, d in data["rows"].items()}
