"""Layout blocks -> what happens to each: a VLM request with its task prompt, a saved crop, or
nothing; and the crop itself. Tables and large blocks get lower priority values (the engine runs
lower values first), so that their long decodes start early and a page does not wait on its
table after all its short blocks are done."""
from __future__ import annotations

import math
from dataclasses import dataclass
from enum import Enum

import numpy as np

from .layout_post import LayoutBlock, area

PROMPT_OCR = "OCR:"
PROMPT_TABLE = "Table Recognition:"
PROMPT_FORMULA = "Formula Recognition:"
PROMPT_CHART = "Chart Recognition:"
PROMPT_SEAL = "Seal Recognition:"

IMAGE_LABELS = frozenset({"image", "header_image", "footer_image"})
#: a block's pixels, as PaddleOCR-VL's pipeline bounds them per block (the processor's resize)
BLOCK_MIN_PIXELS = 112896
BLOCK_MAX_PIXELS = 1003520

#: priority tiers by block area in page pixels (lower = earlier); tables come before all of them
TABLE_PRIORITY = 0
AREA_TIERS = (500_000, 150_000, 50_000)

#: near-white: a formula crop's margin rows/columns (every channel at least this bright)
MARGIN_WHITE = 240
#: pixels of margin kept around a trimmed formula (the glyphs must not touch the edge)
FORMULA_PAD = 4


class BlockKind(Enum):
    VLM = "vlm"             # a request to the VLM with ``prompt``
    IMAGE = "image"         # the crop is saved and linked from the Markdown
    SKIP = "skip"           # nothing (listed in the JSON with empty content)


@dataclass
class BlockTask:
    block: LayoutBlock
    kind: BlockKind
    prompt: str | None
    priority: int
    min_pixels: int = BLOCK_MIN_PIXELS
    max_pixels: int = BLOCK_MAX_PIXELS


@dataclass
class ParseTaskOptions:
    chart_recognition: bool = False     # charts to the VLM ("Chart Recognition:"); else kept as images
    seal_recognition: bool = False      # seals to the VLM ("Seal Recognition:"); else kept as images
    #: labels neither recognised nor saved (still listed in the page JSON)
    skip_labels: frozenset[str] = frozenset()


def task_for(label: str, opts: ParseTaskOptions) -> tuple[BlockKind, str | None]:
    """A block label -> (kind, prompt)."""
    if label in opts.skip_labels:
        return BlockKind.SKIP, None
    if label == "table":
        return BlockKind.VLM, PROMPT_TABLE
    if label == "display_formula":          # formula_number is text ("(3)"): OCR below
        return BlockKind.VLM, PROMPT_FORMULA
    if label == "chart":
        return (BlockKind.VLM, PROMPT_CHART) if opts.chart_recognition else (BlockKind.IMAGE, None)
    if label == "seal":
        return (BlockKind.VLM, PROMPT_SEAL) if opts.seal_recognition else (BlockKind.IMAGE, None)
    if label in IMAGE_LABELS:
        return BlockKind.IMAGE, None
    return BlockKind.VLM, PROMPT_OCR


def block_priority(block: LayoutBlock) -> int:
    """0 for tables; then 1, 2, 3, 4 by area (the largest blocks first)."""
    if block.label == "table":
        return TABLE_PRIORITY
    a = area(block.bbox)
    return 1 + next((t for t, lo in enumerate(AREA_TIERS) if a >= lo), len(AREA_TIERS))


def plan_blocks(blocks: list[LayoutBlock], opts: ParseTaskOptions | None = None) -> list[BlockTask]:
    """One task per block, in the blocks' (reading) order."""
    opts = opts or ParseTaskOptions()
    out = []
    for b in blocks:
        kind, prompt = task_for(b.label, opts)
        # images and skipped blocks are not requests: their priority is never used
        out.append(BlockTask(b, kind, prompt, block_priority(b) if kind is BlockKind.VLM else 0))
    return out


def pixel_box(bbox, width: int, height: int) -> tuple[int, int, int, int]:
    """A float box -> the integer pixel box that covers it, clipped to the image, >= 1 px each way."""
    x0 = min(max(int(math.floor(bbox[0])), 0), width - 1)
    y0 = min(max(int(math.floor(bbox[1])), 0), height - 1)
    x1 = max(min(int(math.ceil(bbox[2])), width), x0 + 1)
    y1 = max(min(int(math.ceil(bbox[3])), height), y0 + 1)
    return x0, y0, x1, y1


def trim_margin(crop: np.ndarray, white: int = MARGIN_WHITE, pad: int = FORMULA_PAD) -> np.ndarray:
    """Near-white rows and columns around the ink removed, ``pad`` pixels of them kept; an
    all-white crop is returned as it is."""
    ink = crop.min(axis=2) < white
    rows, cols = np.flatnonzero(ink.any(axis=1)), np.flatnonzero(ink.any(axis=0))
    if rows.size == 0:
        return crop
    h, w = ink.shape
    y0, y1 = max(rows[0] - pad, 0), min(rows[-1] + 1 + pad, h)
    x0, x1 = max(cols[0] - pad, 0), min(cols[-1] + 1 + pad, w)
    return crop[y0:y1, x0:x1]


def crop_block(image: np.ndarray, task: BlockTask) -> np.ndarray:
    """The block's pixels (uint8 [h, w, 3], a copy); display formulas with their margin trimmed."""
    if image.ndim != 3 or image.shape[2] != 3 or image.dtype != np.uint8:
        raise ValueError(f"page image must be uint8 [h, w, 3], got {image.dtype} {list(image.shape)}")
    h, w = image.shape[:2]
    x0, y0, x1, y1 = pixel_box(task.block.bbox, w, h)
    crop = image[y0:y1, x0:x1]
    if task.block.label == "display_formula":
        crop = trim_margin(crop)
    return np.ascontiguousarray(crop).copy()
