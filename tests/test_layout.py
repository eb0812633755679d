"""The house's layout: no import circles among the modules of fastdeploy_ext or backends,
benchmarks never import the command line, no module outside models/<family>/ imports a family,
and no new CUDA branch outside backends/ (each checker is shown to fire on a planted violation)."""
from __future__ import annotations

import re
from pathlib import Path

import pytest
from .import_graph import cycles, describe, import_graph, imported_names, module_files

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


# --------------------------------------------------------------- the model-family seam
FAMILY_PREFIX = "fastdeploy_ext.models."
FAMILY_NEUTRAL = {"fastdeploy_ext.models", "fastdeploy_ext.models.interface", "fastdeploy_ext.models.registry",
                  "fastdeploy_ext.models.checkpoint_checks", "fastdeploy_ext.models.eager_decoder"}   # shared helpers
# modules that still import a family (PaddleOCR-VL's conformance references:
# the suite's tests reach a family only through its ConformanceFixture); the list may only
# shrink: a module outside it that imports a family fails the test below
STILL_IMPORTING_A_FAMILY = ("fastdeploy_ext.conformance.make_references", "fastdeploy_ext.conformance.tiny_text_model")
# a family built on another family's code, declared: PP-DocLayoutV2 is V3's detector (config,
# modules, loader, processor, post-processing: one implementation) without the mask branch,
# plus its own reading-order network. Any other family-to-family import still fails.
FAMILY_BASES = {"fastdeploy_ext.models.pp_doclayout_v2": "fastdeploy_ext.models.pp_doclayout_v3"}


def family_imports(module: str, path: Path, known: set[str]) -> set[str]:
    """The family modules (fastdeploy_ext.models.<family>...) ``module`` imports, other than its
    own family's and the neutral interface/registry."""
    own = ".".join(module.split(".")[:3]) if module.startswith(FAMILY_PREFIX) else None
    allowed = {own, FAMILY_BASES.get(own)}
    return {n for n in imported_names(module, path, known)
            if n.startswith(FAMILY_PREFIX) and n not in FAMILY_NEUTRAL
            and ".".join(n.split(".")[:3]) not in allowed}


def _family_violations(roots) -> dict[str, set[str]]:
    files = {m: f for root in roots for m, f in module_files(root).items()}
    known = set(files)
    found = {m: family_imports(m, f, known) for m, f in files.items()}
    return {m: names for m, names in found.items() if names}


def test_no_family_import_outside_its_folder():
    bad = _family_violations([REPO / "fastdeploy_ext", REPO / "backends"])
    unexpected = {m: sorted(n) for m, n in bad.items() if not m.startswith(STILL_IMPORTING_A_FAMILY)}
    assert not unexpected, unexpected
    for cleaned in ("fastdeploy_ext.runner", "fastdeploy_ext.torch_runner", "fastdeploy_ext.text_runner",
                    "fastdeploy_ext.graphs", "fastdeploy_ext.plan", "fastdeploy_ext.engine.llm_engine",
                    "fastdeploy_ext.interop.paddle", "backends.cpu_amx.probe"):
        assert cleaned not in bad, (cleaned, bad.get(cleaned))


@pytest.mark.parametrize("planted", [
    "def f():\n    from .models.paddleocr_vl.loader import load_vision\n",           # lazy, relative
    "from fastdeploy_ext.models.paddleocr_vl import config\n",                       # absolute, a package
    "import fastdeploy_ext.models.paddleocr_vl.text\n",
])
def test_family_import_check_fires_on_a_planted_import(tmp_path, planted):
    pkg = tmp_path / "fastdeploy_ext"
    for rel in ("__init__.py", "models/__init__.py", "models/interface.py", "models/paddleocr_vl/__init__.py",
                "models/paddleocr_vl/loader.py", "models/paddleocr_vl/config.py", "models/paddleocr_vl/text.py"):
        (pkg / rel).parent.mkdir(parents=True, exist_ok=True)
        (pkg / rel).write_text("from .config import x\nfrom ..interface import y\n" if rel.endswith("loader.py") else "")
    (pkg / "torch_runner.py").write_text((REPO / "fastdeploy_ext" / "torch_runner.py").read_text() + planted)
    bad = _family_violations([pkg])
    assert list(bad) == ["fastdeploy_ext.torch_runner"], bad          # the family's own import is fine
    assert all(n.startswith("fastdeploy_ext.models.paddleocr_vl") for n in bad["fastdeploy_ext.torch_runner"])


