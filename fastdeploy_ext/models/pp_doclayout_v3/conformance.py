"""PP-DocLayoutV3's conformance fixture: the tiny checkpoint, pages and transformers outputs the
suite ships as package data (conformance/reference_data: tiny_detector, detector_outputs,
detector_detections, produced by conformance/make_references.py from tiny.py),
and, where transformers is installed, the same outputs computed live. A reference that is
missing or whose inputs changed is an error, never a skip."""
from __future__ import annotations

import ast
from functools import cached_property

import torch

from ...conformance.family_fixture import DetectCase, DetectorConformanceFixture
from ...conformance.references import Manifest

LIVE_UNAVAILABLE = "live transformers reference unavailable ({}); comparing against the shipped one only"


class PPDocLayoutV3Conformance(DetectorConformanceFixture):
    @cached_property
    def references(self) -> Manifest:
        return Manifest.load()

    def _expected(self, model_dir, pixels, shipped) -> dict[str, dict[str, torch.Tensor]]:
        from ...conformance.make_references import DETECTOR_OUTPUTS, reference_detector_outputs
        refs = {"shipped": {k: shipped[k] for k in DETECTOR_OUTPUTS}}
        try:
            refs["live"] = reference_detector_outputs(model_dir, pixels)
        except ImportError as e:            # transformers not installed: the shipped copy is the reference
            print(LIVE_UNAVAILABLE.format(e))
        return refs

    def detect_case(self) -> DetectCase:
        from ...conformance.make_references import pixels_sha256
        from .tiny import page_pixels
        model_dir = self.references.path("tiny_detector")
        shipped, info = self.references.tensors("detector_outputs")
        pixels, sizes = page_pixels(model_dir)
        # the goldens hold for these pixels only: our processor must still make them
        assert info["pixel_values_sha256"] == pixels_sha256(pixels), (
            "our processor's pixels for the tiny detector's pages changed since the reference outputs were "
            "computed; regenerate with `python -m fastdeploy_ext.conformance.make_references --only "
            "detector_outputs detector_detections`")
        assert torch.equal(shipped["pixel_values"], pixels)
        assert [tuple(s) for s in ast.literal_eval(info["page_sizes"])] == sizes
        golden = self.references.json("detector_detections")
        return DetectCase(model_dir, pixels, sizes, shipped["logits"].shape[1], golden["threshold"],
                          lambda device=None: self._expected(model_dir, pixels, shipped), golden["pages"],
                          reference_postprocess=golden.get("transformers"))
