"""What the user asked for (PlanRequest) and what the plan decided (RunPlan)."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import ClassVar

from .graph_config import GraphOptimizationConfig
from .kinds import (DTYPES, GRID_SOURCES, QKV_LAYOUTS, SWITCHES, Component, ComponentKind, Decision, GridSource,
                    PlanError, QkvLayout)
from .table import DEFAULT_KV_BLOCK_SIZE


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
    #: a layout detector computes its per-query masks (off unless asked: parsing needs none)
    detector_masks: bool = False
    #: the model family the runner's first plan is resolved for (its built-in config; None: the
    #: default family), before load_model resolves it again for the model it reads: a graph or
    #: kernel request in another family's form would otherwise be judged by the default family's
    model_family: str | None = None

    #: the flag that forces each kind's backend
    BACKEND_FLAG: ClassVar[dict[ComponentKind, str]] = {
        ComponentKind.VISION_VARLEN_ATTENTION: "attention_backend",
        ComponentKind.PAGED_DECODER_ATTENTION: "text_attention_backend",
    }

    def backend_for(self, kind: ComponentKind) -> str:
        """The backend the user forced for ``kind`` ("auto": none)."""
        flag = self.BACKEND_FLAG.get(kind)
        return getattr(self, flag) if flag else "auto"

    def validate(self) -> None:
        for name, value, allowed in (("dtype", self.dtype, DTYPES), ("qkv_layout", self.qkv_layout, QKV_LAYOUTS),
                                     ("grid_thw", self.grid_thw, GRID_SOURCES),
                                     ("fused_layers", self.fused_layers, SWITCHES)):
            if value not in allowed:
                raise PlanError(f"--{name.replace('_', '-')} must be one of {', '.join(allowed)}, got {value!r}")


@dataclass(frozen=True)
class RunPlan:
    runner: str
    row: str
    device: str
    emulated: bool
    dtype: Decision
    attention: Decision          # the vision varlen attention backend
    attention_fallbacks: tuple[str, ...]
    qkv_layout: Decision
    grid_thw: Decision
    graphs: Decision             # value: tuple of EncoderGraphPath, () when off
    fused_layers: Decision = Decision(False, "not requested")
    text_attention: Decision = Decision("sdpa_paged", "default")    # the paged decoder attention backend
    kv_block_size: Decision = Decision(DEFAULT_KV_BLOCK_SIZE, "default")
    decode_graphs: Decision = Decision((), "off")     # value: decode batch sizes captured, () when off
    notes: tuple[str, ...] = ()
    graph_split_oversize: bool = False
    # a view-path tower's paths replayed side by side (value None: the model has no view paths)
    graph_overlap: Decision = Decision(None, "the model has no encoder graph paths over views")

    components: tuple[Component, ...] = ()    # what the plan was resolved for (the model's)
    deformable_attention: Decision = Decision(None, "the model has no deformable attention")
    dense_attention: Decision = Decision(None, "the model has no dense attention")
    detector_graphs: Decision = Decision((), "the model is no detector")   # value: batch-size buckets
    detector_masks: Decision = Decision(None, "the model is no detector")
    # DeepSeek-OCR-2's vision tower and MoE (plan/tower_kinds.py)
    relpos_window_attention: Decision = Decision(None, "the model has no windowed rel-pos attention")
    relpos_global_attention: Decision = Decision(None, "the model has no global rel-pos attention")
    prefix_causal_attention: Decision = Decision(None, "the model has no prefix-causal attention")
    moe_experts: Decision = Decision(None, "the model has no MoE")

    #: the decision holding each kernel kind's backend (a new kind adds its field and an entry)
    KERNEL_FIELD: ClassVar[dict[ComponentKind, str]] = {
        ComponentKind.VISION_VARLEN_ATTENTION: "attention",
        ComponentKind.PAGED_DECODER_ATTENTION: "text_attention",
        ComponentKind.DEFORMABLE_ATTENTION: "deformable_attention",
        ComponentKind.DENSE_ATTENTION: "dense_attention",
        ComponentKind.RELPOS_WINDOW_ATTENTION: "relpos_window_attention",
        ComponentKind.RELPOS_GLOBAL_ATTENTION: "relpos_global_attention",
        ComponentKind.PREFIX_CAUSAL_ATTENTION: "prefix_causal_attention",
        ComponentKind.MOE_EXPERTS: "moe_experts",
    }
    #: kinds whose decisions describe() prints only for a model that declares them
    DECLARED_ONLY: ClassVar[tuple[ComponentKind, ...]] = (
        ComponentKind.RELPOS_WINDOW_ATTENTION, ComponentKind.RELPOS_GLOBAL_ATTENTION,
        ComponentKind.PREFIX_CAUSAL_ATTENTION, ComponentKind.MOE_EXPERTS)

    @property
    def strided_qkv(self) -> bool:
        return self.qkv_layout.value is QkvLayout.STRIDED

    @property
    def host_metadata(self) -> bool:
        return self.grid_thw.value is GridSource.HOST

    def kernel(self, kind: ComponentKind) -> Decision:
        """The backend chosen for ``kind``, with its reason."""
        return getattr(self, self.KERNEL_FIELD[kind])

    def component_kernels(self) -> tuple[tuple[Component, Decision], ...]:
        """Each component the plan was resolved for, with the kernel chosen for it."""
        return tuple((c, self.kernel(c.kind)) for c in self.components)

    def decisions(self) -> dict[str, Decision]:
        return {"dtype": self.dtype, "attention": self.attention, "qkv_layout": self.qkv_layout,
                "grid_thw": self.grid_thw, "graphs": self.graphs,
                "fused_layers": self.fused_layers, "text_attention": self.text_attention,
                "kv_block_size": self.kv_block_size, "decode_graphs": self.decode_graphs}

    @property
    def is_detector(self) -> bool:
        """The plan was resolved for a layout detector (its components include deformable attention)."""
        return any(c.kind is ComponentKind.DEFORMABLE_ATTENTION for c in self.components)

    def detector_decisions(self) -> dict[str, Decision]:
        """A layout detector's own decisions, per component: the compute dtype, the deformable
        (decoder cross-attention) and dense (AIFI) attention backends, graphs, masks."""
        return {"dtype": self.dtype, "deformable_attention": self.deformable_attention,
                "aifi_attention": self.dense_attention, "detector_graphs": self.detector_graphs,
                "masks": self.detector_masks}

    def describe(self) -> str:
        tag = " [EMULATED]" if self.emulated else ""
        lines = [f"plan: runner={self.runner} row={self.row} device={self.device}{tag}"]
        decisions = self.detector_decisions() if self.is_detector else self.decisions()
        declared = {c.kind for c in self.components}
        decisions |= {self.KERNEL_FIELD[k]: self.kernel(k) for k in self.DECLARED_ONLY if k in declared}
        if self.graph_overlap.value is not None:
            decisions["graph_overlap"] = self.graph_overlap
        width = max(15, *map(len, decisions))
        for k, d in decisions.items():
            v = d.value
            if k == "graphs":
                v = ", ".join(f"{p.name}{list(p.budgets)}" for p in v) if v else "off"
            elif k in ("decode_graphs", "detector_graphs"):
                v = f"batch sizes {list(v)}" if v else "off"
            elif k in ("masks", "graph_overlap"):
                v = "on" if v else "off"
            lines.append(f"  {k:<{width}} = {v!s:<28} ({d.reason})")
        if self.attention_fallbacks:
            lines.append(f"  attention fallbacks: {', '.join(self.attention_fallbacks)}")
        for c, d in self.component_kernels():
            kv = f", {c.num_kv_heads} KV heads" if c.num_kv_heads is not None else ""
            what = c.detail if c.detail is not None else f"{c.num_heads} heads of {c.head_dim}{kv}"
            lines.append(f"  component {c.name:<17} {c.kind}: {what} -> {d.value}")
        lines += [f"  note: {n}" for n in self.notes]
        return "\n".join(lines)

    def to_dict(self) -> dict:
        d = asdict(self)
        d["graphs"]["value"] = [asdict(p) for p in self.graphs.value]
        # the plan per component: what `info --json` shows a script
        d["component_kernels"] = [{"component": c.name, "kind": c.kind.value, "head_dim": c.head_dim,
                                   "num_heads": c.num_heads, "num_kv_heads": c.num_kv_heads,
                                   "backend": k.value, "reason": k.reason} for c, k in self.component_kernels()]
        return d
