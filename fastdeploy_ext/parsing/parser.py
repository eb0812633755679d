"""``DocumentParser``: the Python face of `fastdeploy-ext parse`.

    from fastdeploy_ext import DocumentParser
    parser = DocumentParser(model="PaddleOCR-VL", layout_model="PP-DocLayoutV3", device="cuda")
    for page in parser.parse(["report.pdf", "scans/"]):       # as each page completes
        page.result.markdown, page.result.record, page.result.images      # or page.error

``ParseOptions`` holds the command line's options (one field per flag). With ``output`` set,
pages go through the workspace (exactly once, resumable: a rerun skips done pages); without it
they are only yielded. ``parse`` yields a ``PageOutcome`` per page: ``result`` (markdown,
PaddleX-shaped record, image crops) or ``error`` (a PageError naming the stage).
``workers > 1`` starts worker processes with multiprocessing's spawn: a script that uses it needs
the usual ``if __name__ == "__main__":`` guard.
"""
from __future__ import annotations

import logging
import os
from dataclasses import replace
from typing import Callable, Iterable, Iterator

from . import coordinator
from .options import ParseOptions
from .pipeline import PageOutcome

log = logging.getLogger(__name__)

__all__ = ["DocumentParser", "ParseOptions", "PageOutcome"]


class DocumentParser:
    """Loads the models once (``DocumentParser(**ParseOptions fields)`` or ``options=``), then
    ``parse(paths)`` any number of times."""

    def __init__(self, options: ParseOptions | None = None, **kwargs):
        if options is None:
            if "formats" in kwargs and not isinstance(kwargs["formats"], frozenset):
                kwargs["formats"] = frozenset(kwargs["formats"])
            options = ParseOptions(**kwargs)
        elif kwargs:
            raise TypeError("give options= or keyword options, not both")
        options.validate()
        self.options = options
        self.last_pipeline = None
        self.workspace_status = None
        self.pages_total = 0
        self._models = None           # (renderer, layout, engine), built on first parse (one process)

    def _build(self):
        if self._models is None:
            from .render import PageRenderer
            renderer = PageRenderer(workers=self.options.render_workers)
            layout = coordinator.build_layout(self.options)
            self._models = (renderer, layout, coordinator.build_engine(self.options, layout))
        return self._models

    def parse(self, paths: str | os.PathLike | Iterable[str | os.PathLike], *, output: str | os.PathLike | None = None,
              on_start: Callable[[int], None] | None = None) -> Iterator[PageOutcome]:
        """Pages as they complete (not in input order). With a workspace (``output`` here or in
        the options): through it, exactly once (done pages of an earlier run are skipped;
        ``workspace_status`` after the run says where it stands). ``on_start(pages)`` is called
        once the pages to do are known."""
        inputs = [os.fspath(paths)] if isinstance(paths, (str, os.PathLike)) else [os.fspath(p) for p in paths]
        opts = self.options
        if output is not None:
            opts = replace(opts, output=os.fspath(output))
        start = on_start or (lambda n: None)
        if opts.workers > 1:
            if opts.output is None:
                raise ValueError("workers > 1 needs a workspace (output=DIR): the workers share its manifest")
            from .workers import run_workers
            yield from run_workers(opts, inputs, self, start)
            return
        if opts.output is None:
            jobs, bad_inputs = coordinator.local_jobs(opts, inputs)
            start(len(jobs) + len(bad_inputs))
            yield from bad_inputs
            renderer, layout, engine = self._build()
            pipe = coordinator.build_pipeline(opts, renderer=renderer, layout=layout, engine=engine)
            self.last_pipeline = pipe
            yield from pipe.run(jobs)
            return
        ws, todo = coordinator.open_workspace(opts, inputs)
        try:
            self.pages_total = todo
            start(todo)
            log.info("parse: %d pages to do in %s", todo, opts.output)
            renderer, layout, engine = self._build()
            pipe = coordinator.build_pipeline(opts, renderer=renderer, layout=layout, engine=engine,
                                              sink=coordinator.WorkspaceSink(ws))
            self.last_pipeline = pipe
            yield from pipe.run(coordinator.leased_jobs(ws, "local", opts.max_pages_in_flight, opts.retry_failed))
        finally:
            self.workspace_status = ws.status()
            ws.close()

    @property
    def gpu_reader(self):
        """The VLM runner's busy-% reader (the backend's own, e.g. on CUDA), None where the backend has none."""
        if not hasattr(self, "_gpu_read"):
            engine = self._models[2] if self._models else None
            make = getattr(getattr(engine, "runner", None), "utilization_reader", None)
            if engine is None and self.options.workers == 1:
                return None               # not built yet: asked again later
            self._gpu_read = make() if callable(make) else None
        return self._gpu_read

    def close(self) -> None:
        if self._models is not None:
            renderer, layout, engine = self._models
            renderer.close()
            if engine is not None:
                engine.shutdown()
            self._models = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
