"""ci/matrix.yaml and ci/run_matrix.py: the matrix is well formed and within its time budgets,
and the runner reports what happened — a failing, skipping or hung leg fails the run, a leg
whose device is absent is listed with the reason, every leg gets a JUnit file."""
from __future__ import annotations

import sys
import textwrap
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "ci"))
import run_matrix  # noqa: E402


def test_the_matrix_covers_every_device_within_budget():
    m = run_matrix.load_matrix()
    assert {leg.device for leg in m.legs} == set(run_matrix.DEVICES)
    active = [leg for leg in m.legs if not leg.pending]
    ci = sum(leg.budgets["ci"] for leg in active if "ci" in leg.hosts)
    gpu = sum(leg.budgets["gpu"] for leg in active if "gpu" in leg.hosts)
    # budgets are per-leg caps (a leg over its own is flagged); the ci legs run in CI_JOBS lanes,
    # largest first: the lanes must end within the run's wall budget (27 min: ~22 measured + margin)
    wall = run_matrix.lane_makespan([leg.budgets["ci"] for leg in active if "ci" in leg.hosts], run_matrix.CI_JOBS)
    assert wall <= m.cpu_budget_total_s <= 27 * 60, f"CI legs end after {wall:.0f}s in {run_matrix.CI_JOBS} lanes ({ci}s in legs)"
    assert gpu <= m.gpu_budget_total_s <= 10 * 60, f"GPU legs budget {gpu}s"
    # each device runs the conformance suite on some host; the suite also runs without transformers
    assert {leg.device for leg in active if leg.runs == "conformance"} == set(run_matrix.DEVICES)
    assert any(leg.block_transformers and leg.runs == "conformance" for leg in m.legs)
    # graphs on/off only where they exist; both halves of the cuda pair are there
    assert {leg.plan.get("graphs") for leg in active if leg.device == "cuda" and leg.runs == "encode"} >= {"on", "off"}
    assert {leg.plan.get("decode_graphs") for leg in active if leg.device == "cuda" and leg.runs == "generate"} >= {"on", "off"}
    # FD_ENABLE_MAX_PREFILL: both admission modes through generate, on the CI machine and on cuda
    for device in ("cpu", "cuda"):
        modes = {leg.env.get("FD_ENABLE_MAX_PREFILL") for leg in active if leg.device == device and leg.runs == "generate"}
        assert modes == {"0", "1"}, (device, modes)
    assert all(leg.allow_skips is False for leg in active if leg.runs in ("conformance", "encode", "paddle", "oot"))


def test_a_conformance_leg_names_its_family_and_only_conformance_legs_may(tmp_path):
    """The DeepSeek-OCR-2 leg runs the suite with --fdx-family; `family` elsewhere is an error."""
    m = run_matrix.load_matrix()
    ds = next(leg for leg in m.legs if leg.name == "cpu/deepseek-ocr2")
    args = run_matrix.RUNS[ds.runs].args(ds, m)
    assert args[args.index("--fdx-family") + 1] == "deepseek_ocr2" and "--pyargs" in args
    bad = _write(tmp_path, "cpu_budget_total_s: 600\ngpu_budget_total_s: 60\nlegs:\n"
                 + leg("cpu/x", more=", family: deepseek_ocr2"))
    with pytest.raises(run_matrix.MatrixError, match="leg cpu/x: `family` is the conformance suite's --fdx-family"):
        run_matrix.load_matrix(bad)
    # its emulated and cpu_amx-sim legs on the CI box run the core suite (--fdx-suite core)
    for name in ("cpu/deepseek-ocr2[cpu_amx,avx2-only-sim]", "metax-emulated/deepseek-ocr2"):
        other = next(leg for leg in m.legs if leg.name == name)
        args = run_matrix.RUNS[other.runs].args(other, m)
        assert args[args.index("--fdx-family") + 1] == "deepseek_ocr2", name
        assert args[args.index("--fdx-suite") + 1] == "core", name
    assert "--fdx-suite" not in args_of(ds, m)
    for more, runs in ((", suite: core", "unit"), (", suite: quick", "conformance")):
        bad = _write(tmp_path, "cpu_budget_total_s: 600\ngpu_budget_total_s: 60\nlegs:\n" + leg("cpu/x", more=more))
        if runs == "conformance":
            bad.write_text(bad.read_text().replace("runs: unit, paths: [" + str(tmp_path) + "/test_pass.py]",
                                                   "runs: conformance, backend: cpu"))
        with pytest.raises(run_matrix.MatrixError, match="leg cpu/x: `suite` is the conformance suite's --fdx-suite"):
            run_matrix.load_matrix(bad)


def args_of(leg, m):
    return run_matrix.RUNS[leg.runs].args(leg, m)


