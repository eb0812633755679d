"""DeepSeek-OCR-2 (fastdeploy_ext/models/deepseek_ocr2/) against transformers 5.24's implementation.

The reference is transformers' own model on a tiny random configuration with the real geometry
(1024 global view, 768 crops, 14x14 windows, 256/144 queries; tiny widths), saved with
``save_pretrained`` (DeepSeek's tensor names) and loaded by our loader: fp32 parity of the vision
features (max abs <= 1e-4) and of the decoder's logits, the preprocessor bitwise, the prompt's ids
as transformers' processor writes them. Two tests break the tower on purpose (the window padding,
the encoder's prefix mask) and see the parity fail.
"""
from __future__ import annotations

import json
import os

import pytest
import torch
import torch.nn.functional as F
from PIL import Image

pytest.importorskip("transformers.models.deepseek_ocr2")

from fastdeploy_ext.models.deepseek_ocr2 import tiny  # noqa: E402
from fastdeploy_ext.models.deepseek_ocr2 import vision as vision_mod  # noqa: E402
from fastdeploy_ext.models.deepseek_ocr2.config import (  # noqa: E402
    DeepseekOCR2Config,
    released_config_json,
)
from fastdeploy_ext.models.deepseek_ocr2.loader import load  # noqa: E402
from fastdeploy_ext.models.deepseek_ocr2.processor import DeepseekOCR2ImageProcessor  # noqa: E402
from fastdeploy_ext.models.interface import CheckpointError  # noqa: E402
from fastdeploy_ext.models.registry import detect_family, get_family  # noqa: E402
from fastdeploy_ext.ops.attention.biased import rel_pos_table  # noqa: E402
from fastdeploy_ext.ops.moe import experts_dense, experts_gathered  # noqa: E402

CPU = torch.device("cpu")


def image(w: int, h: int, seed: int) -> Image.Image:
    g = torch.Generator().manual_seed(seed)
    return Image.fromarray((torch.rand(h, w, 3, generator=g) * 255).to(torch.uint8).numpy())


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
    return tiny.write_checkpoint(tmp_path_factory.mktemp("dsocr2") / "tiny", seed=0)


@pytest.fixture(scope="module")
def reference(model_dir):
    from transformers import DeepseekOcr2ForConditionalGeneration
    return DeepseekOcr2ForConditionalGeneration.from_pretrained(str(model_dir)).eval()


@pytest.fixture(scope="module")
def ours(model_dir):
    fam = get_family("deepseek_ocr2")
    cfg = fam.read_config(str(model_dir))
    vis, vrep = fam.load_vision(str(model_dir), dtype=torch.float32, device=CPU, model_format="auto", cfg=cfg)
    txt, trep = fam.load_text(str(model_dir), dtype=torch.float32, device=CPU, model_format="auto", cfg=cfg)
    return fam, cfg, vis, txt, (vrep, trep)


# one image without crops (600x500) and one with 3x2 = 6 crops (1000x1600 is 2 cols x 3 rows)
IMAGES = [(600, 500, 1), (1000, 1600, 2)]


@pytest.fixture(scope="module")
def features(ours, reference):
    fam, cfg, vis, _, _ = ours
    imgs = [image(w, h, s) for w, h, s in IMAGES]
    proc = fam.image_processor(None)
    pre = [proc.preprocess(im, f"img{i}") for i, im in enumerate(imgs)]
    meta = fam.metadata_builder(cfg, vis, dtype=torch.float32, device=CPU, attention=None).build_host(
        [p.grid_thw for p in pre])
    pixels = torch.cat([p.pixel_values for p in pre])
    with torch.inference_mode():
        got = vis(pixels, meta, fam.vision_execution(None, False, False))
        r = tiny.processor().image_processor(images=imgs, return_tensors="pt")
        want = reference.model.get_image_features(pixel_values=r["pixel_values"],
                                                  pixel_values_local=r.get("pixel_values_local"),
                                                  num_local_patches=r["num_local_patches"]).pooler_output
    return pixels, meta, got, want


