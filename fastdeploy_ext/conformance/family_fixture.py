"""What a model family gives the conformance suite: its tiny models and their references.

A family returns a :class:`ConformanceFixture` from ``ModelFamily.conformance_fixture(workdir)``
(models/interface.py); the suite (``--fdx-family NAME``, default the default family) runs its
family-neutral tests on it. Each case names the model dir it runs and the reference outputs it
is compared with, by source: ``"shipped"`` (package data computed once, e.g. by transformers) and
``"live"`` (computed now by the family's own reference). A family builds its tiny models into
``workdir`` (or points at shipped ones); nothing here is downloaded.

Tests of what only some families have are marked ``fdx_family_fact(FamilyFact.X)`` and
deselected, with the reason in the summary, on families whose fixture does not declare X.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import Any, Callable, ClassVar

import torch


class FamilyFact(str, Enum):
    """What some families' vision paths have and the tests that check it need."""
    SHIPPED_REFERENCES = "shipped_references"   # references shipped as package data, with provenance
    PADDLE_LAYOUT = "paddle_layout"             # checkpoints in Paddle layout too (Linear [in, out])
    GRID_THW_LAYOUTS = "grid_thw_layouts"       # host and device metadata paths (bitwise equal, host one sync-free)
    QKV_STRIDED = "qkv_strided"                 # strided == dense qkv; the strided kernel reads the projection's views
    VARIABLE_GRIDS = "variable_grids"           # images of any patch grid packed together (padding segments, budgets)
    SYNC_INJECTION = "sync_injection"           # sync_targets(): device tensors of the host metadata path to
    #                                             inject syncs on (the guard must fire on each)

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True)
class SyncTargets:
    """Device tensors made on the host metadata path (on the checked runner's device), for the
    sync-injection tests to read back in every way DESIGN.md section 6 lists."""
    index: torch.Tensor          # int64 [N], values >= 0
    offsets: torch.Tensor        # int32 [k + 1], non-decreasing from 0
    values: torch.Tensor         # fp32


@dataclass(frozen=True)
class EncodeCase:
    """encode parity: the same weights in each layout, a batch of images, expected features."""
    model_dirs: dict[str, Path]                          # layout ("torch", "paddle") -> model dir
    num_images: int
    batch: Callable[[Path, int], Any]                    # (model dir, n) -> ImageBatch of the first n images
    expected: Callable[[], dict[str, list[torch.Tensor]]]    # source -> fp32 features per image (all images)


@dataclass(frozen=True)
class TextCase:
    """decoder parity through the paged step runner: one image's prompt, teacher-forced tokens."""
    model_dir: Path
    token_ids: list[int]
    positions: torch.Tensor                              # int64 [P, n] (P: the family's position_rows)
    rope_delta: int
    image: Any                                           # ImageBatch of the one image
    continuation: list[int]                              # teacher-forced decode tokens after the prompt
    expected: dict[str, torch.Tensor]                    # source -> fp32 logits [1 + len(continuation), vocab]


@dataclass(frozen=True)
class GenerateCase:
    """greedy generation through the engine: one request per image, fp32."""
    model_dir: Path
    images: list[Path]
    prompt: str
    max_tokens: int
    expected: list[list[int]]                            # greedy ids per image, each request alone
    live: Callable[[list[Path]], list[list[int]]] | None = None   # recomputed now (None: the shipped ids only)
    # tokens of the longest prompt of ``images`` (image rows included) where it exceeds what the
    # suite's lengths assume (DeepSeek-OCR-2: >= 257 rows an image); 0: the suite's defaults hold
    max_prompt_len: int = 0


# the bad batches every family must refuse with a clear BatchError (name -> what is wrong)
BAD_BATCH_KINDS = ("empty", "grid_mismatch", "odd_grid", "zero_dim", "bad_rank", "bad_patch", "not_thw",
                   "int_pixels")


