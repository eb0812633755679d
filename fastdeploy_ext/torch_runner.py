"""The shared PyTorch implementation behind every built-in runner.

Backends differ in how they probe, which capability row they pick and which torch device they
run on; what the device itself offers (memory queries, pinned staging, graphs, peak-memory
profiling, the sync guard) is the device API registered for that torch device type
(device_api.py). The vision path itself is this one class, configured by the RunPlan. A vendor
runner subclasses it and overrides those hooks — never copies it.

The runner is the device; the model is a family (models/interface.py) it holds once loaded and
reaches only through the family's hooks. The plan is resolved for the family's declared
components: at creation for the default family's built-in config (what `info` shows without a
model), and again in load_model for the config actually read, before any weight is loaded.
"""
from __future__ import annotations

import dataclasses
import logging
import time
from pathlib import Path
from typing import Callable, ClassVar

import torch

from .engine.step import KVCacheSpec, StepBatch
from .fallbacks import fallback_notes
from .capabilities import capability_table
from .device_api import DeviceAPI, device_api_for
from .models.interface import CheckpointError, FamilyRole, ModelFamily, require_role
from .models.registry import DEFAULT_DETECTOR_FAMILY, DEFAULT_FAMILY, detect_family, get_family
from .ops.kernels import KernelRegistry, kernels_for
from .plan import (CapabilityRow, Component, ComponentKind, Decision, GridSource, PlanError, PlanRequest, RunPlan,
                   resolve_detector_masks, resolve_for_components)
from .runner import DeviceRunner, GraphReport, ImageBatch

log = logging.getLogger(__name__)

