"""PP-DocLayoutV2's conformance fixture (every leg, ``--fdx-detector-family pp_doclayout_v2``).

Why its references are computed on the device under test: transformers reorders the queries
kept-first with ``argsort(kept.int(), descending=True)`` and no ``stable=True``. The sort keys are
0/1, so every kept query ties with every other one: the order within the kept block is the device
sort's own order of equal keys (the CPU's std::sort is stable up to 16 elements and not beyond;
CUDA's sort of 300 elements is a stable radix sort), and the reading-order network embeds
positions, so ``order_logits`` (and the permuted ``logits`` / ``pred_boxes``) depend on the device.
A tie-free fixture is impossible with more than one kept query, so:

- wherever transformers imports (every CPU leg but the no-transformers one, the H200's cuda and
  metax legs), the reference is transformers' model on the device under test, the same weights
  and pixels, fp32 ("live"), and the goldens are the post-processing of its outputs;
- the shipped outputs and goldens (reference_data/, computed by transformers on the CPU:
  ``python -m fastdeploy_ext.models.pp_doclayout_v2.conformance``) are compared on host devices
  only, whose sort made them; elsewhere without transformers there is no valid reference and the
  fixture fails saying so (never a skip).

Why order_logits may be compared teacher-forced: the reading-order network embeds each kept box's
corners as integers (the 0..1000 grid truncated), so order_logits are a step function of
pred_boxes. A box within the fp32 tolerance of the reference's whose grid coordinate sits at an
integer step truncates to the neighbouring integer (seen with the CUDA kernels and on an
AVX-512 CPU), and every order logit moves. Where that happens (``reconcile``), the kept set,
labels and boxes are still compared as they are, and order_logits are those of our network run on
the reference's own grid: the network is checked at the tolerance, the step is reported.

The tiny checkpoint is written from a seed by tiny.py (no shipped weights)."""
from __future__ import annotations

import dataclasses
import json
import tempfile
from functools import cached_property, partial
from pathlib import Path

import torch

from ...conformance.family_fixture import DetectCase, DetectorConformanceFixture
from . import tiny

DATA = Path(__file__).parent / "reference_data"
OUTPUTS_FILE, DETECTIONS_FILE = DATA / "outputs.safetensors", DATA / "detections.json"
#: the device type whose sort the shipped outputs were computed with
SHIPPED_SORT_DEVICE = "cpu"
OUTPUTS = ("logits", "pred_boxes", "order_logits", "enc_outputs_class", "enc_outputs_coord_logits")
REGENERATE = "regenerate with `python -m fastdeploy_ext.models.pp_doclayout_v2.conformance`"


def live_outputs(model_dir, pixels: torch.Tensor, device: torch.device) -> dict[str, torch.Tensor]:
    """transformers' PPDocLayoutV2ForObjectDetection on ``device`` (fp32): its outputs on the CPU.
    ImportError where transformers is not installed."""
    from ...ops.precision import fp32_convolutions
    from .reference import from_pretrained
    ref = from_pretrained(str(model_dir)).to(device)
    # fp32 as ours runs it: cuDNN's TF32 convolutions (on by default on CUDA) would be the
    # reference's error, not ours
    with torch.no_grad(), fp32_convolutions(device, torch.float32):
        out = ref(pixel_values=pixels.to(device))
    return {k: getattr(out, k).detach().float().cpu().contiguous() for k in OUTPUTS}


def check_threshold_margin(logits: torch.Tensor, thresholds, margin: float) -> float:
    """Every query's best score at least ``margin`` from its class's threshold in the reference
    (else a rounding-level difference could change the kept set, and with it every order logit)."""
    m = tiny.threshold_margin(logits, thresholds)
    if not m >= margin:
        raise AssertionError(f"a query's best score is {m:.3g} from its class threshold (< {margin:g}): choose "
                             "other fixture thresholds")
    return m


def goldens_of(outputs: dict[str, torch.Tensor], sizes, threshold: float) -> list[list[dict]]:
    """Our post-processing of reference outputs, as the golden JSON (label, label_id, score, bbox, order)."""
    from ..pp_doclayout_v3.config import RELEASED_LABELS
    from ..pp_doclayout_v3.postprocess import detections
    dets = detections(outputs["logits"], outputs["pred_boxes"], outputs["order_logits"], sizes, RELEASED_LABELS,
                      threshold=threshold)
    return [[{"label": d.label, "label_id": d.label_id, "score": d.score, "bbox": list(d.bbox), "order": d.order}
             for d in page] for page in dets]