# ------------------------------------------------------------------ config
def test_released_config_json_loads_as_the_default(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(released_config_json()))
    fam = get_family("deepseek_ocr2")
    cfg = fam.read_config(str(tmp_path))
    assert cfg == DeepseekOCR2Config() == fam.default_config()
    assert detect_family(str(tmp_path)).family.name == "deepseek_ocr2"
    t = cfg.text
    assert (t.hidden_size, t.num_hidden_layers, t.num_attention_heads, t.head_dim) == (1280, 12, 10, 128)
    assert (t.n_routed_experts, t.num_experts_per_tok, t.n_shared_experts, t.first_k_dense) == (64, 6, 2, 1)
    # KV bytes per token in bf16: layers x (k + v) x kv heads x head_dim x 2 bytes = 60 KiB
    assert t.num_hidden_layers * 2 * t.num_key_value_heads * t.head_dim * 2 == 60 * 1024
    assert (cfg.global_queries, cfg.crop_queries, cfg.image_rows(6)) == (256, 144, 6 * 144 + 257)


def test_default_config_in_transformers_form_builds_the_released_model(tmp_path):
    """Our released values written in transformers' form round-trip and build transformers' model
    of the released size (3.389 B parameters, counted on the meta device)."""
    from transformers import DeepseekOcr2Config, DeepseekOcr2ForConditionalGeneration
    d = DeepseekOCR2Config().to_transformers_json()
    (tmp_path / "config.json").write_text(json.dumps(d))
    assert DeepseekOCR2Config.from_model_dir(tmp_path) == DeepseekOCR2Config()
    with torch.device("meta"):
        m = DeepseekOcr2ForConditionalGeneration(DeepseekOcr2Config(**{k: v for k, v in d.items()
                                                                      if k != "model_type"}))
    n = sum(p.numel() for p in m.parameters())
    assert round(n / 1e9, 3) == 3.389, n


@pytest.mark.parametrize("patch, match", [
    ({"use_mla": True}, "MLA"), ({"norm_topk_prob": True}, "renormalise"),
    ({"topk_method": "noaux_tc"}, "greedy"), ({"num_experts_per_tok": 65}, "num_experts_per_tok")])
def test_released_config_refuses_other_models(tmp_path, patch, match):
    d = released_config_json()
    d["language_config"].update(patch)
    (tmp_path / "config.json").write_text(json.dumps(d))
    with pytest.raises(CheckpointError, match=match):
        DeepseekOCR2Config.from_model_dir(tmp_path)


def test_released_form_refuses_a_v1_projector(tmp_path):
    d = released_config_json()
    d["projector_config"]["input_dim"] = 2048
    (tmp_path / "config.json").write_text(json.dumps(d))
    with pytest.raises(CheckpointError, match="DeepSeek-OCR \\(v1\\)"):
        DeepseekOCR2Config.from_model_dir(tmp_path)


# ------------------------------------------------------------------ processor
@pytest.mark.parametrize("size", [(600, 500), (768, 300), (769, 300), (1240, 1754), (2000, 700), (333, 1500)])
def test_processor_bitwise_equal_to_transformers_pil(size):
    ref = tiny.processor().image_processor
    ours = DeepseekOCR2ImageProcessor()
    im = image(*size, seed=size[0])
    want = ref(images=im, return_tensors="pt")
    got = ours.preprocess(im, "x")
    crops, glob = ours.unpatch(got.pixel_values, got.grid_thw)
    assert got.num_crops == int(want["num_local_patches"][0])
    assert torch.equal(glob, want["pixel_values"][0])
    if got.num_crops:
        assert torch.equal(torch.stack(crops), want["pixel_values_local"])
    assert got.pixel_values.shape[0] == DeepseekOCR2Config().image_patches(got.num_crops)