def _write(tmp_path: Path, matrix: str) -> Path:
    (tmp_path / "test_pass.py").write_text("def test_ok():\n    assert 1 + 1 == 2\n")
    (tmp_path / "test_fail.py").write_text("def test_bad():\n    assert 1 + 1 == 3\n")
    (tmp_path / "test_skip.py").write_text("import pytest\n\ndef test_s():\n    pytest.skip('no device')\n")
    (tmp_path / "test_hang.py").write_text("import time\n\ndef test_h():\n    time.sleep(60)\n")
    path = tmp_path / "matrix.yaml"
    path.write_text(textwrap.dedent(matrix).replace("TMP", str(tmp_path)))
    return path


LEG = "  - {{name: {name}, device: {device}, runs: unit, paths: [TMP/{file}], hosts: [{hosts}], budget_s: {budget}{more}}}\n"


def leg(name, file="test_pass.py", device="cpu", hosts="ci", budget=60, more=""):
    return LEG.format(name=name, file=file, device=device, hosts=hosts, budget=budget, more=more)


def test_failures_skips_and_absent_devices_are_reported(tmp_path, capsys):
    matrix = _write(tmp_path, "cpu_budget_total_s: 600\ngpu_budget_total_s: 60\nlegs:\n"
                    + leg("good") + leg("bad", "test_fail.py") + leg("skips", "test_skip.py")
                    + leg("skips-allowed", "test_skip.py", more=", allow_skips: true")
                    + leg("gpu-only", device="cuda", hosts="gpu")
                    + leg("slot", more=", pending: not built yet"))
    out = tmp_path / "junit"
    rc = run_matrix.main(["--matrix", str(matrix), "--junit-dir", str(out)])
    table = capsys.readouterr().out.split("leg ", 1)[1]
    assert rc == 1
    rows = {line.split()[0]: line for line in table.splitlines()[2:] if line.strip() and not line[0].isdigit()}
    assert rows["good"].split()[3] == "PASS" and rows["skips-allowed"].split()[3] == "PASS"
    assert rows["bad"].split()[3] == "FAIL" and "pytest exit status 1" in rows["bad"]
    assert rows["skips"].split()[3] == "FAIL" and "skips are not coverage" in rows["skips"]
    assert rows["gpu-only"].split()[3] == "NOT-RUN" and "--gpu" in rows["gpu-only"]
    assert rows["slot"].split()[3] == "PENDING" and "not built yet" in rows["slot"]
    for name in ("good", "bad", "skips", "skips-allowed", "gpu-only", "slot"):
        suite = ET.parse(out / f"{name}.xml").getroot()
        suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
        assert int(suite.get("tests")) >= 1, name
    not_run = ET.parse(out / "gpu-only.xml").getroot()
    assert "--gpu" in not_run.find("testcase/skipped").get("message")
    assert (out / "matrix_table.txt").read_text().startswith("leg ")

    # the same matrix without the failing legs is green; --archive packs the JUnit files
    matrix = _write(tmp_path, "cpu_budget_total_s: 600\ngpu_budget_total_s: 60\nlegs:\n"
                    + leg("good") + leg("gpu-only", device="cuda", hosts="gpu"))
    assert run_matrix.main(["--matrix", str(matrix), "--junit-dir", str(out), "--archive", str(tmp_path / "a.tgz")]) == 0
    import tarfile
    with tarfile.open(tmp_path / "a.tgz") as tar:
        assert {"matrix/good.xml", "matrix/gpu-only.xml", "matrix/good.log"} <= set(tar.getnames())


def test_a_failed_legs_tail_names_the_failures_even_under_a_long_skip_list():
    log = "\n".join(["..F.."] + ["FAILED tests/test_x.py::test_one - AssertionError",
                                   "ERROR tests/test_y.py::test_two - RuntimeError"]
                     + [f"SKIPPED [1] tests/test_s.py:{i}: no GPU" for i in range(40)]
                     + ["1 failed, 1 error, 40 skipped in 1.0s"])
    tail = run_matrix.failure_tail(log)
    assert tail[:2] == ["FAILED tests/test_x.py::test_one - AssertionError",
                        "ERROR tests/test_y.py::test_two - RuntimeError"]
    assert tail[-1] == "1 failed, 1 error, 40 skipped in 1.0s" and len(tail) == 2 + 25
    # a plain last-25-lines tail would have lost both
    assert not any(ln.startswith(("FAILED", "ERROR")) for ln in log.splitlines()[-25:])


