"""`fastdeploy-ext parse` end to end on the CPU with tiny models: the real PDFs of ../shared/pdfs,
bad inputs as error records, SIGKILL + rerun = every page once with the bytes of an
uninterrupted run, two workers = one, a stopped worker's expired lease redone elsewhere and its
late commit refused, the stub VLM, the command-line contract (DESIGN.md section 5).

The VLM is the shipped tiny PaddleOCR-VL (conformance/reference_data/tiny_vl), the layout model a
tiny random PP-DocLayoutV3 (tests/pp_doclayout_fixture.py). With random layout weights the boxes
of real pages mean little, so the runs that must exercise the VLM plant a small block mix
(--planted-layouts: the layout model still runs for its cost, its boxes are replaced).
"""
from __future__ import annotations

import dataclasses
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from . import pp_doclayout_fixture as fx
from .server_harness import tiny_vl

PDFS = Path(__file__).resolve().parents[1].parent / "shared" / "pdfs"
if not PDFS.is_dir():
    PDFS = Path("/work/shared/pdfs")
REPO = Path(__file__).resolve().parents[1]

#: a small planted mix for every page (fractions of the page): a title, a paragraph, a table
MIX = [{"label": "paragraph_title", "score": 0.9, "bbox": [0.1, 0.05, 0.9, 0.1]},
       {"label": "text", "score": 0.9, "bbox": [0.1, 0.15, 0.9, 0.4]},
       {"label": "table", "score": 0.9, "bbox": [0.1, 0.45, 0.9, 0.8]}]


@pytest.fixture(scope="session")
def layout_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_layout")
    fx.write_model(path)
    return path


@pytest.fixture(scope="session")
def synthetic_pdf(tmp_path_factory):
    """A 4-page synthetic PDF (parsing/synthetic.py) and the planted layouts file: its pages'
    planted blocks, MIX for every other page."""
    from fastdeploy_ext.parsing.synthetic import PlantedMix, synthetic_document
    root = tmp_path_factory.mktemp("synthetic")
    mix = PlantedMix(kinds=(("doc_title", 1, 900, 60), ("text", 2, 1000, 180), ("table", 1, 1000, 400),
                            ("display_formula", 1, 500, 80), ("image", 1, 300, 200)))
    doc = synthetic_document(4, seed=5, mix=mix)
    pdf = root / "report.pdf"
    pdf.write_bytes(doc.pdf)
    w, h = doc.spec.width, doc.spec.height
    pages = [[{"label": d["label"], "score": d["score"],
               "bbox": [d["bbox"][0] / w, d["bbox"][1] / h, d["bbox"][2] / w, d["bbox"][3] / h]}
              for d in doc.detections(i)] for i in range(4)]
    layout = root / "planted.json"
    layout.write_text(json.dumps({"pages": {pdf.name: pages}, "mix": MIX}))
    return pdf, layout


def base_args(layout_dir, planted=None, *extra) -> list[str]:
    """The CLI flags of every run here (the in-process parser below has the same options)."""
    return ["--model", str(tiny_vl()), "--layout-model", str(layout_dir), "--device", "cpu", "--dtype", "float32",
            "--max-new-tokens", "8", "--kv-cache-memory", "32MiB", "--max-model-len", "1024",
            "--block-max-pixels", "12544", "--render-workers", "1",
            *(["--planted-layouts", str(planted)] if planted else []), *extra]


@pytest.fixture(scope="session")
def parser(layout_dir, synthetic_pdf):
    """One DocumentParser (models loaded once) with the options of base_args(layout_dir, planted):
    the same workspace fingerprint as the CLI's runs, so either can resume the other's."""
    from fastdeploy_ext import DocumentParser
    from fastdeploy_ext.entrypoints.cli import build_parser
    from fastdeploy_ext.entrypoints.parse_cmd import parse_options_from_args
    ns = build_parser().parse_args(["parse", "x", "--output", "unused", *base_args(layout_dir, synthetic_pdf[1])])
    with DocumentParser(parse_options_from_args(ns, output=None)) as p:
        yield p


def run_parse(parser, inputs, out: Path) -> int:
    """A run in this process through the shared parser; the CLI's exit status rule."""
    for _ in parser.parse(inputs, output=out):
        pass
    st = parser.workspace_status
    return 3 if st.failed or st.pending or st.input_errors else 0


