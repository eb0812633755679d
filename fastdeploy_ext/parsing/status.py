"""``parse-status DIR``: done / failed / pending pages and the recent rate, read from the
workspace's files alone (no lock: it runs beside a live coordinator).

Fast on huge workspaces by construction (see journal.py): the totals come from the manifest's
last line, and the done log is decoded column-wise with numpy, one chunk of records at a time;
no JSON is decoded per page.
"""
from __future__ import annotations

import json as _json
import os
import time
from dataclasses import asdict, dataclass

import numpy as np

from .journal import WorkspacePaths, iter_done_columns, manifest_totals, valid_done_length

#: the rate is measured over the commits of this trailing window (ending at the last commit)
RATE_WINDOW_S = 60.0


@dataclass
class WorkspaceStatus:
    done: int
    failed: int              # failed and not done since (a retried page that succeeded is done)
    pending: int             # neither: never tried, in flight, or interrupted
    pages_per_s: float       # over the last RATE_WINDOW_S of commits; 0 with fewer than 2
    total: int = 0
    documents: int = 0
    input_errors: int = 0    # input files that never got pages (unreadable, encrypted, ...)
    last_commit_at: float | None = None   # unix time of the newest done record


def rate_of(times_ms: np.ndarray) -> float:
    """Pages per second over the commits in ``times_ms`` (already cut to the window)."""
    if len(times_ms) < 2:
        return 0.0
    span_s = (int(times_ms.max()) - int(times_ms.min())) / 1000.0
    return (len(times_ms) - 1) / span_s if span_s > 0 else 0.0


def workspace_status(output_dir: str) -> WorkspaceStatus:
    paths = WorkspacePaths(str(output_dir))
    if not os.path.exists(paths.config):
        raise FileNotFoundError(f"{output_dir} is not a parse workspace (no {paths.config}); "
                                "it is created by `fastdeploy-ext parse --output DIR`")
    # the done log's length first: every record in it refers to a page whose manifest record was
    # written before it, so the manifest read next covers all of them
    length = valid_done_length(paths.done_log)
    totals = manifest_totals(paths.manifest)
    size = totals.pages
    done = np.zeros(size, dtype=bool)
    failed = np.zeros(size, dtype=bool)
    recent = np.zeros(0, dtype=np.int64)
    for cols in iter_done_columns(paths.done_log, length, fields=("ordinal", "time_ms")):
        if len(cols.ordinal) and int(cols.ordinal.max()) >= size:   # a manifest read torn mid-append
            grow = int(cols.ordinal.max()) + 1 - size
            done, failed, size = np.append(done, np.zeros(grow, bool)), np.append(failed, np.zeros(grow, bool)), size + grow
        is_done = cols.outcome == ord("D")
        done[cols.ordinal[is_done]] = True
        failed[cols.ordinal[~is_done]] = True
        recent = np.concatenate([recent, cols.time_ms[is_done]])
        if len(recent):
            recent = recent[recent >= recent.max() - int(RATE_WINDOW_S * 1000)]
    n_done = int(done.sum())
    n_failed = int((failed & ~done).sum())
    return WorkspaceStatus(
        done=n_done, failed=n_failed, pending=size - n_done - n_failed, pages_per_s=rate_of(recent),
        total=size, documents=totals.documents, input_errors=totals.input_errors,
        last_commit_at=float(recent.max()) / 1000.0 if len(recent) else None)


def format_status(st: WorkspaceStatus, json: bool = False, *, as_json: bool | None = None) -> str:
    """What ``parse-status`` prints: one JSON object, or a few lines for people
    (``as_json``: the same switch under a name that does not shadow the module)."""
    if json or as_json:
        return _json.dumps(asdict(st), sort_keys=True)
    share = f" ({100.0 * st.done / st.total:.1f} % done)" if st.total else ""
    lines = [f"pages: {st.done:,} done, {st.failed:,} failed, {st.pending:,} pending of {st.total:,}{share}",
             f"documents: {st.documents:,}; input files with errors: {st.input_errors:,}"]
    if st.last_commit_at is None:
        lines.append("rate: no page committed yet")
    else:
        when = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(st.last_commit_at))
        rate = (f"{st.pages_per_s:.2f} pages/s over the last {RATE_WINDOW_S:.0f} s of commits" if st.pages_per_s > 0
                else f"not measured (one commit in the last {RATE_WINDOW_S:.0f} s of commits)")
        lines.append(f"rate: {rate} (last commit {when})")
    return "\n".join(lines)
