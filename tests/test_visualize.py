"""Layout pictures (parsing/visualize.py, `parse --visualize`): on a page with planted blocks
(parsing/synthetic.py) the picture has each box's outline in its label's colour on the box's
edges, and at each box's corner the tag with its reading-order number and label, pixel for
pixel; through the pipeline the picture lies beside the page's Markdown and the page JSON gets
the boxes' scores."""
from __future__ import annotations

import io
import json

import numpy as np
import pytest

from fastdeploy_ext.parsing import visualize as vz
from fastdeploy_ext.parsing.synthetic import PlantedMix, draw_page, planted_layout

from . import pp_doclayout_fixture as fx

MIX = PlantedMix(kinds=(("doc_title", 1, 900, 60), ("text", 2, 1000, 180), ("table", 1, 1000, 400),
                        ("display_formula", 1, 500, 80), ("image", 1, 300, 200)))


def _pixels(png: bytes) -> np.ndarray:
    from PIL import Image
    return np.asarray(Image.open(io.BytesIO(png)).convert("RGB"))


def _tag_at(pic: np.ndarray, x0: int, y0: int, text: str, colour) -> bool:
    """Whether the tag ``text`` sits at (x0, y0), pixel for pixel (where draw_layout puts it)."""
    h, w = pic.shape[:2]
    tag = np.asarray(vz.render_tag(text, colour, vz.tag_scale(w, h)))
    x, y = max(0, min(x0, w - tag.shape[1])), max(0, min(y0, h - tag.shape[0]))
    return np.array_equal(pic[y:y + tag.shape[0], x:x + tag.shape[1]], tag)


def check_picture(pic: np.ndarray, boxes: list[tuple[str, int, tuple[float, float, float, float]]]) -> None:
    """``boxes``: (label, 1-based reading order, bbox). Asserts the outlines and the tags."""
    h, w = pic.shape[:2]
    lw = vz.line_width(w, h)
    for label, order, bbox in boxes:
        x0, y0, x1, y1 = (int(round(v)) for v in bbox)
        colour = vz.label_colour(label)
        xm, ym = (x0 + x1) // 2, (y0 + y1) // 2
        # the bottom and right edges (tags never lie there), each across the outline's width
        for k in range(lw):
            assert tuple(pic[y1 - 1 - k, xm]) == colour, (label, order, "bottom edge")
            assert tuple(pic[ym, x1 - 1 - k]) == colour, (label, order, "right edge")
            assert tuple(pic[y1 - 2, x0 + k]) == colour, (label, order, "left edge")
        # an outline, not a fill: just inside the outline the page shows
        assert tuple(pic[y1 - 1 - lw - 1, x1 - 1 - lw - 1]) != colour
        assert _tag_at(pic, x0, y0, vz.tag_text(order - 1, label), colour), (label, order, "tag")


def test_planted_page_has_each_box_in_its_colour_and_its_number_in_reading_order():
    blocks = planted_layout(seed=3, mix=MIX)
    page = draw_page(blocks, seed=3, page_index=0)
    pic = np.asarray(vz.draw_layout(page, blocks))
    assert pic.shape == page.shape
    check_picture(pic, [(b.label, b.order + 1, b.bbox) for b in blocks])
    # the tag check tells numbers apart: block 2's corner does not read as number 3
    b = blocks[1]
    assert not _tag_at(pic, int(round(b.bbox[0])), int(round(b.bbox[1])), vz.tag_text(2, b.label),
                       vz.label_colour(b.label))
    # and the colour check tells labels apart: every planted label has its own colour
    assert len({vz.label_colour(b.label) for b in blocks}) == len({b.label for b in blocks})


def test_the_picture_follows_the_blocks_reading_order_not_their_list_order():
    import dataclasses
    blocks = planted_layout(seed=4, mix=MIX)
    page = draw_page(blocks, seed=4, page_index=0)
    n = len(blocks)
    reversed_order = [dataclasses.replace(b, order=n - 1 - b.order) for b in blocks]
    pic = np.asarray(vz.draw_layout(page, reversed_order))
    check_picture(pic, [(b.label, b.order + 1, b.bbox) for b in reversed_order])
    with pytest.raises(AssertionError, match="tag"):
        check_picture(pic, [(b.label, b.order + 1, b.bbox) for b in blocks])


def test_a_tag_at_the_page_edge_stays_on_the_page_and_unknown_labels_get_a_stable_colour():
    from fastdeploy_ext.parsing.layout_post import LayoutBlock
    page = np.full((300, 200, 3), 255, np.uint8)
    blocks = [LayoutBlock("some_new_label", 0.5, (150.0, 280.0, 200.0, 300.0), 0)]
    pic = np.asarray(vz.draw_layout(page, blocks))
    colour = vz.label_colour("some_new_label")
    assert colour == vz.label_colour("some_new_label") and colour not in vz.LABEL_COLOURS.values()
    assert _tag_at(pic, 150, 280, "1 some_new_label", colour)
    assert tuple(pic[299, 199]) == colour


# ------------------------------------------------------------------ through the pipeline
@pytest.fixture(scope="module")
def layout_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_layout")
    fx.write_model(path)
    return path


