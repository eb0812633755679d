"""The encoder cache (engine/encoder_cache.py) and the scheduler's use of it, against the fake
paged runner: an item split across prefill chunks is encoded once and its rows reused, a
preempted sequence's items are dropped (and encoded again), a full cache delays the chunk that
would need more rows, an item larger than the cache is refused, and bookkeeping bugs planted on
purpose fail loudly instead of feeding wrong rows."""
from __future__ import annotations

import pytest
import torch

from fastdeploy_ext.engine.config import EngineConfig
from fastdeploy_ext.engine.encoder_cache import EncoderCache, EncoderCacheError
from fastdeploy_ext.engine.errors import InvalidRequest
from fastdeploy_ext.engine.input_processor import InputLimits, InputProcessor
from fastdeploy_ext.engine.llm_engine import LLMEngine
from fastdeploy_ext.engine.scheduler import Scheduler
from fastdeploy_ext.models.paddleocr_vl.processor import ImageProcessor

from .engine_fakes import IMAGE_ID, FakePromptBuilder, FakeRunner
from .test_engine_scheduler import GREEDY, TINY_PP, make_engine, pil, run_all


def two_image_prompt(i, sizes=((56, 56), (84, 56))):
    content = [{"type": "text", "text": f"page {i}"}]
    for k, (w, h) in enumerate(sizes):
        content += [{"type": "image", "image": pil(10 * i + k, w, h)}, {"type": "text", "text": f" part {k}"}]
    return {"messages": [{"role": "user", "content": content}]}


def engine(runner=None, **kw):
    kw.setdefault("limit_mm_per_prompt", {"image": 2})
    return make_engine(runner, **kw)


@pytest.fixture(scope="module")
def alone():
    return [run_all(engine(), [two_image_prompt(i)])[0].token_ids for i in range(3)]


# --------------------------------------------------------------------------- the cache itself
def test_cache_entry_life_and_its_errors():
    c = EncoderCache(10)
    c.reserve((1, 0), 6)
    assert (1, 0) in c and c.free == 4 and not c.can_reserve(5)
    with pytest.raises(EncoderCacheError, match="already in the encoder cache"):
        c.reserve((1, 0), 1)
    with pytest.raises(EncoderCacheError, match="do not fit"):
        c.reserve((2, 0), 5)
    with pytest.raises(EncoderCacheError, match="reserved but not encoded"):
        c.get((1, 0))
    with pytest.raises(EncoderCacheError, match="6 were reserved"):
        c.store((1, 0), torch.zeros(5, 2))
    with pytest.raises(EncoderCacheError, match="not reserved"):
        c.store((3, 0), torch.zeros(1, 2))
    c.store((1, 0), torch.ones(6, 2))
    assert c.get((1, 0)).sum() == 12
    c.reserve((1, 1), 4)
    c.release((1, 0))
    assert c.used == 4 and c.stats().num_consumed == 1
    assert c.drop_sequence(1) == 1 and c.used == 0 and len(c) == 0
    s = c.stats()
    assert (s.num_encoded, s.num_consumed, s.num_evicted) == (1, 1, 1)
    with pytest.raises(ValueError, match="positive number of rows"):
        EncoderCache(0)


# --------------------------------------------------------------------------- through the engine
def test_items_split_across_chunks_are_encoded_once_and_reused(alone):
    runner = FakeRunner()
    eng = engine(runner, enable_max_prefill=False, max_num_batched_tokens=5)
    outs = run_all(eng, [two_image_prompt(i) for i in range(3)])
    assert [o.token_ids for o in outs] == alone
    # every image's 4 or 6 placeholders straddle a chunk boundary of 5 tokens somewhere
    split = [s for st in runner.steps if st.is_prefill for s in st.seqs
             if s.image_embeds is not None and len(s.image_embeds) < s.token_ids.count(IMAGE_ID) + 1
             and 0 < s.token_ids.count(IMAGE_ID) < 4]
    assert split, "no chunk ended inside an image"
    assert sum(runner.encode_calls) == 6, "each of the 6 images encoded exactly once"
    st = eng.stats()
    assert (st.encoder_items_encoded, st.encoder_items_evicted, st.encoder_cache_rows_used) == (6, 0, 0)
    assert st.encoder_cache_rows_total == max(5, 256)            # the default: max(tokens budget, model len)


