"""parsing/pipeline.py on fakes (no models, no processes): pages complete out of order with no
page-group barrier, at most --max-pages-in-flight pages are open, every stage's failure is its
page's error record and the run goes on, planted layouts replace the model's boxes while the
model still runs, a stage thread's bug ends the run with its exception (no hang), and the
engine driver's step loop runs requests submitted while others are in flight."""
from __future__ import annotations

import threading
import time
from concurrent.futures import Future

import numpy as np
import pytest

from fastdeploy_ext.parsing.errors import PageError
from fastdeploy_ext.parsing.pipeline import PageJob, PageSlots, Pipeline, PipelineOptions, StubEngineDriver
from fastdeploy_ext.parsing.render import RenderedPage
from fastdeploy_ext.parsing.workspace import PageWork


class FakeRenderer:
    """Renders at once (a grey page); ``fail`` pages raise PageError('render')."""

    def __init__(self, fail=()):
        self.fail = set(fail)
        self.submitted = 0

    def submit(self, task) -> Future:
        self.submitted += 1
        f: Future = Future()
        if task.page_index in self.fail:
            f.set_exception(PageError("render", f"page {task.page_index + 1}: broken"))
        else:
            img = np.full((200, 160, 3), 200, np.uint8)
            f.set_result(RenderedPage(task.path, task.page_index, 8, img, 160, 200))
        return f


class FakeLayout:
    """Two blocks per page (a text and a table); ``boom``: the call raises."""

    def __init__(self, boom=False):
        self.calls, self.pages, self.boom = 0, 0, boom

    def detect(self, images, threshold):
        self.calls += 1
        self.pages += len(images)
        if self.boom:
            raise RuntimeError("layout model crashed")
        return [[{"label": "text", "score": 0.9, "bbox": [10, 10, 150, 60]},
                 {"label": "table", "score": 0.9, "bbox": [10, 80, 150, 190]}] for _ in images]


class HeldDriver:
    """Holds every request's callback until the test releases it: the test decides the order in
    which blocks finish."""

    def __init__(self, times):
        self.times = times
        self.held: list = []
        self.cv = threading.Condition()
        self.error = None

    def submit(self, prompt, params, priority, on_done):
        with self.cv:
            self.held.append((prompt, priority, on_done))
            self.cv.notify_all()

    def wait_for(self, n):
        with self.cv:
            assert self.cv.wait_for(lambda: len(self.held) >= n, timeout=30), len(self.held)

    def close(self):
        pass

    def join(self):
        pass


class Out:
    def __init__(self, text):
        self.text, self.num_output_tokens, self.finish_reason = text, 2, "stop"


class RecordingSink:
    def __init__(self, commit_error=None):
        self.commits, self.fails = [], []
        self.commit_error = commit_error

    def commit(self, job, result):
        if self.commit_error is not None and job.work.page_index == 0:
            raise self.commit_error
        self.commits.append(job.work.page_index)
        return True

    def fail(self, job, stage, message):
        self.fails.append((job.work.page_index, stage, message))


def jobs(n):
    return [PageJob(PageWork(f"k:{i}", "doc.pdf", i, n, stem="doc")) for i in range(n)]


def pipeline(renderer=None, layout=None, driver=None, sink=None, planted=None, shared_slots=None, **opts):
    return Pipeline(renderer or FakeRenderer(), layout or FakeLayout(), None,
                    PipelineOptions(**{"max_pages_in_flight": 4, **opts}), sink=sink, planted=planted,
                    driver_factory=(lambda t: driver) if driver is not None else StubEngineDriver,
                    shared_slots=shared_slots)


def test_pages_complete_out_of_order_without_a_group_barrier():
    drv = HeldDriver(None)
    pipe = pipeline(driver=drv)
    outs = []
    it = pipe.run(jobs(2))
    t = threading.Thread(target=lambda: outs.extend(it))
    t.start()
    drv.wait_for(4)                       # both pages' blocks are in flight at once
    held = list(drv.held)
    # the table is sent with a lower priority value (earlier) than the paragraph
    prio = {p["prompt"]: pr for p, pr, _ in held}
    assert prio["Table Recognition:"] < prio["OCR:"]
    # page 1's blocks finish while page 0's are still running: page 1 completes first
    for _, _, cb in held[2:]:
        cb(Out("p1"), None)
    held[0][2](Out("p0"), None)
    held[1][2](Out("p0"), None)
    t.join(timeout=30)
    assert [o.job.work.page_index for o in outs] == [1, 0] and all(o.error is None for o in outs)
    texts = [b["block_content"] for b in outs[0].result.record["parsing_res_list"]]
    assert texts[0] == "p1"


