"""The offline API in vLLM's shape:

    from fastdeploy_ext import LLM, SamplingParams
    llm = LLM(model="PaddleOCR-VL", device="cuda", max_num_seqs=64)   # or LLM(load_format="dummy")
    outs = llm.chat([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "page.png"}},
                                                  {"type": "text", "text": "OCR:"}]}],
                    SamplingParams(temperature=0, max_tokens=512))
    outs[0].outputs[0].text

All prompts are handed to the engine's preprocessing pool at once; the step loop runs while
images are still being decoded, so the device does not wait for the CPU.

Results come back in input order, one RequestOutput per prompt. A prompt refused before it is
queued (a bad image, too long, bad sampling parameters) raises InvalidRequest naming it and runs
nothing. A request that fails inside the engine after it was queued fails alone: its output has
finish_reason "error" and ``error`` saying why (logged at ERROR), the others' results are kept.
A progress bar (tqdm) shows while prompts finish when ``use_tqdm`` and stderr is a terminal.
"""
from __future__ import annotations

import concurrent.futures as cf
import itertools
import logging
import sys
from typing import Any, Sequence

from ..engine.config import EngineConfig, parse_bytes, parse_limit_mm
from ..engine.errors import InvalidRequest
from ..engine.llm_engine import LLMEngine
from ..engine.outputs import RequestOutput
from ..engine.sampling_params import SamplingParams
from ..engine.scheduler import check_priority
from ..plan import PlanRequest

log = logging.getLogger(__name__)


