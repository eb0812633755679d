"""The parse workspace: exactly-once commits, resume, torn tails, leases and fencing, the lock,
the fingerprint, JSONL shards, errors.jsonl, status, and SIGKILL at random moments."""
from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
import parse_workspace_driver as driver  # noqa: E402

from fastdeploy_ext.parsing import journal  # noqa: E402
from fastdeploy_ext.parsing.leases import LeaseTable, StaleLease  # noqa: E402
from fastdeploy_ext.parsing.status import format_status, workspace_status  # noqa: E402
from fastdeploy_ext.parsing.workspace import (  # noqa: E402
    FingerprintMismatch, PageAlreadyDone, Workspace, WorkspaceLocked, page_key, shard_of,
)

FP = driver.FINGERPRINT
DRIVER = str(Path(__file__).parent / "parse_workspace_driver.py")


class Clock:
    def __init__(self):
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def open_ws(out, **kw) -> Workspace:
    kw.setdefault("fingerprint", FP)
    return Workspace.open(out, **kw)


def add_docs(ws, n_docs=2, n_pages=3) -> None:
    for path, digest, pages, count in driver.doc_inputs(n_docs, n_pages):
        ws.add_document(path, digest, pages, count)


def commit_all(ws, *, fail=lambda key: False, retry_failed=False) -> list[str]:
    keys = []
    while (lease := ws.grant("w", 2, 60, retry_failed=retry_failed)) is not None:
        for key in lease.keys:
            if fail(key):
                ws.fail(lease, key, "vlm", f"boom {key}")
            else:
                ws.commit(lease, key, driver.fake_result(ws.work(key)))
            keys.append(key)
    return keys


def tree(root: Path) -> dict[str, bytes]:
    """Every output file's bytes (the workspace's own state dir left out: it holds times and a pid)."""
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*"))
            if p.is_file() and journal.STATE_DIR not in p.parts}


def shard_keys(root: Path) -> list[str]:
    return [json.loads(line)["key"] for p in sorted(root.glob("pages-*.jsonl")) for line in p.read_text().splitlines()]


# ---------------------------------------------------------------------------------- commit / resume
def test_commit_resume_skips_done_pages(tmp_path):
    with open_ws(tmp_path) as ws:
        add_docs(ws)
        lease = ws.grant("w", 4, 60)
        assert lease.keys == tuple(w.key for w in ws.pending()[:4])
        for key in lease.keys[:3]:
            ws.commit(lease, key, driver.fake_result(ws.work(key)))
        done_keys = set(lease.keys[:3])
    with open_ws(tmp_path) as ws:           # a rerun: the same documents again, nothing new
        add_docs(ws)
        left = ws.pending()
        assert [w.key for w in left] == [w for w in (page_key(d, i) for _, d, p, _ in driver.doc_inputs(2, 3) for i in p)
                                         if w not in done_keys]
        assert ws.status().done == 3 and ws.status().pending == 3
        commit_all(ws)
        assert ws.status().done == 6


def test_outputs_named_by_stem_and_document_markdown_when_all_done(tmp_path):
    with open_ws(tmp_path) as ws:
        add_docs(ws, n_docs=2, n_pages=2)                  # /in/a/doc0.pdf and /in/b/doc0.pdf
        commit_all(ws)
    (path0, d0, _, _), (_, d1, _, _) = driver.doc_inputs(2, 2)
    other = "doc0-" + d1[:8]                               # the second doc0 gets its digest in its stem
    assert {p.name for p in tmp_path.glob("*.md")} == {
        "doc0.md", "doc0_0001.md", "doc0_0002.md", f"{other}.md", f"{other}_0001.md", f"{other}_0002.md"}
    assert {p.name for p in tmp_path.glob("*.json")} == {"doc0_0001.json", "doc0_0002.json",
                                                         f"{other}_0001.json", f"{other}_0002.json"}
    from fastdeploy_ext.parsing.assemble import document_markdown
    pages = [(tmp_path / f"doc0_000{i}.md").read_text() for i in (1, 2)]
    assert (tmp_path / "doc0.md").read_text() == document_markdown(pages)
    first = driver.fake_result(driver.PageWork(page_key(d0, 0), path0, 0, 2, "doc0"))
    assert (tmp_path / "doc0_0001.md").read_text() == first.markdown
    assert json.loads((tmp_path / "doc0_0001.json").read_text()) == first.record
    assert [(tmp_path / n).read_bytes() for n in first.images] == list(first.images.values())
    assert list(first.images) == ["imgs/doc0_0001_0.png"]


