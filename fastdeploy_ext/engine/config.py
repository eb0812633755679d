"""EngineConfig: everything the engine needs, built from the shared flags (entrypoints/args.py)
or by the offline LLM API; every derived choice is a Decision with its reason."""
from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field

import torch

from .. import envs
from ..plan import Decision, PlanRequest
from .errors import InvalidRequest
from .scheduler import SchedulerConfig

DEFAULT_CPU_KV_CACHE_BYTES = 1 << 30
DEFAULT_MIXED_ENCODER_PATCHES = 16384


def parse_bytes(text: str | int | None) -> int | None:
    """'4GiB', '512MB', '1e9', 1073741824 -> bytes."""
    if text is None or isinstance(text, int):
        return text
    m = re.fullmatch(r"\s*([0-9.eE+]+)\s*([KMGT]?)(i?)B?\s*", str(text), re.IGNORECASE)
    if not m:
        raise ValueError(f"not a byte size: {text!r} (e.g. 4GiB, 512MB, 1073741824)")
    num, unit, binary = float(m.group(1)), m.group(2).upper(), m.group(3)
    base = 1024 if binary or not unit else 1000
    return int(num * base ** " KMGT".index(unit or " "))


def parse_limit_mm(text: str | dict | None) -> dict[str, int]:
    """--limit-mm-per-prompt '{"image": 2}'."""
    if text is None:
        return {"image": 1}
    try:
        d = json.loads(text) if isinstance(text, str) else dict(text)
    except (json.JSONDecodeError, TypeError, ValueError) as e:
        raise ValueError(f"--limit-mm-per-prompt is not valid JSON ({e}): {text!r}") from None
    if not isinstance(d, dict) or set(d) - {"image"} or not all(
            isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in d.values()):
        raise ValueError(f"--limit-mm-per-prompt must be JSON like '{{\"image\": 1}}', got {text!r}")
    return {"image": d.get("image", 1)}


#: --preprocess-device values (EngineConfig.preprocess_decision)
PREPROCESS_DEVICES = ("auto", "host", "device")


