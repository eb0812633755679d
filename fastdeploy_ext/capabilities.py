"""The capability table: which rows exist, and where each one came from.

Every backend ships its own rows; the framework ships none and names no device. The table is
assembled when a runner is created (nothing is read at import time):

1. **Shipped rows.** For each backend registered under the entry-point group
   ``fastdeploy_ext.backends`` (built-ins and out-of-tree vendors alike), the YAML file returned
   by ``BackendClass.capabilities_resource()``. The default is ``capabilities.yaml`` in the
   package of the module that defines the runner class: for ``my_pkg.runner:MyRunner`` that is
   ``my_pkg/capabilities.yaml`` — ship it as package data (``package_data={"my_pkg":
   ["capabilities.yaml"]}``). Override the classmethod to ship rows from elsewhere, or return
   None to ship none. Two entry points of one package (``cpu_amx`` and ``cpu``) read the file once.
   Rows keep their file order; across backends, entry-point order.
2. **Override file.** ``--capabilities FILE.yaml`` (``PlanRequest.capabilities``), else the
   ``FD_CAPABILITIES`` environment variable, names a YAML file in the same schema. A row whose
   name already exists is updated key by key (each top-level key given replaces the shipped one;
   under ``kernels:`` each kind given replaces the shipped list of that kind and the other kinds
   are kept; keys the schema does not know are an error); a new row must be complete and is
   placed ahead of the shipped rows, so it matches first.

Errors (missing file, bad YAML, incomplete row, unknown key or kernel kind) raise
:class:`CapabilityError`, a ``PlanError`` naming the file and the row. Each row records its
origin in ``row.source``; the plan's notes and ``fastdeploy-ext info`` show it.

Schema (one entry under ``rows:`` per device family)::

    rows:
      my_row:                          # the name plans and errors report
        runner: myvendor               # the backend (entry-point name) that may pick this row
        match: {...}                   # free-form; read by that runner's row_matches()
        dtypes: [bfloat16, float32]    # what --dtype may ask for
        default_dtype: bfloat16
        kernels:                       # per kernel kind (plan.ComponentKind): backends in preference order
          vision_varlen_attention:
            - {backend: sdpa, dtypes: [bfloat16]}    # optional reads_strides: false (not verified here)
          paged_decoder_attention:
            - {backend: sdpa_paged, head_dims: [1, 512], dtypes: [bfloat16], graph_safe: false}
        host_grid_thw: true            # metadata from host ints (zero device syncs) is supported
        graphs: {kinds: [encoder], default: false}    # capture kinds and whether on by default
        fused_layers: {supported: false, default: false}   # optional (absent = unsupported)
        kv_block_size: 16              # optional: tokens per KV block (default 16)
        async_scheduling: {default: true}   # optional: overlapped scheduling unless the user says (default true)
        mixed_steps: {default: true}   # optional: decode rows in prefill steps unless the user says (default true)

(``vision_varlen_attention`` entries name backends of ``fastdeploy_ext/ops/attention/varlen.py``
or ones the row's backend contributes (``DeviceRunner.kernel_backends``); the objects own their
kernel facts (strided reads, head dims, graph safety); a row gives the dtypes and may only
narrow strided reads with ``reads_strides: false``. ``paged_decoder_attention`` entries name
backends of ``fastdeploy_ext/ops/attention/paged.py`` (or contributed ones); ``graph_safe``
there means the decode can be captured, which the `decoder` graph kind needs. A model
component whose kind the row lists no backend for is a PlanError naming the row and the kind.)

The form rows had before ``kernels:`` still reads, in shipped rows and override files alike:
``attention:`` is ``kernels.vision_varlen_attention`` and ``text_attention:`` is
``kernels.paged_decoder_attention`` (a complete row of that form without ``text_attention``
gets the portable ``sdpa_paged``, as it always did). Giving one kind both ways is an error.

API: :func:`capability_table` (the assembled table), :func:`shipped_rows` (one backend's rows).
"""
from __future__ import annotations

import dataclasses
import sys
from pathlib import Path
from typing import Any, Iterable

import yaml

from . import envs
from .plan import CapabilityRow, PlanError
from .plan.table import normalize_kernels

__all__ = ["CapabilityError", "capability_table", "shipped_rows"]


class CapabilityError(PlanError):
    """A capability file is missing, unreadable or malformed; names the file and the row."""


def _read(resource: Any, origin: str) -> dict[str, dict]:
    try:
        text = resource.read_text() if hasattr(resource, "read_text") else Path(resource).read_text()
    except OSError as e:
        raise CapabilityError(f"capability file {origin}: cannot read it: {e}") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise CapabilityError(f"capability file {origin}: not valid YAML: {e}") from None
    if not isinstance(data, dict) or not isinstance(data.get("rows"), dict):
        raise CapabilityError(f"capability file {origin}: needs a top-level 'rows:' mapping of row name -> row")
    for name, row in data["rows"].items():
        if not isinstance(row, dict):
            raise CapabilityError(f"capability file {origin}: row {name!r} must be a mapping, got {type(row).__name__}")
    return {str(k): dict(v) for k, v in data["rows"].items()}


