"""`serve`'s /ui page in a real headless Chromium (the distribution's package, driven over the
DevTools protocol: tests/cdp.py) against a tiny-model jobs server: a PDF from ../shared/pdfs
uploaded through the page's file input, every page shown with its picture, one box per block of
the job's JSON (hover: label, score, reading order) and its Markdown; a corrupt file, a file over
the upload limit, a full job queue and a wrong key show the API's own message.

Runs in the cpu/ui leg (ci/matrix.yaml), which installs Chromium with apt when it is missing; a
machine without Chromium skips it with the reason (the leg fails on a skip)."""
from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
from pathlib import Path

import httpx
import pytest

from . import pp_doclayout_fixture as fx
from .cdp import Browser, Page, find_browser, is_png
from .server_harness import ServerProc

PDFS = Path(__file__).resolve().parents[1].parent / "shared" / "pdfs"
if not PDFS.is_dir():
    PDFS = Path("/work/shared/pdfs")
REPO = Path(__file__).resolve().parents[1]
PDF = PDFS / "skinnypage.pdf"            # 2 pages
TOKEN = "ui-test-key"
UPLOAD_LIMIT = 1 << 20
#: a planted block mix per page (title, text, table, image): VLM blocks and one Markdown image
MIX = [{"label": "paragraph_title", "score": 0.91, "bbox": [0.1, 0.05, 0.9, 0.1]},
       {"label": "text", "score": 0.82, "bbox": [0.1, 0.15, 0.9, 0.4]},
       {"label": "table", "score": 0.73, "bbox": [0.1, 0.45, 0.9, 0.7]},
       {"label": "image", "score": 0.64, "bbox": [0.1, 0.75, 0.5, 0.95]}]

BROWSER = find_browser()
pytestmark = pytest.mark.skipif(BROWSER is None, reason="no Chromium here (apt-get install chromium; the cpu/ui "
                                                        "CI leg installs it)")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("ui")
    fx.write_model(root / "layout")
    (root / "planted.json").write_text(json.dumps({"mix": MIX}))
    srv = ServerProc("--jobs-dir", str(root / "jobs"), "--layout-model", str(root / "layout"), "--planted-layouts",
                     str(root / "planted.json"), "--max-new-tokens", "8", "--block-max-pixels", "12544",
                     "--render-workers", "1", "--max-model-len", "1024", "--api-key", TOKEN,
                     "--max-upload-bytes", str(UPLOAD_LIMIT), "--max-queued-jobs", "1")
    try:
        yield srv.wait_healthy()
    finally:
        srv.stop()


@pytest.fixture(scope="module")
def browser():
    b = Browser(BROWSER)
    try:
        yield b
    finally:
        b.close()


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 240))


async def open_ui(browser, server, key: str | None = TOKEN) -> Page:
    page = await Page.open(browser)
    await page.send("Emulation.setDeviceMetricsOverride", width=1280, height=1000, deviceScaleFactor=1, mobile=False)
    await page.goto(f"{server.url}/ui")
    if key is not None:
        await page.eval(f"(() => {{ const k = document.querySelector('#key'); k.value = {json.dumps(key)};"
                        f" k.dispatchEvent(new Event('input')); }})()")
    return page


async def upload(page: Page, path: Path) -> str:
    """Chooses the file in the page's file input; the page's state once it settled."""
    await page.eval("document.body.dataset.state = 'idle'")
    await page.set_files("#file", [str(path)])
    return await page.wait_for("['done', 'error'].includes(document.body.dataset.state) && document.body.dataset.state",
                               deadline_s=200)


SHOWN = """(() => [...document.querySelectorAll('.page')].map(sec => ({
  page: Number(sec.dataset.page),
  image: (() => { const i = sec.querySelector('.page-image img');
                  return i ? {loaded: i.complete && i.naturalWidth > 0, w: i.naturalWidth, h: i.naturalHeight,
                              src: i.getAttribute('src')} : null; })(),
  boxes: [...sec.querySelectorAll('.box')].map(b => ({label: b.dataset.label, order: Number(b.dataset.order),
          score: b.dataset.score === undefined ? null : Number(b.dataset.score),
          rect: (r => [r.left, r.top, r.width, r.height])(b.getBoundingClientRect())})),
  imageRect: (r => [r.left, r.top, r.width, r.height])(sec.querySelector('.page-image').getBoundingClientRect()),
  markdown: [...sec.querySelector('.markdown').children].map(el => ({tag: el.tagName, text: el.textContent,
          loaded: el.tagName === 'IMG' ? el.complete && el.naturalWidth > 0 : null})),
  links: [...sec.querySelectorAll('.page-head a')].map(a => a.className),
})))()"""


