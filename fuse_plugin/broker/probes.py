"""The broker's /healthz, /readyz and /metrics, on the HTTP port the plugin uses too.

Liveness is the loop turning: it turns at least once a second whatever tenants do, so a
loop that has not turned for ``STUCK_AFTER`` is stuck and the kubelet should restart the
broker. Readiness is serving: listening, and the socket at the path is ours.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterator
from http import HTTPStatus
from typing import TYPE_CHECKING

from fuse_plugin import logs
from fuse_plugin.errors import Failure

if TYPE_CHECKING:
    from fuse_plugin.broker.server import Broker, BrokerSettings

STUCK_AFTER = 10.0
PREFIX = "fuse_mount_broker"
TEXT = "text/plain; charset=utf-8"
EXPOSITION = "text/plain; version=0.0.4; charset=utf-8"

Answer = tuple[HTTPStatus, bytes, str]


def health(broker: Broker) -> Answer:
    idle = time.monotonic() - broker.turned
    if idle > STUCK_AFTER:
        return HTTPStatus.SERVICE_UNAVAILABLE, f"the loop has not turned for {idle:.0f}s\n" \
            .encode(), TEXT
    return HTTPStatus.OK, b"ok\n", TEXT


def readiness(broker: Broker) -> Answer:
    if broker.serving:
        return HTTPStatus.OK, b"ready\n", TEXT
    return HTTPStatus.SERVICE_UNAVAILABLE, b"not serving on its socket\n", TEXT


def exposition(broker: Broker) -> Answer:
    snap = broker.stats.snapshot()
    out: list[str] = []

    def family(name: str, kind: str, text: str, *samples: tuple[str, float]) -> None:
        out.append(f"# HELP {PREFIX}_{name} {text}")
        out.append(f"# TYPE {PREFIX}_{name} {kind}")
        out.extend(f"{PREFIX}_{name}{labels} {float(value)!r}" for labels, value in samples)

    family("requests_total", "counter", "Requests carried out, by operation",
           *((f'{{op="{op}"}}', n) for op, n in sorted(snap.served.items())))
    family("refusals_total", "counter", "Requests refused, by the rule that refused them",
           *((f'{{kind="{kind}"}}', n) for kind, n in sorted(snap.refused.items())))
    family("failures_total", "counter", "Requests the kernel or a deadline failed",
           ("", snap.failed))
    family("stalls_total", "counter", "Helpers killed at their deadline", ("", snap.stalled))
    family("aborted_connections_total", "counter",
           "FUSE connections aborted to free a helper stuck on them", ("", snap.aborted))
    family("accept_pauses_total", "counter", "Times accepting paused at the fd limit",
           ("", snap.accept_pauses))
    family("mounts_held", "gauge", "Live FUSE mounts the broker made, per container cgroup",
           *((f'{{cgroup="{_label(c)}"}}', n) for c, n in sorted(broker.mounts_held.items())))
    return HTTPStatus.OK, ("\n".join(out) + "\n").encode(), EXPOSITION


def _label(text: str) -> str:
    return text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


@contextlib.contextmanager
def serve_probes(broker: Broker, settings: BrokerSettings, log: logging.Logger
                 ) -> Iterator[int]:
    from fuse_plugin.http_port import HttpPort

    try:
        port = HttpPort({"/healthz": lambda: health(broker),
                         "/readyz": lambda: readiness(broker),
                         "/metrics": lambda: exposition(broker)},
                        settings.metrics_address, settings.metrics_port, name="probes",
                        log=log)
    except OSError as err:
        raise Failure(f"cannot serve metrics on {settings.metrics_address}:"
                      f"{settings.metrics_port}: {err.strerror or err}") from None
    port.start()
    logs.event(log, "metrics.serving", address=settings.metrics_address, port=port.port)
    try:
        yield port.port
    finally:
        port.stop()
