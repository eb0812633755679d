"""Options of the matrix's smoke legs (ci/matrix.yaml): `--fdx-backend` comes from the
conformance plugin (it also installs the MetaX emulation); `--fdx-plan` names the plan variant."""
from __future__ import annotations

import json

import pytest

PLAN_FLAGS = {"qkv_layout": "--qkv-layout", "grid_thw": "--grid-thw", "dtype": "--dtype"}
GRAPH_KEYS = {"graphs": "use_encoder_cudagraph", "decode_graphs": "use_cudagraph"}   # --graph-optimization-config


def pytest_addoption(parser):
    parser.addoption("--fdx-plan", default="",
                     help="plan variant as KEY=VALUE,... (qkv_layout, grid_thw, dtype, graphs=on|off, decode_graphs=on|off)")


@pytest.fixture(scope="session")
def plan_variant(request) -> dict:
    text = request.config.getoption("--fdx-plan")
    variant = dict(kv.split("=", 1) for kv in text.split(",") if kv)
    unknown = set(variant) - set(PLAN_FLAGS) - set(GRAPH_KEYS)
    if unknown:
        pytest.fail(f"--fdx-plan: unknown keys {sorted(unknown)}")
    return variant


@pytest.fixture(scope="session")
def plan_flags(plan_variant) -> list[str]:
    """The CLI flags that force the variant (graphs: the encoder's; decode_graphs: the decoder's)."""
    flags, graphs = [], {}
    for key, value in plan_variant.items():
        if key in GRAPH_KEYS:
            graphs[GRAPH_KEYS[key]] = value == "on"
        else:
            flags += [PLAN_FLAGS[key], value]
    if graphs:
        flags += ["--graph-optimization-config", json.dumps(graphs)]
    return flags