def test_no_more_pages_open_than_max_pages_in_flight():
    drv = HeldDriver(None)
    renderer = FakeRenderer()
    pipe = pipeline(renderer=renderer, driver=drv, max_pages_in_flight=3)
    outs = []
    it = pipe.run(jobs(8))
    t = threading.Thread(target=lambda: outs.extend(it))
    t.start()
    drv.wait_for(6)                       # three pages, two blocks each
    assert renderer.submitted == 3        # the fourth page waits for a free slot
    for _, _, cb in list(drv.held[:2]):
        cb(Out("x"), None)
    drv.wait_for(8)                       # one page done: exactly one more rendered
    assert renderer.submitted == 4
    released = 2
    while released < 16:                  # the rest, in submission order, as they come
        drv.wait_for(released + 1)
        with drv.cv:
            cb = drv.held[released][2]
        cb(Out("x"), None)
        released += 1
        assert renderer.submitted - len(outs) <= 3 + 1     # +1: a yielded page not yet counted here
    t.join(timeout=30)
    assert len(outs) == 8 and renderer.submitted == 8


@pytest.mark.parametrize("where", ["render", "layout", "vlm", "submit", "assemble", "write"])
def test_a_failing_stage_fails_its_page_only(where, monkeypatch):
    sink = RecordingSink(commit_error=OSError("disk full") if where == "write" else None)
    kw = {}
    if where == "render":
        kw["renderer"] = FakeRenderer(fail={0})
    if where == "layout":
        kw["layout"] = FakeLayout(boom=True)
    driver = None
    if where == "vlm":
        class FailFirst(StubEngineDriver):
            n = 0

            def submit(self, prompt, params, priority, on_done):
                FailFirst.n += 1
                if FailFirst.n == 1:
                    on_done(None, "refused: image too small")
                else:
                    super().submit(prompt, params, priority, on_done)
        driver = FailFirst(None)
    if where == "submit":                 # the engine refuses synchronously (e.g. shutting down)
        class RaiseSecond(StubEngineDriver):
            n = 0

            def submit(self, prompt, params, priority, on_done):
                RaiseSecond.n += 1
                if RaiseSecond.n == 2:
                    raise RuntimeError("engine closed")
                super().submit(prompt, params, priority, on_done)
        driver = RaiseSecond(None)
    if where == "assemble":
        import fastdeploy_ext.parsing.assemble as asm
        real = asm.assemble_page

        def flaky(meta, *a, **k):
            if meta.page_index == 0:
                raise ValueError("bad block")
            return real(meta, *a, **k)
        monkeypatch.setattr(asm, "assemble_page", flaky)
    outs = list(pipeline(driver=driver, sink=sink, layout_batch=1, max_pages_in_flight=1, **kw).run(jobs(3)))
    failed = [o for o in outs if o.error is not None]
    if where == "layout":                 # the model failed for every page: each is its own record
        assert {f[1] for f in sink.fails} == {"layout"} and len(sink.fails) == 3
        return
    assert len(outs) == 3 and len(failed) == 1, [o.error for o in outs]
    stage = "vlm" if where == "submit" else where
    assert failed[0].error.stage == stage
    assert [f[1] for f in sink.fails] == [stage]          # recorded once, though its other block ran
    assert sorted(sink.commits) == sorted(o.job.work.page_index for o in outs if o.error is None)
    assert len(sink.commits) == 2


def test_a_layout_model_that_loses_a_page_fails_the_batch_instead_of_hanging():
    class Short(FakeLayout):
        def detect(self, images, threshold):
            return super().detect(images, threshold)[:-1]
    sink = RecordingSink()
    outs = list(pipeline(layout=Short(), sink=sink, layout_batch=2, max_pages_in_flight=2).run(jobs(2)))
    assert len(outs) == 2 and all(o.error is not None and o.error.stage == "layout" for o in outs)
    assert all("results for" in str(o.error) for o in outs) and len(sink.fails) == 2


def test_planted_layouts_replace_the_models_boxes_and_the_model_still_runs():
    class Planted:
        def detections(self, path, page_index, width, height):
            return [{"label": "doc_title", "score": 0.95, "bbox": [0, 0, width, 30]}]
    layout = FakeLayout()
    outs = list(pipeline(layout=layout, planted=Planted()).run(jobs(3)))
    assert layout.pages == 3                       # the model ran on every page, for its cost
    for o in outs:
        labels = [b["block_label"] for b in o.result.record["parsing_res_list"]]
        assert labels == ["doc_title"]


def test_a_stage_threads_bug_ends_the_run_with_its_exception():
    class BrokenSink(RecordingSink):
        def fail(self, job, stage, message):
            raise KeyError("sink bug")             # not a page's failure: the writer itself is broken
    with pytest.raises(KeyError, match="sink bug"):
        list(pipeline(renderer=FakeRenderer(fail={0}), sink=BrokenSink()).run(jobs(2)))


