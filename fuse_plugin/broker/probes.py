"""The broker's /healthz, /readyz and /metrics, on the HTTP port the plugin uses too.

Liveness is the loop turning: it turns at least once a second whatever tenants do, so a
loop that has not turned for ``STUCK_AFTER`` is stuck and the kubelet should restart the
broker. Readiness is serving: listening, and the socket at the path is ours.
"""

from __future__ import annotations

import contextlib
import logging
import time
from http import HTTPStatus
from typing import TYPE_CHECKING

from fuse_plugin import http_port
from fuse_plugin.exposition import CONTENT_TYPE, Exposition
from fuse_plugin.http_port import Answer, HttpPort

if TYPE_CHECKING:
    from fuse_plugin.broker.server import Broker
    from fuse_plugin.broker.settings import BrokerSettings

STUCK_AFTER = 10.0
PREFIX = "fuse_mount_broker"


def health(broker: Broker) -> tuple[bool, str]:
    idle = time.monotonic() - broker.turned
    if idle > STUCK_AFTER:
        return False, f"the loop has not turned for {idle:.0f}s"
    return True, "ok"


def readiness(broker: Broker) -> tuple[bool, str]:
    if broker.serving:
        return True, "ready"
    return False, "not serving on its socket"


def exposition(broker: Broker) -> Answer:
    snap = broker.stats.snapshot()
    out = Exposition(PREFIX)
    out.family("requests_total", "counter", "Requests carried out, by operation",
               *(({"op": op}, n) for op, n in sorted(snap.served.items())))
    out.family("refusals_total", "counter", "Requests refused, by the rule that refused them",
               *(({"kind": kind}, n) for kind, n in sorted(snap.refused.items())))
    out.family("failures_total", "counter", "Requests the kernel or a deadline failed",
               ({}, snap.failed))
    out.family("stalls_total", "counter", "Helpers killed at their deadline",
               ({}, snap.stalled))
    out.family("aborted_connections_total", "counter",
               "FUSE connections aborted to free a helper stuck on them", ({}, snap.aborted))
    out.family("accept_pauses_total", "counter", "Times accepting paused at the fd limit",
               ({}, snap.accept_pauses))
    out.family("mounts_held", "gauge", "Live FUSE mounts the broker made, per container cgroup",
               *(({"cgroup": c}, n) for c, n in sorted(broker.admission.mounts_held.items())))
    return HTTPStatus.OK, out.encode(), CONTENT_TYPE


def serve_probes(broker: Broker, settings: BrokerSettings, log: logging.Logger
                 ) -> contextlib.AbstractContextManager[HttpPort]:
    """/healthz, /readyz and /metrics, served until the block ends."""
    return http_port.serving({"/healthz": http_port.probe(lambda: health(broker)),
                              "/readyz": http_port.probe(lambda: readiness(broker)),
                              "/metrics": lambda: exposition(broker)},
                             settings.metrics_address, settings.metrics_port,
                             name="metrics", log=log)
