"""Pages -> RGB pixels, in worker processes: PDFium (pypdfium2) is not thread-safe, and a page that
hangs or crashes it must not take the run with it. Each worker holds one open document at a time
(the one its last page came from), so a 3,000-page PDF is rendered page by page, never loaded
whole; host memory is bounded by the pages in flight, which the caller bounds.

A page that runs past its ``timeout_s`` gets its worker killed and replaced; a worker that dies
(a PDFium crash) is replaced too; either way the page's future raises PageError('render') and the
other pages go on. PDFs render at ``dpi`` (144 = PaddleX's zoom 2); images (PNG, JPEG, WebP, BMP,
TIFF frames) are decoded with the checks of fastdeploy_ext/inputs/images.py (bombs refused
before decoding)."""
from __future__ import annotations

import atexit
import logging
import math
import multiprocessing as mp
import os
import queue
import threading
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np

from .. import envs
from .errors import PageError
from .sources import PDFIUM_LOCK, TIFF_SUFFIXES, check_file, is_pdf, open_image_header, open_pdf

log = logging.getLogger(__name__)

#: PaddleX renders PDF pages at zoom 2 (2 x 72 dpi)
DEFAULT_DPI = 144
#: how long a fresh worker may take to import its modules and say it is ready
WORKER_START_TIMEOUT_S = 120.0


@dataclass
class RenderTask:
    path: str
    page_index: int                     # 0-based
    dpi: int = DEFAULT_DPI
    #: the decode cap: images above it are refused; PDF pages are rendered at the largest scale under it
    max_pixels: int = field(default_factory=envs.FD_MAX_IMAGE_PIXELS.get)
    timeout_s: float = 60.0

    def __post_init__(self):
        if isinstance(self.dpi, bool) or not isinstance(self.dpi, int) or not 1 <= self.dpi <= 2400:
            raise ValueError(f"dpi must be an integer in [1, 2400], got {self.dpi!r}")
        if not self.max_pixels >= 1:
            raise ValueError(f"max_pixels must be >= 1, got {self.max_pixels!r}")
        if not self.timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {self.timeout_s!r}")
        if self.page_index < 0:
            raise ValueError(f"page_index must be >= 0, got {self.page_index!r}")


@dataclass
class RenderedPage:
    path: str
    page_index: int
    page_count: int
    image: np.ndarray                   # uint8 [h, w, 3] RGB
    width: int
    height: int
    #: pixels per PDF point actually used (dpi / 72, lower when the pixel cap shrank the page); 1.0 for images
    scale: float = 1.0


# --------------------------------------------------------------------------------------------
# rendering one page (runs in a worker process)
# --------------------------------------------------------------------------------------------

class _OpenDocument:
    """The worker's one open PDF: kept while pages of the same file follow each other."""

    def __init__(self):
        self.path: str | None = None
        self.doc = None
        self._at_exit = False

    def get(self, path: str):
        if self.path != path:
            self.close()
            self.doc = open_pdf(path)
            self.path = path
            if not self._at_exit:
                # closed before pypdfium2's own exit hook (registered earlier, so run later)
                # finds it open: render_page called in-process keeps its last document
                atexit.register(self.close)
                self._at_exit = True
        return self.doc

    def close(self):
        if self.doc is not None:
            self.doc.close()
        self.doc, self.path = None, None


_open_doc = _OpenDocument()


def _out_of_range(task: RenderTask, count: int) -> PageError:
    return PageError("render", f"{task.path}: page {task.page_index + 1} does not exist (the file has {count} pages)")


def pdf_scale(width_pt: float, height_pt: float, dpi: int, max_pixels: int) -> float:
    """Pixels per point for a page: dpi / 72, or less when that would exceed ``max_pixels``."""
    scale = dpi / 72.0

    def pixels(s: float) -> int:            # the bitmap's size: PDFium rounds each side up
        return math.ceil(width_pt * s) * math.ceil(height_pt * s)

    if pixels(scale) > max_pixels:
        scale *= math.sqrt(max_pixels / pixels(scale))
        while pixels(scale) > max_pixels and scale > 1e-6:
            scale *= 0.995
    return scale


