"""Synthetic OmniDocBench-shaped pages with a planted layout, as PDFs: what tests and
``bench parse`` feed the pipeline when they need a known block mix (the layout model runs for
its cost, but with random weights its boxes mean nothing; the planted ones are used instead).

Per page (an OmniDocBench-like block mix, as ``bench parse`` plants it): 2 titles (~900x60 px),
9 paragraphs (~1000x180), 1 table (~1000x600), 2 display formulas (~500x80) and 2 captions
(~800x60), in page pixels at 144 dpi.
On an A4 page (1190x1684 px at 144 dpi) that mix does not fit in one column at full height
(its heights sum to 2,620 px), so heights are scaled by one factor to fit the page between its
margins (0.55 on A4), widths kept; pass a taller ``PageSpec`` to get the nominal sizes exactly.
Everything is deterministic from the seed, the PDF bytes included (PDFium's random file /ID and
its creation date are replaced by seeded values), so the pages' content digests are stable.

Each page is drawn with PIL (text lines, a ruled table, formulas), JPEG-encoded and placed on
its PDF page with pypdfium2, one page at a time: a 2,000-page document costs its JPEG bytes in
memory, not its pixels."""
from __future__ import annotations

import functools
import hashlib
import io
import re
from dataclasses import dataclass, field

import numpy as np

from .layout_post import LayoutBlock

_WORDS = ("the of and to in is for on with as by at from that this are be or an which model "
          "layout page table results data method value figure section analysis performance using "
          "system error rate shown between each these both over under than high low mean").split()


@dataclass(frozen=True)
class PageSpec:
    width: int = 1190               # A4 at 144 dpi: 595 x 842 pt, 2 px per pt
    height: int = 1684
    dpi: int = 144
    margin: int = 60                # top and bottom
    gap: int = 10                   # between blocks


@dataclass(frozen=True)
class PlantedMix:
    """(label, count, nominal width, nominal height) per kind of block, in page pixels."""
    kinds: tuple[tuple[str, int, int, int], ...] = (
        ("doc_title", 1, 900, 60),
        ("paragraph_title", 1, 900, 60),
        ("text", 9, 1000, 180),
        ("table", 1, 1000, 600),
        ("display_formula", 2, 500, 80),
        ("figure_title", 2, 800, 60),
    )

    @property
    def blocks_per_page(self) -> int:
        return sum(k[1] for k in self.kinds)


#: the output length per planted block kind (tokens the VLM writes for it), for benches
#: that plant decode lengths too; kinds not named here count as a paragraph
PLANTED_TOKENS = {"doc_title": 16, "paragraph_title": 16, "text": 120, "table": 600, "display_formula": 60,
                  "figure_title": 40}


def planted_tokens(label: str) -> int:
    return PLANTED_TOKENS.get(label, PLANTED_TOKENS["text"])


@dataclass
class SyntheticDocument:
    pdf: bytes
    pages: list[list[LayoutBlock]]      # planted blocks per page, in reading order
    spec: PageSpec = field(default_factory=PageSpec)

    def detections(self, page_index: int) -> list[dict]:
        """The planted blocks of a page as a detector's output (dicts in reading order)."""
        return [{"label": b.label, "score": b.score, "bbox": list(b.bbox)} for b in self.pages[page_index]]


def _reading_sequence(mix: PlantedMix, rng: np.random.Generator) -> list[tuple[str, int, int]]:
    """The page's blocks top to bottom: the document title first, a caption right above the
    table, the rest in a seeded order."""
    items = [(label, w, h) for label, n, w, h in mix.kinds for _ in range(n)]

    def take(label: str):
        i = next((k for k, it in enumerate(items) if it[0] == label), None)
        return None if i is None else items.pop(i)

    head = take("doc_title")
    table = take("table")
    caption = take("figure_title") if table is not None else None
    order = [items[i] for i in rng.permutation(len(items))]
    if table is not None:
        pos = int(rng.integers(0, len(order) + 1))
        order[pos:pos] = [caption, table] if caption is not None else [table]
    return ([head] if head is not None else []) + order


