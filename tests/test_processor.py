"""PaddleOCR-VL image preprocessor: parity with transformers' PaddleOCRVLImageProcessorPil and
clear errors on bad input."""
from __future__ import annotations

import io
import json
import random
import struct
import zlib

import numpy as np
import pytest
import torch
from PIL import Image

from fastdeploy_ext.models.paddleocr_vl.processor import (
    DEFAULT_MAX_IMAGE_PIXELS,
    ImageInputError,
    ImageProcessor,
    PreprocessorConfig,
    ProcessedImage,
    load_image,
    smart_resize,
)

hf_mod = pytest.importorskip("transformers.models.paddleocr_vl.image_processing_pil_paddleocr_vl")
HFProc = hf_mod.PaddleOCRVLImageProcessorPil

CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
# the released PaddleOCR-VL checkpoint's values
PADDLE = dict(min_pixels=147384, max_pixels=2822400, image_mean=[0.5, 0.5, 0.5], image_std=[0.5, 0.5, 0.5])


def _noise(h, w, c=3, seed=0):
    rng = np.random.default_rng(seed + h * 7919 + w)
    shape = (h, w, c) if c > 1 else (h, w)
    return rng.integers(0, 256, size=shape, dtype=np.uint8)


def _save(tmp_path, name, img: Image.Image, **kw):
    p = tmp_path / name
    img.save(p, **kw)
    return p


def _hf(min_pixels, max_pixels, mean=CLIP_MEAN, std=CLIP_STD):
    return HFProc(min_pixels=min_pixels, max_pixels=max_pixels, image_mean=list(mean), image_std=list(std))


def _ours(min_pixels, max_pixels, mean=CLIP_MEAN, std=CLIP_STD, **kw):
    return ImageProcessor(PreprocessorConfig(min_pixels=min_pixels, max_pixels=max_pixels,
                                             image_mean=tuple(mean), image_std=tuple(std), **kw))


def _compare(ours: ProcessedImage, hf_proc, pil_img: Image.Image):
    ref = hf_proc(images=[pil_img], return_tensors="np")
    ref_pv = np.asarray(ref["pixel_values"])
    ref_grid = tuple(int(x) for x in ref["image_grid_thw"][0])
    assert ours.grid_thw == ref_grid
    assert all(type(x) is int for x in ours.grid_thw)
    pv = ours.pixel_values
    assert pv.dtype == torch.float32 and pv.is_contiguous()
    assert tuple(pv.shape) == ref_pv.shape == (ref_grid[1] * ref_grid[2], 3, 14, 14)
    ours_np = pv.numpy()
    max_diff = float(np.abs(ours_np - ref_pv).max())
    assert max_diff <= 1e-6, max_diff
    # In practice the two are bit-identical; keep that as a hard check so drift is noticed.
    assert np.array_equal(ours_np.view(np.uint32), ref_pv.astype(np.float32).view(np.uint32))
    return max_diff


# (height, width, min_pixels, max_pixels) : what the case exercises
PARITY_CASES = [
    pytest.param(56, 84, 28 * 28, 1536 * 1536, id="no-resize-56x84"),
    pytest.param(1100, 1500, 28 * 28, 320 * 320, id="down-resize-large"),
    pytest.param(60, 50, 384 * 384, 1536 * 1536, id="up-resize-small"),
    pytest.param(333, 517, 384 * 384, 1536 * 1536, id="odd-size-default"),
    pytest.param(1, 1, 384 * 384, 1536 * 1536, id="1x1"),
    pytest.param(3, 500, 28 * 28, 1536 * 1536, id="3xN-upscale"),
    pytest.param(500, 3, 28 * 28, 1536 * 1536, id="Nx3-upscale"),
    pytest.param(10, 1999, 28 * 28, 1536 * 1536, id="aspect-just-under-200"),
    pytest.param(2000, 10, 28 * 28, 512 * 512, id="aspect-just-under-200-tall-downscale"),
]


