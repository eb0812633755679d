"""PaddleOCR-VL's conformance fixture: the tiny checkpoints, images and transformers outputs the
suite ships as package data (fastdeploy_ext/conformance/reference_data, produced by
conformance/make_references.py), and, where transformers is installed, the same outputs
computed live. A reference that is missing or whose inputs changed is an error, never a skip.
"""
from __future__ import annotations

from functools import cached_property

import torch

from ...conformance.family_fixture import ConformanceFixture, EncodeCase, FamilyFact, GenerateCase, TextCase
from ...conformance.references import Manifest

LIVE_UNAVAILABLE = "live transformers reference unavailable ({}); comparing against the shipped one only"


class PaddleOCRVLConformance(ConformanceFixture):
    facts = frozenset(FamilyFact)      # every fact the suite checks is PaddleOCR-VL's

    @cached_property
    def references(self) -> Manifest:
        return Manifest.load()

    @cached_property
    def images(self):
        return self.references.files("images")

    # ------------------------------------------------------------------ encode
    def _batch(self, model_dir, n):
        from ...conformance.make_references import processed_batch
        return processed_batch(model_dir, self.images[:n])

    def _encode_expected(self) -> dict[str, list[torch.Tensor]]:
        from ...conformance.make_references import pixels_sha256
        model_dir = self.references.path("tiny_torch")
        batch = self._batch(model_dir, len(self.images))
        tensors, info = self.references.tensors("encoder_features")
        assert info["pixel_values_sha256"] == pixels_sha256(batch.pixel_values), (
            "the processor's pixels for the shipped images changed since the expected features were computed; "
            "regenerate with `python -m fastdeploy_ext.conformance.make_references --only encoder_features`")
        assert info["grid_thw"] == repr([tuple(g) for g in batch.grid_thw])
        refs = {"shipped": [tensors[f"image{i}"] for i in range(len(batch.grid_thw))]}
        try:
            from ...conformance.tiny_model import reference_image_features
            refs["live"] = reference_image_features(model_dir, batch.pixel_values, batch.grid_thw)
        except ImportError as e:            # transformers not installed: the shipped copy is the reference
            print(LIVE_UNAVAILABLE.format(e))
        return refs

    def encode_case(self) -> EncodeCase:
        dirs = {"torch": self.references.path("tiny_torch"), "paddle": self.references.path("tiny_paddle")}
        return EncodeCase(dirs, len(self.images), self._batch, self._encode_expected)

    # ------------------------------------------------------------------ text
    def text_case(self) -> TextCase:
        from ...conformance.make_references import pixels_sha256, text_prompt
        from ...runner import ImageBatch
        model_dir = self.references.path("tiny_vl")
        tensors, info = self.references.tensors("text_logits")
        image = next(p for p in self.images if p.name == info["image"])
        prompt, im = text_prompt(model_dir, image)
        assert info["pixel_values_sha256"] == pixels_sha256(im.pixel_values), "processor output changed: regenerate"
        assert prompt.token_ids == tensors["prompt_token_ids"].tolist(), (
            "our prompt ids for the shipped tokenizer/template changed since the reference was computed")
        refs = {"shipped": tensors["logits"]}
        cont = tensors["continuation"].tolist()
        try:
            from ...conformance.tiny_text_model import load_reference, reference_logits
            live = reference_logits(load_reference(model_dir), prompt.token_ids + cont, im.pixel_values,
                                    [list(im.grid_thw)])
            refs["live"] = live[len(prompt.token_ids) - 1:]
        except ImportError as e:
            print(LIVE_UNAVAILABLE.format(e))
        return TextCase(model_dir, prompt.token_ids, prompt.positions, prompt.rope_delta,
                        ImageBatch.from_images([im]), cont, refs)

    # ------------------------------------------------------------------ generate
    def generate_case(self) -> GenerateCase:
        from ...conformance.make_references import reference_greedy_ids
        model_dir = self.references.path("tiny_vl")
        expected = self.references.json("generate_greedy")
        assert [p.name for p in self.images] == expected["images"], "the expected ids are for the shipped images"
        prompt, max_tokens = expected["prompt"], expected["max_tokens"]
        return GenerateCase(model_dir, list(self.images), prompt, max_tokens, expected["token_ids"],
                            live=lambda imgs: reference_greedy_ids(model_dir, imgs, prompt, max_tokens))

    # ------------------------------------------------------------------ errors
    def bad_batches(self):
        return {
            "empty": (torch.empty(0, 3, 14, 14), [], "empty batch"),
            "grid_mismatch": (torch.randn(8, 3, 14, 14), [(1, 2, 2)], "patches"),
            "odd_grid": (torch.randn(6, 3, 14, 14), [(1, 2, 3)], "divisible"),
            "zero_dim": (torch.randn(0, 3, 14, 14), [(1, 0, 2)], "non-positive"),
            "bad_rank": (torch.randn(4, 3, 14), [(1, 2, 2)], "pixel_values must be"),
            "bad_patch": (torch.randn(4, 3, 16, 16), [(1, 2, 2)], "pixel_values must be"),
            "not_thw": (torch.randn(4, 3, 14, 14), [(2, 2)], r"\(t, h, w\)"),
            "int_pixels": (torch.zeros(4, 3, 14, 14, dtype=torch.int64), [(1, 2, 2)], "floating point"),
        }
