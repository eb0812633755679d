"""The document-parsing job API of `serve`, driven by paddleocr 3.7's own API client, unmodified.

The client package (``paddleocr/_api_client``) is loaded from the ``paddleocr==3.7.0`` wheel
under a stub ``paddleocr`` package module: the wheel's ``paddleocr/__init__.py`` (which imports
paddlex and its ~420 MB of dependencies) never runs, the client's files are the wheel's bytes.
The server is the real one on loopback with tiny models (the shipped tiny PaddleOCR-VL, a tiny
random PP-DocLayoutV3) and a planted block mix per page (title, text, table, image), so every
page sends VLM blocks and has one Markdown image. The PDFs are read from ../shared/pdfs.
"""
from __future__ import annotations

import base64
import hashlib
import importlib
import json
import sys
import tempfile
import types
from pathlib import Path

import httpx
import pytest

from . import pp_doclayout_fixture as fx
from .server_harness import ServerProc, png_bytes

PDFS = Path(__file__).resolve().parents[1].parent / "shared" / "pdfs"
if not PDFS.is_dir():
    PDFS = Path("/work/shared/pdfs")
TOKEN = "job-api-test-key"
MIX = [{"label": "paragraph_title", "score": 0.9, "bbox": [0.1, 0.05, 0.9, 0.1]},
       {"label": "text", "score": 0.9, "bbox": [0.1, 0.15, 0.9, 0.4]},
       {"label": "table", "score": 0.9, "bbox": [0.1, 0.45, 0.9, 0.7]},
       {"label": "image", "score": 0.9, "bbox": [0.1, 0.75, 0.5, 0.95]}]


CLIENT_COPY = Path(__file__).parent / "data" / "paddleocr_client"


def _client_root() -> Path:
    """The directory holding ``paddleocr/_api_client/`` as the 3.7.0 wheel ships it (copies
    under tests/data/paddleocr_client/, checked against the wheel's RECORD lines)."""
    return CLIENT_COPY


def client_copy_mismatches() -> list[str]:
    """Files whose sha256 differs from the wheel's RECORD line (empty: unmodified copies)."""
    bad = []
    for line in (CLIENT_COPY / "RECORD").read_text().splitlines():
        rel, digest, _size = line.rsplit(",", 2)
        got = base64.urlsafe_b64encode(hashlib.sha256((CLIENT_COPY / rel).read_bytes()).digest()).rstrip(b"=").decode()
        if f"sha256={got}" != digest:
            bad.append(rel)
    return bad


def test_the_client_copies_are_the_wheels_files(tmp_path, monkeypatch):
    """Every file of the client package is listed and unmodified; an edited copy is caught."""
    listed = {line.rsplit(",", 2)[0] for line in (CLIENT_COPY / "RECORD").read_text().splitlines()}
    on_disk = {str(p.relative_to(CLIENT_COPY)) for p in (CLIENT_COPY / "paddleocr").rglob("*.py")}
    assert listed == on_disk and len(listed) == 16
    assert client_copy_mismatches() == []
    import shutil
    fake = tmp_path / "copy"
    shutil.copytree(CLIENT_COPY, fake)
    (fake / "paddleocr" / "_api_client" / "client.py").write_text("# edited\n")
    monkeypatch.setattr(sys.modules[__name__], "CLIENT_COPY", fake)
    assert client_copy_mismatches() == ["paddleocr/_api_client/client.py"]


@pytest.fixture(scope="module")
def api():
    """``paddleocr._api_client`` from the wheel, under a stub ``paddleocr`` package."""
    root = _client_root()
    saved = {k: v for k, v in sys.modules.items() if k == "paddleocr" or k.startswith("paddleocr.")}
    stub = types.ModuleType("paddleocr")
    stub.__path__ = [str(root / "paddleocr")]
    sys.modules["paddleocr"] = stub
    try:
        client = importlib.import_module("paddleocr._api_client.client")
        errors = importlib.import_module("paddleocr._api_client.errors")
        models = importlib.import_module("paddleocr._api_client.models")
        yield types.SimpleNamespace(Client=client.PaddleOCRClient, errors=errors, models=models)
    finally:
        for k in [k for k in sys.modules if k == "paddleocr" or k.startswith("paddleocr.")]:
            del sys.modules[k]
        sys.modules.update(saved)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("job_models")
    fx.write_model(root / "layout")
    (root / "planted.json").write_text(json.dumps({"mix": MIX}))
    return root


def server_args(models: Path, jobs_dir: Path, *extra: str) -> list[str]:
    return ["--jobs-dir", str(jobs_dir), "--layout-model", str(models / "layout"), "--planted-layouts",
            str(models / "planted.json"), "--max-new-tokens", "8", "--block-max-pixels", "12544",
            "--render-workers", "1", "--max-model-len", "1024", "--api-key", TOKEN,
            "--allowed-local-media-path", str(PDFS), *extra]


