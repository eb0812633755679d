"""pytest plugin (registered through the `pytest11` entry point) behind the conformance suite:
the --fdx-backend and --fdx-family options, the emulation switch (a backend whose device is absent is asked for its
``emulation()`` context, e.g. a fake vendor SDK), and the report header/footer that say which
backend, row and device were exercised — and "EMULATED" when they were.

Two rules keep a green run honest: a skipped conformance test fails the session (a skipped
check is not a pass), and tests marked ``fdx_device("cuda")`` are deselected — by name, in the
summary — on legs whose torch device is another type, instead of being skipped. Likewise tests
marked ``fdx_family_fact(FamilyFact.X)`` are deselected, by name and with the fact, for a family
whose conformance fixture does not declare X (e.g. the toy family has no Paddle-layout
checkpoints and no device-side metadata path).
"""
from __future__ import annotations

import pytest


def pytest_addoption(parser):
    g = parser.getgroup("fastdeploy_ext conformance")
    g.addoption("--fdx-backend", default=None, help="registered backend to test (cuda, metax, cpu_amx, cpu, ...)")
    g.addoption("--fdx-family", default=None,
                help="model family whose tiny models and references the suite runs (default: the default family)")
    g.addoption("--fdx-detector-family", default=None,
                help="layout detector family whose tiny model and references the detector tests run (default: the "
                     "default detector family with the default --fdx-family, else none; none: no detector tests)")
    g.addoption("--fdx-suite", default="full", choices=("full", "core"),
                help="core: deselect (by name, in the summary) the tests marked fdx_extended: scheduling variants "
                     "of cases the core keeps (a second leg of a family on the same machine costs less)")
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


def family_option(config) -> str:
    from ..models.registry import DEFAULT_FAMILY
    return config.getoption("--fdx-family") or DEFAULT_FAMILY


#: the detector families the default VLM family pairs with: PaddleOCR-VL-1.5/1.6's PP-DocLayoutV3
#: and the original PaddleOCR-VL's PP-DocLayoutV2
PIPELINE_DETECTOR_FAMILIES = "pp_doclayout_v3,pp_doclayout_v2"


def detector_families_option(config) -> tuple[str, ...]:
    """The detector families the detector tests run, each as a parameter of them (empty: none).
    ``--fdx-detector-family`` takes a comma list. Default: the detector families of the default
    VLM family's pipelines alongside it; a run for another VLM family (e.g. an out-of-tree one)
    runs none unless --fdx-detector-family names some."""
    from ..models.registry import DEFAULT_FAMILY
    names = config.getoption("--fdx-detector-family")
    if names is None:
        names = PIPELINE_DETECTOR_FAMILIES if family_option(config) == DEFAULT_FAMILY else "none"
    return tuple(n for n in (x.strip() for x in names.split(",")) if n and n != "none")


def detector_family_option(config) -> str | None:
    """The detector families as one name for the report lines (None: none)."""
    return ",".join(detector_families_option(config)) or None


def detector_fixture_of(config, name: str | None = None):
    """(the detector family's DetectorConformanceFixture, None) or (None, why not), made once
    per session and family (``name``; default the first of the option's)."""
    cache = config.__dict__.setdefault("_fdx_detector_fixtures", {})
    name = name or (detector_families_option(config) or ("none",))[0]
    if name not in cache:
        from ..models.interface import DetectorFamily
        from ..models.registry import get_family
        from .family_fixture import DetectorConformanceFixture
        try:
            family = get_family(name)
        except ValueError as e:
            cache[name] = (None, str(e))
            return cache[name]
        fx = family.conformance_fixture("") if isinstance(family, DetectorFamily) else None
        cache[name] = (fx, None) if isinstance(fx, DetectorConformanceFixture) else (
            None, f"{name} is no detector family with a detector conformance fixture")
    return cache[name]


