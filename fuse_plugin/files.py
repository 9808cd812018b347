"""Whole-file writes: a reader (the kubelet, apparmor_parser, a pod) sees the old file or
the new one, never half of either."""

from __future__ import annotations

import contextlib
import os
import stat
import tempfile
from pathlib import Path

# Profiles come from a ConfigMap, which holds at most 1 MiB in all.
READ_LIMIT = 1 << 20


class NotReadable(Exception):
    """Not a regular file of a sane size; the message says which, in a few words."""


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
    """Atomically replace ``path`` with ``temp`` and make the rename durable.

    The rename is the write: once it is done, a failing directory sync is not reported.
    """
    os.replace(temp, path)
    with contextlib.suppress(OSError):
        fsync_dir(path.parent)


def fsync_dir(directory: Path) -> None:
    """Make a rename or unlink in ``directory`` durable, not only the file's bytes.

    A directory that is gone has nothing left to sync.
    """
    try:
        fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    except FileNotFoundError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def discard(temp: Path) -> None:
    with contextlib.suppress(FileNotFoundError):
        temp.unlink()


def write_atomic(path: Path, data: bytes, mode: int = 0o644) -> None:
    """Temp file + rename in the same directory; on any failure no temp file is left."""
    temp = staged(path, data, mode)
    try:
        commit(temp, path)
    except BaseException:
        discard(temp)
        raise


def read_or_none(path: Path) -> bytes | None:
    try:
        return path.read_bytes()
    except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
        return None


def read_regular(path: Path, limit: int = READ_LIMIT) -> bytes:
    """The bytes of the regular file at ``path`` (symlinks followed), at most ``limit``.

    Raises OSError from the system (FileNotFoundError for a missing path) and NotReadable
    for anything but a regular file or one larger than ``limit``. A FIFO would block a
    plain open until a writer comes, /dev/zero never ends, and opening some devices
    acts (a watchdog arms): so nothing that stat() does not call a regular file is
    opened, and the open is non-blocking in case the path was swapped in between.
    """
    _require_regular(os.stat(path))
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC)
    try:
        _require_regular(os.fstat(fd))
        chunks, size = [], 0
        while size <= limit:
            chunk = os.read(fd, min(1 << 16, limit + 1 - size))
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
    finally:
        os.close(fd)
    if size > limit:
        raise NotReadable(f"larger than {limit} bytes")
    return b"".join(chunks)


def _require_regular(st: os.stat_result) -> None:
    if not stat.S_ISREG(st.st_mode):
        raise NotReadable(f"{describe(st.st_mode)}, not a regular file")


Identity = tuple[int, int]


def identity(path: Path, directory: bool = False) -> Identity | None:
    """What tells a file from one made anew at the same path, or None when there is
    none: inode and ctime together (ext4 hands a re-created file the same inode); for a
    directory, device and inode (its ctime moves with every entry made in it)."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return (st.st_dev, st.st_ino) if directory else (st.st_ino, st.st_ctime_ns)


def describe(mode: int) -> str:
    """A file type in words: 'a directory', 'a FIFO', ..."""
    for test, words in ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"),
                        (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
                        (stat.S_ISSOCK, "a socket"), (stat.S_ISLNK, "a symlink"),
                        (stat.S_ISREG, "a regular file")):
        if test(mode):
            return words
    return "an unknown kind of file"
