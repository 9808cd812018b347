"""The broker names a caller's container once per process: reading /proc/PID/cgroup was a
third of its time per refused request under a flood, which comes from a few processes.
The key is the process's pidfd inode, which the kernel never gives another process: a
new process, even one that gets the old pid, is read afresh."""

from __future__ import annotations

import collections
import os
import socket
from pathlib import Path

import pytest

from fuse_plugin.broker import caller

pytestmark = pytest.mark.skipif(not caller._pidfd_inodes_unique(),
                                reason="pidfds share one inode before Linux 6.9 (no cache)")


@pytest.fixture(autouse=True)
def empty_cache(monkeypatch: pytest.MonkeyPatch) -> None:
    """Other tests identify this process too: each test here starts from nothing."""
    monkeypatch.setattr(caller, "_CONTAINERS", collections.OrderedDict())


def _connected(tmp_path: Path) -> tuple[socket.socket, socket.socket]:
    server = socket.socket(socket.AF_UNIX)
    server.bind(str(tmp_path / "s"))
    server.listen(1)
    client = socket.socket(socket.AF_UNIX)
    client.connect(str(tmp_path / "s"))
    conn, _ = server.accept()
    server.close()
    (tmp_path / "s").unlink()
    return client, conn


def test_the_same_process_is_named_without_reading_proc_again(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    reads: list[int] = []
    real = caller._cgroup

    def counting(pid: int) -> str:
        reads.append(pid)
        return real(pid)

    monkeypatch.setattr(caller, "_cgroup", counting)
    named = []
    for _ in range(3):
        client, conn = _connected(tmp_path)
        with client, conn:
            who = caller.identify(conn)
            named.append(who.container)
            who.close()
    assert reads == [os.getpid()]
    assert named == [real(os.getpid())] * 3


def test_another_process_is_read_afresh(tmp_path: Path,
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    client, conn = _connected(tmp_path)
    with client, conn:
        caller.identify(conn).close()  # this process is known now
    monkeypatch.setattr(caller, "_cgroup", lambda pid: f"/read-for-{pid}")
    with socket.socket(socket.AF_UNIX) as server:
        server.bind(str(tmp_path / "c"))
        server.listen(1)
        server.settimeout(30)  # a deadline, should the child fail before it connects
        child = os.fork()
        if child == 0:  # a new process: its own pidfd inode, whatever its pid
            try:
                with socket.socket(socket.AF_UNIX) as mine:
                    mine.connect(str(tmp_path / "c"))
                    mine.recv(1)
            finally:
                os._exit(0)
        conn, _ = server.accept()
        with conn:
            who = caller.identify(conn)
            assert who.container == f"/read-for-{child}"
            who.close()
    os.waitpid(child, 0)


def test_the_cache_is_bounded(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(caller, "CACHED_PROCESSES", 2)
    monkeypatch.setattr(caller, "_CONTAINERS", collections.OrderedDict(
        (n, f"/c{n}") for n in range(1, 3)))
    client, conn = _connected(tmp_path)
    with client, conn:
        caller.identify(conn).close()
    assert len(caller._CONTAINERS) == 2
    assert 1 not in caller._CONTAINERS  # the least recently used went first
