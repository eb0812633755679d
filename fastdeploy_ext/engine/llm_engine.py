"""The engine core: add requests, run steps, return outputs (nano-vllm's LLMEngine).

One step = schedule (prefill or decode batch) -> encode the items the scheduler reserved in the
encoder cache (max prefill: one packed vision pass for every request admitted in the step;
chunked: one pass per request, over the items its chunk reaches first) -> runner.execute(StepBatch)
-> sample -> append tokens, check stops, free finished requests.
Preprocessing runs in a worker pool (`submit`), so with requests queued the step loop only
packs ready host tensors. The async server API (async_engine.py) and the offline LLM API
(entrypoints/llm.py) both drive this class.

Faults: host work that belongs to one request (building its SampleRequest, a row the sampler
could not sample because its logits are not finite, appending its token, detokenizing, stop
checks, building its output) is isolated: an exception there fails that request alone, its
blocks are freed and its final RequestOutput has finish_reason "error" with ``error`` saying
why (AsyncLLMEngine raises RequestFailed to its consumer); the batch runs on. What the whole
batch shares (the vision pass, packing the step, runner.execute, an exception raised by the
sampler itself) cannot be pinned on one request: it leaves step() and the caller's loop dies
(the server then reports dead and exits for a restart).

Overlapped ("async") scheduling (EngineConfig.async_scheduling, on by default where the runner
takes device-resident input ids): step() launches step N+1 (schedule, build, execute, sample on
the device) before it reads step N's sampled ids, so the host's scheduling and batch building
run while the device computes. A sampled id the host has not read yet is UNRESOLVED_TOKEN in
``seq.token_ids`` (lengths, block needs and min_tokens counts stay exact); the next decode step
takes it from the sampler's device tensor (SeqStep.prev_row). When step N's ids arrive, each row
goes through the same output processing as the synchronous loop (stop checks, streaming,
finishing); a request found finished then has already been scheduled for N+1: that extra token
is dropped, never reported or counted, and its blocks are freed now. Aborts and host failures of
a request in flight end it at once and drop its in-flight token the same way. A step with a
repetition_penalty or ngram_blocker request waits for step N's ids first (both read the history
on the host). Off (--no-async-scheduling), every step reads its own ids before returning: the same
code, resolved at once.

Mixed steps (EngineConfig.mixed_steps, the engine's Decision logged at start): a step that
admits or continues prefills also carries one decode row per running request (scheduler.py),
so those requests get a token in every step instead of waiting for the newcomers' vision pass
and prefill. The runner takes the decode rows as 1-token chunks of its prefill path
(``takes_mixed_steps``); their token may be the step in flight's sampled id on the device, as in
a decode step.
"""
from __future__ import annotations

import itertools
import logging
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch

from ..device_api import HostRead
from ..ops.sampler import PendingSample, SampleRequest, sample_async
from ..plan import Decision
from ..runner import ImageBatch
from .block_manager import BlockManager
from .config import DEFAULT_CPU_KV_CACHE_BYTES, EngineConfig
from .encoder_cache import EncoderCache
from .errors import InvalidRequest
from .input_processor import FamilyPromptBuilder, InputLimits, InputProcessor
from .output_processor import OutputProcessor
from .outputs import RequestOutput
from .sampling_params import SamplingParams
from .scheduler import Scheduler, SchedulerOutput, check_priority
from .sequence import FinishReason, ProcessedPrompt, Sequence, SequenceStatus
from .step import UNRESOLVED_TOKEN, SeqStep, StepBatch

log = logging.getLogger(__name__)


