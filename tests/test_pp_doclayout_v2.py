"""PP-DocLayoutV2 as a detector family: our modules vs transformers' PPDocLayoutV2ForObjectDetection
on a tiny random config (same weights: built by transformers, written by save_pretrained, read by
our loader; fp32 on the CPU), the reading-order network alone at the edges (nothing kept,
everything kept), the post-processing against transformers' own post-processing code, the config
and loader guards, fault injections that the parity check must see (a wrong class order, a
stable kept-first sort), and the family through the runner, ``Detector`` and ``detect``."""
from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest
import torch

from fastdeploy_ext.models.interface import CheckpointError, DetectorFamily
from fastdeploy_ext.models.pp_doclayout_v2 import model as v2model
from fastdeploy_ext.models.pp_doclayout_v2.config import PPDocLayoutV2Config
from fastdeploy_ext.models.pp_doclayout_v2.loader import UNUSED_NAMES, load_detector
from fastdeploy_ext.models.pp_doclayout_v3.config import RELEASED_LABELS
from fastdeploy_ext.models.pp_doclayout_v3.postprocess import detections
from fastdeploy_ext.models.registry import BUILTIN_FAMILIES, available_families, detect_family, get_family

from . import pp_doclayout_v2_fixture as fx

CPU = torch.device("cpu")
OUTPUTS = ("logits", "pred_boxes", "order_logits", "enc_outputs_class", "enc_outputs_coord_logits")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("pp_doclayout_v2_tiny")
    ref = fx.write_model(path)
    return path, ref


@pytest.fixture(scope="module")
def ours(tiny):
    path, _ = tiny
    cfg = PPDocLayoutV2Config.from_model_dir(str(path))
    model, report = load_detector(str(path), dtype=torch.float32, device=CPU, cfg=cfg)
    return model, report, cfg


@pytest.fixture(scope="module")
def outputs(tiny, ours):
    """Both models on the sample pixels (batch 2)."""
    pixels = fx.sample_pixels()
    with torch.no_grad():
        return tiny[1](pixel_values=pixels), ours[0](pixels)


def max_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """Max abs error over finite entries; the non-finite ones (anchors outside the page are the
    dtype's max) must sit at the same places with the same values."""
    fin = torch.isfinite(a)
    assert torch.equal(fin, torch.isfinite(b))
    assert torch.equal(a[~fin], b[~fin])
    return (a[fin] - b[fin]).abs().max().item()


def kept_counts(ref, logits: torch.Tensor) -> list[int]:
    best, cls = logits.max(-1)
    return (best.sigmoid() >= torch.tensor(ref.config.class_thresholds)[cls]).sum(1).tolist()


# ---------------------------------------------------------------------------------- the seam
def test_the_registry_finds_v2_from_the_tree_and_by_model_type(tiny):
    # the built-in list names it, so the registry finds it whatever the installed metadata says
    assert BUILTIN_FAMILIES["pp_doclayout_v2"] == "fastdeploy_ext.models.pp_doclayout_v2.family:PPDocLayoutV2Family"
    assert issubclass(available_families()["pp_doclayout_v2"], DetectorFamily)
    choice = detect_family(str(tiny[0]))
    assert choice.family.name == "pp_doclayout_v2" and "pp_doclayout_v2" in choice.reason
    family = get_family("pp_doclayout_v2")
    assert family.label_names(family.read_config(str(tiny[0]))) == RELEASED_LABELS


# ---------------------------------------------------------------------------------- config and loader
def test_the_config_reads_thresholds_order_and_the_reading_order_network(ours):
    _, _, cfg = ours
    assert cfg.class_thresholds == pytest.approx(tuple(json.loads(
        (Path(ours[1].model_dir) / "config.json").read_text())["class_thresholds"]))
    assert cfg.class_order == tuple(fx.CLASS_ORDER) and cfg.backbone.out_indices == (2, 3, 4)
    ro = cfg.reading_order
    assert (ro.hidden_size, ro.num_attention_heads, ro.num_hidden_layers, ro.num_classes) == (32, 2, 2, 20)
    default = PPDocLayoutV2Config()         # the released architecture (no checkpoint here)
    assert (default.reading_order.hidden_size, default.reading_order.num_attention_heads,
            default.reading_order.intermediate_size, default.reading_order.num_hidden_layers) == (512, 8, 2048, 6)


