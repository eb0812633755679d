"""Load PaddleX's own PaddleOCR-VL client modules (tests/data/paddlex_client/, copied unmodified
from the 3.7.2 wheel) without PaddleX: every other `paddlex.*` module they import is a stub.

The stubs stand only for what the client path never runs (Paddle, the local predictors, the
benchmark timers): decorators are identities, base classes are empty, ``require_*`` checks pass.
Everything that builds or sends a request (`GenAIClient`, the predictor's request specs, the
JPEG data URLs, the `openai` client underneath) is PaddleX's code as shipped."""
from __future__ import annotations

import base64
import hashlib
import importlib.abc
import importlib.util
import logging
import sys
import types
from pathlib import Path

ROOT = Path(__file__).parent / "data" / "paddlex_client"
REAL = {"paddlex.inference.models.common.genai", "paddlex.inference.models.doc_vlm.predictor",
        "paddlex.inference.models.doc_vlm.constants", "paddlex.inference.models.doc_vlm.utils"}


def _identity_decorator(*_a, **_k):
    return lambda f: f


class _Benchmark:
    timeit_with_options = staticmethod(_identity_decorator)


# names the real modules import from stubbed ones; anything else becomes an empty class
STUB_ATTRS = {
    "paddlex.utils": {"logging": logging.getLogger("paddlex")},
    "paddlex.utils.deps": {"class_requires_deps": _identity_decorator,
                           "require_genai_client_plugin": lambda *a, **k: None},
    "paddlex.inference.utils.benchmark": {"benchmark": _Benchmark(), "add_inference_operations": lambda *a: None},
}


class _StubModule(types.ModuleType):
    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        cls = type(name, (), {"__init__": lambda self, *a, **k: None})
        setattr(self, name, cls)
        return cls


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname, path=None, target=None):
        if fullname != "paddlex" and not fullname.startswith("paddlex."):
            return None
        if fullname in REAL:
            file = ROOT / (fullname.replace(".", "/") + ".py")
            return importlib.util.spec_from_file_location(fullname, file)
        return importlib.util.spec_from_loader(fullname, self, is_package=True)

    def create_module(self, spec):
        m = _StubModule(spec.name)
        m.__path__ = []
        for k, v in STUB_ATTRS.get(spec.name, {}).items():
            setattr(m, k, v)
        return m

    def exec_module(self, module):
        pass


def record_mismatches() -> list[str]:
    """Files whose sha256 differs from the wheel's RECORD line (empty: unmodified copies)."""
    bad = []
    for line in (ROOT / "RECORD").read_text().splitlines():
        rel, digest, _size = line.rsplit(",", 2)
        got = base64.urlsafe_b64encode(hashlib.sha256((ROOT / rel).read_bytes()).digest()).rstrip(b"=").decode()
        if f"sha256={got}" != digest:
            bad.append(rel)
    return bad


def load():
    """(genai module, doc_vlm.predictor module), imported under the stubs. Idempotent."""
    if not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.insert(0, _Finder())
    import importlib
    return (importlib.import_module("paddlex.inference.models.common.genai"),
            importlib.import_module("paddlex.inference.models.doc_vlm.predictor"))


def unload() -> None:
    for name in [n for n in sys.modules if n == "paddlex" or n.startswith("paddlex.")]:
        del sys.modules[name]
    sys.meta_path[:] = [f for f in sys.meta_path if not isinstance(f, _Finder)]
