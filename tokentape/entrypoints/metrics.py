"""The server's Prometheus metrics (`/metrics`), in a registry of its own: building a server
registers nothing process-wide.

Under vLLM's names (`vllm:*`, with its `model_name` label), so vLLM's dashboards and alerts
read them unchanged; the few vLLM has no name for are `tokentape:*`. No metric is served
under both."""

from __future__ import annotations

import bisect
import time
from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest
from prometheus_client.metrics_core import CounterMetricFamily, HistogramMetricFamily

from tokentape.engine.core.messages import SchedulerStats

_LATENCY_BUCKETS = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
)


class ServerMetrics:
    def __init__(self, model_name: str, stats: Callable[[], SchedulerStats]) -> None:
        r = self.registry = CollectorRegistry()
        labels = {"model_name": model_name}

        def gauge(name: str, doc: str, value: Callable[[], float]) -> None:
            Gauge(name, doc, list(labels), registry=r).labels(**labels).set_function(value)

        gauge(
            "vllm:num_requests_running",
            "Number of requests in model execution batches.",
            lambda: stats().num_running,
        )
        gauge(
            "vllm:num_requests_waiting",
            "Number of requests waiting to be processed.",
            lambda: stats().num_waiting,
        )
        gauge(
            "vllm:kv_cache_usage_perc",
            "KV-cache usage. 1 means 100 percent usage.",
            lambda: stats().kv_cache_usage,
        )
        ScrapedCounter(
            "vllm:num_preemptions",
            "Cumulative number of preemptions from the engine.",
            model_name,
            lambda: stats().num_preemptions,
            r,
        )
        gauge(
            "tokentape:is_paused", "1 while generation is paused.", lambda: float(stats().is_paused)
        )
        gauge("tokentape:engine_step", "Engine steps scheduled so far.", lambda: stats().step)
        self.finished = Counter(
            "vllm:request_success",
            "Count of successfully processed requests, by finish reason.",
            ["model_name", "finished_reason"],
            registry=r,
        )
        self.prompt_tokens = Counter(
            "vllm:prompt_tokens",
            "Number of prefill tokens processed (of finished requests).",
            list(labels),
            registry=r,
        ).labels(**labels)
        self.generation_tokens = Counter(
            "vllm:generation_tokens",
            "Number of generation tokens processed (of finished requests).",
            list(labels),
            registry=r,
        ).labels(**labels)
        self.ttft = LatencyHistogram(
            "vllm:time_to_first_token_seconds",
            "Histogram of time to first token in seconds.",
            model_name,
            r,
        )
        self.itl = LatencyHistogram(
            "vllm:inter_token_latency_seconds",
            "Histogram of inter-token latency in seconds (between a stream's outputs).",
            model_name,
            r,
        )
        self.e2e = LatencyHistogram(
            "vllm:e2e_request_latency_seconds",
            "Histogram of e2e request latency in seconds.",
            model_name,
            r,
        )
        self.errors = Counter(
            "tokentape:http_errors", "Error responses, by status.", ["status"], registry=r
        )
        self.model_name = model_name

    def render(self) -> bytes:
        return generate_latest(self.registry)


class ScrapedCounter:
    """A Prometheus counter whose value is read at scrape time (the engine core counts)."""

    def __init__(
        self,
        name: str,
        doc: str,
        model_name: str,
        value: Callable[[], float],
        registry: CollectorRegistry,
    ) -> None:
        self.name, self.doc, self.model_name, self.value = name, doc, model_name, value
        registry.register(self)

    def collect(self) -> Iterator[CounterMetricFamily]:
        family = CounterMetricFamily(self.name, self.doc, labels=["model_name"])
        family.add_metric([self.model_name], self.value())
        yield family


class LatencyHistogram:
    """A Prometheus histogram observed once per stream output, so kept cheap: plain counts
    (the event loop is the only writer), read by the registry at scrape time.
    prometheus_client's Histogram takes a lock per bucket and walks the buckets in Python,
    about 4 us an observation, more than the rest of a token's metrics together."""

    def __init__(self, name: str, doc: str, model_name: str, registry: CollectorRegistry) -> None:
        self.name, self.doc, self.model_name = name, doc, model_name
        self.counts = [0] * (len(_LATENCY_BUCKETS) + 1)  # the last: above every bound (+Inf)
        self.sum = 0.0
        registry.register(self)

    def observe(self, seconds: float) -> None:
        self.counts[bisect.bisect_left(_LATENCY_BUCKETS, seconds)] += 1  # le: bound >= seconds
        self.sum += seconds

    def collect(self) -> Iterator[HistogramMetricFamily]:
        family = HistogramMetricFamily(self.name, self.doc, labels=["model_name"])
        cumulative, buckets = 0, []
        for bound, count in zip((*map(str, _LATENCY_BUCKETS), "+Inf"), self.counts):
            cumulative += count
            buckets.append((bound, cumulative))
        family.add_metric([self.model_name], buckets, self.sum)
        yield family


class RequestTimer:
    """One request's latencies, fed to the metrics as its outputs arrive."""

    __slots__ = ("metrics", "arrival", "last", "num_tokens")

    def __init__(self, metrics: ServerMetrics) -> None:
        self.metrics = metrics
        self.arrival = time.perf_counter()
        self.last: float | None = None
        self.num_tokens = 0

    def output(self, num_new_tokens: int) -> None:
        if not num_new_tokens:
            return
        now = time.perf_counter()
        if self.last is None:
            self.metrics.ttft.observe(now - self.arrival)
        else:
            self.metrics.itl.observe(now - self.last)
        self.last = now
        self.num_tokens += (
            num_new_tokens  # counted once, when the request ends: one lock less per output
        )

    def finished(self, reason: str, num_prompt_tokens: int) -> None:
        m = self.metrics
        m.e2e.observe(time.perf_counter() - self.arrival)
        m.finished.labels(model_name=m.model_name, finished_reason=reason).inc()
        m.prompt_tokens.inc(num_prompt_tokens)
        m.generation_tokens.inc(self.num_tokens)