def reconcile(runner, got, want: dict[str, torch.Tensor], *, tolerance: float):
    """``(outputs to compare, note)``: ours as they are, unless the kept boxes' integer grid
    differs from the reference's only by steps that a within-tolerance box difference crossed;
    then order_logits are our network's on the reference's grid, labels and number kept (the
    rest unchanged) and the note says how many coordinates stepped."""
    from .model import sorted_reading_order_inputs
    model = runner.detector
    dev, thr, order = model.class_order.device, model.thresholds, model.class_order
    ours = sorted_reading_order_inputs(got.logits.float().to(dev), got.pred_boxes.float().to(dev), thr, order)
    ref = sorted_reading_order_inputs(want["logits"].to(dev), want["pred_boxes"].to(dev), thr, order)
    if not (torch.equal(ours[1], ref[1]) and torch.equal(ours[2], ref[2])):
        return got, None                  # another kept set or order of classes: compared as it is
    steps = ours[0].long() != ref[0].long()
    if not steps.any():
        return got, None
    gap = (ours[0] - ref[0]).abs()[steps].max().item()
    if gap > 1000 * tolerance:            # more than the box tolerance moves on the grid: as it is
        return got, None
    with torch.no_grad():
        forced = model.reading_order(*ref)
    note = (f"{int(steps.sum())} kept-box grid coordinate(s) truncate to another integer than the reference's "
            f"(at most {gap:.2g} grid units apart, within the box tolerance): order_logits compared with our "
            "reading-order network run on the reference's grid")
    return dataclasses.replace(got, order_logits=forced.to(got.order_logits.device)), note


