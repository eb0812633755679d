"""pytest plugin (registered through the `pytest11` entry point) behind the conformance suite:
the --fdx-backend option, the emulation switch for MetaX, and the report header/footer that say
which backend, row and device were exercised — and "EMULATED" when they were.

Two rules keep a green run honest: a skipped conformance test fails the session (a skipped
check is not a pass), and tests marked ``fdx_device("cuda")`` are deselected — by name, in the
summary — on legs whose torch device is another type, instead of being skipped.
"""
from __future__ import annotations

import sys

import pytest


def pytest_addoption(parser):
    g = parser.getgroup("fastdeploy_ext conformance")
    g.addoption("--fdx-backend", default=None, help="registered backend to test (cuda, metax, cpu_amx, cpu, ...)")
    g.addoption("--fdx-no-emulate", action="store_true",
                help="never emulate a missing MetaX card (fail instead of injecting the fake pymxsml)")


def _install_fake_pymxsml_if_needed(config) -> bool:
    from . import fake_pymxsml
    try:
        import pymxsml  # noqa: F401  (the real SDK module)
        return False
    except ImportError:
        pass
    if config.getoption("--fdx-no-emulate"):
        return False
    sys.modules["pymxsml"] = fake_pymxsml
    return True


def pytest_configure(config):
    config.addinivalue_line("markers", "fdx_device(type): conformance test that needs a torch device of this "
                                       "type (deselected, and named in the summary, on other legs)")
    backend = config.getoption("--fdx-backend")
    config._fdx_emulated = False
    config._fdx_not_run = []
    config._fdx_skips = None
    if backend:
        config._fdx_skips = _SkipIsFailure()
        config.pluginmanager.register(config._fdx_skips, "fdx-skip-is-failure")
    if backend == "metax":
        config._fdx_emulated = _install_fake_pymxsml_if_needed(config)


def _leg_device_type(backend: str) -> str | None:
    from ..runner import get_backend_class
    cls = get_backend_class(backend)
    probe = cls.probe()
    if not probe.present:
        return None           # the backend_cls fixture fails every test with the probe's reason
    return cls.torch_device(probe).type


def pytest_collection_modifyitems(session, config, items):
    backend = config.getoption("--fdx-backend")
    marked = [i for i in items if i.get_closest_marker("fdx_device")]
    if not backend or not marked:
        return
    device = _leg_device_type(backend)
    if device is None:
        return
    drop = [i for i in marked if i.get_closest_marker("fdx_device").args[0] != device]
    if drop:
        config._fdx_not_run = [(i.nodeid, i.get_closest_marker("fdx_device").args[0], device) for i in drop]
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
    tag = "  [EMULATED: fake pymxsml, no MetaX card; runner code and row are real]" if config._fdx_emulated else ""
    return f"fastdeploy_ext conformance: backend={backend}{tag}"


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    backend = config.getoption("--fdx-backend")
    if not backend:
        return
    plan = getattr(config, "_fdx_plan_line", "")
    tag = " EMULATED" if config._fdx_emulated else ""
    for nodeid, need, have in config._fdx_not_run:
        terminalreporter.write_line(f"not run on this leg (needs a {need} device, the leg's is {have}): {nodeid}")
    for nodeid in config._fdx_skips.skipped:
        terminalreporter.write_line(f"SKIPPED conformance test (a skipped check is not a pass): {nodeid}", red=True)
    terminalreporter.write_sep("=", f"fastdeploy_ext conformance{tag}: backend={backend} {plan}")
