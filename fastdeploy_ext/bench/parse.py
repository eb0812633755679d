"""`fastdeploy-ext bench parse`: document pages/s of our pipeline and, in the same run on the same
engine, of the pipeline driven the way PaddleX drives it, as the baseline; the ratio.

Pages: ``--pages N`` synthetic OmniDocBench-shaped A4 pages (parsing/synthetic.py: PDFs, so
rendering is measured) with planted layouts: the layout model runs for its cost on every page,
the boxes used are the planted ones (per page 2 titles, 9 paragraphs, 1 table, 2 display
formulas, 2 captions), so the block mix is realistic with random weights. ``--pdf DIR``: real
PDFs instead (rendering and the real pages' sizes included); with random layout weights their
boxes come from the same planted mix, and the report says so.

Ours: parsing/pipeline.py (streamed requests with priorities, no barrier, pages complete out of
order). The baseline, PaddleX's shape (three threads: render -> layout -> VLM): pages in groups
of 8 (PaddleX's layout batch); a producer renders and lays out a group while the VLM side works
on the previous one; the VLM side gathers for 0.5 s (PaddleX polls its queue with a 0.5 s
timeout before it sends what it gathered), sends all of the group's blocks at once and starts
the next group only when every block has returned (the longest block of each group stalls it).
Both drive one engine, so the device, the kernels and the batch limits are the same.

Printed: pages/s, blocks/s, output tokens/s, GPU busy (the runner's utilization reader; n/a on the CPU),
the stage breakdown (render, layout, VLM prefill / decode, assemble, engine idle), peak host RSS
and peak device memory, and ours / baseline. ``--stub-vlm``: no VLM at all (every block's text is
a stub): the CPU stages' page rate alone. Nothing here asserts a time.
"""
from __future__ import annotations

import argparse
import json
import logging
import queue
import resource
import tempfile
import threading
import time
from dataclasses import dataclass, replace
from pathlib import Path

from . import BenchError

log = logging.getLogger(__name__)

#: PaddleX: its layout batch and the VLM thread's gathering timeout
BASELINE_GROUP = 8
BASELINE_GATHER_S = 0.5


@dataclass
class BenchParseOptions:
    pages: int = 64
    pdf: str | None = None
    seed: int = 0
    baseline: bool = True
    warmup_pages: int = 2
    json: bool = False
    plots: str | None = None              # a directory for the report's PNG charts (bench/parse_plots.py)


def add_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("bench parse")
    g.add_argument("--pages", type=int, default=None, dest="bench_pages",
                   help="synthetic pages (default 64; 8 on the CPU); with --pdf: at most this many of its pages")
    g.add_argument("--pdf", default=None, metavar="DIR", help="real PDFs from DIR instead of synthetic pages")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--no-baseline", action="store_true", help="ours only (no PaddleX-style run)")
    g.add_argument("--warmup-pages", type=int, default=2, help="pages run once before timing (compiles, warms up)")
    g.add_argument("--json", action="store_true", help="one JSON object")
    g.add_argument("--plots", default=None, metavar="DIR",
                   help="also write the stage breakdown and the GPU-busy timeline as PNG charts into DIR "
                        "(needs matplotlib: the [plots] extra)")


def options_from_args(ns: argparse.Namespace) -> BenchParseOptions:
    on_cpu = ns.device in ("cpu", "cpu_amx")
    pages = ns.bench_pages if ns.bench_pages is not None else (8 if on_cpu else 64)
    if pages < 1:
        raise BenchError(f"--pages must be >= 1, got {pages}")
    if ns.pdf is not None and not Path(ns.pdf).is_dir():
        raise BenchError(f"--pdf {ns.pdf}: not a directory")
    return BenchParseOptions(pages=pages, pdf=ns.pdf, seed=ns.seed, baseline=not ns.no_baseline,
                             warmup_pages=max(ns.warmup_pages, 0), json=ns.json, plots=getattr(ns, "plots", None))


# ------------------------------------------------------------------ the pages
def synthetic_inputs(root: Path, pages: int, seed: int) -> tuple[list[Path], Path]:
    """One synthetic PDF of ``pages`` pages and its planted-layout file."""
    from ..parsing.synthetic import synthetic_document
    doc = synthetic_document(pages, seed)
    pdf = root / f"synthetic_{pages}p_s{seed}.pdf"
    pdf.write_bytes(doc.pdf)
    w, h = doc.spec.width, doc.spec.height
    planted = {"pages": {pdf.name: [[_fraction(d, w, h) for d in doc.detections(i)] for i in range(pages)]}}
    layout = root / "planted.json"
    layout.write_text(json.dumps(planted))
    return [pdf], layout


