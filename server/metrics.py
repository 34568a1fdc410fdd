"""Prometheus metrics for GET /metrics: an LLMEngine stat logger over a private registry.

The names and buckets are vLLM's (vllm/v1/metrics/loggers.py PrometheusStatLogger,
checked by vLLM's tests/entrypoints/openai/test_metrics.py) with `kiln:` for
`vllm:`. Each app owns one CollectorRegistry, so two servers in one process never
share a series. record() runs on the engine thread; prometheus_client's metric
objects lock internally, so the /metrics handler reads them from the event loop.
"""
from __future__ import annotations

from typing import Optional

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from kiln.runtime.core.scheduler_stats import SchedulerStats
from kiln.runtime.engine.stats import IterationStats
from kiln.server.base_handler import BaseHandler

TTFT_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0]
ITL_BUCKETS = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
               40.0, 80.0]
LATENCY_BUCKETS = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                   240.0, 480.0, 960.0, 1920.0, 7680.0]
FINISH_REASONS = ("stop", "length", "abort")


def build_1_2_5_buckets(max_value: int) -> list[int]:
    """1, 2, 5, 10, 20, 50, ... up to max_value (vLLM build_1_2_5_buckets)."""
    out, exp = [], 0
    while True:
        for m in (1, 2, 5):
            v = m * 10 ** exp
            if v > max_value:
                return out
            out.append(v)
        exp += 1


class PrometheusStatLogger:
    def __init__(self, model_name: str, *, max_model_len: int, max_num_batched_tokens: Optional[int] = None,
                 cache_info: Optional[dict[str, str]] = None, registry: Optional[CollectorRegistry] = None) -> None:
        self.registry = registry or CollectorRegistry(auto_describe=True)
        labels = ["model_name"]
        r = self.registry
        lv = {"model_name": model_name}

        def gauge(name, doc):
            return Gauge(name, doc, labels, registry=r, multiprocess_mode="mostrecent").labels(**lv)

        def counter(name, doc):
            return Counter(name, doc, labels, registry=r).labels(**lv)

        def histogram(name, doc, buckets):
            return Histogram(name, doc, labels, buckets=buckets, registry=r).labels(**lv)

        self.running = gauge("kiln:num_requests_running", "Number of requests in model execution batches.")
        self.waiting = gauge("kiln:num_requests_waiting", "Number of requests waiting to be processed.")
        self.kv_usage = gauge("kiln:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.")
        self.state_usage = gauge("kiln:state_slot_usage_perc",
                                 "Hybrid models: Gated DeltaNet state slots in use (the KV cache's second group). "
                                 "1 means 100 percent usage; 0 for models without one.")
        self.prefix_queries = counter("kiln:prefix_cache_queries",
                                      "Prefix cache queries, in terms of number of queried tokens.")
        self.prefix_hits = counter("kiln:prefix_cache_hits",
                                   "Prefix cache hits, in terms of number of cached tokens.")
        self.preemptions = counter("kiln:num_preemptions", "Cumulative number of preemptions from the engine.")
        self.prompt_tokens = counter("kiln:prompt_tokens", "Number of prefill tokens processed.")
        self.generation_tokens = counter("kiln:generation_tokens", "Number of generation tokens processed.")
        success = Counter("kiln:request_success", "Count of successfully processed requests.",
                          labels + ["finished_reason"], registry=r)
        self.success = {reason: success.labels(model_name=model_name, finished_reason=reason)
                        for reason in FINISH_REASONS}
        token_buckets = build_1_2_5_buckets(max_model_len)
        self.req_prompt_tokens = histogram("kiln:request_prompt_tokens", "Number of prefill tokens processed.",
                                           token_buckets)
        self.req_generation_tokens = histogram("kiln:request_generation_tokens",
                                               "Number of generation tokens processed.", token_buckets)
        self.req_max_tokens = histogram("kiln:request_params_max_tokens",
                                        "Histogram of the max_tokens request parameter.", token_buckets)
        self.req_n = histogram("kiln:request_params_n", "Histogram of the n request parameter.", [1, 2, 5, 10, 20])
        iteration_buckets = [1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384]
        if max_num_batched_tokens:
            iteration_buckets = [b for b in iteration_buckets if b <= max_num_batched_tokens] or [1]
        self.iteration_tokens = histogram("kiln:iteration_tokens_total", "Histogram of number of tokens per "
                                          "engine_step.", iteration_buckets)
        self.ttft = histogram("kiln:time_to_first_token_seconds", "Histogram of time to first token in seconds.",
                              TTFT_BUCKETS)
        self.itl = histogram("kiln:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.",
                             ITL_BUCKETS)
        self.tpot = histogram("kiln:request_time_per_output_token_seconds",
                              "Histogram of time_per_output_token_seconds per request.", ITL_BUCKETS)
        self.e2e = histogram("kiln:e2e_request_latency_seconds",
                             "Histogram of e2e request latency in seconds.", LATENCY_BUCKETS)
        if cache_info:
            info = Gauge("kiln:cache_config_info", "Information of the LLMEngine CacheConfig",
                         list(cache_info), registry=r, multiprocess_mode="mostrecent")
            info.labels(**cache_info).set(1)

    def record(self, scheduler_stats: SchedulerStats, iteration_stats: IterationStats) -> None:
        """Called by the engine after every step (and once when it goes idle)."""
        s = scheduler_stats
        self.running.set(s.num_running_reqs)
        self.waiting.set(s.num_waiting_reqs)
        self.kv_usage.set(s.kv_cache_usage)
        self.state_usage.set(s.state_usage)
        self.prefix_queries.inc(s.prefix_cache_stats.queries)
        self.prefix_hits.inc(s.prefix_cache_stats.hits)
        self.preemptions.inc(s.num_preemptions)
        it = iteration_stats
        self.prompt_tokens.inc(it.num_prompt_tokens)
        self.generation_tokens.inc(it.num_generation_tokens)
        if it.num_scheduled_tokens:
            self.iteration_tokens.observe(it.num_scheduled_tokens)
        for t in it.time_to_first_tokens:
            self.ttft.observe(t)
        for t in it.inter_token_latencies:
            self.itl.observe(t)
        for f in it.finished_requests:
            reason = f.finish_reason if f.finish_reason in self.success else "abort"
            self.success[reason].inc()
            self.e2e.observe(f.e2e_latency)
            self.req_prompt_tokens.observe(f.num_prompt_tokens)
            self.req_generation_tokens.observe(f.num_generation_tokens)
            self.req_n.observe(f.n)
            if f.max_tokens is not None:
                self.req_max_tokens.observe(f.max_tokens)
            if f.tpot is not None:
                self.tpot.observe(f.tpot)

    def exposition(self) -> bytes:
        return generate_latest(self.registry)


class MetricsHandler(BaseHandler):
    """GET /metrics: Prometheus text format (no auth, as vLLM)."""

    def get(self) -> None:
        self.set_header("Content-Type", CONTENT_TYPE_LATEST)
        self.write(self.state.metrics.exposition())
