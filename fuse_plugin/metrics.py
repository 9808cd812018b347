"""Prometheus metrics and the probes' endpoints, on one optional HTTP port.

Values are read when Prometheus scrapes: counters from a ``Stats`` snapshot, state from
the lifecycle's ``Status`` and the device state, so the Allocate path pays for nothing
here. ``/healthz`` is liveness: the loop turns, inotify reports; anything the loop cannot
recover from by itself makes it fail so that the kubelet restarts us. ``/readyz`` says
the kubelet can use us now: our socket is the one at the path, registered, device healthy.

The port faces the node's network, and three failed liveness probes restart us, so it is
served by ``fuse_plugin.http_port``: one thread, every connection with a deadline, and a
new connection over the cap closes the oldest, so no client can keep a probe out.
"""

from __future__ import annotations

from http import HTTPStatus

from fuse_plugin import http_port
from fuse_plugin.devices import Health
from fuse_plugin.http_port import TEXT, Answer
from fuse_plugin.lifecycle import Lifecycle
from fuse_plugin.stats import Stats

PREFIX = "fuse_device_plugin"
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
# Open connections at most; a probe or a scrape holds one for a millisecond, and over the
# cap the oldest is closed for the newcomer.
MAX_CONNECTIONS = http_port.MAX_CONNECTIONS


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


class MetricsServer:
    """The HTTP endpoint: /metrics, /healthz, /readyz. Off unless --metrics-port is set."""

    def __init__(self, lifecycle: Lifecycle, stats: Stats, address: str, port: int) -> None:
        self._http = http_port.HttpPort(_routes(lifecycle, stats), address, port,
                                        name="metrics", max_connections=MAX_CONNECTIONS)

    @property
    def port(self) -> int:
        return self._http.port

    def start(self) -> MetricsServer:
        self._http.start()
        return self

    def stop(self) -> None:
        self._http.stop()


def _routes(lifecycle: Lifecycle, stats: Stats) -> dict[str, http_port.Route]:
    def metrics() -> Answer:
        return HTTPStatus.OK, exposition(lifecycle, stats), CONTENT_TYPE

    def healthz() -> Answer:
        if lifecycle.alive():
            return HTTPStatus.OK, b"ok\n", TEXT
        return HTTPStatus.SERVICE_UNAVAILABLE, b"loop stopped or stuck\n", TEXT

    def readyz() -> Answer:
        ready, reason = _readiness(lifecycle)
        code = HTTPStatus.OK if ready else HTTPStatus.SERVICE_UNAVAILABLE
        return code, f"{reason}\n".encode(), TEXT

    return {"/metrics": metrics, "/healthz": healthz, "/readyz": readyz}
