"""Prometheus metrics and the probes' endpoints, on one optional HTTP port.

Values are read from the lifecycle's ``Status`` and the servicer's counters when
Prometheus scrapes, so nothing is counted twice and the Allocate path pays for one
histogram observation only. ``/healthz`` says the process and its loop are alive;
``/readyz`` says the kubelet can use us now: serving, registered, and the device healthy.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from fuse_plugin.devices import Health
from fuse_plugin.lifecycle import Lifecycle

PREFIX = "fuse_device_plugin"
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
# Allocate costs tens of microseconds in-process; buckets reach up to a slow second.
BUCKETS = (0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.1, 1.0)


class _StatusCollector(Collector):
    def __init__(self, lifecycle: Lifecycle) -> None:
        self._lifecycle = lifecycle

    def collect(self) -> Iterator[Metric]:
        life = self._lifecycle
        status, state = life.status, life.state
        yield GaugeMetricFamily(f"{PREFIX}_registered",
                                "1 when the kubelet has accepted our registration",
                                value=int(status.registered))
        slots = GaugeMetricFamily(f"{PREFIX}_slots", "Advertised slots by health",
                                  labels=["health"])
        for health in Health:
            slots.add_metric([health.value],
                             len(state.ids) if state.health is health else 0)
        yield slots
        yield GaugeMetricFamily(f"{PREFIX}_listandwatch_streams",
                                "Open ListAndWatch streams", value=life.servicer.open_streams)
        counters = (
            ("allocations", "Containers given the device by Allocate",
             life.servicer.allocated_containers),
            ("allocate_refusals", "Allocate calls refused with INVALID_ARGUMENT",
             life.servicer.refusals),
            ("kubelet_restarts", "Kubelet restarts seen (a new kubelet.sock)",
             status.kubelet_restarts),
            ("registrations", "Register calls the kubelet accepted", status.registrations),
            ("registration_failures", "Register calls that failed",
             status.registration_failures),
        )
        for name, text, value in counters:
            yield CounterMetricFamily(f"{PREFIX}_{name}", text, value=value)


def _readiness(lifecycle: Lifecycle) -> tuple[bool, str]:
    status = lifecycle.status
    if not status.serving:
        return False, "not serving: our socket is not up"
    if not status.registered:
        return False, f"not registered with the kubelet {status.last_error}".rstrip()
    if lifecycle.state.health is not Health.HEALTHY:
        return False, f"device unhealthy: {lifecycle.state.reason}"
    return True, "ready"


class MetricsServer:
    """The HTTP endpoint: /metrics, /healthz, /readyz. Off unless --metrics-port is set."""

    def __init__(self, lifecycle: Lifecycle, address: str, port: int) -> None:
        self.registry = CollectorRegistry()
        self.registry.register(_StatusCollector(lifecycle))
        self.allocate_seconds = Histogram(
            f"{PREFIX}_allocate_duration_seconds", "Time to answer Allocate in the plugin",
            buckets=BUCKETS, registry=self.registry)
        lifecycle.servicer.on_allocate = self._observe
        self._http = ThreadingHTTPServer((address, port), _handler(self, lifecycle))
        self._http.daemon_threads = True
        self._thread = threading.Thread(target=self._http.serve_forever, name="metrics",
                                        daemon=True)

    @property
    def port(self) -> int:
        return int(self._http.server_address[1])

    def _observe(self, containers: int, seconds: float) -> None:
        self.allocate_seconds.observe(seconds)

    def start(self) -> MetricsServer:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._http.shutdown()
        self._http.server_close()


def _handler(server: MetricsServer, lifecycle: Lifecycle) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            path = self.path.split("?", 1)[0]
            if path == "/metrics":
                self._send(HTTPStatus.OK, generate_latest(server.registry), CONTENT_TYPE)
            elif path == "/healthz":
                alive = lifecycle.alive
                self._send(HTTPStatus.OK if alive else HTTPStatus.SERVICE_UNAVAILABLE,
                           b"ok\n" if alive else b"loop stopped\n")
            elif path == "/readyz":
                ready, reason = _readiness(lifecycle)
                self._send(HTTPStatus.OK if ready else HTTPStatus.SERVICE_UNAVAILABLE,
                           f"{reason}\n".encode())
            else:
                self._send(HTTPStatus.NOT_FOUND, b"try /metrics, /healthz or /readyz\n")

        def _send(self, code: HTTPStatus, body: bytes,
                  content_type: str = "text/plain; charset=utf-8") -> None:
            self.send_response(code)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: object) -> None:
            """Probes every few seconds would drown the event log: stay quiet."""

    return Handler
