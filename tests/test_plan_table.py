"""Capability rows x probes -> plans, for devices this machine does not have (fake probes)."""
from __future__ import annotations

import pytest

from fastdeploy_ext.graphs import pack_groups, route_batch
from fastdeploy_ext.capabilities import capability_table
from fastdeploy_ext.plan import (EncoderGraphPath, GraphOptimizationConfig, PlanError, PlanRequest,
                                 resolve_plan)

from .plan_facts import ALL_PRESENT, absent


def test_table_has_the_four_device_families():
    t = capability_table()
    assert {"cuda_sm90", "cuda_sm80", "metax_c500", "cpu_amx", "cpu"} <= set(t)
    for row in t.values():
        assert row.default_dtype in row.dtypes and row.attention


def test_h200_plan():
    p = resolve_plan(capability_table()["cuda_sm90"], PlanRequest(), device="cuda:0", head_dim=72, kernels=ALL_PRESENT)
    assert p.dtype.value == "bfloat16" and p.attention.value == "triton_rope_varlen"
    assert p.strided_qkv and p.host_metadata and p.graphs.value and p.fused_layers.value
    assert p.attention_fallbacks == ("triton_varlen", "sdpa_cudnn", "sdpa")


def test_h200_without_triton_falls_back_and_turns_graphs_off():
    avail = absent("triton not importable", "triton_varlen", "triton_rope_varlen")
    p = resolve_plan(capability_table()["cuda_sm90"], PlanRequest(), device="cuda:0", head_dim=72, kernels=avail)
    assert p.attention.value == "sdpa_cudnn"
    assert any("triton_varlen skipped" in n and "triton not importable" in n for n in p.notes)
    assert p.graphs.value == () and "cannot be replayed" in p.graphs.reason
    with pytest.raises(PlanError, match="cuda_sm90"):
        resolve_plan(capability_table()["cuda_sm90"], PlanRequest(graph_config=GraphOptimizationConfig(use_encoder_cudagraph=True)),
                     device="cuda:0", head_dim=72, kernels=avail)


def test_fp32_on_h200_skips_bf16_only_kernels():
    p = resolve_plan(capability_table()["cuda_sm90"], PlanRequest(dtype="float32"), device="cuda:0", head_dim=72,
                     kernels=ALL_PRESENT)
    assert p.attention.value == "sdpa"


def test_metax_row_is_dense_host_graphs_opt_in():
    row = capability_table()["metax_c500"]
    p = resolve_plan(row, PlanRequest(), device="cuda:0", head_dim=72, kernels=ALL_PRESENT, emulated=True)
    assert p.qkv_layout.value == "dense" and "not verified on row metax_c500" in p.qkv_layout.reason
    assert p.host_metadata and p.graphs.value == () and p.emulated and "EMULATED" in p.describe()
    with pytest.raises(PlanError, match="metax_c500"):
        resolve_plan(row, PlanRequest(qkv_layout="strided"), device="cuda:0", head_dim=72, kernels=ALL_PRESENT)


def test_head_dim_outside_every_kernel_is_an_error():
    with pytest.raises(PlanError, match="cuda_sm90"):
        resolve_plan(capability_table()["cuda_sm90"], PlanRequest(), device="cuda:0", head_dim=1024, kernels=ALL_PRESENT)


def test_bad_flag_values_are_plan_errors():
    with pytest.raises(PlanError, match="qkv-layout"):
        resolve_plan(capability_table()["cpu"], PlanRequest(qkv_layout="diagonal"), device="cpu", head_dim=72,
                     kernels=ALL_PRESENT)