def real_inputs(root: Path, pdf_dir: str, seed: int) -> tuple[list[Path], Path]:
    """The PDFs of a folder; their boxes from the planted mix (the same page sequence as the
    synthetic pages', in fractions of each real page)."""
    from ..parsing.synthetic import PageSpec, planted_layout
    pdfs = sorted(Path(pdf_dir).rglob("*.pdf"))
    if not pdfs:
        raise BenchError(f"--pdf {pdf_dir}: no .pdf files")
    spec = PageSpec()
    mix = [{"label": b.label, "score": b.score, "bbox": list(b.bbox)} for b in planted_layout(seed, 0)]
    layout = root / "planted.json"
    layout.write_text(json.dumps({"mix": [_fraction(d, spec.width, spec.height) for d in mix]}))
    return pdfs, layout


def _fraction(det: dict, w: int, h: int) -> dict:
    x0, y0, x1, y1 = det["bbox"]
    return {"label": det["label"], "score": det["score"], "bbox": [x0 / w, y0 / h, x1 / w, y1 / h]}


# ------------------------------------------------------------------ measuring
class _Meter:
    """Wall time, GPU busy samples (a thread reading the runner's utilization every 50 ms where
    it has a reader) and the device's peak memory over one run."""

    def __init__(self, engine):
        runner = getattr(engine, "runner", None)
        make = getattr(runner, "utilization_reader", None)
        self.read = make() if callable(make) else None
        self.runner = runner
        self.samples: list[float] = []
        self.sample_t: list[float] = []       # seconds into the run of each sample (--plots' timeline)
        self._stop = threading.Event()

    def __enter__(self):
        from ..device_api import device_api_for
        self.api = device_api_for(getattr(self.runner, "device", "cpu"))
        if self.api.allocator_stats:
            self.api.reset_peak_allocated()
        self.t0 = time.perf_counter()
        if self.read is not None:
            self._thread = threading.Thread(target=self._run, daemon=True)
            self._thread.start()
        return self

    def _run(self):
        while not self._stop.wait(0.05):
            try:
                busy = float(self.read())
                self.sample_t.append(time.perf_counter() - self.t0)
                self.samples.append(busy)
            except Exception:  # noqa: BLE001
                pass

    def __exit__(self, *exc):
        self.wall = time.perf_counter() - self.t0
        self._stop.set()
        if self.read is not None:
            self._thread.join()
        self.peak_device = self.api.peak_allocated_bytes() if self.api.allocator_stats else None

    @property
    def gpu_busy(self) -> float | None:
        return sum(self.samples) / len(self.samples) if self.samples else None


def _report(name: str, outcomes: list, times, meter: _Meter) -> dict:
    done = [o for o in outcomes if o.error is None]
    failed = [o for o in outcomes if o.error is not None]
    blocks = sum(o.blocks for o in done)
    toks = sum(o.output_tokens for o in done)
    wall = meter.wall
    return {"name": name, "pages": len(done), "failed": len(failed), "blocks": blocks, "output_tokens": toks,
            "wall_s": round(wall, 3),
            "pages_per_s": len(done) / wall, "blocks_per_s": blocks / wall, "output_tokens_per_s": toks / wall,
            "gpu_busy_pct": meter.gpu_busy, "peak_device_bytes": meter.peak_device,
            "gpu_busy_timeline": [[round(t, 3), b] for t, b in zip(meter.sample_t, meter.samples)],
            "peak_rss_bytes": _peak_rss(),
            "stages_s": {k: round(v, 3) for k, v in times.as_dict().items() if k.endswith("_s")},
            "errors": sorted({str(o.error) for o in failed})[:5]}