def test_at_the_default_config_ours_has_the_references_tensors():
    """At the released sizes (both built on ``meta``: no weights), the reference's tensors less
    those the loader ignores have exactly our shapes (the names differ only where save_pretrained
    converts them, which the tiny checkpoint's load covers)."""
    from transformers import PPDocLayoutV2Config as RefConfig, PPDocLayoutV2ForObjectDetection
    from fastdeploy_ext.models.pp_doclayout_v2.loader import UNUSED_SUFFIXES
    cfg = PPDocLayoutV2Config()
    with torch.device("meta"):
        ref = PPDocLayoutV2ForObjectDetection(RefConfig(
            id2label=dict(enumerate(cfg.labels)), class_thresholds=list(cfg.class_thresholds),
            class_order=list(cfg.class_order)))
        ours = v2model.PPDocLayoutV2(cfg)
    want = sorted(tuple(t.shape) for n, t in ref.state_dict().items()
                  if n not in UNUSED_NAMES and not n.endswith(UNUSED_SUFFIXES))
    assert sorted(tuple(t.shape) for t in ours.state_dict().values()) == want
    assert 50e6 < sum(p.numel() for p in ours.parameters()) < 56e6


def test_a_config_v2_cannot_run_is_refused_by_field(tiny, tmp_path):
    data = json.loads((tiny[0] / "config.json").read_text())
    cases = [({"class_order": None}, "class_order is missing"),
             ({"class_thresholds": [0.5] * 3}, "class_thresholds has 3 entries for 25 classes"),
             ({"class_order": [25] * 25}, r"class_order entries must be reading-order class ids in \[0, 20\)"),
             ({"reading_order_config": dict(data["reading_order_config"], max_position_embeddings=10)},
              "max_position_embeddings 10 < num_queries"),
             ({"reading_order_config": dict(data["reading_order_config"], has_spatial_attention_bias=False)},
              "has_spatial_attention_bias"),
             ({"model_type": "pp_doclayout_v3"}, "is not pp_doclayout_v2")]
    for change, message in cases:
        (tmp_path / "config.json").write_text(json.dumps(data | change))
        with pytest.raises(CheckpointError, match=message):
            PPDocLayoutV2Config.from_model_dir(str(tmp_path))


def test_the_loader_reads_what_save_pretrained_writes(tiny, ours):
    from safetensors.torch import load_file
    path, _ = tiny
    model, report, _ = ours
    written = load_file(str(path / "model.safetensors"))
    state = model.state_dict()
    # every written tensor is loaded under its own name or knowingly ignored; every one of ours is loaded
    ignored = {n for n in written if n not in state}
    assert ignored == set(UNUSED_NAMES) | {n for n in written if n.endswith(".num_batches_tracked")}
    assert report.tensors_loaded == len(state) and report.tensors_loaded + report.tensors_ignored == len(written)
    assert all(torch.equal(state[n], t) for n, t in written.items() if n in state)
    assert any(n.startswith("reading_order.") for n in state) and any(n.startswith("model.decoder.class_embed.")
                                                                        for n in state)


def test_a_bad_checkpoint_is_refused_naming_the_tensor(tiny, tmp_path):
    from safetensors.torch import load_file, save_file
    path, _ = tiny
    (tmp_path / "config.json").write_text((path / "config.json").read_text())
    tensors = load_file(str(path / "model.safetensors"))
    cfg = PPDocLayoutV2Config.from_model_dir(str(path))
    name = "reading_order.relative_head.dense.weight"
    save_file({n: t for n, t in tensors.items() if n != name}, str(tmp_path / "model.safetensors"))
    with pytest.raises(CheckpointError, match=f"missing.*{name}"):
        load_detector(str(tmp_path), dtype=torch.float32, device=CPU, cfg=cfg)
    save_file(tensors | {"reading_order.extra.weight": torch.zeros(2)}, str(tmp_path / "model.safetensors"))
    with pytest.raises(CheckpointError, match="unexpected tensor 'reading_order.extra.weight'.*PP-DocLayoutV2"):
        load_detector(str(tmp_path), dtype=torch.float32, device=CPU, cfg=cfg)


