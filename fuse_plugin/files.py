"""Whole-file writes: a reader (the kubelet, apparmor_parser, a pod) sees the old file or
the new one, never half of either."""

from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path


def staged(path: Path, data: bytes, mode: int = 0o644) -> Path:
    """Write ``data`` to a hidden temp file beside ``path`` (same filesystem), fsynced.

    The caller renames it over ``path`` with :func:`commit` or removes it with
    :func:`discard`. Hidden, so the AppArmor init scripts never load a staged file.
    """
    fd, name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as out:
            out.write(data)
            out.flush()
            os.fchmod(out.fileno(), mode)
            os.fsync(out.fileno())
    except BaseException:
        discard(Path(name))
        raise
    return Path(name)


def commit(temp: Path, path: Path) -> None:
    """Atomically replace ``path`` with ``temp`` and make the rename durable."""
    os.replace(temp, path)
    with contextlib.suppress(OSError):
        dir_fd = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)


def discard(temp: Path) -> None:
    with contextlib.suppress(FileNotFoundError):
        temp.unlink()


def write_atomic(path: Path, data: bytes, mode: int = 0o644) -> None:
    """Temp file + rename in the same directory."""
    commit(staged(path, data, mode), path)


def read_or_none(path: Path) -> bytes | None:
    try:
        return path.read_bytes()
    except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
        return None
