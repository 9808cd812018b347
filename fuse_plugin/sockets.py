"""Whether a unix socket on the node is alive: the one way the plugin (its own socket
left by a crash?), the broker (another broker on its path?) and the doctor (the kubelet's
and the plugin's sockets) tell a serving socket from a stale file."""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from fuse_plugin import logs

CONNECT_TIMEOUT = 1.0
# sockaddr_un.sun_path holds 108 bytes including the NUL: the one limit on a unix
# socket's path, for the sockets we bind and those we dial.
SUN_PATH_MAX = 107


def too_long(path: Path) -> str | None:
    """Why ``path`` does not fit sockaddr_un, or None when it does. A socket we bind
    must fit (the settings refuse a longer one before anything starts); one we dial can
    be reached by a detour (``dialable``)."""
    size = len(os.fsencode(path))
    if size <= SUN_PATH_MAX:
        return None
    return f"{path} would be {size} bytes, more than a unix socket path holds " \
        f"({SUN_PATH_MAX})"


@contextmanager
def dialable(path: Path) -> Iterator[str]:
    """A name for ``path`` short enough for connect(2): itself, or one via /proc/self/fd."""
    if too_long(path) is None:
        yield str(path)
        return
    fd = os.open(path.parent, os.O_PATH | os.O_DIRECTORY)
    try:
        yield f"/proc/self/fd/{fd}/{path.name}"
    finally:
        os.close(fd)


def refusal(path: Path, kind: int = socket.SOCK_STREAM,
            timeout: float = CONNECT_TIMEOUT) -> OSError | None:
    """Open and close one connection: None when something serves ``path``, else why
    not (ECONNREFUSED: a stale file; ENOENT: none; ...)."""
    with socket.socket(socket.AF_UNIX, kind) as sock:
        sock.settimeout(timeout)
        try:
            with dialable(path) as target:
                sock.connect(target)
        except OSError as err:
            return err
    return None


def serving(path: Path, kind: int = socket.SOCK_STREAM) -> bool:
    return refusal(path, kind) is None


class InUse(Exception):
    """A process serves the socket: it is not ours to take."""


def take_over(path: Path, log: logging.Logger, kind: int = socket.SOCK_STREAM) -> None:
    """Make ``path`` free for a new bind of a ``kind`` socket: remove the socket file a
    killed process left there, with the one line (``socket.stale_removed``) that says so.

    Raises ``InUse`` when a live process serves it (never take a running peer's socket)
    and OSError when it cannot be removed; what those mean is each wing's to say (the
    plugin waits, the DRA driver and the broker refuse to start). Only a socket is
    taken: a file or directory at the path is not ours to delete, and the bind refuses
    it with its own error."""
    if not path.is_socket():
        return
    if serving(path, kind):
        raise InUse(f"another process serves {path}")
    try:
        path.unlink()
    except FileNotFoundError:
        return
    logs.event(log, "socket.stale_removed", socket=str(path))