def cli(args: list[str], **kw) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    return subprocess.run([sys.executable, "-m", "fastdeploy_ext.entrypoints.cli", *map(str, args)], env=env,
                          capture_output=True, text=True, timeout=240, **kw)


def status(out: Path) -> dict:
    from fastdeploy_ext.parsing.status import workspace_status
    st = workspace_status(out)
    return {"done": st.done, "failed": st.failed, "pending": st.pending, "input_errors": st.input_errors}


def outputs(root: Path) -> dict[str, bytes]:
    """Every output file (pages, documents, crops) by relative path; the workspace's own state
    (manifest, logs, lock) left out."""
    out = {}
    for p in sorted(root.rglob("*")):
        rel = p.relative_to(root).as_posix()
        if p.is_file() and (rel.endswith((".md", ".json", ".png")) and not rel.startswith(".")
                            and "manifest" not in rel):
            out[rel] = p.read_bytes()
    return out


def page_files(root: Path) -> list[str]:
    return sorted(p.name for p in root.glob("*_[0-9][0-9][0-9][0-9].json"))


def errors(root: Path) -> list[dict]:
    f = root / "errors.jsonl"
    return [json.loads(line) for line in f.read_text().splitlines() if line.strip()] if f.exists() else []


def pdf_pages(path: Path) -> int:
    import pypdfium2 as pdfium
    doc = pdfium.PdfDocument(str(path))
    try:
        return len(doc)
    finally:
        doc.close()


# ------------------------------------------------------------------ the real PDFs
def test_every_real_pdf_parses_with_markdown_and_json_per_page(tmp_path, parser):
    pdfs = sorted(PDFS.glob("*.pdf"))
    expected = {(p.stem, i) for p in pdfs for i in range(pdf_pages(p))}
    assert len(expected) == 31
    out = tmp_path / "out"
    assert run_parse(parser, [PDFS], out) == 0
    assert errors(out) == []
    got = set()
    for p in pdfs:
        for i in range(pdf_pages(p)):
            stem = f"{p.stem}_{i + 1:04d}"
            rec = json.loads((out / f"{stem}.json").read_text())
            assert rec["input_path"] == str(p) and rec["page_index"] == i and rec["page_count"] == pdf_pages(p)
            labels = [b["block_label"] for b in rec["parsing_res_list"]]
            assert labels == ["paragraph_title", "text", "table"], (stem, labels)
            assert rec["width"] > 0 and rec["height"] > 0
            assert (out / f"{stem}.md").is_file()
            got.add((p.stem, i))
        assert (out / f"{p.stem}.md").is_file()         # the document's Markdown once all its pages are in
    assert got == expected
    assert status(out) == {"done": 31, "failed": 0, "pending": 0, "input_errors": 0}


# ------------------------------------------------------------------ bad inputs
def _bad_inputs(root: Path) -> dict[str, Path]:
    import io

    from PIL import Image
    from pypdf import PdfWriter
    root.mkdir()
    corrupt = root / "corrupt.pdf"
    corrupt.write_bytes(b"%PDF-1.7\n1 0 obj << /Type /Catalog >>\ngarbage without xref\n")
    empty = root / "empty.pdf"
    empty.write_bytes(b"")
    enc = root / "encrypted.pdf"
    w = PdfWriter()
    w.add_blank_page(200, 200)
    w.encrypt("secret")
    with open(enc, "wb") as f:
        w.write(f)
    # a PNG whose header claims 40000 x 40000 pixels (a decompression bomb): refused before decoding
    buf = io.BytesIO()
    Image.new("RGB", (8, 8), "white").save(buf, format="PNG")
    data = bytearray(buf.getvalue())
    import struct
    import zlib
    ihdr = struct.pack(">IIBBBBB", 40000, 40000, 8, 2, 0, 0, 0)
    data[16:29] = ihdr
    data[29:33] = struct.pack(">I", zlib.crc32(b"IHDR" + ihdr))
    bomb = root / "bomb.png"
    bomb.write_bytes(bytes(data))
    good = root / "good.png"
    Image.new("RGB", (200, 160), (250, 250, 250)).save(good)
    return {"corrupt": corrupt, "empty": empty, "encrypted": enc, "bomb": bomb, "good": good}


