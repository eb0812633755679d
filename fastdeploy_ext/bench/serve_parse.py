"""`bench serve --workloads parse`: document parsing through our server's job API (PaddleOCR's
protocol, plain requests) against the in-process `bench parse` on the same pages, in one run.

The pages: one synthetic PDF of ``--parse-pages`` pages (parsing/synthetic.py), posted as
``--parse-jobs`` documents; the in-process side parses the same bytes (that many copies of the
PDF, ``bench parse --pdf``). Both sides use the same planted block mix per page (bench parse's
``--pdf`` mix: the layout model runs for its cost, the planted boxes are used) and, with random
VLM weights, each block decodes its kind's planted length (ignore_eos), so they do the same work.
The in-process side runs first, in its own process, and exits before our server starts: the
device never holds both.

The served figure is timed by the server's clock: pages / (last job finished - first job
started), from the timestamps each job's status carries (the client's polling does not enter
it). A 2-page warm-up job runs first (as bench parse's warm-up pages). ``--parse-concurrency``
bounds the jobs posted and not finished (default: all at once; the server runs
``--max-running-jobs`` of them together, the rest queue there). ``--parse-args`` go to both sides
(parse and engine flags: ``--max-pages-in-flight``, ``--render-workers``, ``--max-num-seqs``...),
``--server-args`` to the server only. Nothing here asserts a time."""
from __future__ import annotations

import argparse
import json
import logging
import os
import shlex
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from . import BenchError

log = logging.getLogger(__name__)

#: any token: the client refuses an empty one, our server checks it only with --api-key
TOKEN = "bench"
API = "/api/v2/ocr"


@dataclass(frozen=True)
class ParseWorkload:
    jobs: int = 8
    pages: int = 250
    concurrency: int | None = None          # jobs posted and not finished at once (None: all)
    layout_model: str | None = None         # None: random layout weights
    parse_args: tuple[str, ...] = ()        # to both sides
    seed: int = 0
    poll_s: float = 0.5
    in_process_pages: int | None = None     # the in-process side's pages (None: every job's)


def add_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("--workloads parse (the job API vs the in-process bench parse)")
    g.add_argument("--parse-jobs", type=int, default=8, metavar="N", help="documents posted (default 8)")
    g.add_argument("--parse-pages", type=int, default=250, metavar="P", help="synthetic pages per document (default 250)")
    g.add_argument("--parse-concurrency", type=int, default=None, metavar="C",
                   help="documents posted and not finished at once (default: all of them)")
    g.add_argument("--layout-model", default=None, metavar="DIR", help="layout detector dir (default: random weights)")
    g.add_argument("--parse-args", default="", metavar="ARGS",
                   help='parse and engine flags for both sides, one string, e.g. "--max-pages-in-flight 32 '
                        '--render-workers 8 --max-num-seqs 128"')
    g.add_argument("--parse-seed", type=int, default=0, help="the synthetic pages' seed")
    g.add_argument("--parse-in-process-pages", type=int, default=None, metavar="N",
                   help="the in-process side parses the first N of those pages (default: all jobs' pages); both "
                        "figures are steady rates, and fewer pages here keep one device call under its limit")


def workload_from_args(ns) -> ParseWorkload:
    for name in ("parse_jobs", "parse_pages"):
        if getattr(ns, name) < 1:
            raise BenchError(f"--{name.replace('_', '-')} must be >= 1")
    for name in ("parse_concurrency", "parse_in_process_pages"):
        if getattr(ns, name) is not None and getattr(ns, name) < 1:
            raise BenchError(f"--{name.replace('_', '-')} must be >= 1")
    if ns.layout_model is not None and not Path(ns.layout_model).is_dir():
        raise BenchError(f"--layout-model {ns.layout_model}: not a directory")
    return ParseWorkload(jobs=ns.parse_jobs, pages=ns.parse_pages, concurrency=ns.parse_concurrency,
                         layout_model=ns.layout_model, parse_args=tuple(shlex.split(ns.parse_args)),
                         seed=ns.parse_seed, in_process_pages=ns.parse_in_process_pages)


