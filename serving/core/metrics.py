"""Prometheus metrics (docs/api.md, GET /metrics), one registry per server so tests can build many.

Endpoints are labelled by route template (/v1/classes/{class}/detect), never by raw path,
so label cardinality stays bounded.
"""
from __future__ import annotations

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

_LATENCY_BUCKETS = (0.0005, 0.001, 0.002, 0.003, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.05, 0.075,
                    0.1, 0.2, 0.5, 1.0, 2.5, 5.0, 10.0)
_BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("slc_http_requests_total", "HTTP requests by route template, method and status",
                                ["endpoint", "method", "status"], registry=r)
        self.latency = Histogram("slc_http_request_duration_seconds", "HTTP latency by route template and status",
                                 ["endpoint", "method", "status"], buckets=_LATENCY_BUCKETS, registry=r)
        self.batch_size = Histogram("slc_batch_size_inputs", "inputs per backbone call", buckets=_BATCH_BUCKETS,
                                    registry=r)
        self.batch_requests = Histogram("slc_batch_size_requests", "requests coalesced per backbone call",
                                        buckets=_BATCH_BUCKETS, registry=r)
        self.batch_seconds = Histogram("slc_batch_compute_seconds", "compute time of one batch (worker thread)",
                                       buckets=_LATENCY_BUCKETS, registry=r)
        self.queue_wait = Histogram("slc_queue_wait_seconds", "time a request waited in the batch queue",
                                    buckets=_LATENCY_BUCKETS, registry=r)
        self.queue_depth = Gauge("slc_queue_depth_inputs", "inputs waiting in the batch queue", registry=r)
        self.rejections = Counter("slc_rejections_total", "requests refused, by reason (error code)", ["reason"],
                                  registry=r)
        self.ready = Gauge("slc_ready", "1 when the server answers inference requests", registry=r)
        # per served model (issue 51: many class-sets on one server), labelled by its name
        self.model_requests = Counter("slc_model_requests_total", "requests to a model's routes by model, route "
                                      "template and status", ["model", "endpoint", "status"], registry=r)
        self.model_latency = Histogram("slc_model_request_duration_seconds", "latency of a model's routes by model",
                                       ["model"], buckets=_LATENCY_BUCKETS, registry=r)
        self.model_loaded = Gauge("slc_model_loaded", "1 while the model is served", ["model"], registry=r)
        self.model_head_bytes = Gauge("slc_model_head_bytes", "bytes of the model's head rows and biases (mapped)",
                                      ["model"], registry=r)
        self.in_flight = 0  # HTTP requests inside the app right now (the batcher reads it)
        self._series: dict[tuple, tuple] = {}

    def observe_request(self, endpoint: str, method: str, status: str, seconds: float) -> None:
        """Count and time one request; the labelled series are looked up once per label set."""
        key = (endpoint, method, status)
        series = self._series.get(key)
        if series is None:
            series = self._series[key] = (self.requests.labels(*key), self.latency.labels(*key))
        series[0].inc()
        series[1].observe(seconds)

    def observe_model(self, model: str, endpoint: str, status: str, seconds: float) -> None:
        """Count and time one request to a model's routes (the labels are bounded: served names)."""
        key = ("model", model, endpoint, status)
        series = self._series.get(key)
        if series is None:
            series = self._series[key] = (self.model_requests.labels(model, endpoint, status),
                                          self.model_latency.labels(model))
        series[0].inc()
        series[1].observe(seconds)

    def forget_model(self, model: str) -> None:
        """An unloaded model's per-model series dropped."""
        for key in [k for k in self._series if len(k) == 4 and k[1] == model]:
            self._series.pop(key)
            try:
                self.model_requests.remove(*key[1:])
            except KeyError:
                pass
        try:
            self.model_latency.remove(model)
        except KeyError:
            pass

    def reject(self, reason: str) -> None:
        self.rejections.labels(reason).inc()

    def render(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
