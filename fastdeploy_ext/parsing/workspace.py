"""A parse output directory as an exactly-once, resumable workspace.

One coordinator process owns it (an exclusive flock on ``.fdparse/lock``) and is its only
writer. The manifest says what work exists (a page's key is its file's content hash + its
index; the config fingerprint says which models and options made the outputs); the done log
says what is finished. A page's outputs are durable before its done record is appended, so after
a crash (``kill -9`` at any moment) the rule on reopening is simple: a page with a done record is
finished, every other page is redone. Outputs of a page without a done record are overwritten
(per-page files) or cut off (JSON Lines shards and errors.jsonl are truncated to the last offset
a done record names), so nothing appears twice. Workers hold leases (leases.py); a commit under a
lease that is no longer current is refused. docs/PARSING.md has the formats and the argument.
"""
from __future__ import annotations

import fcntl
import json
import os
import threading
import time
import zlib
from collections import deque
from pathlib import Path, PurePosixPath
from typing import TYPE_CHECKING, Callable, Iterator

import numpy as np

from .durable import AppendLog, fsync_dir, json_line, truncate, write_atomic
from .journal import (
    CorruptWorkspace, DoneRecord, ManifestTotals, Outcome, WorkspacePaths, encode_done_record, encode_manifest_line,
    iter_done_columns, ManifestReader, valid_done_length,
)
from .leases import Lease, LeaseTable, StaleLease, synchronized
from .pages import DONE, FAILED_BEFORE, FAILED_NOW, PENDING, Doc, PageTable, PageWork, ranges_of
from .pages import page_key  # noqa: F401  (part of this module's API: PageWork's key)
from .status import RATE_WINDOW_S, WorkspaceStatus, rate_of

if TYPE_CHECKING:
    from .assemble import PageResult

FORMATS = frozenset({"md", "json"})
LAYOUT_VERSION = 1

class WorkspaceLocked(RuntimeError):
    """Another coordinator holds the workspace."""


class FingerprintMismatch(ValueError):
    """The workspace was started with other models / options than this run's."""


class PageAlreadyDone(RuntimeError):
    """A second commit of a finished page: refused, so no output is ever written twice."""


def shard_of(key: str, count: int) -> int:
    """A page's JSON Lines shard: a function of its key alone, so reruns pick the same one."""
    return zlib.crc32(key.encode()) % count


