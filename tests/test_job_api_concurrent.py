"""Several jobs at once through the real server and paddleocr's own client: each job gets its own
pages, the jobs' pages are committed interleaved (read from each job's done log, the
workspace's per-page commit times), and /metrics shows the jobs running, their pages and blocks
in flight and the page rate while they run, and the exact counts once they are done."""
from __future__ import annotations

import re
import time

import httpx
import pytest

from fastdeploy_ext.parsing.journal import WorkspacePaths, iter_done_columns

from .server_harness import ServerProc
from .test_job_api import PDFS, TOKEN, check_pages, client, pdf_pages, server_args
from .test_job_api import api, models  # noqa: F401 - the fixtures

DOCS = ("lots_of_sci_tables.pdf", "skinnypage.pdf", "earnings.pdf")
GAUGES = ("jobs_running", "jobs_pending", "job_pages_in_flight", "job_blocks_in_flight", "job_pages_per_second",
          "job_rendering", "job_layout_queue", "job_write_queue")


def scrape(srv) -> dict[str, float]:
    text = httpx.get(srv.url + "/metrics", timeout=10).text
    return {m.group(1): float(m.group(2)) for m in re.finditer(r"^fastdeploy_ext:(\S+?) (\S+)$", text, re.M)}


def commit_times_ms(jobs_dir, job_id) -> list[int]:
    paths = WorkspacePaths(str(jobs_dir / job_id / "ws"))
    return sorted(int(t) for cols in iter_done_columns(paths.done_log, fields=("time_ms",)) for t in cols.time_ms)


def test_jobs_submitted_together_run_interleaved_with_their_own_results_and_metrics(api, models, tmp_path):  # noqa: F811
    pages = [pdf_pages(PDFS / d) for d in DOCS]
    assert pages == [6, 2, 1]
    jobs_dir = tmp_path / "jobs"
    srv = ServerProc(*server_args(models, jobs_dir)).wait_healthy()
    try:
        before = scrape(srv)
        assert {k: before[k] for k in GAUGES} == dict.fromkeys(GAUGES, 0.0)
        assert before["job_pages_in_flight_limit"] == 64.0          # 4 x --max-pages-in-flight (16)
        with client(api, srv) as c:
            jobs = [c.submit_document_parsing(file_path=str(PDFS / d)) for d in DOCS]
            peak = dict.fromkeys(GAUGES, 0.0)
            while True:                       # /metrics while the jobs run: the largest value seen
                m = scrape(srv)
                for k in GAUGES:
                    peak[k] = max(peak[k], m[k])
                if m["jobs_done_total"] + m["jobs_failed_total"] == len(DOCS):
                    break
                time.sleep(0.02)
            results = [c.wait_document_parsing_result(j) for j in jobs]
        after = scrape(srv)
        stamps = [httpx.get(f"{srv.url}/api/v2/ocr/jobs/{j.job_id}", headers={"Authorization": f"Bearer {TOKEN}"},
                            timeout=10).json()["data"]["timestamps"] for j in jobs]
    finally:
        srv.stop()
    for r, n in zip(results, pages):
        check_pages(r, n, pdf=True)
        assert [p.pruned_result["page_index"] for p in r.pages] == list(range(n))
        assert len({p.pruned_result["input_path"] for p in r.pages}) == 1
    # the default --max-running-jobs (4) runs all three at once, within the server's page budget
    assert peak["jobs_running"] == 3 and peak["job_pages_in_flight"] <= 64
    for k in ("job_pages_in_flight", "job_blocks_in_flight", "job_pages_per_second"):
        assert peak[k] > 0, (k, peak)
    # once done: exact counts, nothing left in flight
    assert (after["jobs_submitted_total"], after["jobs_done_total"], after["jobs_failed_total"]) == (3, 3, 0)
    assert after["job_pages_total"] == sum(pages)
    for k in GAUGES:
        if k != "job_pages_per_second":           # the rate's window still holds the pages just done
            assert after[k] == 0, (k, after)
    # the jobs' pages were processed at the same time: each job started (the server's clock)
    # before every other job's last page was committed (the done log's per-page times); one job
    # after another, a job would start only after the previous one's last commit
    times = [commit_times_ms(jobs_dir, j.job_id) for j in jobs]
    assert [len(t) for t in times] == pages
    for st in stamps:
        assert st["created"] <= st["started"] <= st["finished"], st
    for i, st in enumerate(stamps):
        for k, last in enumerate(t[-1] for t in times):
            if k != i:
                assert st["started"] * 1000 < last, (i, k, stamps, times)


def test_kill_9_with_several_jobs_running_resumes_each_and_every_page_is_done_once(api, models, tmp_path,  # noqa: F811
                                                                                   monkeypatch):
    from fastdeploy_ext.parsing.status import workspace_status

    from . import server_harness
    # two pages in flight per job (8 across them): a job's pages complete a few at a time, not in
    # one burst at the step that decodes them all, so a poll sees a job part done
    docs = ("lots_of_sci_tables.pdf", "pdftotext_two_column_issue.pdf")
    pages = [pdf_pages(PDFS / d) for d in docs]
    jobs_dir = tmp_path / "jobs"
    flags = ("--max-pages-in-flight", "2")
    first = ServerProc(*server_args(models, jobs_dir, *flags)).wait_healthy()
    try:
        with client(api, first) as c:
            jobs = [c.submit_document_parsing(file_path=str(PDFS / d)) for d in docs]
            seen = []
            while True:                      # both running, one of them part done: kill
                st = [c.get_status(j.job_id) for j in jobs]
                seen.append([(s.state, s.progress.extracted_pages if s.progress else None) for s in st])
                assert all(s.state in ("pending", "running") for s in st), f"a job ended before the kill: {seen}"
                if all(s.state == "running" for s in st) and any(s.progress.extracted_pages >= 1 for s in st):
                    break
                time.sleep(0.05)
            done_at_kill = [s.progress.extracted_pages for s in st]
            first.proc.kill()
            first.proc.wait()
            # the client's poller does not retry: the connection error reaches the caller
            with pytest.raises(api.errors.NetworkError):
                c.wait_document_parsing_result(jobs[0])
            monkeypatch.setattr(server_harness, "free_port", lambda: first.port)   # the client's URL
            second = ServerProc(*server_args(models, jobs_dir, *flags)).wait_healthy()
            try:
                results = [c.wait_document_parsing_result(j.job_id) for j in jobs]
            finally:
                second.stop()
    finally:
        first.stop()
    for j, r, n in zip(jobs, results, pages):
        check_pages(r, n, pdf=True)
        st = workspace_status(jobs_dir / j.job_id / "ws")
        assert (st.done, st.failed, st.pending) == (n, 0, 0)
    # each job was resumed from its done pages, not redone: at most what was not done at the last poll
    for j, n, done in zip(jobs, pages, done_at_kill):
        todo = [int(x) for x in re.findall(rf"jobs: {j.job_id} running: {n} pages, (\d+) to do", second.output)]
        assert len(todo) == 1 and todo[0] <= n - done, (done_at_kill, second.output[-3000:])
    assert sum(done_at_kill) >= 1
