"""A prefill step's host work does not grow per sequence in what costs most per call: the text
step's inputs are built with two uploads and a fixed number of torch calls whatever the number
of sequences (vectorised numpy on the host, every field a view of one of two packed device
buffers), and equal an independent per-sequence construction field by field (prefill chunks
with and without rope positions, images, chunks that start mid-prompt, a mixed step's decode
rows, a row fed from the device). A builder that uploads per sequence (the planted bug) is seen
by the same counting check."""
from __future__ import annotations

import pytest
import torch
from torch.overrides import TorchFunctionMode

from fastdeploy_ext.device_api import DeviceAPI
from fastdeploy_ext.engine.step import UNRESOLVED_TOKEN, SeqStep, StepBatch
from fastdeploy_ext.text_runner import StepError, TextStepRunner

from .test_device_api import _text_runner

IMG = 63
BS = 16


class CountingAPI(DeviceAPI):
    """The host device API, counting the step paths' uploads."""
    name = "counting"

    def __init__(self):
        super().__init__("cpu")
        self.uploads = 0

    def stage_and_upload(self, t):
        self.uploads += 1
        return super().stage_and_upload(t)


class TorchCalls(TorchFunctionMode):
    """Counts every torch function and Tensor method called (each a dispatcher trip, and on a
    device an op or a launch); attribute reads (``shape``, ``dtype``) are not ops and not counted."""

    def __init__(self):
        super().__init__()
        self.n = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if type(func).__name__ != "getset_descriptor" and getattr(func, "__name__", "") != "__get__":
            self.n += 1
        return func(*args, **(kwargs or {}))


def _runner():
    api = CountingAPI()
    r = _text_runner(api)
    r.free_kv_cache()
    r.init_kv_cache(64)
    return r, api


def _prefill(n_seqs: int, mixed: bool = False) -> StepBatch:
    """n_seqs image prompts (each [text, 4 placeholders, text], its own blocks), every third a
    chunk starting mid-prompt, every fourth without rope positions; with ``mixed``, two decode
    rows first, one fed from the device."""
    seqs, prev = [], None
    if mixed:
        prev = torch.tensor([7, 21], dtype=torch.int64)
        seqs += [SeqStep(900, [UNRESOLVED_TOKEN], 20, [60, 61], None, rope_delta=-3, prev_row=1),
                 SeqStep(901, [9], 5, [62], None, rope_delta=2)]
    for i in range(n_seqs):
        toks = [3 + i % 7, 5, IMG, IMG, IMG, IMG, 8 + i % 5]
        start = 9 if i % 3 == 1 else 0
        pos = None if i % 4 == 3 else torch.arange(3 * len(toks)).view(3, -1) + 100 * i
        seqs.append(SeqStep(i, toks, start, [i % 30, 30 + i % 30], pos, rope_delta=i % 3,
                            image_embeds=torch.full((4, 64), float(i)), need_logits=i % 2 == 0))
    return StepBatch(True, seqs, prev)


