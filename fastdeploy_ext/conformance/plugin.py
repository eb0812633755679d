"""pytest plugin (registered through the `pytest11` entry point) behind the conformance suite:
the --fdx-backend option, the emulation switch for MetaX, and the report header/footer that say
which backend, row and device were exercised — and "EMULATED" when they were."""
from __future__ import annotations

import sys


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
    backend = config.getoption("--fdx-backend")
    config._fdx_emulated = False
    if backend == "metax":
        config._fdx_emulated = _install_fake_pymxsml_if_needed(config)


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
    terminalreporter.write_sep("=", f"fastdeploy_ext conformance{tag}: backend={backend} {plan}")