class PPDocLayoutV2Conformance(DetectorConformanceFixture):
    def __init__(self, workdir):
        super().__init__(workdir)
        if not str(workdir):             # the suite passes none (shipped references): a dir of our own
            self._tmp = tempfile.TemporaryDirectory(prefix="fdx-pp-doclayout-v2-")
            self.workdir = Path(self._tmp.name)
        self._live: dict[str, dict] = {}

    @cached_property
    def model_dir(self) -> Path:
        return tiny.write_model(self.workdir / "tiny_pp_doclayout_v2")

    @cached_property
    def shipped(self) -> tuple[dict[str, torch.Tensor], dict, list]:
        from safetensors import safe_open
        if not OUTPUTS_FILE.exists() or not DETECTIONS_FILE.exists():
            raise AssertionError(f"PP-DocLayoutV2's shipped references are missing ({DATA}): {REGENERATE}")
        with safe_open(str(OUTPUTS_FILE), "pt") as f:
            tensors, info = {k: f.get_tensor(k) for k in f.keys()}, f.metadata()
        return tensors, info, json.loads(DETECTIONS_FILE.read_text())

    def _live_on(self, device: torch.device):
        """The live reference on ``device`` (None without transformers), made once per device."""
        key = str(device)
        if key not in self._live:
            pixels, _ = tiny.page_pixels(self.model_dir)
            try:
                self._live[key] = live_outputs(self.model_dir, pixels, device)
            except ImportError as e:
                print(f"live transformers reference unavailable ({e})")
                self._live[key] = None
        return self._live[key]

    def expected(self, device: torch.device | None = None) -> dict[str, dict[str, torch.Tensor]]:
        device = torch.device("cpu") if device is None else torch.device(device)
        refs = {}
        if device.type == SHIPPED_SORT_DEVICE:
            refs["shipped"] = {k: self.shipped[0][k] for k in OUTPUTS}
        else:
            print(f"shipped PP-DocLayoutV2 reference not compared on {device}: its kept-first order is the "
                  f"{SHIPPED_SORT_DEVICE} sort's")
        live = self._live_on(device)
        if live is not None:
            refs["live"] = live
        if not refs:
            raise AssertionError(f"no PP-DocLayoutV2 reference is valid on {device}: the shipped one holds on "
                                 f"{SHIPPED_SORT_DEVICE} devices only (the kept-first sort's ties) and transformers "
                                 "is not importable for a live one")
        for source, want in refs.items():
            check_threshold_margin(want["logits"], tiny.THRESHOLDS, tiny.THRESHOLD_MARGIN)
        return refs

    def golden_for(self, device: torch.device) -> list[list[dict]]:
        """The live reference's post-processing where transformers imports, else the shipped goldens
        (valid on the shipped sort's devices only)."""
        live = self._live_on(torch.device(device))
        if live is not None:
            return goldens_of(live, list(tiny.PAGE_SIZES), tiny.DETECT_THRESHOLD)
        if torch.device(device).type != SHIPPED_SORT_DEVICE:
            raise AssertionError(f"no PP-DocLayoutV2 goldens are valid on {device} without transformers")
        return self.shipped[2]["pages"]

    def detect_case(self) -> DetectCase:
        from ...conformance.make_references import pixels_sha256
        pixels, sizes = tiny.page_pixels(self.model_dir)
        shipped, info, golden = self.shipped
        assert info["pixel_values_sha256"] == pixels_sha256(pixels) and torch.equal(shipped["pixel_values"], pixels), (
            f"our processor's pixels for the tiny PP-DocLayoutV2's pages changed since the references: {REGENERATE}")
        assert golden["threshold"] == tiny.DETECT_THRESHOLD
        case = DetectCase(self.model_dir, pixels, sizes, tiny.TINY["num_queries"], tiny.DETECT_THRESHOLD,
                          self.expected, golden["pages"], golden_for=self.golden_for)
        case = dataclasses.replace(case, reconcile=partial(reconcile, tolerance=case.tolerance))
        return dataclasses.replace(case, detections_for_goldens=partial(self.detections_for_goldens, case))

    def detections_for_goldens(self, case: DetectCase, runner):
        """runner.detect's detections, or, where the goldens' reference is reconciled (a grid step,
        see ``reconcile``), the post-processing of the reconciled outputs, with runner.detect's
        kept set checked against theirs."""
        from ...conformance.detector_checks import check_same_kept_set
        from ..pp_doclayout_v3.config import RELEASED_LABELS
        from ..pp_doclayout_v3.postprocess import detections
        got = runner.detect(case.pixels, case.sizes, threshold=case.threshold)
        refs = self.expected(runner.device)
        want = refs.get("live", refs.get("shipped"))        # the goldens' source (golden_for)
        compared, note = case.reconciled(runner, runner.detect_device(case.pixels), want)
        if note is None:
            return got, None
        dets = detections(compared.logits.float().cpu(), compared.pred_boxes.float().cpu(),
                          compared.order_logits.float().cpu(), list(case.sizes), RELEASED_LABELS,
                          threshold=case.threshold)
        check_same_kept_set(got, [{"labels": [d.label_id for d in page], "scores": [d.score for d in page],
                                   "boxes": [d.bbox for d in page]} for page in dets],
                            source="its own outputs' post-processing")
        return dets, note + "; the goldens compared with those outputs' post-processing"


def make_references(out: Path = DATA) -> None:
    """The shipped outputs (transformers on the CPU) and goldens (our post-processing of them)."""
    from safetensors.torch import save_file

    from ...conformance.make_references import pixels_sha256
    with tempfile.TemporaryDirectory() as d:
        model_dir = tiny.write_model(Path(d) / "m")
        pixels, sizes = tiny.page_pixels(model_dir)
        outputs = live_outputs(model_dir, pixels, torch.device("cpu"))
    check_threshold_margin(outputs["logits"], tiny.THRESHOLDS, tiny.THRESHOLD_MARGIN)
    out.mkdir(parents=True, exist_ok=True)
    save_file(outputs | {"pixel_values": pixels}, str(out / OUTPUTS_FILE.name),
              metadata={"pixel_values_sha256": pixels_sha256(pixels), "page_sizes": repr(sizes),
                        "sort_device": SHIPPED_SORT_DEVICE, "torch": torch.__version__})
    golden = {"threshold": tiny.DETECT_THRESHOLD, "sort_device": SHIPPED_SORT_DEVICE,
              "pages": goldens_of(outputs, sizes, tiny.DETECT_THRESHOLD)}
    (out / DETECTIONS_FILE.name).write_text(json.dumps(golden, indent=1))
    print(f"wrote {out}: {[len(p) for p in golden['pages']]} detections per page")


if __name__ == "__main__":
    make_references()
