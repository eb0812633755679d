"""fastdeploy_ext/inputs: image values every entry point accepts, and the checks that run before
any pixel is decoded."""
from __future__ import annotations

import base64
import io
import re

import numpy as np
import pytest
from PIL import Image

from fastdeploy_ext.inputs.images import ImageInputError, load_image, resolve_source


def _png(w=30, h=20, seed=0) -> bytes:
    arr = np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, format="PNG")
    return buf.getvalue()


def test_every_form_gives_the_same_pixels(tmp_path):
    data = _png()
    path = tmp_path / "a.png"
    path.write_bytes(data)
    url = "data:image/png;base64," + base64.b64encode(data).decode()
    ref = np.asarray(load_image(str(path)))
    for value in (str(path), path, f"file://{path}", url, data, bytearray(data), Image.open(io.BytesIO(data))):
        got = np.asarray(load_image(resolve_source(value)))
        assert got.shape == (20, 30, 3) and np.array_equal(got, ref), type(value)


@pytest.mark.parametrize("value,match", [
    ("data:image/png;base64,@@@not-base64@@@", "invalid base64"),
    ("data:image/png,plain", "must be 'data:image/...;base64"),
    ("data:image/png;base64,", "empty"),
    ("https://example.com/a.png", "remote images are not fetched"),
    (12345, "unsupported image input type int"),
])
def test_bad_values_are_one_clear_error(value, match):
    with pytest.raises(ImageInputError, match=match):
        resolve_source(value)