def _normalized(name: str, raw: dict, origin: str, *, complete: bool) -> dict:
    """``raw`` with the old keys read as ``kernels:`` (plan/table.py); ``complete``: a whole row
    (shipped, or added by an override), which gets the old form's defaults."""
    try:
        return normalize_kernels(name, raw, old_form_defaults=complete)
    except ValueError as e:
        raise CapabilityError(f"capability row {name} ({origin}): {e}") from None


def _merged(base: dict, update: dict) -> dict:
    """A shipped row updated by an override's keys: top level key by key, ``kernels`` kind by kind."""
    out = {**base, **update}
    if "kernels" in update and "kernels" in base:
        out["kernels"] = {**base["kernels"], **update["kernels"]}
    return out


def _build(name: str, raw: dict, source: str) -> CapabilityRow:
    try:
        row = CapabilityRow.from_dict(name, raw)
    except KeyError as e:
        raise CapabilityError(f"capability row {name} ({source}): missing key {e}") from None
    except (TypeError, ValueError, AttributeError) as e:
        raise CapabilityError(f"capability row {name} ({source}): malformed: {e}") from None
    if row.default_dtype not in row.dtypes:
        raise CapabilityError(f"capability row {name} ({source}): default_dtype {row.default_dtype} "
                              f"is not in its dtypes {list(row.dtypes)}")
    return dataclasses.replace(row, source=source)


def _origin(resource: Any) -> str:
    """A short, stable name for a shipped file: package-relative when possible."""
    path = str(resource)
    for entry in sorted(sys.path, key=len, reverse=True):
        if entry and path.startswith(entry.rstrip("/") + "/"):
            return path[len(entry.rstrip("/")) + 1:]
    return path


def _shipped_raw(backends: Iterable[type]) -> list[tuple[str, dict, str]]:
    out: list[tuple[str, dict, str]] = []
    seen_files: set[str] = set()
    owner: dict[str, str] = {}
    for cls in backends:
        resource = cls.capabilities_resource()
        if resource is None or str(resource) in seen_files:
            continue
        seen_files.add(str(resource))
        origin = _origin(resource)
        for name, raw in _read(resource, origin).items():
            raw = _normalized(name, raw, origin, complete=True)
            if name in owner:
                raise CapabilityError(f"capability row {name} is shipped twice: by {owner[name]} and by {origin}")
            owner[name] = origin
            out.append((name, raw, origin))
    return out


def shipped_rows(cls) -> dict[str, CapabilityRow]:
    """The rows one backend class ships (no override applied)."""
    return {name: _build(name, raw, origin) for name, raw, origin in _shipped_raw([cls])}


def capability_table(override: str | None = None, backends: Iterable[type] | None = None
                     ) -> dict[str, CapabilityRow]:
    """Shipped rows of ``backends`` (default: every registered backend), then the override file
    ``override`` (default: ``FD_CAPABILITIES``; empty: none) applied as the module docstring says."""
    if backends is None:
        from .runner import available_backends     # the registry imports this module's users
        backends = available_backends().values()
    shipped = _shipped_raw(backends)
    if override is None:
        override = envs.FD_CAPABILITIES.get()
    if not override:
        return {name: _build(name, raw, origin) for name, raw, origin in shipped}

    known_keys = {k for _, raw, _ in shipped for k in raw}
    rows = {name: (raw, origin) for name, raw, origin in shipped}
    added: dict[str, tuple[dict, str]] = {}
    path = Path(override)
    if not path.is_file():
        raise CapabilityError(f"capability override {override}: no such file (from --capabilities or FD_CAPABILITIES)")
    for name, raw in _read(path, str(path)).items():
        raw = _normalized(name, raw, str(path), complete=name not in rows)
        if name in rows:
            unknown = sorted(set(raw) - known_keys)
            if unknown:
                raise CapabilityError(f"capability override {path}: row {name}: unknown keys {unknown} "
                                      f"(known: {sorted(known_keys)})")
            base, origin = rows[name]
            given = sorted(k for k in raw if k != "kernels") + [f"kernels.{k}" for k in sorted(raw.get("kernels", {}))]
            rows[name] = (_merged(base, raw), f"{origin}, overridden by {path} ({', '.join(given)})")
        else:
            unknown = sorted(set(raw) - known_keys) if known_keys else []
            if unknown:
                raise CapabilityError(f"capability override {path}: new row {name}: unknown keys {unknown} "
                                      f"(known: {sorted(known_keys)})")
            added[name] = (raw, f"{path} (added)")
    return {name: _build(name, raw, origin) for name, (raw, origin) in {**added, **rows}.items()}
