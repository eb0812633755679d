"""Kernel facts for resolving plans in tests: every registered attention backend's own facts
(ops/attention/varlen.py), as if present, or with some reported missing."""
from __future__ import annotations

import dataclasses

from fastdeploy_ext.ops.attention.varlen import ATTENTION_BACKENDS

ALL_PRESENT = {name: b.facts((True, "ok")) for name, b in ATTENTION_BACKENDS.items()}


def absent(reason: str, *names: str) -> dict:
    """ALL_PRESENT with ``names`` unavailable for ``reason``."""
    return {n: dataclasses.replace(f, present=False, reason=reason) if n in names else f
            for n, f in ALL_PRESENT.items()}
