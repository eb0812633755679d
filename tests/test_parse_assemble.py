"""Page assembly: Markdown and JSON goldens for a page with every block kind, formula delimiters,
repetitive tails, images written as PNG files linked relatively, and the block plan feeding it."""
import io
import json

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st
from PIL import Image

from fastdeploy_ext.parsing.assemble import (BlockResult, PageMeta, assemble_page, convert_math_delimiters,
                                             document_markdown, truncate_repetitive_tail)
from fastdeploy_ext.parsing.blocks import BlockKind, ParseTaskOptions, crop_block, plan_blocks
from fastdeploy_ext.parsing.layout_post import LayoutBlock

# (label, bbox, what the VLM answered)
PAGE = [
    ("header", (50, 10, 900, 40), "Journal of Tests, vol. 3"),
    ("doc_title", (100, 60, 1000, 120), "A  Study of\nEverything"),
    ("paragraph_title", (100, 130, 600, 170), "1 Introduction"),
    ("text", (100, 180, 1100, 360), r"We show \(a+b\) is small, see \[ x^2 \] below."),
    ("display_formula", (300, 370, 800, 450), r"\[ E = mc^2 \]"),
    ("formula_number", (1000, 390, 1060, 430), "(1)"),
    ("figure_title", (200, 460, 1000, 520), "Table 1: Results"),
    ("table", (100, 530, 1100, 1130), "<fcel>Model<lcel><fcel>Score<nl><fcel>a<fcel>b<fcel>1.0<nl>"),
    ("image", (100, 1140, 500, 1400), ""),
    ("chart", (600, 1140, 1000, 1400), ""),
    ("seal", (1000, 1140, 1100, 1240), "APPROVED"),
    ("text", (100, 1410, 1100, 1500), "It loops " + "and loops " * 20),
    ("footnote", (100, 1520, 1100, 1560), "1 A footnote."),
    ("number", (560, 1600, 620, 1630), "7"),
    ("footer", (100, 1640, 1100, 1670), "Printed in 2026"),
]

EXPECTED_MD = (
    "# A Study of Everything\n\n"
    "## 1 Introduction\n\n"
    "We show $a+b$ is small, see $$x^2$$ below.\n\n"
    "$$\nE = mc^2\n$$\n\n"
    "(1)\n\n"
    "Table 1: Results\n\n"
    '<table><tr><td colspan="2">Model</td><td>Score</td></tr><tr><td>a</td><td>b</td><td>1.0</td></tr></table>\n\n'
    "![image](imgs/doc_p1_008_image.png)\n\n"
    "![chart](imgs/doc_p1_009_chart.png)\n\n"
    "APPROVED\n\n"
    "It loops and loops\n"
)


def page_blocks():
    return [LayoutBlock(label, 0.9, tuple(float(v) for v in bbox), i) for i, (label, bbox, _) in enumerate(PAGE)]


def build(opts=ParseTaskOptions(seal_recognition=True)):
    tasks = plan_blocks(page_blocks(), opts)
    image = np.full((1684, 1190, 3), 255, np.uint8)
    image[1150:1390, 110:490] = (200, 30, 30)
    crops = {t.block.order: crop_block(image, t) for t in tasks if t.kind is BlockKind.IMAGE}
    answers = [a for _, _, a in PAGE]
    # results arrive out of order: assembly restores the reading order
    results = [BlockResult(t, answers[t.block.order] if t.kind is BlockKind.VLM else "") for t in reversed(tasks)]
    meta = PageMeta("in/doc.pdf", 0, 3, 1190, 1684)
    return tasks, assemble_page(meta, results, crops, "imgs/doc_p1")


def test_plan_prompts_and_kinds():
    tasks, _ = build()
    got = {t.block.label: (t.kind, t.prompt) for t in tasks}
    assert got["table"] == (BlockKind.VLM, "Table Recognition:")
    assert got["display_formula"] == (BlockKind.VLM, "Formula Recognition:")
    assert got["formula_number"] == (BlockKind.VLM, "OCR:")
    assert got["seal"] == (BlockKind.VLM, "Seal Recognition:")
    assert got["chart"] == (BlockKind.IMAGE, None)          # chart_recognition off
    assert got["image"] == (BlockKind.IMAGE, None)
    assert got["text"] == got["header"] == got["footnote"] == (BlockKind.VLM, "OCR:")
    on = {t.block.label: (t.kind, t.prompt) for t in plan_blocks(page_blocks(), ParseTaskOptions(chart_recognition=True))}
    assert on["chart"] == (BlockKind.VLM, "Chart Recognition:") and on["seal"] == (BlockKind.IMAGE, None)
    for label in ("header_image", "footer_image"):
        assert plan_blocks([LayoutBlock(label, 0.9, (0, 0, 10, 10), 0)])[0].kind is BlockKind.IMAGE
    skip = plan_blocks(page_blocks(), ParseTaskOptions(skip_labels=frozenset({"number"})))
    assert [t.kind for t in skip if t.block.label == "number"] == [BlockKind.SKIP]
    assert all((t.min_pixels, t.max_pixels) == (112896, 1003520) for t in tasks)


def test_tables_and_large_blocks_come_first():
    tasks, _ = build()
    prio = {}
    for t in tasks:                                 # the first block of each label
        prio.setdefault(t.block.label, t.priority)
    assert prio["table"] == 0
    assert prio["table"] < prio["text"] < prio["doc_title"] < prio["number"]    # 180k, 54k, 1.8k px
    vlm = sorted((t for t in tasks if t.kind is BlockKind.VLM), key=lambda t: (t.priority, t.block.order))
    assert vlm[0].block.label == "table" and vlm[1].block.label == "text"


