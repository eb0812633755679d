#!/usr/bin/env python3
"""Run the CI matrix (ci/matrix.yaml): the legs this machine can run, one pytest process each.

    python ci/run_matrix.py                 # the `ci` legs (README's test command, .ci/run)
    python ci/run_matrix.py --gpu           # the `gpu` legs (the H200 call, ci/gpu_leg.sh)
    python ci/run_matrix.py --list          # every leg, whether it can run here and why not
    python ci/run_matrix.py --legs 'cpu/*'  # a subset (fnmatch patterns, comma separated)

Legs whose device is not on this machine are listed with the reason and not run; `pending` legs
are slots for work not on main yet. Each leg writes JUnit XML (`--junit-dir`, one file per leg,
a one-test file saying why for legs not run) and its log beside it; a table (leg, result, tests,
seconds, budget) is printed at the end. Exit status 1 if any leg that ran failed (a test failed,
errored, was skipped where skips are not allowed, or the leg ran past its hang guard).
"""
from __future__ import annotations

import argparse
import fnmatch
import os
import re
import shutil
import subprocess
import sys
import tarfile
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_MATRIX = ROOT / "ci" / "matrix.yaml"
DEVICES = ("cpu", "cpu_amx", "metax-emulated", "cuda")
HOSTS = ("ci", "gpu")
# ci legs at once: most legs wait on subprocesses (servers, CLIs, workers) part of the time, so two
# lanes on the 2-core CI box finish the matrix in about 60 % of one lane's wall time
CI_JOBS = 2
HANG_FACTOR = 3          # a leg running this many times its budget is killed as hung
PLAN_KEYS = ("qkv_layout", "grid_thw", "dtype", "graphs", "decode_graphs")
CUDA_ONLY_PLAN_KEYS = ("graphs", "decode_graphs")


@dataclass(frozen=True)
class Leg:
    name: str
    device: str
    runs: str
    hosts: tuple[str, ...]
    budgets: dict = field(hash=False)             # host -> seconds
    backend: str | None = None
    paths: tuple[str, ...] = ()
    plan: dict = field(default_factory=dict, hash=False)
    env: dict = field(default_factory=dict, hash=False)
    block_transformers: bool = False
    allow_skips: bool = False
    pending: str | None = None
    family: str | None = None                     # conformance legs: --fdx-family (default family if None)
    setup: str | None = None                      # a script run before the tests (e.g. installs a browser)
    pip: tuple[str, ...] = ()                     # the leg's own environment: these requirements on top of ours
    suite: str | None = None                      # conformance legs: --fdx-suite (full if None)

    FIELDS = ("name", "device", "runs", "hosts", "budget_s", "backend", "paths", "plan", "env",
              "block_transformers", "allow_skips", "pending", "family", "setup", "pip", "suite")

    @property
    def slug(self) -> str:
        """File-name form of the leg name (JUnit and log files)."""
        return re.sub(r"[^A-Za-z0-9_.-]+", "_", self.name).strip("_")


@dataclass
class Matrix:
    legs: list[Leg]
    cpu_budget_total_s: int
    gpu_budget_total_s: int


class MatrixError(ValueError):
    """ci/matrix.yaml is malformed; the message names the leg and the field."""


