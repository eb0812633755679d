"""Packaging: every third-party module the package imports is declared in setup.py (a core
requirement or an extra), the LICENSE is the Apache-2.0 text setup.py names, and the version
the CLI prints is the package's."""
from __future__ import annotations

import ast
import hashlib
import re
import sys
from pathlib import Path
from unittest import mock


REPO = Path(__file__).resolve().parents[1]

# import name -> distribution name, where they differ
DIST_OF = {"PIL": "pillow", "yaml": "pyyaml", "cpuinfo": "py-cpuinfo", "pynvml": "nvidia-ml-py",
           "prometheus_client": "prometheus-client", "paddle": "paddlepaddle"}
# imported but deliberately not declared, with the reason
UNDECLARED_OK = {"pydantic": "comes with fastapi (the [serve] extra), whose request models it is",
                 "starlette": "comes with fastapi (the [serve] extra), its ASGI layer",
                 "torchvision": "optional: bench preprocess reports the torchvision processor 'unavailable' without it"}


def setup_kwargs() -> dict:
    import setuptools
    with mock.patch.object(setuptools, "setup") as setup:
        src = (REPO / "setup.py").read_text()
        exec(compile(src, "setup.py", "exec"), {"__name__": "__main__"})
    return setup.call_args.kwargs


def declared(kw: dict) -> set[str]:
    reqs = list(kw["install_requires"]) + [r for extra in kw["extras_require"].values() for r in extra]
    return {re.split(r"[<>=!;\[ ]", r, maxsplit=1)[0].strip().lower() for r in reqs}


def third_party_imports(roots=("fastdeploy_ext", "backends")) -> dict[str, str]:
    """Top-level third-party module -> one file importing it."""
    out = {}
    for root in roots:
        for f in sorted((REPO / root).rglob("*.py")):
            for node in ast.walk(ast.parse(f.read_text(), str(f))):
                names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                    [node.module] if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module else []
                for n in names:
                    top = n.split(".")[0]
                    if top not in sys.stdlib_module_names and top not in ("fastdeploy_ext", "backends"):
                        out.setdefault(top, str(f.relative_to(REPO)))
    return out


def undeclared(imports: dict[str, str], decl: set[str]) -> list[str]:
    return sorted(f"{m} ({where})" for m, where in imports.items()
                  if DIST_OF.get(m, m).lower().replace("_", "-") not in {d.replace("_", "-") for d in decl}
                  and m not in UNDECLARED_OK)


def test_every_import_is_declared():
    kw = setup_kwargs()
    imports = third_party_imports()
    assert "tqdm" in imports                          # the progress bars
    assert undeclared(imports, declared(kw)) == []


def test_the_check_finds_an_undeclared_import():
    kw = setup_kwargs()
    decl = declared(kw) - {"tqdm"}
    missing = undeclared(third_party_imports(), decl)
    assert len(missing) == 1 and missing[0].startswith("tqdm (fastdeploy_ext/"), missing


def test_license_is_apache_2():
    kw = setup_kwargs()
    assert kw["license"] == "Apache-2.0" and kw["license_files"] == ["LICENSE"]
    text = (REPO / "LICENSE").read_text()
    assert text.lstrip().startswith("Apache License") and "Version 2.0, January 2004" in text
    # the canonical https://www.apache.org/licenses/LICENSE-2.0.txt
    assert hashlib.sha256(text.encode()).hexdigest() == "cfc7749b96f63bd31c3c42b5c471bf756814053e847c10f3eb003417bc523d30"


def test_version_matches_setup():
    from fastdeploy_ext import __version__
    assert setup_kwargs()["version"] == __version__
