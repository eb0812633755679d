"""The reference data the conformance suite ships as package data, behind one manifest.

``reference_data/manifest.json`` lists every entry: a name, its kind, its files with their sha256,
what produced it (transformers / torch versions) and what it was computed from. Tests ask for an
entry by name; a name the manifest lacks, a listed file that is missing or a file whose bytes
changed is a ``MissingReference`` error — never a skip — so the suite cannot pass green with its
numerics unchecked, with or without transformers installed.

Kinds: ``model_dir`` (a checkpoint directory), ``files`` (a directory of inputs, e.g. images),
``tensors`` (one safetensors file of expected outputs, string metadata included), ``json``.
New kinds of expected output (e.g. greedy token ids of generation tests) add a producer to
make_references.PRODUCERS and read the entry with ``tensors()`` or ``json()``.

Regenerate (needs transformers 5.24): ``python -m fastdeploy_ext.conformance.make_references``.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path

import torch

REFERENCE_ROOT = Path(__file__).resolve().parent / "reference_data"
MANIFEST_NAME = "manifest.json"
KINDS = ("model_dir", "files", "tensors", "json")
REGENERATE = "python -m fastdeploy_ext.conformance.make_references"


class MissingReference(RuntimeError):
    """A reference the suite needs is absent or altered; the message says which and how to
    regenerate it."""


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


@dataclass(frozen=True)
class ReferenceEntry:
    name: str
    kind: str
    path: str                                  # relative to the manifest's directory
    files: dict[str, str]                      # file (relative to path for directories) -> sha256
    description: str = ""
    inputs: tuple[str, ...] = ()               # names of the entries it was computed from
    produced_with: dict = field(default_factory=dict)

    def to_json(self) -> dict:
        return {"kind": self.kind, "path": self.path, "files": dict(sorted(self.files.items())),
                "description": self.description, "inputs": list(self.inputs),
                "produced_with": self.produced_with}

    @classmethod
    def from_json(cls, name: str, d: dict) -> "ReferenceEntry":
        if d.get("kind") not in KINDS:
            raise MissingReference(f"reference {name}: unknown kind {d.get('kind')!r} (known: {', '.join(KINDS)})")
        return cls(name, d["kind"], d["path"], dict(d["files"]), d.get("description", ""),
                   tuple(d.get("inputs", ())), dict(d.get("produced_with", {})))


@dataclass(frozen=True)
class Manifest:
    root: Path
    entries: dict[str, ReferenceEntry]

    @classmethod
    def load(cls, root: Path | str = REFERENCE_ROOT) -> "Manifest":
        root = Path(root)
        path = root / MANIFEST_NAME
        if not path.is_file():
            raise MissingReference(f"{path}: the reference manifest is missing (is the package data installed? "
                                   f"regenerate with `{REGENERATE}`)")
        data = json.loads(path.read_text())
        return cls(root, {n: ReferenceEntry.from_json(n, d) for n, d in data.get("entries", {}).items()})

    def save(self) -> Path:
        path = self.root / MANIFEST_NAME
        body = {"regenerate": REGENERATE,
                "entries": {n: e.to_json() for n, e in sorted(self.entries.items())}}
        path.write_text(json.dumps(body, indent=1) + "\n")
        return path

    def entry(self, name: str) -> ReferenceEntry:
        if name not in self.entries:
            raise MissingReference(f"reference {name!r} is not in {self.root / MANIFEST_NAME} (entries: "
                                   f"{', '.join(sorted(self.entries)) or 'none'}); regenerate with "
                                   f"`{REGENERATE} --only {name}`")
        return self.entries[name]

    def path(self, name: str) -> Path:
        """The entry's file or directory, after checking every listed file is there with the
        bytes it was produced with."""
        e = self.entry(name)
        base = self.root / e.path
        if not e.files:
            raise MissingReference(f"reference {name}: the manifest lists no files")
        for rel, digest in e.files.items():
            f = base / rel if e.kind in ("model_dir", "files") else base
            if not f.is_file():
                raise MissingReference(f"reference {name}: {f} is missing; regenerate with `{REGENERATE} --only {name}`")
            if sha256_file(f) != digest:
                raise MissingReference(f"reference {name}: {f} does not have the bytes it was produced with "
                                       f"(sha256 mismatch); regenerate with `{REGENERATE} --only {name}`")
        return base

    def files(self, name: str) -> list[Path]:
        base = self.path(name)
        return [base / rel for rel in sorted(self.entry(name).files)]

    def tensors(self, name: str) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
        """(tensors, string metadata) of a ``tensors`` entry."""
        from safetensors import safe_open
        e = self.entry(name)
        if e.kind != "tensors":
            raise MissingReference(f"reference {name} is a {e.kind}, not tensors")
        path = self.path(name)
        with safe_open(str(path), framework="pt") as f:
            return {k: f.get_tensor(k) for k in f.keys()}, dict(f.metadata() or {})

    def json(self, name: str):
        e = self.entry(name)
        if e.kind != "json":
            raise MissingReference(f"reference {name} is a {e.kind}, not json")
        return json.loads(self.path(name).read_text())