def test_failed_pages_skipped_on_rerun_and_retried_only_when_asked(tmp_path):
    with open_ws(tmp_path) as ws:
        add_docs(ws, n_docs=1, n_pages=3)
        bad = ws.pending()[1].key
        commit_all(ws, fail=lambda k: k == bad)
        assert (ws.status().done, ws.status().failed) == (2, 1)
    lines = (tmp_path / "errors.jsonl").read_text().splitlines()
    assert [json.loads(x) for x in lines] == [{"file": "/in/a/doc0.pdf", "page": 2, "stage": "vlm", "message": f"boom {bad}"}]
    assert not (tmp_path / "doc0.md").exists()        # not every page is done
    with open_ws(tmp_path) as ws:
        assert ws.pending() == [] and ws.grant("w", 8, 60) is None
        assert [w.key for w in ws.pending(retry_failed=True)] == [bad]
        # failing again in the retry run: recorded, and not handed out again in the same run
        assert commit_all(ws, fail=lambda k: True, retry_failed=True) == [bad]
        assert ws.grant("w", 8, 60, retry_failed=True) is None
    assert len((tmp_path / "errors.jsonl").read_text().splitlines()) == 2
    with open_ws(tmp_path) as ws:
        assert commit_all(ws, retry_failed=True) == [bad]
        st = ws.status()
    assert (st.done, st.failed, st.pending) == (3, 0, 0)
    assert (tmp_path / "doc0.md").exists()


def test_input_errors_recorded_once_across_reruns(tmp_path):
    for _ in range(2):
        with open_ws(tmp_path) as ws:
            ws.add_input_error("/in/enc.pdf", "input", "encrypted PDF")
    assert [json.loads(x) for x in (tmp_path / "errors.jsonl").read_text().splitlines()] == [
        {"file": "/in/enc.pdf", "page": None, "stage": "input", "message": "encrypted PDF"}]
    assert workspace_status(tmp_path).input_errors == 1


def test_bad_page_indices_and_unknown_keys_are_clear_errors(tmp_path):
    with open_ws(tmp_path) as ws:
        with pytest.raises(ValueError, match=r"doc\.pdf: page indices must be distinct and in 0\.\.2"):
            ws.add_document("/x/doc.pdf", "ab" * 32, [0, 3], 3)
        with pytest.raises(KeyError, match="not in this workspace"):
            ws.work("0123456789abcdef:0")
        assert ws.status().total == 0


def test_commit_guards_name_the_problem(tmp_path):
    with open_ws(tmp_path) as ws:
        with pytest.raises(ValueError, match="digest must be the file's lowercase hex sha256"):
            ws.add_document("/x/a.pdf", "not-hex", [0], 1)
        ws.add_document("/x/a.pdf", "ab" * 32, [0, 1], 2)
        with pytest.raises(ValueError, match="share the page-key prefix abababababababab"):
            ws.add_document("/x/b.pdf", "ab" * 8 + "cd" * 24, [0], 1)
        lease = ws.grant("w", 2, 60)
        first, second = (ws.work(k) for k in lease.keys)
        with pytest.raises(ValueError, match="result for page index 1 committed as abababababababab:0"):
            ws.commit(lease, first.key, driver.fake_result(second))
        bad = driver.fake_result(first)
        bad.images = {"../escape.png": b"x"}
        with pytest.raises(ValueError, match="'../escape.png' must be a relative path inside the output"):
            ws.commit(lease, first.key, bad)
        ws.commit(lease, first.key, driver.fake_result(first))   # nothing half-done blocks a good commit
        assert ws.status().done == 1 and not (tmp_path.parent / "escape.png").exists()


