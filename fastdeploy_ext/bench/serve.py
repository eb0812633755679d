"""`fastdeploy-ext bench serve`: our OpenAI-compatible server and transformers' `generate` behind
the same request stream, in one run (issue 9 item 5; DESIGN.md section 7). Nothing asserts a time.

Both servers run as subprocesses on loopback ports (this module never imports entrypoints: ours
is started by module name, the reference is `bench/serve_reference.py`). Each request is one
page (a synthetic document PNG, default 1920x1080) with "OCR:", greedy, `ignore_eos`, exactly
--output-tokens new tokens (the output length is stated in every result), streamed so that the
time to first token is measured on the client. Workloads:
- single: requests one at a time: e2e latency and TTFT;
- 4x8: 4 clients, each sending 8 requests one after another: avg, P50, P95 of e2e and TTFT;
- c32: --c32-requests requests at 32 concurrency: requests/s and output tokens/s.

Every streamed request's inter-token gaps are measured on the client from the chunks' arrival
times (``token_gaps``: a chunk of k tokens is one gap plus k-1 zero gaps; the tokens per chunk from
the running usage each chunk carries when the server sends it, ``continuous_usage_stats``, else one
per chunk reconciled with the final usage total); each workload reports their P50/P95/P99 and the
max gap over all its requests. Gaps spanning another request's prefill are not told apart here:
the server exposes no step timestamps to a client, and with mixed steps a newcomer's first token
and a running request's next one leave the same step and reach the client in either order, so a
client-side guess would mislabel gaps (``bench generate --itl`` measures those inside the engine).
``--compare-server-args ARGS`` runs our server a second time with ARGS added (e.g. mixed steps
off, then on) and reports that side as ``ours_b`` with the ratios b / a.

- parse: document parsing through the job API (bench/serve_parse.py): ``--parse-jobs`` documents
  of ``--parse-pages`` synthetic pages posted at ``--parse-concurrency``, pages/s from the jobs'
  server-side timestamps, against the in-process `bench parse` figure on the same pages in the
  same run (one after the other: never both on the device at once). It runs alone.

``--base-url URL`` measures a server that is already running (ours or any OpenAI-compatible
one, e.g. vLLM's) with the same workloads instead of starting ours; ``--reference-url URL``
adds a second running server as the reference side. The model name sent is ``--model-name`` or
the first id of the server's ``GET /v1/models``.
"""
from __future__ import annotations

import argparse
import asyncio
import base64
import json
import logging
import os
import shlex
import statistics
import sys
import time
from dataclasses import dataclass, field
from functools import partial

from . import BenchError
from .server_proc import Server

log = logging.getLogger(__name__)

CHAT_WORKLOADS = ("single", "4x8", "c32")
WORKLOADS = CHAT_WORKLOADS + ("parse",)


@dataclass(frozen=True)
class ServeBenchOptions:
    model: str | None
    load_format: str
    device: str
    dtype: str
    server_args: tuple[str, ...]
    workloads: tuple[str, ...]
    output_tokens: int
    single_requests: int
    c32_requests: int
    image_size: tuple[int, int]
    reference: bool
    reference_max_batch: int
    json_out: str | None
    startup_timeout: float
    base_url: str | None = None          # measure this running server instead of starting ours
    reference_url: str | None = None     # a running reference server (with base_url)
    model_name: str | None = None        # `model` of the requests (running servers; default: /v1/models)
    compare_server_args: tuple[str, ...] | None = None   # a second run of ours with these flags added
    parse: object | None = None          # serve_parse.ParseWorkload (the parse workload)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="model dir (with tokenizer; the reference loads it too)")
    p.add_argument("--load-format", default="auto", choices=("auto", "safetensors", "dummy"),
                   help="dummy: random 0.9B weights (with the reference: written once to a temporary model dir "
                        "with a byte-level tokenizer, loaded by both sides)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    p.add_argument("--server-args", default="", help='more flags for our server, one string, e.g. '
                   '"--max-num-seqs 64 --gpu-memory-utilization 0.8"')
    p.add_argument("--workloads", "--workload", default=",".join(CHAT_WORKLOADS),
                   help=f"comma list of {', '.join(WORKLOADS)} (default: the chat ones; parse runs alone)")
    p.add_argument("--output-tokens", type=int, default=512, help="new tokens per request (ignore_eos)")
    p.add_argument("--single-requests", type=int, default=3)
    p.add_argument("--c32-requests", type=int, default=64)
    p.add_argument("--image-size", default="1920x1080", help="WxH of the synthetic page")
    p.add_argument("--no-reference", action="store_true", help="skip transformers")
    p.add_argument("--reference-max-batch", type=int, default=32, help="the reference's largest static batch")
    p.add_argument("--json-out", default=None)
    p.add_argument("--startup-timeout", type=float, default=900.0)
    p.add_argument("--base-url", default=None, metavar="URL",
                   help="measure this running OpenAI-compatible server (e.g. http://127.0.0.1:8000) instead of "
                        "starting ours; no reference side unless --reference-url")
    p.add_argument("--reference-url", default=None, metavar="URL", help="with --base-url: a running reference server")
    p.add_argument("--compare-server-args", default=None, metavar="ARGS",
                   help="run our server a second time with these flags added after --server-args (one string, "
                        'e.g. --server-args=--no-mixed-steps --compare-server-args=--mixed-steps: a single flag needs the '
                        '"=" form) and show '
                        "that side (ours_b) beside the first with ratios b/a")
    p.add_argument("--model-name", default=None,
                   help="`model` sent to a running server (default: the first id of its GET /v1/models)")
    from .serve_parse import add_arguments as add_parse_arguments
    add_parse_arguments(p)


