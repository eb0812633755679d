"""PP-DocLayoutV3 as a detector family: our modules vs transformers' PPDocLayoutV3ForObjectDetection
on a tiny random config (same weights: built by transformers, written by save_pretrained, read by
our loader; fp32 on the CPU), the preprocessing against an independent bicubic, the
post-processing against a hand-computed case, the registry, the plan's deformable attention kind
and the runner's detector path."""
from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from fastdeploy_ext.models.interface import CheckpointError, DetectorFamily, FamilyRole, ModelFamily, VLMFamily
from fastdeploy_ext.models.pp_doclayout_v3.config import RELEASED_LABELS, PPDocLayoutV3Config
from fastdeploy_ext.models.pp_doclayout_v3.loader import load_detector
from fastdeploy_ext.models.pp_doclayout_v3.postprocess import detections, reading_order_ranks
from fastdeploy_ext.models.pp_doclayout_v3.processor import DetectorImageProcessor, DetectorPreprocessorConfig, resize_uint8
from fastdeploy_ext.models.registry import available_families, detect_family, get_family

from . import pp_doclayout_fixture as fx

CPU = torch.device("cpu")
OUTPUTS = ("logits", "pred_boxes", "order_logits", "enc_outputs_class", "enc_outputs_coord_logits")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("pp_doclayout_v3_tiny")
    ref = fx.write_model(path)
    return path, ref


@pytest.fixture(scope="module")
def ours(tiny):
    path, _ = tiny
    cfg = PPDocLayoutV3Config.from_model_dir(str(path))
    model, report = load_detector(str(path), dtype=torch.float32, device=CPU, cfg=cfg)
    return model, report, cfg


def max_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """Max abs error over finite entries; the non-finite ones (anchors outside the page are the
    dtype's max) must sit at the same places with the same values."""
    fin = torch.isfinite(a)
    assert torch.equal(fin, torch.isfinite(b))
    assert torch.equal(a[~fin], b[~fin])
    return (a[fin] - b[fin]).abs().max().item()


# ---------------------------------------------------------------------------------- the seam
def test_the_registry_lists_both_roles_and_detects_the_detector_by_model_type(tiny):
    families = available_families()
    assert issubclass(families["paddleocr_vl"], ModelFamily) and families["paddleocr_vl"].role is FamilyRole.VLM
    assert issubclass(families["pp_doclayout_v3"], DetectorFamily)
    assert families["pp_doclayout_v3"].role is FamilyRole.DETECTOR
    assert VLMFamily is ModelFamily
    choice = detect_family(str(tiny[0]))
    assert choice.family.name == "pp_doclayout_v3" and "pp_doclayout_v3" in choice.reason



def test_labels_are_the_released_names_in_id_order(ours):
    _, _, cfg = ours
    assert cfg.labels == RELEASED_LABELS and len(RELEASED_LABELS) == 25
    assert RELEASED_LABELS[0] == "abstract" and RELEASED_LABELS[22] == "text" and RELEASED_LABELS[24] == "vision_footnote"
    assert PPDocLayoutV3Config().labels == RELEASED_LABELS      # the built-in config (no checkpoint here)


# ---------------------------------------------------------------------------------- the loader
def test_the_loader_reads_what_save_pretrained_writes(tiny, ours):
    from safetensors.torch import load_file
    path, ref = tiny
    model, report, _ = ours
    written = load_file(str(path / "model.safetensors"))
    # every written tensor is loaded or knowingly ignored (step counters, the training-only
    # denoising embedding), and every parameter of ours is loaded
    assert report.tensors_loaded + report.tensors_ignored == len(written)
    assert report.tensors_loaded == len(model.state_dict())
    for name, t in written.items():
        key = name.removeprefix("model.")
        if key in model.state_dict():
            assert torch.equal(model.state_dict()[key], t), name


def test_at_the_default_config_the_checkpoint_has_907_tensors():
    """save_pretrained writes 907 tensors at the default config: ours + one step counter per
    BatchNorm outside the backbone (the reference freezes the backbone's, which drops theirs) +
    the denoising embedding (counted on ``meta``: no weights are built)."""
    from fastdeploy_ext.models.pp_doclayout_v3.model import BatchNorm, PPDocLayoutV3
    with torch.device("meta"):
        model = PPDocLayoutV3(PPDocLayoutV3Config())
    norms = sum(isinstance(m, BatchNorm) and not m.folded for m in model.modules())
    assert len(model.state_dict()) + norms + 1 == 907
    assert 30e6 < sum(p.numel() for p in model.parameters()) < 36e6      # ~33 M