class Workspace:
    """Open with ``Workspace.open``; one per output directory per host, in the coordinator."""

    # ------------------------------------------------------------------ opening
    @classmethod
    def open(cls, output_dir, *, fingerprint: dict, formats: frozenset[str] = FORMATS,
             jsonl_shards: int | None = None, clock: Callable[[], float] = time.monotonic) -> Workspace:
        formats = frozenset(formats)
        if not formats or not formats <= FORMATS:
            raise ValueError(f"formats must be a non-empty subset of {sorted(FORMATS)}, got {sorted(formats)}")
        if jsonl_shards is not None and not 1 <= jsonl_shards <= 9999:
            raise ValueError(f"jsonl_shards must be 1..9999, got {jsonl_shards}")
        ws = cls(WorkspacePaths(str(output_dir)), formats, jsonl_shards, clock)
        try:
            ws._take_flock()
            ws._check_config(fingerprint)
            ws._recover()
        except BaseException:
            ws.close()
            raise
        return ws

    def __init__(self, paths: WorkspacePaths, formats: frozenset[str], jsonl_shards: int | None,
                 clock: Callable[[], float]):
        self.paths = paths
        self.root = Path(paths.root)
        self.formats = formats
        self.jsonl_shards = jsonl_shards
        self._lock = threading.RLock()
        self.leases = LeaseTable(clock=clock, settled=self._settled, lock=self._lock)
        self._lock_fd: int | None = None
        self._logs: list[AppendLog] = []
        self._pages = PageTable(paths.manifest)
        self._totals = ManifestTotals()
        self._cursor = {False: 0, True: 0}
        self._recent: deque[float] = deque()           # unix times of this session's commits
        self._last_commit: float | None = None

    def _take_flock(self) -> None:
        os.makedirs(self.paths.state, exist_ok=True)
        fd = os.open(self.paths.lock, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise WorkspaceLocked(f"{self.root} is in use by another parse coordinator (pid {holder}); "
                                  "wait for it to finish or stop it, or use another --output") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self._lock_fd = fd

    def _layout(self, fingerprint: dict) -> dict:
        # through JSON so tuples and lists compare equal, as they will after a reload
        return json.loads(json.dumps({"layout_version": LAYOUT_VERSION, "fingerprint": fingerprint,
                                      "formats": sorted(self.formats), "jsonl_shards": self.jsonl_shards}))

    def _check_config(self, fingerprint: dict) -> None:
        want = self._layout(fingerprint)
        if not os.path.exists(self.paths.config):
            if os.path.exists(self.paths.manifest):
                raise FingerprintMismatch(f"{self.paths.config} is missing but a manifest exists: "
                                          f"delete {self.root} to start over")
            write_atomic(self.paths.config, (json.dumps(want, indent=2, sort_keys=True) + "\n").encode())
            return
        with open(self.paths.config) as f:
            have = json.load(f)
        if have != want:
            fp_have, fp_want = have.get("fingerprint", {}), want["fingerprint"]
            diffs = [f"{k}: {fp_have.get(k)!r} -> {fp_want.get(k)!r}"
                     for k in sorted(set(fp_have) | set(fp_want)) if fp_have.get(k) != fp_want.get(k)]
            diffs += [f"{k}: {have.get(k)!r} -> {want[k]!r}" for k in ("layout_version", "formats", "jsonl_shards")
                      if have.get(k) != want[k]]
            raise FingerprintMismatch(
                f"{self.root} holds pages made with another configuration ({'; '.join(diffs)}); "
                "mixing them would give outputs from two setups. Rerun with the original options, "
                f"use another --output directory, or delete {self.root} to start over")

    def _recover(self) -> None:
        """Replay the manifest and the done log, cutting torn tails and uncommitted output."""
        manifest = ManifestReader(self.paths.manifest)
        errors_end = 0
        for body in manifest:
            self._pages.apply(body)
            errors_end = max(errors_end, body.get("errors_end", 0))
        totals, valid = manifest.totals, manifest.valid_length
        if totals.pages != len(self._pages.state):
            raise CorruptWorkspace(f"{self.paths.manifest}: totals say {totals.pages} pages, records add up to {len(self._pages.state)}")
        self._totals = totals
        length = valid_done_length(self.paths.done_log)
        state = np.zeros(len(self._pages.state), dtype=np.uint8)
        shards = self.jsonl_shards or 0
        shard_end = np.zeros(max(shards, 1), dtype=np.int64)
        n_done = 0
        fields = ("ordinal", "end", "time_ms") + (("shard",) if shards else ())
        for cols in iter_done_columns(self.paths.done_log, length, fields=fields):
            is_done = cols.outcome == ord("D")
            if len(cols.ordinal) and int(cols.ordinal.max()) >= len(state):
                raise CorruptWorkspace(f"{self.paths.done_log} names page {int(cols.ordinal.max())} beyond the manifest")
            failed = cols.ordinal[~is_done]
            state[failed[state[failed] != DONE]] = FAILED_BEFORE
            state[cols.ordinal[is_done]] = DONE
            n_done += int(is_done.sum())
            if np.count_nonzero(state == DONE) != n_done:      # cheaper than np.unique on 10M records
                raise CorruptWorkspace(f"{self.paths.done_log} marks a page done twice")
            if shards:
                np.maximum.at(shard_end, cols.shard[is_done], cols.end[is_done])
            if (~is_done).any():
                errors_end = max(errors_end, int(cols.end[~is_done].max()))
            if is_done.any():
                self._last_commit = int(cols.time_ms[is_done].max()) / 1000.0
        self._pages.state = bytearray(state.tobytes())
        per_doc = np.bincount(np.frombuffer(self._pages.page_doc, dtype=np.int64)[state == DONE], minlength=len(self._pages.docs))
        for doc in self._pages.docs:
            doc.done = int(per_doc[doc.doc_id])
        self._manifest = self._open_log(self.paths.manifest, valid)
        self._done = self._open_log(self.paths.done_log, length)
        self._errors = self._open_log(self.paths.errors, errors_end)
        self._shards = [self._open_log(self.paths.shard(i, shards), int(shard_end[i])) for i in range(shards)]
        fsync_dir(self.paths.state)
        fsync_dir(self.paths.root)
        for doc in self._pages.docs:         # a crash between a document's last page and its .md
            if self._doc_complete(doc) and not (self.root / f"{doc.stem}.md").exists():
                self._write_document_markdown(doc)

    def _open_log(self, path: str, committed: int) -> AppendLog:
        """Cut ``path`` back to what done / manifest records vouch for, and append from there."""
        truncate(path, committed)
        if os.path.exists(path) and os.path.getsize(path) < committed:
            raise CorruptWorkspace(f"{path} is shorter than its committed {committed} bytes: written outside this workspace?")
        log = AppendLog(path, committed)
        self._logs.append(log)
        return log

    # ------------------------------------------------------------------ the manifest
    def _record(self, body: dict, pages: int = 0, documents: int = 0, input_errors: int = 0) -> None:
        t = self._totals
        totals = ManifestTotals(t.pages + pages, t.documents + documents, t.input_errors + input_errors)
        self._manifest.append(encode_manifest_line(totals, body))
        self._totals = totals
        self._pages.apply(body)

    @synchronized
    def add_document(self, path: str, digest: str, page_indices: list[int], page_count: int) -> int:
        """Register a document's pages (idempotent: a rerun adds nothing). Same content under
        another path is the same work: the new path is recorded for rendering, its outputs keep
        the first path's names. Returns the number of pages newly added."""
        path = str(path)
        if len(digest) < 16 or any(c not in "0123456789abcdef" for c in digest):
            raise ValueError(f"{path}: digest must be the file's lowercase hex sha256, got {digest!r}")
        bad = [i for i in page_indices if not 0 <= i < page_count]
        if bad or len(set(page_indices)) != len(page_indices):
            raise ValueError(f"{path}: page indices must be distinct and in 0..{page_count - 1}, got {sorted(page_indices)}")
        doc = self._pages.by_digest.get(digest[:16])
        if doc is None:
            body = {"doc": len(self._pages.docs), "path": path, "digest": digest, "stem": self._pages.new_stem(path, digest),
                    "page_count": page_count, "pages": ranges_of(page_indices), "first": len(self._pages.state)}
            self._record(body, pages=len(page_indices), documents=1)
            return len(page_indices)
        if doc.digest != digest:
            raise ValueError(f"{path} and {doc.path} share the page-key prefix {digest[:16]} with different contents")
        if doc.path != path:
            self._record({"path_of": doc.doc_id, "path": path})
        new = [i for i in page_indices if doc.ordinal_of(i) is None]
        if new:
            # the document's .md will cover more pages: drop the old one, it is rewritten when they finish
            (self.root / f"{doc.stem}.md").unlink(missing_ok=True)
            self._record({"pages_of": doc.doc_id, "pages": ranges_of(new), "first": len(self._pages.state)}, pages=len(new))
        return len(new)

    @synchronized
    def add_input_error(self, path: str, stage: str, message: str) -> None:
        """An input file that yields no pages (unreadable, encrypted, ...): once per path."""
        path = str(path)
        if path in self._pages.error_paths:
            return
        end = self._append_error({"file": path, "page": None, "stage": stage, "message": message})
        self._record({"input_error": path, "stage": stage, "message": message, "errors_end": end}, input_errors=1)

    # ------------------------------------------------------------------ handing out work
    @synchronized
    def work(self, key: str) -> PageWork:
        """The page behind a lease key (KeyError for a key not in the manifest)."""
        return self._pages.work(self._pages.ordinal(key))

    def _settled(self, key: str) -> bool:
        return self._pages.state[self._pages.ordinal(key)] in (DONE, FAILED_NOW)

    def _wanted(self, state: int, retry_failed: bool) -> bool:
        return state == PENDING or (retry_failed and state == FAILED_BEFORE)

    @synchronized
    def pending(self, retry_failed: bool = False) -> list[PageWork]:
        """Pages still to do, in manifest order: not done; failed ones (from earlier runs) only
        with retry_failed. O(pages): call it once, or use ``grant``."""
        return [self._pages.work(o) for o, s in enumerate(self._pages.state) if self._wanted(s, retry_failed)]

    def _scan(self, retry_failed: bool) -> Iterator[PageWork]:
        while self._cursor[retry_failed] < len(self._pages.state):
            o = self._cursor[retry_failed]
            self._cursor[retry_failed] = o + 1       # before the yield: a yielded page is consumed
            if self._wanted(self._pages.state[o], retry_failed):
                yield self._pages.work(o)

    @synchronized
    def grant(self, worker: str, max_pages: int, ttl_s: float, retry_failed: bool = False) -> Lease | None:
        """Expire overdue leases, then lease up to max_pages pages: O(pages granted), where
        ``leases.grant(worker, ws.pending(), ...)`` is O(manifest) per call."""
        self.leases.expire()
        return self.leases.grant(worker, self._scan(retry_failed), max_pages, ttl_s)

    # ------------------------------------------------------------------ committing
    def _check(self, lease: Lease, key: str) -> int:
        ordinal = self._pages.ordinal(key)
        if not self.leases.check_key(lease, key):
            raise StaleLease(f"lease {lease.lease_id} (token {lease.token}) of worker {lease.worker!r} no longer "
                             f"holds page {key}: it expired or was superseded, so its result is dropped")
        self._refuse_if_done(ordinal, key)
        return ordinal

    def _refuse_if_done(self, ordinal: int, key: str) -> None:
        # unreachable while the fence holds (a settled page leaves its lease): a second line of defence
        if self._pages.state[ordinal] == DONE:
            raise PageAlreadyDone(f"page {key} is already committed; refusing to write it twice")

    @synchronized
    def commit(self, lease: Lease, key: str, result: PageResult) -> None:
        """Write a page's outputs durably, then its done record; StaleLease / PageAlreadyDone
        before anything is written."""
        ordinal = self._check(lease, key)
        doc = self._pages.doc_of(ordinal)
        index = self._pages.page_index[ordinal]
        if result.meta.page_index != index:
            raise ValueError(f"result for page index {result.meta.page_index} committed as {key} (index {index})")
        dirs = {str(self.root)}
        for name, data in sorted(result.images.items()):
            dirs.add(os.path.dirname(self._write_output(name, data)))
        shard = start = end = 0
        if self.jsonl_shards:
            shard = shard_of(key, self.jsonl_shards)
            line = self._shard_line(key, result)
            start = self._shards[shard].length
            end = self._shards[shard].append(json_line(line))
        else:
            stem = f"{doc.stem}_{index + 1:04d}"
            if "md" in self.formats:
                self._write_output(f"{stem}.md", result.markdown.encode())
            if "json" in self.formats:
                self._write_output(f"{stem}.json", (json.dumps(result.record, ensure_ascii=False, indent=4) + "\n").encode())
        for d in sorted(dirs):
            fsync_dir(d)
        self._finish(lease, key, ordinal, DoneRecord(Outcome.DONE, ordinal, shard, start, end, self._now_ms()))
        doc.done += 1
        if self._doc_complete(doc):
            self._write_document_markdown(doc)

    def _shard_line(self, key: str, result: PageResult) -> dict:
        """A shard's line is the page's PaddleX record itself (DESIGN.md section 5: one such
        record per page), led by its key, with the Markdown and the crop names after it."""
        meta = result.meta
        if "json" in self.formats:
            record = result.record
        else:
            record = {"input_path": meta.input_path, "page_index": meta.page_index, "page_count": meta.page_count}
        extra = {"markdown": result.markdown} if "md" in self.formats else {}
        extra["images"] = sorted(result.images)
        clash = sorted(({"key"} | set(extra)) & set(record))
        if clash:
            raise ValueError(f"page record of {key} has fields {clash} that its shard line uses itself")
        return {"key": key, **record, **extra}

    @synchronized
    def fail(self, lease: Lease, key: str, stage: str, message: str) -> None:
        """Record a page that could not be parsed: an errors.jsonl line, then its failed record.
        A rerun leaves it alone unless asked to retry failed pages."""
        ordinal = self._check(lease, key)
        doc = self._pages.doc_of(ordinal)
        start = self._errors.length
        end = self._append_error({"file": doc.path, "page": self._pages.page_index[ordinal] + 1, "stage": stage,
                                  "message": message})
        self._finish(lease, key, ordinal, DoneRecord(Outcome.FAILED, ordinal, 0, start, end, self._now_ms()))

    def _finish(self, lease: Lease, key: str, ordinal: int, record: DoneRecord) -> None:
        self._done.append(encode_done_record(record))
        self._pages.state[ordinal] = DONE if record.outcome == Outcome.DONE else FAILED_NOW
        self.leases.settle(lease, key)
        if record.outcome == Outcome.DONE:
            now = record.time_ms / 1000.0
            self._last_commit = now
            self._recent.append(now)
            while self._recent and self._recent[0] < now - RATE_WINDOW_S:
                self._recent.popleft()

    def _now_ms(self) -> int:
        return int(time.time() * 1000)

    def _append_error(self, entry: dict) -> int:
        return self._errors.append(json_line(entry))

    # ------------------------------------------------------------------ output files
    def _write_output(self, name: str, data: bytes) -> str:
        rel = PurePosixPath(name)
        if rel.is_absolute() or ".." in rel.parts or not rel.parts or rel.parts[0] == ".fdparse":
            raise ValueError(f"output name {name!r} must be a relative path inside the output directory")
        path = self.root.joinpath(*rel.parts)
        path.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(str(path), data)
        return str(path)

    def _doc_complete(self, doc: Doc) -> bool:
        return (0 < doc.n_pages == doc.done and not self.jsonl_shards and "md" in self.formats)

    def _write_document_markdown(self, doc: Doc) -> None:
        from .assemble import document_markdown
        pages = [(self.root / f"{doc.stem}_{i + 1:04d}.md").read_text(encoding="utf-8") for i in doc.page_indices()]
        self._write_output(f"{doc.stem}.md", document_markdown(pages).encode())
        fsync_dir(str(self.root))

    # ------------------------------------------------------------------ status, closing
    @synchronized
    def status(self) -> WorkspaceStatus:
        counts = np.bincount(np.frombuffer(bytes(self._pages.state), dtype=np.uint8), minlength=4)
        failed = int(counts[FAILED_BEFORE] + counts[FAILED_NOW])
        return WorkspaceStatus(
            done=int(counts[DONE]), failed=failed, pending=int(counts[PENDING]),
            pages_per_s=rate_of(np.array([t * 1000 for t in self._recent], dtype=np.int64)),
            total=len(self._pages.state), documents=self._totals.documents, input_errors=self._totals.input_errors,
            last_commit_at=self._last_commit)

    @synchronized
    def close(self) -> None:
        for log in self._logs:
            log.close()
        self._logs = []
        if self._lock_fd is not None:
            os.close(self._lock_fd)      # releases the flock
            self._lock_fd = None

    def __enter__(self) -> Workspace:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