@pytest.mark.parametrize("h,w,min_px,max_px", PARITY_CASES)
def test_parity_png(tmp_path, h, w, min_px, max_px):
    p = _save(tmp_path, f"noise_{h}x{w}.png", Image.fromarray(_noise(h, w)))
    ours = _ours(min_px, max_px).preprocess(p)
    assert ours.source == str(p)
    assert ours.original_size == (h, w)
    assert ours.resized_size == smart_resize(h, w, 28, min_px, max_px)
    with Image.open(p) as im:
        _compare(ours, _hf(min_px, max_px), im)


def test_parity_paddle_checkpoint_config(tmp_path):
    p = _save(tmp_path, "doc.jpg", Image.fromarray(_noise(300, 420)), quality=90)
    ours = _ours(PADDLE["min_pixels"], PADDLE["max_pixels"], PADDLE["image_mean"], PADDLE["image_std"])
    with Image.open(p) as im:
        _compare(ours.preprocess(p), _hf(**{k: PADDLE[k] for k in ("min_pixels", "max_pixels")},
                                         mean=PADDLE["image_mean"], std=PADDLE["image_std"]), im)


def _modes(tmp_path):
    rgba = np.concatenate([_noise(70, 90), _noise(70, 90, c=1, seed=5)[..., None]], axis=-1)
    pal = Image.fromarray(_noise(64, 80)).quantize(colors=32)
    pal_t = pal.copy()
    pal_t.info["transparency"] = 3
    cmyk = Image.fromarray(np.concatenate([_noise(40, 60), _noise(40, 60, c=1)[..., None]], -1), mode="CMYK")
    i16 = Image.fromarray((_noise(50, 66, c=1).astype(np.uint16) * 257).astype(np.uint16))   # the full 16-bit range
    return {
        "rgb.jpg": (Image.fromarray(_noise(77, 91)), dict(quality=85)),
        "rgba.png": (Image.fromarray(rgba, mode="RGBA"), {}),
        "gray.png": (Image.fromarray(_noise(45, 100, c=1)), {}),
        "la.png": (Image.fromarray(np.stack([_noise(45, 50, c=1), _noise(45, 50, c=1, seed=9)], -1), "LA"), {}),
        "pal.png": (pal, {}),
        "pal_transparent.png": (pal_t, dict(transparency=3)),
        "cmyk.jpg": (cmyk, {}),
        "i16.png": (i16, {}),
    }


@pytest.mark.parametrize("fname", ["rgb.jpg", "rgba.png", "gray.png", "la.png", "pal.png",
                                   "pal_transparent.png", "cmyk.jpg", "i16.png"])