# ---------------------------------------------------------------------------------- parity
def test_fp32_parity_with_transformers(tiny, ours, outputs):
    _, ref = tiny
    _, _, cfg = ours
    want, got = outputs
    # the fixture's seed keeps fp32 rounding from swapping the encoder's top-k
    scores = want.enc_outputs_class.max(-1).values.sort(-1, descending=True).values
    k = cfg.num_queries
    assert (scores[:, k - 1] - scores[:, k]).min().item() >= 1e-3
    # the thresholds keep a strict part of the queries: the reading-order network sees padding
    assert all(0 < n < k for n in kept_counts(ref, want.logits))
    for name in OUTPUTS:
        a, b = getattr(want, name), getattr(got, name)
        assert a.shape == b.shape, name
        assert max_err(a, b) <= 1e-4, name
    assert got.out_masks is None


@pytest.mark.parametrize("kept", ["none", "all"])
def test_the_reading_order_network_alone_at_the_edges(tiny, ours, kept):
    """The network on hand-made inputs where nothing is kept (only start and end tokens are real)
    and where every query is kept (no padding), against transformers' network."""
    ref_net, net = tiny[1].reading_order, ours[0].reading_order
    g = torch.Generator().manual_seed(1)
    q = ours[2].num_queries
    xy = torch.rand(2, q, 2, generator=g) * 800
    boxes = torch.cat([xy, xy + torch.rand(2, q, 2, generator=g) * 200], -1).clamp(0, 1000)
    labels = torch.randint(0, 20, (2, q), generator=g)
    mask = torch.full((2, q), kept == "all")
    if kept == "none":
        boxes, labels = torch.zeros_like(boxes), torch.zeros_like(labels)
    with torch.no_grad():
        want = ref_net(boxes=boxes, labels=labels, mask=mask)[:, :, :q]
        got = net(boxes, labels, mask.sum(1))
    assert max_err(want, got) <= 1e-4


def test_bf16_runs_and_stays_close_before_the_top_k(tiny, ours):
    path, _ = tiny
    model32, _, cfg = ours
    model16, _ = load_detector(str(path), dtype=torch.bfloat16, device=CPU, cfg=cfg)
    pixels = fx.sample_pixels(1)
    with torch.no_grad():
        a, b = model32(pixels), model16(pixels.bfloat16())
    assert b.logits.dtype == torch.bfloat16 and torch.isfinite(b.order_logits).all()
    assert model16.threshold_bits.view(torch.float32).tolist() == pytest.approx(cfg.class_thresholds, abs=1e-7)
    cos = torch.nn.functional.cosine_similarity(a.enc_outputs_class.flatten(), b.enc_outputs_class.float().flatten(), 0)
    assert cos.item() >= 0.99


def test_a_wrong_class_order_fails_parity(tiny, ours, outputs, monkeypatch):
    """Fault injection: the identity instead of the config's class order (the relabelling
    skipped) must move the order logits past the tolerance."""
    model = ours[0]
    want, _ = outputs
    monkeypatch.setattr(model, "class_order", torch.arange(len(fx.CLASS_ORDER)) % 20)
    with torch.no_grad():
        got = model(fx.sample_pixels())
    assert max_err(want.logits, got.logits) <= 1e-4          # the detector is untouched
    assert max_err(want.order_logits, got.order_logits) > 1e-4


def test_a_stable_kept_first_sort_fails_parity(tiny, ours, outputs, monkeypatch):
    """Why the kept-first reorder uses the reference's own (unstable) sort: a stable one feeds the
    network the same boxes in another order, which its position embeddings see."""
    model = ours[0]
    want, _ = outputs
    real = torch.argsort
    monkeypatch.setattr(v2model.torch, "argsort", lambda t, **kw: real(t, **kw, stable=True))
    with torch.no_grad():
        got = model(fx.sample_pixels())
    monkeypatch.undo()
    assert max_err(want.order_logits, got.order_logits) > 1e-4


