"""Prometheus metrics and the probes' endpoints, on one optional HTTP port.

Values are read when Prometheus scrapes: counters from a ``Stats`` snapshot, state from
the lifecycle's ``Status`` and the device state, so the Allocate path pays for nothing
here. ``/healthz`` is liveness: the loop turns, inotify reports; anything the loop cannot
recover from by itself makes it fail so that the kubelet restarts us. ``/readyz`` says
the kubelet can use us now: our socket is the one at the path, registered, device healthy.

The port faces the node's network, so it defends itself: each connection gets a short
socket timeout (an idle or half-sent request is dropped) and at most ``MAX_CONNECTIONS``
are served at once (others are closed at once rather than parked on a thread).

HTTP is spoken by a few lines over ``socketserver`` rather than ``http.server``, which
pulls in ``http.client`` and the ``email`` package (24 modules, ~0.9 MiB on every node) to
parse headers nobody here reads: a probe and a scrape are a GET line and a path.
"""

from __future__ import annotations

import logging
import os
import selectors
import socket
import socketserver
import sys
import threading
from http import HTTPStatus
from typing import Any

from fuse_plugin import logs
from fuse_plugin.devices import Health
from fuse_plugin.lifecycle import Lifecycle
from fuse_plugin.stats import Stats

PREFIX = "fuse_device_plugin"
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
TEXT = "text/plain; charset=utf-8"
MAX_CONNECTIONS = 16
# Probes and scrapes send their request at once; nothing legitimate idles this long.
CONNECTION_TIMEOUT = 5.0
# A request line or header longer than this, or more headers, is not a probe.
MAX_LINE = 8192
MAX_HEADERS = 100


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


class _Server(socketserver.ThreadingTCPServer):
    daemon_threads = True
    block_on_close = False
    allow_reuse_address = True  # a restarted plugin binds at once, as http.server does
    # handle_request() is only called once the socket is readable; a connection gone
    # before accept() must not leave it blocked (and stop() waiting behind it).
    timeout = 0.0

    def __init__(self, address: str, port: int,
                 handler: type[socketserver.StreamRequestHandler]) -> None:
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
        self._stop_read, self._stop_write = os.pipe()
        self._thread = threading.Thread(target=self._serve, name="metrics", daemon=True)

    @property
    def port(self) -> int:
        return int(self._http.server_address[1])

    def start(self) -> MetricsServer:
        self._thread.start()
        return self

    def stop(self) -> None:
        os.write(self._stop_write, b"x")
        self._thread.join()
        self._http.server_close()
        os.close(self._stop_read)
        os.close(self._stop_write)

    def _serve(self) -> None:
        """Wait on the listening socket and the stop pipe, nothing else.

        ``serve_forever`` wakes twice a second to look for ``shutdown()``: on every node,
        all day, for a port that is asked every ten seconds. Here an idle port costs
        nothing and ``stop()`` still returns at once.
        """
        with selectors.DefaultSelector() as selector:
            selector.register(self._http, selectors.EVENT_READ)
            selector.register(self._stop_read, selectors.EVENT_READ)
            while True:
                for key, _ in selector.select():
                    if key.fileobj == self._stop_read:
                        return
                    self._http.handle_request()


def _handler(lifecycle: Lifecycle, stats: Stats) -> type[socketserver.StreamRequestHandler]:
    def answer(path: str) -> tuple[HTTPStatus, bytes, str]:
        if path == "/metrics":
            return HTTPStatus.OK, exposition(lifecycle, stats), CONTENT_TYPE
        if path == "/healthz":
            if lifecycle.alive():
                return HTTPStatus.OK, b"ok\n", TEXT
            return HTTPStatus.SERVICE_UNAVAILABLE, b"loop stopped or stuck\n", TEXT
        if path == "/readyz":
            ready, reason = _readiness(lifecycle)
            code = HTTPStatus.OK if ready else HTTPStatus.SERVICE_UNAVAILABLE
            return code, f"{reason}\n".encode(), TEXT
        return HTTPStatus.NOT_FOUND, b"try /metrics, /healthz or /readyz\n", TEXT

    class Handler(socketserver.StreamRequestHandler):
        timeout = CONNECTION_TIMEOUT

        def handle(self) -> None:
            """One request per connection (HTTP/1.0): read the request line and the
            headers (bounded), answer, close."""
            line = self.rfile.readline(MAX_LINE + 1)
            for _ in range(MAX_HEADERS):
                header = self.rfile.readline(MAX_LINE + 1)
                if header in (b"\r\n", b"\n", b"") or len(header) > MAX_LINE:
                    break
            parts = line.split()
            if len(parts) != 3 or not parts[2].startswith(b"HTTP/") or len(line) > MAX_LINE:
                self._send(HTTPStatus.BAD_REQUEST, b"bad request\n", TEXT)
            elif parts[0] != b"GET":
                self._send(HTTPStatus.METHOD_NOT_ALLOWED, b"GET only\n", TEXT)
            else:
                path = parts[1].split(b"?", 1)[0].decode("latin-1")
                self._send(*answer(path))

        def _send(self, code: HTTPStatus, body: bytes, content_type: str) -> None:
            head = (f"HTTP/1.0 {code.value} {code.phrase}\r\nContent-Type: {content_type}"
                    f"\r\nContent-Length: {len(body)}\r\n\r\n")
            self.wfile.write(head.encode("latin-1") + body)

    return Handler
