"""Layout post-processing on planted detections: threshold, class-aware NMS, merging per class,
the overlap filter and the reading order."""
import pytest

from fastdeploy_ext.models.pp_doclayout_v3.postprocess import Detection
from fastdeploy_ext.parsing.layout_post import LayoutBlock, LayoutPostConfig, postprocess

W, H = 1000, 1400


def det(label, score, bbox):
    return {"label": label, "score": score, "bbox": list(bbox)}


def summary(blocks):
    return [(b.label, tuple(round(v, 1) for v in b.bbox), b.order) for b in blocks]


def test_threshold_global_and_per_class():
    dets = [det("text", 0.31, (0, 0, 100, 100)), det("text", 0.29, (0, 200, 100, 300)),
            det("table", 0.5, (0, 400, 100, 500))]
    assert [b.score for b in postprocess(dets, W, H)] == [0.31, 0.5]
    cfg = LayoutPostConfig(threshold={"table": 0.6, "default": 0.25})
    assert [(b.label, b.score) for b in postprocess(dets, W, H, cfg)] == [("text", 0.31), ("text", 0.29)]


def test_nms_within_a_class_at_iou_06():
    a = (0, 0, 100, 100)
    b65 = (0, 0, 100, 65)           # IoU 0.65 with a: suppressed
    b55 = (0, 0, 100, 55)           # IoU 0.55: kept by NMS ...
    out = postprocess([det("text", 0.9, a), det("text", 0.8, b65)], W, H)
    assert summary(out) == [("text", (0, 0, 100, 100), 0)]
    # ... and then, lying wholly in the larger text box, merged into it (union mode for text)
    cfg = LayoutPostConfig(overlap_ratio=1.0)       # merging off: NMS alone
    out = postprocess([det("text", 0.9, a), det("text", 0.8, b55)], W, H, cfg)
    assert len(out) == 2


def test_nms_across_classes_only_above_098():
    a = (0, 0, 100, 100)
    near = (0, 0, 100, 99)          # IoU 0.99 with a
    far = (0, 0, 100, 97)           # IoU 0.97
    cfg = LayoutPostConfig(overlap_ratio=1.0)       # the overlap filter off: NMS alone
    assert [b.label for b in postprocess([det("text", 0.9, a), det("table", 0.8, near)], W, H, cfg)] == ["text"]
    assert sorted(b.label for b in postprocess([det("text", 0.9, a), det("table", 0.8, far)], W, H, cfg)) == \
        ["table", "text"]
    # the same pair within one class is suppressed (0.97 > 0.6)
    assert len(postprocess([det("text", 0.9, a), det("text", 0.8, far)], W, H, cfg)) == 1


def test_overlap_filter_drops_the_smaller_box_of_another_class():
    table = (0, 0, 500, 500)
    inside = (10, 10, 110, 60)      # all of it in the table
    partly = (450, 450, 550, 550)   # a quarter in the table
    out = postprocess([det("table", 0.9, table), det("text", 0.95, inside), det("text", 0.9, partly)], W, H)
    assert summary(out) == [("table", (0, 0, 500, 500), 0), ("text", (450, 450, 550, 550), 1)]
    # 0.7 of the smaller box is the line: 0.75 inside is dropped, 0.6 kept
    for frac, kept in ((0.75, 1), (0.6, 2)):
        small = (500 - 100 * frac, 0, 600 - 100 * frac, 100)
        assert len(postprocess([det("table", 0.9, table), det("text", 0.9, small)], W, H)) == kept


@pytest.mark.parametrize("mode,expect", [
    ("large", [("chart", (0, 0, 400, 400), 0)]),
    ("small", [("chart", (50, 50, 150, 150), 0)]),
    ("union", [("chart", (0, 0, 400, 400), 0)]),
])
def test_merge_modes_on_a_contained_box(mode, expect):
    dets = [det("chart", 0.9, (0, 0, 400, 400)), det("chart", 0.8, (50, 50, 150, 150))]
    assert summary(postprocess(dets, W, H, LayoutPostConfig(merge_modes={"chart": mode}))) == expect


def test_union_merges_overlapping_fragments_into_one_block():
    # two text fragments, the smaller one 80 % inside the larger: one block, their union
    dets = [det("text", 0.8, (0, 0, 500, 100)), det("text", 0.9, (400, 0, 525, 100))]
    assert summary(postprocess(dets, W, H)) == [("text", (0, 0, 525, 100), 0)]
    # a title keeps the large box (its mode is "large")
    dets = [det("doc_title", 0.8, (0, 0, 500, 100)), det("doc_title", 0.9, (400, 0, 525, 100))]
    assert summary(postprocess(dets, W, H)) == [("doc_title", (0, 0, 500, 100), 0)]


