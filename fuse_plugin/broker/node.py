"""What the broker sets up on the node itself: the shim where Allocate binds it from and
the FUSE connections' control files (fusectl; ``records.abort`` uses them)."""

from __future__ import annotations

import os
import socket
from pathlib import Path

from fuse_plugin import files, logs, sockets
from fuse_plugin.broker import kernel, protocol, records


def install_shim(directory: Path, shim: bytes) -> Path:
    """Put the shim where Allocate binds it from, unless it is already there.

    A bind source that was missing when a container started is created by the runtime
    as an empty directory: removed here, so such a node recovers. An identical shim is
    left alone (containers bind that very file); temp files an interrupted start left
    are removed."""
    path = directory / protocol.SHIM_NAME
    for stale in directory.glob(f".{protocol.SHIM_NAME}.*.tmp"):
        files.discard(stale)
    if path.is_dir() and not path.is_symlink():
        path.rmdir()
    if files.read_or_none(path) != shim:
        files.write_atomic(path, shim, 0o755)
    return path


def take_over(path: Path) -> None:
    """``sockets.take_over`` for the loop's socket, logged on the broker's logger.
    Only until server.py calls ``sockets.take_over(path, self.log, SOCK_SEQPACKET)``
    itself, as lxcfs.py does: then this goes."""
    sockets.take_over(path, logs.get(), socket.SOCK_SEQPACKET)


def ensure_fusectl() -> None:
    """The FUSE connections' control files: mounted here if this namespace lacks them
    (a pod's /sys has the directory but not the filesystem)."""
    if not os.path.ismount(records.FUSECTL):
        kernel.mount("fusectl", str(records.FUSECTL), "fusectl", 0)

