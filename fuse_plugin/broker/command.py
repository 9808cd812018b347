"""``fuse-device-plugin broker``: the node's FUSE mount broker, as a command.

Reads the flags, sets up logging and the probes, and runs the loop (``server.Broker``)
until SIGTERM. Follow a request from the socket to the mount in ``server`` (the loop),
``conversation`` (one request) and ``native/helper.c`` (the steps in the caller's
namespaces).
"""

from __future__ import annotations

import argparse
import contextlib

from fuse_plugin import logs
from fuse_plugin.broker.probes import serve_probes
from fuse_plugin.broker.server import Broker
from fuse_plugin.broker.settings import add_flags, from_args
from fuse_plugin.signals import stop_on_signals

__all__ = ["add_flags", "run"]


def run(args: argparse.Namespace) -> int:
    settings = from_args(args)
    log = logs.setup(settings.log_format, settings.log_level)
    broker = Broker(settings, log)
    stop_on_signals(log, broker.stop)
    with contextlib.ExitStack() as stack:
        if settings.metrics_port:  # first: answering (not ready) from the start
            stack.enter_context(serve_probes(broker, settings, log))
        broker.start()
        return broker.run()