def test_max_prefill_packs_every_item_of_the_step_in_one_pass(alone):
    runner = FakeRunner()
    eng = engine(runner, enable_max_prefill=True)
    outs = run_all(eng, [two_image_prompt(i) for i in range(3)])
    assert [o.token_ids for o in outs] == alone
    assert runner.encode_calls == [6]
    assert eng.encoder_cache.used == 0 and eng.stats().encoder_items_encoded == 6


def test_preemption_drops_a_sequences_cached_items_and_they_are_encoded_again(alone):
    runner = FakeRunner()
    eng = engine(runner, enable_max_prefill=False, max_num_batched_tokens=15)
    eng.add_request("0", two_image_prompt(0), GREEDY)
    eng.step()                   # first chunk: 15 tokens, 2 into the first image (at 13)
    seq = eng.scheduler.running[0]
    assert eng.encoder_cache.items_of(seq.seq_id) == {0}
    assert 0 < seq.num_computed_tokens < seq.items[0].end, "the chunk ended inside the image"
    eng.scheduler._preempt(seq)
    assert eng.encoder_cache.used == 0 and eng.stats().encoder_items_evicted == 1
    done = {}
    while eng.has_unfinished():
        done.update({o.request_id: o for o in eng.step()})
    assert done["0"].token_ids == alone[0]
    assert sum(runner.encode_calls) == 3, "the dropped image encoded again, the other once"


def test_tiny_kv_pool_preemption_in_chunked_mode_leaves_the_cache_empty(alone):
    """Two re-prefilling sequences do not fit the pool together: without the rule that a step
    which preempted admits nothing, the newest preempts itself and is re-admitted every step
    while the decoding one starves (this run never ended)."""
    eng = engine(num_kv_blocks=26, max_model_len=96, enable_max_prefill=False, max_num_batched_tokens=9)
    outs = run_all(eng, [two_image_prompt(i) for i in range(3)])
    assert [o.token_ids for o in outs] == alone
    assert eng.scheduler.num_preemptions > 0
    assert eng.encoder_cache.used == 0 and len(eng.encoder_cache) == 0


def test_a_full_cache_cuts_the_chunk_before_the_item_that_does_not_fit(alone, monkeypatch):
    """Room for one 84x56 image (6 rows): the second image of a prompt waits until the first's
    rows are released, its chunk ending right before the second image's placeholders."""
    seen = []
    real = Scheduler.schedule

    def schedule(self):
        out = real(self)
        if out is not None and out.is_prefill:
            seen.extend((s.seq, s.start, s.end, s.encode, self.encoder_cache.used) for s in out.scheduled)
        return out
    monkeypatch.setattr(Scheduler, "schedule", schedule)
    eng = engine(enable_max_prefill=False, max_num_batched_tokens=64, encoder_cache_size=6)
    outs = run_all(eng, [two_image_prompt(0)])
    assert outs[0].token_ids == alone[0]
    seq, start, end, encode, used = seen[0]
    assert end == seq.items[1].offset and encode == (0,), "the first chunk stops before the second image"
    assert seen[1][3] == (1,) and seen[1][1] == end
    assert max(u for *_, u in seen) <= 6


def test_an_item_larger_than_the_cache_is_refused_at_admission():
    eng = engine(enable_max_prefill=False, encoder_cache_size=5)
    with pytest.raises(InvalidRequest, match=r"6 embeddings, more than the encoder cache holds \(5 rows"):
        eng.add_request("big", two_image_prompt(0), GREEDY)
    assert not eng.has_unfinished()


