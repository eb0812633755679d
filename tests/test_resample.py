"""inputs.resample: Pillow's 8-bit resize in torch, compared byte for byte with the installed
Pillow (the bytes DeepSeek-OCR-2's device preprocessing must reproduce), with the mutations that
show the comparison can fail."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from fastdeploy_ext.inputs import resample

PIL_FILTERS = {resample.Filter.BICUBIC: Image.BICUBIC, resample.Filter.BILINEAR: Image.BILINEAR}

# (in h, in w) -> (out w, out h): up, down, mixed both ways, 1-pixel sides, the six-crop page's
# two resizes (1240x1754 -> 1536x2304 and -> 724x1024), a 1080p page's global view
SIZES = [((1754, 1240), (1536, 2304)), ((1754, 1240), (724, 1024)), ((1080, 1920), (1024, 576)),
         ((37, 53), (11, 7)), ((20, 30), (200, 300)), ((100, 100), (100, 37)), ((64, 9), (64, 13)),
         ((9, 64), (13, 64)), ((1, 5), (3, 1)), ((5, 1), (1, 9)), ((300, 200), (299, 201)), ((300, 64), (6, 13))]


def pixels(h: int, w: int, seed: int) -> np.ndarray:
    """Noise over the lower half (every tap's weight shows), a gradient over the upper (the
    rounding of smooth regions)."""
    a = np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8)
    a[: h // 2] = np.linspace(0, 255, w)[None, :, None].astype(np.uint8)
    return a


def pil(a: np.ndarray, size, filt) -> np.ndarray:
    return np.asarray(Image.fromarray(a).resize(size, PIL_FILTERS[filt]))


@pytest.mark.parametrize("filt", list(resample.Filter))
@pytest.mark.parametrize("shape,size", SIZES)
def test_resize_gives_pillows_bytes(shape, size, filt):
    a = pixels(*shape, seed=sum(shape) + sum(size))
    got = resample.resize(torch.from_numpy(a), size, filt)
    assert got.dtype == torch.uint8 and tuple(got.shape) == (size[1], size[0], 3)
    np.testing.assert_array_equal(got.numpy(), pil(a, size, filt))


def test_the_sizes_cover_both_pass_orders():
    orders = {resample.vertical_first(w, h, ow, oh, ordered=True) for (h, w), (ow, oh) in SIZES}
    assert orders == {True, False}


def test_the_other_pass_order_is_seen(monkeypatch):
    """The rule Pillow 13 added (vertical first when the height shrinks most) is what makes
    these bytes: the other version's order on the same case differs from the installed PIL."""
    (h, w), size = (300, 64), (6, 13)
    assert resample.vertical_first(w, h, *size, ordered=True)
    a = pixels(h, w, seed=3)
    want = pil(a, size, resample.Filter.BICUBIC)
    monkeypatch.setattr(resample, "PILLOW_ORDERS_PASSES", not resample.PILLOW_ORDERS_PASSES)
    got = resample.resize(torch.from_numpy(a), size).numpy()
    assert not np.array_equal(got, want)


def test_dropping_the_rounding_offset_is_seen(monkeypatch):
    """Each pass adds 2**21 before the shift (round half up): flooring instead moves bytes."""
    a = pixels(1754 // 8, 1240 // 8, seed=4)
    size = (1536 // 8, 2304 // 8)
    want = pil(a, size, resample.Filter.BICUBIC)
    np.testing.assert_array_equal(resample.resize(torch.from_numpy(a), size).numpy(), want)
    monkeypatch.setattr(resample, "ROUNDING", 0)
    assert not np.array_equal(resample.resize(torch.from_numpy(a), size).numpy(), want)


def test_same_size_is_a_copy():
    a = torch.from_numpy(pixels(10, 12, seed=5))
    out = resample.resize(a, (12, 10))
    assert torch.equal(out, a) and out.data_ptr() != a.data_ptr()


@pytest.mark.parametrize("bad,msg", [(torch.zeros(4, 4, 3), "uint8"), (torch.zeros(4, 4, dtype=torch.uint8), "uint8 \\[H, W, C\\]")])
def test_bad_pixels_are_refused(bad, msg):
    with pytest.raises(ValueError, match=msg):
        resample.resize(bad, (2, 2))


def test_bad_sizes_are_refused():
    with pytest.raises(ValueError, match="must be positive"):
        resample.resize(torch.zeros(4, 4, 3, dtype=torch.uint8), (0, 2))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("shape,size", SIZES[:3])
def test_cuda_gives_the_same_bytes(shape, size):
    a = pixels(*shape, seed=7)
    got = resample.resize(torch.from_numpy(a).cuda(), size)
    assert got.is_cuda
    np.testing.assert_array_equal(got.cpu().numpy(), pil(a, size, resample.Filter.BICUBIC))