def options_from_args(ns) -> ServeBenchOptions:
    wl = tuple(w for w in ns.workloads.split(",") if w)
    if set(wl) - set(WORKLOADS):
        raise BenchError(f"unknown workload(s) {sorted(set(wl) - set(WORKLOADS))}; choose from {', '.join(WORKLOADS)}")
    parse = None
    if "parse" in wl:
        from .serve_parse import workload_from_args
        if wl != ("parse",):
            raise BenchError("--workloads parse runs alone (its server has --jobs-dir and its reference is the "
                             "in-process bench parse); measure the chat workloads in another run")
        if ns.base_url:
            raise BenchError("--workloads parse starts our server (it times the jobs by the server's clock); "
                             "it cannot be used with --base-url")
        parse = workload_from_args(ns)
    try:
        w, h = (int(x) for x in ns.image_size.lower().split("x"))
    except ValueError:
        raise BenchError(f"--image-size must be WxH, got {ns.image_size!r}") from None
    if ns.reference_url and not ns.base_url:
        raise BenchError("--reference-url needs --base-url (both sides already running)")
    for flag, url in (("--base-url", ns.base_url), ("--reference-url", ns.reference_url)):
        if url and not url.startswith(("http://", "https://")):
            raise BenchError(f"{flag} must be an http(s) URL, got {url!r}")
    if ns.base_url is None and ns.load_format != "dummy" and not ns.model:
        raise BenchError("--model DIR is required (or --load-format dummy, which runs ours only; "
                         "or --base-url URL of a running server)")
    reference = bool(ns.reference_url) if ns.base_url else not ns.no_reference
    compare = getattr(ns, "compare_server_args", None)
    if compare is not None:
        if ns.base_url:
            raise BenchError("--compare-server-args starts our server twice; it cannot be used with --base-url")
        if not shlex.split(compare):
            raise BenchError("--compare-server-args is empty: give the flags the second run adds")
    for name in ("output_tokens", "single_requests", "c32_requests", "reference_max_batch"):
        if getattr(ns, name) < 1:
            raise BenchError(f"--{name.replace('_', '-')} must be >= 1")
    return ServeBenchOptions(model=ns.model, load_format=ns.load_format, device=ns.device, dtype=ns.dtype,
                             server_args=tuple(shlex.split(ns.server_args)), workloads=wl,
                             output_tokens=ns.output_tokens, single_requests=ns.single_requests,
                             c32_requests=ns.c32_requests, image_size=(w, h), reference=reference,
                             reference_max_batch=ns.reference_max_batch, json_out=ns.json_out,
                             startup_timeout=ns.startup_timeout, base_url=ns.base_url and ns.base_url.rstrip("/"),
                             reference_url=ns.reference_url and ns.reference_url.rstrip("/"),
                             model_name=ns.model_name,
                             compare_server_args=None if compare is None else tuple(shlex.split(compare)),
                             parse=parse)