def _render_pdf(task: RenderTask) -> RenderedPage:
    import pypdfium2 as pdfium

    doc = _open_doc.get(task.path)
    count = len(doc)
    if count == 0:
        raise PageError("input", f"{task.path}: the PDF has no pages")
    if not 0 <= task.page_index < count:
        raise _out_of_range(task, count)
    try:
        page = doc[task.page_index]
    except pdfium.PdfiumError as e:
        raise PageError("render", f"{task.path}: page {task.page_index + 1} cannot be loaded ({e})") from None
    try:
        w_pt, h_pt = page.get_size()
        if w_pt <= 0 or h_pt <= 0:
            raise PageError("render", f"{task.path}: page {task.page_index + 1} has an empty size {w_pt}x{h_pt} pt")
        scale = pdf_scale(w_pt, h_pt, task.dpi, task.max_pixels)
        if scale < task.dpi / 72.0:
            log.info("%s page %d: rendered at %.0f dpi instead of %d to stay under the %d-pixel cap",
                     task.path, task.page_index + 1, scale * 72, task.dpi, task.max_pixels)
        bitmap = page.render(scale=scale, rev_byteorder=True)      # RGB byte order, white background
        try:
            arr = np.array(bitmap.to_numpy()[..., :3], dtype=np.uint8)   # a copy: the buffer is PDFium's
        finally:
            bitmap.close()
        if arr.shape[0] * arr.shape[1] > task.max_pixels:
            raise PageError("render", f"{task.path}: page {task.page_index + 1} rendered to "
                                      f"{arr.shape[1]}x{arr.shape[0]} pixels, above the cap of {task.max_pixels:,}")
    except PageError:
        raise
    except Exception as e:  # noqa: BLE001 - PDFium's failures are a bad page, not a bad run
        raise PageError("render", f"{task.path}: page {task.page_index + 1} failed to render "
                                  f"({type(e).__name__}: {e})") from None
    finally:
        page.close()
    return RenderedPage(task.path, task.page_index, count, arr, arr.shape[1], arr.shape[0], scale)


def _tiff_frames(path: str) -> int:
    with open_image_header(path) as tif:
        return max(1, int(getattr(tif, "n_frames", 1)))


def _render_image(task: RenderTask) -> RenderedPage:
    from ..inputs.images import ImageInputError, load_image

    check_file(task.path)
    is_tiff = Path(task.path).suffix.lower() in TIFF_SUFFIXES
    try:
        if not is_tiff:
            if task.page_index != 0:
                raise _out_of_range(task, 1)
            arr, count = np.asarray(load_image(task.path, max_image_pixels=task.max_pixels), dtype=np.uint8), 1
        elif task.page_index == 0:
            arr = np.asarray(load_image(task.path, max_image_pixels=task.max_pixels), dtype=np.uint8)
            count = _tiff_frames(task.path)
        else:
            # a later frame of a multi-page TIFF: selected on the lazily opened file, then
            # load_image checks that frame's own size before decoding it
            with open_image_header(task.path) as tif:
                count = max(1, int(getattr(tif, "n_frames", 1)))
                if task.page_index >= count:
                    raise _out_of_range(task, count)
                tif.seek(task.page_index)
                frame = load_image(tif, name=f"{task.path} (frame {task.page_index + 1})",
                                   max_image_pixels=task.max_pixels)
                arr = np.array(frame, dtype=np.uint8)   # before the file closes (an RGB frame is not copied)
    except ImageInputError as e:
        raise PageError("input", str(e)) from None
    except PageError:
        raise
    except Exception as e:  # noqa: BLE001 - PIL's own failures on a bad file
        raise PageError("input", f"{task.path}: cannot decode the image ({type(e).__name__}: {e})") from None
    return RenderedPage(task.path, task.page_index, count, arr, arr.shape[1], arr.shape[0], 1.0)


def render_page(task: RenderTask) -> RenderedPage:
    """One page -> RGB pixels (in the calling process; thread-safe). PageError on any failure."""
    if is_pdf(task.path):
        with PDFIUM_LOCK:
            return _render_pdf(task)
    return _render_image(task)


RenderFn = Callable[[RenderTask], RenderedPage]


def _die_with_parent(parent_pid: int) -> None:
    """Linux: the kernel kills this worker when the thread that started it goes (a coordinator
    killed with SIGKILL must not leave a worker rendering a hung page); Ctrl-C is the parent's
    to handle (it closes the pool), not a traceback in every worker."""
    import signal
    import sys

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if not sys.platform.startswith("linux"):
        return
    try:
        import ctypes
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL, 0, 0, 0)          # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    if os.getppid() != parent_pid:                     # the parent went before the call above
        os._exit(1)


def _worker_main(conn, render_fn: RenderFn, parent_pid: int | None = None) -> None:
    if parent_pid is not None:
        _die_with_parent(parent_pid)
    conn.send(("ready", None))
    while True:
        try:
            task = conn.recv()
        except (EOFError, OSError):
            break
        if task is None:
            break
        try:
            msg = ("ok", render_fn(task))
        except PageError as e:
            msg = ("err", e)
        except BaseException as e:  # noqa: BLE001 - reported as the page's error; the worker lives on
            msg = ("err", PageError("render", f"{task.path}: page {task.page_index + 1} failed to render "
                                              f"({type(e).__name__}: {e})"))
        conn.send(msg)
    _open_doc.close()


# --------------------------------------------------------------------------------------------
# the pool
# --------------------------------------------------------------------------------------------