def _device_under_test() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def test_bytes_are_normalized_on_the_device_bitwise_as_transformers_does(ours, features):
    """The processor hands out uint8 patches; the tower's normalization (on the device under test)
    equals transformers' float64-then-float32 formula on all 256 bytes, and the tower fed the
    bytes gives the same rows as fed the floats transformers' processor would make; bytes cast
    without normalizing would not."""
    import numpy as np

    from fastdeploy_ext.models.deepseek_ocr2.processor import normalize_reference, to_model_pixels
    u = torch.arange(256, dtype=torch.uint8)
    dev = to_model_pixels(u.to(_device_under_test()), torch.float32).cpu().numpy()
    assert np.array_equal(dev.view(np.uint32), normalize_reference(u.numpy()).view(np.uint32))
    fam, cfg, vis, _, _ = ours
    pixels, meta, got, _ = features
    assert pixels.dtype == torch.uint8
    floats = to_model_pixels(pixels, torch.float32)
    with torch.inference_mode():
        assert torch.equal(vis(floats, meta, fam.vision_execution(None, False, False)), got)
        raw = vis(pixels.to(torch.float32), meta, fam.vision_execution(None, False, False))
    assert (raw - got).abs().max() > 1e-2


def test_a_table_that_rounds_differently_fails_the_bitwise_comparison(monkeypatch):
    """The comparison above can fail: the rescale factor rounded to float32 first (as a float32
    division by 255 would be) gives another table on some of the 256 bytes."""
    import numpy as np

    from fastdeploy_ext.models.deepseek_ocr2 import processor as proc_mod
    u = torch.arange(256, dtype=torch.uint8)
    want = proc_mod.normalize_reference(u.numpy()).view(np.uint32)
    monkeypatch.setattr(proc_mod, "RESCALE", float(np.float32(1 / 255)))
    got = proc_mod.to_model_pixels(u.to(_device_under_test()), torch.float32).cpu().numpy()
    assert not np.array_equal(got.view(np.uint32), want)


def test_processor_refuses_an_image_above_the_patch_budget():
    from fastdeploy_ext.inputs.images import ImageInputError
    with pytest.raises(ImageInputError, match="input patches"):
        DeepseekOCR2ImageProcessor().preprocess(image(1240, 1754, 0), "page", max_patches=10000)


# ------------------------------------------------------------------ prompt
def test_prompt_ids_equal_transformers_processor(model_dir, ours):
    fam, cfg, *_ = ours
    tok, fmt = fam.load_tokenizer(str(model_dir), cfg)
    proc = fam.image_processor(str(model_dir))
    imgs = [image(1000, 1600, 2), image(600, 500, 1)]
    grids = [proc.preprocess(im, "x").grid_thw for im in imgs]
    built = fam.build_prompt(tok, fmt, cfg, prompt="Free OCR.", image_grids=grids)
    want = tiny.processor()(images=imgs, text="<image>\n<image>\nFree OCR.", return_tensors="pt")["input_ids"][0]
    assert built.token_ids == want.tolist()
    assert built.image_runs == [(1, 6 * 144 + 257), (1 + 6 * 144 + 257, 257)]
    assert built.positions.tolist() == [list(range(len(want)))] and built.rope_delta == 0


# ------------------------------------------------------------------ loader
def test_loader_reads_save_pretrained_names(ours, model_dir):
    *_, (vrep, trep) = ours
    from safetensors import safe_open
    with safe_open(str(model_dir / "model.safetensors"), "pt") as h:
        names = list(h.keys())
    assert any(n.startswith("model.sam_model.blocks.") for n in names)
    assert "model.qwen2_model.query_768.weight" in names and "model.view_seperator" in names
    experts = sum(".mlp.experts." in n for n in names)
    # every tensor is read; the unfused experts (3 per expert) are stacked into 2 per layer
    assert vrep.tensors_loaded + trep.tensors_loaded == len(names) - experts + 2 * 2


