"""What the coordinator of a parse run does around the pipeline: open the workspace and add
the inputs' documents, build the models, lease the pages, commit through the workspace (the
only writer). DocumentParser (one process) and workers.py (N processes) both use it."""
from __future__ import annotations

import logging
from pathlib import Path
from typing import Iterator

from .errors import PageError
from .options import ParseOptions, PlantedLayoutFile
from .pipeline import LayoutModel, PageJob, PageOutcome, Pipeline

log = logging.getLogger(__name__)

#: a single process's lease never expires by time: nobody else could take its pages over
LOCAL_LEASE_TTL_S = 10 * 365 * 86400.0


# ------------------------------------------------------------------ building the models
def build_engine(opts: ParseOptions, layout: LayoutModel | None = None):
    """The VLM engine in this process (None with stub_vlm). ``layout``: the detector already
    loaded beside it on the same device; one layout batch's memory is measured now and kept out
    of the KV pool (memory_profile.detector_reservation), so build the layout model first."""
    if opts.stub_vlm:
        return None
    from ..engine.config import EngineConfig
    from ..engine.llm_engine import LLMEngine
    from ..memory_profile import detector_reservation
    from ..plan import PlanRequest
    cfg = opts.engine
    if cfg is None:
        cfg = EngineConfig(model=opts.model, load_format=opts.load_format, model_format=opts.model_format,
                           model_family=opts.model_family, plan=PlanRequest(device=opts.device, dtype=opts.dtype))
    reserved = None
    if layout is not None:
        reserved = detector_reservation(layout, opts.layout_batch, a4_page_hw(opts.dpi))
    return LLMEngine(cfg, reserved_memory=reserved)


def a4_page_hw(dpi: int) -> tuple[int, int]:
    """(height, width) in pixels of an A4 page rendered at ``dpi`` (210 x 297 mm)."""
    return round(297 / 25.4 * dpi), round(210 / 25.4 * dpi)


def build_layout(opts: ParseOptions, plan=None) -> LayoutModel:
    from ..plan import PlanRequest
    from ..runner import create_runner
    runner = create_runner(plan or PlanRequest(device=opts.device, dtype=opts.dtype))
    fmt = "dummy" if opts.layout_model is None else opts.layout_load_format
    return LayoutModel(runner, opts.layout_model, load_format=fmt, model_family=opts.layout_family)


def build_pipeline(opts: ParseOptions, *, renderer, layout, engine, sink=None, driver_factory=None,
                   shared_slots=None) -> Pipeline:
    """``driver_factory``: how blocks reach a VLM other than ``engine`` (the server's job runner
    drives the served engine); None: the pipeline's own step loop over ``engine``.
    ``shared_slots``: a PageSlots budget this run shares with others (the server's jobs)."""
    from .blocks import ParseTaskOptions
    from .layout_post import LayoutPostConfig
    planted = PlantedLayoutFile(opts.planted_layouts) if opts.planted_layouts else None
    return Pipeline(renderer, layout, engine, opts.pipeline_options(), sink=sink, planted=planted,
                    post_config=LayoutPostConfig(threshold=opts.layout_threshold),
                    task_options=ParseTaskOptions(chart_recognition=opts.chart_recognition,
                                                  seal_recognition=opts.seal_recognition),
                    driver_factory=driver_factory, shared_slots=shared_slots)


# ------------------------------------------------------------------ the workspace as the sink
class WorkspaceSink:
    """The coordinator's writer: commits through the workspace under the page's lease; a stale
    lease's commit is refused (counted, logged), never written."""

    def __init__(self, workspace):
        self.ws = workspace
        self.refused = 0

    def commit(self, job: PageJob, result) -> bool:
        from .leases import StaleLease
        try:
            self.ws.commit(job.lease, job.work.key, result)
        except StaleLease as e:
            self.refused += 1
            log.warning("parse: refused a stale commit of %s: %s", job.work.key, e)
            return False
        return True

    def fail(self, job: PageJob, stage: str, message: str) -> None:
        from .leases import StaleLease
        try:
            self.ws.fail(job.lease, job.work.key, stage, message)
        except StaleLease as e:
            self.refused += 1
            log.warning("parse: refused a stale failure record of %s: %s", job.work.key, e)


def open_workspace(opts: ParseOptions, inputs: list[str]):
    """The workspace under opts.output with the inputs' documents added (each input's pages, or
    its input error) -> (workspace, pages to do). Only a count: a 10M-page manifest's pending
    pages are leased from the workspace a few at a time, never listed."""
    from .sources import count_pages, expand_inputs, file_digest, parse_page_ranges
    from .workspace import Workspace
    ranges = parse_page_ranges(opts.pages)
    paths = expand_inputs(list(inputs))
    ws = Workspace.open(opts.output, fingerprint=opts.fingerprint(), formats=frozenset(opts.formats),
                        jsonl_shards=opts.jsonl_shards)
    try:
        for p in paths:
            try:
                n = count_pages(p)
                digest = file_digest(p)
            except PageError as e:
                ws.add_input_error(str(p), e.stage, e.message)
                continue
            except OSError as e:
                ws.add_input_error(str(p), "input", f"{type(e).__name__}: {e}")
                continue
            ws.add_document(str(p), digest, ranges.select(n), n)
        st = ws.status()
        return ws, st.pending + (st.failed if opts.retry_failed else 0)
    except BaseException:
        ws.close()
        raise


def local_jobs(opts: ParseOptions, inputs: list[str]) -> tuple[list[PageJob], list[PageOutcome]]:
    """Pages of the inputs without a workspace (no resume): each page's job, and an outcome
    with the PageError of each input that cannot be opened (it has no pages to run)."""
    from .sources import count_pages, expand_inputs, file_digest, parse_page_ranges
    from .workspace import PageWork, page_key
    ranges = parse_page_ranges(opts.pages)
    jobs, errors = [], []
    for p in expand_inputs(list(inputs)):
        try:
            n = count_pages(p)
            digest = file_digest(p)
        except (PageError, OSError) as e:
            err = e if isinstance(e, PageError) else PageError("input", f"{type(e).__name__}: {e}")
            errors.append(PageOutcome(PageJob(PageWork(f"input:{p}", str(p), 0, 0, stem=Path(p).stem)), error=err))
            continue
        for i in ranges.select(n):
            jobs.append(PageJob(PageWork(page_key(digest, i), str(p), i, n, stem=Path(p).stem)))
    return jobs, errors


def leased_jobs(ws, worker: str, chunk: int, retry_failed: bool) -> Iterator[PageJob]:
    """This process's pages from the workspace, leased ``chunk`` at a time (the workspace checks
    each lease's fencing token at commit, as it does for the workers' leases)."""
    while True:
        lease = ws.grant(worker, chunk, LOCAL_LEASE_TTL_S, retry_failed=retry_failed)
        if lease is None:
            return
        for work in lease_works(ws, lease):
            yield PageJob(work, lease)


def lease_works(ws, lease) -> list:
    """The PageWork of each page of a lease."""
    return [ws.work(key) for key in lease.keys]
