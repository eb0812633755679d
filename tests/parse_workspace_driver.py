"""Drives a parse Workspace with fake page results, the way a coordinator would: lease a few
pages, "parse" them (a random small sleep), commit or fail each. Deterministic outputs (content
is a function of the page key), random timing: the SIGKILL test kills it at random moments and
compares the directory with an uninterrupted run's.

    python tests/parse_workspace_driver.py OUT [--docs 4] [--pages 6] [--shards N] [--sleep-ms 8]

Prints one "commit <key>" line per page (flushed) so a test can pick its moment to kill.
"""
from __future__ import annotations

import argparse
import hashlib
import random
import time

from fastdeploy_ext.parsing.assemble import PageMeta, PageResult
from fastdeploy_ext.parsing.workspace import PageWork, Workspace

FINGERPRINT = {"vlm": "fake-vlm@1", "layout": "fake-layout@1", "dpi": 144}


def doc_inputs(n_docs: int, n_pages: int) -> list[tuple[str, str, list[int], int]]:
    """(path, digest, page_indices, page_count); every two documents share a file stem."""
    out = []
    for d in range(n_docs):
        path = f"/in/{'ab'[d % 2]}/doc{d // 2}.pdf"
        out.append((path, hashlib.sha256(f"doc {d}".encode()).hexdigest(), list(range(n_pages)), n_pages))
    return out


def fake_result(work: PageWork, tag: str = "") -> PageResult:
    h = hashlib.sha256(work.key.encode()).hexdigest()
    images = {}
    if work.page_index % 2 == 0:
        images[f"{work.image_prefix}_0.png"] = bytes.fromhex(h) * 40
    md = f"# {work.stem} page {work.page_index + 1}{tag}\n\nText {h[:24]} \u00e9t\u00e9.\n" + "".join(f"\n![]({n})\n" for n in images)
    record = {"input_path": work.path, "page_index": work.page_index, "page_count": work.page_count,
              "width": 1190, "height": 1684,
              "parsing_res_list": [{"block_label": "text", "block_content": h[:24] + tag,
                                    "block_bbox": [10, 20, 300, 40], "block_id": 0, "block_order": 0}]}
    return PageResult(PageMeta(work.path, work.page_index, work.page_count, 1190, 1684), md, record, images)


def fails(key: str) -> bool:
    """The pages the fake pipeline cannot parse: a function of the key, so every run agrees."""
    return int(hashlib.sha256(key.encode()).hexdigest(), 16) % 5 == 0


def run(out: str, n_docs: int, n_pages: int, shards: int | None, sleep_ms: float) -> None:
    rng = random.Random()
    with Workspace.open(out, fingerprint=FINGERPRINT, jsonl_shards=shards) as ws:
        for path, digest, pages, count in doc_inputs(n_docs, n_pages):
            ws.add_document(path, digest, pages, count)
        ws.add_input_error("/in/broken.pdf", "input", "not a PDF (no %PDF header)")
        while (lease := ws.grant("driver", max_pages=3, ttl_s=600)) is not None:
            for key in lease.keys:
                time.sleep(rng.random() * sleep_ms / 1000)
                if fails(key):
                    ws.fail(lease, key, "vlm", f"fake failure of {key}")
                else:
                    ws.commit(lease, key, fake_result(ws.work(key)))
                print("commit", key, flush=True)
    print("ALL DONE", flush=True)


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--docs", type=int, default=4)
    ap.add_argument("--pages", type=int, default=6)
    ap.add_argument("--shards", type=int, default=None)
    ap.add_argument("--sleep-ms", type=float, default=8.0)
    a = ap.parse_args()
    run(a.out, a.docs, a.pages, a.shards, a.sleep_ms)