class ConformanceFixture(ABC):
    """One family's tiny models and references. Cases are built on first use (a leg that runs
    only encode tests never computes generation references)."""
    facts: ClassVar[frozenset[FamilyFact]] = frozenset()
    #: the suite the session runs (--fdx-suite): "core" (a family's second leg on one machine)
    #: lets a fixture build its cases from fewer requests, each property still checked
    suite: str = "full"

    def __init__(self, workdir: str | Path):
        self.workdir = Path(workdir)

    @abstractmethod
    def encode_case(self) -> EncodeCase: ...

    @abstractmethod
    def text_case(self) -> TextCase: ...

    @abstractmethod
    def generate_case(self) -> GenerateCase: ...

    def sync_targets(self, builder, meta) -> SyncTargets:
        """The device tensors of what ``builder.build_host`` just returned (FamilyFact.SYNC_INJECTION).
        The default reads PaddleOCR-VL's metadata: merge permutation, cu_seqlens, rotary cos."""
        return SyncTargets(meta.merge_index, meta.cu_seqlens, meta.cos)

    @abstractmethod
    def bad_batches(self) -> dict[str, tuple[torch.Tensor, list, str]]:
        """BAD_BATCH_KINDS -> (pixel_values, grid_thw, a regex the BatchError must match)."""


# ------------------------------------------------------------------------- detector families
@dataclass(frozen=True)
class DetectCase:
    """A layout detector's parity case: a tiny checkpoint, the pages' pixels (our processor's),
    the reference outputs and the post-processed goldens."""
    model_dir: Path
    pixels: torch.Tensor                                 # [B, 3, H, W] fp32, what the references were computed on
    sizes: list[tuple[int, int]]                         # each page's (height, width)
    num_queries: int
    threshold: float
    #: expected(device under test) -> source -> output name -> fp32 tensor (a family whose reference
    #: outputs depend on the device, e.g. through an unstable sort, computes them there)
    expected: Callable[[torch.device], dict[str, dict[str, torch.Tensor]]]
    golden: list[list[dict]]                             # per page: label, label_id, score, bbox, order
    tolerance: float = 1e-4                              # max abs error of every output (fp32)
    #: transformers' own post-processing of the reference outputs, per page {labels, scores, boxes},
    #: where it was available when the goldens were made (it needs torchvision); None: not recorded
    reference_postprocess: list[dict] | None = None
    topk_margin: float = 1e-3                            # the encoder's k-th vs k+1-th score, at least
    #: golden_for(device) -> the goldens valid on that device (None: ``golden`` holds everywhere)
    golden_for: Callable[[torch.device], list[list[dict]]] | None = None
    #: reconcile(runner, got, want) -> (outputs to compare, note or None): a family whose outputs
    #: have a step function of an earlier output (V2's integer box coordinates) replaces the
    #: outputs behind a step that a within-tolerance difference crossed by the same network run
    #: on the reference's inputs, saying so; it never touches outputs compared as they are
    reconcile: Callable[[Any, Any, dict], tuple[Any, str | None]] | None = None
    #: detections_for_goldens(runner) -> (per-page detections to compare with the goldens, note
    #: or None); None: ``runner.detect`` at ``threshold``
    detections_for_goldens: Callable[[Any], tuple[list, str | None]] | None = None

    def goldens(self, device: torch.device) -> list[list[dict]]:
        return self.golden if self.golden_for is None else self.golden_for(device)

    def reconciled(self, runner, got, want: dict) -> tuple[Any, str | None]:
        """``reconcile``'s (outputs to compare, note); ``(got, None)`` for a family without one."""
        return (got, None) if self.reconcile is None else self.reconcile(runner, got, want)


class DetectorConformanceFixture(ABC):
    """A detector family's tiny models and references (``DetectorFamily.conformance_fixture``):
    the conformance suite's detector tests (test_detector.py) run it on every leg."""

    def __init__(self, workdir: str | Path):
        self.workdir = Path(workdir)

    @abstractmethod
    def detect_case(self) -> DetectCase: ...