# ---------------------------------------------------------------------------------- post-processing
def transformers_postprocess():
    """transformers' own ``PPDocLayoutV2ImageProcessor.post_process_object_detection`` and the
    ``_get_order_seqs`` it calls, compiled from its source file: the module imports torchvision
    at import time (not installed here, and PyPI's does not load with this CPU torch), while these
    two methods use torch only. Decorators and annotations are dropped (they name torchvision-era
    types); the bodies run as written."""
    import transformers
    src = Path(transformers.__file__).parent / "models/pp_doclayout_v2/image_processing_pp_doclayout_v2.py"
    cls = next(n for n in ast.parse(src.read_text()).body
               if isinstance(n, ast.ClassDef) and n.name == "PPDocLayoutV2ImageProcessor")
    funcs = [f for f in cls.body if isinstance(f, ast.FunctionDef)
             and f.name in ("post_process_object_detection", "_get_order_seqs")]
    assert len(funcs) == 2
    for f in funcs:
        f.decorator_list, f.returns = [], None
        for a in f.args.args + f.args.kwonlyargs:
            a.annotation = None
    ns: dict = {"torch": torch}
    exec(compile(ast.Module(body=funcs, type_ignores=[]), str(src), "exec"), ns)
    return type("TransformersV2PostProcess", (), {f.name: ns[f.name] for f in funcs})()


@pytest.mark.parametrize("threshold", [0.5, 0.3])
def test_postprocessing_equals_transformers_own(tiny, outputs, threshold):
    want, got = outputs
    sizes = [(300, 200), (128, 96)]
    expect = transformers_postprocess().post_process_object_detection(want, threshold=threshold,
                                                                      target_sizes=sizes)
    dets = detections(got.logits, got.pred_boxes, got.order_logits, sizes, RELEASED_LABELS, threshold=threshold)
    for page, ref_page in zip(dets, expect):
        assert len(page) == len(ref_page["labels"]) > 0
        assert [d.label_id for d in page] == ref_page["labels"].tolist()
        assert [d.order for d in page] == ref_page["order_seq"].tolist()
        assert [d.score for d in page] == pytest.approx(ref_page["scores"].tolist(), abs=1e-6)
        assert (torch.tensor([d.bbox for d in page]) - ref_page["boxes"]).abs().max().item() <= 1e-3


# ---------------------------------------------------------------------------------- runner, API, CLI
def _cpu_runner():
    from fastdeploy_ext.plan import PlanRequest
    from fastdeploy_ext.runner import get_backend_class
    return get_backend_class("cpu").create(PlanRequest(device="cpu", dtype="float32"))


def test_the_runner_detects_with_v2_and_refuses_masks(tiny, outputs):
    path, _ = tiny
    runner = _cpu_runner()
    report = runner.load_detector(str(path))
    assert runner.detector_family.name == "pp_doclayout_v2" and report.tensors_ignored > 0
    sizes = [(300, 200), (128, 128)]
    got = runner.detect(fx.sample_pixels(), sizes, threshold=0.5)
    want = outputs[0]
    expect = detections(want.logits, want.pred_boxes, want.order_logits, sizes, RELEASED_LABELS, threshold=0.5)
    assert [[(d.label, d.order) for d in p] for p in got] == [[(d.label, d.order) for d in p] for p in expect]
    assert "masks off" in runner.describe()


def test_masks_are_refused_before_any_weight_is_read(tiny, monkeypatch):
    """Asked by the call or by the plan's request, the runner refuses a family without a mask head
    before the plan changes or the family's loader runs."""
    from fastdeploy_ext.models.pp_doclayout_v2.family import PPDocLayoutV2Family
    from fastdeploy_ext.plan import PlanRequest
    from fastdeploy_ext.runner import get_backend_class

    def no_load(*a, **kw):
        raise AssertionError("weights read before the masks were refused")
    monkeypatch.setattr(PPDocLayoutV2Family, "load_detector", no_load)
    runner = _cpu_runner()
    plan = runner.plan
    with pytest.raises(ValueError, match=r"pp_doclayout_v2 has no mask head.*asked by masks=True"):
        runner.load_detector(str(tiny[0]), masks=True)
    assert runner.plan is plan and runner.detector is None
    asked = get_backend_class("cpu").create(PlanRequest(device="cpu", dtype="float32", detector_masks=True))
    with pytest.raises(ValueError, match=r"no mask head.*asked by the plan's request"):
        asked.load_detector(None, load_format="dummy", model_family="pp_doclayout_v2")
    # the guard itself: without it, the loader would run (and the module's setter refuse after it)
    monkeypatch.setattr(PPDocLayoutV2Family, "supports_masks", True)
    with pytest.raises(AssertionError, match="weights read before"):
        runner.load_detector(str(tiny[0]), masks=True)


