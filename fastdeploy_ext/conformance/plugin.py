"""pytest plugin (registered through the `pytest11` entry point) behind the conformance suite:
the --fdx-backend option, the emulation switch (a backend whose device is absent is asked for its
``emulation()`` context, e.g. a fake vendor SDK), and the report header/footer that say which
backend, row and device were exercised — and "EMULATED" when they were.

Two rules keep a green run honest: a skipped conformance test fails the session (a skipped
check is not a pass), and tests marked ``fdx_device("cuda")`` are deselected — by name, in the
summary — on legs whose torch device is another type, instead of being skipped.
"""
from __future__ import annotations

import pytest


def pytest_addoption(parser):
    g = parser.getgroup("fastdeploy_ext conformance")
    g.addoption("--fdx-backend", default=None, help="registered backend to test (cuda, metax, cpu_amx, cpu, ...)")
    g.addoption("--fdx-no-emulate", action="store_true",
                help="never emulate a missing device (fail instead of entering the backend's emulation mode)")


def _enter_emulation_if_needed(config, backend: str) -> bool:
    """The backend's device is absent: ask the backend for its emulation context (the suite
    knows no vendor SDK) and keep it entered for the session. True when the probe then reports
    an emulated device."""
    from ..runner import get_backend_class
    try:
        cls = get_backend_class(backend)
    except ValueError:
        return False          # unknown backend: the backend_cls fixture fails every test saying so
    if cls.probe().present or config.getoption("--fdx-no-emulate"):
        return False
    ctx = cls.emulation()
    if ctx is None:
        return False
    ctx.__enter__()
    config._fdx_emulation = ctx
    return bool(cls.probe().emulated)


def pytest_configure(config):
    config.addinivalue_line("markers", "fdx_device(type): conformance test that needs a torch device of this "
                                       "type (deselected, and named in the summary, on other legs)")
    config.addinivalue_line("markers", "fdx_backend(*names): conformance test of what only these backends "
                                       "decide (deselected, and named in the summary, on other legs)")
    backend = config.getoption("--fdx-backend")
    config._fdx_emulated = False
    config._fdx_not_run = []
    config._fdx_skips = None
    if backend:
        config._fdx_skips = _SkipIsFailure()
        config.pluginmanager.register(config._fdx_skips, "fdx-skip-is-failure")
    if backend:
        config._fdx_emulated = _enter_emulation_if_needed(config, backend)


def pytest_unconfigure(config):
    ctx = getattr(config, "_fdx_emulation", None)
    if ctx is not None:
        config._fdx_emulation = None
        ctx.__exit__(None, None, None)


def _leg_device_type(backend: str) -> str | None:
    from ..runner import get_backend_class
    try:
        cls = get_backend_class(backend)
    except ValueError:
        return None           # unknown backend: the backend_cls fixture fails every test saying so
    probe = cls.probe()
    if not probe.present:
        return None           # the backend_cls fixture fails every test with the probe's reason
    return cls.torch_device(probe).type


def pytest_collection_modifyitems(session, config, items):
    backend = config.getoption("--fdx-backend")
    by_backend = [i for i in items if i.get_closest_marker("fdx_backend")
                  and backend not in i.get_closest_marker("fdx_backend").args]
    if backend and by_backend:
        config._fdx_not_run += [(i.nodeid, "/".join(i.get_closest_marker("fdx_backend").args) + " backend", backend)
                                for i in by_backend]
        config.hook.pytest_deselected(items=by_backend)
        items[:] = [i for i in items if i not in by_backend]
    marked = [i for i in items if i.get_closest_marker("fdx_device")]
    if not backend or not marked:
        return
    device = _leg_device_type(backend)
    if device is None:
        return
    drop = [i for i in marked if i.get_closest_marker("fdx_device").args[0] != device]
    if drop:
        config._fdx_not_run += [(i.nodeid, i.get_closest_marker("fdx_device").args[0] + " device", device)
                                for i in drop]
        config.hook.pytest_deselected(items=drop)
        items[:] = [i for i in items if i not in drop]


class _SkipIsFailure:
    """Registered for conformance runs: a skipped test turns a green session red."""

    def __init__(self):
        self.skipped: list[str] = []

    def pytest_runtest_logreport(self, report):
        if report.skipped:
            self.skipped.append(report.nodeid)

    def pytest_sessionfinish(self, session, exitstatus):
        if self.skipped and exitstatus == 0:
            session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_report_header(config):
    backend = config.getoption("--fdx-backend")
    if not backend:
        return None
    tag = ("  [EMULATED: the backend's emulation mode (no device; a fake SDK answers its probe), runner code "
           "and row are real]" if config._fdx_emulated else "")
    return f"fastdeploy_ext conformance: backend={backend}{tag}"


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    backend = config.getoption("--fdx-backend")
    if not backend:
        return
    plan = getattr(config, "_fdx_plan_line", "")
    tag = " EMULATED" if config._fdx_emulated else ""
    for nodeid, need, have in config._fdx_not_run:
        terminalreporter.write_line(f"not run on this leg (needs a {need}, the leg's is {have}): {nodeid}")
    for nodeid in config._fdx_skips.skipped:
        terminalreporter.write_line(f"SKIPPED conformance test (a skipped check is not a pass): {nodeid}", red=True)
    terminalreporter.write_sep("=", f"fastdeploy_ext conformance{tag}: backend={backend} {plan}")