def test_bad_inputs_are_error_records_and_the_run_finishes(tmp_path, parser):
    _bad_inputs(tmp_path / "in")
    out = tmp_path / "out"
    assert run_parse(parser, [tmp_path / "in"], out) == 3       # the documented status: some pages failed
    errs = {Path(e["file"]).stem: e for e in errors(out)}
    assert set(errs) == {"corrupt", "empty", "encrypted", "bomb"}, errs
    for e in errs.values():
        assert e["stage"] in ("input", "render") and e["message"], e
    assert "password" in errs["encrypted"]["message"].lower() or "encrypt" in errs["encrypted"]["message"].lower()
    assert page_files(out) == ["good_0001.json"]
    assert status(out) == {"done": 1, "failed": 0, "pending": 0, "input_errors": 4}


# ------------------------------------------------------------------ exactly once, resumable
@pytest.fixture(scope="session")
def reference_run(tmp_path_factory, parser, synthetic_pdf):
    """The synthetic document parsed once, uninterrupted, in one process: its output bytes."""
    out = tmp_path_factory.mktemp("ref") / "out"
    assert run_parse(parser, [synthetic_pdf[0]], out) == 0
    files = outputs(out)
    assert page_files(out) == [f"report_{i:04d}.json" for i in range(1, 5)]
    rec = json.loads(files["report_0001.json"])
    kinds = {b["block_label"] for b in rec["parsing_res_list"]}
    assert {"doc_title", "text", "table", "image"} <= kinds
    assert any(name.startswith("imgs/") for name in files)      # the image block's crop, linked from the page
    return files


