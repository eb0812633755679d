"""`parse --ray` on a local Ray cluster (ray.init in this process: 4 CPUs, no dashboard, a 512 MiB
object store) with the tiny models of test_parse_e2e.py: the real PDFs of ../shared/pdfs plus the
generated document give the bytes of the single-process run; a worker actor killed mid-run
loses only its in-flight pages (handed out again); the driver killed mid-run and rerun gives
every page once; a page that kills its worker every time is an error record after --max-attempts.

Ray is the optional [ray] extra: without it these tests skip (the cpu/ray CI leg installs it in
its own environment and fails if they skip; cpu/unit leaves this file to that leg).
"""
from __future__ import annotations

import json
import logging
import os
import re
import signal
import time
from dataclasses import replace

import pytest

ray = pytest.importorskip("ray", reason="parse --ray needs the [ray] extra (pip install ray==2.60.0); "
                                        "the cpu/ray CI leg installs it")

from . import test_parse_e2e as e2e  # noqa: E402
from .test_parse_e2e import PDFS, _start, base_args, errors, outputs, run_parse, status  # noqa: E402

# the tiny models, the generated document and its single-process bytes: test_parse_e2e.py's fixtures
layout_dir, synthetic_pdf, parser, reference_run = e2e.layout_dir, e2e.synthetic_pdf, e2e.parser, e2e.reference_run


#: the in-process runs' actors exit when fed this page (ray_worker.DIE_ON_PAGE_ENV, through the job's runtime_env)
POISON = "poison.pdf:1"


@pytest.fixture(scope="module")
def cluster():
    """The local cluster; its GCS address is what `parse --ray ADDRESS` connects to (another job:
    the fault injection of this process's job is not set there)."""
    from fastdeploy_ext.parsing.ray_worker import DIE_ON_PAGE_ENV
    ray.init(num_cpus=4, include_dashboard=False, object_store_memory=512 * 2**20, logging_level=logging.WARNING,
             log_to_driver=False, runtime_env={"env_vars": {DIE_ON_PAGE_ENV: POISON}})
    try:
        yield ray.get_runtime_context().gcs_address
    finally:
        ray.shutdown()


@pytest.fixture(scope="module")
def rp(cluster, layout_dir, synthetic_pdf):
    """A RayDocumentParser in this process with two worker actors (kept between its runs), one page
    per lease, two pages in flight per worker, --max-attempts 2: the CLI flags of base_args."""
    from fastdeploy_ext.entrypoints.cli import build_parser
    from fastdeploy_ext.entrypoints.parse_cmd import parse_options_from_args, ray_options_from_args
    from fastdeploy_ext.parsing.ray_cluster import RayDocumentParser
    ns = build_parser().parse_args(["parse", "x", "--output", "unused", *base_args(layout_dir, synthetic_pdf[1]),
                                    "--ray-num-workers", "2", "--lease-pages", "1", "--max-pages-in-flight", "2",
                                    "--max-attempts", "2", "--ray"])
    with RayDocumentParser(parse_options_from_args(ns, output="unused"), ray_options_from_args(ns)) as p:
        yield p


def run_ray(rp, inputs, out, on_outcome=None) -> list:
    rp.options = replace(rp.options, output=str(out))
    seen = []
    for o in rp.parse(inputs):
        seen.append(o)
        if on_outcome is not None:
            on_outcome(o)
    return seen