# ------------------------------------------------------------------------------ loading
def load_matrix(path: str | Path = DEFAULT_MATRIX) -> Matrix:
    data = yaml.safe_load(Path(path).read_text())
    legs, seen = [], set()
    for i, d in enumerate(data.get("legs") or []):
        name = d.get("name") or f"#{i}"
        unknown = set(d) - set(Leg.FIELDS)
        if unknown:
            raise MatrixError(f"leg {name}: unknown field(s) {sorted(unknown)}")
        if name in seen:
            raise MatrixError(f"leg {name}: duplicate name")
        seen.add(name)
        if d.get("device") not in DEVICES:
            raise MatrixError(f"leg {name}: device must be one of {DEVICES}, got {d.get('device')!r}")
        if d.get("runs") not in RUNS:
            raise MatrixError(f"leg {name}: runs must be one of {sorted(RUNS)}, got {d.get('runs')!r}")
        hosts = tuple(d.get("hosts") or ())
        if not hosts or set(hosts) - set(HOSTS):
            raise MatrixError(f"leg {name}: hosts must be a non-empty subset of {HOSTS}, got {hosts}")
        plan = dict(d.get("plan") or {})
        if set(plan) - set(PLAN_KEYS):
            raise MatrixError(f"leg {name}: plan keys must be among {PLAN_KEYS}, got {sorted(plan)}")
        if set(plan) & set(CUDA_ONLY_PLAN_KEYS) and d["device"] != "cuda":
            raise MatrixError(f"leg {name}: graphs on/off is a cuda-only variant (device {d['device']})")
        budget = d.get("budget_s")
        budgets = budget if isinstance(budget, dict) else {h: budget for h in hosts}
        if set(budgets) != set(hosts) or not all(isinstance(b, int) and b > 0 for b in budgets.values()):
            raise MatrixError(f"leg {name}: budget_s must be a positive integer, or one per host of {hosts}; "
                              f"got {budget!r}")
        leg = Leg(name=name, device=d["device"], runs=d["runs"], hosts=hosts, budgets=budgets,
                  backend=d.get("backend"), paths=tuple(d.get("paths") or ()), plan=plan,
                  env={k: str(v) for k, v in (d.get("env") or {}).items()},
                  block_transformers=bool(d.get("block_transformers", False)),
                  allow_skips=bool(d.get("allow_skips", False)), pending=d.get("pending"), family=d.get("family"),
                  setup=d.get("setup"), pip=tuple(str(r) for r in (d.get("pip") or ())),
                  suite=d.get("suite"))
        if leg.setup is not None and not (ROOT / leg.setup).is_file():
            raise MatrixError(f"leg {name}: setup {leg.setup} is not a file of the repository")
        RUNS[leg.runs].check(leg)
        legs.append(leg)
    return Matrix(legs, int(data["cpu_budget_total_s"]), int(data["gpu_budget_total_s"]))


# ------------------------------------------------------------------- what each leg runs
@dataclass(frozen=True)
class RunKind:
    """How a leg of one `runs` kind becomes a pytest command line."""
    needs_backend: bool = False
    needs_paths: bool = False
    target: tuple[str, ...] = ()          # fixed pytest target (else the leg's paths)

    def check(self, leg: Leg) -> None:
        if leg.pending:
            return
        if self.needs_backend and not leg.backend:
            raise MatrixError(f"leg {leg.name}: runs {leg.runs} needs `backend`")
        if self.needs_paths and not leg.paths:
            raise MatrixError(f"leg {leg.name}: runs {leg.runs} needs `paths`")
        if leg.family and leg.runs != "conformance":
            raise MatrixError(f"leg {leg.name}: `family` is the conformance suite's --fdx-family (runs {leg.runs})")
        if leg.suite and (leg.runs != "conformance" or leg.suite not in ("full", "core")):
            raise MatrixError(f"leg {leg.name}: `suite` is the conformance suite's --fdx-suite, full or core "
                              f"(runs {leg.runs}, suite {leg.suite!r})")

    def args(self, leg: Leg, matrix: Matrix) -> list[str]:
        args = list(self.target or leg.paths)
        if leg.backend:
            args += ["--fdx-backend", leg.backend]
        if leg.family:
            args += ["--fdx-family", leg.family]
        if leg.suite:
            args += ["--fdx-suite", leg.suite]
        if leg.plan:
            args += ["--fdx-plan", ",".join(f"{k}={v}" for k, v in leg.plan.items())]
        if leg.runs == "unit":
            # a test file that another leg owns (paddle, oot) runs there, not twice
            for other in matrix.legs:
                if other is not leg and other.runs != "unit":
                    args += [f"--ignore={p}" for p in other.paths
                             if any(p.startswith(mine.rstrip("/") + "/") for mine in leg.paths)]
        return args


RUNS: dict[str, RunKind] = {
    "unit": RunKind(needs_paths=True),
    "paddle": RunKind(needs_paths=True),
    "oot": RunKind(needs_paths=True),
    "serve": RunKind(needs_paths=True),
    "ray": RunKind(needs_paths=True),
    "conformance": RunKind(needs_backend=True, target=("--pyargs", "fastdeploy_ext.conformance")),
    "encode": RunKind(needs_backend=True, target=("ci/legs/test_encode_smoke.py",)),
    "generate": RunKind(needs_backend=True, target=("ci/legs/test_generate_smoke.py",)),
}


