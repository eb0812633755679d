"""fastdeploy_ext/inputs: image values every entry point accepts, and the checks that run before
any pixel is decoded."""
from __future__ import annotations

import base64
import io

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
