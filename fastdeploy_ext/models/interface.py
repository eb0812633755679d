"""What a model family supplies to the framework: the one seam every model plugs into.

A backend is a device (runner.py's DeviceRunner); a family is a model. Everything model-specific
lives in ``fastdeploy_ext/models/<family>/`` behind a :class:`ModelFamily`: config parsing,
the loader, the tokenizer and prompt builder, the modules and their per-batch metadata, what a
captured graph budget means, and the components the plan chooses kernels for. The runners call
these hooks and import no family; families register through the entry-point group
``fastdeploy_ext.models`` (models/registry.py), the built-in ones exactly as out-of-tree ones.

The interface is split by role: :class:`Family` holds what every family supplies (identity,
configs, components, conformance); :class:`ModelFamily` (also named :data:`VLMFamily`) adds a
VLM's hooks, :class:`DetectorFamily` a detector's. The registry lists both roles.

The interface is deliberately narrow (as vLLM's ``platforms/interface.py`` is for devices):
a hook exists because a runner calls it.
"""
from __future__ import annotations

import json
from abc import ABC, abstractmethod
from enum import Enum
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Mapping, Protocol, Sequence

import torch

from ..plan import Component, ComponentKind

if TYPE_CHECKING:
    from ..conformance.family_fixture import ConformanceFixture
    from ..ops.attention.varlen import VarlenAttention

Grid = tuple[int, int, int]


class BatchError(ValueError):
    """A vision batch that cannot be encoded (bad grid, wrong shapes); the message says why."""


class CheckpointError(ValueError):
    """The model directory cannot be loaded; the message names the file or tensor."""


def read_config_json(model_dir: str | Path) -> tuple[dict, Path]:
    """A model directory's config.json as a dict, and its path: a missing file is a
    FileNotFoundError, a file that is not a JSON object a CheckpointError, each naming the path."""
    path = Path(model_dir) / "config.json"
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise FileNotFoundError(f"{path}: no config.json in the model directory") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{path}: not a JSON object")
    return data, path


class DecoderModel(Protocol):
    """The text decoder as the step runner drives it (text_runner.py)."""
    cfg: Any                    # num_hidden_layers, num_attention_heads, num_key_value_heads, head_dim
    fused: bool

    def embed(self, token_ids: torch.Tensor, image_embeds: torch.Tensor | None,
              image_index: torch.Tensor | None) -> torch.Tensor: ...

    def __call__(self, x: torch.Tensor, positions: torch.Tensor, attention) -> torch.Tensor: ...

    def logits(self, h: torch.Tensor) -> torch.Tensor: ...


class GraphBuffers(Protocol):
    """The static inputs of one captured encoder budget (graphs.py owns capture and replay)."""
    pixels: torch.Tensor        # [tokens, patch_dim] the replay's input
    meta: Any                   # the family's metadata over the static buffers

    def load(self, pixels: torch.Tensor, meta: Any) -> None:
        """Copy one batch (``meta.num_tokens`` <= the budget) into the static buffers."""

    def outputs(self, num_tokens: int) -> int:
        """Rows of encoder output that ``num_tokens`` input patches produce."""


class FamilyRole(str, Enum):
    """What kind of model a family holds: which runner path and which commands serve it."""
    VLM = "vlm"                  # vision encoder + text decoder + prompt: encode, generate, serve
    DETECTOR = "detector"        # an image -> boxes model: detect (the layout stage of parsing)

    def __str__(self) -> str:
        return self.value


class Family(ABC):
    """What every family supplies, whatever its role: registry identity, configs, the
    components the plan picks kernels for and the conformance hook. Stateless: configs and
    modules are passed in, never kept. A family subclasses one role: :class:`ModelFamily` (a
    VLM) or :class:`DetectorFamily`."""

    name: ClassVar[str]
    #: config.json ``model_type`` values this family loads (detection, models/registry.py)
    model_types: ClassVar[tuple[str, ...]]
    role: ClassVar[FamilyRole]

    # ------------------------------------------------------------------ config
    @abstractmethod
    def default_config(self) -> Any:
        """The built-in config (random weights with ``--load-format dummy``; `info` without a model)."""

    @abstractmethod
    def read_config(self, model_dir: str) -> Any:
        """The model directory's config (config.json); a clear error naming the file when bad."""

    @abstractmethod
    def components(self, cfg: Any) -> tuple[Component, ...]:
        """What the plan chooses kernels for, each with its kernel kind and facts."""

    # ------------------------------------------------------------------ conformance
    def conformance_fixture(self, workdir: str) -> "ConformanceFixture | None":
        """The family's tiny models and references for the conformance suite
        (``--fdx-family NAME``; conformance/family_fixture.py), built into ``workdir`` or shipped.
        None: the family has none, and the suite says so instead of running."""
        return None


def require_role(family: Family, role: FamilyRole, what: str) -> None:
    """A clear error when ``what`` (a command, a runner path) is asked of a family of another role."""
    if family.role is not role:
        raise ValueError(f"model family {family.name} is a {family.role} family; {what} needs a {role} family")


