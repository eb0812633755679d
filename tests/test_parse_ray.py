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
from .test_parse_e2e import PDFS, _start, base_args, cli, errors, outputs, run_parse, status  # noqa: E402

# the tiny models, the generated document and its single-process bytes: test_parse_e2e.py's fixtures
layout_dir, synthetic_pdf, parser, reference_run = e2e.layout_dir, e2e.synthetic_pdf, e2e.parser, e2e.reference_run


@pytest.fixture(scope="module")
def cluster():
    """The local cluster; its GCS address is what `parse --ray ADDRESS` connects to."""
    ray.init(num_cpus=4, include_dashboard=False, object_store_memory=512 * 2**20, logging_level=logging.WARNING,
             log_to_driver=False)
    try:
        yield ray.get_runtime_context().gcs_address
    finally:
        ray.shutdown()


def ray_parser(layout_dir, planted, *extra):
    """A RayDocumentParser with the options of the CLI flags (base_args + extra), in this process."""
    from fastdeploy_ext.entrypoints.cli import build_parser
    from fastdeploy_ext.entrypoints.parse_cmd import parse_options_from_args, ray_options_from_args
    from fastdeploy_ext.parsing.ray_cluster import RayDocumentParser
    ns = build_parser().parse_args(["parse", "x", "--output", "unused", *base_args(layout_dir, planted), *extra,
                                    "--ray"])
    return RayDocumentParser(parse_options_from_args(ns, output="unused"), ray_options_from_args(ns))


def run_ray(rp, inputs, out):
    rp.options = replace(rp.options, output=str(out))
    return list(rp.parse(inputs))


def test_parse_ray_gives_the_single_process_bytes(tmp_path, cluster, parser, layout_dir, synthetic_pdf):
    """The CLI with two worker actors over 31 real pages and 4 generated ones, render tasks over the
    cluster, --json-progress: every page once, the bytes of one process, both workers busy."""
    pdf, layout = synthetic_pdf
    ref = tmp_path / "ref"
    assert run_parse(parser, [PDFS, pdf], ref) == 0
    out = tmp_path / "out"
    r = cli(["parse", PDFS, pdf, "--output", out, "--ray", cluster, "--ray-num-workers", "2", "--lease-pages", "2",
             "--max-pages-in-flight", "4", "--json-progress", "--progress-interval", "60",
             *base_args(layout_dir, layout)])
    assert r.returncode == 0, r.stderr[-4000:]
    assert outputs(out) == outputs(ref)
    assert status(out) == {"done": 35, "failed": 0, "pending": 0, "input_errors": 0}
    assert {"ray-0", "ray-1"} == set(re.findall(r"-> (ray-\d)\b", r.stderr)), r.stderr[-3000:]
    assert "refused" not in r.stderr and "lost" not in r.stderr
    last = json.loads(r.stdout.splitlines()[-1])
    assert last["event"] == "done" and last["done"] == 35 and last["total"] == 35
    per_worker = dict(re.findall(r"(ray-\d) \(pid \d+ on \S+\): (\d+) pages in", r.stderr))
    assert set(per_worker) == {"ray-0", "ray-1"} and sum(map(int, per_worker.values())) == 35, r.stderr[-3000:]


def test_a_killed_worker_actor_loses_only_its_in_flight_pages(tmp_path, cluster, layout_dir, synthetic_pdf,
                                                              reference_run, caplog):
    pdf, layout = synthetic_pdf
    rp = ray_parser(layout_dir, layout, "--ray-num-workers", "2", "--lease-pages", "1", "--max-pages-in-flight", "2")
    rp.options = replace(rp.options, output=str(tmp_path / "out"))
    seen, victim = [], None
    with caplog.at_level(logging.INFO, logger="fastdeploy_ext.parsing.ray_cluster"):
        for o in rp.parse([pdf]):
            seen.append(o.key)
            if victim is None:
                held = rp.leases_held()
                name = max(held, key=held.get)               # a worker with pages in flight
                victim = next(a for a in rp.actors if a.name == name)
                os.kill(victim.info["pid"], signal.SIGKILL)
    log = caplog.text
    assert f"{victim.name} (pid {victim.info['pid']}" in log and "lost" in log, log[-3000:]
    assert re.search(rf"lease \d+ of {victim.name} ended", log), log[-3000:]    # its pages went back at once
    assert "attempt 2" in log                                                 # ...and were leased again
    assert len(seen) == len(set(seen)) == 4                                   # every page once
    assert outputs(tmp_path / "out") == reference_run
    assert status(tmp_path / "out") == {"done": 4, "failed": 0, "pending": 0, "input_errors": 0}
    assert run_ray(rp, [pdf], tmp_path / "out") == []                         # the rerun has nothing left to do


def test_the_driver_killed_mid_run_then_rerun_gives_every_page_once(tmp_path, cluster, layout_dir, synthetic_pdf,
                                                                    reference_run):
    pdf, layout = synthetic_pdf
    out = tmp_path / "out"
    proc = _start(["parse", pdf, "--output", out, "--ray", cluster, "--ray-num-workers", "2", "--lease-pages", "1",
                   "--max-pages-in-flight", "1", *base_args(layout_dir, layout)])
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
        proc.communicate(timeout=30)
    killed_at = done()
    assert 1 <= killed_at < 4, killed_at
    rp = ray_parser(layout_dir, layout, "--ray-num-workers", "2", "--lease-pages", "1")
    seen = [o.key for o in run_ray(rp, [pdf], out)]
    assert len(seen) == len(set(seen)) == 4 - killed_at              # done pages skipped, the others done once
    assert outputs(out) == reference_run
    assert status(out) == {"done": 4, "failed": 0, "pending": 0, "input_errors": 0}


def test_a_page_that_kills_every_worker_is_an_error_record_after_max_attempts(tmp_path, cluster, layout_dir,
                                                                              synthetic_pdf, monkeypatch, caplog):
    from fastdeploy_ext.parsing.ray_worker import DIE_ON_PAGE_ENV
    pdf, layout = synthetic_pdf
    monkeypatch.setenv(DIE_ON_PAGE_ENV, f"{pdf.name}:2")         # the actor's process exits when fed page 2
    rp = ray_parser(layout_dir, layout, "--ray-num-workers", "1", "--lease-pages", "1", "--max-pages-in-flight", "1",
                    "--max-attempts", "2")
    with caplog.at_level(logging.INFO, logger="fastdeploy_ext.parsing.ray_cluster"):
        outs = run_ray(rp, [pdf], tmp_path / "out")
    assert sorted(o.job.work.page_index for o in outs) == [0, 1, 2, 3]
    bad = [o for o in outs if o.error is not None]
    assert [o.job.work.page_index for o in bad] == [1] and bad[0].error.stage == "worker"
    assert [(e["page"], e["stage"]) for e in errors(tmp_path / "out")] == [(2, "worker")]
    assert "gave up after 2 attempts" in errors(tmp_path / "out")[0]["message"]
    assert status(tmp_path / "out") == {"done": 3, "failed": 1, "pending": 0, "input_errors": 0}
    assert caplog.text.count("starting ray-0.") == 2, caplog.text[-3000:]    # two deaths, two replacements


def test_bad_ray_flags_are_usage_errors(tmp_path, layout_dir, capsys):
    from fastdeploy_ext.entrypoints.cli import main
    from fastdeploy_ext.parsing.ray_cluster import RayOptions, plan_workers
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
