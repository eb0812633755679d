"""A page's layout as a picture: the rendered page with each block's box outlined in its label's
colour, and a tag at the box's top-left corner with its reading-order number and label name
(what PaddleX's ``save_to_img`` gives, drawn with PIL's bundled bitmap font: no font files).

``add_layout_picture`` puts the picture into a PageResult's files (``<stem>_0001_layout.png``,
beside the page's Markdown) and the boxes with their scores into its record as PaddleX's
``layout_det_res`` (the page JSON's blocks carry no score)."""
from __future__ import annotations

import functools
import io
import zlib
from typing import TYPE_CHECKING, Sequence

import numpy as np

if TYPE_CHECKING:
    from PIL import Image

#: a colour per label, chosen apart from each other for the labels a page usually has
LABEL_COLOURS: dict[str, tuple[int, int, int]] = {
    "doc_title": (214, 39, 40), "paragraph_title": (255, 127, 14), "text": (31, 119, 180),
    "table": (44, 160, 44), "image": (148, 103, 189), "chart": (140, 86, 75), "display_formula": (227, 119, 194),
    "inline_formula": (188, 189, 34), "formula_number": (23, 190, 207), "figure_title": (128, 128, 0),
    "header": (127, 127, 127), "footer": (90, 90, 90), "number": (160, 160, 160), "footnote": (0, 128, 128),
    "abstract": (0, 0, 200), "reference": (200, 0, 100), "reference_content": (150, 0, 75),
    "seal": (220, 20, 60), "algorithm": (100, 50, 0), "content": (0, 100, 0), "aside_text": (70, 130, 180),
    "vertical_text": (0, 70, 140), "header_image": (120, 80, 160), "footer_image": (100, 60, 140),
    "vision_footnote": (0, 150, 100),
}
TAG_TEXT = (255, 255, 255)
#: a tag's padding around its text, in the bitmap font's pixels (before scaling)
TAG_PAD = 2


def label_colour(label: str) -> tuple[int, int, int]:
    """The label's colour; a label outside the table gets one derived from its name (the same on
    every page and every run)."""
    if label in LABEL_COLOURS:
        return LABEL_COLOURS[label]
    h = zlib.crc32(label.encode())
    return (64 + (h & 0x7F), 64 + ((h >> 8) & 0x7F), 64 + ((h >> 16) & 0x7F))


def line_width(width: int, height: int) -> int:
    """Box outline width: 2 px on a page of ~1000 px, thicker on larger renders."""
    return max(2, round(min(width, height) / 500))


def tag_scale(width: int, height: int) -> int:
    """The bitmap font is 11 px tall: 1:1 up to ~2000 px (an A4 page at 144 dpi), where it reads
    at full size and covers little of the block; scaled by a whole factor on larger renders
    (nearest-neighbour, so the glyphs keep their exact pixels)."""
    return max(1, round(max(width, height) / 2000))


@functools.lru_cache(maxsize=1)
def _font():
    from PIL import ImageFont
    return ImageFont.load_default_imagefont()


def tag_text(order: int, label: str) -> str:
    return f"{order + 1} {label}"


def render_tag(text: str, colour: tuple[int, int, int], scale: int):
    """The tag as its own image: the text in white on the label's colour, scaled up."""
    from PIL import Image, ImageDraw
    font = _font()
    x0, y0, x1, y1 = font.getbbox(text)
    tag = Image.new("RGB", (x1 + 2 * TAG_PAD, y1 + 2 * TAG_PAD), colour)
    ImageDraw.Draw(tag).text((TAG_PAD, TAG_PAD), text, font=font, fill=TAG_TEXT)
    return tag.resize((tag.width * scale, tag.height * scale), Image.NEAREST) if scale > 1 else tag


def draw_layout(image: np.ndarray, blocks: Sequence) -> "Image.Image":
    """The page (H x W x 3 uint8) with every block (``label``, ``bbox`` in page pixels,
    ``order`` 0-based reading order) outlined and tagged. Boxes are drawn in reading order and
    the tags after all boxes, so a later box never covers an earlier block's number."""
    from PIL import Image, ImageDraw
    page = Image.fromarray(np.ascontiguousarray(image, dtype=np.uint8)).convert("RGB")
    w, h = page.size
    lw, scale = line_width(w, h), tag_scale(w, h)
    draw = ImageDraw.Draw(page)
    ordered = sorted(blocks, key=lambda b: b.order)
    for b in ordered:
        x0, y0, x1, y1 = (int(round(v)) for v in b.bbox)
        draw.rectangle((x0, y0, max(x0, x1 - 1), max(y0, y1 - 1)), outline=label_colour(b.label), width=lw)
    for b in ordered:
        x0, y0 = (int(round(v)) for v in b.bbox[:2])
        tag = render_tag(tag_text(b.order, b.label), label_colour(b.label), scale)
        # inside the box's corner; moved left/up where the page edge would cut it off
        page.paste(tag, (max(0, min(x0, w - tag.width)), max(0, min(y0, h - tag.height))))
    return page


def layout_picture_name(image_prefix: str) -> str:
    """``imgs/<stem>_0001`` (the page's crop prefix) -> ``<stem>_0001_layout.png``: beside the
    page's ``<stem>_0001.md``."""
    return f"{image_prefix.rsplit('/', 1)[-1]}_layout.png"


def layout_det_res(blocks: Sequence) -> dict:
    """The boxes as PaddleX's ``layout_det_res``: label, score, coordinate, in reading order."""
    return {"boxes": [{"label": b.label, "score": round(float(b.score), 4),
                       "coordinate": [round(float(v), 2) for v in b.bbox], "order": b.order + 1}
                      for b in sorted(blocks, key=lambda b: b.order)]}


def add_layout_picture(result, image: np.ndarray, blocks: Sequence, image_prefix: str) -> str:
    """The page's layout picture into ``result.images`` (written with the page's files) and its
    boxes into ``result.record``; returns the picture's file name."""
    buf = io.BytesIO()
    draw_layout(image, blocks).save(buf, format="PNG")
    name = layout_picture_name(image_prefix)
    result.images[name] = buf.getvalue()
    result.record["layout_det_res"] = layout_det_res(blocks)
    return name
