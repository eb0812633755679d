"""The manifest in memory: documents, their pages in manifest order (a page's *ordinal* is its
position) and one state byte per page. Compact on purpose: pages are arrays and ranges, not an
object each, so a coordinator can resume a 10M-page workspace."""
from __future__ import annotations

from array import array
from dataclasses import dataclass, field
from pathlib import Path

from .journal import CorruptWorkspace

# page states (one byte per page, indexed by ordinal = position in the manifest)
PENDING, DONE, FAILED_BEFORE, FAILED_NOW = 0, 1, 2, 3


def page_key(digest: str, page_index: int) -> str:
    return f"{digest[:16]}:{page_index}"


@dataclass(frozen=True)
class PageWork:
    key: str
    path: str
    page_index: int
    page_count: int
    stem: str = ""           # the document's output stem (unique within the workspace)

    @property
    def image_prefix(self) -> str:
        """Where this page's crops go (pass to assemble_page): unique per page."""
        return f"imgs/{self.stem}_{self.page_index + 1:04d}"


@dataclass(slots=True)
class Doc:
    doc_id: int
    path: str
    digest: str
    stem: str
    page_count: int
    # the manifest records that added pages: (first ordinal, page-index ranges); kept as ranges,
    # not a dict per page, so a 10M-page manifest fits in memory
    chunks: list[tuple[int, list[list[int]]]] = field(default_factory=list)
    n_pages: int = 0
    done: int = 0

    def ordinal_of(self, page_index: int) -> int | None:
        for first, ranges in self.chunks:
            for a, b in ranges:
                if a <= page_index <= b:
                    return first + page_index - a
                first += b - a + 1
        return None

    def page_indices(self) -> list[int]:
        return sorted(i for _, ranges in self.chunks for i in expand(ranges))


def ranges_of(indices: list[int]) -> list[list[int]]:
    out: list[list[int]] = []
    for i in sorted(indices):
        if out and out[-1][1] == i - 1:
            out[-1][1] = i
        else:
            out.append([i, i])
    return out


def expand(ranges: list[list[int]]) -> list[int]:
    return [i for a, b in ranges for i in range(a, b + 1)]


class PageTable:
    """Built by replaying manifest records (``apply``), on resume and on every new record alike."""

    def __init__(self, source: str):
        self.source = source                           # the manifest's path, for messages
        self.docs: list[Doc] = []
        self.by_digest: dict[str, Doc] = {}            # digest[:16] (the key's prefix) -> doc
        self.stems: set[str] = set()
        self.error_paths: set[str] = set()
        self.page_doc = array("q")                     # ordinal -> doc_id
        self.page_index = array("q")                   # ordinal -> page index
        self.state = bytearray()                       # ordinal -> PENDING / DONE / ...

    def __len__(self) -> int:
        return len(self.state)

    def new_stem(self, path: str, digest: str) -> str:
        """The output stem of a new document: its file's, or with its digest when taken."""
        stem = Path(path).stem
        return stem if stem not in self.stems else f"{stem}-{digest[:8]}"

    def doc_of(self, ordinal: int) -> Doc:
        return self.docs[self.page_doc[ordinal]]

    def apply(self, body: dict) -> None:
        """One manifest record into memory: the same code on replay and on a fresh add."""
        if "doc" in body:
            doc = Doc(body["doc"], body["path"], body["digest"], body["stem"], body["page_count"])
            self.docs.append(doc)
            self.by_digest[doc.digest[:16]] = doc
            self.stems.add(doc.stem)
            self._add_pages(doc, body)
        elif "pages_of" in body:
            self._add_pages(self.docs[body["pages_of"]], body)
        elif "path_of" in body:
            self.docs[body["path_of"]].path = body["path"]
        elif "input_error" in body:
            self.error_paths.add(body["input_error"])
        else:
            raise CorruptWorkspace(f"{self.source}: unknown record {body}")

    def _add_pages(self, doc: Doc, body: dict) -> None:
        if body["first"] != len(self.state):
            raise CorruptWorkspace(f"{self.source}: pages of {doc.path} start at {body['first']}, expected {len(self.state)}")
        indices = expand(body["pages"])
        doc.chunks.append((body["first"], body["pages"]))
        doc.n_pages += len(indices)
        self.page_doc.extend([doc.doc_id] * len(indices))
        self.page_index.extend(indices)
        self.state.extend(bytes(len(indices)))         # PENDING

    def work(self, ordinal: int) -> PageWork:
        doc = self.doc_of(ordinal)
        i = self.page_index[ordinal]
        return PageWork(page_key(doc.digest, i), doc.path, i, doc.page_count, doc.stem)

    def ordinal(self, key: str) -> int:
        doc = self.by_digest.get(key[:16])
        prefix, _, index = key.partition(":")
        ordinal = doc.ordinal_of(int(index)) if doc is not None and index.isdigit() and len(prefix) == 16 else None
        if ordinal is None:
            raise KeyError(f"page {key!r} is not in this workspace's manifest")
        return ordinal