@pytest.fixture(scope="module")
def planted_pdf(tmp_path_factory):
    from fastdeploy_ext.parsing.synthetic import synthetic_document
    root = tmp_path_factory.mktemp("vis")
    doc = synthetic_document(2, seed=7, mix=MIX)
    pdf = root / "planted.pdf"
    pdf.write_bytes(doc.pdf)
    w, h = doc.spec.width, doc.spec.height
    pages = [[{"label": d["label"], "score": d["score"],
               "bbox": [d["bbox"][0] / w, d["bbox"][1] / h, d["bbox"][2] / w, d["bbox"][3] / h]}
              for d in doc.detections(i)] for i in range(2)]
    layout = root / "planted.json"
    layout.write_text(json.dumps({"pages": {pdf.name: pages}}))
    return pdf, layout, doc


def test_parse_visualize_writes_each_pages_picture_beside_its_markdown(tmp_path, layout_dir, planted_pdf):
    from fastdeploy_ext import DocumentParser
    pdf, layout, doc = planted_pdf
    out = tmp_path / "out"
    with DocumentParser(stub_vlm=True, layout_model=str(layout_dir), device="cpu", dtype="float32",
                        planted_layouts=str(layout), render_workers=1, visualize=True) as p:
        outcomes = list(p.parse(pdf, output=out))
    assert len(outcomes) == 2 and all(o.error is None for o in outcomes)
    for i in range(2):
        tag = f"planted_{i + 1:04d}"
        assert (out / f"{tag}.md").is_file()
        rec = json.loads((out / f"{tag}.json").read_text())
        pic = _pixels((out / f"{tag}_layout.png").read_bytes())
        assert pic.shape[:2] == (rec["height"], rec["width"])
        boxes = rec["layout_det_res"]["boxes"]
        planted = doc.pages[i]
        assert [b["label"] for b in boxes] == [b.label for b in planted]
        assert [b["score"] for b in boxes] == [pytest.approx(b.score, abs=1e-4) for b in planted]
        # the JSON's blocks and the picture's boxes are the same boxes in the same order
        assert [b["order"] for b in boxes] == [e["block_id"] + 1 for e in rec["parsing_res_list"]]
        check_picture(pic, [(b["label"], b["order"], b["coordinate"]) for b in boxes])
    # not a Markdown image: the crops folder and the Markdown do not name it
    assert not any("_layout" in f.name for f in (out / "imgs").iterdir())
    assert "_layout.png" not in (out / "planted_0001.md").read_text()


def test_without_visualize_no_picture_and_a_workspace_refuses_the_other_setting(tmp_path, layout_dir, planted_pdf):
    from fastdeploy_ext.parsing.options import ParseOptions
    from fastdeploy_ext.parsing.workspace import FingerprintMismatch, Workspace
    on = ParseOptions(stub_vlm=True, visualize=True).fingerprint()
    off = ParseOptions(stub_vlm=True).fingerprint()
    assert "visualize" not in off          # an older workspace's fingerprint is unchanged
    Workspace.open(tmp_path / "ws", fingerprint=on).close()
    with pytest.raises(FingerprintMismatch, match="visualize"):
        Workspace.open(tmp_path / "ws", fingerprint=off)


def test_the_cli_flag_sets_the_option():
    from fastdeploy_ext.entrypoints.cli import build_parser
    from fastdeploy_ext.entrypoints.parse_cmd import parse_options_from_args
    for extra, want in (([], False), (["--visualize"], True)):
        ns = build_parser().parse_args(["parse", "x.pdf", "--output", "o", "--stub-vlm", *extra])
        assert parse_options_from_args(ns, output="o").visualize is want


# ------------------------------------------------------------------ through the job API
def test_the_job_api_takes_visualize_and_serves_only_the_pages_pictures(tmp_path):
    pytest.importorskip("starlette")
    from fastdeploy_ext.entrypoints.openai.jobs import JobRecord, JobsConfig, JobService
    from fastdeploy_ext.entrypoints.openai.serving_jobs import JobAPIError, job_options
    from fastdeploy_ext.parsing.options import ParseOptions
    base = ParseOptions(stub_vlm=True)
    assert job_options({"visualize": True}, base) == {"visualize": True}
    assert job_options({"visualize": False}, base) == {"visualize": False}
    with pytest.raises(JobAPIError, match="optionalPayload.visualize"):
        job_options({"visualize": "yes"}, base)
    svc = JobService(JobsConfig(jobs_dir=tmp_path / "jobs"), base, engine=None)
    rec = JobRecord(job_id="j1", model="PaddleOCR-VL", file_name="document.pdf", options={}, secret="s", created=0.0)
    ws = tmp_path / "jobs" / "j1" / "ws"
    (ws / "imgs").mkdir(parents=True)
    for name in ("document_0001_layout.png", "imgs/document_0001_001_image.png", "document_0001.json",
                 "imgs/x_layout.png"):
        (ws / name).write_bytes(b"x")
    (tmp_path / "jobs" / "j1" / "job.json").write_bytes(b"{}")
    assert svc.result_path(rec, "document_0001_layout.png") == ws / "document_0001_layout.png"
    assert svc.result_path(rec, "imgs/document_0001_001_image.png") is not None
    # only pictures beside the pages and the crops: not the page JSON, the job record, or a way out
    for rel in ("document_0001.json", "../job.json", "../ws/document_0001_layout.png", "/etc/x_layout.png",
                ".fdparse/x_layout.png", "absent_layout.png", ""):
        assert svc.result_path(rec, rel) is None, rel