def test_graph_config_json():
    gc = GraphOptimizationConfig.from_json('{"use_encoder_cudagraph": true, "encoder_graph_paths": '
                                           '[{"name": "b", "min_tokens": 256, "max_tokens": 3000, '
                                           '"max_image_tokens": 1000, "max_segments": 8}]}')
    assert gc.use_encoder_cudagraph and gc.encoder_graph_paths[0].budgets == (256, 512, 1024, 2048, 3000)
    assert gc.use_cudagraph is None     # the decoder's switch is separate (FastDeploy's meaning)
    gc = GraphOptimizationConfig.from_json('{"use_cudagraph": true, "cudagraph_capture_sizes": [8, 1, 2, 8]}')
    assert gc.use_cudagraph and gc.cudagraph_capture_sizes == (1, 2, 8) and gc.use_encoder_cudagraph is None
    for bad in ('[1]', '{"use_cudagraph": true, "x": 1}', '{"encoder_graph_paths": [{"name": "b"}]}',
                '{"cudagraph_capture_sizes": []}', '{"cudagraph_capture_sizes": [0]}',
                '{"cudagraph_capture_sizes": 8}', '{"cudagraph_capture_sizes": [true]}',
                '{"encoder_graph_paths": [{"name": "b", "min_tokens": 9, "max_tokens": 4, '
                '"max_image_tokens": 4, "max_segments": 1}]}', "{nope"):
        with pytest.raises(ValueError):
            GraphOptimizationConfig.from_json(bad)


def test_greedy_packing_routes_and_splits():
    paths = (EncoderGraphPath("blocks", 64, 256, 100, 3), EncoderGraphPath("pages", 512, 1024, 1024, 2))
    grids = [(1, 8, 8), (1, 8, 8), (1, 8, 8), (1, 8, 8), (1, 20, 20), (1, 40, 40), (1, 8, 10)]
    groups = pack_groups(grids, paths)
    assert [(p.name if p else None, i) for p, i in groups] == [
        ("blocks", [0, 1, 2]),      # max_segments 3 closes the group
        ("blocks", [3]),
        ("pages", [4]),             # 400 patches > blocks' max_image_tokens
        (None, [5]),                # 1600 > every path: eager
        ("blocks", [6]),
    ]


def test_oversize_batches_run_eager_unless_split():
    paths = (EncoderGraphPath("blocks", 64, 256, 100, 3),)
    fits = [(1, 8, 8), (1, 8, 8)]
    assert [(p.name, i) for p, i in route_batch(fits, paths, False)] == [("blocks", [0, 1])]
    big = [(1, 8, 8)] * 5
    assert route_batch(big, paths, False) == [(None, [0, 1, 2, 3, 4])]
    assert [(p.name, i) for p, i in route_batch(big, paths, True)] == [("blocks", [0, 1, 2]), ("blocks", [3, 4])]
    gc = GraphOptimizationConfig.from_json('{"encoder_split_oversize_batches": true}')
    assert gc.encoder_split_oversize_batches and gc.encoder_graph_paths[0].name == "blocks"


def test_metax_graph_opt_in_switches_to_the_graph_safe_kernel():
    row = capability_table()["metax_c500"]
    req = PlanRequest(graph_config=GraphOptimizationConfig(use_encoder_cudagraph=True))
    p = resolve_plan(row, req, device="cuda:0", head_dim=72, kernels=ALL_PRESENT, emulated=True)
    assert p.attention.value == "triton_varlen" and "graph-safe" in p.attention.reason
    assert p.graphs.value and p.qkv_layout.value == "dense"
    no_triton = absent("no CUDA device", "triton_varlen")
    with pytest.raises(PlanError, match="metax_c500"):
        resolve_plan(row, req, device="cpu", head_dim=72, kernels=no_triton)


# ------------------------------------------------------------------ text decoder decisions
TEXT_ALL = {"triton_paged": (True, "ok"), "sdpa_paged": (True, "ok")}


def _plan(row, text_available=TEXT_ALL, **req):
    return resolve_plan(capability_table()[row], PlanRequest(**req), device="cuda:0", head_dim=72, kernels=ALL_PRESENT,
                        text_available=text_available)