# ------------------------------------------------------------------ servers
def our_server(o: ServeBenchOptions, log_dir: str, extra: tuple[str, ...] = (), name: str = "ours") -> Server:
    src = ["--load-format", "dummy"] if o.load_format == "dummy" else ["--model", o.model, "--load-format", o.load_format]
    cmd = [sys.executable, "-m", "fastdeploy_ext.entrypoints.openai.api_server", *src, "--device", o.device,
           "--dtype", o.dtype, "--host", "127.0.0.1", "--served-model-name", "bench", *o.server_args, *extra]
    return Server(name, cmd, os.path.join(log_dir, f"bench_serve_{name}.log"))


def reference_server(o: ServeBenchOptions, log_dir: str) -> Server:
    cmd = [sys.executable, "-m", "fastdeploy_ext.bench.serve_reference", "--model", o.model, "--device", o.device,
           "--dtype", o.dtype, "--max-batch", str(o.reference_max_batch)]
    return Server("transformers", cmd, os.path.join(log_dir, "bench_serve_reference.log"))


# ------------------------------------------------------------------ load generator
@dataclass
class Sample:
    ok: bool
    e2e_s: float
    ttft_s: float | None
    output_tokens: int
    error: str | None = None
    gaps_s: list[float] = field(default_factory=list)     # inter-token gaps (token_gaps)
    counts_from_usage: bool = False                        # every token chunk carried its running usage


def chunk_token_counts(cumulative: list[int | None], total: int | None) -> list[int]:
    """How many new tokens each token-bearing chunk of one stream held. ``cumulative``: per
    chunk, the running ``usage.completion_tokens`` it carried (vLLM's and ours'
    ``continuous_usage_stats``), or None. With every chunk's count known, those are used. Otherwise
    each chunk counts as one token, and the final usage total ``total`` reconciles: tokens it has
    beyond the chunks go to the last chunk (where they go does not matter: token_gaps gives the
    same multiset of gaps for any placement), chunks beyond it are dropped from the end (a finish
    chunk without a token of its own)."""
    if cumulative and all(c is not None for c in cumulative):
        counts, seen = [], 0
        for c in cumulative:
            counts.append(max(0, c - seen))
            seen = max(seen, c)
        return counts
    counts = [1] * len(cumulative)
    if total is None or not counts:
        return counts
    if total < len(counts):
        return counts[:total] + [0] * (len(counts) - total)
    counts[-1] += total - len(counts)
    return counts


def token_gaps(arrivals: list[float], counts: list[int]) -> list[float]:
    """Inter-token gaps of one stream, measured on the client from chunk arrival times: a chunk
    holding k tokens counts as one gap (since the previous token-bearing chunk) plus k-1 zero
    gaps, since its tokens reached the reader together. Spreading the wait over the k tokens
    instead would hide the stall a reader sees; the max gap stays exact this way. The first
    token has no gap (its wait is the TTFT); chunks with no token are skipped. Gives
    sum(counts) - 1 gaps."""
    gaps: list[float] = []
    prev = None
    for t, k in zip(arrivals, counts):
        if k <= 0:
            continue
        if prev is not None:
            gaps.append(max(0.0, t - prev))
        gaps.extend([0.0] * (k - 1))
        prev = t
    return gaps


async def _one(client, url: str, body: dict) -> Sample:
    t0 = time.perf_counter()
    ttft, tokens = None, 0
    arrivals: list[float] = []
    cumulative: list[int | None] = []
    try:
        async with client.stream("POST", url + "/v1/chat/completions", json=body) as r:
            if r.status_code != 200:
                return Sample(False, time.perf_counter() - t0, None, 0, f"HTTP {r.status_code}: {await r.aread()!r:.200}")
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                now = time.perf_counter()
                ev = json.loads(line[6:])
                usage = ev.get("usage") or None
                choices = ev.get("choices") or []
                # the first chunk with a choice: ours sends it when the first token exists (the
                # role chunk waits for it), the reference with its first token; random weights
                # often decode to empty text, so content is not required
                if choices and ttft is None:
                    ttft = now - t0
                # a token-bearing chunk: any choice chunk but the role announcement (OpenAI's
                # first chunk, no token of its own) and a usage-only one (no choices)
                if choices and "role" not in (choices[0].get("delta") or {}):
                    arrivals.append(now)
                    cumulative.append(usage["completion_tokens"] if usage else None)
                if usage:
                    tokens = usage["completion_tokens"]
    except Exception as e:  # noqa: BLE001 - a failed request is counted and reported, not fatal
        return Sample(False, time.perf_counter() - t0, None, 0, f"{type(e).__name__}: {e}")
    counts = chunk_token_counts(cumulative, tokens or None)
    return Sample(True, time.perf_counter() - t0, ttft, tokens, gaps_s=token_gaps(arrivals, counts),
                  counts_from_usage=bool(cumulative) and all(c is not None for c in cumulative))