def test_a_failed_append_leaves_no_partial_record(tmp_path, monkeypatch):
    """Disk full mid-commit: the partial shard line is cut off, the page stays open, and the
    retried commit's line and offsets are exact."""
    ref, out = tmp_path / "ref", tmp_path / "out"
    _run_uninterrupted(ref, jsonl_shards=1)
    with open_ws(out, jsonl_shards=1) as ws:
        add_docs(ws)
        lease = ws.grant("w", 6, 60)
        real_fsync = os.fsync
        calls = {"n": 0}

        def fsync_fails_once(fd):          # on the shard's append, after its bytes were written
            if os.readlink(f"/proc/self/fd/{fd}").endswith(".jsonl") and not calls["n"]:
                calls["n"] += 1
                assert os.fstat(fd).st_size > 0
                raise OSError(28, "No space left on device")
            real_fsync(fd)

        monkeypatch.setattr(os, "fsync", fsync_fails_once)
        with pytest.raises(OSError, match="No space left"):
            ws.commit(lease, lease.keys[0], driver.fake_result(ws.work(lease.keys[0])))
        assert calls["n"] == 1 and (out / "pages-00000-of-00001.jsonl").stat().st_size == 0
        for key in lease.keys:
            ws.commit(lease, key, driver.fake_result(ws.work(key)))
    with open_ws(out, jsonl_shards=1) as ws:
        assert ws.pending() == []
    assert tree(out) == tree(ref)


def test_manifest_records_that_disagree_are_refused(tmp_path):
    with open_ws(tmp_path) as ws:
        add_docs(ws, n_docs=1, n_pages=2)
    manifest = tmp_path / journal.STATE_DIR / "manifest.log"
    line = manifest.read_bytes()
    _, body = journal.decode_manifest_line(line)
    manifest.write_bytes(journal.encode_manifest_line(journal.ManifestTotals(5, 1, 0), body))
    with pytest.raises(journal.CorruptWorkspace, match="totals say 5 pages, records add up to 2"):
        open_ws(tmp_path)
    manifest.write_bytes(journal.encode_manifest_line(journal.ManifestTotals(2, 1, 0), {**body, "first": 3}))
    with pytest.raises(journal.CorruptWorkspace, match="start at 3, expected 0"):
        open_ws(tmp_path)
    (tmp_path / journal.STATE_DIR / "workspace.json").unlink()
    with pytest.raises(FingerprintMismatch, match="workspace.json is missing but a manifest exists"):
        open_ws(tmp_path)


# ---------------------------------------------------------------------------------- torn tails
def _run_uninterrupted(out, **kw):
    with open_ws(out, **kw) as ws:
        add_docs(ws)
        commit_all(ws)


@pytest.mark.parametrize("shards", [None, 2])
def test_torn_done_log_tail_redone_once(tmp_path, shards):
    ref, cut = tmp_path / "ref", tmp_path / "cut"
    _run_uninterrupted(ref, jsonl_shards=shards)
    _run_uninterrupted(cut, jsonl_shards=shards)
    done_log = cut / journal.STATE_DIR / "done.log"
    size = done_log.stat().st_size
    os.truncate(done_log, size - journal.DONE_RECORD_SIZE - 20)     # last record gone, the one before torn
    assert workspace_status(cut).done == 4                          # a reader ignores the torn record
    with open_ws(cut, jsonl_shards=shards) as ws:
        assert len(ws.pending()) == 2
        assert done_log.stat().st_size == size - 2 * journal.DONE_RECORD_SIZE
        commit_all(ws)
    assert tree(cut) == tree(ref)
    if shards:
        assert sorted(shard_keys(cut)) == sorted(set(shard_keys(cut))) and len(shard_keys(cut)) == 6


def test_garbage_done_record_of_full_size_is_dropped(tmp_path):
    _run_uninterrupted(tmp_path)
    done_log = tmp_path / journal.STATE_DIR / "done.log"
    data = bytearray(done_log.read_bytes())
    data[-10] ^= 0x01                                              # the CRC no longer matches
    done_log.write_bytes(bytes(data))
    with open_ws(tmp_path) as ws:
        assert len(ws.pending()) == 1


def test_uncommitted_shard_lines_cut_on_open(tmp_path):
    ref, out = tmp_path / "ref", tmp_path / "out"
    _run_uninterrupted(ref, jsonl_shards=2)
    with open_ws(out, jsonl_shards=2) as ws:
        add_docs(ws)
        lease = ws.grant("w", 6, 60)
        for key in lease.keys[:4]:
            ws.commit(lease, key, driver.fake_result(ws.work(key)))
        # a crash after a 5th page's line reached its shard, before its done record: a whole line
        # and a torn one behind it
        fifth = lease.keys[4]
        shard = out / f"pages-{shard_of(fifth, 2):05d}-of-00002.jsonl"
        committed = shard.stat().st_size
        with open(shard, "ab") as f:
            f.write(json.dumps({"key": fifth}).encode() + b"\n{\"key\": \"tor")
    with open_ws(out, jsonl_shards=2) as ws:
        assert shard.stat().st_size == committed
        commit_all(ws)
    assert tree(out) == tree(ref)
    assert sorted(shard_keys(out)) == sorted(set(shard_keys(out)))