@pytest.fixture(scope="module")
def server(models, tmp_path_factory):
    srv = ServerProc(*server_args(models, tmp_path_factory.mktemp("jobs"), "--max-upload-bytes", str(1 << 20)))
    try:
        yield srv.wait_healthy()
    finally:
        srv.stop()


def client(api, srv, token=TOKEN):
    # the client's poller starts at 3 s and grows to 15 s; nothing here is timed by it
    return api.Client(token=token, base_url=srv.url, request_timeout=60, poll_timeout=600)


def pdf_pages(path: Path) -> int:
    import pypdfium2 as pdfium
    doc = pdfium.PdfDocument(str(path))
    try:
        return len(doc)
    finally:
        doc.close()


def check_pages(result, n: int, *, pdf: bool):
    assert len(result.pages) == n
    for i, page in enumerate(result.pages):
        rec = page.pruned_result
        assert rec["page_index"] == (i if pdf else None) or (not pdf and rec["page_index"] in (0, None))
        assert [b["block_label"] for b in rec["parsing_res_list"]] == ["paragraph_title", "text", "table", "image"]
        # the image block's crop, keyed by a bare file name the Markdown links to
        (name, url), = page.markdown_images.items()
        assert "/" not in name and name in page.markdown_text and url.startswith("http://127.0.0.1:")
    assert result.data_info["type"] == ("pdf" if pdf else "image")


# ------------------------------------------------------------------ the happy paths
def test_pdf_by_upload_and_by_file_url_and_an_image_parse_and_their_resources_save(api, server, tmp_path):
    pdf = PDFS / "skinnypage.pdf"
    n = pdf_pages(pdf)
    assert n == 2
    with client(api, server) as c:
        up = c.parse_document(file_path=str(pdf))
        check_pages(up, n, pdf=True)
        by_url = c.parse_document(file_url=str(pdf))
        # one pipeline, one document: the same pages whichever way it came
        assert [p.markdown_text for p in by_url.pages] == [p.markdown_text for p in up.pages]
        img = tmp_path / "scan.png"
        img.write_bytes(png_bytes(320, 240, seed=4))
        one = c.parse_document(file_path=str(img), model="PaddleOCR-VL-1.5")
        check_pages(one, 1, pdf=False)
        assert one.pages[0].pruned_result["width"] == 320 and one.pages[0].pruned_result["height"] == 240
        saved = c.save_document_parsing_result_resources(up, str(tmp_path))
    assert sorted(Path(p).name for p in saved) == sorted(name for p in up.pages for name in p.markdown_images)
    for p in saved:
        assert Path(p).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # the result links carry the job's secret: another secret is a 404 for the same job
    url = next(iter(up.pages[0].markdown_images.values()))
    parts = url.split("/")
    parts[-3] = "x" * len(parts[-3])
    assert httpx.get("/".join(parts), timeout=10).status_code == 404


def test_every_pdf_of_shared_pdfs_as_one_batch_gives_each_page_once(api, server):
    pdfs = sorted(PDFS.glob("*.pdf"))
    pages = [pdf_pages(p) for p in pdfs]
    assert sum(pages) == 31
    with client(api, server) as c:
        jobs = [c.submit_document_parsing(file_path=str(p), batch_id="all-pdfs") for p in pdfs]
        results = [c.wait_document_parsing_result(j) for j in jobs]
        batch = c.get_batch_status("all-pdfs")
        status = c.get_status(jobs[0].job_id)
    assert [j.job_id for j in batch.jobs] == [j.job_id for j in jobs]
    assert [j.state for j in batch.jobs] == ["done"] * len(pdfs)
    assert status.progress.total_pages == pages[0] and status.progress.extracted_pages == pages[0]
    assert status.result["jsonUrl"].startswith(server.url)
    for r, n in zip(results, pages):
        check_pages(r, n, pdf=True)
        assert [p.pruned_result["page_index"] for p in r.pages] == list(range(n))
    # /metrics counts them (this module's earlier jobs too: at least these two)
    assert server.metric("fastdeploy_ext:jobs_done_total") >= len(pdfs)
    assert server.metric("fastdeploy_ext:job_pages_total") >= 31
    assert server.metric("fastdeploy_ext:jobs_running") == 0


