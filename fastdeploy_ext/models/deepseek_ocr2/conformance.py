"""DeepSeek-OCR-2's conformance fixture: the tiny random model (tiny.py) written by transformers'
``save_pretrained`` into the suite's work dir, images of several crop counts (0, 2, 3, 0), and
the expected outputs computed live by transformers' own model (features, teacher-forced logits,
greedy ids of ``generate``). Nothing is shipped; transformers 5.24 (its ``deepseek_ocr2``) must
be importable wherever the suite runs on this family.

Facts: SYNC_INJECTION only (sync_targets: device tensors made from the host metadata's view
sizes on the builder's device, which the injected syncs read back). One layout (torch:
DeepSeek's names); the metadata's device path reads the grids back (no bitwise host/device
claim, no metadata tables of PaddleOCR-VL's kind); the vision tower has no varlen strided-qkv
kernel; the grid is (views, rows, cols), not a patch grid, so the variable-grid tests (padding
segments, budgets of patches) do not apply.
"""
from __future__ import annotations

from functools import cached_property
from pathlib import Path

import torch

from ...conformance.family_fixture import (ConformanceFixture, EncodeCase, FamilyFact, GenerateCase, SyncTargets,
                                           TextCase)
from . import tiny

# (width, height) -> crops: 600x500 none, 1600x900 2x1, 800x2400 1x3, 500x700 none
IMAGE_SIZES = ((600, 500), (1600, 900), (800, 2400), (500, 700))
# the generation case's images: none needs crops, so every prompt is ~260 tokens and the
# preemption test's growth (as long as the prompt) stays affordable; crops through the engine
# are tests/test_deepseek_ocr2_engine.py's
GENERATE_SIZES = ((600, 500), (500, 700), (768, 400), (300, 640))
PROMPT, MAX_TOKENS = "OCR:", 8       # the suite's prompt (an unknown word to the tiny tokenizer)
CONTINUATION = (17, 101, 230, 45, 9, 200)


def write_images(path: Path, seed: int = 1, sizes=IMAGE_SIZES) -> list[Path]:
    from PIL import Image
    path.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(seed)
    out = []
    for i, (w, h) in enumerate(sizes):
        p = path / f"img{i}.png"
        Image.fromarray((torch.rand(h, w, 3, generator=g) * 255).to(torch.uint8).numpy()).save(p)
        out.append(p)
    return out