def test_markdown_golden():
    _, page = build()
    assert page.markdown == EXPECTED_MD


def test_json_golden():
    _, page = build()
    rec = page.record
    assert {k: rec[k] for k in ("input_path", "page_index", "page_count", "width", "height")} == \
        {"input_path": "in/doc.pdf", "page_index": 0, "page_count": 3, "width": 1190, "height": 1684}
    res = rec["parsing_res_list"]
    assert [r["block_id"] for r in res] == list(range(len(PAGE)))
    assert [r["block_label"] for r in res] == [label for label, _, _ in PAGE]
    assert res[0] == {"block_label": "header", "block_content": "Journal of Tests, vol. 3",
                      "block_bbox": [50, 10, 900, 40], "block_id": 0, "block_order": None}
    assert res[4] == {"block_label": "display_formula", "block_content": "$$\nE = mc^2\n$$",
                      "block_bbox": [300, 370, 800, 450], "block_id": 4, "block_order": 4}
    assert res[8] == {"block_label": "image", "block_content": "", "block_bbox": [100, 1140, 500, 1400],
                      "block_id": 8, "block_order": 8, "block_image": "imgs/doc_p1_008_image.png"}
    assert res[7]["block_content"].startswith('<table><tr><td colspan="2">Model</td>')
    # headers, footers, page numbers and footnotes: in the JSON with their text, not in the Markdown
    for i in (0, 12, 13, 14):
        assert res[i]["block_order"] is None and res[i]["block_content"] and res[i]["block_content"] not in page.markdown
    assert [r["block_order"] for r in res if r["block_order"] is not None] == list(range(1, 12))
    json.dumps(rec)                                 # plain JSON types only


def test_images_are_png_files_linked_relatively():
    _, page = build()
    assert sorted(page.images) == ["imgs/doc_p1_008_image.png", "imgs/doc_p1_009_chart.png"]
    img = np.asarray(Image.open(io.BytesIO(page.images["imgs/doc_p1_008_image.png"])))
    assert img.shape == (260, 400, 3)
    assert (img[20, 20] == (200, 30, 30)).all() and (img[0, 0] == 255).all()
    for name in page.images:
        assert f"]({name})" in page.markdown and not name.startswith("/")


def test_formula_delimiters():
    assert convert_math_delimiters(r"a \( x \) b \[y\] c") == "a $x$ b $$y$$ c"
    assert convert_math_delimiters("no math, $5 only") == "no math, $5 only"
    from fastdeploy_ext.parsing.assemble import display_formula
    for raw in (r"\[ a \]", "$$a$$", r"\(a\)", "$a$", "a"):
        assert display_formula(raw) == "$$\na\n$$"
    assert display_formula("  ") == ""


@pytest.mark.parametrize("text,expect", [
    ("Intro. " + "na " * 30, "Intro. na "),
    ("x" * 100, "x"),
    ("<fcel>1<nl>" * 12, "<fcel>1<nl>"),
    ("A short 1 2 3 1 2 3 tail", "A short 1 2 3 1 2 3 tail"),       # too short to be a loop
    ("ab" * 10, "ab" * 10),                                          # 20 chars: below the minimum
    ("", ""),
])
def test_repetitive_tail_truncation(text, expect):
    assert truncate_repetitive_tail(text) == expect


def test_formula_crop_trims_its_margin():
    image = np.full((400, 600, 3), 255, np.uint8)
    image[150:170, 200:300] = 0                     # the formula's ink
    block = LayoutBlock("display_formula", 0.9, (100.0, 100.0, 500.0, 300.0), 0)
    (task,) = plan_blocks([block])
    crop = crop_block(image, task)
    assert crop.shape == (20 + 8, 100 + 8, 3)       # the ink plus 4 px each side
    (text_task,) = plan_blocks([LayoutBlock("text", 0.9, (100.0, 100.0, 500.0, 300.0), 0)])
    assert crop_block(image, text_task).shape == (200, 400, 3)
    # a box reaching past the page is clipped; never an empty crop
    (edge,) = plan_blocks([LayoutBlock("text", 0.9, (590.5, 399.2, 700.0, 450.0), 0)])
    assert crop_block(image, edge).shape == (1, 10, 3)


def test_document_markdown_joins_pages_and_leaves_out_empty_ones():
    assert document_markdown(["# A\n", "", "b\n\n"]) == "# A\n\nb\n"
    assert document_markdown([]) == ""


def test_crop_block_checks_the_page_image():
    (task,) = plan_blocks([LayoutBlock("text", 0.9, (0.0, 0.0, 5.0, 5.0), 0)])
    with pytest.raises(ValueError, match=r"page image must be uint8 \[h, w, 3\], got float32 \[10, 10, 3\]"):
        crop_block(np.zeros((10, 10, 3), np.float32), task)


@settings(max_examples=150, deadline=None)
@given(st.text(alphabet="ab c.\n", max_size=120), st.text(alphabet="xyz ", min_size=1, max_size=12),
       st.integers(0, 40))
def test_repetitive_tail_keeps_a_prefix_and_one_copy_of_a_loop(head, unit, times):
    text = head + unit * times
    out = truncate_repetitive_tail(text)
    assert text.startswith(out)
    if times * len(unit) >= 60 + 2 * len(unit) and len(unit) <= 12:
        # a long loop is cut: what is left of the tail is shorter than two copies of it
        assert len(out) < len(head) + 2 * len(unit) + len(unit)
