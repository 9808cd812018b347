"""The HTTP probes of the plugin and the broker, read as the kubelet reads them."""

from __future__ import annotations

import urllib.error
import urllib.request

# How long a fast test waits for a probe to change its answer.
DEADLINE = 10.0


def get(port: int, path: str) -> tuple[int, str]:
    """(status, body) of ``GET http://127.0.0.1:<port><path>``, errors included."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as reply:
            return reply.status, reply.read().decode()
    except urllib.error.HTTPError as err:
        return err.code, err.read().decode()
