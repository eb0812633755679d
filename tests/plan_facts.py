"""Kernel facts for resolving plans in tests: every registered attention backend's own facts
(ops/attention/varlen.py), present as on a CUDA machine without the optional fa3 extra
(ALL_PRESENT), with it (WITH_FA3), or with some reported missing (absent)."""
from __future__ import annotations

import dataclasses

from fastdeploy_ext.ops.attention.varlen import ATTENTION_BACKENDS

WITH_FA3 = {name: b.facts((True, "ok")) for name, b in ATTENTION_BACKENDS.items()}
_NO_FA3 = "fa3_fwd_interface not installed (pip install fastdeploy_ext[fa3], i.e. fa3-fwd)"
ALL_PRESENT = {n: dataclasses.replace(f, present=False, reason=_NO_FA3) if n == "fa3_varlen" else f
               for n, f in WITH_FA3.items()}


def absent(reason: str, *names: str) -> dict:
    """ALL_PRESENT with ``names`` unavailable for ``reason``."""
    return {n: dataclasses.replace(f, present=False, reason=reason) if n in names else f
            for n, f in ALL_PRESENT.items()}