def test_uncommitted_errors_line_cut_on_open(tmp_path):
    with open_ws(tmp_path) as ws:
        add_docs(ws, n_docs=1, n_pages=2)
        commit_all(ws, fail=lambda k: True)
    errors = tmp_path / "errors.jsonl"
    good = errors.read_bytes()
    errors.write_bytes(good + b'{"file": "/in/a/doc0.pdf", "pa')
    with open_ws(tmp_path):
        pass
    assert errors.read_bytes() == good


def test_torn_manifest_tail_truncated_and_document_added_again(tmp_path):
    ref, tmp_path = tmp_path / "ref", tmp_path / "out"
    with open_ws(tmp_path) as ws:
        add_docs(ws, n_docs=2, n_pages=3)
    manifest = tmp_path / journal.STATE_DIR / "manifest.log"
    first_line = manifest.read_bytes().split(b"\n")[0] + b"\n"
    os.truncate(manifest, len(first_line) + 30)
    st = workspace_status(tmp_path)
    assert (st.total, st.documents) == (3, 1)
    with open_ws(tmp_path) as ws:
        assert manifest.read_bytes() == first_line
        assert ws.status().total == 3
        add_docs(ws, n_docs=2, n_pages=3)
        assert ws.status().total == 6
        commit_all(ws)
    _run_uninterrupted(ref)
    assert tree(tmp_path) == tree(ref)
    assert (tmp_path / journal.STATE_DIR / "manifest.log").read_bytes() == (ref / journal.STATE_DIR / "manifest.log").read_bytes()


@pytest.mark.parametrize("chunk", [7, 64, 1 << 16])
def test_manifest_totals_read_backwards_in_any_chunk_size(tmp_path, chunk):
    with open_ws(tmp_path) as ws:
        add_docs(ws, n_docs=3, n_pages=2)
        ws.add_input_error("/in/x.pdf", "input", "x" * 300)          # a line longer than the small chunks
    manifest = str(tmp_path / journal.STATE_DIR / "manifest.log")
    assert journal.manifest_totals(manifest, chunk) == journal.ManifestTotals(6, 3, 1)
    size = os.path.getsize(manifest)
    os.truncate(manifest, size - 5)                                  # the long line torn
    assert journal.manifest_totals(manifest, chunk) == journal.ManifestTotals(6, 3, 0)
    with open(manifest, "r+b") as f:                                 # only a torn first line left
        f.truncate(40)
    assert journal.manifest_totals(manifest, chunk) == journal.ManifestTotals()


def test_damage_before_valid_manifest_records_is_refused(tmp_path):
    with open_ws(tmp_path) as ws:
        add_docs(ws, n_docs=3, n_pages=1)
    manifest = tmp_path / journal.STATE_DIR / "manifest.log"
    data = bytearray(manifest.read_bytes())
    data[40] ^= 0x01
    manifest.write_bytes(bytes(data))
    with pytest.raises(journal.CorruptWorkspace, match="valid records follow"):
        open_ws(tmp_path)


def test_done_log_naming_a_page_twice_or_beyond_the_manifest_is_refused(tmp_path):
    _run_uninterrupted(tmp_path)
    done_log = tmp_path / journal.STATE_DIR / "done.log"
    good = done_log.read_bytes()
    done_log.write_bytes(good + good[:journal.DONE_RECORD_SIZE])
    with pytest.raises(journal.CorruptWorkspace, match="marks a page done twice"):
        open_ws(tmp_path)
    beyond = journal.DoneRecord(journal.Outcome.DONE, 6, 0, 0, 0, 1)
    done_log.write_bytes(good + journal.encode_done_record(beyond))
    with pytest.raises(journal.CorruptWorkspace, match="names page 6 beyond the manifest"):
        open_ws(tmp_path)