# ------------------------------------------------------------------ PaddleX's /layout-parsing
def test_paddlex_layout_parsing_answers_one_document_with_inline_images(server):
    import base64
    import requests
    pdf = PDFS / "skinnypage.pdf"
    # PaddleX serving's documented call: the file in base64, fileType 0 (PDF), options at the top
    payload = {"file": base64.b64encode(pdf.read_bytes()).decode("ascii"), "fileType": 0,
               "useDocOrientationClassify": False, "useDocUnwarping": False, "useChartRecognition": False}
    r = requests.post(server.url + "/layout-parsing", json=payload, headers={"Authorization": f"token {TOKEN}"},
                      timeout=120)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["errorCode"] == 0 and body["logId"]
    res = body["result"]
    assert res["dataInfo"]["type"] == "pdf" and res["dataInfo"]["numPages"] == 2 and len(res["dataInfo"]["pages"]) == 2
    assert [p["prunedResult"]["page_index"] for p in res["layoutParsingResults"]] == [0, 1]
    for page in res["layoutParsingResults"]:
        (name, b64), = page["markdown"]["images"].items()
        assert name in page["markdown"]["text"] and base64.b64decode(b64)[:4] == b"\x89PNG"
    # by URL (a local path under --allowed-local-media-path), fileType inferred
    r = requests.post(server.url + "/layout-parsing", json={"file": str(PDFS / "small_page_size.pdf")},
                      headers={"Authorization": f"Bearer {TOKEN}"}, timeout=120)
    assert r.status_code == 200 and len(r.json()["result"]["layoutParsingResults"]) == 1, r.text
    for bad, msg in (({"file": "%%% not base64"}, "neither a URL nor valid base64"),
                     ({"file": payload["file"], "fileType": 5}, "fileType: 5"),
                     ({"file": payload["file"], "fileType": 0, "topP": 0.5}, "topP=0.5")):
        r = requests.post(server.url + "/layout-parsing", json=bad, headers={"Authorization": f"token {TOKEN}"},
                          timeout=30)
        assert r.status_code == 400 and r.json()["errorCode"] == 400 and msg in r.json()["errorMsg"], r.text
    r = requests.post(server.url + "/layout-parsing", json=payload, timeout=30)          # no token
    assert r.status_code == 401 and r.json()["errorCode"] == 401


# ------------------------------------------------------------------ refusals
def test_a_corrupt_file_is_the_clients_failed_state_with_the_reason(api, server, tmp_path):
    bad = tmp_path / "broken.pdf"
    bad.write_bytes(b"%PDF-1.7\n this is no PDF at all\n")
    with client(api, server) as c:
        with pytest.raises(api.errors.JobFailedError) as e:
            c.parse_document(file_path=str(bad))
    assert e.value.error_msg and "input" in e.value.error_msg
    # the message names the job's input, never where the server keeps it
    assert "document.pdf" in e.value.error_msg or "broken.pdf" in e.value.error_msg, e.value.error_msg
    assert tempfile.gettempdir() not in e.value.error_msg, e.value.error_msg      # the jobs dir is a temp dir here


def test_a_wrong_token_is_the_clients_auth_error(api, server):
    with client(api, server, token="not-the-key") as c:
        with pytest.raises(api.errors.AuthError, match="access token"):
            c.submit_document_parsing(file_path=str(PDFS / "small_page_size.pdf"))
        with pytest.raises(api.errors.AuthError):
            c.get_status("0" * 32)


def test_other_models_unknown_options_and_unimplemented_features_are_400s_naming_them(api, server):
    m = api.models
    pdf = str(PDFS / "small_page_size.pdf")
    with client(api, server) as c:
        with pytest.raises(api.errors.InvalidRequestError, match="PP-StructureV3"):
            c.submit_document_parsing(model="PP-StructureV3", file_path=pdf)
        with pytest.raises(api.errors.InvalidRequestError, match="optionalPayload.noSuchKey: unknown option"):
            c.submit_document_parsing(file_path=pdf, options=m.PaddleOCRVLOptions(extra_options={"noSuchKey": 1}))
        with pytest.raises(api.errors.InvalidRequestError, match="useDocUnwarping.*unwarping is not implemented"):
            c.submit_document_parsing(file_path=pdf, options=m.PaddleOCRVLOptions(use_doc_unwarping=True))
        with pytest.raises(api.errors.InvalidRequestError, match="fileUrl"):
            c.submit_document_parsing(file_url="/etc/passwd")      # outside --allowed-local-media-path
    # over --max-upload-bytes (1 MiB here): 413 from the server, before the job exists
    r = httpx.post(server.url + "/api/v2/ocr/jobs", headers={"Authorization": f"Bearer {TOKEN}"},
                   files={"file": ("big.pdf", b"%PDF" + b"0" * (2 << 20))}, data={"model": "PaddleOCR-VL"}, timeout=30)
    assert r.status_code == 413 and r.json()["code"] != 0 and "--max-upload-bytes" in r.json()["msg"]


# kill -9 mid-job (several jobs running, each resumed, every page once): test_job_api_concurrent.py