class ModelFamily(Family):
    """A VLM family (vision encoder + projector, text decoder, prompt builder): the hooks the
    encoder, the engine and the server call. The name predates the role split and is kept."""

    role: ClassVar[FamilyRole] = FamilyRole.VLM

    # ------------------------------------------------------------------ loading
    @abstractmethod
    def load_vision(self, model_dir: str | None, *, dtype: torch.dtype, device: torch.device,
                    model_format: str, cfg: Any) -> tuple[torch.nn.Module, Any]:
        """Vision encoder + projector (random weights when ``model_dir`` is None); returns the
        module and a LoadReport (model_dir, files, layout, layout_reason, tensors_loaded)."""

    @abstractmethod
    def build_vision_model(self, cfg: Any) -> torch.nn.Module:
        """The vision module's structure with weights on ``meta`` (the no-sync proof's twin)."""

    @abstractmethod
    def load_text(self, model_dir: str | None, *, dtype: torch.dtype, device: torch.device,
                  model_format: str, cfg: Any) -> tuple[DecoderModel, Any]:
        """The text decoder; returns it and its LoadReport."""

    @abstractmethod
    def load_tokenizer(self, model_dir: str | None, cfg: Any) -> tuple[Any, Any]:
        """(tokenizer, chat template) of the model dir, or the built-in ones without a dir."""

    @abstractmethod
    def image_processor(self, model_dir: str | None) -> Any:
        """The host-side image preprocessor (the model dir's settings, or the built-in ones)."""

    @abstractmethod
    def build_prompt(self, tokenizer, chat_template, cfg: Any, *, messages=None, prompt=None, image_grids=()):
        """The prompt as the engine feeds it: an object with ``token_ids`` (image placeholders
        expanded, one token per embedding row), ``positions`` (int64 ``[position_rows, n]``),
        ``rope_delta`` (a decode token's position is its index + rope_delta; 0 for 1D rope) and
        ``image_runs`` ((offset, length) of each image's placeholder run, in order; length =
        ``output_sizes`` of its grid). ``messages`` are already normalized by
        fastdeploy_ext/inputs/messages.py when the engine calls it; ``image_grids`` are the image
        processor's grids in prompt order."""

    # ------------------------------------------------------------------ execution
    @abstractmethod
    def vision_execution(self, attention: "VarlenAttention", strided_qkv: bool, fused_layers: bool, *,
                         kernels: Mapping[ComponentKind, Any] | None = None) -> Any:
        """How the vision modules run under the plan (attention backend, qkv layout, fused passes).
        ``kernels``: the backend object the plan chose per kernel kind of the model's components
        (the runner's registry's), for families whose vision tower has kinds of its own."""

    @abstractmethod
    def metadata_builder(self, cfg: Any, vision_model: torch.nn.Module, *, dtype: torch.dtype,
                         device: torch.device, attention: "VarlenAttention") -> Any:
        """The per-batch metadata builder (``build_host(grids)``, ``build_device(grid_tensor)``;
        both return metadata with ``num_tokens`` and ``out_split_sizes``)."""

    @abstractmethod
    def check_pixels(self, cfg: Any, pixel_values: torch.Tensor, grids: Sequence[Sequence[int]]) -> list[Grid]:
        """Validate a packed batch's pixels and grids (BatchError naming the problem)."""

    @abstractmethod
    def output_sizes(self, cfg: Any, grids: Sequence[Grid]) -> list[int]:
        """Encoder output rows (image embeddings) per image."""

    @abstractmethod
    def graph_buffers(self, cfg: Any, tokens: int, attention_state: Any, *, device: torch.device,
                      dtype: torch.dtype) -> GraphBuffers:
        """Static buffers for an encoder graph captured at a budget of ``tokens`` input patches:
        what a budget means for this family (e.g. how many output rows it yields)."""

    def encoder_graphs(self, runner: Any, paths: tuple) -> Any:
        """The runner's encoder graphs for the plan's ``paths`` (``capture() -> GraphReport``,
        ``run(pixels, grids)`` -> the eager forward's rows, ``stats``). None (the default): the
        runner's own, graphs.py's budgets over packed patches through graph_buffers."""
        return None

    @abstractmethod
    def image_token_id(self, cfg: Any) -> int:
        """The placeholder token whose rows the image embeddings replace."""

    @property
    @abstractmethod
    def position_rows(self) -> int:
        """Rows of a prefill's rope positions ([P, n]: 3 for mrope, 1 for 1D rope)."""

    @abstractmethod
    def encoder_matmul_shapes(self, cfg: Any, tokens: int) -> tuple[tuple[int, int, int], ...]:
        """(m, k, n) of the encoder's GEMMs on ``tokens`` patches (backends probe their BLAS with it)."""

    # --- engine inputs
    @abstractmethod
    def encoder_cost(self, cfg: Any, grid: Grid) -> int:
        """What encoding one item of this grid costs, in the unit the scheduler budgets per step
        against --max-encoder-patches (e.g. input patches t*h*w); at least 1."""

    # --- memory profile (memory_profile.py: the engine sizes its KV pool from it)
    @abstractmethod
    def profile_images(self, cfg: Any, max_encoder_patches: int) -> Any:
        """The dummy runner.ImageBatch the measured memory profile encodes: the largest (in activation
        memory) one step's encoder budget admits (a sum of ``encoder_cost`` <= the budget), in
        the family's own pixel/grid form (``check_pixels`` accepts it); at least one item, the
        smallest, when the budget admits none."""

    @abstractmethod
    def activation_bytes(self, cfg: Any, max_num_batched_tokens: int, max_encoder_patches: int,
                         element_size: int) -> tuple[int, int]:
        """Estimated peak activation bytes (where the device API reports no allocator
        statistics) as (one vision pass over the encoder budget, one prefill of
        ``max_num_batched_tokens`` tokens), at ``element_size`` bytes per element; weights, KV
        and logits excluded."""

    @abstractmethod
    def eos_token_ids(self, cfg: Any) -> tuple[int, ...]:
        """The token ids that end a generation."""

    @abstractmethod
    def vocab_size(self, cfg: Any) -> int:
        """Rows of the decoder's logits (sampling parameters naming token ids are checked against it)."""

    def encode_outputs(self, cfg: Any, grids: Sequence[Grid]) -> dict[str, torch.Tensor]:
        """The tensors `encode` writes beside ``image_0, image_1, ...``: by default the images'
        grids (``grid_thw``, int64 ``[n, 3]``); a family whose grid is not a (t, h, w) patch grid
        writes its own form."""
        return {"grid_thw": torch.tensor([tuple(g) for g in grids], dtype=torch.int64).view(-1, 3)}

    # --- benchmarks
    # Not abstract: only a family the benchmarks compare against a reference implements them.
    def released_image_processor(self) -> Any:
        """The image processor with the released checkpoint's preprocessor settings (``bench
        preprocess`` without --model: what its transformers references are compared at)."""
        raise NotImplementedError(f"model family {self.name}: no released preprocessor settings")

    def preprocess_pool(self, processor: Any, workers: int | None = None) -> Any:
        """Threads running ``processor.preprocess`` (None: one per usable core): a context
        manager with ``workers`` and ``map(images)`` (results in input order)."""
        raise NotImplementedError(f"model family {self.name}: no preprocess pool")

    def builtin_special_tokens(self, cfg: Any) -> dict[str, int]:
        """Special token -> id as ``cfg`` numbers them (``bench serve`` writes a tokenizer for
        random weights with them)."""
        raise NotImplementedError(f"model family {self.name}: no built-in special tokens")

    def default_chat_template(self) -> str:
        """The chat template used when a model directory ships none."""
        raise NotImplementedError(f"model family {self.name}: no default chat template")

    def vision_bench(self) -> Any:
        """``bench vision`` for a family with its own workloads and reference: a callable
        ``(source, plan_request, options) -> exit status``; None (the default): the shared
        bench's workloads, variants and reference (PaddleOCR-VL's)."""
        return None

    def generate_reference(self) -> Any:
        """``bench generate``'s transformers side for this family: a class built like
        bench.generate.TransformersReference; None (the default): that one."""
        return None