def test_h200_text_plan_triton_paged_with_decode_graphs():
    from fastdeploy_ext.plan import DEFAULT_CAPTURE_SIZES
    p = _plan("cuda_sm90")
    assert p.text_attention.value == "triton_paged" and p.kv_block_size.value == 64
    assert p.decode_graphs.value == DEFAULT_CAPTURE_SIZES and "on by default" in p.decode_graphs.reason
    gc = GraphOptimizationConfig(use_cudagraph=True, cudagraph_capture_sizes=(1, 4))
    assert _plan("cuda_sm90", graph_config=gc).decode_graphs.value == (1, 4)
    off = _plan("cuda_sm90", graph_config=GraphOptimizationConfig(use_cudagraph=False))
    assert off.decode_graphs.value == () and off.graphs.value      # encoder graphs stay on: separate keys
    enc_off = _plan("cuda_sm90", graph_config=GraphOptimizationConfig(use_encoder_cudagraph=False))
    assert enc_off.graphs.value == () and enc_off.decode_graphs.value
    assert "decode_graphs" in p.describe() and "text_attention" in p.describe()


def test_without_triton_the_text_falls_back_and_decode_graphs_turn_off():
    no_triton = dict(TEXT_ALL, triton_paged=(False, "triton not importable"))
    p = _plan("cuda_sm90", text_available=no_triton)
    assert p.text_attention.value == "sdpa_paged" and "triton_paged" in p.text_attention.reason
    assert any("text attention triton_paged skipped" in n for n in p.notes)
    assert p.decode_graphs.value == () and "cannot be captured" in p.decode_graphs.reason
    with pytest.raises(PlanError, match="cuda_sm90.*graph-safe"):
        _plan("cuda_sm90", text_available=no_triton, graph_config=GraphOptimizationConfig(use_cudagraph=True))
    with pytest.raises(PlanError, match="cuda_sm90.*triton_paged"):
        _plan("cuda_sm90", text_available=no_triton, text_attention_backend="triton_paged")


@pytest.mark.parametrize("row", ["cpu", "cpu_amx", "metax_c500"])
def test_other_rows_decode_eager_over_sdpa(row):
    p = _plan(row)
    assert p.text_attention.value == "sdpa_paged" and p.kv_block_size.value == 16 and p.decode_graphs.value == ()
    with pytest.raises(PlanError, match=f"row {row}.*decoder graph"):
        _plan(row, graph_config=GraphOptimizationConfig(use_cudagraph=True))
    with pytest.raises(PlanError, match=f"row {row} does not list text attention backend 'triton_paged'"):
        _plan(row, text_attention_backend="triton_paged")


def test_the_models_components_drive_which_kind_resolvers_run():
    """A model without a vision component gets no vision kernel (and nothing that follows from
    one); a kind declared twice is refused; the plan per component names each kernel."""
    from fastdeploy_ext.plan import Component, ComponentKind, resolve_for_components
    row = capability_table()["cuda_sm90"]
    paged = {"triton_paged": (True, "ok"), "sdpa_paged": (True, "ok")}
    text = Component("text.attention", ComponentKind.PAGED_DECODER_ATTENTION, 128, 16, 2)
    p = resolve_for_components(row, PlanRequest(), (text,), device="cuda:0", kernels=ALL_PRESENT, text_available=paged)
    assert p.attention.value is None and p.attention_fallbacks == ()
    assert p.qkv_layout.value == "dense" and "no vision varlen attention" in p.qkv_layout.reason
    assert p.graphs.value == () and "no vision varlen attention" in p.graphs.reason
    assert p.text_attention.value == "triton_paged" and p.decode_graphs.value
    assert [(c.name, d.value) for c, d in p.component_kernels()] == [("text.attention", "triton_paged")]
    assert "component text.attention    paged_decoder_attention: 16 heads of 128, 2 KV heads -> triton_paged" \
        in p.describe()
    with pytest.raises(PlanError, match="encoder graphs requested but the model has no vision varlen attention"):
        resolve_for_components(row, PlanRequest(graph_config=GraphOptimizationConfig(use_encoder_cudagraph=True)),
                               (text,), device="cuda:0", kernels=ALL_PRESENT, text_available=paged)
    with pytest.raises(PlanError, match="2 components of kind paged_decoder_attention"):
        resolve_for_components(row, PlanRequest(), (text, text), device="cuda:0", kernels=ALL_PRESENT,
                               text_available=paged)
