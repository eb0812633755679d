"""What ``parse`` reads: the INPUT arguments expanded to files, page ranges (``--pages``), a file's
content digest (the page ids of the manifest) and its page count (PDF pages, TIFF frames, 1 for
other images). File-level problems (missing, empty, encrypted, corrupt) are reported here, before
any page is rendered."""
from __future__ import annotations

import glob
import hashlib
import os
import threading
from dataclasses import dataclass
from pathlib import Path

from .errors import PageError

#: suffixes picked up from folders and globs (an explicit file must have one of them too)
PDF_SUFFIXES = frozenset({".pdf"})
TIFF_SUFFIXES = frozenset({".tif", ".tiff"})
IMAGE_SUFFIXES = frozenset({".png", ".jpg", ".jpeg", ".webp", ".bmp"}) | TIFF_SUFFIXES
SUPPORTED_SUFFIXES = PDF_SUFFIXES | IMAGE_SUFFIXES

_GLOB_CHARS = frozenset("*?[")

#: PDFium is not thread-safe: every use of it in one process goes through this lock (the render
#: pool's workers are processes of their own)
PDFIUM_LOCK = threading.RLock()


def is_pdf(path: str | os.PathLike) -> bool:
    return Path(path).suffix.lower() in PDF_SUFFIXES


def _supported(p: Path) -> bool:
    return p.suffix.lower() in SUPPORTED_SUFFIXES


def _folder_files(folder: Path) -> list[Path]:
    out = []
    for root, dirs, files in os.walk(folder):
        # hidden entries are left out, as globs do (".git", macOS "._x.pdf" resource forks)
        dirs[:] = [d for d in dirs if not d.startswith(".")]
        for name in files:
            p = Path(root) / name
            if not name.startswith(".") and _supported(p) and p.is_file():
                out.append(p)
    # sorted by path components: a deterministic order (the manifest's), a folder's files together
    return sorted(out, key=lambda p: p.relative_to(folder).parts)


def _list_file_entries(list_path: Path) -> list[str]:
    if not list_path.is_file():
        raise ValueError(f"input list @{list_path}: file not found")
    entries = []
    for raw in list_path.read_text(encoding="utf-8").splitlines():
        line = raw.strip()          # whole-line comments only: '#' may be part of a file name
        if line and not line.startswith("#"):
            at = "@" if line.startswith("@") else ""        # a list may name other lists
            p = Path(line[len(at):]).expanduser()
            entries.append(at + str(p if p.is_absolute() else list_path.parent / p))
    return entries


def _expand_one(item: str, seen_lists: frozenset[Path]) -> list[Path]:
    if item.startswith("@"):
        list_path = Path(item[1:]).expanduser().resolve()
        if list_path in seen_lists:
            raise ValueError(f"input list @{item[1:]} includes itself")
        out: list[Path] = []
        for entry in _list_file_entries(list_path):
            out.extend(_expand_one(entry, seen_lists | {list_path}))
        return out
    p = Path(item).expanduser()
    if p.is_dir():
        return _folder_files(p)
    if p.is_file():
        if not _supported(p):
            raise ValueError(f"input {item}: unsupported file type {p.suffix or '(no suffix)'!r} "
                             f"(supported: {', '.join(sorted(SUPPORTED_SUFFIXES))})")
        return [p]
    if _GLOB_CHARS & set(item):
        out = []
        for m in sorted(glob.glob(os.path.expanduser(item), recursive=True)):
            mp = Path(m)
            out.extend(_folder_files(mp) if mp.is_dir() else [mp] if _supported(mp) else [])
        if not out:
            raise ValueError(f"input {item}: the pattern matches no supported file")
        return out
    raise ValueError(f"input {item}: no such file or folder")


def expand_inputs(inputs: list[str]) -> list[Path]:
    """Files, folders (recursive, sorted), globs and ``@list.txt`` files (one path per line,
    ``#`` comments, paths relative to the list's folder) -> the files to parse, in the order
    given, each once (by resolved path). Raises ValueError naming the first bad input."""
    if not inputs:
        raise ValueError("no inputs given")
    seen: set[Path] = set()
    out: list[Path] = []
    for item in inputs:
        for p in _expand_one(str(item), frozenset()):
            key = p.resolve()
            if key not in seen:
                seen.add(key)
                out.append(p)
    return out


# --------------------------------------------------------------------------------------------
# page ranges
# --------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class PageRanges:
    """1-based inclusive ranges as given (``end`` None: to the last page); None ranges = all pages."""
    ranges: tuple[tuple[int, int | None], ...] | None = None

    def contains(self, i0: int) -> bool:
        """Whether the 0-based page index ``i0`` is selected."""
        if self.ranges is None:
            return True
        n = i0 + 1
        return any(lo <= n and (hi is None or n <= hi) for lo, hi in self.ranges)

    def select(self, page_count: int) -> list[int]:
        """The selected 0-based indices of a document of ``page_count`` pages, ascending."""
        return [i for i in range(page_count) if self.contains(i)]

    def __str__(self) -> str:
        if self.ranges is None:
            return "all"
        return ",".join(f"{lo}-" if hi is None else str(lo) if lo == hi else f"{lo}-{hi}" for lo, hi in self.ranges)


