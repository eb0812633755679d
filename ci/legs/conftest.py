"""Options of the matrix's smoke legs (ci/matrix.yaml): `--fdx-backend` comes from the
conformance plugin (it also installs the MetaX emulation); `--fdx-plan` names the plan variant."""
from __future__ import annotations

import pytest

PLAN_FLAGS = {"qkv_layout": "--qkv-layout", "grid_thw": "--grid-thw", "dtype": "--dtype"}


def pytest_addoption(parser):
    parser.addoption("--fdx-plan", default="",
                     help="plan variant as KEY=VALUE,... (qkv_layout, grid_thw, dtype, graphs=on|off)")


@pytest.fixture(scope="session")
def plan_variant(request) -> dict:
    text = request.config.getoption("--fdx-plan")
    variant = dict(kv.split("=", 1) for kv in text.split(",") if kv)
    unknown = set(variant) - set(PLAN_FLAGS) - {"graphs"}
    if unknown:
        pytest.fail(f"--fdx-plan: unknown keys {sorted(unknown)}")
    return variant


@pytest.fixture(scope="session")
def plan_flags(plan_variant) -> list[str]:
    """The CLI flags that force the variant."""
    flags = []
    for key, value in plan_variant.items():
        if key == "graphs":
            flags += ["--graph-optimization-config", '{"use_cudagraph": %s}' % ("true" if value == "on" else "false")]
        else:
            flags += [PLAN_FLAGS[key], value]
    return flags