def test_a_hung_leg_is_killed_and_fails(tmp_path, capsys):
    matrix = _write(tmp_path, "cpu_budget_total_s: 60\ngpu_budget_total_s: 60\nlegs:\n" + leg("hang", "test_hang.py", budget=1))
    assert run_matrix.main(["--matrix", str(matrix), "--junit-dir", str(tmp_path / "j")]) == 1
    assert "killed as hung" in capsys.readouterr().out
    assert ET.parse(tmp_path / "j" / "hang.xml").getroot().find("testcase/error") is not None


@pytest.mark.parametrize("field, bad, message", [
    ("device", "tpu", "device must be one of"),
    ("runs", "benchmark", "runs must be one of"),
    ("hosts", "[laptop]", "hosts must be"),
    ("budget_s", "0", "budget_s must be"),
    ("budget_s", "{ci: 10, gpu: 10}", "one per host"),
    ("plan", "{graphs: 'on'}", "graphs on/off is a cuda-only variant"),
    ("plan", "{decode_graphs: 'off'}", "graphs on/off is a cuda-only variant"),
    ("colour", "red", "unknown field"),
])
def test_malformed_matrix_is_a_clear_error(tmp_path, capsys, field, bad, message):
    d = {"name": "x", "device": "cpu", "runs": "unit", "paths": "[TMP/test_pass.py]", "hosts": "[ci]", "budget_s": "60"}
    d[field] = bad
    body = ", ".join(f"{k}: {v}" for k, v in d.items())
    matrix = _write(tmp_path, f"cpu_budget_total_s: 60\ngpu_budget_total_s: 60\nlegs:\n  - {{{body}}}\n")
    assert run_matrix.main(["--matrix", str(matrix), "--list"]) == 2
    assert message in capsys.readouterr().err


def test_a_required_device_that_is_absent_fails_the_run(tmp_path, capsys, monkeypatch):
    """On the GPU host `--require cuda` turns "no cuda here" from a listed leg into a failure, so a
    broken CUDA setup cannot pass the GPU leg by running nothing."""
    monkeypatch.setattr(run_matrix, "device_here", lambda d: (d != "cuda", f"no {d} (test)"))
    matrix = _write(tmp_path, "cpu_budget_total_s: 60\ngpu_budget_total_s: 60\nlegs:\n"
                    + leg("cuda-leg", device="cuda", hosts="gpu"))
    args = ["--matrix", str(matrix), "--junit-dir", str(tmp_path / "j"), "--gpu"]
    assert run_matrix.main(args) == 0                                # listed, not run
    assert run_matrix.main(args + ["--require", "cuda"]) == 1        # required: a failure
    assert "required here, but no cuda (test)" in capsys.readouterr().out


def test_the_deadline_stops_the_run_and_still_reports(tmp_path, capsys):
    """The GPU call has a hard limit: past --deadline-s the running leg is stopped and the rest
    fail as not started, but the table and the archive are written."""
    matrix = _write(tmp_path, "cpu_budget_total_s: 600\ngpu_budget_total_s: 60\nlegs:\n"
                    + leg("slow", "test_hang.py", budget=100) + leg("after"))
    out = tmp_path / "j"
    # one lane, as on the GPU host (--gpu): with two the second leg would start beside the first
    assert run_matrix.main(["--matrix", str(matrix), "--junit-dir", str(out), "--deadline-s", "8", "--jobs", "1",
                            "--archive", str(tmp_path / "a.tgz")]) == 1
    text = capsys.readouterr().out
    assert "deadline-s was reached" in text and "not started" in text
    assert (tmp_path / "a.tgz").is_file() and (out / "after.xml").is_file()


def test_lane_makespan_packs_largest_first():
    assert run_matrix.lane_makespan([100, 60, 50, 40], 2) == 140      # 100 | 60, 50 on 60's lane, 40 on 100's
    assert run_matrix.lane_makespan([100, 60, 50, 40], 1) == 250
    assert run_matrix.lane_makespan([300, 10, 10], 2) == 300


def test_lanes_run_legs_at_once_longest_first_and_keep_the_table_order():
    import threading
    import time as _time
    lock, running, peak, started = threading.Lock(), [0], [0], []

    def one(name):
        with lock:
            running[0] += 1
            peak[0] = max(peak[0], running[0])
            started.append(name)
        _time.sleep(0.05)
        with lock:
            running[0] -= 1
        return name.upper()

    budgets = {"a": 10, "b": 300, "c": 20, "d": 5}
    assert run_matrix.run_in_lanes(list(budgets), one, 2, key=budgets.get) == ["A", "B", "C", "D"]
    assert peak[0] == 2 and started[0] == "b"          # two lanes; the 300 s leg first
    started.clear(), peak.__setitem__(0, 0)
    assert run_matrix.run_in_lanes(list(budgets), one, 1, key=budgets.get) == ["A", "B", "C", "D"]
    assert peak[0] == 1 and started == ["a", "b", "c", "d"]     # one lane: the matrix's order


