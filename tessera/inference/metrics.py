"""`GET /metrics`: the server's counters, gauges and histograms in Prometheus's text format.

prometheus-client keeps and renders them. The names are vLLM's (vllm/v1/metrics/loggers.py,
PrometheusStatLogger) with a `tessera:` prefix for `vllm:`, so a vLLM dashboard works once its
queries name the other prefix; docs/inference.md lists them with their vLLM equivalents. The
engine's state (running, waiting, KV blocks, preemptions, CUDA graph captures) is read when
scraped; request timings are observed as outputs reach the event loop. Each app has a registry
of its own.
"""

from __future__ import annotations

from typing import Iterator

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from starlette.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

PREFIX = "tessera:"
# From a GPU's decode step (milliseconds) to a long queue (minutes).
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                   10.0, 20.0, 40.0, 80.0, 160.0, 640.0)
TOKEN_GAP_BUCKETS = (0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3,
                     0.5, 1.0, 2.5, 5.0)


class EngineCollector:
    """The engine's state when scraped (rank 0's engine under tensor parallelism)."""

    def __init__(self, engine):
        self.engine = engine

    def collect(self) -> Iterator:
        scheduler, cache = self.engine.scheduler, self.engine.cache
        usable = cache.num_blocks - 1   # block 0 is the null block
        used = usable - cache.allocator.num_free
        captures, capture_seconds = self.engine.runner.graph_captures()
        yield GaugeMetricFamily(PREFIX + "num_requests_running", "Requests in the running batch",
                                value=len(scheduler.running))
        yield GaugeMetricFamily(PREFIX + "num_requests_waiting", "Requests admitted, waiting for the running batch",
                                value=len(scheduler.waiting))
        yield GaugeMetricFamily(PREFIX + "kv_cache_usage_perc", "Fraction of KV-cache blocks in use (1 = all)",
                                value=used / usable)
        yield GaugeMetricFamily(PREFIX + "kv_cache_blocks_used", "KV-cache blocks in use", value=used)
        yield CounterMetricFamily(PREFIX + "num_preemptions", "Requests preempted (to be recomputed) so far",
                                  value=scheduler.preemptions)
        yield CounterMetricFamily(PREFIX + "cuda_graph_captures", "CUDA graphs captured (warm-up included)",
                                  value=captures)
        yield CounterMetricFamily(PREFIX + "cuda_graph_capture_seconds", "Host seconds the captures took",
                                  value=capture_seconds)


class ServerMetrics:
    """What the routes observe, and the engine's state, in one registry."""

    def __init__(self, engine):
        self.registry = CollectorRegistry()
        registry = self.registry
        self.http_requests = Counter(PREFIX + "http_requests", "HTTP requests answered, by route and status",
                                     ["route", "status"], registry=registry)
        self.prompt_tokens = Counter(PREFIX + "prompt_tokens", "Prompt tokens admitted (once per choice)",
                                     registry=registry)
        self.generation_tokens = Counter(PREFIX + "generation_tokens", "Tokens generated", registry=registry)
        self.request_success = Counter(PREFIX + "request_success", "Engine requests finished, by reason "
                                       "(stop, length, abort)", ["finished_reason"], registry=registry)
        self.time_to_first_token = Histogram(PREFIX + "time_to_first_token_seconds", "Admission to first token",
                                             buckets=LATENCY_BUCKETS, registry=registry)
        self.inter_token_latency = Histogram(PREFIX + "inter_token_latency_seconds", "Time between two tokens of "
                                             "a request", buckets=TOKEN_GAP_BUCKETS, registry=registry)
        self.e2e_request_latency = Histogram(PREFIX + "e2e_request_latency_seconds", "Admission to last token",
                                             buckets=LATENCY_BUCKETS, registry=registry)
        registry.register(EngineCollector(engine))

    def output(self, started: float, previous: float | None, now: float, tokens: int,
               finish_reason: str | None) -> None:
        """One engine output of a request admitted at `started`, whose previous output came at `previous`."""
        if tokens:
            self.generation_tokens.inc(tokens)
            if previous is None:
                self.time_to_first_token.observe(now - started)
            else:   # a burst of greedy steps shares the gap out
                for _ in range(tokens):
                    self.inter_token_latency.observe((now - previous) / tokens)
        if finish_reason is not None:
            self.request_success.labels(finish_reason).inc()
            self.e2e_request_latency.observe(now - started)

    def response(self) -> Response:
        return Response(generate_latest(self.registry), media_type=CONTENT_TYPE_LATEST)


class CountResponses:
    """ASGI middleware: every answer counted by route (an unknown path is `other`) and status."""

    def __init__(self, app: ASGIApp, metrics: ServerMetrics, routes: frozenset[str]):
        self.app, self.counter, self.routes = app, metrics.http_requests, routes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        route = scope["path"] if scope["path"] in self.routes else "other"
        started = False

        async def counting_send(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
                self.counter.labels(route, str(message["status"])).inc()
            await send(message)

        try:
            await self.app(scope, receive, counting_send)
        except Exception:
            if not started:   # answered 500 by Starlette's outermost middleware
                self.counter.labels(route, "500").inc()
            raise