# ------------------------------------------------------------- can this machine run it?
def device_here(device: str) -> tuple[bool, str]:
    """Whether `device` is on this machine, with the reason, asked through the backends' own
    probes and plans (the same path `fastdeploy-ext info` takes)."""
    if device in ("cpu", "metax-emulated"):
        return True, "runs on any machine" if device == "cpu" else "emulated: fake pymxsml, the runner's own code and row"
    sys.path.insert(0, str(ROOT))
    try:
        from fastdeploy_ext.plan import PlanRequest
        from fastdeploy_ext.runner import get_backend_class
        backend = "cuda" if device == "cuda" else "cpu_amx"
        cls = get_backend_class(backend)
        try:
            runner = cls.create(PlanRequest(device=backend))
        except Exception as e:   # absent device, or a plan this machine cannot make
            return False, f"no {device} here: {e}"
        if device == "cpu_amx" and runner.plan.row != "cpu_amx":
            return False, (f"AMX not proven here (the cpu_amx runner picks row {runner.plan.row}: "
                           f"{runner.probe_result.details.get('amx_reason', 'no AMX flags')}; cpu/* covers it)")
        return True, f"{backend} runner on row {runner.plan.row}"
    finally:
        sys.path.remove(str(ROOT))


def why_not_here(leg: Leg, host: str, devices: dict[str, tuple[bool, str]]) -> str | None:
    if leg.pending:
        return f"pending: {leg.pending}"
    if host not in leg.hosts:
        return ("GPU-host leg: runs in `ci/run_matrix.py --gpu` on the H200" if host == "ci"
                else "CI-host leg: runs in `ci/run_matrix.py` on the CPU CI machine")
    ok, reason = devices[leg.device]
    return None if ok else reason


# ------------------------------------------------------------- a leg's own environment
#: where legs with `pip` keep their virtual environments between runs (under the checkout: a CI
#: workdir that persists keeps them; a fresh clone builds them once)
VENV_ROOT = Path(os.environ.get("FDX_CI_VENV_DIR", ROOT / "ci" / ".venv"))
SETUP_TIMEOUT_S = 900


def leg_python(leg: Leg, python: str) -> tuple[str, str]:
    """The interpreter a leg runs under, and what was done to get it: ``python`` itself, or for a
    leg with `pip` a venv over it (--system-site-packages: everything installed here, plus the
    leg's requirements), reused while its requirements are the same. RuntimeError if pip fails."""
    if not leg.pip:
        return python, ""
    venv = VENV_ROOT / leg.slug
    marker = venv / ".fdx-requirements"
    want = "\n".join(leg.pip) + "\n"
    vpython = venv / "bin" / "python"
    if vpython.exists() and marker.exists() and marker.read_text() == want:
        return str(vpython), f"env {venv} reused"
    t0 = time.monotonic()
    shutil.rmtree(venv, ignore_errors=True)
    # no pip of its own (ensurepip costs more than the install): this interpreter's pip installs into it
    for cmd in ([python, "-m", "venv", "--without-pip", "--system-site-packages", str(venv)],
                [python, "-m", "pip", "--python", str(vpython), "install", "-q", "--disable-pip-version-check",
                 *leg.pip]):
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=SETUP_TIMEOUT_S)
        if r.returncode != 0:
            shutil.rmtree(venv, ignore_errors=True)
            raise RuntimeError(f"setting up its environment failed: {' '.join(cmd)}: {(r.stderr or r.stdout)[-500:]}")
    marker.write_text(want)
    return str(vpython), f"env {venv} built in {time.monotonic() - t0:.0f}s"


# -------------------------------------------------------------------------- running
@dataclass
class LegResult:
    leg: Leg
    result: str                   # PASS FAIL NOT-RUN PENDING (RUNNABLE with --list)
    budget: int | None = None     # seconds, on this host
    seconds: float = 0.0
    counts: dict = field(default_factory=dict)
    detail: str = ""

    @property
    def failed(self) -> bool:
        return self.result == "FAIL"


def junit_counts(path: Path) -> dict:
    root = ET.parse(path).getroot()
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    total = {"tests": 0, "failures": 0, "errors": 0, "skipped": 0}
    for s in suites:
        for k in total:
            total[k] += int(s.get(k, 0))
    total["passed"] = total["tests"] - total["failures"] - total["errors"] - total["skipped"]
    return total