def request_body(png: bytes, tokens: int, model: str = "bench", ours: bool = True) -> dict:
    """``ours``: the server is one this module started (ours or the reference), which take our
    extra field; a running server of unknown kind gets only OpenAI's fields and vLLM's
    ignore_eos and continuous_usage_stats (which vLLM, SGLang and FastDeploy accept)."""
    url = "data:image/png;base64," + base64.b64encode(png).decode()
    body = {"model": model, "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": "OCR:"}]}],
        "max_tokens": tokens, "temperature": 0, "ignore_eos": True, "stream": True,
        # continuous_usage_stats (vLLM's; SGLang and ours accept it): each chunk's running token
        # count, so a chunk holding several tokens is counted as such (chunk_token_counts)
        "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    if ours:
        # random weights repeat themselves: without this the repetition-loop guard ends requests
        # early (the H200 run's single requests stopped short of 512 tokens)
        body["repetition_guard"] = {"enabled": False}
    return body


_request_body = request_body


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, round(q / 100 * (len(xs) - 1))))]


def _summary(samples: list[Sample], wall: float, tokens: int) -> dict:
    ok = [s for s in samples if s.ok]
    e2e = [s.e2e_s for s in ok]
    ttft = [s.ttft_s for s in ok if s.ttft_s is not None]
    out = {"requests": len(samples), "failed": len(samples) - len(ok), "output_tokens_per_request": tokens,
           "wall_s": wall, "requests_per_s": len(ok) / wall if wall else None,
           "output_tokens_per_s": sum(s.output_tokens for s in ok) / wall if wall else None,
           "short_outputs": sum(s.output_tokens != tokens for s in ok)}
    for name, xs in (("e2e", e2e), ("ttft", ttft)):
        if xs:
            out[f"{name}_avg_s"] = statistics.fmean(xs)
            out[f"{name}_p50_s"] = _pct(xs, 50)
            out[f"{name}_p95_s"] = _pct(xs, 95)
    gaps = [g for s in ok for g in s.gaps_s]
    if gaps:
        # every request's gaps pooled (as vLLM's benchmark does): the percentiles are over tokens
        out["itl_gaps"] = len(gaps)
        for q in (50, 95, 99):
            out[f"itl_p{q}_ms"] = _pct(gaps, q) * 1e3
        out["itl_max_ms"] = max(gaps) * 1e3
        out["itl_token_counts"] = ("usage" if all(s.counts_from_usage for s in ok) else
                                   "chunks (one token each, the final usage total reconciling)")
    errors = [s.error for s in samples if not s.ok][:3]
    if errors:
        out["errors"] = errors
    return out


async def run_workload(url: str, name: str, pages: list[bytes], o: ServeBenchOptions, model: str = "bench",
                       ours: bool = True) -> dict:
    import httpx
    tokens = o.output_tokens
    request_body = partial(_request_body, model=model, ours=ours)
    limits = httpx.Limits(max_connections=64, max_keepalive_connections=64)
    async with httpx.AsyncClient(timeout=httpx.Timeout(3600.0), limits=limits) as client:
        await _one(client, url, request_body(pages[-1], 4))                   # warm-up
        t0 = time.perf_counter()
        if name == "single":
            samples = [await _one(client, url, request_body(pages[i % len(pages)], tokens))
                       for i in range(o.single_requests)]
        elif name == "4x8":
            async def worker(w):
                return [await _one(client, url, request_body(pages[(w * 8 + i) % len(pages)], tokens))
                        for i in range(8)]
            samples = [s for ws in await asyncio.gather(*[worker(w) for w in range(4)]) for s in ws]
        else:
            sem = asyncio.Semaphore(32)

            async def one(i):
                async with sem:
                    return await _one(client, url, request_body(pages[i % len(pages)], tokens))
            samples = await asyncio.gather(*[one(i) for i in range(o.c32_requests)])
        return _summary(samples, time.perf_counter() - t0, tokens)