@dataclass
class EngineStats:
    num_running: int
    num_waiting: int
    num_preprocessing: int
    kv_blocks_total: int
    kv_blocks_used: int
    kv_usage: float
    block_size: int
    num_steps: int
    num_prefill_steps: int
    num_decode_steps: int
    num_preemptions: int
    num_finished: int
    num_aborted: int
    prompt_tokens: int
    generation_tokens: int
    graph_hits: int
    graph_fallbacks: int
    preprocess_s: float            # summed over requests (worker pool time)
    vision_s: float                # host time in vision passes
    vision_passes: int
    max_prefill: bool
    encoder_graph_hits: int = 0    # packed vision passes replayed from an encoder graph
    encoder_graph_fallbacks: int = 0   # images run eagerly (no captured budget fits them)
    num_failed: int = 0            # requests that failed alone (finish_reason "error")
    encoder_cache_rows_total: int = 0  # embedding rows the encoder cache holds
    encoder_cache_rows_used: int = 0   # reserved or stored now
    encoder_cache_items: int = 0       # items held now
    encoder_items_encoded: int = 0     # items the encoder produced since start
    encoder_items_evicted: int = 0     # items dropped before their last chunk (preemption, abort, failure)
    async_scheduling: bool = False     # steps overlap (the engine's Decision)
    num_sync_steps: int = 0            # steps that waited for the previous step's ids (async on:
                                       # a repetition_penalty request in them)
    mixed_steps: bool = False          # decode rows ride in prefill steps (the engine's Decision)
    num_mixed_steps: int = 0           # prefill steps that also advanced running requests
    mixed_decode_rows: int = 0         # decode rows run in those steps


@dataclass
class InFlight:
    """A launched step whose sampled ids the host has not read yet."""
    rows: list[tuple[Sequence, int]]   # per logits row: the sequence and the index of its
                                       # UNRESOLVED_TOKEN in seq.token_ids
    sample: PendingSample              # token_ids on the device, the host read queued
    row_of: dict[int, int]             # seq_id -> row of sample.token_ids