def test_parity_modes(tmp_path, fname):
    img, save_kw = _modes(tmp_path)[fname]
    p = _save(tmp_path, fname, img, **save_kw)
    proc = _ours(28 * 28, 256 * 256)
    ours = proc.preprocess(p)
    with Image.open(p) as im:
        if im.mode.startswith("I;16"):
            # transformers' convert_to_rgb clips 16-bit samples to 255 (a page turns white); ours
            # scales them by the bit depth, so the reference gets the depth-scaled 8-bit image
            v = np.asarray(im).astype(np.int64)
            im = Image.fromarray(((v * 255 + 32767) // 65535).astype(np.uint8), mode="L")
        _compare(ours, _hf(28 * 28, 256 * 256), im)
    # PIL image and raw bytes inputs give the same result as the path
    with Image.open(p) as im:
        assert torch.equal(proc.preprocess(im).pixel_values, ours.pixel_values)
    by_bytes = proc.preprocess(p.read_bytes())
    assert by_bytes.source == "<bytes>"
    assert torch.equal(by_bytes.pixel_values, ours.pixel_values)


def test_rgba_is_composited_on_white(tmp_path):
    arr = np.zeros((28, 28, 4), dtype=np.uint8)  # fully transparent black
    im = load_image(Image.fromarray(arr, "RGBA"), PreprocessorConfig())
    assert im.mode == "RGB" and np.all(np.asarray(im) == 255)


def test_smart_resize_matches_transformers():
    rnd = random.Random(0)
    sizes = [(1, 1), (27, 27), (28, 28), (1, 200), (1, 201), (200, 1), (201, 1), (14, 2800), (14, 2801),
             (10000, 50), (4000, 3000), (29, 29)]
    sizes += [(rnd.randint(1, 5000), rnd.randint(1, 5000)) for _ in range(400)]
    sizes += [(rnd.randint(1, 40), rnd.randint(1, 8000)) for _ in range(200)]
    for mn, mx in [(384 * 384, 1536 * 1536), (147384, 2822400), (28 * 28, 28 * 28 * 4)]:
        hf = _hf(mn, mx)
        ours = _ours(mn, mx)
        for h, w in sizes:
            try:
                ref = hf_mod.smart_resize(h, w, 28, mn, mx)
            except ValueError:
                with pytest.raises(ImageInputError, match="aspect ratio"):
                    smart_resize(h, w, 28, mn, mx)
                continue
            assert smart_resize(h, w, 28, mn, mx) == ref, (h, w)
            assert ours.num_patches(h, w) == hf.get_number_of_image_patches(h, w), (h, w)


def test_call_batch_and_names(tmp_path):
    p = _save(tmp_path, "a.png", Image.fromarray(_noise(40, 40)))
    proc = _ours(28 * 28, 128 * 128)
    outs = proc([p, p.read_bytes(), Image.fromarray(_noise(30, 60))])
    assert [o.source for o in outs] == [str(p), "<image 1>", "<image 2>"]
    assert torch.equal(outs[0].pixel_values, outs[1].pixel_values)
    with pytest.raises(ImageInputError, match=r"<image 1>"):
        proc([p, b"garbage"])


# ---------------------------------------------------------------------------------- config

def test_config_both_forms_equal(tmp_path):
    base = {"image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5], "patch_size": 14, "merge_size": 2,
            "temporal_patch_size": 1, "rescale_factor": 0.00392156862745098, "resample": 3,
            "do_convert_rgb": True}
    a = PreprocessorConfig.from_dict({**base, "min_pixels": 147384, "max_pixels": 2822400})
    b = PreprocessorConfig.from_dict({**base, "size": {"shortest_edge": 147384, "longest_edge": 2822400}})
    c = PreprocessorConfig.from_dict({**base, "size": {"min_pixels": 147384, "max_pixels": 2822400}})
    assert a == b == c
    assert (a.min_pixels, a.max_pixels, a.factor) == (147384, 2822400, 28)
    # top-level keys win over size, as in transformers
    d = PreprocessorConfig.from_dict({**base, "size": {"shortest_edge": 1, "longest_edge": 2822400},
                                      "min_pixels": 147384})
    assert d == a
    # from_model_dir: file present / absent
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "preprocessor_config.json").write_text(json.dumps({**base, "min_pixels": 147384,
                                                                        "max_pixels": 2822400}))
    e = PreprocessorConfig.from_model_dir(tmp_path / "m")
    assert e == a and e.source.endswith("preprocessor_config.json")
    f = PreprocessorConfig.from_model_dir(tmp_path)
    assert f.source == "defaults" and f.min_pixels == 384 * 384 and f.max_pixels == 1536 * 1536
    assert f.image_mean == CLIP_MEAN and f.image_std == CLIP_STD and f.patch_size == 14 and f.merge_size == 2
    assert f.max_image_pixels == DEFAULT_MAX_IMAGE_PIXELS or "FD_MAX_IMAGE_PIXELS" in __import__("os").environ


@pytest.mark.parametrize("d,match", [
    ({"min_pixels": 1000, "max_pixels": 10}, "min_pixels .* <= max_pixels"),
    ({"min_pixels": -5}, "min_pixels must be a positive integer"),
    ({"max_pixels": 12.5}, "max_pixels must be a positive integer"),
    ({"patch_size": 0}, "patch_size must be a positive integer"),
    ({"image_mean": [0.5, 0.5]}, "image_mean must have 3 values"),
    ({"image_std": [0.5, 0.5, 0.5, 0.5]}, "image_std must have 3 values"),
    ({"image_std": [0.5, 0.0, 0.5]}, "image_std must be non-zero"),
    ({"image_mean": "abc"}, "image_mean must"),
    ({"size": 384}, "size must be an object"),
    ({"resample": 42}, "resample must be a PIL resampling filter"),
    ({"do_resize": False}, "do_resize=false is not supported"),
])
def test_config_invalid(d, match):
    with pytest.raises(ValueError, match=match):
        PreprocessorConfig.from_dict(d)


def test_config_invalid_json_file(tmp_path):
    (tmp_path / "preprocessor_config.json").write_text("{not json")
    with pytest.raises(ValueError, match="preprocessor_config.json"):
        PreprocessorConfig.from_model_dir(tmp_path)
    (tmp_path / "preprocessor_config.json").write_text(json.dumps({"min_pixels": 9, "max_pixels": 1}))
    with pytest.raises(ValueError, match=r"preprocessor_config.json: .*min_pixels"):
        PreprocessorConfig.from_model_dir(tmp_path)


def test_max_image_pixels_env(monkeypatch):
    monkeypatch.setenv("FD_MAX_IMAGE_PIXELS", "12345")
    assert PreprocessorConfig().max_image_pixels == 12345
    assert PreprocessorConfig(max_image_pixels=99).max_image_pixels == 99  # explicit wins
    monkeypatch.setenv("FD_MAX_IMAGE_PIXELS", "lots")
    with pytest.raises(ValueError, match="FD_MAX_IMAGE_PIXELS"):
        PreprocessorConfig()


# ----------------------------------------------------------------------------- bad inputs

def _png_bytes(h=32, w=32):
    buf = io.BytesIO()
    Image.fromarray(_noise(h, w)).save(buf, format="PNG")
    return buf.getvalue()


def _bomb_png(width, height):
    """A small valid PNG whose IHDR claims width x height (CRC fixed up); pixel data is tiny."""
    data = bytearray(_png_bytes(8, 8))
    assert data[12:16] == b"IHDR"
    data[16:24] = struct.pack(">II", width, height)
    data[29:33] = struct.pack(">I", zlib.crc32(bytes(data[12:29])) & 0xFFFFFFFF)
    return bytes(data)


def _assert_healthy(proc, tmp_path):
    p = _save(tmp_path, "good_after.png", Image.fromarray(_noise(40, 52)))
    out = proc.preprocess(p)
    assert out.pixel_values.shape[0] == out.grid_thw[1] * out.grid_thw[2] > 0


def _bad_cases(tmp_path):
    png = _png_bytes(64, 64)
    jpg = io.BytesIO()
    Image.fromarray(_noise(64, 64)).save(jpg, format="JPEG")
    cases = {
        "missing.png": (None, "file not found"),
        "empty.png": (b"", "empty"),
        "a_directory": ("DIR", "directory"),
        "corrupt.png": (b"this is not an image at all" * 10, "not a recognised image format"),
        "truncated.png": (png[: len(png) // 2], "truncated|corrupt"),
        "truncated.jpg": (jpg.getvalue()[: len(jpg.getvalue()) // 2], "truncated|corrupt"),
        "bad_crc_body.png": (png[:40] + bytes(b ^ 0x5A for b in png[40:]), "corrupt|truncated"),
        "too_wide.png": (None, "aspect ratio"),
        "bomb_huge.png": (_bomb_png(100_000, 100_000), "decode cap"),
        "bomb_mid.png": (_bomb_png(9000, 9000), "decode cap"),
    }
    for name, (content, _) in cases.items():
        p = tmp_path / name
        if content == "DIR":
            p.mkdir()
        elif content is not None:
            p.write_bytes(content)
    Image.fromarray(_noise(1, 250)).save(tmp_path / "too_wide.png")  # 1x250 -> 28x7000: ratio 250
    return cases


@pytest.mark.parametrize("name", ["missing.png", "empty.png", "a_directory", "corrupt.png", "truncated.png",
                                  "truncated.jpg", "bad_crc_body.png", "too_wide.png", "bomb_huge.png",
                                  "bomb_mid.png"])
def test_bad_inputs_raise_clear_error(tmp_path, name):
    cases = _bad_cases(tmp_path)
    _, match = cases[name]
    proc = _ours(28 * 28, 128 * 128)
    with pytest.raises(ImageInputError, match=match) as ei:
        proc.preprocess(tmp_path / name)
    assert name in str(ei.value)
    assert isinstance(ei.value, ValueError)
    err = ei.value  # no raw PIL/OSError traceback chained onto ours
    assert err.__cause__ is None and (err.__context__ is None or err.__suppress_context__)
    # the same via bytes (except path-only cases)
    if name not in ("missing.png", "a_directory"):
        with pytest.raises(ImageInputError, match=match) as eb:
            proc.preprocess((tmp_path / name).read_bytes(), name=f"upload:{name}")
        assert f"upload:{name}" in str(eb.value)
    _assert_healthy(proc, tmp_path)


def test_pixel_cap_from_config_and_env(tmp_path, monkeypatch):
    p = _save(tmp_path, "hundred.png", Image.fromarray(_noise(100, 100)))
    with pytest.raises(ImageInputError, match=r"hundred\.png.*10000x?|hundred\.png.*decode cap"):
        _ours(28 * 28, 128 * 128, max_image_pixels=9999).preprocess(p)
    _ours(28 * 28, 128 * 128, max_image_pixels=10000).preprocess(p)  # exactly at the cap is fine
    monkeypatch.setenv("FD_MAX_IMAGE_PIXELS", "5000")
    proc = ImageProcessor(PreprocessorConfig(min_pixels=28 * 28, max_pixels=128 * 128))
    with pytest.raises(ImageInputError, match="decode cap"):
        proc.preprocess(p)
    # a PIL image passed in is also checked (before its pixels are loaded)
    with Image.open(p) as im, pytest.raises(ImageInputError, match="decode cap"):
        proc.preprocess(im, name="pil-from-caller")


def test_unsupported_type():
    with pytest.raises(ImageInputError, match="unsupported image input type"):
        ImageProcessor().preprocess(12345)


def test_error_is_picklable():
    import pickle
    e = ImageInputError("x.png", "file not found", "Check the path")
    e2 = pickle.loads(pickle.dumps(e))
    assert type(e2) is ImageInputError and str(e2) == str(e) == "x.png: file not found. Check the path"
    assert e2.source == "x.png"


# ------------------------------------------------------- fast pixel mapping, pool (issue 10)

from fastdeploy_ext.models.paddleocr_vl import pixel_map  # noqa: E402
from fastdeploy_ext.models.paddleocr_vl.preprocess_pool import PreprocessPool  # noqa: E402

# (config kwargs, the recipe the processor is expected to pick)
RECIPE_CASES = [
    pytest.param(dict(image_mean=PADDLE["image_mean"], image_std=PADDLE["image_std"]), "exact3/div", id="released-0.5"),
    pytest.param(dict(image_mean=CLIP_MEAN, image_std=CLIP_STD), "exact3/div", id="clip"),
    pytest.param(dict(image_mean=CLIP_MEAN, image_std=CLIP_STD, rescale_factor=0.0039), "table", id="odd-rescale-table"),
    pytest.param(dict(image_mean=(0.3, 0.4, 0.5), image_std=(1.0, 2.0, 4.0), do_rescale=False), "normalize",
                 id="no-rescale"),
    pytest.param(dict(image_mean=CLIP_MEAN, image_std=CLIP_STD, do_normalize=False), "exact3/div", id="no-normalize"),
]


@pytest.mark.parametrize("kw,recipe", RECIPE_CASES)
def test_recipes_bitwise_vs_transformers(kw, recipe):
    """Each recipe the processor may pick, on a real resize (333x517 -> multiple of 28), equals
    the PIL-backed transformers processor bit for bit (incl. the table fallback)."""
    cfg = PreprocessorConfig(min_pixels=28 * 28, max_pixels=1536 * 1536, **kw)
    proc = ImageProcessor(cfg)
    assert proc.pixel_recipe == recipe
    hf = HFProc(min_pixels=cfg.min_pixels, max_pixels=cfg.max_pixels, image_mean=list(cfg.image_mean),
                image_std=list(cfg.image_std), rescale_factor=cfg.rescale_factor, do_rescale=cfg.do_rescale,
                do_normalize=cfg.do_normalize)
    img = Image.fromarray(_noise(333, 517))
    _compare(proc.preprocess(img), hf, img)


def test_mapper_rejects_a_recipe_that_is_off_by_one_ulp(monkeypatch):
    """Mutation test of the exactness check: transformers' own recipe followed by a multiply by
    (1 + 2^-23) (one ulp on most values) is refused; the exact table gather is used instead."""
    real = pixel_map._candidate_recipes

    def mutated(rf, mean, std):
        for name, steps in real(rf, mean, std):
            yield name + "+ulp", steps + ((np.multiply, np.float32(1 + 2 ** -23)),)
    monkeypatch.setattr(pixel_map, "_candidate_recipes", mutated)
    m = pixel_map.PixelMapper.build(1 / 255, CLIP_MEAN, CLIP_STD)
    assert m.recipe_name == "table" and m.steps is None
    good = pixel_map.reference_table(1 / 255, CLIP_MEAN, CLIP_STD)
    arr = _noise(28, 56)
    out = m.patchify(arr, 14)
    assert out.shape == (2 * 4, 3, 14, 14)
    assert out[0, 1, 0, 0] == good[1, arr[0, 0, 1]] and out[5, 2, 13, 13] == good[2, arr[27, 27, 2]]  # patch 5 = grid (1, 1)


@pytest.mark.parametrize("h,w", [(1080, 1920), (2339, 1654), (730, 480)])
def test_parity_page_sizes_released_config(h, w):
    """Page-sized inputs with the released checkpoint's settings: resize up (1080p), down (an A4
    scan at 200 dpi is above max_pixels) and a small photo; bitwise vs transformers."""
    proc = _ours(PADDLE["min_pixels"], PADDLE["max_pixels"], PADDLE["image_mean"], PADDLE["image_std"])
    img = Image.fromarray(_noise(h, w))
    ours = proc.preprocess(img)
    assert ours.resized_size != (h, w)
    _compare(ours, _hf(PADDLE["min_pixels"], PADDLE["max_pixels"], PADDLE["image_mean"], PADDLE["image_std"]), img)


def test_pool_matches_serial_order_and_errors(tmp_path):
    proc = _ours(28 * 28, 256 * 256)
    srcs = [Image.fromarray(_noise(40 + 7 * i, 90 - 5 * i, seed=i)) for i in range(6)]
    serial = [proc.preprocess(s) for s in srcs]
    with PreprocessPool(proc, workers=3) as pool:
        assert pool.workers == 3
        outs = pool.map(srcs)
        assert [o.source for o in outs] == [f"<image {i}>" for i in range(6)]
        for a, b in zip(outs, serial):
            assert a.grid_thw == b.grid_thw and torch.equal(a.pixel_values, b.pixel_values)
        # a bad image among good ones: its name in the error, the pool still works afterwards
        with pytest.raises(ImageInputError, match=r"<image 2>.*not a recognised image format"):
            pool.map([srcs[0], srcs[1], b"not an image" * 20, srcs[3]])
        fut = pool.submit(srcs[4], name="req-7/image 0")
        assert fut.result().source == "req-7/image 0"
        assert torch.equal(fut.result().pixel_values, serial[4].pixel_values)
        with pytest.raises(ValueError, match="2 names for 1 images"):
            pool.map([srcs[0]], names=["a", "b"])


@pytest.mark.parametrize("workers", [0, -1, 1.5, True])
def test_pool_rejects_bad_worker_count(workers):
    with pytest.raises(ValueError, match="workers must be a positive integer"):
        PreprocessPool(ImageProcessor(), workers=workers)


def test_pool_threads_share_one_processor_concurrently():
    """Many threads on one processor at once (the engine's use): every result equals the serial one."""
    proc = _ours(28 * 28, 512 * 512)
    srcs = [Image.fromarray(_noise(300 + i, 200 + 3 * i, seed=i)) for i in range(8)]
    serial = [proc.preprocess(s).pixel_values for s in srcs]
    with PreprocessPool(proc, workers=8) as pool:
        for _ in range(3):
            outs = pool.map(srcs * 2)
            for i, o in enumerate(outs):
                assert torch.equal(o.pixel_values, serial[i % 8])