def write_not_run_junit(path: Path, leg: Leg, reason: str) -> None:
    suite = ET.Element("testsuite", name=leg.name, tests="1", failures="0", errors="0", skipped="1")
    case = ET.SubElement(suite, "testcase", classname="ci.matrix", name=leg.name)
    ET.SubElement(case, "skipped", message=reason)
    ET.ElementTree(suite).write(path, encoding="utf-8", xml_declaration=True)


def write_error_junit(path: Path, leg: Leg, message: str) -> None:
    suite = ET.Element("testsuite", name=leg.name, tests="1", failures="0", errors="1", skipped="0")
    case = ET.SubElement(suite, "testcase", classname="ci.matrix", name=leg.name)
    ET.SubElement(case, "error", message=message)
    ET.ElementTree(suite).write(path, encoding="utf-8", xml_declaration=True)


def failure_tail(log: str, lines: int = 25) -> list[str]:
    """What a failed leg prints: every FAILED/ERROR summary line (a long skip list must not push
    them out of view), then the log's last lines."""
    all_lines = log.splitlines()
    failures = [ln for ln in all_lines if ln.startswith(("FAILED ", "ERROR "))]
    last = [ln for ln in all_lines[-lines:] if ln not in failures]
    return failures + last


def lane_threads(jobs: int, cores: int | None = None) -> int | None:
    """Intra-op threads for each of ``jobs`` legs run at once: the cores split between them, so two
    torch processes do not each spin a thread per core (OpenMP's barriers then wait on a core the
    other lane holds: a leg of many small ops ran 8-16x slower beside cpu/unit on 2 cores). None:
    one leg at a time, torch's own default."""
    if jobs <= 1:
        return None
    return max(1, (cores or os.cpu_count() or 1) // jobs)


def run_leg(leg: Leg, matrix: Matrix, out_dir: Path, python: str, extra: list[str], host: str = "ci",
            time_left: float | None = None, threads: int | None = None) -> LegResult:
    budget = leg.budgets[host]
    limit = budget * HANG_FACTOR if time_left is None else min(budget * HANG_FACTOR, time_left)
    junit, log_path = out_dir / f"{leg.slug}.xml", out_dir / f"{leg.slug}.log"
    try:
        python, setup = leg_python(leg, python)         # not counted in the leg's seconds: a cached env costs nothing
    except (RuntimeError, subprocess.TimeoutExpired) as e:
        write_error_junit(junit, leg, str(e))
        log_path.write_text(f"{e}\n")
        return LegResult(leg, "FAIL", budget, 0.0, detail=str(e))
    cmd = [python, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rfEs", f"--junitxml={junit}",
           "-o", f"junit_suite_name={leg.name}", "-o", "junit_logging=system-out", *RUNS[leg.runs].args(leg, matrix), *extra]
    env = dict(os.environ, **leg.env)
    if threads is not None and "OMP_NUM_THREADS" not in env:   # the caller's or the leg's own setting wins
        env["OMP_NUM_THREADS"] = str(threads)
    pypath = [str(ROOT)]
    if leg.block_transformers:
        # ci/no_transformers.py: every import of transformers raises ImportError, as if absent
        pypath.append(str(ROOT / "ci"))
        cmd[3:3] = ["-p", "no_transformers"]
    env["PYTHONPATH"] = os.pathsep.join(pypath + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    t0 = time.monotonic()
    with open(log_path, "w") as log:
        if leg.setup is not None:          # inside the leg's time: what it installs is part of its cost
            log.write(f"$ {leg.setup}\n")
            log.flush()
            try:
                rc = subprocess.run([str(ROOT / leg.setup)], cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                                    timeout=limit).returncode
            except subprocess.TimeoutExpired:
                rc = "timeout"
            if rc != 0:
                msg = f"setup {leg.setup} failed ({rc}; see {log_path.name})"
                write_error_junit(junit, leg, msg)
                return LegResult(leg, "FAIL", budget, time.monotonic() - t0, detail=msg)
        log.write(f"$ {' '.join(cmd)}\n")
        log.flush()
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
        try:
            rc = proc.wait(timeout=limit)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)
            proc.wait()
            rc = None
    seconds = time.monotonic() - t0
    if rc is None:
        msg = (f"killed as hung after {seconds:.0f}s ({HANG_FACTOR}x its {budget}s budget)" if limit == budget * HANG_FACTOR
               else f"killed after {seconds:.0f}s: the run's --deadline-s was reached")
        write_error_junit(junit, leg, msg)
        return LegResult(leg, "FAIL", budget, seconds, detail=msg)
    if not junit.exists():
        msg = f"pytest exited {rc} without a JUnit report (see {log_path.name})"
        write_error_junit(junit, leg, msg)
        return LegResult(leg, "FAIL", budget, seconds, detail=msg)
    counts = junit_counts(junit)
    problems = []
    if rc != 0:
        problems.append(f"pytest exit status {rc}")
    if counts["tests"] == 0:
        problems.append("no tests collected")
    if counts["skipped"] and not leg.allow_skips:
        problems.append(f"{counts['skipped']} skipped (skips are not coverage on this leg)")
    over = seconds > budget
    detail = "; ".join(problems + ([f"over its {budget}s budget"] if over else []) + ([setup] if setup else []))
    return LegResult(leg, "FAIL" if problems else "PASS", budget, seconds, counts, detail)


def lane_makespan(seconds: list[float], jobs: int) -> float:
    """When the last of ``jobs`` lanes ends if legs of these durations start largest first, each
    on the lane that frees up first (run_in_lanes' order): the run's wall time in legs."""
    lanes = [0.0] * max(jobs, 1)
    for s in sorted(seconds, reverse=True):
        i = lanes.index(min(lanes))
        lanes[i] += s
    return max(lanes)


def run_in_lanes(legs: list, run_one, jobs: int, key) -> list:
    """``run_one`` over ``legs``, ``jobs`` at a time, the largest ``key`` (budget) started first so
    the longest leg does not start last; results in the legs' order (the table's)."""
    if jobs <= 1:
        return [run_one(leg) for leg in legs]
    from concurrent.futures import ThreadPoolExecutor
    order = sorted(range(len(legs)), key=lambda i: -key(legs[i]))
    with ThreadPoolExecutor(max_workers=jobs) as pool:
        futures = {i: pool.submit(run_one, legs[i]) for i in order}
        return [futures[i].result() for i in range(len(legs))]


# ---------------------------------------------------------------------------- report
def format_table(results: list[LegResult]) -> str:
    rows = [("leg", "device", "runs", "result", "pass/fail/skip", "seconds", "budget", "detail")]
    for r in results:
        c = r.counts
        tests = f"{c['passed']}/{c['failures'] + c['errors']}/{c['skipped']}" if c else "-"
        secs = f"{r.seconds:.1f}" if r.result in ("PASS", "FAIL") else "-"
        rows.append((r.leg.name, r.leg.device, r.leg.runs, r.result, tests, secs, str(r.budget or "-"), r.detail))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]) - 1)]
    lines = []
    for j, row in enumerate(rows):
        lines.append("  ".join(v.ljust(w) for v, w in zip(row, widths)) + "  " + row[-1])
        if j == 0:
            lines.append("  ".join("-" * w for w in widths) + "  ------")
    ran = [r for r in results if r.result in ("PASS", "FAIL")]
    lines.append(f"{len(ran)} legs ran: {sum(not r.failed for r in ran)} passed, {sum(r.failed for r in ran)} failed; "
                 f"{len(results) - len(ran)} not run here; {sum(r.seconds for r in ran):.1f}s in legs")
    return "\n".join(lines)


