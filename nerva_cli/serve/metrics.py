"""GET /metrics: Prometheus's text format through prometheus_client, on a registry of the
server's own (not the process-wide default, which a host program may fill with its own)."""

from __future__ import annotations

from typing import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

# from a few ms (a small model's token on a GPU) to a minute (a long prompt on a slow CPU)
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
TPOT_BUCKETS = (0.002, 0.005, 0.01, 0.02, 0.04, 0.08, 0.15, 0.3, 0.6, 1.2, 2.5, 5.0)


class Metrics:
    """Updated from the workers' threads (prometheus_client's metrics are thread-safe); the
    gauges are read from the scheduler when scraped, so they are never stale."""

    content_type = CONTENT_TYPE_LATEST

    def __init__(self, running: Callable[[], int], waiting: Callable[[], int],
                 prompt_cache_bytes: Callable[[], int] = lambda: 0):
        r = self.registry = CollectorRegistry()
        Gauge("nerva_requests_running", "Requests on an engine slot now", registry=r).set_function(running)
        Gauge("nerva_requests_waiting", "Requests waiting for a slot (or for their model to load) now",
              registry=r).set_function(waiting)
        Gauge("nerva_prompt_cache_bytes", "Bytes of prompt chunks' KV rows the loaded models' prompt caches hold now",
              registry=r).set_function(prompt_cache_bytes)
        self.rejected = Counter("nerva_requests_rejected", "Requests refused with 503 because the queue was full",
                                registry=r)
        self.prompt_tokens = Counter("nerva_prompt_tokens", "Prompt tokens prefilled", registry=r)
        self.prefix_cache_hit_tokens = Counter(
            "nerva_prefix_cache_hit_tokens",
            "Prompt tokens an engine's cache or its prompt cache already held, so not prefilled again",
            registry=r)
        self.generated_tokens = Counter("nerva_generated_tokens", "Tokens generated", registry=r)
        self.ttft = Histogram("nerva_time_to_first_token_seconds",
                              "From a request's arrival to its first token (queueing and loading included)",
                              buckets=TTFT_BUCKETS, registry=r)
        self.tpot = Histogram("nerva_time_per_output_token_seconds",
                              "Between a request's consecutive tokens, as its client sees them", buckets=TPOT_BUCKETS,
                              registry=r)

    def exposition(self) -> bytes:
        return generate_latest(self.registry)