def planted_layout(seed: int, page_index: int = 0, mix: PlantedMix | None = None,
                   spec: PageSpec | None = None) -> list[LayoutBlock]:
    """The planted blocks of one page (deterministic from ``seed`` and ``page_index``)."""
    mix, spec = mix or PlantedMix(), spec or PageSpec()
    rng = np.random.default_rng([seed, page_index])
    seq = _reading_sequence(mix, rng)
    jitter = [(w * float(rng.uniform(0.95, 1.05)), h * float(rng.uniform(0.95, 1.05))) for _, w, h in seq]
    room = spec.height - 2 * spec.margin - spec.gap * (len(seq) - 1)
    scale = min(1.0, room / sum(h for _, h in jitter))
    y = float(spec.margin)
    out = []
    for i, ((label, _, _), (w, h)) in enumerate(zip(seq, jitter)):
        w = min(w, spec.width - 20.0)
        h *= scale
        x0 = (spec.width - w) / 2 + float(rng.uniform(-10, 10))
        x0 = min(max(x0, 10.0), spec.width - 10.0 - w)
        box = (round(x0, 1), round(y, 1), round(x0 + w, 1), round(y + h, 1))
        out.append(LayoutBlock(label, round(float(rng.uniform(0.85, 0.99)), 4), box, i))
        y += h + spec.gap
    return out


# --------------------------------------------------------------------------------------------
# drawing
# --------------------------------------------------------------------------------------------

@functools.lru_cache(maxsize=64)
def _font(size: int):
    from PIL import ImageFont
    try:
        return ImageFont.load_default(size=size)
    except TypeError:                   # Pillow < 10.1: the bitmap font, one size
        return ImageFont.load_default()


@functools.lru_cache(maxsize=64)
def _char_width(size: int) -> float:
    sample = " ".join(_WORDS)
    return _font(size).getlength(sample) / len(sample)


def _words(rng: np.random.Generator, n: int) -> str:
    return " ".join(_WORDS[int(i)] for i in rng.integers(0, len(_WORDS), n))