# ---------------------------------------------------------------------------------- leases
def test_stale_lease_expired_or_superseded(tmp_path):
    clock = Clock()
    with open_ws(tmp_path, clock=clock) as ws:
        add_docs(ws, n_docs=1, n_pages=2)
        a = ws.grant("a", 2, ttl_s=10)
        clock.t += 5
        a = ws.leases.renew(a)                     # renewed: expires 10 s from now
        clock.t += 9
        ws.commit(a, a.keys[0], driver.fake_result(ws.work(a.keys[0])))
        clock.t += 2                               # expired: its open page is refused
        with pytest.raises(StaleLease, match="expired or was superseded"):
            ws.commit(a, a.keys[1], driver.fake_result(ws.work(a.keys[1])))
        b = ws.grant("b", 2, ttl_s=10)             # superseded: the page is b's now
        assert b.keys == (a.keys[1],) and b.token > a.token and b.attempt == 2
        with pytest.raises(StaleLease):
            ws.commit(a, a.keys[1], driver.fake_result(ws.work(a.keys[1])))
        with pytest.raises(StaleLease):
            ws.leases.renew(a)
        ws.commit(b, b.keys[0], driver.fake_result(ws.work(b.keys[0])))
        with pytest.raises(StaleLease):            # after b's commit a is still refused
            ws.commit(a, a.keys[1], driver.fake_result(ws.work(a.keys[1])))
        assert ws.status().done == 2 and ws.leases.active == []


def test_fencing_check_is_what_refuses_the_zombie(tmp_path, monkeypatch):
    """Break the fence on purpose: the zombie's late result lands instead of the live lease's;
    with the done guard behind it broken too, the page is written twice."""
    def zombie_then_live(out):
        clock = Clock()
        with open_ws(out, clock=clock, jsonl_shards=1) as ws:
            add_docs(ws, n_docs=1, n_pages=1)
            zombie = ws.grant("zombie", 1, ttl_s=10)
            clock.t += 11                              # the zombie stalls past its expiry...
            live = ws.grant("live", 1, ttl_s=10)       # ...its page is leased again...
            key = live.keys[0]
            outcomes = []
            for lease in (zombie, live):               # ...and the zombie wakes up first
                try:
                    ws.commit(lease, key, driver.fake_result(ws.work(key), " " + lease.worker))
                    outcomes.append("written")
                except (StaleLease, PageAlreadyDone) as e:
                    outcomes.append(type(e).__name__)
        return outcomes, (out / "pages-00000-of-00001.jsonl").read_text().splitlines()

    outcomes, lines = zombie_then_live(tmp_path / "fenced")
    assert outcomes == ["StaleLease", "written"] and len(lines) == 1 and " live" in lines[0]
    monkeypatch.setattr(LeaseTable, "check_key", lambda self, lease, key: True)
    real_settle = LeaseTable.settle
    monkeypatch.setattr(LeaseTable, "settle", lambda self, lease, key: lease.lease_id in self._held and real_settle(self, lease, key))
    outcomes, lines = zombie_then_live(tmp_path / "unfenced")
    assert outcomes == ["written", "PageAlreadyDone"] and len(lines) == 1 and " zombie" in lines[0]
    monkeypatch.setattr(Workspace, "_refuse_if_done", lambda self, ordinal, key: None)
    outcomes, lines = zombie_then_live(tmp_path / "unguarded")
    assert outcomes == ["written", "written"] and len(lines) == 2      # the double write
    assert json.loads(lines[0])["key"] == json.loads(lines[1])["key"]


def test_done_guard_refuses_a_second_commit_when_the_fence_is_off(tmp_path, monkeypatch):
    monkeypatch.setattr(LeaseTable, "check_key", lambda self, lease, key: True)
    monkeypatch.setattr(LeaseTable, "settle", lambda self, lease, key: None)
    with open_ws(tmp_path, jsonl_shards=1) as ws:
        add_docs(ws, n_docs=1, n_pages=1)
        lease = ws.grant("w", 1, 60)
        key = lease.keys[0]
        ws.commit(lease, key, driver.fake_result(ws.work(key)))
        with pytest.raises(PageAlreadyDone, match="refusing to write it twice"):
            ws.commit(lease, key, driver.fake_result(ws.work(key)))
    assert len((tmp_path / "pages-00000-of-00001.jsonl").read_text().splitlines()) == 1