def expected_markdown(text: str) -> list[tuple[str, str | None]]:
    """What the page should show for the server's Markdown: per block its element and text."""
    out = []
    for chunk in (c.strip() for c in re.split(r"\n{2,}", text)):
        if not chunk:
            continue
        if m := re.match(r"(#{1,6}) (.*)$", chunk, re.S):
            out.append((f"H{min(6, len(m.group(1)) + 2)}", m.group(2)))
        elif chunk.startswith("!["):
            out.append(("IMG", ""))
        elif chunk.startswith("$$") and chunk.endswith("$$"):
            out.append(("PRE", chunk[2:-2].strip()))
        elif chunk.lower().startswith("<table"):
            out.append(("TABLE", None))
        else:
            out.append(("P", re.sub(r"\$([^$\n]+)\$", r"\1", chunk)))
    return out


def test_the_page_shows_every_page_with_its_boxes_and_markdown(server, browser, tmp_path):
    async def scenario():
        page = await open_ui(browser, server)
        try:
            assert await upload(page, PDF) == "done", await page.eval("document.querySelector('#error').textContent")
            await page.wait_for("[...document.images].every(i => i.complete)")     # pictures and crops loaded
            shown = await page.eval(SHOWN)
            jsonl_url = await page.eval("document.querySelector('a.dl-jsonl').href")
            # hover the first page's table box: the tip names its label, reading order and score
            table = next(b for b in shown[0]["boxes"] if b["label"] == "table")
            x, y, w, h = table["rect"]
            await page.hover(x + w / 2, y + h / 2)
            tip = await page.wait_for("document.querySelector('#tip').style.display === 'block' && "
                                      "document.querySelector('#tip').textContent")
            shot = await page.screenshot(tmp_path / "ui.png")
            # the model's text is shown, never run: a table keeps only table elements and spans,
            # other Markdown is text; formulas are text in their own element
            hostile = await page.eval("""(() => {
              window.pwned = 0;
              const md = markdownView({images: {}, text:
                '<table><tr><td colspan="2" onclick="pwned=1">a<img src=x onerror="pwned=1"></td></tr></table>\\n\\n' +
                '<img src=x onerror="pwned=1"> and $x^2$\\n\\n$$\\n\\\\frac{a}{b}\\n$$'});
              document.body.append(md);
              return new Promise(r => setTimeout(() => r({html: md.innerHTML, pwned: window.pwned}), 300));
            })()""")
            # the key is kept for the tab: a reload still has it
            await page.goto(f"{server.url}/ui")
            kept = await page.eval("document.querySelector('#key').value")
            return shown, jsonl_url, table, tip, shot, kept, hostile
        finally:
            await page.close()

    shown, jsonl_url, table, tip, shot, kept, hostile = run(scenario())
    assert hostile["pwned"] == 0
    assert hostile["html"] == ('<table><tbody><tr><td colspan="2">a</td></tr></tbody></table>'
                               '<p>&lt;img src=x onerror="pwned=1"&gt; and <span class="formula">x^2</span></p>'
                               '<pre class="formula">\\frac{a}{b}</pre>')
    lines = [json.loads(x) for x in httpx.get(jsonl_url, timeout=30).text.splitlines() if x.strip()]
    items = [it for line in lines for it in line["result"]["layoutParsingResults"]]
    assert len(items) == 2 and [p["page"] for p in shown] == [1, 2]
    for view, item in zip(shown, items):
        rec = item["prunedResult"]
        # its picture: the job's layout picture, loaded, at the page's size
        assert view["image"]["loaded"] and view["image"]["src"] == item["outputImages"]["layout_det_res"]
        assert (view["image"]["w"], view["image"]["h"]) == (rec["width"], rec["height"])
        # its boxes: one per block of the JSON, placed where the block's bbox is on the shown image
        blocks = rec["parsing_res_list"]
        assert len(view["boxes"]) == len(blocks) == len(MIX)
        ix, iy, iw, ih = view["imageRect"]
        sx, sy = iw / rec["width"], ih / rec["height"]
        for box, blk in zip(view["boxes"], blocks):
            assert box["label"] == blk["block_label"] and box["order"] == blk["block_id"] + 1
            x0, y0, x1, y1 = blk["block_bbox"]
            assert box["rect"] == pytest.approx([ix + x0 * sx, iy + y0 * sy, (x1 - x0) * sx, (y1 - y0) * sy], abs=2.5)
        assert [b["score"] for b in view["boxes"]] == [pytest.approx(m["score"]) for m in MIX]
        # its Markdown, block by block as the server wrote it; the image block's crop loaded
        md = view["markdown"]
        want = expected_markdown(item["markdown"]["text"])
        assert [m["tag"] for m in md] == [t for t, _ in want] and md
        for got, (tag, text) in zip(md, want):
            if text is not None and tag != "IMG":
                assert got["text"] == text
            if tag == "IMG":
                assert got["loaded"]
        assert view["links"] == ["dl-json", "dl-md"]
    assert "table" in tip and f"#{table['order']}" in tip and "score 0.730" in tip
    assert is_png(shot) == (1280, 1000)
    assert kept == TOKEN
    if os.environ.get("FDX_WRITE_DOC_IMAGES") == "1":        # refresh the README's screenshot
        shutil.copy(tmp_path / "ui.png", REPO / "docs" / "images" / "ui.png")


