"""DeepSeek-OCR-2's dual-path encoder graphs (models/deepseek_ocr2/encoder_graphs.py): the plan's
decision per row and the `encoder_graph_paths` keys; capture and replay through a device API
whose graph re-runs the captured call into its static output (what a CUDA graph does, on the
CPU): each path padded to its own smallest budget, replay == eager on the same padded buffer
bitwise, each path falling back to eager alone above its largest budget, pages with 0 and 6 crops
in one batch; the replay path under the sync guard (on ``meta``, as the runner's no-sync proof
runs on a host device) with injected syncs that it catches; and on CUDA (skipped elsewhere; it
runs in ci/gpu_leg.sh deepseek_graphs on the H200) replay == eager bitwise through the runner.

The tower here is a tiny random one with a small view geometry (256 global, 192 crops), so that
a budget of 8 crops stays cheap on a 2-core box; graphs see only view counts and view sizes."""
from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
import torch

from fastdeploy_ext.capabilities import capability_table
from fastdeploy_ext.device_api import DeviceAPI
from fastdeploy_ext.models.deepseek_ocr2.config import DeepseekOCR2Config, EncoderConfig, SamConfig, TextConfig
from fastdeploy_ext.models.deepseek_ocr2.encoder_graphs import DeepseekEncoderGraphs
from fastdeploy_ext.models.deepseek_ocr2.family import DeepseekOCR2Family
from fastdeploy_ext.models.deepseek_ocr2.loader import load
from fastdeploy_ext.models.deepseek_ocr2.vision import VisionMetadataBuilder
from fastdeploy_ext.models.registry import get_family
from fastdeploy_ext.plan import (DEFAULT_VIEW_GRAPH_PATHS, Decision, GraphOptimizationConfig, PlanError, PlanRequest,
                                 ViewGraphPath, resolve_for_components)
from fastdeploy_ext.runner import ImageBatch
from fastdeploy_ext.sync_guard import HostSyncError, HostSyncGuard

from .graph_fakes import HostGraphAPI

CPU = torch.device("cpu")
TINY = DeepseekOCR2Config(
    sam=SamConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, mlp_dim=64, global_attn_indexes=(1,),
                  output_channels=16, downsample_channels=(32, 64)),
    encoder=EncoderConfig(hidden_size=64, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                          intermediate_size=128),
    text=TextConfig(hidden_size=48, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=4,
                    intermediate_size=64, moe_intermediate_size=16, n_routed_experts=4, num_experts_per_tok=2,
                    n_shared_experts=1, vocab_size=64),
    image_token_id=3, base_size=256, tile_size=192).validate()
PATHS = (ViewGraphPath("global", (1, 3)), ViewGraphPath("local", (2, 4, 8)))
# (views, rows, cols) per image: 0, 6 (3x2) and 2 (1x2) crops
NO_CROP, SIX, TWO = (1, 1, 1), (7, 3, 2), (3, 1, 2)


@dataclasses.dataclass
class _Runner:
    """What DeepseekEncoderGraphs reads from a runner."""
    model: torch.nn.Module
    device: torch.device
    cfg: DeepseekOCR2Config = TINY
    dtype: torch.dtype = torch.float32
    strided: bool = True
    overlap: bool = False
    api: type = HostGraphAPI

    def __post_init__(self):
        self.device_api = self.api(self.device)
        self.plan = SimpleNamespace(graph_overlap=Decision(self.overlap, "test"))
        self.meta_builder = VisionMetadataBuilder(self.cfg, device=self.device)
        self.execution = get_family("deepseek_ocr2").vision_execution(None, self.strided, False)


@pytest.fixture(scope="module")
def tower():
    torch.manual_seed(0)
    model, _ = load("vision", None, TINY, dtype=torch.float32, device=CPU, seed=3)
    return model


def _graphs(model, device=CPU, paths=PATHS, **runner):
    g = DeepseekEncoderGraphs(_Runner(model, device, **runner), paths)
    report = g.capture()
    assert report.captured == 5 and report.paths == {"global": [1, 3], "local": [2, 4, 8]}
    return g