class DeepseekOCR2Conformance(ConformanceFixture):
    facts = frozenset({FamilyFact.SYNC_INJECTION})

    def sync_targets(self, builder, meta) -> SyncTargets:
        """The metadata's host ints as device tensors on the builder's device, made by fill and
        scan kernels (no upload: on CUDA a pageable upload would sync by itself): the packed
        patch index, the views' patch offsets, the output rows as floats."""
        dev = builder.device
        sizes = torch.cat([torch.full((1,), n, dtype=torch.int32, device=dev) for n in meta.view_sizes])
        offsets = torch.cat([torch.zeros(1, dtype=torch.int32, device=dev), sizes.cumsum(0, dtype=torch.int32)])
        index = torch.arange(meta.num_tokens, device=dev)
        rows = torch.cat([torch.full((1,), float(n), device=dev) for n in meta.out_split_sizes])
        return SyncTargets(index, offsets, rows)

    @cached_property
    def model_dir(self) -> Path:
        return tiny.write_checkpoint(self.workdir / "deepseek_ocr2", seed=0)

    @cached_property
    def images(self) -> list[Path]:
        return write_images(self.workdir / "images")

    @cached_property
    def reference(self):
        from transformers import DeepseekOcr2ForConditionalGeneration
        return DeepseekOcr2ForConditionalGeneration.from_pretrained(str(self.model_dir)).eval()

    @cached_property
    def processor(self):
        return tiny.processor()

    def _pil(self, paths):
        from PIL import Image
        return [Image.open(p).convert("RGB") for p in paths]

    def _batch(self, model_dir: Path, n: int):
        from ...runner import ImageBatch
        from .config import DeepseekOCR2Config
        from .processor import DeepseekOCR2ImageProcessor
        proc = DeepseekOCR2ImageProcessor(DeepseekOCR2Config.from_model_dir(model_dir))
        return ImageBatch.from_images([proc.preprocess(p) for p in self.images[:n]])

    def _features(self, paths) -> list[torch.Tensor]:
        out = []
        with torch.inference_mode():
            for im in self._pil(paths):
                r = self.processor.image_processor(images=[im], return_tensors="pt")
                f = self.reference.model.get_image_features(
                    pixel_values=r["pixel_values"], pixel_values_local=r.get("pixel_values_local"),
                    num_local_patches=r["num_local_patches"]).pooler_output
                out.append(f[0].float())
        return out

    def _inputs(self, path):
        return self.processor(images=self._pil([path]), text="<image>\n" + PROMPT, return_tensors="pt")

    def encode_case(self) -> EncodeCase:
        # the core suite: one image without crops and one with (each image is a transformers
        # pass and ours at the real geometry: the cost of a leg)
        n = len(self.images) if self.suite == "full" else 2
        return EncodeCase({"torch": self.model_dir}, n, self._batch, lambda: {"live": self._features(self.images[:n])})

    def text_case(self) -> TextCase:
        r = self._inputs(self.images[0])
        ids = r["input_ids"][0].tolist()
        full = torch.tensor([ids + list(CONTINUATION)])
        with torch.inference_mode():
            logits = self.reference(input_ids=full, pixel_values=r["pixel_values"],
                                    num_local_patches=r["num_local_patches"]).logits[0].float()
        return TextCase(self.model_dir, ids, torch.arange(len(ids)).view(1, -1), 0, self._batch(self.model_dir, 1),
                        list(CONTINUATION), {"live": logits[len(ids) - 1:]})

    def _greedy(self, paths) -> list[list[int]]:
        out = []
        with torch.inference_mode():
            for p in paths:
                r = self._inputs(p)
                g = self.reference.generate(**r, max_new_tokens=MAX_TOKENS, min_new_tokens=MAX_TOKENS, do_sample=False)
                out.append(g[0, r["input_ids"].shape[1]:].tolist())
        return out

    def generate_case(self) -> GenerateCase:
        # the core suite's greedy and bf16 teacher-forced checks on two of the requests (each
        # request is a transformers generate call and two of ours: the cost of a leg)
        sizes = GENERATE_SIZES if self.suite == "full" else GENERATE_SIZES[:2]
        images = write_images(self.workdir / "generate_images", seed=2, sizes=sizes)
        longest = max(len(self._inputs(p)["input_ids"][0]) for p in images)
        return GenerateCase(self.model_dir, images, PROMPT, MAX_TOKENS, self._greedy(images),
                            max_prompt_len=longest)

    def bad_batches(self):
        n = 4096                      # one image without crops: its global view's patches
        return {
            "empty": (torch.empty(0, 3, 16, 16), [], "empty batch"),
            "grid_mismatch": (torch.randn(n // 2, 3, 16, 16), [(1, 1, 1)], "patches"),
            "odd_grid": (torch.randn(n, 3, 16, 16), [(4, 1, 2)], r"crops must be rows x cols"),
            "zero_dim": (torch.randn(0, 3, 16, 16), [(1, 0, 2)], "non-positive"),
            "bad_rank": (torch.randn(4, 3, 16), [(1, 1, 1)], "pixel_values must be"),
            "bad_patch": (torch.randn(n, 3, 14, 14), [(1, 1, 1)], "pixel_values must be"),
            "not_thw": (torch.randn(n, 3, 16, 16), [(1, 1)], r"\(views, rows, cols\)"),
            "int_pixels": (torch.zeros(n, 3, 16, 16, dtype=torch.int64), [(1, 1, 1)], "uint8 bytes or normalized floating-point"),
        }
