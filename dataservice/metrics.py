"""Prometheus metrics of a data service replica (`tessera-data serve --metrics-port P`).

Counters, from which Prometheus derives rates (`rate(tessera_data_tokens_total[1m])` is the
replica's tokens/s):

    tessera_data_streams_active            gauge: streams open now
    tessera_data_streams_total             streams started
    tessera_data_batches_total             messages sent
    tessera_data_rows_total                packed rows sent
    tessera_data_tokens_total              non-padding tokens sent
    tessera_data_errors_total{code}        requests and streams ended by an error (gRPC status)
    tessera_data_drained_streams_total     streams ended by a drain (clients continue elsewhere)
    tessera_data_batch_seconds             histogram: time to build one message (rows, packing, encoding)
    tessera_data_first_batch_seconds       histogram: request to first message (validation, plan, seek)
    tessera_data_draining                  gauge: 1 while the replica drains
    process_resident_memory_bytes, ...     the process collector (memory, CPU, open files)

Each replica has its own registry, so several servers in one process (tests) do not collide.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector, start_http_server

_LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


class ServiceMetrics:
    """The replica's instruments; `serve_http` exposes them at http://HOST:PORT/metrics."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.streams_active = Gauge("tessera_data_streams_active", "Streams open now.", registry=r)
        self.streams = Counter("tessera_data_streams", "Streams started.", registry=r)
        self.batches = Counter("tessera_data_batches", "Messages sent.", registry=r)
        self.rows = Counter("tessera_data_rows", "Packed rows sent.", registry=r)
        self.tokens = Counter("tessera_data_tokens", "Non-padding tokens sent.", registry=r)
        self.errors = Counter("tessera_data_errors", "Requests and streams ended by an error, by gRPC status.",
                              ["code"], registry=r)
        self.drained = Counter("tessera_data_drained_streams", "Streams ended by a drain.", registry=r)
        self.batch_seconds = Histogram("tessera_data_batch_seconds", "Time to build one message.",
                                       buckets=_LATENCY_BUCKETS, registry=r)
        self.first_batch_seconds = Histogram("tessera_data_first_batch_seconds",
                                             "Time from a request to its first message.",
                                             buckets=_LATENCY_BUCKETS, registry=r)
        self.draining = Gauge("tessera_data_draining", "1 while the replica drains.", registry=r)
        ProcessCollector(registry=r)
        self._http = None

    def error(self, code) -> None:
        self.errors.labels(code=code.name).inc()

    def sent(self, seconds: float, rows: int, tokens: int, first: bool) -> None:
        (self.first_batch_seconds if first else self.batch_seconds).observe(seconds)
        self.batches.inc()
        self.rows.inc(rows)
        self.tokens.inc(tokens)

    def serve_http(self, host: str, port: int) -> int:
        """Expose /metrics on HOST:PORT (0: a free port) from a daemon thread; returns the port."""
        server, thread = start_http_server(port, addr=host, registry=self.registry)
        self._http = (server, thread)
        return server.server_address[1]

    def close(self) -> None:
        if self._http is not None:
            server, _ = self._http
            self._http = None
            server.shutdown()  # returns once the serving loop has noticed (within half a second)
            server.server_close()
