"""The KV pool's memory profile for each VLM family: the measured path (a device API with
allocator statistics, faked on the host) encodes the family's own dummy batch
(ModelFamily.profile_images) through its real encoder, and the estimate (ModelFamily.activation_bytes)
is positive and grows with the encoder budget. DeepSeek-OCR-2 once crashed here on PaddleOCR-VL's
``cfg.vision``."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers.models.deepseek_ocr2")

from fastdeploy_ext import memory_profile  # noqa: E402
from fastdeploy_ext.device_api import DeviceAPI  # noqa: E402
from fastdeploy_ext.plan import PlanRequest  # noqa: E402
from fastdeploy_ext.runner import get_backend_class  # noqa: E402


class FakeStatsAPI(DeviceAPI):
    """The host, claiming allocator statistics: the peak grows by 100 bytes per reading."""
    name = "fake-stats"
    allocator_stats = True

    def __init__(self):
        super().__init__(torch.device("cpu"))
        self.reads = 0

    def synchronize(self):
        pass

    def empty_cache(self):
        pass

    def reset_peak_allocated(self):
        pass

    def allocated_bytes(self):
        return 1000

    def peak_allocated_bytes(self):
        self.reads += 1
        return 1000 + 100 * self.reads


@pytest.fixture(scope="module")
def runners(tmp_path_factory):
    from fastdeploy_ext.conformance.tiny_text_model import write_tiny_vl_model
    from fastdeploy_ext.models.deepseek_ocr2 import tiny
    root = tmp_path_factory.mktemp("memprof")
    dirs = {"paddleocr_vl": write_tiny_vl_model(root / "paddle", tied=True, seed=0),
            "deepseek_ocr2": tiny.write_checkpoint(root / "dsocr2", seed=0)}
    out = {}
    for name, d in dirs.items():
        r = get_backend_class("cpu").create(PlanRequest(device="cpu", dtype="float32"))
        r.load_model(str(d), with_text=True, model_family=name)
        assert r.family.name == name
        out[name] = r
    return out


# (family, budget, images the hook must choose, grid of each): PaddleOCR-VL one near-square grid
# within the budget; DeepSeek-OCR-2 as many crop-less images (4096 patches each) as fit, at least one
CASES = [("paddleocr_vl", 100, 1, (1, 10, 10)), ("deepseek_ocr2", 9000, 2, (1, 1, 1)),
         ("deepseek_ocr2", 100, 1, (1, 1, 1))]


@pytest.mark.parametrize("family,budget,images,grid", CASES)
def test_measured_profile_encodes_the_familys_dummy_batch(runners, monkeypatch, family, budget, images, grid):
    r = runners[family]
    monkeypatch.setattr(r, "device_api", FakeStatsAPI())
    seen = []
    encode = r.encode_images

    def recording(batch):
        out = encode(batch)
        seen.append((batch, out))
        return out
    monkeypatch.setattr(r, "encode_images", recording)
    peak = memory_profile.profile_peak_memory(r, 32, budget)
    assert peak == 200                      # the prefill's reading (2nd) minus allocated_bytes
    (batch, out), = seen
    assert batch.grid_thw == [grid] * images
    assert r.family.check_pixels(r.cfg, batch.pixel_values, batch.grid_thw) == [grid] * images
    assert [o.shape[0] for o in out] == r.family.output_sizes(r.cfg, batch.grid_thw)
    assert sum(r.family.encoder_cost(r.cfg, g) for g in batch.grid_thw) <= max(budget, r.family.encoder_cost(r.cfg, grid))
    assert r.text.kv is None                # the temporary cache is freed


def test_estimate_for_deepseek_is_positive_and_grows_with_the_encoder_budget(runners):
    r = runners["deepseek_ocr2"]
    small, big = (memory_profile.profile_peak_memory(r, 32, p) for p in (4096, 65536))
    assert 0 < small < big
    vision_small, _ = r.family.activation_bytes(r.cfg, 32, 4096, 4)
    vision_big, _ = r.family.activation_bytes(r.cfg, 32, 65536, 4)
    assert 0 < vision_small < vision_big


def test_paddleocr_vl_estimate_is_the_formula_it_always_was(runners):
    """PaddleOCR-VL's figure through the family hook, against the formula written out."""
    r = runners["paddleocr_vl"]
    vc, tc, el = r.cfg.vision, r.cfg.text, 4
    q, kv = tc.num_attention_heads * tc.head_dim, tc.num_key_value_heads * tc.head_dim
    vision = 1024 * (7 * vc.hidden_size + vc.intermediate_size) * el
    text = 256 * (3 * tc.hidden_size + q + 2 * kv + q + 3 * tc.intermediate_size) * el
    assert memory_profile.estimate_peak_bytes(r, 256, 1024) == int(max(vision, text + 256 * tc.vocab_size * 4) * 1.5)