def test_the_detector_api_and_the_cli_pick_v2_from_config_json(tiny, tmp_path, capsys):
    import numpy as np
    from PIL import Image
    from fastdeploy_ext import Detector
    from fastdeploy_ext.entrypoints.cli import main
    path, ref = tiny
    page = tmp_path / "page.png"
    Image.fromarray(np.random.default_rng(3).integers(0, 256, (150, 100, 3), dtype=np.uint8)).save(page)
    det = Detector(str(path), device="cpu", dtype="float32", threshold=0.5)
    assert det.family.name == "pp_doclayout_v2"
    got = det.detect([str(page)])[0]
    pixels, sizes = det.processor.preprocess([str(page)])
    with torch.no_grad():
        o = ref(pixel_values=pixels)
    want = transformers_postprocess().post_process_object_detection(o, threshold=0.5, target_sizes=sizes)[0]
    assert [d.label for d in got] == [RELEASED_LABELS[i] for i in want["labels"].tolist()] and got
    capsys.readouterr()
    assert main(["detect", "--model", str(path), "--image", str(page), "--device", "cpu", "--dtype", "float32",
                 "--json"]) == 0
    line = json.loads(capsys.readouterr().out.strip())
    assert [d["label"] for d in line["detections"]] == [d.label for d in got]
    assert (torch.tensor([d["bbox"] for d in line["detections"]]) - torch.tensor([d.bbox for d in got])).abs().max() <= 1e-3


# ---------------------------------------------------------------------------------- no host syncs
def test_the_v2_forward_has_no_host_sync(tiny):
    """The forward on ``meta`` tensors under the guard: the threshold selection, the kept-first
    sort and the reading-order network's token ids and masks are all device arithmetic."""
    from fastdeploy_ext.sync_guard import HostSyncGuard
    cfg = PPDocLayoutV2Config.from_model_dir(str(tiny[0]))
    with torch.device("meta"):
        model = v2model.PPDocLayoutV2(cfg).eval()
    with torch.inference_mode(), HostSyncGuard({"meta"}):
        out = model(torch.zeros(2, 3, fx.IMAGE, fx.IMAGE, device="meta"))
    assert out.logits.shape == (2, 20, 25) and out.order_logits.shape == (2, 20, 20)


def test_the_sync_guard_fires_on_a_sync_injected_into_the_reading_order_inputs(tiny, monkeypatch):
    from fastdeploy_ext.sync_guard import HostSyncError, HostSyncGuard
    real = v2model.reading_order_inputs

    def syncing(logits, *a):
        out = real(logits, *a)
        out[3].max().item()             # reading the kept count back to the host
        return out
    monkeypatch.setattr(v2model, "reading_order_inputs", syncing)
    cfg = PPDocLayoutV2Config.from_model_dir(str(tiny[0]))
    with torch.device("meta"):
        model = v2model.PPDocLayoutV2(cfg).eval()
    with pytest.raises(HostSyncError), torch.inference_mode(), HostSyncGuard({"meta"}):
        model(torch.zeros(1, 3, fx.IMAGE, fx.IMAGE, device="meta"))