def select(matrix: Matrix, patterns: str | None) -> list[Leg]:
    if not patterns:
        return matrix.legs
    pats = [p.strip() for p in patterns.split(",") if p.strip()]
    legs = [leg for leg in matrix.legs if any(fnmatch.fnmatchcase(leg.name, p) for p in pats)]
    if not legs:
        raise MatrixError(f"--legs {patterns!r} matches no leg; legs: {', '.join(l.name for l in matrix.legs)}")
    return legs


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--matrix", default=str(DEFAULT_MATRIX))
    ap.add_argument("--gpu", action="store_true", help="run the gpu-host legs (the H200 call) instead of the ci legs")
    ap.add_argument("--legs", default=None, help="fnmatch patterns of leg names, comma separated")
    ap.add_argument("--list", action="store_true", help="list the legs and whether each can run here; run nothing")
    ap.add_argument("--junit-dir", default=str(ROOT / "ci" / "junit"), help="per-leg JUnit XML and logs")
    ap.add_argument("--archive", default=None, help="also pack the junit dir into this .tar.gz")
    ap.add_argument("--require", default="", metavar="DEVICE,...",
                    help="devices that must be on this machine: their legs fail instead of being listed as not run")
    ap.add_argument("--deadline-s", type=float, default=None,
                    help="wall-clock limit of the whole run (the GPU call's): a leg that cannot start in time "
                         "fails as not run, a running one is stopped, and the table and archive are still written")
    ap.add_argument("--strict-budgets", action="store_true", help="a leg over its budget fails")
    ap.add_argument("--jobs", type=int, default=None, metavar="N",
                    help=f"legs run at once (default {CI_JOBS} on the ci host, 1 with --gpu: its legs share one GPU)")
    ap.add_argument("--python", default=sys.executable)
    ap.add_argument("pytest_args", nargs="*", help="extra pytest arguments for every leg (after --)")
    args = ap.parse_args(argv)
    try:
        matrix = load_matrix(args.matrix)
        legs = select(matrix, args.legs)
    except MatrixError as e:
        print(f"run_matrix: error: {e}", file=sys.stderr)
        return 2
    host = "gpu" if args.gpu else "ci"
    required = {d.strip() for d in args.require.split(",") if d.strip()}
    if required - set(DEVICES):
        print(f"run_matrix: error: --require: unknown devices {sorted(required - set(DEVICES))}", file=sys.stderr)
        return 2
    devices = {d: device_here(d) for d in sorted({leg.device for leg in legs if leg.pending is None} | required)}
    out = Path(args.junit_dir)
    if not args.list:
        shutil.rmtree(out, ignore_errors=True)
        out.mkdir(parents=True)
    print(f"run_matrix: host={host}; devices here: " +
          "; ".join(f"{d}: {'yes' if ok else 'no'} ({why})" for d, (ok, why) in devices.items()), flush=True)
    start = time.monotonic()
    jobs = args.jobs if args.jobs is not None else (1 if host == "gpu" else CI_JOBS)
    threads = lane_threads(jobs)

    def one(leg: Leg) -> LegResult:
        time_left = None if args.deadline_s is None else args.deadline_s - (time.monotonic() - start)
        reason = why_not_here(leg, host, devices)
        if reason is not None and leg.device in required and host in leg.hosts and not leg.pending:
            res = LegResult(leg, "FAIL", leg.budgets[host], detail=f"required here, but {reason}")
            if not args.list:
                write_error_junit(out / f"{leg.slug}.xml", leg, res.detail)
        elif reason is not None:
            res = LegResult(leg, "PENDING" if leg.pending else "NOT-RUN", leg.budgets.get(host), detail=reason)
            if not args.list:
                write_not_run_junit(out / f"{leg.slug}.xml", leg, reason)
        elif args.list:
            res = LegResult(leg, "RUNNABLE", leg.budgets[host])
        elif time_left is not None and time_left < 5:
            res = LegResult(leg, "FAIL", leg.budgets[host], detail="not started: the run's --deadline-s was reached")
            write_error_junit(out / f"{leg.slug}.xml", leg, res.detail)
        else:
            print(f"=== {leg.name} (budget {leg.budgets[host]}s)", flush=True)
            res = run_leg(leg, matrix, out, args.python, args.pytest_args, host, time_left, threads)
            if args.strict_budgets and res.result == "PASS" and res.seconds > res.budget:
                res.result = "FAIL"
            tail = ("\n    " + "\n    ".join(failure_tail((out / f"{leg.slug}.log").read_text()))) if res.failed else ""
            print(f"    {leg.name}: {res.result} in {res.seconds:.1f}s {res.detail}{tail}", flush=True)
        return res

    if threads is not None and not args.list:
        print(f"run_matrix: {jobs} legs at a time, OMP_NUM_THREADS={threads} each ({os.cpu_count()} cores; "
              "a leg's own env or the caller's OMP_NUM_THREADS wins)", flush=True)
    results = run_in_lanes(legs, one, jobs, key=lambda leg: leg.budgets.get(host) or 0)
    if jobs > 1 and not args.list:
        print(f"run_matrix: {jobs} legs at a time; {time.monotonic() - start:.0f}s wall for "
              f"{sum(r.seconds for r in results):.0f}s in legs", flush=True)
    table = format_table(results)
    print(table)
    if not args.list:
        (out / "matrix_table.txt").write_text(table + "\n")
        if args.archive:
            with tarfile.open(args.archive, "w:gz") as tar:
                tar.add(out, arcname="matrix")
            print(f"packed {out} into {args.archive}")
    return 1 if any(r.failed for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