DTYPE_BY_NAME = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class TorchRunner(DeviceRunner):
    name: ClassVar[str] = "torch"
    #: set by subclasses that pin one row regardless of the probe (e.g. the plain `cpu` device)
    forced_row: ClassVar[str | None] = None
    #: execute() reads a decode row's token from StepBatch.prev_token_ids on the device (eager
    #: and decode graphs: TextStepRunner.feed_device_ids), so the engine may overlap its steps
    takes_device_token_ids: ClassVar[bool] = True
    #: execute() takes decode rows (one token, no rope_positions) in a prefill StepBatch through
    #: the paged prefill path (mixed steps: engine/scheduler.py)
    takes_mixed_steps: ClassVar[bool] = True

    # ------------------------------------------------------------ hooks
    @classmethod
    def torch_device(cls, probe) -> torch.device:
        raise NotImplementedError

    def sync_guard(self):
        """Context that fails on any device->host sync of this runner's device: data-dependent
        ops, read-backs and transfers (sync_guard.HostSyncGuard). On a host device nothing can be
        seen, so the proof runs on ``sync_check_runner()`` (device tensors on ``meta``)."""
        if self.device.type == "cpu":
            raise RuntimeError(f"{self.name}: on the host a device->host transfer moves nothing and cannot be "
                               "seen; guard runner.sync_check_runner() instead (its device tensors live on meta)")
        return self.device_api.sync_guard()

    def sync_check_runner(self) -> "TorchRunner":
        """The runner the no-sync proof runs on. On an accelerator: this runner. On a host device:
        a twin with the same class, plan and model config whose device-side tensors (weights,
        metadata tables, activations) live on ``meta``, so that a read-back or a transfer to the
        host — invisible between two CPU tensors — is an op on a meta tensor the guard sees."""
        if self.device.type != "cpu":
            return self
        self._require_model()
        twin = type(self)(dataclasses.replace(self.plan, device="meta"), self.probe_result, self.row,
                          family=self.family)
        twin.cfg, twin.load_report = self.cfg, self.load_report
        twin.model = self.family.build_vision_model(self.cfg).to(self.dtype).eval()
        twin._init_metadata()
        return twin

    def memory_stats(self) -> dict:
        """The device API's: torch's caching allocator on CUDA-style devices, the process's peak
        RSS on the host."""
        return self.device_api.memory_stats()

    def device_memory(self):
        return self.device_api.memory()

    def capture_graphs(self) -> GraphReport:
        """Encoder graphs as the plan asks (the plan only turns them on for rows whose device
        can capture them: CUDA, and MetaX's CUDA-compatible MACA; the device API captures)."""
        if not self.plan.graphs.value:
            return GraphReport(captured=0, reason=self.plan.graphs.reason)
        self._require_model()
        self.graphs = self.family.encoder_graphs(self, self.plan.graphs.value)
        if self.graphs is None:
            from .graphs import EncoderGraphs
            self.graphs = EncoderGraphs(self, self.plan.graphs.value, self.plan.graph_split_oversize)
        return self.graphs.capture()

    # ------------------------------------------------------------ construction
    @classmethod
    def select_row(cls, probe, table: dict[str, CapabilityRow]) -> tuple[CapabilityRow, str]:
        if cls.forced_row:
            return table[cls.forced_row], f"the {cls.name} device always uses row {cls.forced_row}"
        for row in table.values():
            if row.runner == cls.name and cls.row_matches(row, probe):
                return row, f"first row of runner {cls.name} matching the probe ({row.match or 'any'})"
        raise RuntimeError(f"no capability row for runner {cls.name} matches the probe: {probe.summary()}")

    @classmethod
    def row_matches(cls, row: CapabilityRow, probe) -> bool:
        return True

    @classmethod
    def create(cls, request: PlanRequest, probe=None, table=None, family: ModelFamily | None = None) -> "TorchRunner":
        """The plan is first resolved for ``family``'s built-in config (default: the request's
        ``model_family``, else the default family); load_model resolves it again for the model
        it reads."""
        probe = probe or cls.probe()
        if not probe.present:
            raise RuntimeError(f"{cls.name}: device not present: {probe.reason}")
        table = table or capability_table(request.capabilities)
        row, row_reason = cls.select_row(probe, table)
        if row.source:
            row_reason += f" [row from {row.source}]"
        device = cls.torch_device(probe)
        family = family or get_family(request.model_family or DEFAULT_FAMILY)
        kernels = kernels_for(cls)      # the built-ins + what this backend contributes (kernel_backends)

        def plan_for(components: tuple[Component, ...]) -> RunPlan:
            plan = resolve_for_components(row, request, components, device=str(device),
                                          kernels=kernels.vision_facts(device),
                                          emulated=bool(getattr(probe, "emulated", False)), row_reason=row_reason,
                                          text_available=kernels.paged_availability(device),
                                          deformable_available=kernels.availability(
                                              ComponentKind.DEFORMABLE_ATTENTION, device),
                                          dense_available=kernels.availability(ComponentKind.DENSE_ATTENTION,
                                                                               device),
                                          tower_available=kernels.tower_availability(device))
            # no silent fallbacks: what this device will run differently from the plan's decisions
            return dataclasses.replace(plan, notes=plan.notes + fallback_notes(
                device, bool(plan.fused_layers.value), probe, DTYPE_BY_NAME[plan.dtype.value]))

        return cls(plan_for(family.components(family.default_config())), probe, row, family=family, replan=plan_for,
                   kernels=kernels)

    def __init__(self, plan: RunPlan, probe, row: CapabilityRow | None = None, *, family: ModelFamily | None = None,
                 replan: "Callable[[tuple[Component, ...]], RunPlan] | None" = None,
                 kernels: KernelRegistry | None = None):
        super().__init__(plan, probe)
        self.row = row or capability_table()[plan.row]
        #: this runner's kernel backends per kind: the built-ins + its backend's contributions
        self.kernels = kernels or kernels_for(type(self))
        self.device = torch.device(plan.device)
        self.dtype = DTYPE_BY_NAME[plan.dtype.value]
        self.device_api: DeviceAPI = device_api_for(self.device)
        # the step paths call these per step: the device API's bound methods, not a forwarding call
        self.pin_host, self.upload = self.device_api.pin, self.device_api.upload
        self.memory_query = self.device_api.memory_query()
        log.info("device API %s for %s; memory query: %s (%s)", self.device_api.name, self.device,
                 "yes" if self.memory_query.value else "none", self.memory_query.reason)
        self.family = family or get_family(DEFAULT_FAMILY)
        self._replan = replan
        self.model = None
        self.cfg = None
        self.load_report = None
        self.meta_builder = None
        self._set_execution()
        self.graphs = None
        self.text = None            # TextStepRunner once a text model is loaded
        self.text_model = None
        self.tokenizer = None
        self.chat_template = None
        # a detector family's model (load_detector), apart from the VLM's
        self.detector = self.detector_family = self.detector_cfg = self.detector_report = None
        self.detector_masks: Decision | None = None
        self.detector_graphs = None       # DetectorGraphs once captured (capture_detector_graphs)
        self._detector_dir = None

    # ------------------------------------------------------------ model
    def load_model(self, model_dir, *, load_format: str = "auto", model_format: str = "auto",
                   with_text: bool = False, model_family: str | None = None):
        """The family's vision encoder + projector, and with ``with_text`` its text decoder,
        tokenizer and chat template (the engine asks for them; `encode` does not). The family is
        ``model_family`` or the one config.json's model_type names (models/registry.py); the
        plan is re-resolved for the config read before any weight is."""
        if load_format not in ("auto", "safetensors", "dummy"):
            raise ValueError(f"--load-format must be auto, safetensors or dummy, got {load_format!r}")
        if load_format != "dummy" and model_dir is None:
            raise ValueError("a model directory is needed unless --load-format dummy")
        t0 = time.perf_counter()
        src = None if load_format == "dummy" else model_dir
        if src is not None and not Path(src).is_dir():
            raise CheckpointError(f"{src}: model directory does not exist")
        choice = detect_family(src, model_family)
        family = choice.family
        require_role(family, FamilyRole.VLM, "load_model (encode, generate, serve)")
        cfg = family.default_config() if src is None else family.read_config(src)
        self._plan_for_model(family, cfg)
        log.info("model family %s (%s)", family.name, choice.reason)
        self.model, self.load_report = family.load_vision(src, dtype=self.dtype, device=self.device,
                                                          model_format=model_format, cfg=cfg)
        self.cfg = cfg
        self._init_metadata()
        if with_text:
            self._load_text(src, model_format)
        log.info("model loaded in %.2fs: %s layout, %s, %s", time.perf_counter() - t0, self.load_report.layout,
                 self.dtype, self.device)
        return self.load_report

    def _plan_for_model(self, family: ModelFamily, cfg) -> None:
        """Resolve the plan for the components of the model about to be loaded (unchanged when
        they are those the plan was resolved for). A runner built without its resolution inputs
        (not through create) keeps its plan, and a component outside its kernels' facts is an error."""
        self.family = family
        components = family.components(cfg)
        if components == self.plan.components:
            return
        if self._replan is not None:
            before = self.plan.decisions()
            self.plan = self._replan(components)
            changed = [k for k, d in self.plan.decisions().items() if d != before[k]]
            if changed:
                log.info("plan re-resolved for the model's components: %s changed", ", ".join(changed))
            self._set_execution()
            return
        self._check_head_dim(components)
        self.plan = dataclasses.replace(self.plan, components=components)

    def plan_for_model(self, family: ModelFamily, cfg) -> RunPlan:
        """The plan for ``family``'s model of config ``cfg``, resolved as load_model would before
        reading any weight (`info --model` shows it without loading one)."""
        self._plan_for_model(family, cfg)
        return self.plan

    def _set_execution(self) -> None:
        if self.family.role is not FamilyRole.VLM:
            self.execution = None       # a detector's kernel is set on its model (load_detector)
            return
        name = self.plan.attention.value        # None: the model has no vision varlen attention
        attention = None if name is None else self.kernels.get(ComponentKind.VISION_VARLEN_ATTENTION, name)
        # every component's chosen backend object, for families with kinds of their own (DeepSeek-OCR-2's tower)
        chosen = {c.kind: self.kernels.get(c.kind, d.value) for c, d in self.plan.component_kernels()
                  if d.value is not None and d.value in self.kernels.backends(c.kind)}
        self.execution = self.family.vision_execution(attention, self.plan.strided_qkv,
                                                      bool(self.plan.fused_layers.value), kernels=chosen)

    def _init_metadata(self) -> None:
        """The metadata builder of the loaded model on this runner's device."""
        self.meta_builder = self.family.metadata_builder(self.cfg, self.model, dtype=self.dtype, device=self.device,
                                                         attention=self.execution.attention)

    def _load_text(self, model_dir, model_format: str) -> None:
        from .text_runner import TextStepRunner
        self.text_model, report = self.family.load_text(model_dir, dtype=self.dtype, device=self.device,
                                                        model_format=model_format, cfg=self.cfg)
        if report.layout != self.load_report.layout:
            raise ValueError(f"{model_dir}: the vision weights are in {self.load_report.layout} layout but the "
                             f"text weights in {report.layout} layout")
        self.tokenizer, self.chat_template = self.family.load_tokenizer(model_dir, self.cfg)
        from .ops.triton import decoder_passes
        # the decoder's Triton passes ride on the plan's fused_layers decision (same kernels' family,
        # same availability: Triton on CUDA); eager ATen elsewhere
        self.text_model.fused = bool(self.plan.fused_layers.value) and decoder_passes.usable(self.device)
        log.info("text decoder: %s attention, KV blocks of %d, %s layers", self.plan.text_attention.value,
                 self.plan.kv_block_size.value, "fused Triton" if self.text_model.fused else "ATen")
        moe = self.plan.moe_experts
        if moe.value is not None:       # a MoE decoder runs its routed experts through the plan's backend
            self.text_model.moe_experts = self.kernels.get(ComponentKind.MOE_EXPERTS, moe.value)
            log.info("text decoder: routed experts by %s (%s): %s", moe.value, moe.reason,
                     self.text_model.moe_experts.what)
        self.text = TextStepRunner(self.text_model, self.kernels.get(ComponentKind.PAGED_DECODER_ATTENTION,
                                                                     self.plan.text_attention.value),
                                   block_size=self.plan.kv_block_size.value, device=self.device, dtype=self.dtype,
                                   device_api=self.device_api,
                                   image_token_id=self.family.image_token_id(self.cfg),
                                   position_rows=self.family.position_rows)

    def _require_text(self):
        if self.text is None:
            raise RuntimeError("no text model loaded: call load_model(..., with_text=True) first")
        return self.text

    # ------------------------------------------------------------ generation (the engine's side)
    def kv_cache_spec(self) -> KVCacheSpec:
        return self._require_text().kv_cache_spec()

    def init_kv_cache(self, num_blocks: int) -> None:
        self._require_text().init_kv_cache(num_blocks)

    def free_kv_cache(self) -> None:
        if self.text is not None:
            self.text.free_kv_cache()

    def execute(self, step: StepBatch) -> torch.Tensor:
        return self._require_text().execute(step)

    def profile_peak_memory(self, max_num_batched_tokens: int, max_encoder_patches: int) -> int:
        from .memory_profile import profile_peak_memory
        return profile_peak_memory(self, max_num_batched_tokens, max_encoder_patches)

    def capture_decode_graphs(self, max_num_seqs: int, max_model_len: int) -> GraphReport:
        """Decode graphs per batch-size bucket as the plan says (no-op report when off)."""
        text = self._require_text()
        sizes = tuple(s for s in self.plan.decode_graphs.value if s <= max_num_seqs)
        if not sizes:
            return GraphReport(captured=0, reason=self.plan.decode_graphs.reason if not self.plan.decode_graphs.value
                               else f"no capture size <= max_num_seqs {max_num_seqs}")
        if not text.backend.graph_safe_decode:
            raise PlanError(f"row {self.plan.row}: decode graphs need a graph-safe text attention backend, "
                            f"plan chose {text.backend.name}")
        from .text_runner import DecodeGraphs
        graphs = DecodeGraphs(text, sizes, max_model_len)
        info = graphs.capture()
        text.graphs = graphs
        log.info("decode graphs captured for batch sizes %s in %.2fs (%.1f MiB)", info["sizes"], info["seconds"],
                 info["memory_bytes"] / 2 ** 20)
        return GraphReport(captured=len(sizes), paths={"decode": list(sizes)}, capture_seconds=info["seconds"],
                           graph_memory_bytes=info["memory_bytes"], reason=self.plan.decode_graphs.reason)

    def _check_head_dim(self, components: tuple[Component, ...]) -> None:
        """A plan that cannot be re-resolved must still fit the model's components: each one's
        head_dim within the range of the kernel chosen for its kind."""
        for c in components:
            chosen = self.plan.kernel(c.kind).value
            if chosen is None:
                raise PlanError(f"row {self.plan.row}: the plan has no {c.kind} kernel for the model's {c.name}")
            if c.kind is ComponentKind.VISION_VARLEN_ATTENTION:
                backend = self.execution.attention
                lo, hi = backend.head_dims
                if not lo <= c.head_dim <= hi:
                    raise PlanError(f"row {self.plan.row}: attention backend {backend.name} supports head_dim "
                                    f"{lo}..{hi}, the model has {c.head_dim}; choose another with --attention-backend")
            elif c.kind is ComponentKind.PAGED_DECODER_ATTENTION:
                entry = {e.backend: e for e in self.row.entries(c.kind)}[chosen]
                if not entry.head_dims[0] <= c.head_dim <= entry.head_dims[1]:
                    raise PlanError(f"row {self.plan.row}: text attention backend {entry.backend} supports head_dim "
                                    f"{entry.head_dims[0]}..{entry.head_dims[1]}, the model has {c.head_dim}")

    def _require_model(self):
        if self.model is None:
            raise RuntimeError("no model loaded: call load_model() first")

    # ------------------------------------------------------------ encoding
    def build_metadata(self, grids: list[tuple[int, int, int]], source: GridSource | str | None = None):
        source = GridSource(source or self.plan.grid_thw.value)
        if source is GridSource.HOST:
            return self.meta_builder.build_host(grids)
        grid_dev = torch.tensor(grids, dtype=torch.int64).to(self.device)
        return self.meta_builder.build_device(grid_dev)

    def check_batch(self, batch: ImageBatch) -> tuple[torch.Tensor, list[tuple[int, int, int]]]:
        self._require_model()
        pv = batch.pixel_values
        return pv, self.family.check_pixels(self.cfg, pv, batch.grid_thw)

    def upload_pixels(self, pv: torch.Tensor) -> torch.Tensor:
        if pv.device != self.device and pv.device.type == "cpu":
            pv = self.device_api.pin(pv)
        pv = pv.to(self.device, non_blocking=True)
        # a family whose processor hands out bytes (DeepSeek-OCR-2) normalizes them on the device
        return (pv.to(self.dtype) if pv.is_floating_point() else pv).reshape(pv.shape[0], -1)

    def encode_images(self, batch: ImageBatch) -> list[torch.Tensor]:
        pv, grids = self.check_batch(batch)
        return self.encode_uploaded(self.upload_pixels(pv), grids)

    def encode_uploaded(self, pixels: torch.Tensor, grids: list[tuple[int, int, int]]) -> list[torch.Tensor]:
        """encode_images for pixels already on the device ([N, C*P*P], compute dtype) and
        validated grids: the hot path benchmarks time. An fp32 plan's convolutions (a
        patch embedding, a neck) run in fp32, not cuDNN's default TF32."""
        from .ops.precision import fp32_convolutions
        with torch.inference_mode(), fp32_convolutions(self.device, self.dtype):
            if self.graphs is not None:
                out = self.graphs.run(pixels, grids)
                sizes = self.family.output_sizes(self.cfg, grids)
            else:
                meta = self.build_metadata(grids)
                out = self.model(pixels, meta, self.execution)
                sizes = meta.out_split_sizes
        return list(out.split(sizes))

    # ------------------------------------------------------------ detection (a DetectorFamily's model)
    def load_detector(self, model_dir, *, load_format: str = "auto", model_family: str | None = None,
                      masks: bool | None = None):
        """A detector family's model (config.json's model_type, ``model_family``, or the default
        detector without a directory), its plan re-resolved for the detector's components before
        any weight is read, and the plan's kernels set on it: the deformable attention backend
        (the decoder's cross-attention) and the dense one (the encoder's AIFI layer). ``masks``:
        compute the per-query mask outputs (None: the plan's decision, off unless the request
        asks). Kept apart from the VLM's state: a runner may hold one of each."""
        if load_format not in ("auto", "safetensors", "dummy"):
            raise ValueError(f"--load-format must be auto, safetensors or dummy, got {load_format!r}")
        if load_format != "dummy" and model_dir is None:
            raise ValueError("a model directory is needed unless --load-format dummy")
        src = None if load_format == "dummy" else model_dir
        if src is not None and not Path(src).is_dir():
            raise CheckpointError(f"{src}: model directory does not exist")
        choice = detect_family(src, model_family or (DEFAULT_DETECTOR_FAMILY if src is None else None))
        family = choice.family
        require_role(family, FamilyRole.DETECTOR, "load_detector (detect)")
        cfg = family.default_config() if src is None else family.read_config(src)
        components = family.components(cfg)
        if self._replan is not None:
            plan = self._replan(components)
        else:
            self._check_head_dim(components)
            plan = dataclasses.replace(self.plan, components=components)
        if masks is not None:
            plan = dataclasses.replace(plan, detector_masks=resolve_detector_masks(bool(masks), True))
        if plan.detector_masks.value and not family.supports_masks:
            # refused before the runner's plan changes or a weight is read
            how = "masks=True" if masks else "the plan's request (detector_masks)"
            raise ValueError(f"detector family {family.name} has no mask head: masks cannot be computed "
                             f"(asked by {how}); load it with masks off")
        self.plan = plan
        self.dtype = DTYPE_BY_NAME[self.plan.dtype.value]
        model, report = family.load_detector(src, dtype=self.dtype, device=self.device, cfg=cfg)
        self._set_detector_kernels(model)
        self.detector_masks = self.plan.detector_masks
        model.with_masks = bool(self.detector_masks.value)
        self.detector, self.detector_family, self.detector_cfg, self.detector_report = model, family, cfg, report
        self.detector_graphs, self._detector_dir = None, src
        log.info("detector family %s (%s): deformable attention %s, AIFI attention %s, %s on %s; masks %s (%s); "
                 "graphs %s (%s)", family.name, choice.reason, self.plan.deformable_attention.value,
                 self.plan.dense_attention.value, self.dtype, self.device, "on" if model.with_masks else "off",
                 self.detector_masks.reason, list(self.plan.detector_graphs.value) or "off",
                 self.plan.detector_graphs.reason)
        return report

    def _set_detector_kernels(self, model) -> None:
        """The plan's deformable and dense attention backends on ``model`` (a component the
        family does not declare keeps the model's own kernel)."""
        deformable = self.plan.deformable_attention.value
        model.set_deformable_kernel(self.kernels.get(ComponentKind.DEFORMABLE_ATTENTION, deformable).sample)
        dense = self.plan.dense_attention.value
        if dense is not None and hasattr(model, "set_aifi_attention"):
            model.set_aifi_attention(self.kernels.get(ComponentKind.DENSE_ATTENTION, dense).attend)

    def detector_input_size(self) -> tuple[int, int]:
        """The fixed (height, width) the loaded detector's processor resizes every page to."""
        proc = self.detector_family.image_processor(self._detector_dir, self.detector_cfg)
        return int(proc.cfg.height), int(proc.cfg.width)

    def capture_detector_graphs(self) -> GraphReport:
        """The detector's forward captured per batch-size bucket, as the plan decides (a no-op
        report with the plan's reason when its detector graphs are off)."""
        if self.detector is None:
            raise RuntimeError("no detector loaded: call load_detector() first")
        buckets = self.plan.detector_graphs.value
        if not buckets:
            return GraphReport(captured=0, reason=self.plan.detector_graphs.reason)
        from .detector_graphs import DetectorGraphs
        graphs = DetectorGraphs(self, buckets, self.detector_input_size())
        report = graphs.capture()
        self.detector_graphs = graphs
        return dataclasses.replace(report, reason=self.plan.detector_graphs.reason)

    def detect_uploaded(self, pixels: torch.Tensor):
        """The detector's raw outputs for pixels already on the device in the compute dtype:
        replayed through its bucket graphs when captured (and the pixels are their size), else
        eager."""
        from .ops.precision import fp32_convolutions
        with torch.inference_mode():
            g = self.detector_graphs
            if g is not None and tuple(pixels.shape[1:]) == (3, *g.image_size):
                return g.run(pixels)
            with fp32_convolutions(self.device, self.dtype):      # an fp32 plan's convolutions: no TF32
                return self.detector(pixels)

    def _check_detector_pixels(self, pixel_values) -> None:
        if self.detector is None:
            raise RuntimeError("no detector loaded: call load_detector() first")
        if not isinstance(pixel_values, torch.Tensor) or pixel_values.ndim != 4 or pixel_values.shape[1] != 3:
            raise ValueError(f"pixel_values must be a [B, 3, H, W] tensor, got "
                             f"{list(getattr(pixel_values, 'shape', [])) or type(pixel_values).__name__}")
        if not pixel_values.is_floating_point():
            raise ValueError(f"pixel_values must be floating point (the processor's [0, 1] scale), got "
                             f"{pixel_values.dtype}")

    def detect_device(self, pixel_values: torch.Tensor):
        """detect() up to its one read-back: the pixels checked, pinned, uploaded and run. The
        host path a sync guard covers (detector_sync_check_runner)."""
        self._check_detector_pixels(pixel_values)
        pv = pixel_values
        if pv.device != self.device and pv.device.type == "cpu":
            pv = self.device_api.pin(pv)
        return self.detect_uploaded(pv.to(self.device, non_blocking=True).to(self.dtype))

    def detect(self, pixel_values: torch.Tensor, sizes, *, threshold: float):
        """Detections per page ([B, 3, H, W] float pixels from the family's processor; ``sizes``
        each page's (height, width)): label, score, bbox in page pixels, in reading order. The
        post-processing's copy of the outputs to the host is the one read-back."""
        self._check_detector_pixels(pixel_values)
        if len(sizes) != pixel_values.shape[0]:
            raise ValueError(f"{pixel_values.shape[0]} images but {len(sizes)} page sizes")
        out = self.detect_device(pixel_values)
        return self.detector_family.postprocess(self.detector_cfg, out, sizes, threshold=threshold)

    def detector_sync_check_runner(self) -> "TorchRunner":
        """The runner the detector's no-sync proof runs on (as sync_check_runner for the VLM):
        this runner on an accelerator; on a host device a twin with the same class, plan and
        detector config whose detector lives on ``meta``, so that a read-back or a transfer to
        the host is an op the guard sees."""
        if self.detector is None:
            raise RuntimeError("no detector loaded: call load_detector() first")
        if self.device.type != "cpu":
            return self
        twin = type(self)(dataclasses.replace(self.plan, device="meta"), self.probe_result, self.row,
                          family=self.family, kernels=self.kernels)
        model, _ = self.detector_family.load_detector(None, dtype=self.dtype, device=torch.device("meta"),
                                                      cfg=self.detector_cfg)
        twin._set_detector_kernels(model)
        model.with_masks = self.detector.with_masks
        twin.detector, twin.detector_family, twin.detector_cfg = model, self.detector_family, self.detector_cfg
        twin.detector_report, twin.detector_masks, twin._detector_dir = (self.detector_report, self.detector_masks,
                                                                        self._detector_dir)
        return twin

    # ------------------------------------------------------------ reporting
    def describe(self) -> str:
        lines = [f"runner: {self.name}", f"probe: {self.probe_result.summary()}", self.plan.describe()]
        if self.load_report:
            r = self.load_report
            lines.append(f"model: {self.family.name} family, {r.model_dir or 'dummy (built-in config)'}; "
                         f"layout {r.layout} ({r.layout_reason}); {r.tensors_loaded} tensors")
        if self.detector is not None:
            r = self.detector_report
            lines.append(f"detector: {self.detector_family.name} family, {r.model_dir or 'dummy (built-in config)'}; "
                         f"{r.tensors_loaded} tensors ({r.tensors_ignored} unused by inference ignored); masks "
                         f"{'on' if self.detector.with_masks else 'off'}; graphs "
                         + (f"replaying buckets {list(self.detector_graphs.buckets)}" if self.detector_graphs
                            else "none captured"))
        return "\n".join(lines)

