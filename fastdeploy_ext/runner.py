"""The device-agnostic runner interface and the backend registry.

A backend (built-in or out of tree) is a `DeviceRunner` subclass registered under the
entry-point group ``fastdeploy_ext.backends``; the built-ins register exactly the same way
(setup.py). The registry is filled lazily from entry points; with the device APIs the backends
register for their torch device types (device_api.py) and the family registry, it is the
framework's only module-level mutable state.
"""
from __future__ import annotations

import contextlib
import logging
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from importlib.metadata import entry_points
from typing import TYPE_CHECKING, Callable, ClassVar, Sequence

import torch

from .models.interface import BatchError
from .plan import CapabilityRow, PlanRequest, RunPlan

if TYPE_CHECKING:
    from .engine.step import KVCacheSpec, StepBatch
    from .plan import ComponentKind
    from .platforms import ProbeResult

log = logging.getLogger(__name__)

ENTRY_POINT_GROUP = "fastdeploy_ext.backends"
AUTO_ORDER = ("cuda", "metax", "cpu_amx")   # --device auto: best present first
LOAD_FORMATS = ("auto", "safetensors", "dummy")
MODEL_FORMATS = ("auto", "torch", "paddle")


@dataclass(frozen=True)
class ModelSource:
    """Where load_model reads weights from: a model directory, or ``load_format="dummy"``
    (random weights from the family's built-in config, no directory). ``model_family`` overrides
    detection from config.json's model_type (models/registry.py)."""
    model_dir: str | None
    load_format: str = "auto"
    model_format: str = "auto"
    model_family: str | None = None

    def __post_init__(self):
        if self.load_format not in LOAD_FORMATS:
            raise ValueError(f"load_format must be one of {', '.join(LOAD_FORMATS)}, got {self.load_format!r}")
        if self.model_format not in MODEL_FORMATS:
            raise ValueError(f"model_format must be one of {', '.join(MODEL_FORMATS)}, got {self.model_format!r}")
        if self.load_format != "dummy" and not self.model_dir:
            raise ValueError("a model directory is needed unless load_format is 'dummy'")

    def load_into(self, runner: "DeviceRunner"):
        """runner.load_model with these settings; returns its LoadReport."""
        return runner.load_model(self.model_dir, load_format=self.load_format, model_format=self.model_format,
                                 model_family=self.model_family)


@dataclass
class ImageBatch:
    """Preprocessed images packed for one vision pass.

    pixel_values: [N, C, P, P] (or [N, C*P*P]) patches of all images, concatenated: float32, or the
    bytes of a family that normalizes on the device (DeepSeek-OCR-2: uint8).
    grid_thw: each image's (t, h, w) as host ints — the runtime's metadata comes from these.
    """
    pixel_values: torch.Tensor
    grid_thw: list[tuple[int, int, int]]

    @classmethod
    def from_images(cls, images: Sequence) -> "ImageBatch":
        """From a family processor's images (each with pixel_values and grid_thw)."""
        if not images:
            raise BatchError("empty batch: at least one image is needed")
        return cls(torch.cat([im.pixel_values for im in images]), [tuple(im.grid_thw) for im in images])


@dataclass(frozen=True)
class GraphReport:
    captured: int
    paths: dict = field(default_factory=dict)        # path name -> list of budgets captured
    capture_seconds: float = 0.0
    graph_memory_bytes: int = 0
    reason: str = ""