def test_lease_table_returns_expired_pages_first_and_counts_attempts():
    clock = Clock()
    table = LeaseTable(clock=clock)
    pages = [driver.PageWork(f"{i:016x}:0", f"/p{i}", 0, 1) for i in range(5)]
    a = table.grant("a", pages, 2, 5)
    b = table.grant("b", pages, 2, 50)
    assert (a.keys, b.keys) == ((pages[0].key, pages[1].key), (pages[2].key, pages[3].key))
    clock.t += 6
    assert table.expire() == [a]
    c = table.grant("c", pages, 3, 5)
    assert c.keys == (pages[0].key, pages[1].key, pages[4].key) and c.attempt == 2
    assert not table.check(a) and table.check(b) and table.check_key(c, pages[4].key)
    assert not table.check_key(b, pages[0].key)
    assert table.grant("d", pages, 3, 5) is None
    table.settle(b, pages[2].key)
    clock.t += 100                                   # b and c expire; pages[2] was settled under b
    assert {lease.lease_id for lease in table.expire()} == {b.lease_id, c.lease_id}
    d = table.grant("d", pages, 5, 5)
    assert sorted(d.keys) == sorted(p.key for p in pages if p is not pages[2])
    with pytest.raises(ValueError, match="max_pages >= 1"):
        table.grant("e", pages, 0, 5)


