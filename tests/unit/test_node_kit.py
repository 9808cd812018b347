"""The node-daemon kit the three wings share, on real unix sockets: taking over a stale
socket of either kind (and only a socket), gRPC binding on a unix socket,
watchdog events to paths, and readiness checks. The wings' own tests prove each uses it;
these pin what the kit itself promises."""

from __future__ import annotations

import logging
import socket
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import pytest
from watchdog.events import FileCreatedEvent, FileMovedEvent

from fuse_plugin import grpc_unix, readiness, sockets
from fuse_plugin.watches import event_paths


@contextmanager
def listening(path: Path, kind: int) -> Iterator[socket.socket]:
    with socket.socket(socket.AF_UNIX, kind) as sock:
        sock.bind(str(path))
        sock.listen(1)
        yield sock


def stale(path: Path, kind: int) -> None:
    """A socket file nobody serves, as a killed process leaves it."""
    with listening(path, kind):
        pass
    assert path.is_socket()


def test_take_over_removes_a_stale_socket_and_says_so(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = tmp_path / "plugin.sock"
    stale(path, socket.SOCK_STREAM)
    with caplog.at_level(logging.INFO):
        sockets.take_over(path, logging.getLogger("test"))
    assert not path.exists()
    assert [r.getMessage() for r in caplog.records] == ["socket.stale_removed"]
    assert caplog.records[0].__dict__["fields"] == {"socket": str(path)}


def test_take_over_leaves_a_served_socket_and_is_silent_without_one(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = tmp_path / "plugin.sock"
    log = logging.getLogger("test")
    with caplog.at_level(logging.INFO):
        sockets.take_over(path, log)  # nothing there: nothing to say
        with listening(path, socket.SOCK_STREAM), pytest.raises(sockets.InUse):
            sockets.take_over(path, log)
        assert path.is_socket()
    assert caplog.records == []


def test_take_over_takes_only_a_stale_socket_of_the_kind_it_binds(tmp_path: Path) -> None:
    """The broker's sockets are SOCK_SEQPACKET: a stream connect to a live one would be
    refused and the socket wrongly taken as stale."""
    path = tmp_path / "broker.sock"
    log = logging.getLogger("test")
    stale(path, socket.SOCK_SEQPACKET)
    sockets.take_over(path, log, socket.SOCK_SEQPACKET)
    assert not path.exists()
    with listening(path, socket.SOCK_SEQPACKET), pytest.raises(sockets.InUse):
        sockets.take_over(path, log, socket.SOCK_SEQPACKET)
    path.unlink()
    path.write_text("not a socket")  # not ours to delete: left for the bind to refuse
    sockets.take_over(path, log)
    assert path.read_text() == "not a socket"


def test_grpc_binds_a_unix_socket_and_says_when_it_cannot(tmp_path: Path) -> None:
    with ThreadPoolExecutor(1) as executor:
        server = grpc_unix.server(executor)
        try:
            assert not grpc_unix.bind(server, tmp_path / "missing" / "a.sock")
            assert grpc_unix.bind(server, tmp_path / "a.sock")
            server.start()
            assert sockets.serving(tmp_path / "a.sock")
        finally:
            server.stop(None).wait()


def test_event_paths_are_the_source_and_a_moves_destination() -> None:
    assert event_paths(FileCreatedEvent("/dev/fuse")) == {"/dev/fuse"}
    assert event_paths(FileCreatedEvent(b"/dev/fuse")) == {"/dev/fuse"}
    assert event_paths(FileMovedEvent("/dev/.fuse.tmp", "/dev/fuse")) == {
        "/dev/.fuse.tmp", "/dev/fuse"}


def test_readiness_says_the_first_check_that_fails() -> None:
    unregistered = readiness.registered(False, "")
    assert unregistered == (False, "not registered with the kubelet")
    assert readiness.registered(False, "refused") == (
        False, "not registered with the kubelet refused")
    assert readiness.first_failing(readiness.READY, unregistered, (False, "later")) == \
        unregistered
    assert readiness.first_failing(readiness.READY, readiness.registered(True, "x")) == \
        (True, "ready")