def test_a_stable_rank_sort_in_the_postprocessing_departs_from_transformers(outputs, monkeypatch):
    """Why the post-processing sorts the ranks with the reference's own (unstable) sort: on this
    fixture some query is kept under two classes, and a stable sort orders those two otherwise."""
    from fastdeploy_ext.models.pp_doclayout_v3 import postprocess
    want, got = outputs
    sizes = [(300, 200), (128, 96)]
    expect = transformers_postprocess().post_process_object_detection(want, threshold=0.5, target_sizes=sizes)
    real = torch.sort
    monkeypatch.setattr(postprocess.torch, "sort", lambda t, **kw: real(t, **kw, stable=True))
    dets = detections(got.logits, got.pred_boxes, got.order_logits, sizes, RELEASED_LABELS, threshold=0.5)
    monkeypatch.undo()
    assert [[d.label_id for d in page] for page in dets] != [p["labels"].tolist() for p in expect]


# ---------------------------------------------------------------------------------- the conformance fixture
@pytest.fixture(scope="module")
def v2_case():
    from fastdeploy_ext.models.pp_doclayout_v2.conformance import PPDocLayoutV2Conformance
    fixture = PPDocLayoutV2Conformance("")
    return fixture, fixture.detect_case()


def test_the_fixtures_shipped_and_live_references_agree_on_the_cpu(v2_case):
    """On the CPU (the shipped outputs' sort) both references are there and agree; the seed's top-k
    margin and the thresholds' margin hold; the goldens keep detections on both pages. The live
    reference is computed here, with this machine's threads: a kept box within 1e-7 of the
    shipped one can still truncate to the neighbouring integer of the reading-order grid, which
    moves every order logit; the fixture's reconcile resolves that as the suite does (order_logits
    through our network on the shipped grid), anything else is compared as it is."""
    from fastdeploy_ext.conformance.detector_checks import OUTPUTS, check_outputs, check_topk_margin
    from fastdeploy_ext.models.pp_doclayout_v2 import tiny as v2tiny
    from fastdeploy_ext.models.pp_doclayout_v3.model import DetectorOutputs
    from fastdeploy_ext.plan import PlanRequest
    from fastdeploy_ext.runner import get_backend_class
    _, case = v2_case
    refs = case.expected(CPU)
    assert set(refs) == {"shipped", "live"}
    runner = get_backend_class("cpu").create(PlanRequest(device="cpu", dtype="float32",
                                                         model_family="pp_doclayout_v2"))
    runner.load_detector(str(case.model_dir))
    live, _ = case.reconciled(runner, DetectorOutputs(**{k: refs["live"][k] for k in OUTPUTS}), refs["shipped"])
    check_outputs(live, refs["shipped"], case.tolerance)
    check_topk_margin(refs["live"]["enc_outputs_class"], case.num_queries, case.topk_margin)
    kept = v2tiny.kept_counts(refs["live"]["logits"], v2tiny.THRESHOLDS)
    assert all(0 < n < case.num_queries for n in kept)          # the network sees boxes and padding
    # the goldens of the (reconciled) live outputs are the shipped goldens: the same detections in
    # the same reading order, scores and pixel boxes within the outputs' tolerance
    from fastdeploy_ext.models.pp_doclayout_v2.conformance import goldens_of
    got = goldens_of({k: getattr(live, k) for k in OUTPUTS}, list(v2tiny.PAGE_SIZES), v2tiny.DETECT_THRESHOLD)
    assert all(len(p) > 0 for p in case.golden) and [len(p) for p in got] == [len(p) for p in case.golden]
    for page_got, page_want in zip(got, case.golden):
        for a, b in zip(page_got, page_want):
            assert (a["label"], a["label_id"], a["order"]) == (b["label"], b["label_id"], b["order"]), (a, b)
            assert abs(a["score"] - b["score"]) <= case.tolerance, (a, b)
            assert max(abs(x - y) for x, y in zip(a["bbox"], b["bbox"])) <= 0.1, (a, b)     # pixels


class SimpleOutputs:
    def __init__(self, d):
        self.__dict__.update(d)