def test_every_durable_append_happens_under_the_workspace_lock(tmp_path, monkeypatch):
    """Writer and granting threads may share a Workspace: each log append (offsets included)
    must run under its lock. Threads committing concurrently then give one valid line per page."""
    import threading
    from fastdeploy_ext.parsing import durable
    ws = open_ws(tmp_path, jsonl_shards=2)
    real_append = durable.AppendLog.append
    unlocked = []
    monkeypatch.setattr(durable.AppendLog, "append",
                        lambda self, data: (unlocked.append(self.path) if not ws._lock._is_owned() else None,
                                            real_append(self, data))[1])
    add_docs(ws, n_docs=4, n_pages=5)

    def worker(name):
        while (lease := ws.grant(name, 2, 60)) is not None:
            for key in lease.keys:
                ws.commit(lease, key, driver.fake_result(ws.work(key)))

    threads = [threading.Thread(target=worker, args=(f"t{i}",)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    ws.close()
    assert unlocked == []
    keys = shard_keys(tmp_path)
    assert len(keys) == len(set(keys)) == 20 and workspace_status(tmp_path).done == 20
    # and the check sees an unlocked append when there is one
    log = durable.AppendLog(str(tmp_path / "scratch"), 0)
    log.append(b"x")
    log.close()
    assert unlocked == [str(tmp_path / "scratch")]


# ---------------------------------------------------------------------------------- lock, fingerprint
def test_second_coordinator_refused_naming_the_holder(tmp_path):
    with open_ws(tmp_path):
        with pytest.raises(WorkspaceLocked, match=rf"in use by another parse coordinator \(pid {os.getpid()}\)"):
            open_ws(tmp_path)
        r = subprocess.run([sys.executable, DRIVER, str(tmp_path)], capture_output=True, text=True, timeout=120)
        assert r.returncode != 0 and f"pid {os.getpid()}" in r.stderr
    with open_ws(tmp_path):                  # released on close
        pass


def test_other_fingerprint_refused_with_how_to_proceed(tmp_path):
    with open_ws(tmp_path) as ws:
        add_docs(ws, n_docs=1, n_pages=1)
    with pytest.raises(FingerprintMismatch, match=r"dpi: 144 -> 200.*another --output directory, or delete"):
        open_ws(tmp_path, fingerprint={**FP, "dpi": 200})
    with pytest.raises(FingerprintMismatch, match=r"jsonl_shards: None -> 4"):
        open_ws(tmp_path, jsonl_shards=4)
    with open_ws(tmp_path, fingerprint=dict(reversed(list(FP.items())))):      # key order is no change
        pass


# ---------------------------------------------------------------------------------- shards, status
def test_jsonl_shards_one_line_per_page_in_the_keys_shard(tmp_path):
    with open_ws(tmp_path, jsonl_shards=3, formats=frozenset({"md"})) as ws:
        add_docs(ws, n_docs=2, n_pages=4)
        keys = commit_all(ws)
    assert sorted(p.name for p in tmp_path.glob("pages-*.jsonl")) == [f"pages-0000{i}-of-00003.jsonl" for i in range(3)]
    assert not list(tmp_path.glob("*.md"))
    seen = {}
    for i in range(3):
        for line in (tmp_path / f"pages-0000{i}-of-00003.jsonl").read_text().splitlines():
            rec = json.loads(line)
            seen[rec["key"]] = (i, rec)
    assert sorted(seen) == sorted(keys) and len(keys) == 8
    for key, (i, rec) in seen.items():
        want = driver.fake_result(ws.work(key))
        assert i == shard_of(key, 3)
        assert rec == {"key": key, "input_path": want.meta.input_path, "page_index": want.meta.page_index,
                       "page_count": want.meta.page_count, "markdown": want.markdown, "images": sorted(want.images)}


def test_jsonl_shard_line_is_the_paddlex_record_with_key_markdown_and_images(tmp_path):
    with open_ws(tmp_path, jsonl_shards=1) as ws:
        add_docs(ws, n_docs=1, n_pages=1)
        (key,) = commit_all(ws)
        want = driver.fake_result(ws.work(key))
        line = (tmp_path / "pages-00000-of-00001.jsonl").read_bytes()
        assert list(json.loads(line)) == ["key", *want.record, "markdown", "images"]
        assert json.loads(line) == {"key": key, **want.record, "markdown": want.markdown, "images": sorted(want.images)}
    with open_ws(tmp_path / "clash", jsonl_shards=1) as ws:
        add_docs(ws, n_docs=1, n_pages=1)
        lease = ws.grant("w", 1, 60)
        bad = driver.fake_result(ws.work(lease.keys[0]))
        bad.record["markdown"] = "x"
        with pytest.raises(ValueError, match=r"has fields \['markdown'\] that its shard line uses itself"):
            ws.commit(lease, lease.keys[0], bad)


def test_status_counts_from_files_match_the_workspace(tmp_path):
    with open_ws(tmp_path) as ws:
        add_docs(ws, n_docs=3, n_pages=4)
        ws.add_input_error("/in/x.pdf", "input", "empty file")
        lease = ws.grant("w", 7, 60)
        for key in lease.keys[:5]:
            ws.commit(lease, key, driver.fake_result(ws.work(key)))
        for key in lease.keys[5:]:
            ws.fail(lease, key, "render", "timeout")
        live = ws.status()
        st = workspace_status(tmp_path)           # while the coordinator holds the lock
    assert (st.done, st.failed, st.pending, st.total, st.documents, st.input_errors) == (5, 2, 5, 12, 3, 1)
    assert (live.done, live.failed, live.pending, live.total) == (5, 2, 5, 12)
    assert st.last_commit_at is not None and st.pages_per_s >= 0
    assert format_status(st).splitlines()[0] == "pages: 5 done, 2 failed, 5 pending of 12 (41.7 % done)"
    assert json.loads(format_status(st, json=True))["pending"] == 5
    assert format_status(st, as_json=True) == format_status(st, json=True)
    with pytest.raises(FileNotFoundError, match="is not a parse workspace"):
        workspace_status(tmp_path / "nowhere")


@pytest.mark.parametrize("chunk", [3, 1 << 20])
def test_status_rate_is_over_the_last_minute_of_commits(tmp_path, monkeypatch, chunk):
    import functools
    from fastdeploy_ext.parsing import status
    with open_ws(tmp_path) as ws:
        ws.add_document("/in/a.pdf", "ab" * 32, list(range(30)), 30)
    t_end = 1_800_000_000_000
    times = [t_end - 10_000_000 + i * 1_000_000 for i in range(5)]          # long ago: outside the window
    times += [t_end - 1000 + i * 100 for i in range(11)]                      # 11 commits in the last second
    records = [journal.DoneRecord(journal.Outcome.DONE, i, 0, 0, 0, t) for i, t in enumerate(times)]
    records.insert(8, journal.DoneRecord(journal.Outcome.FAILED, 29, 0, 0, 0, t_end - 500))  # no rate
    (tmp_path / journal.STATE_DIR / "done.log").write_bytes(b"".join(map(journal.encode_done_record, records)))
    monkeypatch.setattr(status, "iter_done_columns", functools.partial(journal.iter_done_columns, chunk_records=chunk))
    st = workspace_status(tmp_path)
    assert (st.done, st.failed, st.pending) == (16, 1, 13)
    assert st.pages_per_s == pytest.approx(10.0) and st.last_commit_at == t_end / 1000
    assert format_status(st).splitlines()[2] == (
        "rate: 10.00 pages/s over the last 60 s of commits (last commit 2027-01-15 08:00:00 UTC)")


def test_status_decodes_many_records_in_chunks(tmp_path, monkeypatch):
    """The numpy decoder across chunk boundaries, against the per-record decoder."""
    _run_uninterrupted(tmp_path)
    log = str(tmp_path / journal.STATE_DIR / "done.log")
    want = [journal.decode_done_record(r) for r in _records(log)]
    got = [(chr(o), int(n), int(s), int(a), int(b), int(t)) for c in journal.iter_done_columns(log, chunk_records=4)
           for o, n, s, a, b, t in zip(c.outcome, c.ordinal, c.shard, c.start, c.end, c.time_ms)]
    assert got == [(w.outcome.decode(), w.ordinal, w.shard, w.start, w.end, w.time_ms) for w in want]


def test_status_scale_script_builds_a_valid_workspace(tmp_path, capsys):
    """ci/parse_status_scale.py at a small size: its column-built records are the workspace's own
    (it checks a sample), status counts what it planted, and a coordinator resumes from it."""
    sys.path.insert(0, str(Path(__file__).parent.parent / "ci"))
    import parse_status_scale
    assert parse_status_scale.main(["--pages", "3000", "--docs", "30", "--open", "--keep", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "pages: 2,730 done, 120 failed, 150 pending of 3,000 (91.0 % done)" in out
    assert "status 2,730 done" in out


def _records(path):
    data = Path(path).read_bytes()
    return [data[i:i + journal.DONE_RECORD_SIZE] for i in range(0, len(data), journal.DONE_RECORD_SIZE)]


# ---------------------------------------------------------------------------------- SIGKILL
@pytest.mark.parametrize("shards", [None, 3])
@pytest.mark.parametrize("sleep_ms", [6, 0])     # 0: the kills land inside commits (fsyncs) nearly always
def test_sigkill_at_random_moments_then_rerun_gives_each_page_once(tmp_path, shards, sleep_ms):
    n_docs, n_pages = 4, 8
    args = ["--docs", str(n_docs), "--pages", str(n_pages), "--sleep-ms", str(sleep_ms)] + (["--shards", str(shards)] if shards else [])
    ref, out = tmp_path / "ref", tmp_path / "out"
    subprocess.run([sys.executable, DRIVER, str(ref), *args], check=True, capture_output=True, timeout=120)
    rng = random.Random(1234 + (shards or 0) + sleep_ms)
    kills = 0
    for _ in range(4):
        proc = subprocess.Popen([sys.executable, DRIVER, str(out), *args], stdout=subprocess.PIPE, text=True)
        wait_commits = rng.randint(0, 4)
        for _ in range(wait_commits):              # let it get somewhere, then kill mid-stride
            if not proc.stdout.readline().startswith("commit"):
                break
        time.sleep(rng.random() * 0.01)
        os.kill(proc.pid, signal.SIGKILL)
        kills += proc.wait(timeout=60) == -signal.SIGKILL
        proc.stdout.close()
    assert kills >= 3
    r = subprocess.run([sys.executable, DRIVER, str(out), *args], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "ALL DONE" in r.stdout
    assert tree(out) == tree(ref)
    ref_manifest = (ref / journal.STATE_DIR / "manifest.log").read_bytes()
    assert (out / journal.STATE_DIR / "manifest.log").read_bytes() == ref_manifest
    errors = (out / "errors.jsonl").read_text().splitlines()
    n_failed = sum(driver.fails(page_key(d, i)) for _, d, p, _ in driver.doc_inputs(n_docs, n_pages) for i in p)
    assert n_failed > 0 and len(errors) == len(set(errors)) == 1 + n_failed
    if shards:
        keys = shard_keys(out)
        assert len(keys) == len(set(keys)) == n_docs * n_pages - n_failed
    st = workspace_status(out)
    assert (st.done, st.failed, st.pending) == (n_docs * n_pages - n_failed, n_failed, 0)
