"""What the broker sets up on the node itself: the shim where Allocate binds it from,
the FUSE connections' control files (fusectl; ``records.abort`` uses them) and the
node's cgroups its helpers are charged in."""

from __future__ import annotations

import os
from pathlib import Path

from fuse_plugin import files
from fuse_plugin.broker import cgroups, kernel, protocol, records
from fuse_plugin.errors import EXIT_USAGE, Failure


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


def ensure_fusectl() -> None:
    """The FUSE connections' control files: mounted here if this namespace lacks them
    (a pod's /sys has the directory but not the filesystem)."""
    if not os.path.ismount(records.FUSECTL):
        kernel.mount("fusectl", str(records.FUSECTL), "fusectl", 0)


def charge() -> cgroups.Charge:
    """The hierarchies helpers are charged in, from the node's cgroup namespace; a
    ``Failure`` at start if the broker cannot write them (fail closed: no helper would
    ever run in the broker's cgroups)."""
    try:
        cgroups.enter_node_namespace()
        return cgroups.node_charge()
    except cgroups.Unwritable as err:
        raise Failure(str(err), EXIT_USAGE) from None
    except OSError as err:
        raise Failure(f"cannot see the node's cgroups: {err.strerror or err} (the broker "
                      "needs host PID and CAP_SYS_ADMIN to join the node's cgroup "
                      "namespace)") from None