def test_another_sort_breaks_the_shipped_reference_and_the_live_one_follows_it(v2_case, monkeypatch):
    """What a device whose sort orders ties otherwise (CUDA's stable radix sort) does to V2: our
    outputs leave the CPU-made shipped reference, and the live reference, computed with the same
    sort, still matches them: why the fixture computes it on the device under test."""
    from fastdeploy_ext.conformance.detector_checks import check_outputs
    from fastdeploy_ext.models.pp_doclayout_v2.conformance import PPDocLayoutV2Conformance
    from fastdeploy_ext.plan import PlanRequest
    from fastdeploy_ext.runner import get_backend_class
    _, case = v2_case
    real = torch.argsort
    monkeypatch.setattr(torch, "argsort", lambda t, **kw: real(t, **(kw | {"stable": True})))
    runner = get_backend_class("cpu").create(PlanRequest(device="cpu", dtype="float32"))
    runner.load_detector(str(case.model_dir))
    got = runner.detect_device(case.pixels)
    fresh = PPDocLayoutV2Conformance("")               # no live reference cached from the real sort
    refs = fresh.expected(CPU)
    with pytest.raises(AssertionError, match="order_logits: max abs error"):
        check_outputs(got, refs["shipped"], case.tolerance, "shipped")
    check_outputs(got, refs["live"], case.tolerance, "live")


def test_without_transformers_only_host_devices_have_a_reference(v2_case, monkeypatch):
    from fastdeploy_ext.models.pp_doclayout_v2 import conformance as v2conf

    def absent(*a, **kw):
        raise ImportError("transformers blocked")
    monkeypatch.setattr(v2conf, "live_outputs", absent)
    fresh = v2conf.PPDocLayoutV2Conformance("")
    assert set(fresh.expected(CPU)) == {"shipped"}
    assert fresh.golden_for(CPU) == v2_case[1].golden
    for call in (fresh.expected, fresh.golden_for):
        with pytest.raises(AssertionError, match="no PP-DocLayoutV2 (reference|goldens) (is|are) valid on cuda"):
            call(torch.device("cuda"))


def test_the_threshold_margin_check_fires():
    from fastdeploy_ext.models.pp_doclayout_v2.conformance import check_threshold_margin
    logits = torch.tensor([[[2.0, -1.0], [-3.0, 0.5]]])
    assert check_threshold_margin(logits, [0.5, 0.5], 1e-3) == pytest.approx(torch.sigmoid(torch.tensor(0.5)) - 0.5)
    with pytest.raises(AssertionError, match="from its class threshold"):
        check_threshold_margin(logits, [float(torch.sigmoid(torch.tensor(2.0))) + 1e-5, 0.5], 1e-3)


# ---------------------------------------------------------------------------------- bucket graphs
def test_v2s_forward_replays_per_bucket_with_each_real_page_its_eager_outputs(ours):
    """detector_graphs.py on V2's forward (threshold selection, kept-first sort, reading-order
    network: all per page), through a device API whose graph re-runs the captured call into its
    static outputs: 7 pages as a bucket of 4 and 3 padded with a zero page to 4, each real page
    with its eager outputs (bitwise against the same padded buffer), no masks."""
    from fastdeploy_ext.detector_graphs import DetectorGraphs

    from .graph_fakes import HostGraphAPI
    model = ours[0]
    runner = type("R", (), {})()
    runner.device_api, runner.detector, runner.device, runner.dtype = (HostGraphAPI(CPU), model, CPU, torch.float32)
    graphs = DetectorGraphs(runner, (1, 2, 4), (fx.IMAGE, fx.IMAGE))
    assert graphs.capture().captured == 3
    pixels = torch.rand(7, 3, fx.IMAGE, fx.IMAGE, generator=torch.Generator().manual_seed(2))
    with torch.inference_mode():
        got = graphs.run(pixels)
        want = model(pixels)
        padded = graphs.graphs[4].eager()
    assert graphs.stats.per_bucket == {4: 2} and graphs.stats.padded_pages == 1
    for name in OUTPUTS:
        assert getattr(got, name).shape[0] == 7, name
        assert max_err(getattr(want, name), getattr(got, name)) <= 1e-5, name
        assert torch.equal(getattr(got, name)[4:], getattr(padded, name)[:3]), name
    assert got.out_masks is None