def test_a_bad_checkpoint_is_refused_naming_the_tensor(tiny, tmp_path):
    from safetensors.torch import load_file, save_file
    path, _ = tiny
    for f in ("config.json", "preprocessor_config.json"):
        (tmp_path / f).write_text((path / f).read_text())
    tensors = load_file(str(path / "model.safetensors"))
    cfg = PPDocLayoutV3Config.from_model_dir(str(path))
    dropped = dict(tensors)
    dropped.pop("model.decoder_norm.weight")
    save_file(dropped, str(tmp_path / "model.safetensors"))
    with pytest.raises(CheckpointError, match="missing.*model.decoder_norm.weight"):
        load_detector(str(tmp_path), dtype=torch.float32, device=CPU, cfg=cfg)
    wrong = dict(tensors)
    wrong["model.decoder_norm.weight"] = torch.zeros(7)
    save_file(wrong, str(tmp_path / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"model.decoder_norm.weight.*shape \[7\]"):
        load_detector(str(tmp_path), dtype=torch.float32, device=CPU, cfg=cfg)


def test_a_config_asking_for_what_is_not_built_is_refused_by_field(tiny, tmp_path):
    path, _ = tiny
    data = json.loads((path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(data | {"learn_initial_query": True}))
    with pytest.raises(CheckpointError, match="learn_initial_query"):
        PPDocLayoutV3Config.from_model_dir(str(tmp_path))
    (tmp_path / "config.json").write_text(json.dumps(data | {"d_model": 33}))
    with pytest.raises(CheckpointError, match="d_model 33"):
        PPDocLayoutV3Config.from_model_dir(str(tmp_path))


# ---------------------------------------------------------------------------------- parity
def test_fp32_parity_with_transformers(tiny, ours):
    _, ref = tiny
    model, _, cfg = ours
    pixels = fx.sample_pixels()
    with torch.no_grad():
        want = ref(pixel_values=pixels)
        got = model(pixels)
    # the fixture's seed keeps fp32 rounding from swapping the encoder's top-k
    scores = want.enc_outputs_class.max(-1).values.sort(-1, descending=True).values
    k = cfg.num_queries
    assert (scores[:, k - 1] - scores[:, k]).min().item() >= 1e-3
    for name in OUTPUTS:
        a, b = getattr(want, name), getattr(got, name)
        assert a.shape == b.shape, name
        assert max_err(a, b) <= 1e-4, name
    assert got.out_masks is None            # masks are off unless asked


def test_the_mask_outputs_when_asked_match_transformers(tiny, ours):
    _, ref = tiny
    model, _, _ = ours
    pixels = fx.sample_pixels(1)
    model.with_masks = True
    try:
        with torch.no_grad():
            want, got = ref(pixel_values=pixels), model(pixels)
    finally:
        model.with_masks = False
    assert got.out_masks.shape == want.out_masks.shape
    assert max_err(want.out_masks, got.out_masks) <= 1e-4


def test_bf16_runs_and_stays_close_before_the_top_k(ours, tiny):
    """bf16 on the CPU: finite outputs in bf16, and the encoder's per-position scores (before any
    top-k, so no index can swap) close to fp32's by cosine."""
    path, _ = tiny
    model32, _, cfg = ours
    model16, _ = load_detector(str(path), dtype=torch.bfloat16, device=CPU, cfg=cfg)
    pixels = fx.sample_pixels(1)
    with torch.no_grad():
        a, b = model32(pixels), model16(pixels.bfloat16())
    assert b.logits.dtype == torch.bfloat16 and torch.isfinite(b.logits).all() and torch.isfinite(b.pred_boxes).all()
    cos = torch.nn.functional.cosine_similarity(a.enc_outputs_class.flatten(), b.enc_outputs_class.float().flatten(), 0)
    assert cos.item() >= 0.99


def test_the_parity_test_sees_a_wrong_kernel(tiny, ours):
    """Fault injection through the kernel seam: a deformable kernel whose sampling points are off
    by half a cell (align_corners=True) must fail parity."""
    import torch.nn.functional as F
    from fastdeploy_ext.models.pp_doclayout_v3.model import deformable_sample
    _, ref = tiny
    model, _, _ = ours

    def shifted(value, shapes, locations, weights):
        real = F.grid_sample
        try:
            F.grid_sample = lambda *a, **kw: real(*a, **(kw | {"align_corners": True}))
            return deformable_sample(value, shapes, locations, weights)
        finally:
            F.grid_sample = real
    pixels = fx.sample_pixels(1)
    model.set_deformable_kernel(shifted)
    try:
        with torch.no_grad():
            got = model(pixels)
    finally:
        model.set_deformable_kernel(deformable_sample)
    with torch.no_grad():
        want = ref(pixel_values=pixels)
    assert max_err(want.logits, got.logits) > 1e-4


# ---------------------------------------------------------------------------------- preprocessing
def _cubic(t: np.ndarray, a: float = -0.75) -> np.ndarray:
    """Keys' cubic convolution weights for the 4 taps at offsets -1, 0, 1, 2 from floor(src)."""
    d = np.stack([t + 1, t, 1 - t, 2 - t], -1)
    near = ((a + 2) * d - (a + 3)) * d * d + 1
    far = ((a * d - 5 * a) * d + 8 * a) * d - 4 * a
    return np.where(d <= 1, near, far)


def _bicubic_reference(img: np.ndarray, out_h: int, out_w: int) -> np.ndarray:
    """An independent bicubic resize (float64 numpy, half-pixel centres, edge taps clamped),
    rounded and clamped to uint8 values: the golden pixels."""
    def axis(n_in, n_out):
        src = (np.arange(n_out) + 0.5) * (n_in / n_out) - 0.5
        i0 = np.floor(src).astype(int)
        w = _cubic(src - i0)
        idx = np.clip(i0[:, None] + np.arange(-1, 3)[None], 0, n_in - 1)
        m = np.zeros((n_out, n_in))
        for r in range(n_out):
            for c in range(4):
                m[r, idx[r, c]] += w[r, c]
        return m
    mh, mw = axis(img.shape[1], out_h), axis(img.shape[2], out_w)
    out = mh @ img.astype(np.float64) @ mw.T            # rows, then columns, per channel
    return np.clip(np.round(out), 0, 255)


@pytest.mark.parametrize("src_hw,dst_hw", [((9, 13), (16, 16)), ((40, 30), (16, 16)), ((16, 16), (16, 16)),
                                            ((300, 200), (800, 800))])
def test_the_resize_matches_an_independent_bicubic(src_hw, dst_hw):
    g = np.random.default_rng(5)
    img = g.integers(0, 256, (3, *src_hw), dtype=np.uint8)
    got = resize_uint8(torch.from_numpy(img), *dst_hw).numpy()
    want = _bicubic_reference(img, *dst_hw)
    # float32 vs float64 may land a value on the other side of .5: at most 1 level, rarely (a
    # page-sized upscale: ~6 in a million values; the small cases: none)
    diff = np.abs(got - want)
    assert diff.max() <= 1 and (diff > 0).mean() < 1e-4
    if max(src_hw) < 100:
        assert diff.max() == 0
    assert got.dtype == np.float32 and np.all(got == np.round(got))


def test_the_processor_scales_to_unit_range_and_keeps_page_sizes(tiny):
    proc = get_family("pp_doclayout_v3").image_processor(str(tiny[0]), None)
    assert (proc.cfg.height, proc.cfg.width) == (fx.IMAGE, fx.IMAGE)
    page = np.full((50, 70, 3), 255, dtype=np.uint8)
    pv, sizes = proc.preprocess([page, torch.zeros(3, 20, 10, dtype=torch.uint8)])
    assert pv.shape == (2, 3, fx.IMAGE, fx.IMAGE) and sizes == [(50, 70), (20, 10)]
    assert torch.equal(pv[0], torch.ones_like(pv[0])) and torch.equal(pv[1], torch.zeros_like(pv[1]))
    with pytest.raises(ValueError, match=r"\[h, w, 3\]"):
        proc.preprocess([np.zeros((4, 4), dtype=np.uint8)])
    assert DetectorImageProcessor(DetectorPreprocessorConfig()).cfg.height == 800


# ---------------------------------------------------------------------------------- post-processing
def test_postprocessing_on_a_hand_computed_case():
    """2 queries x 2 classes, scores q0 (a 0.9, b 0.2), q1 (a 0.4, b 0.7). The pointer's logit
    (0, 1) = -4: "q0 before q1" improbable, so q1 reads first."""
    logit = lambda p: math.log(p / (1 - p))  # noqa: E731
    logits = torch.tensor([[[logit(0.9), logit(0.2)], [logit(0.4), logit(0.7)]]])
    boxes = torch.tensor([[[0.5, 0.5, 0.2, 0.4], [0.25, 0.1, 0.5, 0.2]]])
    order = torch.tensor([[[-1e4, -4.0], [-1e4, -1e4]]])
    # votes: q0 = 0 + (1 - sigmoid(-1e4)) ... computed by hand: q0 gets 1 - sigmoid(-4) = 0.982,
    # q1 gets sigmoid(-4) = 0.018 -> q1 ranks first
    assert reading_order_ranks(order).tolist() == [[1, 0]]
    dets = detections(logits, boxes, order, [(100, 200)], ("a", "b"), threshold=0.5)[0]
    # kept: (q0, a, 0.9), (q1, b, 0.7); q1 first in reading order
    assert [(d.label, round(d.score, 6), d.order) for d in dets] == [("b", 0.7, 0), ("a", 0.9, 1)]
    # q1: cx 0.25 cy 0.1 w 0.5 h 0.2 on a 200 x 100 page -> x 0..100, y 0..20
    assert dets[0].bbox == pytest.approx((0.0, 0.0, 100.0, 20.0))
    assert dets[1].bbox == pytest.approx((80.0, 30.0, 120.0, 70.0))
    # top-k keeps k = 2 (queries) of the 4 scores: (q1, a, 0.4) is out even under a 0.3 threshold
    assert [d.label for d in detections(logits, boxes, order, [(100, 200)], ("a", "b"), threshold=0.3)[0]] == ["b", "a"]
    assert [d.label for d in detections(logits, boxes, order, [(100, 200)], ("a", "b"), threshold=0.8)[0]] == ["a"]
    assert dets[0].to_json() == {"label": "b", "score": dets[0].score, "bbox": list(dets[0].bbox)}


# ---------------------------------------------------------------------------------- plan and runner
def test_the_plan_resolves_the_deformable_kind_on_every_shipped_row():
    from fastdeploy_ext.capabilities import capability_table
    from fastdeploy_ext.plan import ComponentKind, PlanError, PlanRequest, resolve_for_components
    family = get_family("pp_doclayout_v3")
    components = family.components(family.default_config())
    assert [c.kind for c in components] == [ComponentKind.DEFORMABLE_ATTENTION, ComponentKind.DENSE_ATTENTION]
    for name, row in capability_table().items():
        plan = resolve_for_components(row, PlanRequest(), components, device="cpu", kernels={},
                                      text_available={})
        assert plan.kernel(ComponentKind.DEFORMABLE_ATTENTION).value == "aten_grid_sample", name
        assert plan.kernel(ComponentKind.DENSE_ATTENTION).value == "sdpa", name
        assert plan.attention.value is None and plan.text_attention.value is None
    bare = row.with_entries(ComponentKind.DEFORMABLE_ATTENTION, ())
    with pytest.raises(PlanError, match=f"row {bare.name} lists no backend for kernel kind deformable_attention"):
        resolve_for_components(bare, PlanRequest(), components, device="cpu", kernels={}, text_available={})


def _cpu_runner():
    from fastdeploy_ext.plan import PlanRequest
    from fastdeploy_ext.runner import get_backend_class
    return get_backend_class("cpu").create(PlanRequest(device="cpu", dtype="float32"))


def test_the_runner_runs_the_detector_on_the_plans_device(tiny, ours):
    from fastdeploy_ext.plan import ComponentKind
    path, ref = tiny
    runner = _cpu_runner()
    report = runner.load_detector(str(path))
    assert report.tensors_loaded == ours[1].tensors_loaded
    assert runner.plan.kernel(ComponentKind.DEFORMABLE_ATTENTION).value == "aten_grid_sample"
    assert [c.name for c in runner.plan.components] == ["decoder.cross_attention", "encoder.aifi_attention"]
    pixels = fx.sample_pixels()
    sizes = [(300, 200), (128, 128)]
    got = runner.detect(pixels, sizes, threshold=0.5)
    with torch.no_grad():
        want = ref(pixel_values=pixels)
    expect = detections(want.logits, want.pred_boxes, want.order_logits, sizes, RELEASED_LABELS, threshold=0.5)
    assert [[(d.label, d.order) for d in page] for page in got] == [[(d.label, d.order) for d in page]
                                                                    for page in expect]
    for g_page, w_page in zip(got, expect):
        assert g_page, "the fixture yields detections above 0.5"
        for g, w in zip(g_page, w_page):
            assert g.score == pytest.approx(w.score, abs=1e-5)
            assert g.bbox == pytest.approx(w.bbox, abs=1e-3)
    orders = [d.order for d in got[0]]
    assert orders == sorted(orders)


def test_the_runner_refuses_the_wrong_role_both_ways(tiny):
    runner = _cpu_runner()
    with pytest.raises(ValueError, match="pp_doclayout_v3 is a detector family; load_model .* needs a vlm family"):
        runner.load_model(str(tiny[0]))
    with pytest.raises(ValueError, match="paddleocr_vl is a vlm family; load_detector .* needs a detector family"):
        runner.load_detector(None, load_format="dummy", model_family="paddleocr_vl")
    with pytest.raises(RuntimeError, match="no detector loaded"):
        runner.detect(torch.zeros(1, 3, 8, 8), [(8, 8)], threshold=0.5)


# ---------------------------------------------------------------------------------- no host syncs
def _meta_detector(tiny):
    from fastdeploy_ext.models.pp_doclayout_v3.model import PPDocLayoutV3
    cfg = PPDocLayoutV3Config.from_model_dir(str(tiny[0]))
    with torch.device("meta"):
        return PPDocLayoutV3(cfg).eval()


def test_the_detector_forward_has_no_host_sync(tiny):
    """The host path's proof: the forward on ``meta`` tensors (where a read-back or a
    data-dependent op is an op the guard sees) under the guard every leg runs."""
    from fastdeploy_ext.sync_guard import HostSyncGuard
    model = _meta_detector(tiny)
    with torch.inference_mode(), HostSyncGuard({"meta"}):
        out = model(torch.zeros(2, 3, fx.IMAGE, fx.IMAGE, device="meta"))
    assert out.logits.shape == (2, 20, 25) and out.order_logits.shape == (2, 20, 20)


@pytest.mark.parametrize("mutation", ["item", "nonzero"])
def test_the_sync_guard_fires_on_a_sync_injected_into_the_detector(tiny, monkeypatch, mutation):
    from fastdeploy_ext.models.pp_doclayout_v3 import model as mod
    from fastdeploy_ext.sync_guard import HostSyncError, HostSyncGuard
    real = mod.mask_boxes

    def syncing(mask, dtype):
        if mutation == "item":
            mask.any().item()
        else:
            mask.nonzero()
        return real(mask, dtype)
    monkeypatch.setattr(mod, "mask_boxes", syncing)
    model = _meta_detector(tiny)
    with pytest.raises(HostSyncError), torch.inference_mode(), HostSyncGuard({"meta"}):
        model(torch.zeros(1, 3, fx.IMAGE, fx.IMAGE, device="meta"))


def test_masks_are_off_unless_asked_and_computed_when_asked(tiny):
    path, ref = tiny
    runner = _cpu_runner()
    runner.load_detector(str(path))
    assert runner.detector_masks.value is False and "off unless asked" in runner.detector_masks.reason
    pixels = fx.sample_pixels(1)
    assert runner.detect_uploaded(pixels).out_masks is None
    assert "masks off" in runner.describe()
    runner.load_detector(str(path), masks=True)
    assert runner.detector_masks.value is True and runner.detector_masks.reason == "requested"
    got = runner.detect_uploaded(pixels).out_masks
    with torch.no_grad():
        want = ref(pixel_values=pixels).out_masks
    assert got.shape == want.shape == (1, 20, fx.IMAGE // 4, fx.IMAGE // 4)