def test_parse_ray_gives_the_single_process_bytes(tmp_path, parser, rp, synthetic_pdf, caplog):
    """Two worker actors over the 31 real pages and the 4 generated ones, rendered as tasks over
    the cluster: every page once, the bytes of one process, both workers busy, their rates logged."""
    pdf = synthetic_pdf[0]
    ref = tmp_path / "ref"
    assert run_parse(parser, [PDFS, pdf], ref) == 0
    out = tmp_path / "out"
    with caplog.at_level(logging.INFO, logger="fastdeploy_ext.parsing.ray_cluster"):
        seen = [o.key for o in run_ray(rp, [PDFS, pdf], out)]
    log = caplog.text
    assert len(seen) == len(set(seen)) == 35
    assert outputs(out) == outputs(ref)
    assert status(out) == {"done": 35, "failed": 0, "pending": 0, "input_errors": 0}
    assert "refused" not in log and "lost" not in log and "expired" not in log, log[-3000:]
    assert "rendering: Ray tasks over the cluster (2 CPUs beside the workers)" in log
    per_worker = dict(re.findall(r"(ray-\d) \(pid \d+ on \S+\): (\d+) pages in", log))
    assert set(per_worker) == {"ray-0", "ray-1"} and sum(map(int, per_worker.values())) == 35, log[-3000:]
    assert all(int(n) > 0 for n in per_worker.values())


class _KillOnGrant(logging.Handler):
    """SIGKILLs the worker actor that the ``nth`` lease goes to, as the driver logs the grant: the
    pages of that worker's leases have just started (rendering), none of them is committed."""

    def __init__(self, rp, nth: int):
        super().__init__(logging.INFO)
        self.rp, self.nth, self.victim = rp, nth, None

    def emit(self, record):
        m = re.match(r"parse --ray: lease (\d+) \(token \d+, attempt 1, \d+ pages\) -> (\S+)$", record.getMessage())
        if m and int(m.group(1)) == self.nth and self.victim is None:
            self.victim = next(a for a in self.rp.actors if a.name == m.group(2))
            os.kill(self.victim.info["pid"], signal.SIGKILL)


def test_a_killed_worker_actor_loses_only_its_in_flight_pages(tmp_path, rp, synthetic_pdf, reference_run, caplog):
    """SIGKILL of a worker actor as its second lease goes out (two pages in flight): its leases
    end at once, their pages are leased again (attempt 2) and every page is done once."""
    pdf = synthetic_pdf[0]
    out = tmp_path / "out"
    killer = _KillOnGrant(rp, nth=4)            # 4 pages, one per lease, two per worker: the last grant
    logger = logging.getLogger("fastdeploy_ext.parsing.ray_cluster")
    logger.addHandler(killer)
    try:
        with caplog.at_level(logging.INFO, logger=logger.name):
            seen = [o.key for o in run_ray(rp, [pdf], out)]
    finally:
        logger.removeHandler(killer)
    v, log = killer.victim, caplog.text
    assert v is not None, log[-3000:]
    assert f"{v.name} (pid {v.info['pid']} on" in log and "lost" in log, log[-3000:]
    ended = [int(n) for n in re.findall(rf"lease \d+ of {re.escape(v.name)} ended \((\d+) pages", log)]
    assert sum(ended) >= 1, log[-3000:]                                          # its pages went back at once
    assert len(re.findall(r"attempt 2, 1 pages\) -> ray-", log)) == sum(ended), log[-3000:]   # ...leased again
    assert len(seen) == len(set(seen)) == 4                                      # every page once
    assert outputs(out) == reference_run
    assert status(out) == {"done": 4, "failed": 0, "pending": 0, "input_errors": 0}
    assert run_ray(rp, [pdf], out) == []                                         # a rerun has nothing left