def test_the_suite_runs_v2_alone_by_its_option():
    """``--fdx-detector-family pp_doclayout_v2`` registers V2's case as the detector tests' one parameter."""
    import os
    import subprocess
    import sys
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--pyargs",
                        "fastdeploy_ext.conformance.test_detector", "--fdx-backend", "cpu", "-k", "plan_decides",
                        "--fdx-detector-family", "pp_doclayout_v2", "-rA"], capture_output=True, text=True,
                       timeout=600, env=dict(os.environ))
    assert r.returncode == 0, r.stdout[-3000:]
    assert "PASSED fastdeploy_ext/conformance/test_detector.py::test_the_plan_decides_every_detector_component" \
           "[pp_doclayout_v2]" in r.stdout, r.stdout[-3000:]
    assert "[pp_doclayout_v3]" not in r.stdout and "detector=pp_doclayout_v2 " in r.stdout


def _step_one_kept_box(runner, got, grid_units: float):
    """Our outputs with one kept box moved right by just enough to cross its x0's integer step
    (plus ``grid_units`` beyond it), and the order_logits our network gives for the moved box:
    what a within-tolerance box difference at an integer step does on another device."""
    import dataclasses

    from fastdeploy_ext.models.pp_doclayout_v2.model import sorted_reading_order_inputs
    model = runner.detector
    grid, _, num_kept = sorted_reading_order_inputs(got.logits, got.pred_boxes, model.thresholds, model.class_order)
    frac = grid[0, : int(num_kept[0]), 0].frac()
    q = int(torch.argmax(frac))                            # the x0 closest to its next integer
    boxes = got.pred_boxes.clone()
    boxes[0, q, 0] += float((1 - frac[q]) + grid_units) / 1000
    with torch.no_grad():
        order = model.order_logits_of(got.logits, boxes)
    return dataclasses.replace(got, pred_boxes=boxes, order_logits=order), (1 - frac[q]).item() + grid_units


def test_a_grid_step_within_tolerance_is_compared_teacher_forced_and_a_wrong_network_still_fails(v2_case):
    """Two devices' boxes within the tolerance can truncate to neighbouring grid integers, and the
    order logits jump: ``reconcile`` then compares our network on the reference's grid (saying so).
    It cannot hide a wrong network (its weights perturbed) nor a box outside the tolerance."""
    from fastdeploy_ext.conformance.detector_checks import check_outputs
    _, case = v2_case
    runner = _cpu_runner()
    runner.load_detector(str(case.model_dir))
    want = case.expected(CPU)["live"]
    got = runner.detect_device(case.pixels)
    assert case.reconcile(runner, got, want) == (got, None)          # no step: compared as it is
    stepped, moved = _step_one_kept_box(runner, got, 1e-3)
    assert moved / 1000 <= case.tolerance
    with pytest.raises(AssertionError, match="order_logits: max abs error"):
        check_outputs(stepped, want, case.tolerance, "live")
    compared, note = case.reconcile(runner, stepped, want)
    assert note.startswith("1 kept-box grid coordinate(s) truncate to another integer") and compared.pred_boxes is \
        stepped.pred_boxes
    check_outputs(compared, want, case.tolerance, "live")
    far, _ = _step_one_kept_box(runner, got, 0.5)                   # 0.5 grid units: beyond the box tolerance
    assert case.reconcile(runner, far, want) == (far, None)
    with torch.no_grad():
        runner.detector.reading_order.relative_head.dense.weight.mul_(1.01)   # a wrong network
    try:
        compared, note = case.reconcile(runner, stepped, want)
        assert note is not None
        with pytest.raises(AssertionError, match="order_logits: max abs error"):
            check_outputs(compared, want, case.tolerance, "live")
    finally:
        with torch.no_grad():
            runner.detector.reading_order.relative_head.dense.weight.div_(1.01)


def test_the_goldens_of_a_stepped_grid_are_the_reconciled_outputs_post_processing(v2_case, monkeypatch):
    from fastdeploy_ext.conformance.detector_checks import check_detections
    _, case = v2_case
    runner = _cpu_runner()
    runner.load_detector(str(case.model_dir))
    assert case.detections_for_goldens(runner)[1] is None
    real = runner.detect_device
    monkeypatch.setattr(runner, "detect_device", lambda pixels: _step_one_kept_box(runner, real(pixels), 1e-3)[0])
    dets, note = case.detections_for_goldens(runner)
    assert "the goldens compared with those outputs' post-processing" in note
    check_detections(dets, case.goldens(CPU))