class _Slot:
    """One worker process and the parent thread that feeds it one task at a time."""

    def __init__(self, renderer: "PageRenderer", index: int):
        self.renderer = renderer
        self.index = index
        self.proc = None
        self.conn = None
        self.restarts = 0
        self.thread = threading.Thread(target=self._run, name=f"fdx-render-{index}", daemon=True)

    def _start(self) -> None:
        ctx = self.renderer._ctx
        parent, child = ctx.Pipe()
        proc = ctx.Process(target=_worker_main, args=(child, self.renderer._render_fn, os.getpid()),
                           name=f"fdx-render-{self.index}", daemon=True)
        try:
            proc.start()
        except BaseException:
            # a process that never started has nothing to kill or join: the slot stays empty and
            # the page fails with the reason (e.g. a daemonic caller may not have children)
            parent.close()
            child.close()
            raise
        child.close()
        self.proc, self.conn = proc, parent
        if not parent.poll(WORKER_START_TIMEOUT_S):
            self._stop(kill=True)
            raise RuntimeError(f"render worker {self.index} did not start within {WORKER_START_TIMEOUT_S:g} s")
        parent.recv()           # "ready": the page timeout counts from here, not from the imports

    def _stop(self, kill: bool) -> None:
        proc, conn = self.proc, self.conn
        self.proc, self.conn = None, None
        if proc is None:
            return
        if kill:
            proc.kill()
        else:
            try:
                conn.send(None)
            except (OSError, BrokenPipeError):
                pass
            proc.join(5.0)
            if proc.is_alive():
                proc.kill()
        proc.join()
        conn.close()

    def _restart_after(self, why: str) -> None:
        self.restarts += 1
        log.warning("render worker %d replaced: %s", self.index, why)
        self._stop(kill=True)

    def _run(self) -> None:
        tasks = self.renderer._tasks
        while True:
            item = tasks.get()
            if item is None:
                break
            task, fut = item
            if not fut.set_running_or_notify_cancel():
                continue
            try:
                if self.proc is None:
                    self._start()
                self.conn.send(task)
                if not self.conn.poll(task.timeout_s):
                    self._restart_after(f"page {task.page_index + 1} of {task.path} timed out")
                    fut.set_exception(PageError(
                        "render", f"{task.path}: page {task.page_index + 1} did not render within "
                                  f"{task.timeout_s:g} s (its worker was killed and replaced)"))
                    continue
                try:
                    kind, value = self.conn.recv()
                except (EOFError, OSError):
                    self.proc.join(5.0)             # it closed its end: it is exiting; reap it for its code
                    code = self.proc.exitcode
                    self._restart_after(f"it died on page {task.page_index + 1} of {task.path}")
                    fut.set_exception(PageError(
                        "render", f"{task.path}: page {task.page_index + 1} crashed the render worker "
                                  f"(exit code {code}); the worker was replaced"))
                    continue
                if kind == "ok":
                    fut.set_result(value)
                else:
                    fut.set_exception(value)
            except BaseException as e:  # noqa: BLE001 - the slot survives; the page fails
                try:
                    self._restart_after(f"{type(e).__name__}: {e}")
                except BaseException as stop_error:  # noqa: BLE001 - the thread must outlive a bad worker
                    log.warning("render worker %d could not be stopped: %s", self.index, stop_error)
                    self.proc, self.conn = None, None
                if not fut.done():
                    fut.set_exception(e if isinstance(e, PageError) else PageError(
                        "render", f"{task.path}: page {task.page_index + 1}: {type(e).__name__}: {e}"))
        self._stop(kill=False)


class PageRenderer:
    """A pool of ``workers`` render processes. ``submit(task)`` -> a Future of RenderedPage that
    raises PageError on failure. Use as a context manager, or call ``close()``.

    ``render_fn`` (a picklable module-level function) replaces :func:`render_page` in the workers,
    e.g. to inject faults in tests. ``mp_context``: "spawn" by default, since the parent may hold
    threads and an initialised PDFium that a forked child must not inherit."""

    def __init__(self, workers: int = 2, *, mp_context: str = "spawn", render_fn: RenderFn = render_page):
        if workers < 1:
            raise ValueError(f"workers must be >= 1, got {workers}")
        self._ctx = mp.get_context(mp_context)
        self._render_fn = render_fn
        self._tasks: queue.Queue = queue.Queue()
        self._closed = False
        self._lock = threading.Lock()
        self._slots = [_Slot(self, i) for i in range(workers)]
        for s in self._slots:
            s.thread.start()

    @property
    def restarts(self) -> int:
        """Workers replaced so far (timeouts and crashes)."""
        return sum(s.restarts for s in self._slots)

    def submit(self, task: RenderTask) -> Future:
        fut: Future = Future()
        with self._lock:
            if self._closed:
                raise RuntimeError("PageRenderer is closed")
            self._tasks.put((task, fut))
        return fut

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            # pages not started yet are cancelled; the ones running finish first
            while True:
                try:
                    item = self._tasks.get_nowait()
                except queue.Empty:
                    break
                if item is not None:
                    item[1].cancel()
            for _ in self._slots:
                self._tasks.put(None)
        for s in self._slots:
            s.thread.join()

    def __enter__(self) -> "PageRenderer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