def test_the_driver_killed_mid_run_then_rerun_gives_every_page_once(tmp_path, cluster, rp, layout_dir, synthetic_pdf,
                                                                    reference_run):
    """`parse --ray ADDRESS` (the CLI, --json-progress) SIGKILLed after its first commit (its
    actors die with its job); the rerun (this process's parser, same options) does the rest once,
    with the bytes of one process."""
    pdf, layout = synthetic_pdf
    out = tmp_path / "out"
    proc = _start(["parse", pdf, "--output", out, "--ray", cluster, "--ray-num-workers", "1", "--lease-pages", "1",
                   "--max-pages-in-flight", "1", "--json-progress", "--progress-interval", "0.2",
                   *base_args(layout_dir, layout)])
    deadline = time.monotonic() + 150

    def done() -> int:
        try:
            return status(out)["done"]
        except (OSError, ValueError):      # the workspace is not created yet
            return 0
    try:
        while done() < 1 and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)               # the test watches the workspace; the driver itself never polls
        assert proc.poll() is None, "the run ended before it could be killed: " + proc.communicate()[1][-3000:]
    finally:
        proc.send_signal(signal.SIGKILL)   # anywhere: maybe inside the next page's commit
        stdout, stderr = proc.communicate(timeout=30)
    killed_at = done()
    assert 1 <= killed_at < 4, killed_at
    assert re.search(r"parse --ray: ray-0 up \(pid \d+", stderr), stderr[-3000:]
    progress = [json.loads(line) for line in stdout.splitlines()]       # the cluster's progress, one bar
    assert progress and {p["event"] for p in progress} == {"progress"} and {p["total"] for p in progress} == {4}
    seen = [o.key for o in run_ray(rp, [pdf], out)]
    assert len(seen) == len(set(seen)) == 4 - killed_at              # done pages skipped, the others done once
    assert outputs(out) == reference_run
    assert status(out) == {"done": 4, "failed": 0, "pending": 0, "input_errors": 0}


def test_a_page_that_kills_every_worker_is_an_error_record_after_max_attempts(tmp_path, rp, caplog):
    """poison.pdf's first page makes each worker fed it exit (POISON): with --max-attempts 2 the
    page is granted twice, both workers die (and are replaced), the third grant records it as
    failed (stage "worker"); the document's other page is done."""
    from fastdeploy_ext.parsing.synthetic import synthetic_document
    pdf = tmp_path / POISON.split(":")[0]
    pdf.write_bytes(synthetic_document(2, seed=11).pdf)
    out = tmp_path / "out"
    with caplog.at_level(logging.INFO, logger="fastdeploy_ext.parsing.ray_cluster"):
        outs = run_ray(rp, [pdf], out)
    assert sorted(o.job.work.page_index for o in outs) == [0, 1]
    bad = [o for o in outs if o.error is not None]
    assert [o.job.work.page_index for o in bad] == [0] and bad[0].error.stage == "worker"
    errs = errors(out)
    assert [(e["page"], e["stage"]) for e in errs] == [(1, "worker")]
    assert "gave up after 2 attempts" in errs[0]["message"]
    assert status(out) == {"done": 1, "failed": 1, "pending": 0, "input_errors": 0}
    assert len(re.findall(r"starting ray-\d\.\d+ in its place", caplog.text)) == 2, caplog.text[-3000:]


