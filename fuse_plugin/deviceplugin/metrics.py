"""Prometheus metrics and the probes' endpoints, on one optional HTTP port.

Values are read when Prometheus scrapes: counters from a ``Stats`` snapshot, state from
the lifecycle's ``Status`` and the device state, so the Allocate path pays for nothing
here; ``fuse_plugin.exposition`` writes them out, as it does the broker's. ``/healthz``
is liveness: the loop turns, inotify reports; anything the loop cannot recover from by
itself makes it fail so that the kubelet restarts us. ``/readyz`` says
the kubelet can use us now: our socket is the one at the path, registered, device healthy.

The port faces the node's network, and three failed liveness probes restart us, so it is
served by ``fuse_plugin.http_port``: one thread, every connection with a deadline, and a
new connection over the cap closes the oldest, so no client can keep a probe out.
"""

from __future__ import annotations

import contextlib
import logging
from http import HTTPStatus

from fuse_plugin import http_port, readiness
from fuse_plugin.deviceplugin.lifecycle import Lifecycle
from fuse_plugin.devices import Health
from fuse_plugin.exposition import CONTENT_TYPE, Exposition
from fuse_plugin.http_port import Answer
from fuse_plugin.stats import Stats

PREFIX = "fuse_device_plugin"
# Open connections at most; a probe or a scrape holds one for a millisecond, and over the
# cap the oldest is closed for the newcomer.
MAX_CONNECTIONS = http_port.MAX_CONNECTIONS


def exposition(lifecycle: Lifecycle, stats: Stats) -> bytes:
    """The scrape: counters from one ``Stats`` snapshot, state as the loop left it."""
    counts = stats.snapshot()
    out = Exposition(PREFIX)
    status, state = lifecycle.status, lifecycle.state
    out.family("registered", "gauge", "1 when the kubelet has accepted our registration",
               ({}, int(status.registered)))
    out.family("slots", "gauge", "Advertised slots by health",
               *(({"health": health.value},
                  len(state.ids) if state.health is health else 0) for health in Health))
    out.family("listandwatch_streams", "gauge", "Open ListAndWatch streams",
               ({}, lifecycle.servicer.open_streams))
    for name, text, value in (
            ("allocations", "Containers given the device by Allocate", counts.allocations),
            ("allocate_refusals", "Allocate calls refused with INVALID_ARGUMENT",
             counts.refusals),
            ("kubelet_restarts", "Kubelet restarts seen (a new kubelet.sock)",
             counts.kubelet_restarts),
            ("registrations", "Register calls the kubelet accepted", counts.registrations),
            ("registration_failures", "Register calls that failed",
             counts.registration_failures)):
        out.family(f"{name}_total", "counter", text, ({}, value))
    return out.encode()


def _readiness(lifecycle: Lifecycle) -> tuple[bool, str]:
    status = lifecycle.status
    if not status.serving or not lifecycle.owns_socket():
        reason = f": {status.last_error}" if status.last_error else ""
        return False, f"not serving: our socket is not up{reason}"
    return readiness.first_failing(readiness.registered(status.registered, status.last_error),
                                   readiness.device(lifecycle.state))


def _liveness(lifecycle: Lifecycle) -> tuple[bool, str]:
    return (True, "ok") if lifecycle.alive() else (False, "loop stopped or stuck")


def serving(lifecycle: Lifecycle, stats: Stats, address: str, port: int,
            log: logging.Logger) -> contextlib.AbstractContextManager[http_port.HttpPort]:
    """The HTTP endpoint, /metrics, /healthz and /readyz, served until the block ends;
    off unless --metrics-port is set."""
    return http_port.serving(_routes(lifecycle, stats), address, port, name="metrics",
                             log=log, max_connections=MAX_CONNECTIONS)


def _routes(lifecycle: Lifecycle, stats: Stats) -> dict[str, http_port.Route]:
    def metrics() -> Answer:
        return HTTPStatus.OK, exposition(lifecycle, stats), CONTENT_TYPE

    return {"/metrics": metrics, "/healthz": http_port.probe(lambda: _liveness(lifecycle)),
            "/readyz": http_port.probe(lambda: _readiness(lifecycle))}