def _peak_rss() -> int:
    """This process's peak resident set (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def run_ours(pipe_factory, jobs: list, engine) -> dict:
    pipe = pipe_factory()
    with _Meter(engine) as meter:
        outcomes = list(pipe.run(jobs))
    return _report("ours", outcomes, pipe.times, meter)


# ------------------------------------------------------------------ the PaddleX-style baseline
class GroupBarrierRun:
    """The baseline's VLM side: a group's blocks all in flight at once, the next group only when
    every one has returned. Reuses our pipeline's stages (render, layout model, post-processing,
    crops, assembly, the same engine driver) so that only the scheduling differs."""

    def __init__(self, pipe, group: int = BASELINE_GROUP, gather_s: float = BASELINE_GATHER_S):
        self.pipe, self.group, self.gather_s = pipe, group, gather_s

    def run(self, jobs: list) -> list:
        from ..parsing.pipeline import _Page
        p = self.pipe
        p.driver = p.driver_factory(p.times)
        groups: queue.Queue = queue.Queue(maxsize=1)        # the producer runs one group ahead
        outcomes: list = []

        def produce():
            for g in range(0, len(jobs), self.group):
                pages = [_Page(j, time.perf_counter()) for j in jobs[g:g + self.group]]
                futs = [p.renderer.submit(_render_task(p, pg.job)) for pg in pages]
                ok = []
                for pg, f in zip(pages, futs):
                    try:
                        pg.rendered = f.result()
                        ok.append(pg)
                    except Exception as e:  # noqa: BLE001
                        pg.error = e
                p.times.render_s += time.perf_counter() - pages[0].t_submit
                groups.put((pages, ok))
            groups.put(None)

        threading.Thread(target=produce, daemon=True).start()
        while True:
            item = groups.get()
            if item is None:
                break
            pages, ok = item
            planned = self._plan(ok)
            # PaddleX's gathering: its VLM thread takes boxes until its queue poll times out (0.5 s)
            time.sleep(self.gather_s)
            self._run_group(planned)
            outcomes.extend(self._finish(pages))
        p.driver.close()
        p.driver.join()
        return outcomes

    def _plan(self, pages: list) -> list:
        """Layout (one call for the group), post-processing and crops; the requests not sent yet."""
        from ..parsing.assemble import BlockResult, PageMeta
        from ..parsing.blocks import BlockKind, crop_block, plan_blocks
        from ..parsing.layout_post import postprocess
        p, out = self.pipe, []
        if not pages:
            return out
        t0 = time.perf_counter()
        found = p.layout.detect([pg.rendered.image for pg in pages], p.opts.layout_threshold)
        t1 = time.perf_counter()
        p.times.layout_s += t1 - t0
        for pg, dets in zip(pages, found):
            r, w = pg.rendered, pg.job.work
            if p.planted is not None:
                dets = p.planted.detections(str(w.path), w.page_index, r.width, r.height)
            tasks = plan_blocks(postprocess(dets, r.width, r.height, p.post_config), p.task_options)
            pg.meta = PageMeta(str(w.path), w.page_index, r.page_count, r.width, r.height)
            pg.results = [None] * len(tasks)
            for i, task in enumerate(tasks):
                if task.kind is BlockKind.VLM:
                    out.append((pg, i, task, crop_block(r.image, task)))
                else:
                    if task.kind is BlockKind.IMAGE:
                        pg.crops[task.block.order] = crop_block(r.image, task)
                    pg.results[i] = BlockResult(task, "")
            pg.rendered = None
        p.times.post_s += time.perf_counter() - t1
        return out

    def _run_group(self, planned: list) -> None:
        from ..parsing.assemble import BlockResult
        p = self.pipe
        left = [len(planned)]
        lock, all_back = threading.Lock(), threading.Event()
        if not planned:
            return

        def done(out, err, pg, i, task):
            with lock:
                if err is not None:
                    pg.error = err
                else:
                    pg.results[i] = BlockResult(task, out.text or "")
                    pg.output_tokens += int(out.num_output_tokens or 0)
                left[0] -= 1
                if left[0] == 0:
                    all_back.set()
        for pg, i, task, crop in planned:       # every block of the group at once, default priority
            p.driver.submit(p._request(task, crop), p._params(task), 0,
                            lambda out, err, pg=pg, i=i, task=task: done(out, err, pg, i, task))
        all_back.wait()                          # the barrier: the longest block holds the group

    def _finish(self, pages: list) -> list:
        from ..parsing.assemble import assemble_page
        from ..parsing.errors import PageError
        from ..parsing.pipeline import PageOutcome, default_image_prefix
        p, out = self.pipe, []
        for pg in pages:
            o = PageOutcome(pg.job, blocks=len(pg.results), output_tokens=pg.output_tokens)
            if pg.error is None:
                t0 = time.perf_counter()
                o.result = assemble_page(pg.meta, pg.results, pg.crops, default_image_prefix(pg.job))
                p.times.assemble_s += time.perf_counter() - t0
                p.times.pages_done += 1
            else:
                o.error = pg.error if isinstance(pg.error, PageError) else PageError("vlm", str(pg.error))
            out.append(o)
        return out


def _render_task(pipe, job):
    from ..parsing.render import RenderTask
    return RenderTask(str(job.work.path), job.work.page_index, dpi=pipe.opts.dpi, timeout_s=pipe.opts.render_timeout_s)


def run_baseline(pipe_factory, jobs: list, engine) -> dict:
    pipe = pipe_factory()
    with _Meter(engine) as meter:
        outcomes = GroupBarrierRun(pipe).run(jobs)
    return _report("paddlex-style", outcomes, pipe.times, meter)


# ------------------------------------------------------------------ the command
def run(opts, bench: BenchParseOptions, models: tuple | None = None) -> dict:
    """``opts``: the parse options (models, device, engine); ``models``: (renderer, layout,
    engine) already built (tests), else built here. Returns the report."""
    from ..parsing.coordinator import build_engine, build_layout, build_pipeline, local_jobs
    from ..parsing.render import PageRenderer
    with tempfile.TemporaryDirectory(prefix="fdx-bench-parse-") as tmp:
        root = Path(tmp)
        if bench.pdf is None:
            inputs, planted = synthetic_inputs(root, bench.pages, bench.seed)
            source = f"{bench.pages} synthetic A4 pages at {opts.dpi} dpi, planted layouts"
        else:
            inputs, planted = real_inputs(root, bench.pdf, bench.seed)
            source = (f"real PDFs from {bench.pdf} (rendering and page sizes real; boxes from the planted mix: "
                      "the layout model runs for its cost, its random-weight boxes are not used)")
        # random VLM weights: each block decodes its kind's planted length on both sides
        opts = replace(opts, planted_layouts=str(planted), output=None, planted_decode=opts.load_format == "dummy")
        jobs, bad = local_jobs(opts, [str(p) for p in inputs])
        if bad:
            log.warning("bench parse: %d inputs cannot be opened: %s", len(bad), "; ".join(str(o.error) for o in bad))
        jobs = jobs[:bench.pages]
        if not jobs:
            raise BenchError("no pages to run")
        t0 = time.perf_counter()
        renderer = PageRenderer(workers=opts.render_workers) if models is None else models[0]
        try:
            if models is None:
                layout = build_layout(opts)
                engine = build_engine(opts, layout)     # after the layout model: its memory is kept out of the KV pool
            else:
                layout, engine = models[1:]
            log.info("bench parse: models ready in %.1f s", time.perf_counter() - t0)

            def factory():
                return build_pipeline(opts, renderer=renderer, layout=layout, engine=engine)
            if bench.warmup_pages:
                list(factory().run(jobs[:bench.warmup_pages]))
            ours = run_ours(factory, jobs, engine)
            base = run_baseline(factory, jobs, engine) if bench.baseline else None
        finally:
            if models is None:
                renderer.close()
    if opts.planted_decode:
        source += "; each block decodes its kind's planted length (random VLM weights)"
    report = {"source": source, "pages": len(jobs), "stub_vlm": opts.stub_vlm, "ours": ours, "baseline": base,
              "ratio": (ours["pages_per_s"] / base["pages_per_s"]) if base and base["pages_per_s"] else None}
    return report


def run_cli(opts, bench: BenchParseOptions) -> int:
    if bench.plots is not None:
        from .parse_plots import _pyplot
        _pyplot()                          # no matplotlib: say so before the run, not after it
    report = run(opts, bench)
    if bench.plots is not None:
        from .parse_plots import write_plots
        for path in write_plots(report, bench.plots):
            log.info("bench parse: wrote %s", path)
    if bench.json:
        print(json.dumps(report))
        return 0
    print(f"bench parse: {report['source']}" + (" (stub VLM: the CPU stages alone)" if report["stub_vlm"] else ""))
    for r in (report["ours"], report["baseline"]):
        if r is None:
            continue
        busy = f"{r['gpu_busy_pct']:.0f}%" if r["gpu_busy_pct"] is not None else "n/a"
        dev = f"{r['peak_device_bytes'] / 2**30:.2f} GiB" if r["peak_device_bytes"] else "n/a"
        st = r["stages_s"]
        print(f"  {r['name']:<14} {r['pages_per_s']:7.2f} pages/s  {r['blocks_per_s']:8.1f} blocks/s  "
              f"{r['output_tokens_per_s']:9.1f} tok/s  GPU busy {busy}  peak RSS {r['peak_rss_bytes'] / 2**30:.2f} GiB"
              f"  device {dev}  ({r['pages']} pages, {r['failed']} failed, {r['wall_s']:.1f} s)")
        print(f"  {'':<14} stages: render {st['render_s']:.2f} s, layout {st['layout_s']:.2f}, post {st['post_s']:.2f}, "
              f"VLM prefill {st['prefill_s']:.2f} / decode {st['decode_s']:.2f}, assemble {st['assemble_s']:.2f}, "
              f"engine idle {st['idle_s']:.2f}")
        for e in r["errors"]:
            print(f"  {'':<14} error: {e}")
    if report["ratio"] is not None:
        print(f"  ours / baseline: {report['ratio']:.2f}x pages/s")
    return 0
