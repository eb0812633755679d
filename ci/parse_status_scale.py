#!/usr/bin/env python3
"""`parse-status` at scale: build a synthetic parse workspace of N pages (default 10M) in a temp
dir, in the exact on-disk formats (the records come from the workspace's own encoders, checked
record by record on a sample), then time `workspace_status` on it and check its counts.
Optionally also time a coordinator's resume (`Workspace.open`) and its peak RSS.

    python3 ci/parse_status_scale.py [--pages 10000000] [--docs 100000] [--open] [--keep DIR]

Not a CI test (it writes ~700 MB); tests/test_parse_workspace.py checks the counts on a small one.
The mix: 90 % done, 5 % failed of which a fifth later done by a retry (two records), the rest
pending; done records in a shuffled order (pages complete out of order).
"""
from __future__ import annotations

import argparse
import os
import resource
import shutil
import sys
import tempfile
import time
import zlib

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from fastdeploy_ext.parsing import journal  # noqa: E402
from fastdeploy_ext.parsing.status import format_status, workspace_status  # noqa: E402
from fastdeploy_ext.parsing.workspace import Workspace  # noqa: E402

FINGERPRINT = {"vlm": "synthetic", "layout": "synthetic", "dpi": 144}
FORMATS = frozenset({"json"})     # no per-document Markdown to rebuild: the synthetic pages have no files


def write_manifest(path: str, n_pages: int, n_docs: int) -> None:
    per_doc = -(-n_pages // n_docs)
    with open(path, "wb") as f:
        first = 0
        for d in range(n_docs):
            k = min(per_doc, n_pages - first)
            if k <= 0:
                break
            digest = f"{d:064x}"
            body = {"doc": d, "path": f"/data/batch/doc{d:07d}.pdf", "digest": digest, "stem": f"doc{d:07d}",
                    "page_count": k, "pages": [[0, k - 1]], "first": first}
            first += k
            f.write(journal.encode_manifest_line(journal.ManifestTotals(first, d + 1, 0), body))


def _fixed(values: np.ndarray, width: int) -> np.ndarray:
    """int64 [n] -> ASCII decimal [n, width], zero-padded."""
    powers = 10 ** np.arange(width - 1, -1, -1, dtype=np.int64)
    return ((values[:, None] // powers) % 10 + 48).astype(np.uint8)


def done_records(outcome: np.ndarray, ordinal: np.ndarray, time_ms: np.ndarray) -> np.ndarray:
    """The done log's bytes as [n, DONE_RECORD_SIZE], built column-wise; CRCs per record."""
    n = len(ordinal)
    rec = np.full((n, journal.DONE_RECORD_SIZE), ord(" "), dtype=np.uint8)
    rec[:, 0] = outcome
    zeros = np.zeros(n, dtype=np.int64)
    for (a, b), col in zip(journal._DONE_FIELDS[1:6], (ordinal, zeros, zeros, zeros, time_ms)):
        rec[:, a:b] = _fixed(col, b - a)
    rec[:, -1] = ord("\n")
    flat = rec.reshape(-1)
    mv = memoryview(flat)
    size = journal.DONE_RECORD_SIZE
    crcs = np.fromiter((zlib.crc32(mv[i * size:i * size + 57]) for i in range(n)), dtype=np.int64, count=n)
    nibbles = (crcs[:, None] >> (4 * np.arange(7, -1, -1, dtype=np.int64))) & 0xF
    rec[:, 58:66] = np.where(nibbles < 10, nibbles + 48, nibbles + 87).astype(np.uint8)
    return rec


def build(root: str, n_pages: int, n_docs: int, seed: int = 0) -> dict:
    Workspace.open(root, fingerprint=FINGERPRINT, formats=FORMATS).close()       # the config and the lock file
    paths = journal.WorkspacePaths(root)
    write_manifest(paths.manifest, n_pages, n_docs)
    rng = np.random.default_rng(seed)
    order = rng.permutation(n_pages).astype(np.int64)
    n_done, n_failed = int(n_pages * 0.90), int(n_pages * 0.05)
    retried = order[n_done:n_done + n_failed // 5]             # failed first, then done on retry
    ordinal = np.concatenate([order[:n_done], order[n_done:n_done + n_failed], retried])
    outcome = np.concatenate([np.full(n_done, ord("D")), np.full(n_failed, ord("F")), np.full(len(retried), ord("D"))])
    t0 = int(time.time() * 1000) - len(ordinal) * 10
    time_ms = t0 + np.arange(len(ordinal), dtype=np.int64) * 10     # 100 pages/s
    with open(paths.done_log, "wb") as f:
        step = 1 << 20
        for i in range(0, len(ordinal), step):
            rec = done_records(outcome[i:i + step].astype(np.uint8), ordinal[i:i + step], time_ms[i:i + step])
            if i == 0:      # the column-built records are the workspace's own, byte for byte
                for j in (0, 1, len(rec) - 1):
                    want = journal.encode_done_record(journal.DoneRecord(
                        bytes([outcome[j]]), int(ordinal[j]), 0, 0, 0, int(time_ms[j])))
                    assert rec[j].tobytes() == want, (rec[j].tobytes(), want)
            f.write(rec.tobytes())
    done = n_done + len(retried)
    return {"total": n_pages, "done": done, "failed": n_failed - len(retried), "pending": n_pages - done - (n_failed - len(retried))}


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pages", type=int, default=10_000_000)
    ap.add_argument("--docs", type=int, default=100_000)
    ap.add_argument("--open", action="store_true", help="also time a coordinator's resume (Workspace.open)")
    ap.add_argument("--keep", help="build here and keep it (default: a temp dir, removed)")
    a = ap.parse_args(argv)
    root = a.keep or tempfile.mkdtemp(prefix="parse_status_scale_")
    try:
        t = time.perf_counter()
        want = build(root, a.pages, a.docs)
        size = os.path.getsize(journal.WorkspacePaths(root).done_log) + os.path.getsize(journal.WorkspacePaths(root).manifest)
        print(f"built {a.pages:,} pages / {a.docs:,} documents ({size / 1e6:.0f} MB) in {time.perf_counter() - t:.1f} s")
        t = time.perf_counter()
        st = workspace_status(root)
        elapsed = time.perf_counter() - t
        print(format_status(st))
        print(f"workspace_status: {elapsed:.2f} s for {a.pages:,} pages")
        got = {"total": st.total, "done": st.done, "failed": st.failed, "pending": st.pending}
        if got != want:
            print(f"FAIL: counts {got} != {want}")
            return 1
        if a.open:
            t = time.perf_counter()
            ws = Workspace.open(root, fingerprint=FINGERPRINT, formats=FORMATS)
            print(f"Workspace.open (resume): {time.perf_counter() - t:.2f} s, status {ws.status().done:,} done; "
                  f"peak RSS {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.0f} MB")
            ws.close()
        return 0
    finally:
        if not a.keep:
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