def parse_page_ranges(text: str | None) -> PageRanges:
    """``"1-3,7"``, ``"5-"``, ``"2"`` (1-based, inclusive); None or "" or "all" = every page."""
    if text is None or not text.strip() or text.strip().lower() == "all":
        return PageRanges(None)
    ranges = []
    for part in text.split(","):
        part = part.strip()
        lo_s, dash, hi_s = part.partition("-")
        try:
            lo = int(lo_s)
            hi = (int(hi_s) if hi_s.strip() else None) if dash else lo
        except ValueError:
            raise ValueError(f"--pages: {part!r} is not a page number or range "
                             f"(use 1-based pages like '1-3,7' or '5-')") from None
        if lo < 1 or (hi is not None and hi < lo):
            raise ValueError(f"--pages: {part!r} is not a valid range (pages start at 1, and a range's end "
                             f"must not precede its start)")
        ranges.append((lo, hi))
    return PageRanges(tuple(ranges))


# --------------------------------------------------------------------------------------------
# file identity and size
# --------------------------------------------------------------------------------------------

def file_digest(path: str | os.PathLike, chunk: int = 1 << 20) -> str:
    """sha256 hex of the file's bytes, read in chunks (a 1 GB PDF is never held in memory)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def check_file(path: str | os.PathLike) -> None:
    """The checks every input gets before it is opened: it exists, is a file, and is not empty."""
    p = Path(path)
    if not p.exists():
        raise PageError("input", f"{p}: file not found")
    if not p.is_file():
        raise PageError("input", f"{p}: not a regular file")
    if p.stat().st_size == 0:
        raise PageError("input", f"{p}: file is empty (0 bytes)")


#: how much of each end of a PDF is searched for its trailer's /Encrypt entry
_TRAILER_SPAN = 64 * 1024


def pdf_open_error(path: str | os.PathLike, err: Exception) -> PageError:
    """PDFium's load failure -> a message that says what is wrong with the file. PDFium's error
    code is its *last* error, which a failure without a code of its own leaves stale (the
    password error of an earlier file), so encryption is read from the file's trailer instead:
    an /Encrypt entry near either end (a linearized file has a trailer at the start)."""
    text = str(err)
    what = "corrupt"
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            head = f.read(_TRAILER_SPAN)
            f.seek(max(0, size - _TRAILER_SPAN))
            tail = f.read()
        if b"%PDF-" not in head[:1024]:
            what = "not a PDF (no %PDF- header)"
        elif b"/Encrypt" in tail or b"/Encrypt" in head:
            return PageError("input", f"{path}: the PDF is encrypted (password-protected); decrypt it first ({text})")
        elif b"%%EOF" not in tail[-1024:]:
            what = "truncated (no %%EOF marker at its end)"
        else:
            what = "corrupt or has no pages"
    except OSError:
        pass
    # a password error here is stale (the file has no /Encrypt): PDFium's words would mislead
    said = "" if "password" in text.lower() else f" ({text})"
    return PageError("input", f"{path}: the file is {what} and cannot be opened as a PDF{said}")


def open_pdf(path: str | os.PathLike):
    """A pypdfium2 document (the caller closes it), or PageError('input') saying why not."""
    import pypdfium2 as pdfium

    check_file(path)
    try:
        return pdfium.PdfDocument(str(path))
    except pdfium.PdfiumError as e:
        raise pdf_open_error(path, e) from None
    except OSError as e:
        raise PageError("input", f"{path}: cannot read the file ({e.strerror or e})") from None


def count_pages(path: str | os.PathLike) -> int:
    """PDF pages, TIFF frames, or 1 for other images. PageError('input') for a file that cannot be
    opened (missing, empty, corrupt, encrypted, or a PDF with no pages)."""
    if is_pdf(path):
        with PDFIUM_LOCK:                       # the coordinator may count from several threads
            doc = open_pdf(path)
            try:
                n = len(doc)
            finally:
                doc.close()
        if n == 0:
            raise PageError("input", f"{path}: the PDF has no pages")
        return n
    with open_image_header(path) as img:
        return max(1, int(getattr(img, "n_frames", 1)))       # TIFF frames; 1 for other images


def open_image_header(path: str | os.PathLike):
    """The image opened lazily with PIL (its header read, no pixel decoded; the caller closes
    it), or PageError('input') for a missing, empty, corrupt file or a bomb's header."""
    import warnings

    from PIL import Image

    check_file(path)
    try:
        with warnings.catch_warnings():
            # PIL warns above its own limit; the decode cap is checked before any decode
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            return Image.open(path)
    except Image.DecompressionBombError:
        raise PageError("input", f"{path}: the image header claims more pixels than PIL's bomb limit "
                                 f"(refused before decoding as a possible decompression bomb)") from None
    except Image.UnidentifiedImageError:
        raise PageError("input", f"{path}: not a recognised image format (corrupt or not an image)") from None
    except Exception as e:  # noqa: BLE001 - OSError and PIL's parser errors: a bad input file
        raise PageError("input", f"{path}: cannot open the image ({type(e).__name__}: {e})") from None