def test_default_merge_modes():
    cfg = LayoutPostConfig()
    assert [cfg.merge_mode(x) for x in ("chart", "display_formula", "doc_title", "paragraph_title", "text",
                                        "table", "image")] == ["large"] * 4 + ["union"] * 3
    with pytest.raises(ValueError, match="merge mode for 'text'"):
        LayoutPostConfig(merge_modes={"text": "biggest"})


def test_reading_order_is_the_models_and_a_merge_takes_the_earliest_place():
    dets = [det("text", 0.5, (0, 900, 500, 1000)),      # the model reads this one first
            det("doc_title", 0.9, (0, 0, 500, 50)),
            det("text", 0.7, (0, 100, 500, 200)),
            det("text", 0.9, (0, 120, 500, 180))]        # inside the previous one: merged with it
    out = postprocess(dets, W, H)
    assert summary(out) == [("text", (0, 900, 500, 1000), 0), ("doc_title", (0, 0, 500, 50), 1),
                            ("text", (0, 100, 500, 200), 2)]
    assert all(isinstance(b, LayoutBlock) for b in out)


def test_detection_objects_carry_their_own_rank_and_boxes_are_clipped():
    dets = [Detection("text", 22, 0.9, (-20.0, 10.0, 200.0, 60.0), 1),
            Detection("table", 21, 0.8, (0.0, 100.0, 1200.0, 300.0), 0),
            Detection("text", 22, 0.9, (1100.0, 0.0, 1200.0, 50.0), 2)]       # wholly off the page
    out = postprocess(dets, W, H)
    assert summary(out) == [("table", (0, 100, 1000, 300), 0), ("text", (0, 10, 200, 60), 1)]


def test_empty_input():
    assert postprocess([], W, H) == []


def test_planted_synthetic_layouts_pass_through_unchanged():
    from fastdeploy_ext.parsing.synthetic import PageSpec, planted_layout
    for seed in range(4):
        for page in range(3):
            planted = planted_layout(seed, page)
            dets = [{"label": b.label, "score": b.score, "bbox": list(b.bbox)} for b in planted]
            assert postprocess(dets, PageSpec().width, PageSpec().height) == planted
    # a page tall enough for the nominal sizes gets them (within the +-5 % jitter), unscaled
    tall = planted_layout(0, 0, spec=PageSpec(height=3000))
    table = next(b for b in tall if b.label == "table")
    assert 570 <= table.bbox[3] - table.bbox[1] <= 630


@pytest.mark.parametrize("bad,msg", [({"nms_iou_same": 1.5}, r"nms_iou_same must be in \[0, 1\], got 1.5"),
                                     ({"overlap_ratio": -0.1}, "overlap_ratio must be in"),
                                     ({"default_merge_mode": "max"}, "merge mode for '<default>'")])
def test_config_values_are_checked(bad, msg):
    with pytest.raises(ValueError, match=msg):
        LayoutPostConfig(**bad)


def naive_nms(cands, iou_same, iou_cross):
    from fastdeploy_ext.parsing.layout_post import iou
    kept = []
    for c in sorted(cands, key=lambda c: (-c.score, c.rank)):
        if all(iou(c.bbox, k.bbox) <= (iou_same if k.label == c.label else iou_cross) for k in kept):
            kept.append(c)
    return kept


def test_vectorised_nms_matches_the_greedy_definition():
    import numpy as np

    from fastdeploy_ext.parsing.layout_post import _candidates, class_aware_nms
    rng = np.random.default_rng(7)
    for trial in range(20):
        dets = []
        for _ in range(int(rng.integers(1, 60))):
            x, y, w, h = rng.uniform(0, 800), rng.uniform(0, 1200), rng.uniform(5, 300), rng.uniform(5, 200)
            dets.append(det(str(rng.choice(["text", "table", "image"])), float(rng.uniform(0.3, 1)), (x, y, x + w, y + h)))
        cands = _candidates(dets, W, H, LayoutPostConfig())
        assert class_aware_nms(cands, 0.6, 0.98) == naive_nms(cands, 0.6, 0.98), trial
        assert class_aware_nms(cands, 0.3, 0.5) == naive_nms(cands, 0.3, 0.5), trial
