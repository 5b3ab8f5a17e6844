"""The server's counters in Prometheus' text exposition format (``GET /metrics``), without a client
library: requests by status, errors by kind, images, queue depth, batch sizes and request latency."""

from __future__ import annotations

import threading
from collections import Counter

BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64)
LATENCY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)


class Histogram:
    def __init__(self, buckets: tuple[float, ...]):
        self.buckets = buckets
        self.counts = [0] * len(buckets)
        self.total = 0
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.total += 1
        self.sum += value
        for i, edge in enumerate(self.buckets):
            if value <= edge:
                self.counts[i] += 1

    def lines(self, name: str) -> list[str]:
        out = [
            f'{name}_bucket{{le="{edge:g}"}} {n}' for edge, n in zip(self.buckets, self.counts, strict=True)
        ]
        return out + [
            f'{name}_bucket{{le="+Inf"}} {self.total}',
            f"{name}_sum {self.sum:.6f}",
            f"{name}_count {self.total}",
        ]


class Metrics:
    """Thread-safe: the worker and the HTTP handlers both record."""

    def __init__(self):
        self.lock = threading.Lock()
        self.requests: Counter[int] = Counter()
        self.errors: Counter[str] = Counter()
        self.images = 0
        self.batches = Histogram(BATCH_BUCKETS)
        self.latency = Histogram(LATENCY_BUCKETS)
        self.queue_depth = 0

    def request(self, status: int, seconds: float | None = None) -> None:
        with self.lock:
            self.requests[status] += 1
            if seconds is not None:
                self.latency.observe(seconds)

    def error(self, kind: str) -> None:
        with self.lock:
            self.errors[kind] += 1

    def batch(self, images: int) -> None:
        with self.lock:
            self.batches.observe(images)
            self.images += images

    def text(self) -> str:
        with self.lock:
            lines = [
                "# HELP sdkiln_requests_total Image generation requests answered, by HTTP status.",
                "# TYPE sdkiln_requests_total counter",
                *(f'sdkiln_requests_total{{status="{s}"}} {n}' for s, n in sorted(self.requests.items())),
                "# HELP sdkiln_errors_total Requests that failed, by kind.",
                "# TYPE sdkiln_errors_total counter",
                *(f'sdkiln_errors_total{{kind="{k}"}} {n}' for k, n in sorted(self.errors.items())),
                "# HELP sdkiln_images_total Images generated.",
                "# TYPE sdkiln_images_total counter",
                f"sdkiln_images_total {self.images}",
                "# HELP sdkiln_queue_depth Requests waiting for the model.",
                "# TYPE sdkiln_queue_depth gauge",
                f"sdkiln_queue_depth {self.queue_depth}",
                "# HELP sdkiln_batch_images Images per pipeline call (a batch of requests).",
                "# TYPE sdkiln_batch_images histogram",
                *self.batches.lines("sdkiln_batch_images"),
                "# HELP sdkiln_request_seconds Latency of answered generation requests, queue included.",
                "# TYPE sdkiln_request_seconds histogram",
                *self.latency.lines("sdkiln_request_seconds"),
            ]
        return "\n".join(lines) + "\n"
