"""The device-id path of a decode step (runs on any CPU, the graphs through the recording device
API of tests/test_device_api.py): rows whose token is the previous step's sampled id take it from
StepBatch.prev_token_ids on the device — into the eager step's ids and into the captured graphs'
persistent id buffer, after the host staging's upload; a mixed step's decode rows at their
offsets of the flat prefill batch — and the logits equal those of the same step built from host ids. The mutation (the copy skipped: the host's placeholder fed) is seen."""
from __future__ import annotations

import pytest
import torch

from fastdeploy_ext.engine.step import UNRESOLVED_TOKEN, SeqStep, StepBatch
from fastdeploy_ext.text_runner import DecodeGraphs, StepError, TextStepRunner

from .test_device_api import RecordingAPI, _text_runner

ROWS = [(5, 20, [3, 1], -2), (9, 7, [2], 0), (11, 33, [4, 5, 0], 1)]     # (token, start, table, rope_delta)
PREV = torch.tensor([40, 11, 7, 5, 9], dtype=torch.int64)               # the previous step's sampled ids
FROM = {0: 3, 2: 1}                                                     # batch row -> row of PREV (ids 5, 11)


def _step(device_rows: bool) -> StepBatch:
    seqs = [SeqStep(i, [UNRESOLVED_TOKEN if device_rows and i in FROM else tok], start, table, None,
                    rope_delta=delta, prev_row=FROM.get(i) if device_rows else None)
            for i, (tok, start, table, delta) in enumerate(ROWS)]
    return StepBatch(False, seqs, PREV.clone() if device_rows else None)


def _fresh_kv(r: TextStepRunner, kv):
    r.kv.k.copy_(kv[0])
    r.kv.v.copy_(kv[1])


@pytest.fixture
def graphs():
    api = RecordingAPI()
    r = _text_runner(api)
    dg = DecodeGraphs(r, (1, 2, 4), max_model_len=64)
    dg.capture()
    r.graphs = dg
    return r, dg


def test_eager_and_graph_steps_read_the_device_ids(graphs):
    r, dg = graphs
    kv = (r.kv.k.clone(), r.kv.v.clone())
    ref = r.forward(r.build_inputs(_step(False)))
    _fresh_kv(r, kv)
    inp = r.build_inputs(_step(True))
    assert inp.token_ids.tolist() == [5, 9, 11]
    torch.testing.assert_close(r.forward(inp), ref)
    _fresh_kv(r, kv)
    replayed = dg.run(_step(True))
    assert dg.h_scalars[0, :3].tolist() == [UNRESOLVED_TOKEN, 9, UNRESOLVED_TOKEN], "the host staged placeholders"
    assert dg.ids[:3].tolist() == [5, 9, 11], "the graph's id buffer holds the device ids"
    torch.testing.assert_close(replayed, ref)
    assert dg.graphs[4].replays == 1


def test_the_mutation_skipping_the_device_copy_is_seen(graphs, monkeypatch):
    r, dg = graphs
    monkeypatch.setattr(TextStepRunner, "feed_device_ids", lambda self, ids, step: None)
    with pytest.raises(IndexError):         # the placeholder reaches the embedding (a device assert on CUDA)
        dg.run(_step(True))
    assert dg.ids[:3].tolist() == [UNRESOLVED_TOKEN, 9, UNRESOLVED_TOKEN]
    assert r.build_inputs(_step(True)).token_ids.tolist() != [5, 9, 11]


def test_a_device_row_needs_a_decode_step_with_that_row(graphs):
    r, _ = graphs
    bad = _step(True)
    bad.seqs[0].prev_row = len(PREV)
    with pytest.raises(StepError, match="prev_row 5"):
        r.build_inputs(bad)
    bad = _step(True)
    bad.prev_token_ids = None
    with pytest.raises(StepError, match="it has 0"):
        r.execute(bad)
    prefill = StepBatch(True, [SeqStep(0, [5, 6], 0, [3], None, prev_row=0)], PREV)
    with pytest.raises(StepError, match="needs a decode row"):
        r.build_inputs(prefill)


def test_a_mixed_steps_decode_rows_read_the_device_ids_at_their_offsets(graphs):
    """A prefill step carrying decode rows (mixed steps): each device row's id lands at its own
    token's offset of the flat batch, and the logits equal the same step built from host ids."""
    r, _ = graphs
    kv = (r.kv.k.clone(), r.kv.v.clone())

    def mixed(device_rows: bool) -> StepBatch:
        chunk = SeqStep(7, [8, 3, 4], 0, [6], None)
        rows = _step(device_rows).seqs
        return StepBatch(True, [rows[0], chunk, rows[1], rows[2]], PREV.clone() if device_rows else None)
    ref = r.forward(r.build_inputs(mixed(False)))
    _fresh_kv(r, kv)
    inp = r.build_inputs(mixed(True))
    assert inp.token_ids.tolist() == [5, 8, 3, 4, 9, 11]
    torch.testing.assert_close(r.forward(inp), ref)


# ------------------------------------------------------------------ the host read, one step late
def test_the_cuda_host_read_is_queued_at_sampling_and_waited_for_at_result(monkeypatch):
    """CudaDeviceAPI.start_host_read (torch.cuda's pieces recorded on the CPU): page-locked targets,
    non-blocking copies and one event at sampling; the event is waited for only when the engine
    reads the result, and the result equals the synchronous sampler's."""
    from fastdeploy_ext.ops.sampler import SampleRequest, sample, sample_async
    from backends.cuda.device_api import CudaDeviceAPI
    log = []

    class Event:
        def record(self):
            log.append("event.record")

        def synchronize(self):
            log.append("event.synchronize")
    real_empty = torch.empty

    def empty(shape, dtype=None, pin_memory=False):
        log.append(f"empty(pin_memory={pin_memory})")
        return real_empty(shape, dtype=dtype)
    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch, "empty", empty)
    api = CudaDeviceAPI(torch.device("cuda", 0))
    logits = torch.randn(4, 64, generator=torch.Generator().manual_seed(3))
    for reqs in ([SampleRequest()] * 4, [SampleRequest(num_logprobs=2)] * 4):
        log.clear()
        pending = sample_async(logits.clone(), reqs, start_read=api.start_host_read)
        assert log and set(log[:-1]) == {"empty(pin_memory=True)"} and log[-1] == "event.record"
        assert pending.token_ids.tolist() == logits.argmax(-1).tolist()      # on the "device" already
        res = pending.result()
        assert log[-1] == "event.synchronize" and log.count("event.synchronize") == 1
        monkeypatch.setattr(torch, "empty", real_empty)
        ref = sample(logits.clone(), reqs)
        monkeypatch.setattr(torch, "empty", empty)
        assert (res.token_ids, res.logprobs, res.errors) == (ref.token_ids, ref.logprobs, ref.errors)