def _start(args, env_extra=None) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO), **(env_extra or {})}
    return subprocess.Popen([sys.executable, "-m", "fastdeploy_ext.entrypoints.cli", *map(str, args)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_sigkill_mid_run_then_rerun_gives_every_page_once_with_the_same_bytes(tmp_path, layout_dir, synthetic_pdf,
                                                                               parser, reference_run):
    pdf, layout = synthetic_pdf
    out = tmp_path / "out"
    proc = _start(["parse", pdf, "--output", out, *base_args(layout_dir, layout, "--max-pages-in-flight", "1")])
    deadline = time.monotonic() + 110

    def done() -> int:
        try:
            return status(out)["done"]
        except (OSError, ValueError):      # the workspace is not created yet
            return 0
    while done() < 1 and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)          # the test watches the workspace; the pipeline itself never polls
    assert proc.poll() is None, "the run ended before it could be killed"
    proc.send_signal(signal.SIGKILL)       # anywhere: maybe inside the next page's commit
    proc.communicate(timeout=30)
    killed_at = done()
    assert 1 <= killed_at < 4, killed_at
    seen = []
    for o in parser.parse([pdf], output=out):              # the rerun (same options: same fingerprint)
        seen.append(o.job.work.page_index)
    assert len(seen) == 4 - killed_at                     # done pages are skipped, the others done once
    assert outputs(out) == reference_run
    assert status(out) == {"done": 4, "failed": 0, "pending": 0, "input_errors": 0}


def test_two_workers_on_one_manifest_give_the_bytes_of_one(tmp_path, layout_dir, synthetic_pdf, reference_run):
    pdf, layout = synthetic_pdf
    out = tmp_path / "out"
    r = cli(["parse", pdf, "--output", out, "--workers", "2", "--lease-pages", "1", "--max-pages-in-flight", "2",
             *base_args(layout_dir, layout)])
    assert r.returncode == 0, r.stderr[-3000:]
    assert {"worker-0", "worker-1"} == set(re.findall(r"-> (worker-\d)", r.stderr))    # both got pages
    assert "refused" not in r.stderr and "expired" not in r.stderr
    assert outputs(out) == reference_run
    assert status(out) == {"done": 4, "failed": 0, "pending": 0, "input_errors": 0}


def _children(pid: int) -> list[int]:
    """Every descendant of ``pid`` (Linux /proc), deepest first."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                found += _children(int(entry.name)) + [int(entry.name)]
    return found


def test_a_stopped_workers_expired_lease_is_redone_and_its_late_commit_refused(tmp_path, layout_dir, synthetic_pdf,
                                                                                reference_run):
    """--workers 2 with one page per lease; worker 0 stops itself (SIGSTOP) before its first
    commit: its lease expires, worker 1 redoes those pages, and when worker 0 is continued its
    late commit is refused by the fencing token. The bytes are those of one process."""
    pdf, layout = synthetic_pdf
    out = tmp_path / "out"
    proc = _start(["parse", pdf, "--output", out, "--workers", "2", "--lease-pages", "1", "--lease-ttl", "3",
                   "--max-pages-in-flight", "2",
                   *base_args(layout_dir, layout)], env_extra={"FDX_PARSE_TEST_STOP_WORKER": "0"})
    lines: list[str] = []
    expired = threading.Event()

    def read():
        for line in proc.stderr:
            lines.append(line)
            if "expired" in line and "worker-0" in line:
                expired.set()
    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        # the worker stops with half a message in its pipe: the coordinator must not hang on it
        assert expired.wait(110), "".join(lines)[-3000:]
        pid = int(re.search(r"worker 0 \(pid (\d+)\): stopping itself", "".join(lines)).group(1))
        os.kill(pid, signal.SIGCONT)          # the stale worker wakes up and sends the rest of its result
        proc.wait(timeout=110)
    finally:
        if proc.poll() is None:               # a failed check leaves no run (or its stopped worker) behind
            for child in _children(proc.pid):
                os.kill(child, signal.SIGKILL)
            proc.kill()
            proc.wait(timeout=30)
    reader.join(timeout=10)
    log = "".join(lines)
    assert proc.returncode == 0, log[-3000:]
    assert re.search(r"refused a stale commit of page \S+ from worker-0", log), log[-3000:]
    assert {"worker-0", "worker-1"} <= set(re.findall(r"-> (worker-\d)", log))
    assert outputs(out) == reference_run
    assert status(out) == {"done": 4, "failed": 0, "pending": 0, "input_errors": 0}


# ------------------------------------------------------------------ stub VLM, the contract
def test_stub_vlm_runs_the_cpu_stages_alone(tmp_path, layout_dir, synthetic_pdf):
    from fastdeploy_ext import DocumentParser
    pdf, layout = synthetic_pdf
    with DocumentParser(stub_vlm=True, layout_model=str(layout_dir), device="cpu", dtype="float32",
                        planted_layouts=str(layout), render_workers=1, pages="2-3") as p:
        outs = list(p.parse(pdf))                         # no workspace: pages only yielded
    assert sorted(o.job.work.page_index for o in outs) == [1, 2] and all(o.error is None for o in outs)
    rec = outs[0].result.record
    texts = {b["block_label"]: b["block_content"] for b in rec["parsing_res_list"]}
    assert texts["text"] == "stub" and texts["image"] == ""
    assert not (tmp_path / "out").exists()


def test_the_cli_contract_names_outputs_after_the_input_and_rejects_bad_flags(tmp_path, layout_dir, synthetic_pdf,
                                                                              reference_run, capsys):
    from fastdeploy_ext.entrypoints.cli import main
    pdf, layout = synthetic_pdf
    out = tmp_path / "out"
    assert main(["parse", str(pdf), "--output", str(out), "--pages", "1", "--formats", "json", "--jsonl-shards", "2",
                 "--json-progress", *base_args(layout_dir, layout)]) == 0
    progress = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert progress[-1]["event"] == "done" and progress[-1]["done"] == 1 and progress[-1]["total"] == 1
    lines = [json.loads(line) for f in sorted(out.glob("*.jsonl")) if f.name != "errors.jsonl"
             for line in f.read_text().splitlines()]
    ref = json.loads(reference_run["report_0001.json"])
    assert len(lines) == 1 and {k: lines[0][k] for k in ref} == ref       # the page's PaddleX record itself
    assert lines[0]["input_path"].endswith("report.pdf") and "markdown" not in lines[0]
    assert (out / "errors.jsonl").exists()
    assert main(["parse-status", str(out), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["done"] == 1
    # the same workspace with other options: refused, saying what differs, nothing written
    assert main(["parse", str(pdf), "--output", str(out), "--pages", "1", "--formats", "json", "--jsonl-shards", "2",
                 "--dpi", "100", *base_args(layout_dir, layout)]) == 2
    assert "dpi" in capsys.readouterr().err
    for bad, what in ((["--formats", "xml"], "formats"), (["--pages", "3-1"], "3-1"),
                      (["--workers", "0"], "workers")):
        assert main(["parse", str(pdf), "--output", str(tmp_path / "bad"), *bad, *base_args(layout_dir)]) == 2
        err = capsys.readouterr().err
        assert what in err and err.count("error:") == 1, err[-1000:]
    assert main(["parse", str(tmp_path / "missing.pdf"), "--output", str(tmp_path / "bad"), *base_args(layout_dir)]) == 2
    assert "missing.pdf" in capsys.readouterr().err
    assert not (tmp_path / "bad").exists()               # nothing was started for a usage error


# ------------------------------------------------------------------ bench parse
def test_bench_parse_runs_ours_and_the_paddlex_style_baseline_on_one_engine(parser):
    from fastdeploy_ext.bench.parse import BenchParseOptions, run
    report = run(parser.options, BenchParseOptions(pages=2, warmup_pages=0), models=parser._build())
    assert report["pages"] == 2 and "planted" in report["source"]
    for r in (report["ours"], report["baseline"]):
        assert r["pages"] == 2 and r["failed"] == 0, r["errors"]
        assert r["blocks_per_s"] > 0 and r["output_tokens_per_s"] > 0 and r["peak_rss_bytes"] > 0
        assert r["gpu_busy_pct"] is None                       # no NVML on the CPU: not made up
        st = r["stages_s"]
        assert {"render_s", "layout_s", "prefill_s", "decode_s", "assemble_s", "idle_s"} <= set(st)
        assert st["layout_s"] > 0 and st["prefill_s"] > 0 and st["decode_s"] > 0
    assert report["ratio"] == pytest.approx(report["ours"]["pages_per_s"] / report["baseline"]["pages_per_s"])


def test_bench_parse_with_random_vlm_weights_decodes_each_blocks_planted_length(parser):
    # random weights seldom emit EOS: each block's length is fixed by its kind instead (here capped
    # by --max-new-tokens 8), on both sides, so the two runs decode the same work
    from fastdeploy_ext.bench.parse import BenchParseOptions, run
    from fastdeploy_ext.parsing.pipeline import Pipeline
    from fastdeploy_ext.parsing.synthetic import PLANTED_TOKENS
    opts = dataclasses.replace(parser.options, load_format="dummy")
    report = run(opts, BenchParseOptions(pages=1, warmup_pages=0), models=parser._build())
    assert "planted length" in report["source"]
    for r in (report["ours"], report["baseline"]):
        assert r["blocks"] > 0 and r["output_tokens"] == 8 * r["blocks"], r
    task = type("T", (), {"block": type("B", (), {"label": "table"})()})()
    pipe = Pipeline.__new__(Pipeline)
    pipe.opts = dataclasses.replace(opts.pipeline_options(), max_new_tokens=4096, planted_decode=True)
    sp = pipe._params(task)
    assert (sp.max_tokens, sp.min_tokens, sp.ignore_eos, sp.repetition_guard.enabled) == (
        PLANTED_TOKENS["table"], PLANTED_TOKENS["table"], True, False)
    pipe.opts = dataclasses.replace(pipe.opts, planted_decode=False)
    assert (pipe._params(task).max_tokens, pipe._params(task).ignore_eos) == (4096, False)


def test_bench_parse_command_with_the_stub_vlm_and_real_pdfs(layout_dir, capsys):
    from fastdeploy_ext.entrypoints.cli import main
    assert main(["bench", "parse", "--pdf", str(PDFS), "--pages", "2", "--stub-vlm", "--json", "--no-baseline",
                 "--warmup-pages", "0", "--layout-model", str(layout_dir), "--device", "cpu", "--dtype", "float32",
                 "--render-workers", "1"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["stub_vlm"] and report["baseline"] is None and report["pages"] == 2
    assert "real PDFs" in report["source"] and "planted mix" in report["source"]   # it says where boxes come from
    assert report["ours"]["pages"] == 2 and report["ours"]["blocks_per_s"] > 0