def test_max_prefill_raises_a_small_cache_to_one_prompt_with_a_reason():
    d = EngineConfig(max_model_len=256, encoder_cache_size=5, enable_max_prefill=True).encoder_cache_rows()
    assert d.value == 256 and "raised to --max-model-len" in d.reason
    d = EngineConfig(max_model_len=256, encoder_cache_size=5, enable_max_prefill=False).encoder_cache_rows()
    assert d.value == 5
    with pytest.raises(ValueError, match="--encoder-cache-size must be a positive integer"):
        EngineConfig(encoder_cache_size=0).validate()


# --------------------------------------------------------------------------- planted bugs
def test_planted_early_release_is_caught_not_fed_wrong_rows(monkeypatch):
    real = LLMEngine._embeds

    def early(self, seq, start, end):            # releases an item at the first chunk touching it
        out = real(self, seq, start, end)
        for k in seq.items_in(start, end):
            if self.encoder_cache.is_stored((seq.seq_id, k)):
                self.encoder_cache.release((seq.seq_id, k))
        return out
    monkeypatch.setattr(LLMEngine, "_embeds", early)
    eng = engine(enable_max_prefill=False, max_num_batched_tokens=5)
    eng.add_request("0", two_image_prompt(0), GREEDY)
    with pytest.raises(EncoderCacheError, match="left the encoder cache before its last chunk"):
        for _ in range(50):
            eng.step()


def test_planted_missing_reservation_is_caught(monkeypatch):
    monkeypatch.setattr(Scheduler, "_reserve", lambda self, seq, items: None)
    eng = engine(enable_max_prefill=True)
    eng.add_request("0", two_image_prompt(0), GREEDY)
    with pytest.raises(EncoderCacheError, match="was not reserved before its encoder pass"):
        eng.step()


# --------------------------------------------------------------------------- positions [P, n]
def one_d_engine(**kw):
    runner = FakeRunner(position_rows=1)
    cfg = EngineConfig(max_model_len=96, preprocess_workers=2, limit_mm_per_prompt={"image": 2}, **kw)
    proc = InputProcessor(FakePromptBuilder(position_rows=1), ImageProcessor(TINY_PP),
                          InputLimits(2, cfg.max_encoder_patches, cfg.max_model_len))
    return runner, LLMEngine(cfg, runner=runner, input_processor=proc)


def test_one_row_positions_through_chunks_and_preemption():
    """A 1D-rope family (P = 1): every prefill chunk carries [1, n] positions equal to the token
    indices, output tokens re-fed after a preemption included, and greedy tokens do not change."""
    reqs = [two_image_prompt(i) for i in range(3)]
    ref = [run_all(one_d_engine(num_kv_blocks=512)[1], [r])[0].token_ids for r in reqs]
    # prefill and decode steps apart: in this pool that schedule preempts requests that already
    # have output tokens (with mixed steps the same pool preempts them before their first)
    runner, eng = one_d_engine(num_kv_blocks=26, enable_max_prefill=False, max_num_batched_tokens=9,
                               mixed_steps=False)
    outs = run_all(eng, reqs)
    assert [o.token_ids for o in outs] == ref
    assert eng.scheduler.num_preemptions > 0
    prompt_len = [len(eng.input_processor.process(r).prompt_token_ids) for r in reqs]   # seq ids 0, 1, 2
    refed = False
    for st in runner.steps:
        for s in st.seqs:
            if st.is_prefill and s.rope_positions is not None:
                n = len(s.token_ids)
                assert s.rope_positions.shape == (1, n)
                assert s.rope_positions[0].tolist() == list(range(s.start_pos, s.start_pos + n))
                refed |= s.start_pos + n > prompt_len[s.seq_id]        # output tokens re-fed
            else:       # a decode row (of a decode step or a mixed step): one token at start_pos
                assert s.rope_positions is None and s.rope_delta == 0 and len(s.token_ids) == 1
    assert refed, "no preempted sequence re-fed its output tokens"


