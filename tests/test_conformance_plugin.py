"""The conformance plugin's honesty rules, each shown to fire: a skipped conformance test fails
the session, a device-specific test is deselected by name on other legs, and the CI blocker
really makes `import transformers` fail."""
from __future__ import annotations

import os
from pathlib import Path

CI = Path(__file__).resolve().parents[1] / "ci"


def test_a_skipped_conformance_test_fails_the_session(pytester):
    pytester.makepyfile("""
        import pytest
        def test_ok():
            pass
        def test_skipped():
            pytest.skip("no numerics here")
    """)
    red = pytester.runpytest("--fdx-backend", "cpu", "-p", "no:cacheprovider")
    assert red.ret == 1
    red.stdout.fnmatch_lines(["*SKIPPED conformance test (a skipped check is not a pass)*test_skipped*"])
    plain = pytester.runpytest("-p", "no:cacheprovider")          # outside the suite: pytest's rules
    assert plain.ret == 0


def test_device_specific_tests_are_deselected_by_name_on_other_legs(pytester):
    pytester.makepyfile("""
        import pytest
        @pytest.mark.fdx_device("cuda")
        def test_cuda_only():
            raise AssertionError("must not run on the cpu leg")
        def test_everywhere():
            pass
    """)
    r = pytester.runpytest("--fdx-backend", "cpu", "-p", "no:cacheprovider")
    assert r.ret == 0
    r.assert_outcomes(passed=1, deselected=1)
    r.stdout.fnmatch_lines(["*not run on this leg (needs a cuda device, the leg's is cpu)*test_cuda_only*"])


def test_the_ci_blocker_makes_transformers_unimportable(pytester, monkeypatch):
    pytester.makepyfile("""
        import pytest
        def test_blocked():
            with pytest.raises(ImportError, match="blocked"):
                import transformers
    """)
    env_path = os.pathsep.join(p for p in (str(CI), os.environ.get("PYTHONPATH", "")) if p)
    monkeypatch.setenv("PYTHONPATH", env_path)
    r = pytester.runpytest_subprocess("-p", "no_transformers", "-p", "no:cacheprovider")
    assert r.ret == 0, r.stdout.str()
    r.stdout.fnmatch_lines(["*transformers: BLOCKED*"])


def test_the_core_suite_deselects_the_extended_tests_by_name(pytester):
    """--fdx-suite core (a family's second leg on one machine) drops the fdx_extended tests and
    names each (the full suite, the default, runs them: every other conformance run)."""
    pytester.makepyfile("""
        import pytest
        @pytest.mark.fdx_extended
        def test_variant():
            pass
        def test_core():
            pass
    """)
    # in a subprocess: torch imported in-process by an earlier pytester run cannot be imported again
    core = pytester.runpytest_subprocess("--fdx-backend", "cpu", "--fdx-suite", "core", "-p", "no:cacheprovider")
    assert core.ret == 0, core.stdout.str()
    core.assert_outcomes(passed=1, deselected=1)
    core.stdout.fnmatch_lines(["*not run on this leg (needs a full suite, the leg's is core (--fdx-suite))*"
                               "test_variant*", "*fastdeploy_ext conformance (core suite): backend=cpu*"])