def _pixels(grids, seed=1, device=CPU):
    n = sum(TINY.image_patches(v - 1) for v, _, _ in grids)
    return torch.randn(n, TINY.patch_dim, generator=torch.Generator().manual_seed(seed)).to(device)


def _eager(model, pixels, grids):
    meta = VisionMetadataBuilder(TINY, device=pixels.device).build_host(grids)
    with torch.inference_mode():
        return model(pixels, meta, get_family("deepseek_ocr2").vision_execution(None, True, False))


# ------------------------------------------------------------------ the plan and the keys
def _plan(row, **req):
    fam = get_family("deepseek_ocr2")
    return resolve_for_components(capability_table()[row], PlanRequest(**req), fam.components(fam.default_config()),
                                  device="cuda:0", kernels={}, text_available={"sdpa_paged": (True, "ok")})


def test_the_plan_turns_the_dual_path_graphs_on_for_cuda_rows_only():
    for row in ("cuda_sm90", "cuda_sm80"):
        p = _plan(row)
        assert p.graphs.value == DEFAULT_VIEW_GRAPH_PATHS, row
        assert p.graphs.reason.startswith(f"on by default on row {row}") and "sdpa_bias" in p.graphs.reason
        assert "global[1, 2, 4, 8, 16], local[2, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96]" in p.describe()
        assert p.to_dict()["graphs"]["value"][1] == {"name": "local", "budgets": (2, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96)}
    assert _plan("metax_c500").graphs == Decision((), "off by default on row metax_c500 (opt in: "
                                                      "use_encoder_cudagraph=true)")
    for row in ("cpu", "cpu_amx", "cuda"):
        p = _plan(row)
        assert p.graphs.value == () and p.graphs.reason.startswith(f"row {row} captures no encoder graphs"), row
        with pytest.raises(PlanError, match=f"row {row} supports no encoder graph capture"):
            _plan(row, graph_config=GraphOptimizationConfig(use_encoder_cudagraph=True))
    forced = _plan("metax_c500", graph_config=GraphOptimizationConfig(use_encoder_cudagraph=True))
    assert forced.graphs.value == DEFAULT_VIEW_GRAPH_PATHS and forced.graphs.reason.startswith("requested")
    off = _plan("cuda_sm90", graph_config=GraphOptimizationConfig(use_encoder_cudagraph=False))
    assert off.graphs == Decision((), "use_encoder_cudagraph=false")
    assert _plan("cuda_sm90", grid_thw="device").graphs == Decision((), "graphs need host metadata")


def test_encoder_graph_paths_name_the_paths_and_their_budgets():
    gc = GraphOptimizationConfig.from_json('{"encoder_graph_paths": [{"name": "local", "budgets": [8, 2, 4, 2]}]}')
    assert gc.encoder_graph_paths == (ViewGraphPath("local", (2, 4, 8)),)
    assert _plan("cuda_sm90", graph_config=gc).graphs.value == (ViewGraphPath("local", (2, 4, 8)),)
    bad = {'{"encoder_graph_paths": [{"name": "local", "budgets": []}]}': "non-empty list of distinct positive",
           '{"encoder_graph_paths": [{"name": "local", "budgets": [0, 2]}]}': "non-empty list of distinct positive",
           '{"encoder_graph_paths": [{"name": "local", "budgets": ["2"]}]}': "non-empty list of distinct positive",
           '{"encoder_graph_paths": [{"name": "local", "budgets": [2]}, {"name": "local", "budgets": [4]}]}':
               "path names repeat",
           '{"encoder_graph_paths": [{"name": "local", "budgets": [2], "views": 3}]}': "unexpected keyword",
           '{"encoder_graph_paths": [{"name": "local", "budgets": [2]}, {"name": "b", "min_tokens": 1, '
           '"max_tokens": 2, "max_image_tokens": 2, "max_segments": 1}]}': "all paths take one form",
           '{"encoder_graph_paths": []}': "non-empty list of paths"}
    for text, match in bad.items():
        with pytest.raises(ValueError, match=match):
            GraphOptimizationConfig.from_json(text)
    with pytest.raises(PlanError, match=r"unknown path \['crops'\]; this model's paths are \['global', 'local'\]"):
        _plan("cuda_sm90", graph_config=GraphOptimizationConfig.from_json(
            '{"encoder_graph_paths": [{"name": "crops", "budgets": [2]}]}'))
    patches = GraphOptimizationConfig.from_json('{"encoder_graph_paths": [{"name": "b", "min_tokens": 64, '
                                                '"max_tokens": 256, "max_image_tokens": 128, "max_segments": 2}]}')
    with pytest.raises(PlanError, match="budgets of views per path"):
        _plan("cuda_sm90", graph_config=patches)
    # the other way round: PaddleOCR-VL's graphs take patches, not views
    vlm = get_family("paddleocr_vl")
    from fastdeploy_ext.ops.attention.varlen import ATTENTION_BACKENDS
    kernels = {n: b.facts((True, "ok")) for n, b in ATTENTION_BACKENDS.items()}
    with pytest.raises(PlanError, match="take budgets of patches"):
        resolve_for_components(capability_table()["cuda_sm90"], PlanRequest(graph_config=gc),
                               vlm.components(vlm.default_config()), device="cuda:0", kernels=kernels,
                               text_available={"sdpa_paged": (True, "ok")})


