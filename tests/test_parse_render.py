"""Rendering in the worker pool: generated and real PDFs, bad files as PageErrors with clear
messages, bombs refused, multi-page TIFFs, and a pool that survives failing, crashing and hung
pages."""
import io
import os
import struct
import time
import zlib
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from fastdeploy_ext.parsing.errors import PageError
from fastdeploy_ext.parsing.render import PageRenderer, RenderTask, render_page
from fastdeploy_ext.parsing.sources import count_pages
from fastdeploy_ext.parsing.synthetic import synthetic_document

ROOT = Path(__file__).resolve().parents[1]


def shared_pdfs() -> Path:
    """``../shared/pdfs`` of the checkout (or of a folder above it, for a git worktree)."""
    for up in ROOT.parents:
        if (up / "shared" / "pdfs").is_dir():
            return up / "shared" / "pdfs"
    pytest.fail(f"no shared/pdfs folder above {ROOT}: the real PDFs are read from ../shared/pdfs")


@pytest.fixture(scope="module")
def renderer():
    with PageRenderer(workers=2) as r:
        yield r


@pytest.fixture(scope="module")
def synthetic_pdf(tmp_path_factory):
    doc = synthetic_document(2, seed=3)
    p = tmp_path_factory.mktemp("pdf") / "synthetic.pdf"
    p.write_bytes(doc.pdf)
    return p


def error_of(fut, timeout=120) -> PageError:
    e = fut.exception(timeout=timeout)
    assert isinstance(e, PageError), repr(e)
    return e


def test_generated_pdf_renders_at_144_dpi(renderer, synthetic_pdf):
    pages = [renderer.submit(RenderTask(str(synthetic_pdf), i)).result(timeout=120) for i in range(2)]
    for i, page in enumerate(pages):
        assert (page.page_index, page.page_count, page.width, page.height) == (i, 2, 1190, 1684)
        assert page.image.shape == (1684, 1190, 3) and page.image.dtype == np.uint8
        assert page.scale == 2.0
        # the same pixels as rendering in this process, and not a blank page
        assert np.array_equal(page.image, render_page(RenderTask(str(synthetic_pdf), i)).image)
        assert page.image.min() < 50 and page.image.max() == 255
    assert not np.array_equal(pages[0].image, pages[1].image)


def test_synthetic_documents_are_deterministic_from_the_seed():
    a, b, c = synthetic_document(1, seed=5), synthetic_document(1, seed=5), synthetic_document(1, seed=6)
    assert a.pdf == b.pdf and a.pages == b.pages
    assert a.pdf != c.pdf
    labels = [blk.label for blk in a.pages[0]]
    assert sorted(set(labels)) == ["display_formula", "doc_title", "figure_title", "paragraph_title", "table", "text"]
    assert [labels.count(x) for x in ("doc_title", "paragraph_title", "text", "table", "display_formula",
                                      "figure_title")] == [1, 1, 9, 1, 2, 2]
    assert labels[0] == "doc_title" and labels[labels.index("table") - 1] == "figure_title"
    boxes = [blk.bbox for blk in a.pages[0]]
    assert all(0 <= x0 < x1 <= 1190 and 0 <= y0 < y1 <= 1684 for x0, y0, x1, y1 in boxes)
    assert all(boxes[i][3] < boxes[i + 1][1] for i in range(len(boxes) - 1))      # stacked, no overlap
    assert [blk.order for blk in a.pages[0]] == list(range(16))


def test_every_real_pdf_renders_every_page(renderer):
    pdfs = sorted(shared_pdfs().glob("*.pdf"))
    assert pdfs
    futures = [(p, i, renderer.submit(RenderTask(str(p), i))) for p in pdfs for i in range(count_pages(p))]
    assert len(futures) == 31
    for p, i, fut in futures:
        page = fut.result(timeout=300)
        assert page.image.ndim == 3 and page.width > 0 and page.height > 0, (p.name, i)
        assert page.page_count == count_pages(p)


def encrypted_pdf(path: Path) -> None:
    from pypdf import PdfWriter
    w = PdfWriter()
    w.add_blank_page(200, 200)
    w.encrypt(user_password="secret", owner_password="owner")
    with open(path, "wb") as f:
        w.write(f)


