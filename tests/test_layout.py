"""The house's layout: no import circles among the modules of fastdeploy_ext or backends, and
benchmarks never import the command line (the checker itself is shown to fire)."""
from __future__ import annotations

from pathlib import Path

import pytest
from .import_graph import cycles, describe, import_graph

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("package", ["fastdeploy_ext", "backends"])
def test_no_import_cycles(package):
    graph = import_graph(REPO / package)
    assert len(graph) > 3, graph               # the walk found the package's modules
    found = cycles(graph)
    assert not found, "\n".join(describe(graph, c) for c in found)


def test_benchmarks_never_import_entrypoints():
    graph = import_graph(REPO / "fastdeploy_ext")
    bad = {m: sorted(n for n in deps if n.startswith("fastdeploy_ext.entrypoints"))
           for m, deps in graph.items() if m.startswith("fastdeploy_ext.bench")}
    assert graph["fastdeploy_ext.entrypoints.cli"] & {m for m in graph if m.startswith("fastdeploy_ext.bench")}
    assert not any(bad.values()), bad


def _package(tmp_path: Path, files: dict[str, str]) -> Path:
    root = tmp_path / "pkg"
    for name, text in files.items():
        f = root / name
        f.parent.mkdir(parents=True, exist_ok=True)
        f.write_text(text)
    return root


@pytest.mark.parametrize("files", [
    {"__init__.py": "", "a.py": "from . import b\n", "b.py": "from .a import x\n"},           # relative
    {"__init__.py": "", "a.py": "import pkg.sub.c\n", "sub/__init__.py": "",
     "sub/c.py": "def f():\n    from ..a import g\n"},                                           # lazy, absolute
    {"__init__.py": "", "a.py": "from .sub import c\n", "sub/__init__.py": "",
     "sub/c.py": "from ..b import y\n", "b.py": "from pkg import a\n"},                           # three modules
])
def test_checker_finds_a_planted_circle(tmp_path, files):
    graph = import_graph(_package(tmp_path, files))
    found = cycles(graph)
    assert len(found) == 1 and "pkg.a" in found[0], (graph, found)
    assert "circle: " in describe(graph, found[0])


def test_checker_passes_an_acyclic_package(tmp_path):
    root = _package(tmp_path, {"__init__.py": "", "a.py": "from . import b\nimport os\n",
                               "b.py": "from .c import z\n", "c.py": "import json\n"})
    graph = import_graph(root)
    assert graph["pkg.a"] == {"pkg.b"} and graph["pkg.b"] == {"pkg.c"} and not cycles(graph)