def _submit_error(server, name: str, data: bytes, token: str) -> str:
    """What the job API itself answers to this upload when it refuses it."""
    r = httpx.post(f"{server.url}/api/v2/ocr/jobs", files={"file": (name, data)},
                   headers={"Authorization": f"Bearer {token}"}, timeout=60)
    assert r.status_code != 200, r.text
    return f"HTTP {r.status_code}: {r.json()['msg']}"


def _job_error(server, job_id: str) -> str:
    """A job's errorMsg as its status reports it."""
    st = httpx.get(f"{server.url}/api/v2/ocr/jobs/{job_id}", headers={"Authorization": f"Bearer {TOKEN}"},
                   timeout=30).json()["data"]
    assert st["state"] == "failed", st
    return st["errorMsg"]


# "queue full" last: its blocking job is left running (the server's teardown stops it)
@pytest.mark.parametrize("case", ["corrupt", "too large", "wrong key", "queue full"])
def test_errors_are_shown_as_the_api_reports_them(server, browser, tmp_path, case):
    if case == "corrupt":
        path, key = tmp_path / "broken.pdf", TOKEN
        path.write_bytes(b"%PDF-1.7\n" + bytes(range(256)) * 8)
    elif case == "too large":
        path, key = tmp_path / "big.pdf", TOKEN
        path.write_bytes(b"%PDF-1.7\n" + b"0" * (UPLOAD_LIMIT + 1))
    elif case == "wrong key":
        path, key = PDF, "not-the-key"
    else:
        # the queue holds one job (--max-queued-jobs 1): a 14-page job takes it while the page uploads
        path, key = PDF, TOKEN
        r = httpx.post(f"{server.url}/api/v2/ocr/jobs", headers={"Authorization": f"Bearer {TOKEN}"}, timeout=60,
                       files={"file": ("long.pdf", (PDFS / "pdftotext_two_column_issue.pdf").read_bytes())})
        assert r.status_code == 200, r.text
    # a refused upload: the API's answer to the same request; a failed job: its errorMsg
    api_says = None if case == "corrupt" else _submit_error(server, path.name, path.read_bytes(), key)

    async def scenario():
        page = await open_ui(browser, server, key)
        try:
            state = await upload(page, path)
            return state, await page.eval("document.querySelector('#error').textContent"), \
                await page.eval("document.querySelectorAll('.page').length"), \
                await page.eval("document.body.dataset.job || null")
        finally:
            await page.close()

    state, error, pages, job = run(scenario())
    assert state == "error" and pages == 0
    if case == "corrupt":
        api_says = _job_error(server, job)
    else:
        assert job is None            # refused at submit: no job was made
    assert api_says and api_says in error, (api_says, error)
    hint = {"corrupt": "the job failed", "too large": "HTTP 413", "wrong key": "HTTP 401", "queue full": "HTTP 429"}[case]
    assert hint in error