# ------------------------------------------------------------------ the two sides
def common_flags(o, w: ParseWorkload) -> list[str]:
    """The model, device and parse flags both sides take."""
    src = ["--load-format", "dummy"] if o.load_format == "dummy" else ["--model", o.model, "--load-format",
                                                                        o.load_format]
    layout = ["--layout-model", w.layout_model] if w.layout_model else ["--layout-load-format", "dummy"]
    return [*src, "--device", o.device, "--dtype", o.dtype, *layout, *w.parse_args]


def in_process_pages(w: ParseWorkload) -> int:
    return min(w.in_process_pages or w.jobs * w.pages, w.jobs * w.pages)


def run_in_process(o, w: ParseWorkload, docs: Path, log_path: str) -> dict:
    """`bench parse --pdf DOCS` in its own process (ours only): its report's "ours" side."""
    cmd = [sys.executable, "-m", "fastdeploy_ext.entrypoints.cli", "bench", "parse", "--pdf", str(docs), "--pages",
           str(in_process_pages(w)), "--seed", str(w.seed), "--no-baseline", "--json", *common_flags(o, w)]
    log.info("in-process: %s (log %s)", " ".join(cmd), log_path)
    with open(log_path, "wb") as err:
        proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=err, timeout=None)
    lines = [ln for ln in proc.stdout.decode(errors="replace").splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        raise BenchError(f"in-process bench parse exited with {proc.returncode}; see {log_path}")
    report = json.loads(lines[-1])
    return {**report["ours"], "source": report["source"]}


class JobClient:
    """The job API by plain requests: submit by upload, status, the JSON Lines result."""

    def __init__(self, url: str):
        import requests
        self.url, self.http = url, requests.Session()
        self.http.headers["Authorization"] = f"Bearer {TOKEN}"

    def submit(self, pdf: bytes, name: str) -> str:
        r = self.http.post(self.url + API + "/jobs", files={"file": (name, pdf, "application/pdf")},
                           data={"model": "PaddleOCR-VL-1.6", "optionalPayload": "{}"}, timeout=600)
        body = r.json()
        if r.status_code != 200 or body.get("code") != 0:
            raise BenchError(f"submit: HTTP {r.status_code}: {body.get('msg')}")
        return body["data"]["jobId"]

    def status(self, job_id: str) -> dict:
        r = self.http.get(f"{self.url}{API}/jobs/{job_id}", timeout=60)
        r.raise_for_status()
        return r.json()["data"]

    def result_lines(self, data: dict) -> list[dict]:
        r = self.http.get(data["resultUrl"]["jsonUrl"], timeout=600)
        r.raise_for_status()
        return [json.loads(x) for x in r.text.splitlines() if x.strip()]


def run_jobs(client: JobClient, pdf: bytes, jobs: int, concurrency: int, poll_s: float) -> list[dict]:
    """``jobs`` posts of ``pdf``, at most ``concurrency`` unfinished at once: each job's final
    status, in the order posted."""
    waiting = list(range(jobs))
    active: dict[str, int] = {}
    done: dict[int, dict] = {}
    while waiting or active:
        while waiting and len(active) < concurrency:
            i = waiting.pop(0)
            active[client.submit(pdf, f"doc_{i:02d}.pdf")] = i
        time.sleep(poll_s)
        for job_id in list(active):
            st = client.status(job_id)
            if st["state"] in ("done", "failed"):
                done[active.pop(job_id)] = st
    return [done[i] for i in range(jobs)]


def served_summary(client: JobClient, statuses: list[dict], client_wall: float) -> dict:
    """Pages/s by the server's clock: every page of the jobs over first start -> last finish."""
    pages = failed = 0
    errors: list[str] = []
    for st in statuses:
        if st["state"] != "done":
            failed += st.get("extractProgress", {}).get("totalPages", 0) or 1
            errors.append(st.get("errorMsg") or st["state"])
            continue
        for line in client.result_lines(st):
            for item in line["result"]["layoutParsingResults"]:
                if "error" in item:
                    failed += 1
                    errors.append(f"{item['error']['stage']}: {item['error']['message']}")
                else:
                    pages += 1
    stamps = [st["timestamps"] for st in statuses]
    t0 = min(s["started"] for s in stamps if s["started"] is not None)
    t1 = max(s["finished"] for s in stamps if s["finished"] is not None)
    wall = t1 - t0
    return {"name": "served", "jobs": len(statuses), "pages": pages, "failed": failed, "wall_s": round(wall, 3),
            "pages_per_s": pages / wall if wall > 0 else None, "client_wall_s": round(client_wall, 3),
            "queue_s_max": round(max(s["started"] - s["created"] for s in stamps if s["started"]), 3),
            "errors": sorted(set(errors))[:5]}


def run_parse_bench(o, log_dir: str) -> dict:
    from ..parsing.synthetic import synthetic_document
    from .parse import real_inputs
    from .server_proc import Server
    w: ParseWorkload = o.parse
    report = {"workload": "parse", "device": o.device, "dtype": o.dtype, "model": o.model or "dummy",
              "layout_model": w.layout_model or "dummy", "jobs": w.jobs, "pages_per_job": w.pages,
              "concurrency": w.concurrency or w.jobs, "in_process_pages": in_process_pages(w), "parse_args": list(w.parse_args),
              "server_args": list(o.server_args), "workloads": {}}
    with tempfile.TemporaryDirectory(prefix="fdx-bench-serve-parse-") as tmp:
        root = Path(tmp)
        docs = root / "docs"
        docs.mkdir()
        t0 = time.perf_counter()
        pdf = synthetic_document(w.pages, w.seed, processes=max(1, min(8, os.cpu_count() or 1))).pdf
        for i in range(w.jobs):                  # the in-process side's copies of the same bytes
            (docs / f"doc_{i:02d}.pdf").write_bytes(pdf)
        warmup = synthetic_document(2, w.seed + 1).pdf
        _, planted = real_inputs(root, str(docs), w.seed)     # the planted mix both sides use
        log.info("bench serve parse: %d documents of %d pages written in %.1f s", w.jobs, w.pages,
                 time.perf_counter() - t0)
        in_process = None
        if o.reference:
            in_process = run_in_process(o, w, docs, os.path.join(log_dir, "bench_serve_parse_in_process.log"))
            log.info("in-process: %s", json.dumps(in_process))
        cmd = [sys.executable, "-m", "fastdeploy_ext.entrypoints.openai.api_server", *common_flags(o, w), "--host",
               "127.0.0.1", "--jobs-dir", str(root / "jobs"), "--planted-layouts", str(planted),
               *o.server_args]
        srv = Server("ours", cmd, os.path.join(log_dir, "bench_serve_parse_server.log"))
        try:
            srv.wait_healthy(o.startup_timeout)
            client = JobClient(srv.url)
            warm = run_jobs(client, warmup, 1, 1, 0.1)
            if warm[0]["state"] != "done":
                raise BenchError(f"the warm-up job failed: {warm[0].get('errorMsg')}; see {srv.log_path}")
            c0 = time.perf_counter()
            statuses = run_jobs(client, pdf, w.jobs, w.concurrency or w.jobs, w.poll_s)
            served = served_summary(client, statuses, time.perf_counter() - c0)
        finally:
            srv.stop()
    entry = {"ours": served}
    if in_process is not None:
        entry["in_process"] = in_process
        if served["pages_per_s"] and in_process.get("pages_per_s"):
            entry["ratio_served_over_in_process"] = served["pages_per_s"] / in_process["pages_per_s"]
    report["workloads"]["parse"] = entry
    return report


def print_parse_report(report: dict) -> None:
    print(f"bench serve parse: device {report['device']} dtype {report['dtype']} model {report['model']} layout "
          f"{report['layout_model']}: {report['jobs']} documents x {report['pages_per_job']} pages, "
          f"{report['concurrency']} posted at once")
    r = report["workloads"]["parse"]
    s = r["ours"]
    print(f"  served (job API, server clock): {s['pages_per_s'] or 0:.2f} pages/s ({s['pages']} pages, {s['failed']} "
          f"failed, {s['wall_s']:.1f} s first start -> last finish; client {s['client_wall_s']:.1f} s)")
    ip = r.get("in_process")
    if ip is not None:
        print(f"  in-process (bench parse):       {ip['pages_per_s']:.2f} pages/s ({ip['pages']} pages, "
              f"{ip['failed']} failed, {ip['wall_s']:.1f} s)")
    if "ratio_served_over_in_process" in r:
        print(f"  served / in-process: {r['ratio_served_over_in_process']:.3f}")
    for e in s["errors"] + (ip or {}).get("errors", []):
        print(f"  error: {e}")