class DeviceRunner(ABC):
    """Runs a model on one device: the vision path (encoder + projector) and the text decoder
    over a paged KV cache, one StepBatch at a time (engine/step.py is the scheduler's side)."""

    name: ClassVar[str]

    def __init__(self, plan: RunPlan, probe: "ProbeResult"):
        self.plan, self.probe_result = plan, probe

    # -------------------------------------------------------------- class level
    @classmethod
    def capabilities_resource(cls):
        """Where this backend's capability rows are (a file or importlib.resources Traversable
        holding YAML), or None when it ships none. Default: ``capabilities.yaml`` in the package
        of the module defining the class. Schema and override rules: fastdeploy_ext/capabilities.py
        (which imports this registry: the lookup is here so the two do not import each other)."""
        import sys
        from importlib import resources
        package = getattr(sys.modules.get(cls.__module__), "__package__", None) or ""
        if not package:
            return None
        try:
            res = resources.files(package).joinpath("capabilities.yaml")
        except (ModuleNotFoundError, TypeError):
            return None
        return res if res.is_file() else None

    @classmethod
    def emulation(cls) -> "contextlib.AbstractContextManager | None":
        """A context inside which this backend runs without its hardware (e.g. a fake vendor SDK
        installed for the probe, results marked emulated), or None when the backend cannot be
        emulated. The conformance suite and ``FD_EMULATE`` use it; neither knows any vendor SDK."""
        return None

    @classmethod
    def matmul_kernel_evidence(cls, run: "Callable[[dict[str, str]], str]") -> dict | None:
        """Which kernels ran a workload's matmuls, read from the vendor library's own log:
        ``run(env)`` runs the workload in a child process with ``env`` added to its environment
        and returns the child's output; the backend chooses the variables that turn its log on
        and parses it. None: this backend reads no such log (``bench gemm`` then says so)."""
        return None

    @classmethod
    @abstractmethod
    def probe(cls) -> "ProbeResult":
        """Is this device here, and what is it? Never raises."""

    @classmethod
    @abstractmethod
    def select_row(cls, probe: "ProbeResult", table: dict[str, CapabilityRow]) -> tuple[CapabilityRow, str]:
        """The capability row for the probed device, with the reason."""

    @classmethod
    @abstractmethod
    def create(cls, request: PlanRequest, probe: "ProbeResult | None" = None,
               table: dict[str, CapabilityRow] | None = None) -> "DeviceRunner":
        """Probe (unless given), resolve the plan, and build the runner."""

    @classmethod
    def kernel_backends(cls) -> "dict[ComponentKind, list]":
        """Kernel backend objects this backend contributes, per kernel kind (e.g. a vision varlen
        attention of the vendor's own: a ``VarlenAttention``); its capability rows may name them
        like the built-ins. They join this runner's table only (ops/kernels.py: built-ins +
        these), so another backend's runner never sees them. Default: none."""
        return {}

    # ----------------------------------------------------------- instance level
    @abstractmethod
    def load_model(self, model_dir: str | None, *, load_format: str = "auto", model_format: str = "auto",
                   with_text: bool = False, model_family: str | None = None):
        """Load weights (or random ones for load_format='dummy'); returns a LoadReport. With
        ``with_text`` also the text decoder, the tokenizer and the chat template. ``model_family``
        overrides the family detected from the model dir (models/registry.py)."""

    @abstractmethod
    def encode_images(self, batch: ImageBatch) -> list[torch.Tensor]:
        """Vision + projector for all images of the batch in one packed pass; one
        [h*w/4, text_hidden] tensor per image, in the compute dtype, on the device."""

    @abstractmethod
    def capture_graphs(self) -> GraphReport:
        """Capture what the plan asks for (no-op report when graphs are off)."""

    # ---------------------------------------------------------- generation
    @abstractmethod
    def kv_cache_spec(self) -> "KVCacheSpec":
        """What one KV block costs (block size from the capability row)."""

    @abstractmethod
    def profile_peak_memory(self, max_num_batched_tokens: int, max_encoder_patches: int) -> int:
        """Bytes of activations a full step needs (vision pass + prefill), weights and KV excluded;
        measured where the allocator reports it, estimated otherwise. Call before init_kv_cache."""

    @abstractmethod
    def init_kv_cache(self, num_blocks: int) -> None:
        """Allocate ``num_blocks`` KV blocks (ids 0..num_blocks-1 for the block tables)."""

    @abstractmethod
    def free_kv_cache(self) -> None:
        """Release the KV cache (and the decode graphs that point into it)."""

    @abstractmethod
    def execute(self, step: "StepBatch") -> torch.Tensor:
        """Write the step's KV and return float32 logits [seqs with need_logits, vocab], on the
        device, rows in step order."""

    @abstractmethod
    def capture_decode_graphs(self, max_num_seqs: int, max_model_len: int) -> GraphReport:
        """Capture the decode batch-size buckets the plan asks for (after init_kv_cache);
        execute() then replays them for decode steps. A no-op report when the plan says off."""

    # ------------------------------------------------- host -> device on the step paths
    # (TorchRunner binds these, device_memory and memory_stats to its device API: device_api.py)
    def pin_host(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` (a host tensor) in memory this device copies from without blocking the host
        (page-locked on CUDA-style devices), or ``t`` itself where that means nothing. Called by
        the preprocessing workers, off the step loop."""
        return t

    def upload(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` (a host tensor, ideally from pin_host) on this runner's device, queued without
        blocking the host where the device can do that."""
        return t.to(self.device, non_blocking=True)

    def device_memory(self) -> "tuple[int, int] | None":
        """(free, total) bytes of the device now, or None when the backend cannot tell: the
        engine then sizes the KV pool from --kv-cache-memory and says so. Backends implement it
        with their device's allocator or management library."""
        return None

    def utilization_reader(self) -> "Callable[[], float] | None":
        """A callable returning the device's current busy % (sampled by benchmarks), or None when
        the backend cannot tell. Backends implement it with their vendor's management library."""
        return None

    @abstractmethod
    def memory_stats(self) -> dict:
        """Current and peak memory of the device, in bytes."""

    @abstractmethod
    def describe(self) -> str:
        """Probe + plan + model, human readable (printed at start-up and by `info`)."""


# ---------------------------------------------------------------------- registry
_REGISTRY: dict[str, type[DeviceRunner]] = {}


def register_backend(name: str, cls: type[DeviceRunner]) -> None:
    """For tests and embedding; installed backends use the entry-point group instead."""
    _REGISTRY[name] = cls


def available_backends() -> dict[str, type[DeviceRunner]]:
    found = {}
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        if ep.name in _REGISTRY or ep.name in found:
            continue
        try:
            found[ep.name] = ep.load()
        except Exception as e:  # a broken third-party backend must not take the others down
            log.warning("backend %s (%s) failed to load: %s", ep.name, ep.value, e)
    _REGISTRY.update(found)
    return dict(_REGISTRY)


def get_backend_class(name: str) -> type[DeviceRunner]:
    backends = available_backends()
    if name not in backends:
        raise ValueError(f"unknown device/backend {name!r}; registered: {', '.join(sorted(backends)) or 'none'} "
                         f"(is the package installed? backends register via the '{ENTRY_POINT_GROUP}' entry points)")
    return backends[name]


def choose_device(device: str) -> tuple[type[DeviceRunner], "ProbeResult", str]:
    """Resolve --device (auto or a backend name) to a runner class and its probe; an explicit
    device that is absent is an error naming what the probe saw."""
    if device != "auto":
        cls = get_backend_class(device)
        probe = cls.probe()
        if not probe.present:
            raise RuntimeError(f"--device {device}: device not present: {probe.reason}")
        return cls, probe, "requested"
    seen = []
    backends = available_backends()
    order = [n for n in AUTO_ORDER if n in backends] + sorted(set(backends) - set(AUTO_ORDER) - {"cpu"})
    for name in order:
        cls = backends[name]
        probe = cls.probe()
        if probe.present and probe.usable:
            return cls, probe, f"auto: first present of {order}" + (f" (skipped: {'; '.join(seen)})" if seen else "")
        seen.append(f"{name}: {probe.reason}")
    raise RuntimeError("--device auto: no usable device: " + "; ".join(seen))


def emulated_backends(names: Sequence[str]) -> contextlib.ExitStack:
    """Enter the emulation context of each named backend (``FD_EMULATE``); close the returned
    stack to leave them. A name that is not registered, or a backend without emulation, is an error."""
    stack = contextlib.ExitStack()
    for name in names:
        ctx = get_backend_class(name).emulation()
        if ctx is None:
            stack.close()
            raise ValueError(f"FD_EMULATE: backend {name!r} offers no emulation mode")
        stack.enter_context(ctx)
    return stack


def create_runner(request: PlanRequest) -> DeviceRunner:
    cls, probe, why = choose_device(request.device)
    runner = cls.create(request, probe=probe)
    log.info("device %s chosen (%s)", cls.name, why)
    return runner