def test_the_paths_overlap_only_when_asked():
    p = _plan("cuda_sm90")
    assert p.graph_overlap.value is False and p.graph_overlap.reason.startswith("off by default: the paths replay one")
    assert "graph_overlap" in p.describe() and "one graph pool" in p.describe()
    on = _plan("cuda_sm90", graph_config=GraphOptimizationConfig.from_json('{"encoder_overlap_paths": true}'))
    assert on.graph_overlap == Decision(True, "encoder_overlap_paths=true: the paths replay on two streams side by "
                                              "side, a graph pool each")
    assert "a graph pool each" in on.describe()
    off = _plan("cuda_sm90", graph_config=GraphOptimizationConfig.from_json('{"encoder_overlap_paths": false}'))
    assert off.graph_overlap.value is False and off.graph_overlap.reason.startswith("encoder_overlap_paths=false")
    one = _plan("cuda_sm90", graph_config=GraphOptimizationConfig.from_json(
        '{"encoder_graph_paths": [{"name": "local", "budgets": [2, 4]}]}'))
    assert one.graph_overlap == Decision(False, "fewer than two encoder graph paths captured")
    assert _plan("cpu").graph_overlap == Decision(False, "no encoder graphs")
    with pytest.raises(ValueError, match="unknown keys"):
        GraphOptimizationConfig.from_json('{"encoder_overlap": true}')


# ------------------------------------------------------------------ capture and replay (CPU fake)
def test_budget_choice_per_path_and_eager_above_the_largest(tower, monkeypatch):
    g = _graphs(tower)
    static = {bg.pixels.data_ptr() for bg in g.graphs.values()}
    eager_calls = []
    real = type(tower).encode_views

    def recording(self, patches, views, is_global, strided=True):
        if patches.data_ptr() not in static:        # not a graph's (the fake replay re-runs it)
            eager_calls.append((views, is_global))
        return real(self, patches, views, is_global, strided)
    monkeypatch.setattr(type(tower), "encode_views", recording)
    with torch.inference_mode():
        # 2 pages: 2 global views -> budget 3; 0 + 6 crops -> budget 8
        g.run(_pixels([NO_CROP, SIX]), [NO_CROP, SIX])
        # 4 pages: 4 global views > 3 -> eager; 2 + 2 crops -> budget 4
        g.run(_pixels([TWO, NO_CROP, TWO, NO_CROP]), [TWO, NO_CROP, TWO, NO_CROP])
        # 1 page, 6 crops: global -> 1; 2 pages: global -> 3, 12 crops > 8 -> eager alone
        g.run(_pixels([SIX]), [SIX])
        g.run(_pixels([SIX, SIX]), [SIX, SIX])
        # no crops at all: no local pass
        g.run(_pixels([NO_CROP]), [NO_CROP])
    gs, ls = g.stats["global"], g.stats["local"]
    assert gs.per_budget == {3: 2, 1: 2} and gs.eager_views == 4 and gs.padded_views == 2 and gs.real_views == 6
    assert ls.per_budget == {8: 2, 4: 1} and ls.eager_views == 12 and ls.padded_views == 2 + 2 + 0
    assert ls.real_views == 6 + 4 + 6
    # eager passes ran only where a path had no budget for its views: 4 global views, 12 crops
    assert eager_calls == [(4, True), (12, False)]


