"""A gRPC server on unix sockets: how the plugin serves the kubelet's device-plugin API
and the DRA driver its DRA and registration services, each on sockets in the kubelet's
directories that one process owns (``sockets.take_over`` clears a killed one's first)."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc

# SO_REUSEPORT (gRPC's default) lets servers share a TCP port; a socket path is ours
# alone, and the stale-socket check decides who may bind it.
OPTIONS = (("grpc.so_reuseport", 0),)


def server(executor: ThreadPoolExecutor) -> grpc.Server:
    """A server whose handlers run on ``executor``; ``bind`` gives it its sockets."""
    return grpc.server(executor, options=list(OPTIONS))


def bind(server: grpc.Server, path: Path) -> bool:
    """Add the unix socket ``path`` to ``server`` (before it starts): False when gRPC
    cannot bind it, which it says with nothing more than a RuntimeError, so the caller
    words the reason (a missing directory, a path in use)."""
    try:
        server.add_insecure_port(f"unix://{path}")
    except RuntimeError:
        return False
    return True
