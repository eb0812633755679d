"""A page's block results -> its Markdown and its PaddleX-shaped JSON record, and the crops saved
as PNG files the Markdown links relatively.

Content rules: every block's text has its repetitive tail cut (a decode that looped until
max_new_tokens keeps one copy of the loop); tables are converted from OTSL to HTML; LaTeX
delimiters ``\\( \\)`` / ``\\[ \\]`` become ``$ $`` / ``$$ $$``, and a display formula is set as a
``$$`` block. Headers, footers, page numbers and footnotes stay in the JSON but are left out of
the Markdown by default (they repeat on every page and break the text's flow)."""
from __future__ import annotations

import io
import re
from dataclasses import dataclass

import numpy as np

from .blocks import BlockKind, BlockTask
from .otsl import otsl_to_html

#: labels listed in the JSON but not written to the Markdown (PaddleX's defaults)
MARKDOWN_SKIP_LABELS = frozenset({"header", "header_image", "footer", "footer_image", "number", "footnote"})
TITLE_LEVELS = {"doc_title": "#", "paragraph_title": "##"}

#: a tail repeated at least this many times, covering at least this many characters, is a loop
REPEAT_MIN_COUNT = 3
REPEAT_MIN_CHARS = 60
REPEAT_MAX_PERIOD = 400


@dataclass
class PageMeta:
    input_path: str
    page_index: int
    page_count: int
    width: int
    height: int


@dataclass
class BlockResult:
    task: BlockTask
    content: str                # the VLM's text; "" for IMAGE and SKIP blocks


@dataclass
class PageResult:
    meta: PageMeta
    markdown: str
    record: dict
    images: dict[str, bytes]    # relative file name (as linked from the markdown) -> PNG bytes


# --------------------------------------------------------------------------------------------
# content
# --------------------------------------------------------------------------------------------

def truncate_repetitive_tail(text: str, min_count: int = REPEAT_MIN_COUNT, min_chars: int = REPEAT_MIN_CHARS,
                             max_period: int = REPEAT_MAX_PERIOD) -> str:
    """Text whose end is one unit repeated (``min_count``+ times, ``min_chars``+ characters in
    all) -> the text up to and including the first copy of that unit. Of the candidate periods
    the one covering most of the tail wins (the shortest among equals)."""
    n = len(text)
    best_start, best_period = n, 0
    for p in range(1, min(max_period, n // min_count) + 1):
        unit = text[n - p:]
        start = n - p
        while start - p >= 0 and text[start - p:start] == unit:
            start -= p
        count = (n - start) // p
        if count >= min_count and n - start >= min_chars and start < best_start:
            best_start, best_period = start, p
    if best_period == 0:
        return text
    return text[:best_start + best_period]


_INLINE = re.compile(r"\\\((.+?)\\\)", re.S)
_DISPLAY = re.compile(r"\\\[(.+?)\\\]", re.S)


def convert_math_delimiters(text: str) -> str:
    """``\\(x\\)`` -> ``$x$``, ``\\[x\\]`` -> ``$$x$$``."""
    text = _DISPLAY.sub(lambda m: f"$${m.group(1).strip()}$$", text)
    return _INLINE.sub(lambda m: f"${m.group(1).strip()}$", text)


def display_formula(text: str) -> str:
    """A formula block's LaTeX, whatever delimiters the model used, as a ``$$`` block."""
    body = text.strip()
    for open_, close in (("$$", "$$"), ("\\[", "\\]"), ("\\(", "\\)"), ("$", "$")):
        if body.startswith(open_) and body.endswith(close) and len(body) >= len(open_) + len(close):
            body = body[len(open_):len(body) - len(close)].strip()
            break
    return f"$$\n{body}\n$$" if body else ""


def block_content(task: BlockTask, raw: str) -> str:
    """The block's text as stored in the JSON and written to the Markdown."""
    if task.kind is not BlockKind.VLM:
        return ""
    text = truncate_repetitive_tail(raw.strip())
    label = task.block.label
    if label == "table":
        return otsl_to_html(text)
    if label == "display_formula":
        return display_formula(text)
    return convert_math_delimiters(text)


def image_name(prefix: str, task: BlockTask) -> str:
    return f"{prefix}_{task.block.order:03d}_{task.block.label}.png"


def png_bytes(crop: np.ndarray) -> bytes:
    from PIL import Image
    buf = io.BytesIO()
    Image.fromarray(np.ascontiguousarray(crop, dtype=np.uint8)).save(buf, format="PNG")
    return buf.getvalue()


def _markdown_block(label: str, content: str, image: str | None) -> str:
    if image is not None:
        return f"![{label}]({image})"
    if not content:
        return ""
    if label in TITLE_LEVELS:
        return f"{TITLE_LEVELS[label]} {' '.join(content.split())}"
    return content


# --------------------------------------------------------------------------------------------
# the page and the document
# --------------------------------------------------------------------------------------------

def assemble_page(meta: PageMeta, results: list[BlockResult], crops: dict[int, np.ndarray], image_prefix: str,
                  *, markdown_skip_labels: frozenset[str] = MARKDOWN_SKIP_LABELS) -> PageResult:
    """``results`` in any order (they complete out of order): restored to reading order by their
    block's ``order``. ``crops``: block order -> pixels for IMAGE blocks. ``image_prefix``:
    e.g. ``"imgs/<stem>_p3"``, so image names are unique across pages and documents."""
    ordered = sorted(results, key=lambda r: r.task.block.order)
    parsing_res, md_parts, images = [], [], {}
    md_order = 0
    for block_id, r in enumerate(ordered):
        t, b = r.task, r.task.block
        content = block_content(t, r.content)
        entry = {
            "block_label": b.label,
            "block_content": content,
            "block_bbox": [int(round(v)) for v in b.bbox],
            "block_id": block_id,
            "block_order": None,
        }
        image = None
        if t.kind is BlockKind.IMAGE and b.order in crops:
            image = image_name(image_prefix, t)
            images[image] = png_bytes(crops[b.order])
            entry["block_image"] = image
        if b.label not in markdown_skip_labels:
            part = _markdown_block(b.label, content, image)
            if part:
                md_order += 1
                entry["block_order"] = md_order
                md_parts.append(part)
        parsing_res.append(entry)
    record = {
        "input_path": meta.input_path,
        "page_index": meta.page_index,
        "page_count": meta.page_count,
        "width": meta.width,
        "height": meta.height,
        "parsing_res_list": parsing_res,
    }
    markdown = "\n\n".join(md_parts) + "\n" if md_parts else ""
    return PageResult(meta, markdown, record, images)


def document_markdown(pages: list[str]) -> str:
    """The pages' Markdown, in page order, as one document (empty pages left out)."""
    parts = [p.strip("\n") for p in pages if p.strip()]
    return "\n\n".join(parts) + "\n" if parts else ""