def _reference(step: StepBatch, position_rows: int = 3):
    """Each field built one sequence at a time, as plainly as possible (the oracle)."""
    ids, pos, slots, img_rows, logits_rows, ctx, cu, tables = [], [], [], [], [], [], [0], []
    width = max(-(-(s.start_pos + len(s.token_ids)) // BS) for s in step.seqs)
    for s in step.seqs:
        off, n = cu[-1], len(s.token_ids)
        p = list(range(s.start_pos, s.start_pos + n))
        toks = [int(step.prev_token_ids[s.prev_row])] if s.prev_row is not None else s.token_ids
        ids += toks
        if s.rope_positions is not None:
            pos.append(s.rope_positions)
        else:
            pos.append(torch.tensor([x + s.rope_delta for x in p]).expand(position_rows, -1))
        slots += [s.block_table[x // BS] * BS + x % BS for x in p]
        if s.image_embeds is not None:
            img_rows += [off + j for j, t in enumerate(s.token_ids) if t == IMG]
        if s.need_logits:
            logits_rows.append(off + n - 1)
        ctx.append(s.start_pos + n)
        cu.append(off + n)
        nb = -(-(s.start_pos + n) // BS)
        tables.append(s.block_table[:nb] + [0] * (width - nb))
    embeds = [s.image_embeds for s in step.seqs if s.image_embeds is not None]
    return {"token_ids": ids, "positions": torch.cat(pos, 1).tolist(), "slot_mapping": slots,
            "image_index": img_rows, "logits_index": logits_rows, "context_lens": ctx, "cu_query": cu,
            "block_tables": tables, "image_embeds": torch.cat(embeds).tolist() if embeds else None}


def _fields(inp):
    m = inp.meta
    return {"token_ids": inp.token_ids.tolist(), "positions": inp.positions.tolist(),
            "slot_mapping": m.slot_mapping.tolist(),
            "image_index": [] if inp.image_index is None else inp.image_index.tolist(),
            "logits_index": inp.logits_index.tolist(), "context_lens": m.context_lens.tolist(),
            "cu_query": m.cu_query.tolist(), "block_tables": m.block_tables.tolist(),
            "image_embeds": None if inp.image_embeds is None else inp.image_embeds.tolist()}


@pytest.mark.parametrize("mixed", [False, True], ids=["prefill", "mixed"])
def test_inputs_equal_the_per_sequence_construction(mixed):
    r, _ = _runner()
    step = _prefill(9, mixed)
    inp = r.build_inputs(step)
    assert _fields(inp) == _reference(step)
    assert inp.meta.block_tables.dtype == inp.meta.context_lens.dtype == inp.meta.cu_query.dtype == torch.int32
    assert inp.meta.slot_mapping.dtype == inp.token_ids.dtype == inp.positions.dtype == torch.int64
    assert inp.meta.max_query_len == 7 and inp.meta.max_context_len == (21 if mixed else 16)


def test_a_decode_steps_inputs_equal_the_per_sequence_construction():
    r, _ = _runner()
    seqs = [SeqStep(i, [4 + i], 3 + 5 * i, [i, 40 + i, 50], None, rope_delta=i - 2) for i in range(6)]
    step = StepBatch(False, seqs)
    inp = r.build_inputs(step)
    ref = _reference(step, position_rows=1)
    assert _fields(inp) == ref | {"positions": ref["positions"][0]}     # decode positions: [T]


def host_work(r, api, step) -> tuple[int, int]:
    """(uploads, torch calls) of building one step's inputs."""
    api.uploads = 0
    with TorchCalls() as calls:
        r.build_inputs(step)
    return api.uploads, calls.n


def check_constant_in_batch_size(r, api, sizes=(2, 6, 24)) -> None:
    """The same host work for every batch size (from two sequences: one is a cat shorter)."""
    work = {n: host_work(r, api, _prefill(n, mixed=True)) for n in sizes}
    assert len(set(work.values())) == 1, f"host work (uploads, torch calls) grows with the sequences: {work}"


def test_uploads_and_torch_calls_do_not_grow_with_the_sequences():
    r, api = _runner()
    check_constant_in_batch_size(r, api)
    uploads, _ = host_work(r, api, _prefill(24, mixed=True))
    assert uploads == 3     # the two packed buffers, and the index of the rows fed from the device


def test_planted_per_sequence_upload_is_caught():
    class PerSequenceUploads(TextStepRunner):
        def build_inputs(self, step):
            for s in step.seqs:          # the bug: each sequence's block table uploaded alone
                self.upload(torch.as_tensor(s.block_table, dtype=torch.int32))
            return super().build_inputs(step)
    r, api = _runner()
    r.__class__ = PerSequenceUploads
    with pytest.raises(AssertionError, match="grows with the sequences"):
        check_constant_in_batch_size(r, api)


def test_a_placeholder_count_that_does_not_match_the_embeddings_names_the_sequence():
    r, _ = _runner()
    step = _prefill(3)
    step.seqs[1].image_embeds = torch.zeros(3, 64)
    with pytest.raises(StepError, match="seq 1: 4 image placeholder tokens in this chunk but 3 image embedding rows"):
        r.build_inputs(step)


# ---------------------------------------------------------------------- no sync
def _meta_runner() -> TextStepRunner:
    """The text step runner with its device on ``meta``: a read-back of a device tensor while
    the inputs are built is an op on a meta tensor the guard sees (on the CPU it would be free
    and invisible)."""
    from fastdeploy_ext.device_api import device_api_for
    r = _text_runner(device_api_for("meta"))
    r.device = torch.device("meta")
    r.free_kv_cache()
    r.init_kv_cache(64)
    return r


def _on_meta(step: StepBatch) -> StepBatch:
    if step.prev_token_ids is not None:
        step.prev_token_ids = step.prev_token_ids.to("meta", non_blocking=True)
    for s in step.seqs:
        if s.image_embeds is not None:
            s.image_embeds = s.image_embeds.to("meta", non_blocking=True)     # the encoder's rows live on the device
    return step


def test_building_a_mixed_prefill_makes_no_host_sync():
    from fastdeploy_ext.sync_guard import HostSyncGuard
    r = _meta_runner()
    with HostSyncGuard({"meta"}):
        inp = r.build_inputs(_on_meta(_prefill(12, mixed=True)))
    assert inp.token_ids.device.type == "meta" and inp.meta.block_tables.device.type == "meta"


def test_planted_read_back_while_building_is_caught(monkeypatch):
    """The mutation: the rows fed from the device read back to the host to place them."""
    from fastdeploy_ext.sync_guard import HostSyncError, HostSyncGuard
    real = TextStepRunner.feed_device_ids

    def reading(self, token_ids, step, offsets=None):
        step.prev_token_ids.tolist()
        return real(self, token_ids, step, offsets)
    monkeypatch.setattr(TextStepRunner, "feed_device_ids", reading)
    r = _meta_runner()
    with pytest.raises(HostSyncError, match="tolist"), HostSyncGuard({"meta"}):
        r.build_inputs(_on_meta(_prefill(4, mixed=True)))


# ---------------------------------------------------------------------- a mixed step's two kernels
def test_a_mixed_steps_decode_rows_go_to_the_decode_kernel_with_the_same_logits(monkeypatch):
    """The leading decode rows (StepBatch.num_decode_rows) are attended by the backend's decode
    function in one batch and the chunks by its prefill function; the logits equal those of the
    whole step through the prefill function (fp32, the CPU's SDPA kernels)."""
    from fastdeploy_ext.text_runner import PagedAttention
    r, _ = _runner()
    whole = r.forward(r.build_inputs(_prefill(5, mixed=True)))
    seen = []
    real_dec, real_pre = r.backend.decode, r.backend.prefill

    def mixed(self, q, kc, vc, meta, scale):
        dec, pre = meta.mixed
        seen.append((dec.num_seqs, dec.is_prefill, pre.num_seqs, pre.cu_query.tolist()))
        assert q.shape[0] == dec.num_seqs + sum(pre.query_lens)
        n = dec.num_seqs
        return torch.cat([real_dec(q[:n], kc, vc, dec, scale), real_pre(q[n:], kc, vc, pre, scale)])
    monkeypatch.setattr(PagedAttention, "_mixed", mixed)
    step = _prefill(5, mixed=True)
    step.num_decode_rows = 2
    split = r.forward(r.build_inputs(step))
    assert seen == [(2, False, 5, [0, 7, 14, 21, 28, 35])]      # one layer: decode 2 rows, prefill 5 chunks
    torch.testing.assert_close(split, whole)


def test_leading_decode_rows_must_be_one_token_rows():
    r, _ = _runner()
    step = _prefill(3, mixed=True)
    step.num_decode_rows = 3            # the third row is a 7-token chunk
    with pytest.raises(StepError, match="row 2 of a step's 3 leading decode rows"):
        r.build_inputs(step)


# ---------------------------------------------------------------------- the vision metadata's new sizes
@pytest.fixture(scope="module")
def vision_runner():
    from fastdeploy_ext.conformance.references import Manifest
    from fastdeploy_ext.plan import PlanRequest
    from fastdeploy_ext.runner import create_runner
    r = create_runner(PlanRequest(device="cpu", dtype="float32"))
    r.load_model(str(Manifest.load().path("tiny_vl")))
    return r


def _distinct_grids(n: int, salt: int):
    return [(1, 2 * (1 + (i + salt) % 5), 2 * (1 + (7 * i + salt) % 29)) for i in range(n)]


def calls_per_new_size(r, n_small=6, n_large=24) -> float:
    """Torch calls per frame size the metadata cache has not seen, from two fresh caches."""
    counts = []
    for n in (n_small, n_large):
        r._init_metadata()
        grids = list(dict.fromkeys(_distinct_grids(n, salt=3)))
        with TorchCalls() as calls:
            r.meta_builder.build_host(grids)
        counts.append((len(grids), calls.n))
    (a, ca), (b, cb) = counts
    return (cb - ca) / (b - a)


def test_a_batchs_new_sizes_are_created_together_bitwise_equal(vision_runner):
    """Document crops bring a new (h, w) nearly every image: the batch's new sizes are created in
    one pass (a few torch calls each, ~80 one by one), bitwise equal to one by one."""
    r = vision_runner
    grids = _distinct_grids(30, salt=0) + [(2, 4, 6)]
    r._init_metadata()
    one = [r.meta_builder.build_host([g]) for g in grids]
    r._init_metadata()
    together = r.meta_builder.build_host(grids)
    for field in ("pos_embed", "cos", "sin"):
        assert torch.equal(getattr(together, field), torch.cat([getattr(m, field) for m in one])), field
    assert calls_per_new_size(r) <= 16


def test_planted_one_by_one_creation_is_caught(vision_runner, monkeypatch):
    from fastdeploy_ext.models.paddleocr_vl.metadata import MetadataBuilder
    r = vision_runner
    monkeypatch.setattr(MetadataBuilder, "_create_tables", lambda self, shapes: {})    # every size alone
    assert calls_per_new_size(r) > 16