def test_padded_replay_equals_eager_on_the_padded_buffer_and_the_unpadded_batch(tower):
    g = _graphs(tower)
    grids = [NO_CROP, SIX]                    # 2 global views padded to 3, 6 crops to 8
    pixels = _pixels(grids)
    with torch.inference_mode():
        got = g.run(pixels, grids)
        want = _eager(tower, pixels, grids)
        local, glob = g.graphs[("local", 8)], g.graphs[("global", 3)]
        assert torch.equal(local.pixels[6 * TINY.patches(192):], torch.zeros_like(local.pixels[6 * TINY.patches(192):]))
        # bitwise: the replay is the captured pass on the padded buffer
        assert torch.equal(local.out[:6], local.eager(6)) and torch.equal(glob.out[:2], glob.eager(2))
    rows = [TINY.image_rows(0), TINY.image_rows(6)]
    assert got.shape == (sum(rows), TINY.text.hidden_size) == want.shape
    # the unpadded eager pass differs only by GEMM shapes (fp32)
    assert (got - want).abs().max().item() <= 1e-5
    # and the layout is the eager forward's: page 0's global rows, separator; page 1's crops first
    sep = tower.view_separator
    assert torch.equal(got[rows[0] - 1], sep) and torch.equal(got[-1], sep)
    assert torch.equal(got[:TINY.global_queries], glob.out[0])
    assert torch.equal(got[rows[0]:rows[0] + TINY.crop_queries], local.out[0])


def test_a_replayed_output_is_read_before_the_next_replay(tower):
    """The static output is overwritten by the next replay of the same graph: run() returns rows
    of its own, so a second batch leaves the first one's rows intact."""
    g = _graphs(tower)
    with torch.inference_mode():
        a = g.run(_pixels([SIX], seed=4), [SIX])
        keep = a.clone()
        g.run(_pixels([SIX], seed=5), [SIX])
    assert torch.equal(a, keep)


def test_the_runner_encodes_through_the_graphs_once_captured(tower, monkeypatch):
    """encode_images routes through the family's encoder graphs (capture_graphs -> the family's
    encoder_graphs hook) when the plan has paths; the rows equal the eager runner's."""
    from fastdeploy_ext.runner import get_backend_class
    monkeypatch.setattr(DeepseekOCR2Family, "default_config", lambda self: TINY)
    runner = get_backend_class("cpu").create(PlanRequest(device="cpu", dtype="float32"))
    runner.load_model(None, load_format="dummy", model_family="deepseek_ocr2")
    assert runner.capture_graphs().captured == 0 and runner.graphs is None     # the cpu row: off
    grids = [SIX, NO_CROP, TWO]
    batch = ImageBatch(_pixels(grids, seed=7), grids)
    eager = runner.encode_images(batch)
    runner.device_api = HostGraphAPI(CPU)
    runner.plan = dataclasses.replace(runner.plan, graphs=Decision(PATHS, "test"))
    report = runner.capture_graphs()
    assert isinstance(runner.graphs, DeepseekEncoderGraphs) and report.captured == 5
    got = runner.encode_images(batch)
    assert [t.shape for t in got] == [t.shape for t in eager]
    assert max((a - b).abs().max().item() for a, b in zip(got, eager)) <= 1e-5
    assert runner.graphs.stats["global"].per_budget == {3: 1} and runner.graphs.stats["global"].eager_views == 0
    assert runner.graphs.stats["local"].per_budget == {8: 1}