def _draw_lines(draw, box, rng, size: int, fill=(20, 20, 20)) -> None:
    """Lines of words filling the box (one draw call: the text is laid out by its mean glyph width)."""
    x0, y0, x1, y1 = box
    line_h = int(size * 1.35)
    chars = max(4, int((x1 - x0 - 8) / _char_width(size)))
    n_lines = max(1, (y1 - y0 - 2 - size) // line_h + 1)
    lines = [_words(rng, chars // 3)[:chars].rstrip() for _ in range(n_lines)]
    draw.multiline_text((x0 + 2, y0 + 2), "\n".join(lines), fill=fill, font=_font(size), spacing=line_h - size)


def _draw_table(draw, box, rng) -> None:
    x0, y0, x1, y1 = box
    rows, cols = int(rng.integers(6, 11)), int(rng.integers(4, 7))
    font = _font(max(10, int((y1 - y0) / rows * 0.45)))
    draw.rectangle(box, outline=(0, 0, 0), width=2)
    for r in range(1, rows):
        y = y0 + (y1 - y0) * r / rows
        draw.line((x0, y, x1, y), fill=(0, 0, 0), width=2 if r == 1 else 1)
    for c in range(1, cols):
        x = x0 + (x1 - x0) * c / cols
        draw.line((x, y0, x, y1), fill=(0, 0, 0), width=1)
    for r in range(rows):
        for c in range(cols):
            text = _words(rng, 1) if r == 0 else f"{float(rng.uniform(0, 100)):.2f}"
            draw.text((x0 + (x1 - x0) * c / cols + 6, y0 + (y1 - y0) * r / rows + 4), text, fill=(0, 0, 0), font=font)


def _draw_formula(draw, box, rng) -> None:
    x0, y0, x1, y1 = box
    h = y1 - y0
    font = _font(max(10, int(h * 0.35)))
    a, b, c = (int(v) for v in rng.integers(1, 10, 3))
    cx = x0 + (x1 - x0) * 0.15
    draw.text((cx, y0 + h * 0.3), f"f(x) = {a}x + ", fill=(0, 0, 0), font=font)
    fx = cx + draw.textlength(f"f(x) = {a}x + ", font=font) + 4
    draw.text((fx, y0 + h * 0.05), f"{b} + x", fill=(0, 0, 0), font=font)
    draw.line((fx, y0 + h * 0.5, fx + h * 1.6, y0 + h * 0.5), fill=(0, 0, 0), width=2)
    draw.text((fx, y0 + h * 0.55), f"{c} - x", fill=(0, 0, 0), font=font)


def _draw_picture(draw, box, rng) -> None:
    """An image block: overlapping coloured shapes on a tinted background."""
    x0, y0, x1, y1 = box
    draw.rectangle(box, fill=tuple(int(v) for v in rng.integers(180, 240, 3)))
    for _ in range(6):
        cx, cy = float(rng.uniform(x0, x1)), float(rng.uniform(y0, y1))
        r = float(rng.uniform(0.1, 0.3)) * min(x1 - x0, y1 - y0)
        shape = (max(x0, cx - r), max(y0, cy - r), min(x1, cx + r), min(y1, cy + r))
        if shape[2] > shape[0] and shape[3] > shape[1]:
            draw.ellipse(shape, fill=tuple(int(v) for v in rng.integers(0, 200, 3)))


def _draw_chart(draw, box, rng) -> None:
    """A chart block: axes and bars."""
    x0, y0, x1, y1 = box
    draw.line((x0 + 10, y0 + 5, x0 + 10, y1 - 10, x1 - 5, y1 - 10), fill=(0, 0, 0), width=2)
    n = int(rng.integers(4, 9))
    step = (x1 - x0 - 30) / n
    for i in range(n):
        top = y1 - 10 - float(rng.uniform(0.1, 0.9)) * (y1 - y0 - 20)
        draw.rectangle((x0 + 20 + i * step, top, x0 + 20 + i * step + step * 0.6, y1 - 11), fill=(40, 90, 200))


def _draw_seal(draw, box, rng) -> None:
    x0, y0, x1, y1 = box
    draw.ellipse(box, outline=(200, 20, 20), width=4)
    font = _font(max(10, int((y1 - y0) * 0.15)))
    draw.text((x0 + (x1 - x0) * 0.2, y0 + (y1 - y0) * 0.42), _words(rng, 2).upper(), fill=(200, 20, 20), font=font)


def draw_page(blocks: list[LayoutBlock], seed: int, page_index: int, spec: PageSpec | None = None) -> np.ndarray:
    """The page's pixels (uint8 [h, w, 3]) with something drawn in every planted block."""
    from PIL import Image, ImageDraw

    spec = spec or PageSpec()
    rng = np.random.default_rng([seed, page_index, 1])
    img = Image.new("RGB", (spec.width, spec.height), (255, 255, 255))
    draw = ImageDraw.Draw(img)
    for b in blocks:
        box = tuple(int(round(v)) for v in b.bbox)
        if b.label == "table":
            _draw_table(draw, box, rng)
        elif b.label == "display_formula":
            _draw_formula(draw, box, rng)
        elif b.label in ("image", "header_image", "footer_image"):
            _draw_picture(draw, box, rng)
        elif b.label == "chart":
            _draw_chart(draw, box, rng)
        elif b.label == "seal":
            _draw_seal(draw, box, rng)
        elif b.label in ("doc_title", "paragraph_title", "figure_title"):      # one line
            _draw_lines(draw, box, rng, max(10, int((box[3] - box[1]) * (0.5 if b.label == "figure_title" else 0.6))))
        else:
            _draw_lines(draw, box, rng, max(10, min(22, int((box[3] - box[1]) / 5))))
    return np.asarray(img)


# --------------------------------------------------------------------------------------------
# the PDF
# --------------------------------------------------------------------------------------------

_ID = re.compile(rb"/ID\s*\[\s*<([0-9A-Fa-f]+)>\s*<([0-9A-Fa-f]+)>\s*\]")
_DATE = re.compile(rb"/CreationDate\(D:(\d{14})")


def _deterministic(pdf: bytes, seed: int) -> bytes:
    """PDFium's random trailer /ID and its creation time replaced in place (same lengths, so
    the cross-reference offsets stay right)."""
    digest = hashlib.sha256(f"fdx-synthetic-{seed}".encode()).hexdigest().upper()

    def _id(m):
        a, b = m.group(1), m.group(2)
        return m.group(0).replace(a, digest[: len(a)].encode()).replace(b, digest[: len(b)].encode())

    pdf = _ID.sub(_id, pdf)
    return _DATE.sub(b"/CreationDate(D:20000101000000", pdf)


def page_jpeg(seed: int, page_index: int, mix: PlantedMix | None = None, spec: PageSpec | None = None,
              jpeg_quality: int = 85) -> tuple[list[LayoutBlock], bytes]:
    """One synthetic page: its planted blocks and its pixels as JPEG bytes."""
    from PIL import Image

    blocks = planted_layout(seed, page_index, mix, spec)
    buf = io.BytesIO()
    Image.fromarray(draw_page(blocks, seed, page_index, spec)).save(buf, format="JPEG", quality=jpeg_quality)
    return blocks, buf.getvalue()


def _page_jpeg_args(args: tuple) -> tuple[list[LayoutBlock], bytes]:
    return page_jpeg(*args)


def synthetic_document(page_count: int, seed: int = 0, *, mix: PlantedMix | None = None,
                       spec: PageSpec | None = None, jpeg_quality: int = 85, processes: int = 1) -> SyntheticDocument:
    """A PDF of ``page_count`` synthetic pages and their planted blocks. ``processes`` > 1 draws
    the pages in that many worker processes (the bytes do not depend on it); the pages are
    placed in the PDF here, in order, as they come back."""
    import pypdfium2 as pdfium

    if page_count < 1:
        raise ValueError(f"page_count must be >= 1, got {page_count}")
    if processes < 1:
        raise ValueError(f"processes must be >= 1, got {processes}")
    mix, spec = mix or PlantedMix(), spec or PageSpec()
    points = 72.0 / spec.dpi
    w_pt, h_pt = spec.width * points, spec.height * points
    jobs = [(seed, i, mix, spec, jpeg_quality) for i in range(page_count)]
    pool = None
    if processes > 1 and page_count > 1:
        import multiprocessing as mp
        from concurrent.futures import ProcessPoolExecutor
        pool = ProcessPoolExecutor(min(processes, page_count), mp_context=mp.get_context("spawn"))
        drawn = pool.map(_page_jpeg_args, jobs, chunksize=4)       # in order, a few pages ahead
    else:
        drawn = map(_page_jpeg_args, jobs)
    pdf = pdfium.PdfDocument.new()
    pages = []
    try:
        for blocks, jpeg in drawn:
            pages.append(blocks)
            page = pdf.new_page(w_pt, h_pt)
            obj = pdfium.PdfImage.new(pdf)
            obj.load_jpeg(io.BytesIO(jpeg), inline=True)        # the JPEG is copied into the document now
            obj.set_matrix(pdfium.PdfMatrix().scale(w_pt, h_pt))
            page.insert_obj(obj)
            page.gen_content()
            page.close()
        out = io.BytesIO()
        pdf.save(out)
    finally:
        pdf.close()
        if pool is not None:
            pool.shutdown(cancel_futures=True)
    return SyntheticDocument(_deterministic(out.getvalue(), seed), pages, spec)