class LLM:
    def __init__(self, model: str | None = None, *, load_format: str = "auto", model_format: str = "auto",
                 model_family: str | None = None, device: str = "auto", dtype: str = "auto", max_num_seqs: int = 256,
                 max_num_batched_tokens: int = 16384, max_model_len: int = 16384,
                 gpu_memory_utilization: float = 0.9, kv_cache_memory: int | str | None = None,
                 limit_mm_per_prompt: dict | str | None = None, max_encoder_patches: int = 65536,
                 encoder_cache_size: int | None = None, enable_max_prefill: bool | None = None, num_kv_blocks: int | None = None,
                 preprocess_workers: int = 4, preprocess_device: str = "auto", runner=None, input_processor=None, **plan_flags: Any):
        if model is None and load_format != "dummy" and runner is None:
            raise ValueError("LLM needs model=DIR (a local model directory) or load_format='dummy'")
        plan = PlanRequest(device=device, dtype=dtype, **plan_flags)
        plan.validate()
        self.config = EngineConfig(
            model=model, load_format=load_format, model_format=model_format, model_family=model_family, plan=plan, max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens, max_model_len=max_model_len,
            gpu_memory_utilization=gpu_memory_utilization, kv_cache_memory=parse_bytes(kv_cache_memory),
            limit_mm_per_prompt=parse_limit_mm(limit_mm_per_prompt), max_encoder_patches=max_encoder_patches,
            encoder_cache_size=encoder_cache_size, enable_max_prefill=enable_max_prefill, num_kv_blocks=num_kv_blocks, preprocess_workers=preprocess_workers,
            preprocess_device=preprocess_device)
        self._start(runner, input_processor)

    @classmethod
    def from_config(cls, config: EngineConfig, runner=None, input_processor=None) -> "LLM":
        """From an EngineConfig built elsewhere (the CLI's flags)."""
        self = cls.__new__(cls)
        self.config = config
        self._start(runner, input_processor)
        return self

    def _start(self, runner, input_processor) -> None:
        self.engine = LLMEngine(self.config, runner=runner, input_processor=input_processor)
        self._ids = itertools.count()

    def get_tokenizer(self):
        return self.engine.input_processor.builder.tokenizer

    # ------------------------------------------------------------------ public
    def generate(self, prompts: str | dict | Sequence[str | dict], sampling_params: SamplingParams |
                 Sequence[SamplingParams] | None = None, use_tqdm: bool = True,
                 priority: int | Sequence[int] | None = None) -> list[RequestOutput]:
        """prompts: {"prompt": str, "multi_modal_data": {"image": img or [imgs]}} (or a bare
        string); a raw prompt is one user turn's text after its images, in the chat template.
        priority: one int for all prompts or one per prompt; lower is scheduled earlier, default
        0, FIFO among equals (engine/scheduler.py)."""
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        reqs = [{"prompt": p} if isinstance(p, str) else p for p in prompts]
        if not reqs:
            return []
        return self._run(reqs, sampling_params, use_tqdm, priority)

    def chat(self, messages: list[dict] | Sequence[list[dict]], sampling_params: SamplingParams |
             Sequence[SamplingParams] | None = None, use_tqdm: bool = True,
             priority: int | Sequence[int] | None = None) -> list[RequestOutput]:
        """One conversation (a list of OpenAI-style messages) or a list of conversations;
        priority as in generate()."""
        if not isinstance(messages, (list, tuple)):
            raise InvalidRequest("chat() needs a conversation (list of messages) or a list of conversations")
        if not messages:
            return []
        convs = [messages] if isinstance(messages[0], dict) else list(messages)
        return self._run([{"messages": c} for c in convs], sampling_params, use_tqdm, priority)

    # ------------------------------------------------------------------ the loop
    @staticmethod
    def _per_prompt(value, n: int, default, what: str) -> list:
        """One value (not a list) for every prompt, or a list of exactly n."""
        if not isinstance(value, (list, tuple)):
            return [default if value is None else value] * n
        if len(value) != n:
            raise ValueError(f"{len(value)} {what} for {n} prompts (give one for all or one per prompt)")
        return list(value)

    def _run(self, reqs: list[dict], params, use_tqdm: bool, priority=None) -> list[RequestOutput]:
        params = self._per_prompt(params, len(reqs), SamplingParams(), "sampling params")
        priorities = self._per_prompt(priority, len(reqs), 0, "priorities")
        for i, pr in enumerate(priorities):
            try:
                check_priority(pr)
            except InvalidRequest as e:
                raise InvalidRequest(f"prompt {i}: {e}") from None
        eng = self.engine
        ids = [f"offline-{next(self._ids)}" for _ in reqs]
        index = {rid: i for i, rid in enumerate(ids)}
        futures = {eng.submit(rid, r, p, priority=pr): rid for rid, r, p, pr in zip(ids, reqs, params, priorities)}
        results: list[RequestOutput | None] = [None] * len(reqs)
        bar = _progress(len(reqs), use_tqdm)
        try:
            while futures or eng.has_unfinished_in_engine():      # an in-flight step (async scheduling) counts
                failed = [f for f in futures if f.done() and f.exception() is not None]
                if failed:
                    rid = futures[failed[0]]
                    raise InvalidRequest(f"prompt {index[rid]}: {failed[0].exception()}")
                for f in [f for f in futures if f.done()]:
                    del futures[f]
                if not eng.has_unfinished_in_engine():
                    # nothing ready to run yet: wait for preprocessing instead of spinning
                    cf.wait(list(futures), timeout=1.0, return_when=cf.FIRST_COMPLETED)
                    continue
                for out in eng.step():
                    if out.finished and out.request_id in index:
                        results[index[out.request_id]] = out
                        bar.update(1)
        except BaseException:
            for rid in ids:                    # leave the engine clean for the next call
                eng.abort_request(rid)
            for f in futures:
                f.cancel()
            cf.wait(list(futures))
            while eng.has_unfinished():
                eng.step()
            raise
        finally:
            bar.close()
        return results  # type: ignore[return-value]

    def shutdown(self) -> None:
        self.engine.shutdown()


class _NoBar:
    def update(self, n):
        pass

    def close(self):
        pass


def _progress(total: int, enabled: bool):
    # on a terminal only: a bar redrawn into a log file or a pipe is noise
    if not enabled or total < 1 or not sys.stderr.isatty():
        return _NoBar()
    from tqdm.auto import tqdm
    return tqdm(total=total, desc="Processed prompts", unit="req", dynamic_ncols=True)