class SideBySideAPI(HostGraphAPI):
    """A graph API that hands out a new pool per capture group and records what side_by_side
    ran on its "side stream" (the host runs it first, as the CUDA API queues it first)."""

    def __init__(self, device):
        super().__init__(device)
        self.side_calls, self.pools_made = [], 0

    def graph_pool(self):
        self.pools_made += 1
        return ("pool", self.pools_made)

    def side_by_side(self, first, second):
        self.side_calls.append((first.args, second.args))
        return super().side_by_side(first, second)


def test_overlapping_paths_own_a_pool_each_and_give_the_same_rows(tower):
    seq, over = _graphs(tower, api=SideBySideAPI), _graphs(tower, api=SideBySideAPI, overlap=True)
    assert seq.api.pools_made == 1 and over.api.pools_made == 2
    assert {g.pool for (n, _), g in over.graphs.items() if n == "global"} == {("pool", 1)}
    assert {g.pool for (n, _), g in over.graphs.items() if n == "local"} == {("pool", 2)}
    assert "side by side" in over.describe() and "side by side" not in seq.describe()
    with torch.inference_mode():
        for grids in ([NO_CROP, SIX], [SIX, TWO, NO_CROP], [NO_CROP]):
            px = _pixels(grids, seed=11)
            assert torch.equal(over.run(px, grids), seq.run(px, grids))
    # the global path went to the side stream, the crops stayed on the current one; a batch
    # without crops has nothing to overlap
    assert [(a[0], b[0]) for a, b in over.api.side_calls] == [("global", "local")] * 2
    assert seq.api.side_calls == []


def test_overlapping_paths_sharing_a_pool_are_refused(tower, monkeypatch):
    """The mutation: capture both paths into one pool while they replay side by side."""
    from fastdeploy_ext.models.deepseek_ocr2 import encoder_graphs as eg
    real = eg.capture_graphs
    shared = {}

    def one_pool(api, make):
        pool = shared.setdefault("pool", api.graph_pool())
        monkeypatch.setattr(api, "graph_pool", lambda: pool)
        return real(api, make)
    monkeypatch.setattr(eg, "capture_graphs", one_pool)
    with pytest.raises(RuntimeError, match="'global' and 'local' share a graph pool but replay side by side"):
        _graphs(tower, api=SideBySideAPI, overlap=True)


# ------------------------------------------------------------------ no host sync on the replay path
@pytest.fixture(scope="module")
def meta_graphs(tower):
    """The graphs of the same tower on ``meta``: a read-back or a transfer to the host is an op on
    a meta tensor that the guard sees (on the CPU, two host tensors hide it)."""
    model = get_family("deepseek_ocr2").build_vision_model(TINY).eval()
    return _graphs(model, torch.device("meta"))


def test_the_replay_path_makes_no_host_sync(meta_graphs):
    grids = [NO_CROP, SIX, TWO, NO_CROP]              # 4 globals: eager; 8 crops: budget 8
    pixels = torch.empty(sum(TINY.image_patches(v - 1) for v, _, _ in grids), TINY.patch_dim, device="meta")
    with torch.inference_mode(), HostSyncGuard(watch={"meta"}):
        out = meta_graphs.run(pixels, grids)
        out = meta_graphs.run(pixels[:TINY.image_patches(6) + TINY.image_patches(0)], [SIX, NO_CROP])
    assert out.shape == (TINY.image_rows(6) + TINY.image_rows(0), TINY.text.hidden_size)


def _item(self, parts):
    int(parts[0][0, 0].item())


def _host_copy(self, parts):
    parts[0].cpu()


def _mask(self, parts):
    parts[0][parts[0] > 0]


@pytest.mark.parametrize("inject", [_item, _host_copy, _mask], ids=["item", "to_cpu", "boolean_mask"])
def test_the_guard_fires_on_a_sync_injected_into_the_replay_path(meta_graphs, monkeypatch, inject):
    from fastdeploy_ext.models.deepseek_ocr2 import encoder_graphs as eg
    real = eg._ViewBudgetGraph.load

    def load(self, parts):
        inject(self, parts)
        real(self, parts)
    monkeypatch.setattr(eg._ViewBudgetGraph, "load", load)
    pixels = torch.empty(TINY.image_patches(6), TINY.patch_dim, device="meta")
    with torch.inference_mode(), HostSyncGuard(watch={"meta"}), pytest.raises(HostSyncError, match="host sync"):
        meta_graphs.run(pixels, [SIX])