def test_the_engine_driver_runs_requests_submitted_while_others_run():
    """EngineDriver on the real LLMEngine with the fake runner: a request submitted while
    another decodes finishes too; each callback once, with its tokens."""
    from fastdeploy_ext.engine.sampling_params import SamplingParams
    from fastdeploy_ext.parsing.pipeline import EngineDriver, StageTimes

    from .test_engine_scheduler import make_engine, prompts
    eng = make_engine()
    times = StageTimes()
    drv = EngineDriver(eng, times)
    got, lock = [], threading.Lock()
    first_running, both = threading.Event(), threading.Event()

    def cb(name):
        def done(out, err):
            with lock:
                got.append((name, err, out.num_output_tokens if out else None))
                if len(got) == 2:
                    both.set()
        return done
    a, b = prompts(2)
    drv.submit(a, SamplingParams(temperature=0, max_tokens=60, ignore_eos=True), 0, cb("first"))
    while eng.stats().num_decode_steps < 3:
        first_running.wait(0.01)          # the test waits for the first request to be decoding
    drv.submit(b, SamplingParams(temperature=0, max_tokens=5, ignore_eos=True), 0, cb("second"))
    assert both.wait(60)
    drv.close()
    drv.join()
    assert sorted(got) == [("first", None, 60), ("second", None, 5)]
    assert times.prefill_s > 0 and times.decode_s > 0
    # a refused request (preprocessing raised) is reported to its callback, never queued
    drv2 = EngineDriver(eng, StageTimes())
    refused = []
    ev = threading.Event()
    drv2.submit({"prompt": 3}, SamplingParams(max_tokens=2), 0, lambda out, err: (refused.append(err), ev.set()))
    assert ev.wait(30) and refused[0].startswith("refused:")
    # abort(): a request in flight ends at the next step, reported with its reason
    ended, ev2 = [], threading.Event()
    before = eng.stats().num_decode_steps
    drv2.submit(a, SamplingParams(temperature=0, max_tokens=200, ignore_eos=True), 0,
                lambda out, err: (ended.append((err, out.num_output_tokens)), ev2.set()))
    while eng.stats().num_decode_steps < before + 2:
        ev2.wait(0.01)
    drv2.abort()
    drv2.join()
    assert ev2.wait(30) and ended[0][0] == "abort" and ended[0][1] < 200
    eng.shutdown()


def test_progress_json_lines_and_the_bar():
    import io
    import json
    import time

    from fastdeploy_ext.parsing.pipeline import PageOutcome
    from fastdeploy_ext.parsing.progress import Progress
    stream = io.StringIO()
    prog = Progress(3, json_lines=True, interval_s=0.05, gpu_reader=lambda: 50.0, stream=stream)
    ok = PageOutcome(jobs(1)[0], blocks=4, output_tokens=10)
    prog.update(ok)
    prog.update(ok)
    prog.update(PageOutcome(jobs(1)[0], error=PageError("render", "broken")))
    deadline = time.monotonic() + 30
    while '"progress"' not in stream.getvalue() and time.monotonic() < deadline:
        time.sleep(0.01)                   # the reporter's own period
    prog.close()
    lines = [json.loads(x) for x in stream.getvalue().splitlines()]
    assert lines[0]["event"] == "progress" and lines[-1]["event"] == "done"
    last = lines[-1]
    assert (last["done"], last["failed"], last["total"], last["eta_s"], last["gpu_busy_pct"]) == (2, 1, 3, 0.0, 50.0)
    assert last["blocks_per_s"] > 0 and last["output_tokens_per_s"] > 0
    # no reader (the CPU): null, never a made-up figure; the bar draws when asked
    bar = Progress(1, bar=True, gpu_reader=None)
    bar.update(ok)
    assert bar.snapshot()["gpu_busy_pct"] is None
    bar.close()


@pytest.mark.parametrize("threshold, kept", [(0.5, 2), (0.95, 0)])
def test_the_layout_threshold_option_reaches_the_model_and_post_processing(threshold, kept):
    from fastdeploy_ext.parsing.coordinator import build_pipeline
    from fastdeploy_ext.parsing.options import ParseOptions

    class Seen(FakeLayout):
        def detect(self, images, thr):
            self.thr = thr
            return super().detect(images, thr)
    layout = Seen()
    opts = ParseOptions(stub_vlm=True, layout_threshold=threshold)
    outs = list(build_pipeline(opts, renderer=FakeRenderer(), layout=layout, engine=None).run(jobs(1)))
    assert layout.thr == threshold
    assert len(outs[0].result.record["parsing_res_list"]) == kept