def closed_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_head_address_where_nothing_answers_is_a_usage_error_not_a_hang(tmp_path, layout_dir):
    """In a process without a Ray session (this module's tests share one, which `parse --ray`
    then uses as it is): the address is checked before ray.init, which would retry it for minutes."""
    import subprocess
    import sys
    pdf = next(PDFS.glob("*.pdf"))
    port = closed_port()
    out = subprocess.run([sys.executable, "-m", "fastdeploy_ext.entrypoints.cli", "parse", str(pdf), "--ray",
                          f"127.0.0.1:{port}", "--output", str(tmp_path / "o"), *base_args(layout_dir)],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2, out.stderr[-2000:]
    assert f"--ray 127.0.0.1:{port}: nothing answers there" in out.stderr
    assert not (tmp_path / "o").exists()


def test_bad_ray_flags_are_usage_errors(tmp_path, layout_dir, capsys):
    from fastdeploy_ext.entrypoints.cli import main
    from fastdeploy_ext.parsing.ray_cluster import RayOptions, plan_render, plan_workers
    pdf = next(PDFS.glob("*.pdf"))
    for bad, what in ((["--ray", str(pdf), str(pdf)], "as the cluster address"),
                      ([str(pdf), "--ray", "--ray-num-workers", "0"], "--ray-num-workers must be >= 1"),
                      ([str(pdf), "--ray", "--ray-num-workers", "many"], "'many': a number or auto"),
                      ([str(pdf), "--ray", "--max-attempts", "0"], "--max-attempts must be >= 1"),
                      ([str(pdf), "--ray", "--workers", "2"], "drop --workers")):
        assert main(["parse", *bad, "--output", str(tmp_path / "o"), *base_args(layout_dir)]) == 2
        err = capsys.readouterr().err
        assert what in err, err[-1000:]
    assert not (tmp_path / "o").exists()
    # the plan: a GPU per worker where there are GPUs, CPU workers with --device cpu, a clear refusal
    per, n = plan_workers(RayOptions(), "auto", {"CPU": 64, "GPU": 8}, 2)
    assert (per.value, n.value) == (1.0, 8)
    per, n = plan_workers(RayOptions(), "cpu", {"CPU": 64, "GPU": 8}, 2)
    assert (per.value, n.value) == (0.0, 2) and "one CPU worker per node" in n.reason
    with pytest.raises(ValueError, match="each worker needs 1 GPUs .* the cluster has 0"):
        plan_workers(RayOptions(gpus_per_worker=1), "auto", {"CPU": 4}, 1)
    # render tasks need a CPU the workers leave free, else they would wait forever
    assert plan_render("tasks", {"CPU": 4}, 2).value == "tasks"
    lone = plan_render("tasks", {"CPU": 2}, 2)
    assert lone.value == "actor" and "none is left for render tasks" in lone.reason
    assert plan_render("actor", {"CPU": 64}, 2).value == "actor"


def test_an_actors_runs_are_told_apart_so_nothing_of_one_is_taken_for_the_next():
    """ParseWorker's run ids (no Ray, no models: a pipeline that returns each page as it comes):
    a feed or take of another run is dropped, results of an ended run never reach the next one,
    and the feeder's want is said once per need."""
    import threading

    from fastdeploy_ext.parsing.pipeline import PageOutcome
    from fastdeploy_ext.parsing.ray_worker import ParseWorker
    from fastdeploy_ext.parsing.workspace import PageWork

    class EchoPipeline:
        def run(self, jobs):
            for job in jobs:
                yield PageOutcome(job, result=f"page {job.work.page_index}")

    w = ParseWorker.__new__(ParseWorker)             # the actor's state without its models
    w.name, w.pipe, w._busy, w._die_on = "t", EchoPipeline(), None, None
    w._cond, w._run_id, w._thread = threading.Condition(), 0, None
    w._reset()
    page = lambda i: PageWork(f"k{i}", "doc.pdf", i, 9, stem="doc")      # noqa: E731
    w.begin(1)
    assert w.take(1, 5.0)["want"] is True and w.take(1, 0.05)["want"] is False    # said once
    w.feed(0, "lease-0", [page(0)])                   # a feed of another run: dropped
    w.feed(1, "lease-1", [page(1)])
    got = w.take(1, 5.0)
    while not got["results"]:
        got = w.take(1, 5.0)
    assert [(m[0], m[1], m[2].page_index, m[3]) for m in got["results"]] == [("commit", "lease-1", 1, "page 1")]
    assert w.take(0, 0.01) == {"run": -1, "results": [], "want": False, "busy": None, "finished": False,
                               "error": None}        # a take of an ended run gets nothing
    w.feed(1, "lease-1", [page(2)])
    w.begin(2)                                        # run 1 ends (its page 2 may finish: it stays in run 1)
    assert w.take(1, 0.01)["run"] == -1
    w.feed(2, "lease-2", [page(3)])
    seen = []
    while not seen or seen[-1][1] != "lease-2":
        seen += w.take(2, 5.0)["results"]
    assert [m[1] for m in seen] == ["lease-2"]        # nothing of run 1 in run 2
    w.stop()
    w._thread.join(5)
    assert w.take(2, 1.0)["finished"] is True