def test_graphs_need_a_graph_api_and_known_paths(tower):
    runner = _Runner(tower, CPU)
    runner.device_api = DeviceAPI(CPU)
    with pytest.raises(RuntimeError, match="need a device with a graph API"):
        DeepseekEncoderGraphs(runner, PATHS)
    with pytest.raises(ValueError, match=r"paths are \['global', 'local'\]; got \['crops'\]"):
        DeepseekEncoderGraphs(_Runner(tower, CPU), (ViewGraphPath("crops", (2,)),))


# ------------------------------------------------------------------ CUDA: replay == eager bitwise
@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA device (ci/gpu_leg.sh deepseek_graphs)")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_cuda_graph_replay_equals_eager_bitwise(dtype, monkeypatch):
    from fastdeploy_ext.runner import get_backend_class
    from fastdeploy_ext.sync_guard import cuda_host_sync_guard
    monkeypatch.setattr(DeepseekOCR2Family, "default_config", lambda self: TINY)
    gc = GraphOptimizationConfig(use_encoder_cudagraph=True, encoder_graph_paths=PATHS)
    runner = get_backend_class("cuda").create(PlanRequest(device="cuda", dtype=dtype, graph_config=gc,
                                                               model_family="deepseek_ocr2"))
    runner.load_model(None, load_format="dummy", model_family="deepseek_ocr2")
    report = runner.capture_graphs()
    assert report.captured == 5 and report.capture_seconds > 0 and report.graph_memory_bytes > 0
    grids = [NO_CROP, SIX]
    batch = ImageBatch(_pixels(grids, seed=9), grids)
    runner.encode_images(batch)
    pixels = runner.upload_pixels(batch.pixel_values)
    with cuda_host_sync_guard():
        replayed = runner.encode_uploaded(pixels, grids)
    g = runner.graphs
    assert g.stats["global"].per_budget == {3: 2} and g.stats["local"].per_budget == {8: 2}
    with torch.inference_mode():
        for name, budget, n in (("global", 3, 2), ("local", 8, 6)):
            bg = g.graphs[(name, budget)]
            assert torch.equal(bg.out[:n], bg.eager(n)), name
    runner.graphs, graphs = None, runner.graphs          # the runner's eager path (same precision)
    eager = runner.encode_uploaded(pixels, grids)
    runner.graphs = graphs
    # the paths replayed side by side (their own pools, a side stream) give the same bytes, and
    # make no host sync either
    assert not g.overlap and len({bg.pool for bg in g.graphs.values()}) == 1
    side = get_backend_class("cuda").create(PlanRequest(
        device="cuda", dtype=dtype, model_family="deepseek_ocr2",
        graph_config=dataclasses.replace(gc, encoder_overlap_paths=True)))
    side.load_model(None, load_format="dummy", model_family="deepseek_ocr2")
    side.model.load_state_dict(runner.model.state_dict())
    side.capture_graphs()
    assert side.graphs.overlap and len({bg.pool for bg in side.graphs.graphs.values()}) == 2
    side.encode_uploaded(pixels, grids)
    with cuda_host_sync_guard():
        overlapped = side.encode_uploaded(pixels, grids)
    side.graphs.overlap = False                     # the same graphs, one path after the other
    for a, b, c in zip(overlapped, side.encode_uploaded(pixels, grids), replayed):
        assert torch.equal(a, b)
        assert torch.nn.functional.cosine_similarity(a.float().flatten(), c.float().flatten(), dim=0) >= 0.9999
    for a, b in zip(replayed, eager):
        a, b = a.float(), b.float()
        cos = torch.nn.functional.cosine_similarity(a.flatten(), b.flatten(), dim=0).item()
        print(f"{dtype}: replay vs unpadded eager max abs {(a - b).abs().max().item():.3g} cosine {cos:.6f}")
        assert cos >= 0.9999 if dtype == "bfloat16" else (a - b).abs().max().item() <= 1e-4