class LLMEngine:
    def __init__(self, config: EngineConfig, runner=None, input_processor: InputProcessor | None = None,
                 reserved_memory: Decision | None = None):
        """``reserved_memory``: device bytes something else in this process will still allocate
        on the same device (the parsing pipeline's layout detector), kept out of the KV pool when
        it is sized from free memory; its reason says what they are for."""
        config.validate()
        self.config = config
        self.reserved_memory = reserved_memory
        if runner is None:
            runner = self._create_runner(config)
        self.runner = runner
        self._device = torch.device(getattr(runner, "device", "cpu"))
        self.max_prefill = config.max_prefill()
        log.info("max prefill: %s (%s)", self.max_prefill.value, self.max_prefill.reason)
        self.async_scheduling = config.async_decision(runner)
        log.info("async scheduling: %s (%s)", "on" if self.async_scheduling.value else "off",
                 self.async_scheduling.reason)
        self.mixed_steps = config.mixed_decision(runner)
        log.info("mixed steps: %s (%s)", "on" if self.mixed_steps.value else "off", self.mixed_steps.reason)
        if self.mixed_steps.value:
            self.mixed_encoder_budget = config.mixed_encoder_budget()
            log.info("mixed steps' encoder budget: %d (%s)", self.mixed_encoder_budget.value,
                     self.mixed_encoder_budget.reason)
        self._inflight: InFlight | None = None
        image_processor, self.preprocess = None, None
        if input_processor is None:
            image_processor, self.preprocess = self._image_processor(runner, config)
        self._views_on_device = image_processor if self.preprocess and self.preprocess.value == "device" else None
        spec = runner.kv_cache_spec()
        num_blocks = self._size_kv_pool(spec)
        log.info("KV pool: %d blocks x %d tokens = %d tokens, %.1f MiB (%s)", num_blocks.value, spec.block_size,
                 num_blocks.value * spec.block_size, num_blocks.value * spec.bytes_per_block / 2**20, num_blocks.reason)
        runner.init_kv_cache(num_blocks.value)
        self.kv_decision = num_blocks
        # decode graphs point into the KV cache just allocated: captured after it, every time
        capture = getattr(runner, "capture_decode_graphs", None)
        if callable(capture):
            report = capture(config.max_num_seqs, config.max_model_len)
            if report.captured:
                log.info("decode graphs: batch sizes %s captured in %.2fs, %.1f MiB", report.paths.get("decode"),
                         report.capture_seconds, report.graph_memory_bytes / 2**20)
            else:
                log.info("decode graphs: none (%s)", report.reason)
        self.block_manager = BlockManager(num_blocks.value, spec.block_size)
        rows = config.encoder_cache_rows()
        self.encoder_cache = EncoderCache(rows.value)
        log.info("encoder cache: %d embedding rows (%s)%s", rows.value, rows.reason,
                 "; an item of more rows is refused" if rows.value < config.max_model_len - 1 else "")
        self.encoder_cache_decision = rows
        self.scheduler = Scheduler(config.scheduler_config(bool(self.mixed_steps.value)), self.block_manager, self.encoder_cache)
        self.input_processor = input_processor or self._create_input_processor(runner, config, image_processor)
        builder = self.input_processor.builder
        self.eos_token_ids = tuple(builder.eos_token_ids)
        self.vocab_size = builder.vocab_size
        # The image placeholder is never sampled: re-fed after a preemption it would be taken
        # for an image token (the runner scatters image rows at every placeholder).
        self.never_sample = (builder.image_token_id,) if builder.image_token_id < builder.vocab_size else ()
        self.output_processor = OutputProcessor(builder.tokenizer)
        self.pool = ThreadPoolExecutor(config.preprocess_workers, thread_name_prefix="fdx-preprocess")
        self._seq_ids = itertools.count()
        self._lock = threading.Lock()             # guards _ready / _pending (worker threads add)
        self._ready: list[Sequence] = []
        self._pending: dict[str, Future] = {}
        self._sent: dict[int, int] = {}            # seq_id -> output tokens already reported
        self._abort_pending: set[str] = set()
        self._counters = dict(num_steps=0, num_prefill_steps=0, num_decode_steps=0, num_finished=0, num_aborted=0,
                              num_failed=0, num_sync_steps=0, num_mixed_steps=0, mixed_decode_rows=0,
                              prompt_tokens=0, generation_tokens=0, preprocess_s=0.0, vision_s=0.0, vision_passes=0)

    # ------------------------------------------------------------------ construction
    @staticmethod
    def _create_runner(config: EngineConfig):
        import dataclasses

        from ..runner import create_runner
        plan = config.plan
        if plan.model_family is None and config.model_family is not None:
            plan = dataclasses.replace(plan, model_family=config.model_family)
        runner = create_runner(plan)
        runner.load_model(config.model, load_format=config.load_format, model_format=config.model_format,
                          with_text=True, model_family=config.model_family)
        report = runner.capture_graphs()          # encoder graphs, as the plan says
        log.info("encoder graphs: %s", f"{report.captured} captured {report.paths}" if report.captured
                 else f"none ({report.reason})")
        for line in runner.describe().splitlines():
            log.info("%s", line)
        return runner

    @staticmethod
    def _image_processor(runner, config: EngineConfig):
        """The family's image processor where the preprocessing decision puts it, and that
        decision (its value "device" reserves the workers' working set beside the KV pool)."""
        image_processor = runner.family.image_processor(config.model)
        where = config.preprocess_decision(runner, image_processor)
        log.info("image preprocessing: %s (%s)", where.value, where.reason)
        if where.value == "device":
            image_processor = image_processor.on_device(runner.device)
        return image_processor, where

    @staticmethod
    def _create_input_processor(runner, config: EngineConfig, image_processor) -> InputProcessor:
        limits = InputLimits(max_images=config.limit_mm_per_prompt.get("image", 1),
                             max_encoder_cost=config.max_encoder_patches, max_model_len=config.max_model_len)
        return InputProcessor(FamilyPromptBuilder.from_runner(runner), image_processor, limits)

    def _memory_beside_the_engine(self) -> Decision | None:
        """Device bytes other work in this process will still allocate: ``reserved_memory`` (the
        caller's, e.g. a layout detector) plus, with preprocessing on the device, each worker's
        working set for one page (the processor's ``device_working_bytes``)."""
        parts = [self.reserved_memory] if self.reserved_memory is not None else []
        proc = self._views_on_device
        if proc is not None:
            per = int(proc.device_working_bytes())
            workers = self.config.preprocess_workers
            parts.append(Decision(workers * per, f"{workers} preprocessing workers making views on the device "
                                                 f"({per / 2**20:.0f} MiB each: {type(proc).__name__}.device_working_bytes)"))
        if not parts:
            return None
        return Decision(sum(int(p.value) for p in parts), "; ".join(p.reason for p in parts))

    def _size_kv_pool(self, spec) -> Decision:
        cfg = self.config
        if cfg.num_kv_blocks is not None:
            blocks, reason = cfg.num_kv_blocks, "num_kv_blocks set explicitly"
        else:
            # the backend's free-memory query (DeviceRunner.device_memory); None: it has none
            query = getattr(self.runner, "device_memory", None)
            memory = query() if callable(query) and cfg.kv_cache_memory is None else None
            if memory is not None:
                free, total = memory
                peak = self.runner.profile_peak_memory(cfg.max_num_batched_tokens, cfg.max_encoder_patches)
                budget = int(free - (1 - cfg.gpu_memory_utilization) * total - peak)
                reason = (f"free {free / 2**30:.2f} GiB - (1 - {cfg.gpu_memory_utilization}) x total "
                          f"{total / 2**30:.2f} GiB - profiled step peak {peak / 2**30:.2f} GiB")
                reserved = self._memory_beside_the_engine()
                if reserved is not None:
                    log.info("memory reserved beside the engine: %.1f MiB (%s)", reserved.value / 2**20,
                             reserved.reason)
                    budget -= int(reserved.value)
                    reason += f" - reserved {reserved.value / 2**30:.2f} GiB for {reserved.reason}"
            else:
                if self.reserved_memory is not None and self.reserved_memory.value:
                    log.info("memory reserved beside the engine (%.1f MiB, %s) not applied: the KV pool is not sized "
                             "from free memory here", self.reserved_memory.value / 2**20, self.reserved_memory.reason)
                budget = cfg.kv_cache_memory or DEFAULT_CPU_KV_CACHE_BYTES
                backend = getattr(self.runner, "name", type(self.runner).__name__)
                reason = (f"--kv-cache-memory {budget / 2**30:.2f} GiB" + ("" if cfg.kv_cache_memory else
                          f" (default: the {backend} backend has no free-memory query)"))
            blocks = max(budget, 0) // spec.bytes_per_block
        need = -(-cfg.max_model_len // spec.block_size)
        if blocks < need:
            raise ValueError(f"the KV pool holds {blocks} blocks ({blocks * spec.block_size} tokens), fewer than one "
                             f"sequence of --max-model-len {cfg.max_model_len} needs ({need} blocks, {reason}); "
                             f"lower --max-model-len or give the cache more memory")
        return Decision(int(blocks), reason)

    # ------------------------------------------------------------------ requests
    def process_request(self, request_id: str, prompt: dict, params: SamplingParams | None = None,
                        arrival: float | None = None, priority: int = 0) -> Sequence:
        """Preprocess and validate (any thread): a ready Sequence, or InvalidRequest. ``priority``:
        lower is scheduled earlier (scheduler.py's rule)."""
        priority = check_priority(priority)
        arrival = time.time() if arrival is None else arrival
        params = params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise InvalidRequest(f"params must be SamplingParams, got {type(params).__name__}")
        params.validate(self.vocab_size)
        processed: ProcessedPrompt = self.input_processor.process(prompt)
        room = self.config.max_model_len - len(processed.prompt_token_ids)
        if params.max_tokens is not None and params.max_tokens > room:
            raise InvalidRequest(f"max_tokens {params.max_tokens} + prompt {len(processed.prompt_token_ids)} tokens "
                                 f"exceed --max-model-len {self.config.max_model_len}")
        cap = self.encoder_cache.capacity
        for k, it in enumerate(processed.items):
            if it.num_embeddings > cap:       # could never be scheduled: refused, not queued forever
                raise InvalidRequest(f"image {k} ({it.source}) has {it.num_embeddings} embeddings, more than the "
                                     f"encoder cache holds ({cap} rows: {self.encoder_cache_decision.reason})")
        # host staging here, in the worker, so the step's uploads do not block the host (the
        # backend's hook: page-locked memory where the device copies from it asynchronously)
        for it in processed.items:
            if it.encoder_inputs.device.type == "cpu":       # a device processor's are there already
                it.encoder_inputs = self.runner.pin_host(it.encoder_inputs)
        seq = Sequence(next(self._seq_ids), request_id, processed, params, params.max_tokens or room,
                       self.eos_token_ids, arrival, priority)
        if params.seed is not None:
            seq.generator = torch.Generator(device=self._device).manual_seed(params.seed)
        return seq

    def add_sequence(self, seq: Sequence, stream: bool = False) -> None:
        """Queue a ready sequence (thread-safe); it is scheduled from the next step on."""
        seq.stream = stream
        with self._lock:
            self._ready.append(seq)

    def add_request(self, request_id: str, prompt: dict, params: SamplingParams | None = None,
                    stream: bool = False, priority: int = 0) -> None:
        """Synchronous preprocessing then queueing; InvalidRequest before anything is queued."""
        self.add_sequence(self.process_request(request_id, prompt, params, priority=priority), stream)

    def submit(self, request_id: str, prompt: dict, params: SamplingParams | None = None,
               stream: bool = False, priority: int = 0) -> Future:
        """Preprocess in the worker pool, queue when ready. The future holds the Sequence or the
        InvalidRequest; the request is never queued when it fails."""
        arrival = time.time()

        def work():
            seq = self.process_request(request_id, prompt, params, arrival, priority)
            self.add_sequence(seq, stream)
            return seq
        fut = self.pool.submit(work)
        with self._lock:
            self._pending[request_id] = fut
        fut.add_done_callback(lambda f: self._forget_pending(request_id, f))
        return fut

    def _forget_pending(self, request_id: str, fut: Future) -> None:
        with self._lock:
            if self._pending.get(request_id) is fut:
                del self._pending[request_id]

    def abort_request(self, request_id: str) -> None:
        """Thread-safe: the request ends at the next step with finish_reason "abort" and its blocks
        are freed."""
        with self._lock:
            self._abort_pending.add(request_id)

    def has_unfinished_in_engine(self) -> bool:
        """Something queued or running (requests still preprocessing not counted)."""
        with self._lock:
            ready = bool(self._ready or self._abort_pending)
        return ready or self.scheduler.has_unfinished() or self._inflight is not None

    def has_unfinished(self) -> bool:
        with self._lock:
            busy = bool(self._ready or self._pending)
        return busy or self.scheduler.has_unfinished() or self._inflight is not None

    # ------------------------------------------------------------------ the step
    def _take_inbox(self) -> list[RequestOutput]:
        outputs = []
        with self._lock:
            ready, self._ready = self._ready, []
            aborts, self._abort_pending = self._abort_pending, set()
        for seq in ready:
            if seq.request_id in aborts:
                aborts.discard(seq.request_id)
                seq.finish_reason = FinishReason.ABORT
                self._counters["num_aborted"] += 1
                outputs.append(self.output_processor.make_output(seq, 0))
                continue
            self.scheduler.add(seq)
            self._sent[seq.seq_id] = 0
        for rid in aborts:
            seq = self.scheduler.find(rid)
            if seq is None:
                # still preprocessing (or queued by a worker since the inbox was taken): abort
                # again at the next step, once it is queued
                with self._lock:
                    if rid in self._pending or any(r.request_id == rid for r in self._ready):
                        self._abort_pending.add(rid)
                continue
            self.scheduler.finish(seq)
            seq.drop_unresolved()          # an in-flight token is dropped with the request
            seq.finish_reason = FinishReason.ABORT
            seq.metrics.finish = time.time()
            self.output_processor.flush(seq)
            self._counters["num_aborted"] += 1
            outputs.append(self.output_processor.make_output(seq, self._sent.pop(seq.seq_id, 0)))
        return outputs

    def step(self) -> list[RequestOutput]:
        """Launch the next step, then read the previous one's ids (async scheduling) or this
        one's (off); the outputs are those the read ids produced, plus aborts."""
        outputs = self._take_inbox()
        sched = self.scheduler.schedule()
        prev, self._inflight = self._inflight, None
        if sched is not None and prev is not None and self._needs_host_ids(sched):
            outputs += self._resolve(prev)
            prev = None
            self._counters["num_sync_steps"] += 1
        launched = self._launch(sched, prev, outputs) if sched is not None else None
        if prev is not None:
            outputs += self._resolve(prev)          # step N's ids, read while step N+1 runs
        if launched is not None:
            if self.async_scheduling.value:
                self._inflight = launched
            else:
                outputs += self._resolve(launched)
        return outputs

    @staticmethod
    def _needs_host_ids(sched: SchedulerOutput) -> bool:
        """A row whose sampling reads its ids on the host (the repetition penalty's history)
        while one of them is still on the device: the step waits for the previous ids."""
        return any((s.seq.params.repetition_penalty != 1.0 or s.seq.params.ngram_blocker is not None)
                   and s.seq.token_ids[-1] == UNRESOLVED_TOKEN for s in sched.scheduled)

    def _launch(self, sched: SchedulerOutput, prev: InFlight | None,
                outputs: list[RequestOutput]) -> InFlight | None:
        """Build, execute and sample one step on the device; the sampled ids are not read here."""
        finished = SequenceStatus.FINISHED
        # a request that ended since it was scheduled (the previous ids read just before) is not run
        sched.scheduled = [s for s in sched.scheduled if s.seq.status is not finished]
        now = time.time()
        for s in sched.scheduled:
            if s.seq.metrics.first_scheduled is None:
                s.seq.metrics.first_scheduled = now
        rows, reqs = [], []
        for s in sched.scheduled:
            if s.completes_prefill or not sched.is_prefill:
                try:
                    reqs.append(self._sample_request(s.seq))
                    rows.append(s)
                except Exception as e:  # noqa: BLE001 - this request's bookkeeping: it alone fails
                    outputs.append(self._fail(s.seq, e))
        if any(s.seq.status is finished for s in sched.scheduled):        # failed just above: not run
            sched.scheduled = [s for s in sched.scheduled if s.seq.status is not finished]
        if not sched.scheduled:
            return None
        # from here to the sampled ids the step is shared by the batch: a fault cannot be pinned
        # on one request and ends the step loop (the server reports dead and exits)
        batch = self._build_batch(sched, prev)
        logits = self.runner.execute(batch)
        # a synchronous step reads its ids at once with one blocking copy (nothing to overlap it
        # with); the device API's queued read (page-locked copies + an event) pays when deferred
        pending = sample_async(logits, reqs, None if self.async_scheduling.value else HostRead)
        for s in sched.scheduled:
            s.seq.num_computed_tokens = s.end
        c = self._counters
        c["num_steps"] += 1
        c["num_prefill_steps" if sched.is_prefill else "num_decode_steps"] += 1
        mixed = sched.num_decode_rows
        if mixed:
            c["num_mixed_steps"] += 1
            c["mixed_decode_rows"] += mixed
        slots = []
        for s in rows:             # the sampled token's place, known before its value
            slots.append((s.seq, s.seq.num_tokens))
            s.seq.token_ids.append(UNRESOLVED_TOKEN)
        return InFlight(slots, pending, {s.seq.seq_id: i for i, s in enumerate(rows)})

    @staticmethod
    def _is_live(seq: Sequence) -> bool:
        """Its in-flight token counts: the request has not ended (finished at the step before,
        aborted or failed) since the step was launched."""
        return seq.status is not SequenceStatus.FINISHED

    def _resolve(self, step: InFlight) -> list[RequestOutput]:
        """Read a launched step's ids (waits for its host copy) and process each row's token
        exactly as the synchronous loop does; the token of a request that ended meanwhile is
        dropped."""
        result = step.sample.result()
        outputs = []
        now = time.time()
        for (seq, k), tok, lp, err in zip(step.rows, result.token_ids, result.logprobs, result.errors):
            if not self._is_live(seq):
                continue
            later = seq.token_ids[k + 1:]            # the placeholder of a step launched since
            del seq.token_ids[k:]
            try:
                if err is not None:
                    outputs.append(self._fail(seq, err))
                    continue
                out = self._process_token(seq, tok, lp, now)
            except Exception as e:  # noqa: BLE001 - detokenization, stop checks, output: it alone fails
                outputs.append(self._fail(seq, e))
                continue
            if self._is_live(seq):
                seq.token_ids.extend(later)
            if out is not None:
                outputs.append(out)
        return outputs

    def _process_token(self, seq: Sequence, tok: int, lp: dict | None, now: float) -> RequestOutput | None:
        c = self._counters
        self.output_processor.append_token(seq, tok, lp, now)
        c["generation_tokens"] += 1
        finished = seq.finish_reason is not None
        if finished:
            seq.metrics.finish = now
            self.scheduler.finish(seq)
            c["num_finished"] += 1
            c["prompt_tokens"] += seq.prompt_len
            c["preprocess_s"] += seq.metrics.preprocess_s
        out = None
        if finished or seq.stream:
            out = self.output_processor.make_output(seq, self._sent.get(seq.seq_id, 0))
            self._sent[seq.seq_id] = seq.num_output_tokens
        if finished:
            self._sent.pop(seq.seq_id, None)
        return out

    def _fail(self, seq: Sequence, error: BaseException | str) -> RequestOutput:
        """Fail one request alone: its blocks freed, its final output finish_reason "error".
        Built from plain slices only (the output processor may be what raised)."""
        if isinstance(error, BaseException):
            reason = f"{type(error).__name__}: {error}"
            log.error("request %s failed on the host (the others run on): %s", seq.request_id, reason,
                      exc_info=error)
        else:
            reason = error
            log.error("request %s failed (the others run on): %s", seq.request_id, reason)
        self.scheduler.finish(seq)
        seq.drop_unresolved()
        seq.finish_reason, seq.stop_reason = FinishReason.ERROR, None
        seq.metrics.finish = time.time()
        self._counters["num_failed"] += 1
        sent = self._sent.pop(seq.seq_id, 0)
        out_ids = seq.token_ids[seq.prompt_len:]
        return RequestOutput(
            request_id=seq.request_id, prompt=seq.prompt.prompt_text, prompt_token_ids=seq.prompt.prompt_token_ids,
            delta_token_ids=out_ids[sent:], delta_text="", delta_logprobs=None, num_output_tokens=len(out_ids),
            finish_reason=FinishReason.ERROR.value, stop_reason=None, token_ids=out_ids,
            text=seq.text if isinstance(seq.text, str) else "", error=reason, metrics=seq.metrics)

    def _sample_request(self, seq: Sequence) -> SampleRequest:
        p = seq.params
        banned = self.never_sample
        if seq.num_output_tokens < p.min_tokens:
            banned += tuple(set(p.stop_token_ids) | (set() if p.ignore_eos else set(seq.eos_token_ids)))
        if p.ngram_blocker is not None:      # host ids only: the step waited for them (_needs_host_ids)
            banned += tuple(p.ngram_blocker.banned(seq.token_ids[seq.prompt_len:]))
        return SampleRequest(temperature=p.temperature, top_p=p.top_p, top_k=p.top_k,
                             repetition_penalty=p.repetition_penalty,
                             history=seq.token_ids if p.repetition_penalty != 1.0 else (),
                             generator=seq.generator, num_logprobs=p.logprobs, banned_ids=banned)

    def _encode(self, work: list[tuple[Sequence, list[int]]]) -> None:
        """One packed vision pass over the given items (each reserved in the encoder cache by the
        scheduler); their features are stored there, keyed by (seq_id, item index)."""
        items = [(seq, k, seq.items[k]) for seq, ks in work for k in ks]
        t0 = time.perf_counter()
        # each item's host inputs (pinned in the worker) uploaded by the backend and packed on
        # the device: a host concatenation of six 1080p pages would copy ~150 MB on the step loop
        pixels = torch.cat([self.runner.upload(it.encoder_inputs) for _, _, it in items])
        feats = self.runner.encode_images(ImageBatch(pixels, [it.grid for _, _, it in items]))
        dt = time.perf_counter() - t0
        self._counters["vision_s"] += dt
        self._counters["vision_passes"] += 1
        for (seq, k, _), f in zip(items, feats, strict=True):
            self.encoder_cache.store((seq.seq_id, k), f)
        for seq, _ in work:
            seq.metrics.vision_s += dt

    def _embeds(self, seq: Sequence, start: int, end: int) -> torch.Tensor | None:
        """The encoder rows of the placeholders among tokens [start, end), in order; an item's
        cache entry is released by the chunk that covers its last placeholder."""
        rows = []
        for k in seq.items_in(start, end):
            it, key = seq.items[k], (seq.seq_id, k)
            feats = self.encoder_cache.get(key)
            rows.append(feats[max(start, it.offset) - it.offset:min(end, it.end) - it.offset])
            if end >= it.end:
                self.encoder_cache.release(key)
        if not rows:
            return None
        return rows[0] if len(rows) == 1 else torch.cat(rows)

    @staticmethod
    def _decode_steps(scheduled, prev: InFlight | None) -> tuple[list[SeqStep], bool]:
        """The decode rows' SeqSteps (a decode step's, or a mixed step's first rows) and whether
        one reads its token from the step in flight on the device."""
        steps, from_device = [], False
        for s in scheduled:
            seq = s.seq
            tok = seq.token_ids[-1]
            row = None
            if tok == UNRESOLVED_TOKEN:           # sampled by the step in flight: read on the device
                row = prev.row_of.get(seq.seq_id) if prev is not None else None
                if row is None:
                    raise RuntimeError(f"{seq}: its last token is not known on the host and not in the step "
                                       "in flight")
                from_device = True
            steps.append(SeqStep(seq.seq_id, [tok], s.start, seq.block_table, None, seq.prompt.rope_delta,
                                 prev_row=row))
        return steps, from_device

    def _build_batch(self, sched: SchedulerOutput, prev: InFlight | None = None) -> StepBatch:
        if not sched.is_prefill:
            steps, from_device = self._decode_steps(sched.scheduled, prev)
            return StepBatch(False, steps, prev.sample.token_ids if from_device else None, borrow_logits=True)
        # a mixed step's decode rows come first (scheduler.py), in the order their logits rows are sampled
        n_dec = sched.num_decode_rows
        steps, from_device = self._decode_steps(sched.scheduled[:n_dec], prev) if n_dec else ([], False)
        chunks = sched.scheduled[n_dec:]
        if any(s.decode for s in chunks):
            raise RuntimeError("a mixed step's decode rows must precede its prefill chunks")
        work = [(s.seq, list(s.encode)) for s in chunks if s.encode]
        if work:
            if self.max_prefill.value:
                self._encode(work)                      # one packed pass for the whole step
            else:
                for w in work:                          # per request: the items its chunk reaches first
                    self._encode([w])
        for s in chunks:
            seq = s.seq
            if seq.token_ids[s.end - 1] == UNRESOLVED_TOKEN:
                # placeholders sit at the tail and a preempted sequence is re-admitted only after
                # its in-flight id is read: a prefill of one would feed the model a fake token
                raise RuntimeError(f"{seq}: a prefill chunk [{s.start}, {s.end}) reaches a token the host has "
                                   "not read yet")
            steps.append(SeqStep(seq.seq_id, seq.token_ids[s.start:s.end], s.start, seq.block_table,
                                 seq.positions(s.start, s.end), seq.prompt.rope_delta,
                                 self._embeds(seq, s.start, s.end), need_logits=s.completes_prefill))
        return StepBatch(True, steps, prev.sample.token_ids if from_device else None, num_decode_rows=n_dec,
                         borrow_logits=True)

    # ------------------------------------------------------------------ observability
    @property
    def num_steps(self) -> int:
        """Steps that ran the model so far."""
        return self._counters["num_steps"]

    def stats(self) -> EngineStats:
        c = self._counters
        text = getattr(self.runner, "text", None)       # the runner's decode side (graph counters)
        enc = getattr(getattr(self.runner, "graphs", None), "stats", None)   # encoder graphs, when captured
        with self._lock:
            pre = len(self._pending)
        bm = self.block_manager
        ec = self.encoder_cache.stats()
        return EngineStats(num_running=self.scheduler.num_running, num_waiting=self.scheduler.num_waiting,
                           num_preprocessing=pre, kv_blocks_total=bm.num_blocks, kv_blocks_used=bm.num_used,
                           kv_usage=bm.usage, block_size=bm.block_size, num_preemptions=self.scheduler.num_preemptions,
                           graph_hits=int(getattr(text, "graph_hits", 0)),
                           graph_fallbacks=int(getattr(text, "graph_fallbacks", 0)),
                           max_prefill=bool(self.max_prefill.value),
                           encoder_graph_hits=int(getattr(enc, "hits", 0)),
                           encoder_graph_fallbacks=int(getattr(enc, "fallbacks", 0)),
                           encoder_cache_rows_total=ec.capacity_rows, encoder_cache_rows_used=ec.used_rows,
                           encoder_cache_items=ec.num_items, encoder_items_encoded=ec.num_encoded,
                           encoder_items_evicted=ec.num_evicted,
                           async_scheduling=bool(self.async_scheduling.value),
                           mixed_steps=bool(self.mixed_steps.value), **c)

    def shutdown(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)
        free = getattr(self.runner, "free_kv_cache", None)
        if callable(free):
            free()