def run_serve_bench(o: ServeBenchOptions, log_dir: str = ".") -> dict:
    import dataclasses
    import shutil
    if o.parse is not None:
        from .serve_parse import run_parse_bench
        return run_parse_bench(o, log_dir)
    if o.reference and o.model is None:
        tmp = write_random_model_dir()
        try:
            return run_serve_bench(dataclasses.replace(o, model=tmp, load_format="auto"), log_dir)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    from .generate import synthetic_png
    w, h = o.image_size
    n_pages = max(o.c32_requests, 32, o.single_requests)
    pages = [synthetic_png(20_000 + i, w, h, max(h // 27, 1)) for i in range(n_pages)]
    if o.base_url:
        return _measure_running(o, pages)
    report = {"device": o.device, "dtype": o.dtype, "model": o.model or "dummy", "image_size": f"{w}x{h}",
              "output_tokens_per_request": o.output_tokens, "server_args": list(o.server_args),
              "reference": "transformers generate, static batches of up to "
                           f"{o.reference_max_batch} concurrent requests" if o.reference else None,
              "compare_server_args": None if o.compare_server_args is None else list(o.compare_server_args),
              "workloads": {}}
    sides = [("ours", our_server)]
    if o.compare_server_args is not None:
        sides.append(("ours_b", partial(our_server, extra=o.compare_server_args, name="ours_b")))
    if o.reference:
        sides.append(("reference", reference_server))
    for side, start in sides:
        srv = start(o, log_dir)
        try:
            srv.wait_healthy(o.startup_timeout)
            for wl in o.workloads:
                res = asyncio.run(run_workload(srv.url, wl, pages, o))
                report["workloads"].setdefault(wl, {})[side] = res
                log.info("%s %s: %s", side, wl, json.dumps(res))
        finally:
            srv.stop()
    return _with_speedups(report)


def served_model_name(url: str) -> str:
    """The first model id a running OpenAI-compatible server lists."""
    import httpx
    try:
        r = httpx.get(url + "/v1/models", timeout=30)
        r.raise_for_status()
        return r.json()["data"][0]["id"]
    except (httpx.HTTPError, KeyError, IndexError, ValueError) as e:
        raise BenchError(f"{url}/v1/models: cannot read a model id ({type(e).__name__}: {e}); "
                         f"pass --model-name") from None


def _measure_running(o: ServeBenchOptions, pages: list[bytes]) -> dict:
    """The workloads against servers that are already running (--base-url, --reference-url)."""
    sides = [("ours", o.base_url)] + ([("reference", o.reference_url)] if o.reference_url else [])
    w, h = o.image_size
    report = {"device": "remote", "dtype": "remote", "model": None, "image_size": f"{w}x{h}",
              "output_tokens_per_request": o.output_tokens, "server_args": [], "base_url": o.base_url,
              "reference": o.reference_url, "workloads": {}}
    names = {}
    for side, url in sides:
        names[side] = o.model_name or served_model_name(url)
        for wl in o.workloads:
            res = asyncio.run(run_workload(url, wl, pages, o, model=names[side], ours=False))
            report["workloads"].setdefault(wl, {})[side] = res
            log.info("%s %s (%s): %s", side, wl, url, json.dumps(res))
    report["model"] = names["ours"]
    return _with_speedups(report)


#: the figures compared between our two server configurations (--compare-server-args), b / a
COMPARED = ("requests_per_s", "output_tokens_per_s", "ttft_p95_s", "e2e_p95_s", "itl_p50_ms", "itl_p99_ms",
            "itl_max_ms")


def compare_ratios(a: dict, b: dict) -> dict:
    """b / a for each figure both sides have (a zero or missing one is left out)."""
    return {k: b[k] / a[k] for k in COMPARED if a.get(k) and b.get(k) is not None}


def _with_speedups(report: dict) -> dict:
    for wl, r in report["workloads"].items():
        if "ours" in r and "ours_b" in r:
            r["ratios_b_over_a"] = compare_ratios(r["ours"], r["ours_b"])
        if "ours" in r and "reference" in r and r["reference"].get("requests_per_s"):
            r["speedup_requests_per_s"] = r["ours"]["requests_per_s"] / r["reference"]["requests_per_s"]
            if r["ours"].get("e2e_avg_s") and r["reference"].get("e2e_avg_s"):
                r["speedup_e2e_avg"] = r["reference"]["e2e_avg_s"] / r["ours"]["e2e_avg_s"]
    return report


def print_report(report: dict) -> None:
    if report.get("workload") == "parse":
        from .serve_parse import print_parse_report
        print_parse_report(report)
        return
    where = (f"server {report['base_url']}" if report.get("base_url") else
             f"device {report['device']} dtype {report['dtype']}")
    print(f"bench serve: {where} model {report['model']} "
          f"pages {report['image_size']}, {report['output_tokens_per_request']} output tokens per request (ignore_eos)")
    ref_label = "reference:   " if report.get("base_url") else "transformers:"

    def fmt(r):
        if r is None:
            return "n/a"
        s = f"{r['requests'] - r['failed']}/{r['requests']} ok, {r['requests_per_s']:.2f} req/s, " \
            f"{r['output_tokens_per_s']:.0f} out tok/s"
        if "e2e_avg_s" in r:
            s += f", e2e avg/P50/P95 {r['e2e_avg_s']:.3f}/{r['e2e_p50_s']:.3f}/{r['e2e_p95_s']:.3f} s"
        if "ttft_avg_s" in r:
            s += f", TTFT avg/P50/P95 {r['ttft_avg_s']:.3f}/{r['ttft_p50_s']:.3f}/{r['ttft_p95_s']:.3f} s"
        if "itl_max_ms" in r:
            s += (f", ITL P50/P95/P99/max {r['itl_p50_ms']:.1f}/{r['itl_p95_ms']:.1f}/{r['itl_p99_ms']:.1f}/"
                  f"{r['itl_max_ms']:.1f} ms")
        return s
    if report.get("compare_server_args") is not None:
        print(f"  ours_b = ours with {' '.join(report['compare_server_args'])} added")
    for wl, r in report["workloads"].items():
        print(f"  {wl:6s} ours:         {fmt(r.get('ours'))}")
        if "ours_b" in r:
            print(f"  {wl:6s} ours_b:       {fmt(r.get('ours_b'))}")
            print(f"  {wl:6s} ours_b / ours: " + ", ".join(f"{k} x{v:.2f}" for k, v in r["ratios_b_over_a"].items()))
        if "reference" in r:
            print(f"  {wl:6s} {ref_label} {fmt(r.get('reference'))}")
        if "speedup_requests_per_s" in r:
            print(f"  {wl:6s} ours / {ref_label.strip(': ')}: x{r['speedup_requests_per_s']:.2f} requests/s"
                  + (f", x{r['speedup_e2e_avg']:.2f} average e2e latency" if "speedup_e2e_avg" in r else ""))


def run_cli(ns) -> int:
    logging.getLogger("httpx").setLevel(logging.WARNING)      # one line per request otherwise
    o = options_from_args(ns)
    log_dir = os.path.dirname(os.path.abspath(o.json_out)) if o.json_out else os.getcwd()
    report = run_serve_bench(o, log_dir)
    print_report(report)
    if o.json_out:
        with open(o.json_out, "w") as f:
            json.dump(report, f, indent=1)
        print(f"wrote {o.json_out}")
    return 0 if all(r.get("failed", 0) == 0 for wr in report["workloads"].values()
                    for r in wr.values() if isinstance(r, dict)) else 1


def write_random_model_dir() -> str:
    """For --load-format dummy with the reference: random 0.9B weights saved once (both sides
    load the same dir) plus a byte-level tokenizer.json whose special tokens have config.json's
    ids (the built-in tokenizer's scheme, as a file transformers-free code and ours both read)
    and the released chat template."""
    import tempfile

    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PaddleOCRVLConfig, PaddleOCRVLForConditionalGeneration

    from ..models.registry import detect_family
    path = tempfile.mkdtemp(prefix="fdx-bench-serve-")
    torch.manual_seed(0)
    PaddleOCRVLForConditionalGeneration(PaddleOCRVLConfig()).eval().save_pretrained(path)
    family = detect_family(path).family
    specials = family.builtin_special_tokens(family.read_config(path))
    byte_chars = pre_tokenizers.ByteLevel.alphabet()
    taken = set(specials.values())
    ids = (i for i in range(3, 10 ** 6) if i not in taken)
    vocab = {c: next(ids) for c in sorted(byte_chars)}
    vocab.update(specials)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    from tokenizers import AddedToken
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])
    tok.save(os.path.join(path, "tokenizer.json"))
    with open(os.path.join(path, "chat_template.jinja"), "w") as f:
        f.write(family.default_chat_template())
    log.info("random 0.9B checkpoint with a byte-level tokenizer written to %s (both sides load it)", path)
    return path