#: the role's own name for the VLM interface
VLMFamily = ModelFamily


class DetectorFamily(Family):
    """An image -> detections family (the layout detectors): a fixed-size input, one forward
    per batch of pages, a host-side post-processing. The runner loads the module with
    ``load_detector`` and runs it on pixels from ``image_processor``; ``postprocess`` turns its
    outputs into detections in page pixels, in reading order."""

    role: ClassVar[FamilyRole] = FamilyRole.DETECTOR
    #: whether the module can compute the per-query mask outputs (a runner asked for masks refuses
    #: a family without them before loading its weights)
    supports_masks: ClassVar[bool] = True

    @abstractmethod
    def load_detector(self, model_dir: str | None, *, dtype: torch.dtype, device: torch.device,
                      cfg: Any) -> tuple[torch.nn.Module, Any]:
        """The detector module (random weights when ``model_dir`` is None) and its LoadReport
        (model_dir, files, tensors_loaded)."""

    @abstractmethod
    def image_processor(self, model_dir: str | None, cfg: Any) -> Any:
        """The host-side preprocessor: ``preprocess(images) -> (pixel_values [B, 3, H, W] float32,
        original sizes [(height, width), ...])``."""

    @abstractmethod
    def label_names(self, cfg: Any) -> tuple[str, ...]:
        """The class names, by class id."""

    @abstractmethod
    def postprocess(self, cfg: Any, outputs: Any, sizes: Sequence[tuple[int, int]], *,
                    threshold: float) -> list[list[Any]]:
        """Per image, its detections above ``threshold`` (label, score, bbox [x0, y0, x1, y1] in
        the image's pixels), in reading order."""
