"""The server's Prometheus metrics (`/metrics`), in a registry of its own: building a server
registers nothing process-wide."""

from __future__ import annotations

import time
from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from tokentape.engine.core.messages import SchedulerStats

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


class ServerMetrics:
    def __init__(self, model_name: str, stats: Callable[[], SchedulerStats]) -> None:
        r = self.registry = CollectorRegistry()
        labels = {"model_name": model_name}

        def gauge(name: str, doc: str, value: Callable[[], float]) -> None:
            Gauge(name, doc, list(labels), registry=r).labels(**labels).set_function(value)

        gauge("tokentape:num_requests_running", "Requests running in the engine.", lambda: stats().num_running)
        gauge("tokentape:num_requests_waiting", "Requests waiting in the engine.", lambda: stats().num_waiting)
        gauge("tokentape:is_paused", "1 while generation is paused.", lambda: float(stats().is_paused))
        gauge("tokentape:engine_step", "Engine steps scheduled so far.", lambda: stats().step)
        self.finished = Counter("tokentape:request_success", "Requests finished, by finish reason.",
                                ["model_name", "finished_reason"], registry=r)
        self.prompt_tokens = Counter("tokentape:prompt_tokens", "Prompt tokens of finished requests.",
                                     list(labels), registry=r).labels(**labels)
        self.generation_tokens = Counter("tokentape:generation_tokens", "Tokens generated.",
                                         list(labels), registry=r).labels(**labels)
        self.ttft = Histogram("tokentape:time_to_first_token_seconds", "Time to first token.",
                              list(labels), buckets=_LATENCY_BUCKETS, registry=r).labels(**labels)
        self.itl = Histogram("tokentape:inter_token_latency_seconds", "Time between outputs of a stream.",
                             list(labels), buckets=_LATENCY_BUCKETS, registry=r).labels(**labels)
        self.e2e = Histogram("tokentape:e2e_request_latency_seconds", "Request latency, arrival to finish.",
                             list(labels), buckets=_LATENCY_BUCKETS, registry=r).labels(**labels)
        self.errors = Counter("tokentape:http_errors", "Error responses, by status.", ["status"], registry=r)
        self.model_name = model_name

    def render(self) -> bytes:
        return generate_latest(self.registry)


class RequestTimer:
    """One request's latencies, fed to the metrics as its outputs arrive."""

    __slots__ = ("metrics", "arrival", "last")

    def __init__(self, metrics: ServerMetrics) -> None:
        self.metrics = metrics
        self.arrival = time.perf_counter()
        self.last: float | None = None

    def output(self, num_new_tokens: int) -> None:
        if not num_new_tokens:
            return
        now = time.perf_counter()
        if self.last is None:
            self.metrics.ttft.observe(now - self.arrival)
        else:
            self.metrics.itl.observe(now - self.last)
        self.last = now
        self.metrics.generation_tokens.inc(num_new_tokens)

    def finished(self, reason: str, num_prompt_tokens: int) -> None:
        m = self.metrics
        m.e2e.observe(time.perf_counter() - self.arrival)
        m.finished.labels(model_name=m.model_name, finished_reason=reason).inc()
        m.prompt_tokens.inc(num_prompt_tokens)
