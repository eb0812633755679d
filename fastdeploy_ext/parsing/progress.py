"""Progress of a parse run: a tqdm bar on a terminal (pages/s, blocks/s, GPU busy, ETA), or with
``json_lines`` one JSON object per line every ``interval_s`` seconds on stdout (for tools):

    {"event": "progress", "done": 12, "failed": 1, "total": 31, "pages_per_s": 2.4,
     "blocks_per_s": 30.1, "output_tokens_per_s": 410.0, "gpu_busy_pct": 93.0, "eta_s": 7.5, "elapsed_s": 5.0}

and a last line with ``"event": "done"`` when the run ends. GPU busy is the runner's
utilization reader (the backend's, where it has one) sampled at each report; null where the backend cannot tell.
"""
from __future__ import annotations

import json
import sys
import threading
import time
from typing import Callable, TextIO


class Progress:
    def __init__(self, total: int, *, json_lines: bool = False, interval_s: float = 5.0,
                 gpu_reader: Callable[[], float] | None = None, stream: TextIO | None = None,
                 bar: bool | None = None):
        self.total = total
        self.done = self.failed = self.blocks = self.output_tokens = 0
        self.gpu_reader = gpu_reader
        self._gpu_samples: list[float] = []
        self.t0 = time.monotonic()
        self._lock = threading.Lock()
        self._stream = stream or sys.stdout
        self.json_lines = json_lines
        self._stop = threading.Event()
        self._thread = None
        self._bar = None
        if json_lines:
            self.interval = interval_s
            self._thread = threading.Thread(target=self._report_loop, name="fdx-parse-progress", daemon=True)
            self._thread.start()
        elif (sys.stderr.isatty() if bar is None else bar) and total > 0:
            from tqdm.auto import tqdm
            self._bar = tqdm(total=total, unit="page", desc="parse", dynamic_ncols=True)

    def update(self, outcome) -> None:
        with self._lock:
            if outcome.error is not None:
                self.failed += 1
            else:
                self.done += 1
                self.blocks += outcome.blocks
                self.output_tokens += outcome.output_tokens
        if self._bar is not None:
            snap = self.snapshot()
            post = {"blocks/s": f"{snap['blocks_per_s']:.1f}", "failed": snap["failed"]}
            if snap["gpu_busy_pct"] is not None:
                post["GPU"] = f"{snap['gpu_busy_pct']:.0f}%"
            self._bar.set_postfix(post, refresh=False)
            self._bar.update(1)

    def _gpu(self) -> float | None:
        if self.gpu_reader is None:
            return None
        try:
            v = self.gpu_reader()
        except Exception:  # noqa: BLE001 - a management library hiccup is not the run's problem
            return None
        if v is None:
            return None
        v = float(v)
        self._gpu_samples.append(v)
        return v

    def snapshot(self, event: str = "progress") -> dict:
        with self._lock:
            done, failed, blocks, toks = self.done, self.failed, self.blocks, self.output_tokens
        el = max(time.monotonic() - self.t0, 1e-9)
        rate = (done + failed) / el
        left = max(self.total - done - failed, 0)
        gpu = self._gpu()
        if event == "done" and self._gpu_samples:
            gpu = sum(self._gpu_samples) / len(self._gpu_samples)
        return {"event": event, "done": done, "failed": failed, "total": self.total,
                "pages_per_s": round(done / el, 3), "blocks_per_s": round(blocks / el, 3),
                "output_tokens_per_s": round(toks / el, 3), "gpu_busy_pct": None if gpu is None else round(gpu, 1),
                "eta_s": round(left / rate, 1) if rate > 0 else None, "elapsed_s": round(el, 2)}

    def _emit(self, event: str) -> None:
        self._stream.write(json.dumps(self.snapshot(event)) + "\n")
        self._stream.flush()

    def _report_loop(self) -> None:
        while not self._stop.wait(self.interval):     # a report every interval, at once on close
            self._emit("progress")

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._emit("done")
        if self._bar is not None:
            self._bar.close()