def test_loader_names_a_missing_tensor(model_dir, tmp_path):
    from safetensors.torch import load_file, save_file
    t = load_file(str(model_dir / "model.safetensors"))
    del t["model.layers.2.mlp.experts.5.up_proj.weight"]
    save_file(t, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text((model_dir / "config.json").read_text())
    cfg = DeepseekOCR2Config.from_model_dir(tmp_path)
    with pytest.raises(CheckpointError, match=r"model\.layers\.2\.mlp\.experts\.5\.up_proj\.weight is missing"):
        load("text", tmp_path, cfg, dtype=torch.float32, device=CPU)
    t2 = load_file(str(model_dir / "model.safetensors"))
    t2["model.sam_model.pos_embed"] = t2["model.sam_model.pos_embed"][:, :32]
    save_file(t2, str(tmp_path / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"model\.sam_model\.pos_embed has shape \[1, 32, 64, 32\]"):
        load("vision", tmp_path, cfg, dtype=torch.float32, device=CPU)


# ------------------------------------------------------------------ parity
def test_vision_features_match_transformers(features):
    _, meta, got, want = features
    assert meta.out_split_sizes == [257, 6 * 144 + 257]
    want = torch.cat(want)
    assert got.shape == want.shape
    assert want.abs().max() > 0.5          # a real signal, not a near-zero tower
    assert (got - want).abs().max().item() <= 1e-4


@pytest.mark.parametrize("fault", ["masked_window_padding", "causal_visual_tokens"])
def test_breaking_the_tower_breaks_parity(features, ours, monkeypatch, fault):
    """The checks above can fail: masking the padded window keys (the trained model does not),
    or making the encoder causal over its visual prefix, each moves the features past 1e-4."""
    pixels, meta, _, want = features
    fam, cfg, vis, *_ = ours
    if fault == "masked_window_padding":
        real = vision_mod.SamBlock.forward

        def padded_zero_qkv(self, x, strided=True):
            if not self.window:
                return real(self, x, strided)
            # pad the *output of qkv* with zeros instead of its input: padded keys lose their bias
            b, h, w, d = x.shape
            s = self.window
            ph, pw = -h % s, -w % s
            y = F.pad(self.norm1(x), (0, 0, 0, pw, 0, ph))
            keep = F.pad(torch.ones(b, h, w, 1), (0, 0, 0, pw, 0, ph))
            hp, wp = h + ph, w + pw
            y = y.view(b, hp // s, s, wp // s, s, d).transpose(2, 3).reshape(-1, s, s, d)
            keep = keep.view(b, hp // s, s, wp // s, s, 1).transpose(2, 3).reshape(-1, s, s, 1)
            a = self.attn
            qkv = a.qkv(y) * keep
            q, k, v = qkv.view(-1, s * s, 3, a.nh, a.hd).permute(2, 0, 3, 1, 4).unbind(0)
            qg = q.reshape(-1, a.nh, s, s, a.hd)
            rh = torch.einsum("bnhwc,hkc->bnhwk", qg, rel_pos_table(a.rel_pos_h, s))
            rw = torch.einsum("bnhwc,wkc->bnhwk", qg, rel_pos_table(a.rel_pos_w, s))
            bias = (rh[..., :, None] + rw[..., None, :]).reshape(-1, a.nh, s * s, s * s)
            o = a.proj(F.scaled_dot_product_attention(q, k, v, attn_mask=bias).transpose(1, 2).reshape(-1, s, s, d))
            o = o.view(b, hp // s, wp // s, s, s, d).transpose(2, 3).reshape(b, hp, wp, d)[:, :h, :w]
            x = x + o
            return x + self.mlp(self.norm2(x))
        monkeypatch.setattr(vision_mod.SamBlock, "forward", padded_zero_qkv)
    else:
        from fastdeploy_ext.ops.attention import biased
        monkeypatch.setattr(biased, "prefix_mask", lambda nv, n, device: torch.ones(n, n, dtype=torch.bool,
                                                                                    device=device).tril())
    with torch.inference_mode():
        got = vis(pixels, meta, fam.vision_execution(None, False, False))
    assert (got - torch.cat(want)).abs().max().item() > 1e-3


def test_strided_and_dense_qkv_agree_and_reach_sdpa_as_planned(features, ours, monkeypatch):
    """The plan's qkv_layout reaches SAM: strided hands SDPA views of the fused projection,
    dense contiguous copies; the features agree (the parity above ran dense)."""
    pixels, meta, dense, _ = features
    fam, cfg, vis, *_ = ours
    seen = []
    real = F.scaled_dot_product_attention

    def recording(q, k, v, attn_mask=None, **kw):
        if attn_mask is not None and attn_mask.is_floating_point():      # SAM's rel-pos bias
            seen.append(q.is_contiguous() and k.is_contiguous() and v.is_contiguous())
        return real(q, k, v, attn_mask=attn_mask, **kw)
    monkeypatch.setattr(F, "scaled_dot_product_attention", recording)
    with torch.inference_mode():
        strided = vis(pixels, meta, fam.vision_execution(None, True, False))
        assert seen and not any(seen)
        seen.clear()
        again = vis(pixels, meta, fam.vision_execution(None, False, False))
        assert seen and all(seen)
    assert torch.equal(again, dense)
    assert (strided - dense).abs().max().item() <= 1e-5


def reference_attend(i, q, k, v):
    """Causal attention over one whole sequence ([T, heads, d]): what the paged runner computes
    for a single prefill."""
    o = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), is_causal=True)
    return o.transpose(0, 1)


def test_decoder_logits_match_transformers_with_an_image(ours, reference, features, model_dir):
    """Prompt (BOS, 257 image rows, text) through our decoder with our image rows vs
    transformers' full forward from pixels."""
    fam, cfg, vis, txt, _ = ours
    _, _, got_rows, _ = features
    rows = got_rows[:257]                                      # the first image: no crops
    tok, fmt = fam.load_tokenizer(str(model_dir), cfg)
    built = fam.build_prompt(tok, fmt, cfg, prompt="Free OCR.", image_grids=[(1, 1, 1)])
    ids = torch.tensor(built.token_ids)
    (off, n), = built.image_runs
    with torch.inference_mode():
        x = txt.embed(ids, rows, torch.arange(off, off + n))
        logits = txt.logits(txt(x, built.positions, reference_attend))
        r = tiny.processor()(images=[image(600, 500, 1)], text="<image>\nFree OCR.", return_tensors="pt")
        assert r["input_ids"][0].tolist() == built.token_ids
        want = reference(**r).logits[0]
    assert (logits - want).abs().max().item() <= 1e-4
    assert want.std() > 0.1


def test_moe_paths_agree_and_do_not_renormalise(ours, monkeypatch):
    """The dense (decode) and gathered (prefill) expert paths give the same output; the routed
    weights are the router's probabilities as they are (their sum is below 1)."""
    _, cfg, _, txt, _ = ours
    moe = txt.layers[1].mlp
    x = torch.randn(20, cfg.text.hidden_size, generator=torch.Generator().manual_seed(3))
    with torch.inference_mode():
        w, idx = moe.route(x)
        assert (w.sum(-1) < 0.999).all()
        gathered = experts_gathered(x, w, idx, moe.gate_up, moe.down)
        dense = experts_dense(x, w, idx, moe.gate_up, moe.down)
    assert (gathered - dense).abs().max().item() < 1e-5
    # the transformers-style loop over experts, written out
    want = torch.zeros_like(x)
    with torch.no_grad():
        for t in range(x.shape[0]):
            for j in range(idx.shape[1]):
                e = int(idx[t, j])
                g, u = (moe.gate_up[e] @ x[t]).chunk(2)
                want[t] += w[t, j] * (moe.down[e] @ (F.silu(g) * u))
    assert (gathered - want).abs().max().item() < 1e-5


def test_router_weights_stay_fp32_in_bf16(model_dir):
    cfg = DeepseekOCR2Config.from_model_dir(model_dir)
    txt, _ = load("text", model_dir, cfg, dtype=torch.bfloat16, device=CPU)
    moe = txt.layers[1].mlp
    assert moe.gate.weight.dtype == torch.float32
    assert moe.gate_up.dtype == torch.bfloat16 and txt.lm_head.weight.dtype == torch.bfloat16
    dummy, _ = load("text", None, cfg, dtype=torch.bfloat16, device=CPU)
    assert dummy.layers[1].mlp.gate.weight.dtype == torch.float32 and dummy.norm.weight.dtype == torch.bfloat16
