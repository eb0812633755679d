"""Preprocess many images on several cores: a thread pool around one ``ImageProcessor``.

Threads, not processes: the heavy parts of ``ImageProcessor.preprocess`` (image decode, PIL's
resize, numpy's cast/normalize loops) run with the GIL released, so threads scale across cores
without pickling ~25 MB of pixels per page back from a worker process. The processor is
immutable after construction, so one instance serves all threads.

Usage (the engine's pattern)::

    pool = PreprocessPool(processor, workers=8)
    fut = pool.submit(image_bytes, name="req-1/image 0")   # -> Future[ProcessedImage]
    outs = pool.map(images)                                   # ordered; first error raised
    pool.close()
"""
from __future__ import annotations

import logging
import os
from collections.abc import Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor

from ...inputs.images import ImageInputError, ImageSource, source_name
from .processor import ImageProcessor, ProcessedImage

logger = logging.getLogger(__name__)


def default_workers() -> int:
    """Cores this process may run on (its CPU affinity), at least 1."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


class PreprocessPool:
    """``workers`` threads calling ``processor.preprocess``; usable as a context manager."""

    def __init__(self, processor: ImageProcessor | None = None, workers: int | None = None):
        if workers is not None and (isinstance(workers, bool) or not isinstance(workers, int) or workers < 1):
            raise ValueError(f"workers must be a positive integer, got {workers!r}")
        self.processor = processor or ImageProcessor()
        self.workers = workers or default_workers()
        self._executor = ThreadPoolExecutor(max_workers=self.workers, thread_name_prefix="fdx-preprocess")
        logger.info("preprocess pool: %d threads (%s)", self.workers,
                    "requested" if workers else "one per usable core")

    def submit(self, src: ImageSource, name: str | None = None) -> "Future[ProcessedImage]":
        """Queue one image; the future raises ``ImageInputError`` for a bad one."""
        return self._executor.submit(self.processor.preprocess, src, name)

    def map(self, images: Iterable[ImageSource], names: Sequence[str | None] | None = None) -> list[ProcessedImage]:
        """Preprocess all images in parallel; results in input order.

        Unnamed bytes / PIL inputs are called ``<image i>`` in errors, as ``ImageProcessor.__call__``
        does. If any image is bad, the first bad one (in input order) is raised after all finish,
        so no work is left running behind the caller's back."""
        images = list(images)
        names = list(names) if names is not None else [None] * len(images)
        if len(names) != len(images):
            raise ValueError(f"got {len(names)} names for {len(images)} images")
        futures = []
        for i, (src, nm) in enumerate(zip(images, names)):
            if nm is None:
                nm = source_name(src, None)
                if nm.startswith("<"):
                    nm = f"<image {i}>"
            futures.append(self.submit(src, nm))
        results: list[ProcessedImage] = []
        first_error: ImageInputError | None = None
        for f in futures:
            try:
                results.append(f.result())
            except ImageInputError as e:
                first_error = first_error or e
        if first_error is not None:
            raise first_error
        return results

    def close(self) -> None:
        self._executor.shutdown(wait=True)

    def __enter__(self) -> "PreprocessPool":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


__all__ = ["PreprocessPool", "default_workers"]