@dataclass
class EngineConfig:
    model: str | None = None
    load_format: str = "auto"
    model_format: str = "auto"
    model_family: str | None = None            # None: detected from config.json's model_type
    plan: PlanRequest = field(default_factory=PlanRequest)
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 16384
    max_model_len: int = 16384
    max_encoder_patches: int = 65536           # one step's encoder work in the family's cost unit
                                               # (PaddleOCR-VL: patches; 65536 ~ 6 1080p pages)
    encoder_cache_size: int | None = None      # embedding rows the encoder cache holds; None: see
                                               # encoder_cache_rows()
    limit_mm_per_prompt: dict = field(default_factory=lambda: {"image": 1})
    gpu_memory_utilization: float = 0.9
    kv_cache_memory: int | None = None         # bytes of KV pool on devices without a free-memory
                                               # query (CPU); default 1 GiB
    num_kv_blocks: int | None = None           # exact pool size (tests, debugging): overrides both
    enable_max_prefill: bool | None = None     # None: FD_ENABLE_MAX_PREFILL
    preprocess_workers: int = 4
    preprocess_device: str = "auto"            # where image views are made: host (PIL), device (the
                                               # runner's, where the family's processor can), auto
    step_timeout: float = 300.0                # seconds one step may run (after the first) before the
                                               # async engine reports itself stuck
    async_scheduling: bool | None = None       # overlap step N+1's host work with step N (None: the row's default)
                                               # (LLMEngine decides with the runner: async_decision)
    mixed_steps: bool | None = None            # running requests' decode rows in prefill steps (None: the
                                               # row's default; LLMEngine decides: mixed_decision)
    mixed_encoder_patches: int | None = None   # a mixed step's encoder budget (None: see mixed_encoder_budget)

    def validate(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_model_len", "max_encoder_patches",
                     "preprocess_workers", "mixed_encoder_patches"):
            v = getattr(self, name)
            if v is None and name == "mixed_encoder_patches":
                continue
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be a positive integer, got {v!r}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"--gpu-memory-utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.kv_cache_memory is not None and self.kv_cache_memory <= 0:
            raise ValueError(f"--kv-cache-memory must be positive, got {self.kv_cache_memory}")
        c = self.encoder_cache_size
        if c is not None and (isinstance(c, bool) or not isinstance(c, int) or c < 1):
            raise ValueError(f"--encoder-cache-size must be a positive integer, got {c!r}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError(f"num_kv_blocks must be >= 1, got {self.num_kv_blocks}")
        parse_limit_mm(self.limit_mm_per_prompt)
        if self.preprocess_device not in PREPROCESS_DEVICES:
            raise ValueError(f"--preprocess-device must be one of {', '.join(PREPROCESS_DEVICES)}, "
                             f"got {self.preprocess_device!r}")
        t = self.step_timeout
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not 0 < t < float("inf"):
            raise ValueError(f"--step-timeout must be a positive number of seconds, got {t!r}")

    def max_prefill(self) -> Decision:
        """The admission mode: the one place FD_ENABLE_MAX_PREFILL is read (the server logs this
        Decision; the scheduler gets its value)."""
        if self.enable_max_prefill is not None:
            return Decision(bool(self.enable_max_prefill), "set in the engine config")
        value = envs.FD_ENABLE_MAX_PREFILL.get()
        how = "set" if envs.FD_ENABLE_MAX_PREFILL.name in os.environ else "default for PaddleOCR-VL"
        mode = ("one packed vision pass per step, whole prompts" if value
                else "per-request item encoding, chunked prefill")
        return Decision(value, f"FD_ENABLE_MAX_PREFILL={int(value)} ({how}): {mode}")

    def preprocess_decision(self, runner, image_processor) -> Decision:
        """Where the preprocessing workers make a request's image views: "host" (PIL) or
        "device" (the runner's: the family's processor uploads the decoded page and resizes and
        cuts it there, the same bytes; ``on_device``). --preprocess-device device asks for it and
        is refused for a processor without a device path; auto takes the device wherever the
        processor has that path and the runner is not on the host CPU."""
        dev = torch.device(getattr(runner, "device", "cpu"))
        name = type(image_processor).__name__
        how = self.preprocess_device
        flag = "auto" if how == "auto" else f"--preprocess-device {how}"
        if how == "host":
            return Decision("host", "--preprocess-device host: PIL in the preprocessing workers")
        if not callable(getattr(image_processor, "on_device", None)):
            if how == "device":
                raise ValueError(f"--preprocess-device device: {name} makes its views on the host only "
                                 "(DeepSeek-OCR-2's processor has a device path); use host or auto")
            return Decision("host", f"auto: {name} makes its views on the host only (PIL in the preprocessing "
                                    "workers)")
        if dev.type == "cpu":
            return Decision("host", f"{flag}: the runner's device is the host CPU, where PIL is the faster way to "
                                    "the same bytes")
        return Decision("device", f"{flag}: {name} resizes and cuts on {dev} (Pillow's integer resampling, the "
                                  "same bytes); the host decodes")

    def async_decision(self, runner) -> Decision:
        """Overlapped ("async") scheduling: --async-scheduling / --no-async-scheduling when given;
        otherwise the runner's capability row decides (``async_scheduling.default``: off on a row
        whose device has not yet shown the device-fed decode inputs right). Never on a runner that
        cannot take the previous step's sampled ids on the device as the next step's input ids."""
        how = ("step N+1 is scheduled and built while the device runs step N, its sampled ids feed N+1 on the "
               "device and reach the host one step late; a step with a repetition_penalty request waits for the "
               "previous ids (the penalty reads the history on the host)")
        if self.async_scheduling is False:
            return Decision(False, "--no-async-scheduling: each step waits for its sampled ids before the next "
                                   "is scheduled")
        if not getattr(runner, "takes_device_token_ids", False):
            name = getattr(runner, "name", type(runner).__name__)
            return Decision(False, f"the {name} runner cannot take device-resident input ids "
                                   "(takes_device_token_ids): synchronous steps")
        if self.async_scheduling is True:
            return Decision(True, f"--async-scheduling: {how}")
        row = getattr(runner, "row", None)
        if row is not None and not row.async_scheduling_default:
            return Decision(False, f"row {row.name}: async_scheduling.default is false (the overlapped step loop is "
                                   "not yet verified on this device); --async-scheduling turns it on")
        return Decision(True, f"default{f' of row {row.name}' if row is not None else ''}: {how}")

    def mixed_decision(self, runner) -> Decision:
        """Mixed steps (scheduler.py): the running requests' decode rows in the steps that admit
        new ones, so the newcomers' vision pass and prefill do not stall their next token.
        --mixed-steps / --no-mixed-steps when given; otherwise the runner's capability row
        (``mixed_steps.default``). Never on a runner that cannot take decode rows in a prefill
        step (``takes_mixed_steps``)."""
        how = ("running requests get their next token in the steps that prefill new ones (their inter-token gap "
               "is one step, not a vision pass plus a prefill and then a decode)")
        if self.mixed_steps is False:
            return Decision(False, "--no-mixed-steps: a step that admits requests is a prefill only, running "
                                   "requests wait for it")
        if not getattr(runner, "takes_mixed_steps", False):
            name = getattr(runner, "name", type(runner).__name__)
            return Decision(False, f"the {name} runner cannot take decode rows in a prefill step "
                                   "(takes_mixed_steps): prefill and decode steps apart")
        if self.mixed_steps is True:
            return Decision(True, f"--mixed-steps: {how}")
        row = getattr(runner, "row", None)
        if row is not None and not getattr(row, "mixed_steps_default", True):
            return Decision(False, f"row {row.name}: mixed_steps.default is false (decode rows through the prefill "
                                   "kernels not yet measured on this device); --mixed-steps turns it on")
        return Decision(True, f"default{f' of row {row.name}' if row is not None else ''}: {how}")

    def mixed_encoder_budget(self) -> Decision:
        """A mixed step's encoder budget (family cost units, patches for PaddleOCR-VL): its decode
        rows wait for its vision pass, so it is kept to what runs in ~25 ms on the H200 (16 layout
        blocks, ~16k patches: docs/PERFORMANCE.md) unless set; never above --max-encoder-patches."""
        if self.mixed_encoder_patches is not None:
            value = min(self.mixed_encoder_patches, self.max_encoder_patches)
            return Decision(value, "--mixed-encoder-patches" + (" (capped at --max-encoder-patches)"
                                                                if value < self.mixed_encoder_patches else ""))
        value = min(DEFAULT_MIXED_ENCODER_PATCHES, self.max_encoder_patches)
        return Decision(value, f"default: min({DEFAULT_MIXED_ENCODER_PATCHES}, --max-encoder-patches): a mixed "
                               "step's vision pass stays short, the running requests' tokens wait for it")

    def encoder_cache_rows(self) -> Decision:
        """Embedding rows of the encoder cache. Default max(--max-num-batched-tokens,
        --max-model-len): a step's placeholder tokens never exceed it, so the cache never delays
        a step the token budget allows, and one prompt's items always fit. In max prefill mode a
        whole prompt's items are encoded and held in one step, so a smaller --encoder-cache-size
        is raised to --max-model-len (else a prompt with several items could never be admitted).
        In chunked mode a smaller value stands; an item with more rows is refused at admission."""
        default = max(self.max_num_batched_tokens, self.max_model_len)
        if self.encoder_cache_size is None:
            return Decision(default, f"default: max(--max-num-batched-tokens {self.max_num_batched_tokens}, "
                                     f"--max-model-len {self.max_model_len})")
        if self.max_prefill().value and self.encoder_cache_size < self.max_model_len:
            return Decision(self.max_model_len, f"--encoder-cache-size {self.encoder_cache_size} raised to "
                                                f"--max-model-len: max prefill holds a whole prompt's items at once")
        return Decision(self.encoder_cache_size, "--encoder-cache-size")

    def scheduler_config(self, mixed_steps: bool = False) -> SchedulerConfig:
        return SchedulerConfig(max_num_seqs=self.max_num_seqs, max_num_batched_tokens=self.max_num_batched_tokens,
                               max_encoder_cost=self.max_encoder_patches,
                               enable_max_prefill=bool(self.max_prefill().value), mixed_steps=mixed_steps,
                               mixed_encoder_cost=self.mixed_encoder_budget().value)


__all__ = ["EngineConfig", "InvalidRequest", "parse_bytes", "parse_limit_mm"]
