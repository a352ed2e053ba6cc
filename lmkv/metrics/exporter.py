"""The recorder as Prometheus text over HTTP, outside vLLM.

``lmkv server --metrics-port P`` and, in a process that opens an engine,
``metrics.port`` serve ``/metrics`` (every catalog metric as ``lmkv_<name>``,
read from ``Recorder.totals()`` at each scrape: the hot path never formats)
and ``/health`` (a small JSON body). Inside vLLM the same figures also reach
``vllm serve``'s own ``/metrics`` as ``vllm:lmkv_<name>``, through vLLM's
connector stats (``lmkv.integrations.vllm.stats``).

Closed by default: the exporter binds 127.0.0.1 unless an address is given.

Health. Faults at run time degrade to misses and never stop serving, so a
tier that is down (its circuit breaker open) does not make the process
unhealthy: ``/health`` answers 200 with ``"status": "degraded"`` and the tier
marked unreachable, and only ``/health?strict=1`` answers 503 then (for a
readiness probe that should steer traffic away from a degraded instance).
"""

from __future__ import annotations

import json
import logging
import os
import threading
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlsplit

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from lmkv.base.errors import LMKVError
from lmkv.metrics.catalog import CATALOG, LATENCY_BUCKETS, TIER_SOURCES
from lmkv.metrics.recorder import Recorder, TierStats, recorder

logger = logging.getLogger(__name__)

PREFIX = "lmkv_"
DEFAULT_HOST = "127.0.0.1"
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class RecorderCollector(Collector):
    """Every catalog metric from one recorder, read at each scrape."""

    def __init__(self, rec: Recorder | None = None) -> None:
        self.rec = rec or recorder()

    def collect(self) -> Iterator[Metric]:
        totals = self.rec.totals()
        for metric in CATALOG:
            name = PREFIX + metric.name
            if metric.name in TIER_SOURCES:
                yield _tier_family(name, metric.kind, metric.help, metric.labels,
                                   TIER_SOURCES[metric.name], totals.tiers)
            elif metric.kind == "counter":
                yield CounterMetricFamily(name, metric.help,
                                          value=totals.counters.get(metric.name, 0))
            elif metric.kind == "gauge":
                yield GaugeMetricFamily(name, metric.help,
                                        value=totals.gauges.get(metric.name, 0))
            else:
                hist = totals.histograms.get(metric.name)
                counts = hist.counts if hist else [0] * (len(LATENCY_BUCKETS) + 1)
                buckets, running = [], 0
                for bound, count in zip([*map(str, LATENCY_BUCKETS), "+Inf"], counts,
                                        strict=True):
                    running += count  # the recorder keeps one count per bucket
                    buckets.append((bound, running))
                yield HistogramMetricFamily(name, metric.help, buckets=buckets,
                                            sum_value=hist.sum if hist else 0.0)


def _tier_family(name: str, kind: str, help: str, labels: tuple[str, ...], key: str,
                 rows: TierStats) -> Metric:
    family: CounterMetricFamily | GaugeMetricFamily = (
        CounterMetricFamily(name, help, labels=list(labels)) if kind == "counter"
        else GaugeMetricFamily(name, help, labels=list(labels)))
    for row in rows:
        value = row.get(key)
        if isinstance(value, (int, float)):  # None: unbounded capacity, say
            family.add_metric([str(row.get("tier")), str(row.get("type"))], float(value))
    return family


def health(rec: Recorder | None = None) -> dict[str, Any]:
    """``status`` ``ok``, or ``degraded`` when a tier is unreachable (its breaker is
    open: it answers misses until a probe gets through), and each tier's state."""
    rows = (rec or recorder()).tiers()
    tiers = [{"tier": row.get("tier"), "type": row.get("type"),
              "reachable": bool(row.get("available", 1))} for row in rows]
    down = any(not t["reachable"] for t in tiers)
    return {"status": "degraded" if down else "ok", "pid": os.getpid(), "tiers": tiers}


class MetricsServer:
    """``/metrics`` and ``/health`` on ``host:port``, served by a daemon thread."""

    def __init__(self, port: int, host: str = DEFAULT_HOST, rec: Recorder | None = None
                 ) -> None:
        self.rec = rec or recorder()
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(RecorderCollector(self.rec))
        handler = _handler_for(self.registry, lambda: health(self.rec))
        try:
            self._httpd = _Server((host, port), handler)
        except OSError as exc:
            raise LMKVError(f"metrics exporter: cannot listen on {_where(host, port)}: "
                            f"{exc.strerror or exc}") from None
        self.host = host
        self.port = self._httpd.server_address[1]
        self._thread = threading.Thread(target=self._httpd.serve_forever,
                                        name="lmkv-metrics", daemon=True)
        self._thread.start()

    @property
    def url(self) -> str:
        return f"http://{_where(self.host, self.port)}"

    def close(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join(timeout=2.0)


class _Server(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, address: tuple[str, int], handler: type) -> None:
        import socket

        if ":" in address[0]:
            self.address_family = socket.AF_INET6
        super().__init__(address, handler)


def _where(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _handler_for(registry: CollectorRegistry, status: Callable[[], dict[str, Any]]
                 ) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # the stdlib calls it by this name
            url = urlsplit(self.path)
            if url.path == "/metrics":
                self._send(200, CONTENT_TYPE, generate_latest(registry))
            elif url.path == "/health":
                body = status()
                strict = parse_qs(url.query).get("strict", ["0"])[0] not in ("0", "")
                code = 503 if strict and body["status"] != "ok" else 200
                self._send(code, "application/json", json.dumps(body).encode())
            else:
                self._send(404, "text/plain", b"lmkv metrics: /metrics or /health\n")

        def _send(self, code: int, kind: str, body: bytes) -> None:
            self.send_response(code)
            self.send_header("Content-Type", kind)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: Any) -> None:
            logger.debug("lmkv metrics: " + format, *args)

    return Handler


_started: dict[tuple[str, int], MetricsServer] = {}
_started_lock = threading.Lock()


def serve_metrics(port: int, host: str = DEFAULT_HOST) -> MetricsServer:
    """The process's exporter on ``host:port``, started once: a second call for the
    same address returns the running one (every engine a process opens may ask).
    LMKVError (one line) when the port cannot be bound."""
    with _started_lock:
        running = _started.get((host, port))
        if running is None:
            running = MetricsServer(port, host)
            _started[(host, port)] = running
            logger.info("lmkv: metrics on %s/metrics, health on %s/health", running.url,
                        running.url)
        return running
