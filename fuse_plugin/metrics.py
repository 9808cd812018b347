"""Prometheus metrics and the probes' endpoints, on one optional HTTP port.

Values are read when Prometheus scrapes: counters from a ``Stats`` snapshot, state from
the lifecycle's ``Status`` and the device state, so the Allocate path pays for nothing
here. ``/healthz`` is liveness: the loop turns, inotify reports; anything the loop cannot
recover from by itself makes it fail so that the kubelet restarts us. ``/readyz`` says
the kubelet can use us now: our socket is the one at the path, registered, device healthy.

The port faces the node's network, so it defends itself: each connection gets a short
socket timeout (an idle or half-sent request is dropped) and at most ``MAX_CONNECTIONS``
are served at once (others are closed at once rather than parked on a thread).
"""

from __future__ import annotations

import logging
import socket
import sys
import threading
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from itertools import accumulate
from typing import Any

from fuse_plugin import logs
from fuse_plugin.devices import Health
from fuse_plugin.lifecycle import Lifecycle
from fuse_plugin.stats import ALLOCATE_BUCKETS, Stats

PREFIX = "fuse_device_plugin"
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
MAX_CONNECTIONS = 16
# Probes and scrapes send their request at once; nothing legitimate idles this long.
CONNECTION_TIMEOUT = 5.0


def exposition(lifecycle: Lifecycle, stats: Stats) -> bytes:
    """The Prometheus text format (0.0.4), written out: a dozen series do not need
    prometheus-client, whose import alone loads OpenSSL (~8 MiB on every node)."""
    counts = stats.snapshot()
    out: list[str] = []

    def family(name: str, kind: str, text: str, *samples: tuple[str, str, float]) -> None:
        out.append(f"# HELP {PREFIX}_{name} {text}")
        out.append(f"# TYPE {PREFIX}_{name} {kind}")
        out.extend(f"{PREFIX}_{name}{suffix}{labels} {float(value)!r}"
                   for suffix, labels, value in samples)

    status, state = lifecycle.status, lifecycle.state
    family("registered", "gauge", "1 when the kubelet has accepted our registration",
           ("", "", int(status.registered)))
    family("slots", "gauge", "Advertised slots by health",
           *(("", f'{{health="{health.value}"}}',
              len(state.ids) if state.health is health else 0) for health in Health))
    family("listandwatch_streams", "gauge", "Open ListAndWatch streams",
           ("", "", lifecycle.servicer.open_streams))
    for name, text, value in (
            ("allocations", "Containers given the device by Allocate", counts.allocations),
            ("allocate_refusals", "Allocate calls refused with INVALID_ARGUMENT",
             counts.refusals),
            ("kubelet_restarts", "Kubelet restarts seen (a new kubelet.sock)",
             counts.kubelet_restarts),
            ("registrations", "Register calls the kubelet accepted", counts.registrations),
            ("registration_failures", "Register calls that failed",
             counts.registration_failures)):
        family(f"{name}_total", "counter", text, ("", "", value))
    bounds = [repr(float(bound)) for bound in ALLOCATE_BUCKETS] + ["+Inf"]
    cumulative = list(accumulate(counts.allocate_buckets))
    family("allocate_duration_seconds", "histogram", "Time to answer Allocate in the plugin",
           *(("_bucket", f'{{le="{le}"}}', n) for le, n in zip(bounds, cumulative, strict=True)),
           ("_count", "", cumulative[-1]), ("_sum", "", counts.allocate_seconds_sum))
    return ("\n".join(out) + "\n").encode()


def _readiness(lifecycle: Lifecycle) -> tuple[bool, str]:
    status = lifecycle.status
    if not status.serving or not lifecycle.owns_socket():
        reason = f": {status.last_error}" if status.last_error else ""
        return False, f"not serving: our socket is not up{reason}"
    if not status.registered:
        return False, f"not registered with the kubelet {status.last_error}".rstrip()
    if lifecycle.state.health is not Health.HEALTHY:
        return False, f"device unhealthy: {lifecycle.state.reason}"
    return True, "ready"


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    block_on_close = False

    def __init__(self, address: str, port: int, handler: type[BaseHTTPRequestHandler]
                 ) -> None:
        self.address_family = socket.AF_INET6 if ":" in address else socket.AF_INET
        self._slots = threading.BoundedSemaphore(MAX_CONNECTIONS)
        super().__init__((address, port), handler)

    def process_request(self, request: Any, client_address: Any) -> None:
        if not self._slots.acquire(blocking=False):
            self.shutdown_request(request)  # over the cap: close, do not queue
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._slots.release()
            raise

    def handle_error(self, request: Any, client_address: Any) -> None:
        """A client that hangs up mid-answer is routine (a probe timing out): no
        traceback on stderr; anything else is one log line."""
        error = sys.exc_info()[1]
        if not isinstance(error, OSError):
            logs.event(logs.get(), "metrics.error", logging.WARNING, error=repr(error))

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._slots.release()


class MetricsServer:
    """The HTTP endpoint: /metrics, /healthz, /readyz. Off unless --metrics-port is set."""

    def __init__(self, lifecycle: Lifecycle, stats: Stats, address: str, port: int) -> None:
        self._http = _Server(address, port, _handler(lifecycle, stats))
        self._thread = threading.Thread(target=self._http.serve_forever, name="metrics",
                                        daemon=True)

    @property
    def port(self) -> int:
        return int(self._http.server_address[1])

    def start(self) -> MetricsServer:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._http.shutdown()
        self._http.server_close()


def _handler(lifecycle: Lifecycle, stats: Stats) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        timeout = CONNECTION_TIMEOUT

        def do_GET(self) -> None:
            path = self.path.split("?", 1)[0]
            if path == "/metrics":
                self._send(HTTPStatus.OK, exposition(lifecycle, stats), CONTENT_TYPE)
            elif path == "/healthz":
                alive = lifecycle.alive()
                self._send(HTTPStatus.OK if alive else HTTPStatus.SERVICE_UNAVAILABLE,
                           b"ok\n" if alive else b"loop stopped or stuck\n")
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