def test_positions_of_the_wrong_rows_are_refused_naming_the_contract(monkeypatch):
    builder = FakePromptBuilder(position_rows=1)
    real = FakePromptBuilder.build

    def three_rows(self, messages, grids):       # a family whose prompt builder breaks [P, n]
        p = real(self, messages, grids)
        p.positions = p.positions.expand(3, -1)
        return p
    monkeypatch.setattr(FakePromptBuilder, "build", three_rows)
    proc = InputProcessor(builder, ImageProcessor(TINY_PP), InputLimits(1, 65536, 96))
    with pytest.raises(InvalidRequest, match=r"prompt builder: positions must be \[1, \d+\], got \[3, \d+\]"):
        proc.process({"prompt": "x", "images": [pil(0)]})


def test_placeholder_runs_that_disagree_with_the_encoder_outputs_are_refused(monkeypatch):
    monkeypatch.setattr(FakePromptBuilder, "output_sizes", lambda self, grids: [n + 1 for n in
                                                                               (t * h * w // 4 for t, h, w in grids)])
    proc = InputProcessor(FakePromptBuilder(), ImageProcessor(TINY_PP), InputLimits(1, 65536, 96))
    with pytest.raises(InvalidRequest, match=r"placeholder runs of \[4\] tokens for images of \[5\] embeddings"):
        proc.process({"prompt": "x", "images": [pil(0)]})


def test_an_item_run_outside_the_prompt_is_refused(monkeypatch):
    real = FakePromptBuilder.build

    def shifted(self, messages, grids):          # runs of the right length at the wrong place
        p = real(self, messages, grids)
        p.image_runs = [(len(p.token_ids) - 1, n) for _, n in p.image_runs]
        return p
    monkeypatch.setattr(FakePromptBuilder, "build", shifted)
    proc = InputProcessor(FakePromptBuilder(), ImageProcessor(TINY_PP), InputLimits(1, 65536, 96))
    with pytest.raises(InvalidRequest, match=r"prompt builder: item 0: placeholder run \[\d+, \d+\) .* does not fit"):
        proc.process({"prompt": "x", "images": [pil(0)]})


def test_item_runs_that_are_not_the_placeholder_tokens_are_refused(monkeypatch):
    real = FakePromptBuilder.build

    def moved(self, messages, grids):            # inside the prompt, the right length, one token early
        p = real(self, messages, grids)
        p.image_runs = [(o - 1, n) for o, n in p.image_runs]
        return p
    monkeypatch.setattr(FakePromptBuilder, "build", moved)
    proc = InputProcessor(FakePromptBuilder(), ImageProcessor(TINY_PP), InputLimits(1, 65536, 96))
    with pytest.raises(InvalidRequest, match=r"placeholder runs \[\(\d+, 4\)\] are not the prompt's image tokens"):
        proc.process({"prompt": "x", "images": [pil(0)]})


# --------------------------------------------------------------------------- the encoder cost budget
@pytest.mark.parametrize("max_prefill,passes", [(True, [2, 2, 2]), (False, [1, 1, 1, 1, 1, 1])])
def test_the_step_encoder_cost_stays_within_max_encoder_patches(alone, max_prefill, passes):
    """Items of 16 + 24 patches against a budget of 30: max prefill admits the first prompt of a
    step whole (over the budget: it must run) and no second one; chunked mode ends a chunk
    before the item that would exceed the budget."""
    runner = FakeRunner()
    eng = engine(runner, enable_max_prefill=max_prefill, max_encoder_patches=30)
    outs = run_all(eng, [two_image_prompt(i) for i in range(3)])
    assert [o.token_ids for o in outs] == alone
    assert runner.encode_calls == passes