def family_fixture_of(config):
    """(the family's ConformanceFixture, None) or (None, why not), made once per session in a
    work dir of its own (removed at the end)."""
    if not hasattr(config, "_fdx_family_fixture"):
        import tempfile
        from ..models.registry import get_family
        name = family_option(config)
        try:
            family = get_family(name)
        except ValueError as e:          # unknown family: every test fails saying so
            config._fdx_family_fixture = (None, str(e))
            return config._fdx_family_fixture
        from .family_fixture import ConformanceFixture
        config._fdx_workdir = tempfile.TemporaryDirectory(prefix=f"fdx-{name}-")
        fx = family.conformance_fixture(config._fdx_workdir.name)
        if fx is not None:
            fx.suite = config.getoption("--fdx-suite")
        if fx is not None and not isinstance(fx, ConformanceFixture):
            config._fdx_family_fixture = (None, f"{name} is a {family.role} family: its conformance tests are the "
                                                f"detector tests (--fdx-detector-family {name})")
        else:
            config._fdx_family_fixture = (fx, None) if fx is not None else (
                None, "the family supplies no conformance fixture (ModelFamily.conformance_fixture returns None)")
    return config._fdx_family_fixture


def pytest_configure(config):
    config.addinivalue_line("markers", "fdx_family_fact(fact): conformance test of what only families declaring "
                                       "this FamilyFact have (deselected, and named in the summary, for others)")
    config.addinivalue_line("markers", "fdx_detector: conformance test of the layout detector family "
                                       "(--fdx-detector-family; deselected, and named in the summary, with none)")
    config.addinivalue_line("markers", "fdx_device(type): conformance test that needs a torch device of this "
                                       "type (deselected, and named in the summary, on other legs)")
    config.addinivalue_line("markers", "fdx_extended: conformance test of a variant of a case the core suite "
                                       "keeps (deselected, and named in the summary, with --fdx-suite core)")
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
    workdir = getattr(config, "_fdx_workdir", None)
    if workdir is not None:
        workdir.cleanup()
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


def _deselect_by_family_facts(config, items) -> None:
    marked = [i for i in items if i.get_closest_marker("fdx_family_fact")]
    if not marked:
        return
    fx, _ = family_fixture_of(config)
    if fx is None:
        return                # the family_fixture fixture fails every test with the reason
    have = {str(f) for f in fx.facts}
    name = family_option(config)
    declared = f"{name} (declares {', '.join(sorted(have)) or 'none of them'})"
    drop = [i for i in marked if not {str(a) for m in i.iter_markers("fdx_family_fact") for a in m.args} <= have]
    if drop:
        config._fdx_not_run += [
            (i.nodeid, "family with " + "+".join(sorted(str(a) for m in i.iter_markers("fdx_family_fact")
                                                        for a in m.args)), declared) for i in drop]
        config.hook.pytest_deselected(items=drop)
        items[:] = [i for i in items if i not in drop]


def _deselect_detector_tests(config, items) -> None:
    if detector_family_option(config) is not None:
        return
    drop = [i for i in items if i.get_closest_marker("fdx_detector")]
    if drop:
        config._fdx_not_run += [(i.nodeid, "detector family", "none (--fdx-detector-family)") for i in drop]
        config.hook.pytest_deselected(items=drop)
        items[:] = [i for i in items if i not in drop]


def _deselect_extended(config, items) -> None:
    if config.getoption("--fdx-suite") != "core":
        return
    drop = [i for i in items if i.get_closest_marker("fdx_extended")]
    if drop:
        config._fdx_not_run += [(i.nodeid, "full suite", "core (--fdx-suite)") for i in drop]
        config.hook.pytest_deselected(items=drop)
        items[:] = [i for i in items if i not in drop]


def pytest_collection_modifyitems(session, config, items):
    backend = config.getoption("--fdx-backend")
    if backend:
        _deselect_by_family_facts(config, items)
        _deselect_detector_tests(config, items)
        _deselect_extended(config, items)
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
    return (f"fastdeploy_ext conformance: backend={backend} family={family_option(config)} "
            f"detector={detector_family_option(config) or 'none'}{tag}")


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    backend = config.getoption("--fdx-backend")
    if not backend:
        return
    plan = getattr(config, "_fdx_plan_line", "")
    tag = " EMULATED" if config._fdx_emulated else ""
    if config.getoption("--fdx-suite") == "core":
        tag += " (core suite)"
    for nodeid, need, have in config._fdx_not_run:
        terminalreporter.write_line(f"not run on this leg (needs a {need}, the leg's is {have}): {nodeid}")
    for nodeid in config._fdx_skips.skipped:
        terminalreporter.write_line(f"SKIPPED conformance test (a skipped check is not a pass): {nodeid}", red=True)
    terminalreporter.write_sep("=", f"fastdeploy_ext conformance{tag}: backend={backend} "
                                    f"family={family_option(config)} detector={detector_family_option(config) or 'none'}"
                                    f" {plan}")
