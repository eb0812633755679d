"""Prometheus metrics: FastDeploy's names where FastDeploy has the metric (``fastdeploy:*``,
so existing dashboards work), ``fastdeploy_ext:*`` for the rest.

One `ServerMetrics` per app, on its own `CollectorRegistry` (no process-global state). Request
metrics are observed by the chat handler; engine state (queue depth, running sequences, KV
usage, encoder cache, graph hits/fallbacks) is read from `engine.stats()` at scrape time, so it is never stale
and never double-counted."""
from __future__ import annotations

from typing import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0, 640.0)
TOKEN_GAP_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
TOKEN_COUNT_BUCKETS = (1, 4, 16, 64, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768)

# request outcomes, the `status` label of fastdeploy_ext:requests_total
STATUSES = ("ok", "bad_request", "unauthorized", "not_found", "too_large", "queue_full", "timeout",
            "cancelled", "unavailable", "error")


class _EngineCollector:
    """Engine gauges and counters, read from ``stats_fn()`` when scraped."""

    def __init__(self, stats_fn: Callable[[], object | None]):
        self.stats_fn = stats_fn

    def describe(self):
        return []   # no registration-time collect (the engine may not exist yet)

    def collect(self):
        s = self.stats_fn()
        if s is None:
            return
        g = lambda name, doc, v: GaugeMetricFamily(name, doc, value=float(v))  # noqa: E731
        yield g("fastdeploy:num_requests_running", "Number of requests currently running", s.num_running)
        yield g("fastdeploy:num_requests_waiting", "Number of requests currently waiting (queue depth)", s.num_waiting)
        yield g("fastdeploy:gpu_cache_usage_perc", "KV-cache usage of the device (1 = 100%)", s.kv_usage)
        yield g("fastdeploy:available_gpu_block_num", "Free KV-cache blocks", s.kv_blocks_total - s.kv_blocks_used)
        yield g("fastdeploy_ext:kv_blocks_total", "KV-cache blocks in the pool", s.kv_blocks_total)
        yield g("fastdeploy_ext:kv_blocks_used", "KV-cache blocks in use", s.kv_blocks_used)
        yield g("fastdeploy_ext:num_requests_preprocessing", "Requests in the preprocessing worker pool",
                s.num_preprocessing)
        yield g("fastdeploy_ext:encoder_cache_rows_total", "Embedding rows the encoder cache holds "
                "(--encoder-cache-size)", s.encoder_cache_rows_total)
        yield g("fastdeploy_ext:encoder_cache_rows_used", "Encoder cache rows reserved or holding vision output now",
                s.encoder_cache_rows_used)
        counters = (("graph_hits", "Decode steps that replayed a captured decoder graph"),
                    ("graph_fallbacks", "Decode steps that ran eagerly (no captured batch size fits)"),
                    ("encoder_graph_hits", "Packed vision passes replayed from a captured encoder graph"),
                    ("encoder_graph_fallbacks", "Images encoded eagerly (no captured token budget fits)"),
                    ("num_preemptions", "Sequences preempted (recomputed later) for lack of KV blocks"),
                    ("preprocess_s", "Seconds spent preprocessing requests (worker pool, summed)"),
                    ("vision_s", "Seconds spent in vision encoder passes"),
                    ("vision_passes", "Vision encoder passes"),
                    ("encoder_items_encoded", "Multimodal items encoded into the encoder cache"),
                    ("encoder_items_evicted", "Encoder cache items dropped before their last prefill chunk "
                                              "(preemption, abort, failure)"))
        for attr, doc in counters:
            name = {"preprocess_s": "preprocess_seconds", "vision_s": "vision_seconds",
                    "graph_hits": "decoder_graph_hits", "graph_fallbacks": "decoder_graph_fallbacks"}.get(attr, attr)
            c = CounterMetricFamily(f"fastdeploy_ext:{name}", doc)
            c.add_metric([], float(getattr(s, attr)))
            yield c


class ServerMetrics:
    def __init__(self, stats_fn: Callable[[], object | None], model_name: str):
        self.registry = r = CollectorRegistry(auto_describe=False)
        labels = {"labelnames": ["model_name"]}
        self.requests_number = Counter("fastdeploy:requests_number", "Total number of received requests",
                                       registry=r, **labels)
        self.request_success = Counter("fastdeploy:request_success", "Number of successfully processed requests",
                                       registry=r, **labels)
        self.requests_by_status = Counter("fastdeploy_ext:requests", "Finished requests by outcome",
                                          ["status"], registry=r)
        self.ttft = Histogram("fastdeploy:time_to_first_token_seconds", "Time to first token (from arrival)",
                              buckets=LATENCY_BUCKETS, registry=r, **labels)
        self.tpot = Histogram("fastdeploy:time_per_output_token_seconds", "Time between consecutive output tokens",
                              buckets=TOKEN_GAP_BUCKETS, registry=r, **labels)
        self.e2e = Histogram("fastdeploy:e2e_request_latency_seconds", "End-to-end request latency",
                             buckets=LATENCY_BUCKETS, registry=r, **labels)
        self.prompt_tokens = Counter("fastdeploy:prompt_tokens", "Prompt tokens processed", registry=r, **labels)
        self.generation_tokens = Counter("fastdeploy:generation_tokens", "Tokens generated", registry=r, **labels)
        self.request_prompt_tokens = Histogram("fastdeploy:request_prompt_tokens", "Prompt tokens per request",
                                               buckets=TOKEN_COUNT_BUCKETS, registry=r, **labels)
        self.request_generation_tokens = Histogram("fastdeploy:request_generation_tokens",
                                                   "Generated tokens per request", buckets=TOKEN_COUNT_BUCKETS,
                                                   registry=r, **labels)
        self.max_tokens_param = Histogram("fastdeploy:request_params_max_tokens", "max_tokens of requests",
                                          buckets=TOKEN_COUNT_BUCKETS, registry=r, **labels)
        self.preprocess = Histogram("fastdeploy_ext:preprocess_time_seconds",
                                    "Image decode + resize + patchify + tokenization per request",
                                    buckets=LATENCY_BUCKETS, registry=r)
        self.vision = Histogram("fastdeploy_ext:vision_encode_time_seconds",
                                "Vision encoder time of the step that encoded the request's images",
                                buckets=LATENCY_BUCKETS, registry=r)
        self.inflight = Gauge("fastdeploy_ext:server_requests_in_flight",
                              "Chat requests admitted by the server and not yet answered (running + waiting)",
                              registry=r)
        r.register(_EngineCollector(stats_fn))
        self.model_name = model_name
        for st in STATUSES:          # every outcome visible from the start (0), not after its first event
            self.requests_by_status.labels(st)
        for m in (self.requests_number, self.request_success, self.prompt_tokens, self.generation_tokens):
            m.labels(model_name)

    def outcome(self, status: str) -> None:
        self.requests_by_status.labels(status).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