def test_decode_cap_and_size_rules_run_before_decoding(tmp_path):
    """The header says 30x20: with a 500-pixel cap, or a size rule that refuses it, the file is
    refused even though its pixel data is truncated (so nothing was decoded to find out)."""
    data = _png()
    truncated = data[:len(data) // 2]
    with pytest.raises(ImageInputError, match="decode cap"):
        load_image(truncated, "t.png", max_image_pixels=500)
    seen = []

    def rule(label, w, h):
        seen.append((label, w, h))
        raise ImageInputError(label, "refused by the model's size rule")
    with pytest.raises(ImageInputError, match="t.png: refused by the model's size rule"):
        load_image(truncated, "t.png", size_check=rule)
    assert seen == [("t.png", 30, 20)]
    # mutation check: without those limits the same bytes fail only when decoded
    with pytest.raises(ImageInputError, match="t.png: image data is (truncated|corrupt)"):
        load_image(truncated, "t.png")


@pytest.mark.parametrize("kind", ["empty", "corrupt", "missing", "dir"])
def test_unreadable_files_name_the_source(tmp_path, kind):
    p = tmp_path / "x.png"
    if kind == "empty":
        p.write_bytes(b"")
    elif kind == "corrupt":
        p.write_bytes(b"\x89PNG\r\n\x1a\nnot really")
    elif kind == "dir":
        p.mkdir()
    with pytest.raises(ImageInputError, match="x.png"):
        load_image(str(p))


# --------------------------------------------------------------------------- decoding by bit depth
def _encode(img: Image.Image, fmt: str, **kw) -> bytes:
    buf = io.BytesIO()
    img.save(buf, format=fmt, **kw)
    return buf.getvalue()


def _gray(data) -> np.ndarray:
    """The decoded RGB image's single gray channel (all three channels must agree)."""
    rgb = np.asarray(load_image(data))
    assert rgb.ndim == 3 and rgb.shape[2] == 3
    assert np.array_equal(rgb[..., 0], rgb[..., 1]) and np.array_equal(rgb[..., 0], rgb[..., 2])
    return rgb[..., 0]


def _box16() -> np.ndarray:
    a = np.full((6, 8), 65535, np.uint16)
    a[2:4, 3:6] = 10000                  # a faint mark on a white 16-bit page
    return a


def _box_expected(inner: int, outer: int = 255) -> np.ndarray:
    e = np.full((6, 8), outer, np.uint8)
    e[2:4, 3:6] = inner
    return e


@pytest.mark.parametrize("fmt", ["PNG", "TIFF"])
def test_16_bit_gray_file_is_scaled_by_its_depth(fmt):
    """A 10000/65535 box on white -> round(10000 * 255 / 65535) = 39 on 255 (PIL's own convert
    clips every value above 255: the page came out blank)."""
    data = _encode(Image.fromarray(_box16()), fmt)
    assert Image.open(io.BytesIO(data)).mode == "I;16"
    assert np.array_equal(_gray(data), _box_expected(39))


@pytest.mark.parametrize("chunk", [1 << 20, 300])      # 300: one row a block, 85 blocks
def test_16_bit_gradient_is_scaled_by_depth_not_by_its_own_range(monkeypatch, chunk):
    """A full-range gradient, every value exact (also when rescaled in many row blocks), and a
    dark, narrow-range one stays dark (no min/max stretch)."""
    from fastdeploy_ext.inputs import images
    monkeypatch.setattr(images, "_PIXELS_PER_CHUNK", chunk)
    v = np.arange(0, 65536, 3, dtype=np.uint16)[:21845].reshape(85, 257)
    assert np.array_equal(_gray(_encode(Image.fromarray(v), "PNG")),
                          np.vectorize(lambda x: round(x * 255 / 65535))(v).astype(np.uint8))
    dark = np.array([[1000, 1200, 1400, 1600]], np.uint16)
    assert _gray(_encode(Image.fromarray(dark), "PNG")).tolist() == [[4, 5, 5, 6]]


@pytest.mark.parametrize("mode", ["I;16", "I;16L", "I;16B", "I;16N"])
def test_16_bit_modes_in_memory_and_as_tiff(mode):
    a = _box16()
    dtype = {"I;16B": ">u2", "I;16L": "<u2"}.get(mode, "=u2")
    img = Image.frombytes(mode, (8, 6), a.astype(dtype).tobytes())
    assert np.array_equal(_gray(img), _box_expected(39))
    if mode in ("I;16", "I;16B"):             # the ones PIL writes to TIFF (it reads I;16L back as I;16)
        assert np.array_equal(_gray(_encode(img, "TIFF")), _box_expected(39))


def test_32_bit_int_tiff_is_scaled_by_its_bits_per_sample():
    """Mode I from a signed 32-bit TIFF: 0..2^31-1 -> 0..255, negatives black."""
    a = np.array([[2 ** 31 - 1, 0, -5, 2 ** 30, 10000]], np.int32)
    assert _gray(_encode(Image.fromarray(a), "TIFF")).tolist() == [[255, 0, 0, 128, 0]]
    # an in-memory I image carries 16-bit samples (PIL's container for them, e.g. convert("I"))
    i16 = Image.frombytes("I;16", (8, 6), _box16().tobytes()).convert("I")
    assert i16.mode == "I" and np.array_equal(_gray(i16), _box_expected(39))


def test_float_tiff_is_scaled_from_0_1():
    a = np.array([[0.5, 1.0, 2.0, -1.0, np.nan, 10000 / 65535]], np.float32)
    assert _gray(_encode(Image.fromarray(a), "TIFF")).tolist() == [[128, 255, 255, 0, 0, 39]]


def test_16_bit_gray_png_transparency_key_is_white():
    a = np.array([[0, 1000, 65535, 10000]], np.uint16)
    assert _gray(_encode(Image.fromarray(a), "PNG", transparency=1000)).tolist() == [[0, 255, 255, 39]]


def _png16(arr: np.ndarray, color_type: int) -> bytes:
    """A 16-bit PNG written by hand (PIL cannot write 16-bit RGB/RGBA/LA)."""
    import struct
    import zlib

    def chunk(tag: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + tag + data + struct.pack(">I", zlib.crc32(tag + data))
    h, w = arr.shape[:2]
    rows = b"".join(b"\0" + arr[y].astype(">u2").tobytes() for y in range(h))
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", w, h, 16, color_type, 0, 0, 0))
            + chunk(b"IDAT", zlib.compress(rows)) + chunk(b"IEND", b""))


@pytest.mark.parametrize("color_type,channels", [(2, 3), (6, 4), (4, 2)], ids=["RGB16", "RGBA16", "LA16"])
def test_16_bit_color_pngs_as_pil_opens_them(color_type, channels):
    """PIL opens 16-bit RGB/RGBA/LA PNGs as 8-bit modes keeping each sample's high byte (= the
    depth-scaled value for these samples): 10000 -> 39, 20000 -> 78, never a min/max stretch."""
    color = channels - (channels in (2, 4))   # the channels that are not alpha
    px = np.zeros((2, 2, channels), np.uint16)
    px[0, :, :color] = 10000                  # top row
    px[1, :, :color] = 20000                  # bottom row
    if channels in (2, 4):
        px[..., -1] = 65535                    # opaque
        px[1, 1, -1] = 0                       # one transparent pixel: white
    got = np.asarray(load_image(_png16(px, color_type)))
    assert got[0, 0].tolist() == [39, 39, 39] and got[1, 0].tolist() == [78, 78, 78]
    if channels in (2, 4):
        assert got[1, 1].tolist() == [255, 255, 255]


# --------------------------------------------------------------------------- the 8-bit modes (as before)
def _blend(c: int, a: int) -> int:
    return round(c * a / 255 + 255 * (255 - a) / 255)


def test_rgba_and_la_composited_on_white():
    rgba = np.array([[[255, 0, 0, 0], [255, 0, 0, 255], [0, 0, 255, 128]]], np.uint8)
    got = np.asarray(load_image(_encode(Image.fromarray(rgba, "RGBA"), "PNG")))
    assert got.tolist() == [[[255, 255, 255], [255, 0, 0], [_blend(0, 128), _blend(0, 128), 255]]]
    la = np.array([[[0, 0], [0, 255], [100, 128]]], np.uint8)
    assert _gray(_encode(Image.fromarray(la, "LA"), "PNG")).tolist() == [[255, 0, _blend(100, 128)]]


def test_palette_with_transparency_and_cmyk():
    p = Image.new("P", (3, 1))
    p.putpalette([255, 0, 0, 0, 255, 0, 0, 0, 255] + [0] * 759)
    p.putdata([0, 1, 2])
    got = np.asarray(load_image(_encode(p, "PNG", transparency=1)))
    assert got.tolist() == [[[255, 0, 0], [255, 255, 255], [0, 0, 255]]]
    cmyk = np.array([[[0, 255, 255, 0], [0, 0, 0, 255], [51, 0, 0, 0], [0, 0, 0, 0]]], np.uint8)
    got = np.asarray(load_image(_encode(Image.fromarray(cmyk, "CMYK"), "TIFF")))
    assert got.tolist() == [[[255, 0, 0], [0, 0, 0], [204, 255, 255], [255, 255, 255]]]


@pytest.mark.parametrize("fmt", ["PNG", "TIFF32"])
def test_exif_orientation_is_applied(fmt):
    """Orientation 6 (rotate 90 clockwise to display); for a 32-bit TIFF the depth must still
    come from the file's tags, which a transposed copy no longer has."""
    if fmt == "PNG":
        arr = np.arange(6, dtype=np.uint8).reshape(2, 3) * 40
        exif = Image.Exif()
        exif[0x0112] = 6
        data, expected = _encode(Image.fromarray(arr), "PNG", exif=exif.tobytes()), arr
    else:
        arr = np.array([[0, 2 ** 30, 2 ** 31 - 1], [2 ** 29, 0, 2 ** 31 - 1]], np.int32)
        data = _encode(Image.fromarray(arr), "TIFF", tiffinfo={0x0112: 6})
        expected = np.array([[0, 128, 255], [64, 0, 255]], np.uint8)
    got = _gray(data)
    assert got.shape == (3, 2) and np.array_equal(got, np.rot90(expected, k=-1))
    if fmt == "PNG":                          # (PIL's TIFF decoder applies the tag itself)
        unrotated = np.asarray(load_image(data, exif_transpose=False))[..., 0]
        assert np.array_equal(unrotated, expected)


def test_rescale_guard_breaks_when_removed(monkeypatch):
    """Fault injection: without the depth rescale (PIL's own conversion), the 16-bit page is
    blank, which is what the tests above would catch."""
    from fastdeploy_ext.inputs import images
    monkeypatch.setattr(images, "_SIXTEEN_BIT_MODES", frozenset())
    data = _encode(Image.fromarray(_box16()), "PNG")
    assert (_gray(data) == 255).all()


# --------------------------------------------------------------------------- URL schemes, one parser
def _data_url(data: bytes, prefix: str = "data:image/png;base64,") -> str:
    return prefix + base64.b64encode(data).decode()


@pytest.mark.parametrize("prefix", ["data:image/png;base64,", "DATA:image/png;base64,", "Data:IMAGE/PNG;BASE64,",
                                    "DATA://image/png;base64,"])     # the last: a data URL, never a path
def test_data_urls_in_any_case_decode_the_same(prefix):
    data = _png()
    assert resolve_source(_data_url(data, prefix)) == data


def test_file_urls_and_paths_in_any_case(tmp_path):
    data = _png()
    (tmp_path / "a b.png").write_bytes(data)
    p = str(tmp_path / "a b.png")
    quoted = str(tmp_path / "a%20b.png")
    for value in (p, f"file://{p}", f"FILE://{p}", f"File://{quoted}", f"file://localhost{p}"):
        assert resolve_source(value) == p, value
        assert np.asarray(load_image(resolve_source(value))).shape == (20, 30, 3)


@pytest.mark.parametrize("value,match", [
    ("HTTP://example.com/a.png", "remote images are not fetched"),
    ("Https://example.com/a.png", "remote images are not fetched"),
    ("DATA:image/png,AAAA", "must be 'data:image/...;base64"),
    ("ftp://example.com/a.png", "unsupported URL scheme 'ftp'"),
])
def test_schemes_are_case_insensitive_in_resolve_source(value, match):
    with pytest.raises(ImageInputError, match=re.escape(match)):
        resolve_source(value)


def test_parse_source_rules():
    from fastdeploy_ext.inputs.sources import parse_source
    assert [parse_source(v).scheme for v in ("DATA:x", "data://x", "HTTP://h", "hTTps://h", "FILE:///a",
                                             "page:1.png", "rel/x.png", "C:x", "s3://b/k")] == \
        ["data", "data", "http", "https", "file", "", "", "", "s3"]
    assert parse_source("page:1.png").path == "page:1.png"          # a local name with a colon
    assert parse_source("file://rel/x.png").path == "rel/x.png"
    assert parse_source("FILE://LOCALHOST/abs/x.png").path == "/abs/x.png"


def _fetcher(root):
    from fastdeploy_ext.entrypoints.openai.media import MediaFetcher, MediaPolicy
    return MediaFetcher(MediaPolicy(max_bytes=1 << 20, fetch_timeout=5.0, allowed_local_path=root))


def test_media_fetcher_reads_schemes_like_resolve_source(tmp_path, monkeypatch):
    """The server's fetcher dispatches on the same parser: DATA: passes through (to the engine's
    resolve_source, which decodes it), FILE:// reads the allowed file, HTTP:// goes to the http
    fetch, DATA:// is a data URL in both (never a relative path in one of them)."""
    import asyncio

    from fastdeploy_ext.entrypoints.openai.errors import APIError
    data = _png()
    (tmp_path / "p.png").write_bytes(data)
    f = _fetcher(tmp_path.resolve())
    fetched = []

    async def fake_http(url, label):
        fetched.append(url)
        return b"http-bytes"
    monkeypatch.setattr(f, "_fetch_http", fake_http)

    def fetch(url):
        return asyncio.run(f.fetch(url, "image 0"))
    up = _data_url(data, "DATA:image/png;base64,")
    assert fetch(up) == up and resolve_source(fetch(up)) == data
    for url in (f"FILE://{tmp_path}/p.png", f"file://{tmp_path}/p.png", str(tmp_path / "p.png")):
        assert fetch(url) == data, url
    assert fetch("HTTP://127.0.0.1:9/x.png") == b"http-bytes" and fetched == ["HTTP://127.0.0.1:9/x.png"]
    odd = _data_url(data, "DATA://image/png;base64,")
    assert fetch(odd) == odd and resolve_source(fetch(odd)) == data
    with pytest.raises(APIError, match="unsupported URL scheme 'ftp'"):
        fetch("FTP://example.com/a.png")