def test_parse_without_a_layout_model_says_its_boxes_mean_nothing(caplog):
    from fastdeploy_ext.entrypoints.cli import build_parser
    from fastdeploy_ext.entrypoints.parse_cmd import parse_options_from_args
    ns = build_parser().parse_args(["parse", "x.pdf", "--output", "o", "--stub-vlm", "--device", "cpu"])
    with caplog.at_level("WARNING", logger="fastdeploy_ext"):
        opts = parse_options_from_args(ns, output="o")
    assert opts.layout_model is None and "random weights" in caplog.text


def test_a_run_abandoned_by_its_caller_aborts_the_blocks_in_flight():
    class AbortingDriver(HeldDriver):
        aborted = False

        def abort(self):
            AbortingDriver.aborted = True
            with self.cv:
                held = list(self.held)
            for _, _, cb in held[:2]:          # the engine ends them with finish_reason "abort"
                cb(None, "abort")
    drv = AbortingDriver(None)
    it = pipeline(driver=drv).run(jobs(2))
    got = []

    def consume():
        for o in it:
            got.append(o)
            break                              # the caller stops reading after one page
        it.close()
    t = threading.Thread(target=consume)
    t.start()
    drv.wait_for(4)
    for _, _, cb in list(drv.held[2:]):       # page 1 completes, page 0's blocks stay in flight
        cb(Out("p1"), None)
    t.join(timeout=60)
    assert not t.is_alive() and [o.job.work.page_index for o in got] == [1]
    assert AbortingDriver.aborted


def test_page_slots_count_wake_on_abort_and_refuse_an_extra_release():
    slots, abort = PageSlots(2), threading.Event()
    assert slots.acquire(abort) and slots.acquire(abort) and slots.in_use() == 2
    got = []
    t = threading.Thread(target=lambda: got.append(slots.acquire(abort)))
    t.start()
    t.join(0.2)
    assert t.is_alive()                     # no slot free: it waits
    abort.set()
    slots.wake()
    t.join(10)
    assert got == [False] and slots.in_use() == 2        # an aborted waiter takes nothing
    slots.release(2)
    assert slots.in_use() == 0
    with pytest.raises(RuntimeError, match="released more than taken"):
        slots.release()
    with pytest.raises(ValueError):
        PageSlots(0)


def test_two_runs_on_one_shared_budget_hold_no_more_pages_than_it():
    """Each run may hold 4 pages; together they hold at most the shared 3, and the budget is
    whole again after both runs."""
    shared = PageSlots(3)
    drivers = [HeldDriver(None), HeldDriver(None)]
    renderers = [FakeRenderer(), FakeRenderer()]
    pipes = [pipeline(renderer=r, driver=d, shared_slots=shared) for r, d in zip(renderers, drivers)]
    outs: list = [[], []]
    threads = [threading.Thread(target=lambda i=i: outs[i].extend(pipes[i].run(jobs(5)))) for i in range(2)]
    for t in threads:
        t.start()

    def held():
        return sum(len(d.held) for d in drivers)
    end = time.monotonic() + 30
    while held() < 6 and time.monotonic() < end:     # three pages' blocks (2 each), from either run
        time.sleep(0.01)
    time.sleep(0.2)                                   # a fourth page would be rendered by now
    assert held() == 6 and sum(r.submitted for r in renderers) == 3 and shared.in_use() == 3
    answered = 0
    while any(t.is_alive() for t in threads):
        for d in drivers:
            with d.cv:
                todo, d.held[:] = list(d.held), []
            for _, _, cb in todo:
                cb(Out("x"), None)
                answered += 1
        assert sum(r.submitted for r in renderers) - sum(map(len, outs)) <= 3 + 2   # +2: yielded, not yet counted
        time.sleep(0.01)
    assert [len(o) for o in outs] == [5, 5] and all(x.error is None for o in outs for x in o)
    assert answered == 20 and shared.in_use() == 0


def test_an_abandoned_run_gives_its_shared_slots_back():
    """A run whose caller stops reading holds shared slots for pages never yielded: they come back
    when the run ends (without that, the server's budget would shrink with every stopped job)."""
    shared = PageSlots(4)
    drv = HeldDriver(None)
    it = pipeline(driver=drv, shared_slots=shared).run(jobs(6))
    t = threading.Thread(target=lambda: (next(iter(it)), it.close()))
    t.start()
    drv.wait_for(8)                             # 4 pages open: the budget is spent
    assert shared.in_use() == 4
    for _, _, cb in list(drv.held[:2]):         # page 0 completes and is yielded; the caller stops
        cb(Out("x"), None)
    t.join(60)
    assert not t.is_alive() and shared.in_use() == 0