def test_two_lanes_report_every_leg(tmp_path, capsys):
    matrix = _write(tmp_path, "cpu_budget_total_s: 600\ngpu_budget_total_s: 60\nlegs:\n"
                    + leg("good") + leg("bad", "test_fail.py") + leg("good2"))
    assert run_matrix.main(["--matrix", str(matrix), "--junit-dir", str(tmp_path / "j"), "--jobs", "2"]) == 1
    out = capsys.readouterr().out
    assert "2 legs at a time" in out
    rows = {line.split()[0]: line.split()[3] for line in out.split("leg ", 1)[1].splitlines()[2:]
            if line.strip() and not line[0].isdigit() and len(line.split()) > 3}
    assert rows == {"good": "PASS", "bad": "FAIL", "good2": "PASS"}


def test_a_legs_setup_runs_first_and_its_failure_fails_the_leg(tmp_path, capsys):
    """`setup` (the cpu/ui leg installs Chromium with it) runs before the tests, in the leg's
    environment; a setup that fails fails the leg without running its tests."""
    ok = tmp_path / "setup_ok.sh"
    ok.write_text(f"#!/bin/sh\necho ran > {tmp_path}/setup_ran\n")
    bad = tmp_path / "setup_bad.sh"
    bad.write_text("#!/bin/sh\necho no browser >&2\nexit 3\n")
    for script in (ok, bad):
        script.chmod(0o755)
    matrix = _write(tmp_path, "cpu_budget_total_s: 600\ngpu_budget_total_s: 60\nlegs:\n"
                    + leg("with-setup", more=f", setup: {ok}") + leg("setup-fails", more=f", setup: {bad}"))
    out = tmp_path / "j"
    assert run_matrix.main(["--matrix", str(matrix), "--junit-dir", str(out)]) == 1
    table = capsys.readouterr().out
    rows = {line.split()[0]: line for line in table.splitlines() if line.startswith(("with-setup", "setup-fails"))}
    assert rows["with-setup"].split()[3] == "PASS" and (tmp_path / "setup_ran").read_text() == "ran\n"
    assert rows["setup-fails"].split()[3] == "FAIL" and "failed (3" in rows["setup-fails"]
    assert "no browser" in (out / "setup-fails.log").read_text()
    assert ET.parse(out / "setup-fails.xml").getroot().find("testcase/error") is not None
    # a setup that is not a file is a matrix error, before anything runs
    missing = _write(tmp_path, "cpu_budget_total_s: 60\ngpu_budget_total_s: 60\nlegs:\n"
                     + leg("x", more=f", setup: {tmp_path}/nope.sh"))
    with pytest.raises(run_matrix.MatrixError, match="setup .* is not a file"):
        run_matrix.load_matrix(missing)


def test_a_leg_with_pip_runs_in_its_own_environment_and_a_broken_one_fails(tmp_path, capsys, monkeypatch):
    """`pip:` builds a venv over this interpreter (--system-site-packages), runs the leg's pytest
    in it and reuses it the next time; requirements that do not install fail the leg, naming pip."""
    monkeypatch.setattr(run_matrix, "VENV_ROOT", tmp_path / "venvs")
    (tmp_path / "test_where.py").write_text("import sys\n\ndef test_in_venv():\n    assert sys.prefix.endswith('own')\n")
    matrix = _write(tmp_path, "cpu_budget_total_s: 600\ngpu_budget_total_s: 60\nlegs:\n"
                    + leg("own", "test_where.py", more=", pip: [pytest]")
                    + leg("broken", more=f", pip: ['{tmp_path}/no-such-project']"))
    args = ["--matrix", str(matrix), "--junit-dir", str(tmp_path / "j")]
    assert run_matrix.main(args) == 1
    out = capsys.readouterr().out
    rows = {line.split()[0]: line for line in out.split("leg ", 1)[1].splitlines()[2:] if line.strip() and not line[0].isdigit()}
    assert rows["own"].split()[3] == "PASS" and "built in" in rows["own"], rows["own"]
    assert rows["broken"].split()[3] == "FAIL" and "setting up its environment failed" in rows["broken"]
    assert not (tmp_path / "venvs" / "broken").exists()
    assert run_matrix.main(args + ["--legs", "own"]) == 0
    assert "reused" in capsys.readouterr().out


def test_lanes_split_the_cores_between_them():
    assert run_matrix.lane_threads(1, cores=2) is None          # one leg at a time: torch's default
    assert run_matrix.lane_threads(2, cores=2) == 1
    assert run_matrix.lane_threads(2, cores=16) == 8
    assert run_matrix.lane_threads(3, cores=2) == 1             # never zero threads
