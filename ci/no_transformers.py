"""pytest plugin for the CI leg that proves the conformance suite needs no transformers:
`PYTHONPATH=ci pytest -p no_transformers ...` makes every import of transformers raise
ImportError, as on a machine where it is not installed (a vendor's MetaX box may well lack it).
The suite then runs every test against its shipped references; a skip would fail the session."""
from __future__ import annotations

import importlib.abc
import sys

BLOCKED = "transformers"


class _BlockTransformers(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == BLOCKED or name.startswith(BLOCKED + "."):
            raise ImportError(f"import of {name} blocked: this CI leg runs without transformers")
        return None


if any(m == BLOCKED or m.startswith(BLOCKED + ".") for m in sys.modules):
    raise RuntimeError("transformers was imported before the blocker: load it with -p no_transformers")
sys.meta_path.insert(0, _BlockTransformers())


def pytest_report_header(config):
    return "transformers: BLOCKED from import (no_transformers plugin)"