def test_only_the_declared_family_base_may_be_imported_by_a_family(tmp_path):
    pkg = tmp_path / "fastdeploy_ext"
    for fam in ("paddleocr_vl", "pp_doclayout_v3", "pp_doclayout_v2"):
        for rel in ("__init__.py", "model.py"):
            (pkg / "models" / fam / rel).parent.mkdir(parents=True, exist_ok=True)
            (pkg / "models" / fam / rel).write_text("")
    for rel in ("__init__.py", "models/__init__.py"):
        (pkg / rel).write_text("")
    (pkg / "models/pp_doclayout_v2/model.py").write_text("from ..pp_doclayout_v3.model import x\n")
    assert _family_violations([pkg]) == {}
    (pkg / "models/pp_doclayout_v2/model.py").write_text("from ..paddleocr_vl.model import x\n")
    (pkg / "models/pp_doclayout_v3/model.py").write_text("from ..pp_doclayout_v2.model import x\n")
    assert _family_violations([pkg]) == {"fastdeploy_ext.models.pp_doclayout_v2.model": {"fastdeploy_ext.models.paddleocr_vl.model"},
                                         "fastdeploy_ext.models.pp_doclayout_v3.model": {"fastdeploy_ext.models.pp_doclayout_v2.model"}}


# --------------------------------------------------------------- CUDA branches live in backends
CUDA_BRANCH = re.compile(r"""\.type\s*[!=]=\s*["']cuda["']|torch\.cuda\.""")
# where a CUDA test belongs: the kernels, the CUDA sync-debug mode, the CUDA-only benches
CUDA_ALLOWED = ("fastdeploy_ext/ops/", "fastdeploy_ext/sync_guard.py", "fastdeploy_ext/bench/attention.py",
                "fastdeploy_ext/bench/layer_ops.py", "fastdeploy_ext/bench/gemm_gelu.py")
# modules with sites still to move behind the device API (fastdeploy_ext/device_api.py), with
# their number of sites (may only go down), and modules exempt as a whole: none left
CUDA_REMAINING: dict[str, int] = {}
CUDA_REMAINING_WHOLE: tuple[str, ...] = ()


def cuda_branch_sites(text: str) -> int:
    return sum(1 for line in text.splitlines() if CUDA_BRANCH.search(line) and not line.lstrip().startswith("#"))


def _cuda_violations(root: Path) -> dict[str, int]:
    out = {}
    for f in sorted((root / "fastdeploy_ext").rglob("*.py")):
        rel = f.relative_to(root).as_posix()
        if rel.startswith(CUDA_ALLOWED) or rel.startswith(CUDA_REMAINING_WHOLE):
            continue
        n = cuda_branch_sites(f.read_text())
        if n > CUDA_REMAINING.get(rel, 0):
            out[rel] = n
    return out


def test_no_new_cuda_branch_outside_backends():
    assert not _cuda_violations(REPO), _cuda_violations(REPO)
    # the KV pool's free-memory query is the backends' hook (DeviceRunner.device_memory)
    assert "mem_get_info" not in (REPO / "fastdeploy_ext/engine/llm_engine.py").read_text()


@pytest.mark.parametrize("planted", ['    if x.device.type == "cuda":\n        pass\n',
                                     "    free, total = torch.cuda.mem_get_info(d)\n"])
def test_cuda_branch_check_fires_on_a_planted_branch(tmp_path, planted):
    planted_in = ("fastdeploy_ext/engine/llm_engine.py", "fastdeploy_ext/runner.py", "fastdeploy_ext/bench/vision.py")
    for rel in planted_in:
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text((REPO / rel).read_text() + "\n\ndef planted(x, d):\n" + planted)
    assert set(_cuda_violations(tmp_path)) == set(planted_in)