def test_bad_pdfs_are_page_errors_with_clear_messages(renderer, tmp_path, synthetic_pdf):
    data = synthetic_pdf.read_bytes()
    (tmp_path / "empty.pdf").write_bytes(b"")
    (tmp_path / "corrupt.pdf").write_bytes(b"%PDF-1.7\n" + bytes(range(256)) * 4 + b"\n%%EOF\n")
    (tmp_path / "truncated.pdf").write_bytes(data[: len(data) // 2])
    (tmp_path / "notpdf.pdf").write_bytes(b"<html>not a pdf</html>")
    encrypted_pdf(tmp_path / "encrypted.pdf")
    expect = {"empty.pdf": "file is empty (0 bytes)",
              "corrupt.pdf": "the file is corrupt or has no pages and cannot be opened as a PDF",
              "truncated.pdf": "the file is truncated (no %%EOF marker at its end)",
              "notpdf.pdf": "not a PDF (no %PDF- header)",
              "encrypted.pdf": "the PDF is encrypted (password-protected); decrypt it first"}
    futs = {name: renderer.submit(RenderTask(str(tmp_path / name), 0)) for name in expect}
    for name, msg in expect.items():
        e = error_of(futs[name])
        assert e.stage == "input" and msg in e.message and name in e.message, str(e)
    # PDFium's error code is its last one: after the encrypted file, the others must still be
    # told apart (in one process, in any order)
    for name in ("encrypted.pdf", "corrupt.pdf", "encrypted.pdf", "truncated.pdf", "notpdf.pdf", "empty.pdf"):
        with pytest.raises(PageError) as e:
            count_pages(tmp_path / name)
        assert e.value.stage == "input" and expect[name] in e.value.message, str(e.value)
        assert ("password" in e.value.message.lower()) == (name == "encrypted.pdf")
    e = error_of(renderer.submit(RenderTask(str(synthetic_pdf), 2)))
    assert e.stage == "render" and "page 3 does not exist (the file has 2 pages)" in e.message
    # the pool is fine afterwards
    assert renderer.submit(RenderTask(str(synthetic_pdf), 0)).result(timeout=120).width == 1190


def png_claiming(width: int, height: int) -> bytes:
    """A tiny valid PNG whose header is rewritten to claim ``width`` x ``height`` (a bomb's header)."""
    buf = io.BytesIO()
    Image.new("L", (4, 4), 255).save(buf, format="PNG")
    data = bytearray(buf.getvalue())
    ihdr = data[12:29]                      # chunk type + 13 bytes of IHDR data
    ihdr[4:12] = struct.pack(">II", width, height)
    data[12:29] = ihdr
    data[29:33] = struct.pack(">I", zlib.crc32(bytes(ihdr)))
    return bytes(data)


def test_bomb_image_is_refused_before_decoding(renderer, tmp_path):
    bomb = tmp_path / "bomb.png"
    bomb.write_bytes(png_claiming(100_000, 100_000))
    with pytest.raises(PageError, match="possible decompression bomb"):
        count_pages(bomb)
    e = error_of(renderer.submit(RenderTask(str(bomb), 0)))
    assert e.stage == "input" and "decompression bomb" in e.message and "bomb.png" in e.message
    # an image over the task's own cap: refused with the sizes named
    big = tmp_path / "big.png"
    Image.new("RGB", (300, 200), (0, 0, 255)).save(big)
    e = error_of(renderer.submit(RenderTask(str(big), 0, max_pixels=50_000)))
    assert "300x200 = 60,000 pixels" in e.message and "decode cap of 50,000 pixels" in e.message
    page = renderer.submit(RenderTask(str(big), 0)).result(timeout=120)
    assert page.image.shape == (200, 300, 3) and (page.image[0, 0] == (0, 0, 255)).all()


def test_pdf_pages_over_the_pixel_cap_render_smaller(synthetic_pdf):
    page = render_page(RenderTask(str(synthetic_pdf), 0, max_pixels=200_000))
    assert page.width * page.height <= 200_000 and page.scale < 2.0
    assert abs(page.width / page.height - 1190 / 1684) < 0.01


def test_multi_page_tiff(renderer, tmp_path):
    colors = [(255, 0, 0), (0, 255, 0), (0, 0, 255)]
    frames = [Image.new("RGB", (40 + 10 * i, 30), c) for i, c in enumerate(colors)]
    tif = tmp_path / "scan.tiff"
    frames[0].save(tif, save_all=True, append_images=frames[1:])
    assert count_pages(tif) == 3
    pages = [renderer.submit(RenderTask(str(tif), i)).result(timeout=120) for i in range(3)]
    for i, page in enumerate(pages):
        assert (page.page_count, page.width, page.height) == (3, 40 + 10 * i, 30)
        assert (page.image[5, 5] == colors[i]).all()
    e = error_of(renderer.submit(RenderTask(str(tif), 3)))
    assert "page 4 does not exist (the file has 3 pages)" in e.message
    # each frame is checked against the cap on its own header
    e = error_of(renderer.submit(RenderTask(str(tif), 2, max_pixels=1_400)))
    assert "frame 3" in e.message and "60x30" in e.message


# ---- fault injection: these run in the worker processes (imported there by module name) ----

def faulty_render(task: RenderTask):
    name = Path(task.path).name
    if name.startswith("hang"):
        Path(task.path + ".started").touch()   # a test may wait for the worker to be in the page
        time.sleep(3600)
    if name.startswith("crash"):
        os._exit(3)                         # what a PDFium segfault looks like to the pool
    if name.startswith("raise"):
        raise RuntimeError("injected failure")
    return render_page(task)


def test_pool_survives_failing_crashing_and_hung_pages(tmp_path):
    ok = tmp_path / "ok.png"
    Image.new("RGB", (20, 10), (9, 9, 9)).save(ok)
    for name in ("hang.png", "crash.png", "raise.png"):
        (tmp_path / name).write_bytes(ok.read_bytes())
    with PageRenderer(workers=1, render_fn=faulty_render) as r:
        futs = [r.submit(RenderTask(str(tmp_path / name), 0, timeout_s=2.0))
                for name in ("raise.png", "ok.png", "crash.png", "ok.png", "hang.png", "ok.png")]
        e = error_of(futs[0])
        assert e.stage == "render" and "failed to render (RuntimeError: injected failure)" in e.message
        e = error_of(futs[2])
        assert "crashed the render worker (exit code 3)" in e.message and "crash.png" in e.message
        e = error_of(futs[4])
        assert "did not render within 2 s (its worker was killed and replaced)" in e.message
        for i in (1, 3, 5):
            assert futs[i].result(timeout=120).image.shape == (10, 20, 3)
        assert r.restarts == 2                  # the crash and the hang; a raise keeps its worker


def test_a_worker_that_cannot_start_fails_its_page_and_the_next_one_starts(tmp_path, monkeypatch):
    """Process.start raising (a daemonic caller may not have children) fails that page with the
    reason; the slot's thread lives on and starts a worker for the next page."""
    ok = tmp_path / "ok.png"
    Image.new("RGB", (20, 10), (9, 9, 9)).save(ok)
    import multiprocessing.process as mp_process
    real_start, calls = mp_process.BaseProcess.start, []

    def start_once_failing(self):
        calls.append(self.name)
        if len(calls) == 1:
            raise AssertionError("daemonic processes are not allowed to have children")
        return real_start(self)
    monkeypatch.setattr(mp_process.BaseProcess, "start", start_once_failing)
    with PageRenderer(workers=1) as r:
        e = error_of(r.submit(RenderTask(str(ok), 0)))
        assert e.stage == "render" and "not allowed to have children" in e.message
        assert r.submit(RenderTask(str(ok), 0)).result(timeout=120).image.shape == (10, 20, 3)
    assert len(calls) == 2


def test_submit_after_close_and_cancel_on_close(tmp_path):
    r = PageRenderer(workers=1)
    r.close()
    with pytest.raises(RuntimeError, match="closed"):
        r.submit(RenderTask(str(tmp_path / "x.png"), 0))
    with pytest.raises(ValueError, match="workers must be >= 1"):
        PageRenderer(workers=0)


def test_a_page_rendered_above_the_cap_is_refused(monkeypatch, synthetic_pdf):
    # the cap's own guard: with the scale computation broken on purpose, the check after
    # rendering still refuses the page
    from fastdeploy_ext.parsing import render
    monkeypatch.setattr(render, "pdf_scale", lambda w, h, dpi, cap: dpi / 72.0)
    with pytest.raises(PageError, match=r"rendered to 1190x1684 pixels, above the cap of 100,000"):
        render_page(RenderTask(str(synthetic_pdf), 0, max_pixels=100_000))


def test_page_error_shape():
    e = PageError("vlm", "block 3 failed")
    assert (e.stage, e.message, str(e)) == ("vlm", "block 3 failed", "vlm: block 3 failed")
    import pickle
    e2 = pickle.loads(pickle.dumps(e))
    assert (e2.stage, e2.message) == ("vlm", "block 3 failed")
    with pytest.raises(ValueError, match="unknown parse stage 'decode'"):
        PageError("decode", "x")


@pytest.mark.parametrize("kw,msg", [({"dpi": 0}, r"dpi must be an integer in \[1, 2400\], got 0"),
                                    ({"dpi": 72.0}, "dpi must be an integer"),
                                    ({"timeout_s": 0}, "timeout_s must be > 0"),
                                    ({"max_pixels": 0}, "max_pixels must be >= 1"),
                                    ({"page_index": -1}, "page_index must be >= 0")])
def test_render_task_values_are_checked(kw, msg):
    args = {"path": "x.pdf", "page_index": 0, **kw}
    with pytest.raises(ValueError, match=msg):
        RenderTask(**args)


@pytest.mark.parametrize("fmt,suffix", [("WEBP", ".webp"), ("JPEG", ".jpg"), ("BMP", ".bmp"), ("PNG", ".png")])
def test_single_image_formats(tmp_path, fmt, suffix):
    p = tmp_path / f"page{suffix}"
    img = Image.new("RGB", (64, 48), (250, 250, 250))
    img.paste((10, 10, 10), (8, 8, 40, 24))
    img.save(p, format=fmt, **({"lossless": True} if fmt == "WEBP" else {}))
    page = render_page(RenderTask(str(p), 0))
    assert (page.page_count, page.width, page.height, page.scale) == (1, 64, 48, 1.0)
    assert page.image[15, 20].max() < 40 and page.image[40, 60].min() > 200
    with pytest.raises(PageError, match=r"page 2 does not exist \(the file has 1 pages\)"):
        render_page(RenderTask(str(p), 1))


def test_a_pdf_without_pages(tmp_path):
    from pypdf import PdfWriter
    PdfWriter().write(tmp_path / "none.pdf")
    for call in (lambda: count_pages(tmp_path / "none.pdf"), lambda: render_page(RenderTask(str(tmp_path / "none.pdf"), 0))):
        with pytest.raises(PageError, match="none.pdf: the file is corrupt or has no pages") as e:
            call()
        assert e.value.stage == "input"


def test_pdfium_calls_in_one_process_are_serialised(monkeypatch, synthetic_pdf):
    import threading

    from fastdeploy_ext.parsing import render, sources

    class Recording:
        """The lock, counting the PDFium sections that take it."""
        def __init__(self):
            self.lock, self.entered = threading.RLock(), 0

        def __enter__(self):
            self.lock.acquire()
            self.entered += 1

        def __exit__(self, *exc):
            self.lock.release()

    rec = Recording()
    monkeypatch.setattr(sources, "PDFIUM_LOCK", rec)
    monkeypatch.setattr(render, "PDFIUM_LOCK", rec)
    results = []
    threads = [threading.Thread(target=lambda: results.append(
        (count_pages(synthetic_pdf), render_page(RenderTask(str(synthetic_pdf), 1)).height))) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == [(2, 1684)] * 4 and rec.entered == 8


def test_synthetic_mix_of_other_kinds_is_drawn_in_its_boxes(tmp_path):
    from fastdeploy_ext.parsing.synthetic import PlantedMix, planted_tokens
    mix = PlantedMix(kinds=(("image", 1, 600, 300), ("chart", 1, 600, 300), ("seal", 1, 200, 200), ("text", 1, 1000, 180)))
    doc = synthetic_document(1, seed=4, mix=mix)
    (tmp_path / "mix.pdf").write_bytes(doc.pdf)
    page = render_page(RenderTask(str(tmp_path / "mix.pdf"), 0))
    for b in doc.pages[0]:
        x0, y0, x1, y1 = (int(v) for v in b.bbox)
        crop = page.image[y0:y1, x0:x1]
        assert crop.min() < 128, b.label                    # something is drawn in every box
        chroma = int((crop.max(axis=2).astype(int) - crop.min(axis=2)).max())     # text is drawn in gray
        assert (chroma > 60) == (b.label in ("image", "chart", "seal")), (b.label, chroma)
    assert mix.blocks_per_page == 4
    assert [planted_tokens(x) for x in ("doc_title", "text", "table", "display_formula", "figure_title", "image")] == \
        [16, 120, 600, 60, 40, 120]


_ORPHAN_SCRIPT = """
import sys, time
from pathlib import Path
from fastdeploy_ext.parsing.render import PageRenderer, RenderTask
from tests.test_parse_render import faulty_render
r = PageRenderer(workers=1, render_fn=faulty_render)
fut = r.submit(RenderTask(sys.argv[1], 0, timeout_s=600))
started = Path(sys.argv[1] + ".started")
while not started.exists():
    time.sleep(0.05)
print(r._slots[0].proc.pid, flush=True)
time.sleep(600)
"""


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/status") as f:
            return "\nState:\tZ" not in f.read()         # a zombie is dead, waiting to be reaped
    except FileNotFoundError:
        return False


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads /proc (Linux)")
def test_a_killed_parent_takes_its_hung_worker_with_it(tmp_path):
    import signal
    import subprocess
    import sys
    hang = tmp_path / "hang.png"
    Image.new("RGB", (8, 8)).save(hang)
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    proc = subprocess.Popen([sys.executable, "-c", _ORPHAN_SCRIPT, str(hang)], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, text=True)
    try:
        worker = int(proc.stdout.readline())       # printed once the worker is in the hung page
        assert _alive(worker)
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
        deadline = time.monotonic() + 30
        while _alive(worker) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not _alive(worker)
    finally:
        if proc.poll() is None:
            proc.kill()


def test_synthetic_pages_drawn_in_processes_give_the_same_bytes():
    one = synthetic_document(3, seed=8)
    two = synthetic_document(3, seed=8, processes=2)
    assert one.pdf == two.pdf and one.pages == two.pages
    with pytest.raises(ValueError, match="processes must be >= 1"):
        synthetic_document(1, processes=0)
