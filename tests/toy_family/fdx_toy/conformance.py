"""toy_vlm's conformance fixture: a tiny checkpoint and images written into the suite's work
dir, and the expected outputs computed by the family's own float64 reference (reference.py)."""
from __future__ import annotations

from functools import cached_property
from pathlib import Path

import torch

from fastdeploy_ext.conformance.family_fixture import ConformanceFixture, EncodeCase, GenerateCase, TextCase

from .config import ToyConfig
from .loader import write_checkpoint
from .processor import ToyImageProcessor
from .prompt import ChatTemplate, build_prompt, load_tokenizer
from .reference import ToyReference

# (width, height): any size, every image is resized to 32 x 32
IMAGE_SIZES = ((40, 24), (32, 32), (17, 53), (64, 48))
PROMPT, MAX_TOKENS = "OCR:", 8
CONTINUATION = (17, 101, 230, 45, 9, 200)


def write_images(path: Path, seed: int = 1) -> list[Path]:
    from PIL import Image
    path.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(seed)
    out = []
    for i, (w, h) in enumerate(IMAGE_SIZES):
        p = path / f"img{i}.png"
        Image.fromarray((torch.rand(h, w, 3, generator=g) * 255).to(torch.uint8).numpy()).save(p)
        out.append(p)
    return out


class ToyConformance(ConformanceFixture):
    facts = frozenset()     # one fixed grid, one metadata path that needs no device grid, torch layout only

    @cached_property
    def model_dir(self) -> Path:
        return write_checkpoint(self.workdir / "toy_vlm")

    @cached_property
    def images(self) -> list[Path]:
        return write_images(self.workdir / "images")

    @cached_property
    def reference(self) -> ToyReference:
        return ToyReference(self.model_dir)

    def _processed(self, model_dir: Path, paths):
        proc = ToyImageProcessor(ToyConfig.from_model_dir(model_dir))
        return [proc.preprocess(p) for p in paths]

    def _batch(self, model_dir: Path, n: int):
        from fastdeploy_ext.runner import ImageBatch
        return ImageBatch.from_images(self._processed(model_dir, self.images[:n]))

    def _features(self, paths) -> list[torch.Tensor]:
        return [self.reference.image_features(im.pixel_values) for im in self._processed(self.model_dir, paths)]

    def _prompt(self, n_images: int):
        cfg = self.reference.cfg
        return build_prompt(load_tokenizer(cfg), ChatTemplate(), cfg, prompt=PROMPT, image_grids=[cfg.grid] * n_images)

    def encode_case(self) -> EncodeCase:
        return EncodeCase({"torch": self.model_dir}, len(self.images), self._batch,
                          lambda: {"live": self._features(self.images)})

    def text_case(self) -> TextCase:
        p = self._prompt(1)
        ids = p.token_ids + list(CONTINUATION)
        logits = self.reference.logits(ids, self._features(self.images[:1]))
        return TextCase(self.model_dir, p.token_ids, p.positions, p.rope_delta, self._batch(self.model_dir, 1),
                        list(CONTINUATION), {"live": logits[len(p.token_ids) - 1:]})

    def _greedy(self, paths) -> list[list[int]]:
        ids = self._prompt(1).token_ids
        return [self.reference.greedy(ids, self._features([p]), MAX_TOKENS) for p in paths]

    def generate_case(self) -> GenerateCase:
        return GenerateCase(self.model_dir, self.images, PROMPT, MAX_TOKENS, self._greedy(self.images))

    def bad_batches(self):
        cfg = self.reference.cfg
        c, p, n = cfg.num_channels, cfg.patch_size, cfg.patches_per_image
        return {
            "empty": (torch.empty(0, c, p, p), [], "empty batch"),
            "grid_mismatch": (torch.randn(n // 2, c, p, p), [cfg.grid], "patches"),
            "odd_grid": (torch.randn(6, c, p, p), [(1, 2, 3)], r"every toy_vlm image is resized to 32x32: grid \(1, 4, 4\)"),
            "zero_dim": (torch.randn(0, c, p, p), [(1, 0, 2)], "non-positive"),
            "bad_rank": (torch.randn(4, c, p), [cfg.grid], "pixel_values must be"),
            "bad_patch": (torch.randn(n, c, p + 6, p + 6), [cfg.grid], "pixel_values must be"),
            "not_thw": (torch.randn(n, c, p, p), [(4, 4)], r"\(t, h, w\)"),
            "int_pixels": (torch.zeros(n, c, p, p, dtype=torch.int64), [cfg.grid], "floating point"),
        }
