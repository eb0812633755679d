"""The detector conformance checks, as functions the suite's tests call and the unit tests break
on purpose (a wrong kernel must fail parity; an injected sync must fail the guard)."""
from __future__ import annotations

from typing import Mapping, Sequence

import torch

OUTPUTS = ("logits", "pred_boxes", "order_logits", "enc_outputs_class", "enc_outputs_coord_logits")


def max_abs_err(got: torch.Tensor, want: torch.Tensor) -> float:
    """Max abs error over the finite entries; the non-finite ones (anchors outside the page are
    the dtype's max, which the box head's output keeps) must sit at the same places with the
    same values."""
    got, want = got.detach().float().cpu(), want.detach().float().cpu()
    if got.shape != want.shape:
        raise AssertionError(f"shape {list(got.shape)}, the reference's {list(want.shape)}")
    fin = torch.isfinite(want)
    if not torch.equal(fin, torch.isfinite(got)) or not torch.equal(got[~fin], want[~fin]):
        raise AssertionError("non-finite entries differ from the reference's")
    return (got[fin] - want[fin]).abs().max().item() if fin.any() else 0.0


def check_outputs(got, expected: Mapping[str, torch.Tensor], tolerance: float, source: str = "reference"
                  ) -> dict[str, float]:
    """Every output within ``tolerance`` (max abs) of ``expected``; returns the errors."""
    errors, bad = {}, []
    for name in OUTPUTS:
        try:
            errors[name] = max_abs_err(getattr(got, name), expected[name])
        except AssertionError as e:
            bad.append(f"{name}: {e}")
            continue
        if not errors[name] <= tolerance:
            bad.append(f"{name}: max abs error {errors[name]:.3g} > {tolerance:g}")
    if bad:
        raise AssertionError(f"detector outputs vs the {source} reference: " + "; ".join(bad))
    return errors


def check_topk_margin(enc_outputs_class: torch.Tensor, k: int, margin: float) -> float:
    """The reference's encoder scores must separate the k selected positions from the rest by
    ``margin`` on every page (else fp32 rounding could swap a query and parity would test luck)."""
    if enc_outputs_class.shape[1] <= k:
        raise AssertionError(f"the encoder has {enc_outputs_class.shape[1]} positions for {k} queries: no selection")
    scores = enc_outputs_class.float().max(-1).values.sort(-1, descending=True).values
    gap = float((scores[:, k - 1] - scores[:, k]).min())
    if not gap >= margin:
        raise AssertionError(f"the encoder's {k}th and {k + 1}th scores differ by {gap:.3g} < {margin:g}: choose "
                             "another fixture seed")
    return gap


def check_detections(got: Sequence[Sequence], golden: Sequence[Sequence[Mapping]], *, score_tol: float = 1e-5,
                     box_tol: float = 1e-3) -> None:
    """Post-processed detections equal to the goldens: the same labels in the same (reading)
    order with the same ranks, scores and page-pixel boxes within the tolerances."""
    if len(got) != len(golden):
        raise AssertionError(f"{len(got)} pages, the goldens have {len(golden)}")
    for p, (page, want) in enumerate(zip(got, golden)):
        g = [(d.label, d.order) for d in page]
        w = [(d["label"], d["order"]) for d in want]
        if g != w:
            raise AssertionError(f"page {p}: (label, order) {g[:5]}... != the goldens' {w[:5]}... "
                                 f"({len(g)} vs {len(w)} detections)")
        for i, (d, e) in enumerate(zip(page, want)):
            if abs(d.score - e["score"]) > score_tol:
                raise AssertionError(f"page {p} detection {i}: score {d.score} != {e['score']}")
            if max(abs(a - b) for a, b in zip(d.bbox, e["bbox"])) > box_tol:
                raise AssertionError(f"page {p} detection {i}: bbox {d.bbox} != {e['bbox']}")


def check_same_kept_set(got: Sequence[Sequence], reference: Sequence[Mapping], *, score_tol: float = 1e-5,
                        box_tol: float = 1e-3, source: str = "transformers' post-processing") -> None:
    """The detections another post-processing kept (per page: labels, scores, boxes; by default
    transformers' post_process_object_detection), compared as a set with ours: the same
    (label, score, box) entries, whatever their order."""
    if len(got) != len(reference):
        raise AssertionError(f"{len(got)} pages, {source} has {len(reference)}")
    for p, (page, ref) in enumerate(zip(got, reference)):
        ours = sorted((d.label_id, d.score, d.bbox) for d in page)
        theirs = sorted(zip(ref["labels"], ref["scores"], map(tuple, ref["boxes"])))
        if len(ours) != len(theirs):
            raise AssertionError(f"page {p}: {len(ours)} detections kept, {source} {len(theirs)}")
        for (la, sa, ba), (lb, sb, bb) in zip(ours, theirs):
            if la != lb or abs(sa - sb) > score_tol or max(abs(x - y) for x, y in zip(ba, bb)) > box_tol:
                raise AssertionError(f"page {p}: ({la}, {sa:.6f}, {ba}) != {source}: ({lb}, {sb:.6f}, {bb})")
