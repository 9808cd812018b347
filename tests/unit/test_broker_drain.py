"""The broker's drain on SIGTERM (issue 35: a rollout of its DaemonSet fails no mount).

The order, in the loop with stand-in helpers: the listening socket goes first (its path
removed, the connections in its queue reset, unaccepted), the requests already held are
served, and past the bound (``server.STOP_GRACE``) what was not acted on is refused with
``retry=1``, while a helper already told to mount finishes. Then the shim's side: a
refusal with ``retry=1`` is asked again of the next broker, like a reset, and a reset by a
real broker's closing listener is. The same with real containers and the real broker is
tests/containers/test_broker_drain.py."""

from __future__ import annotations

import collections
import logging
import os
import select
import socket
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from fuse_plugin.broker import caller as callers
from fuse_plugin.broker import messages, protocol, replies, scheduler, server
from fuse_plugin.broker.conversation import Conversation, State
from fuse_plugin.broker.helper import Job
from fuse_plugin.broker.server import Broker
from fuse_plugin.broker.settings import BrokerSettings
from tests.lib import broker as broker_rig
from tests.lib.manifests import MANIFESTS, one, pod_spec
from tests.lib.waiting import wait_for

# Four pods, one container each: a pod's helper share (2) never holds one back here.
A, B, C, D = (f"/kubepods/pod0f1e2d3c-4b5a-6978-8796-a5b4c3d2e1f{n}/c" for n in range(4))
MARK = {"status": "mark", "mark_dev": "", "mark_root": ""}  # the loop's own, unstarted
FACTS = {"status": "facts", "mount": "41", "fstype": "ext4", "mount_point": "/mnt",
         "shared": "0", "mode": "755", "owner": "0", "writable": "1", "uid": "0",
         "gid": "0"}
WAIT = 10.0  # seconds any step below may take before the test fails
STOPPING = "broker refused: the broker is stopping and did nothing of this request; try again"


class GatedHelper:
    """A stand-in helper whose reports the test lets through (``say``): its ctl is a real
    socket in the loop's selector, and its pidfd a pipe that turns readable when it is
    killed. It has exited once it has said everything, or was killed."""

    def __init__(self, said: list[dict[str, str]]) -> None:
        self.said = said
        self.ctl, self._gate = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.ctl.setblocking(False)
        self.pidfd, self._exit = os.pipe()
        self.deadline = time.monotonic() + 60
        self.sent: list[messages.Answer] = []
        self.killed_at: float | None = None
        self.aborted = False
        self.closed = False

    def say(self, count: int = 1) -> None:
        for _ in range(count):
            self._gate.send(b".")

    def receive(self) -> dict[str, str] | None:
        try:
            self.ctl.recv(1)
        except BlockingIOError:
            return None
        return self.said.pop(0)

    def send(self, answer: messages.Answer) -> None:
        self.sent.append(answer)

    def kill(self) -> None:
        if self.killed_at is None:
            self.killed_at = time.monotonic()
            os.write(self._exit, b".")

    def exited(self) -> bool:
        return not self.said or self.killed_at is not None

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            for sock in (self.ctl, self._gate):
                sock.close()
            for fd in (self.pidfd, self._exit):
                os.close(fd)


def mounting(connection: int) -> list[dict[str, str]]:
    """A helper's four reports for a mount that the kernel gives ``connection``."""
    dev = f"0:{connection}"
    return [MARK, FACTS, {"status": "built", "dev": dev},
            {"status": "ok", "mnt_id": str(100 + connection), "dev": dev, "options": "rw"}]


class Seen(logging.Handler):
    """The broker's lines, each with whether its socket's path still existed when it
    was logged (in the loop's own thread, so at that very point of the drain)."""

    def __init__(self, socket_path: Path) -> None:
        super().__init__()
        self.socket_path = socket_path
        self.lines: list[tuple[str, dict[str, Any], bool]] = []

    def emit(self, record: logging.LogRecord) -> None:
        fields: dict[str, Any] = getattr(record, "fields", {})
        self.lines.append((record.getMessage(), fields, self.socket_path.exists()))


@pytest.fixture
def broker(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Broker]:
    """A broker listening in tmp_path/dir, its records on a stand-in fusectl, each
    helper a ``GatedHelper`` that the test chose for the request's path."""
    log = logging.getLogger("test.drain")
    log.setLevel(logging.INFO)
    loop = Broker(BrokerSettings(directory=tmp_path / "dir", state=tmp_path / "state",
                                 lxcfs_dir=tmp_path / "lxcfs",
                                 max_mounts=4), log)
    loop.records.fusectl = tmp_path / "connections"
    loop.records.fusectl.mkdir()
    loop.records.load()
    loop.settings.directory.mkdir()
    loop._listen()
    yield loop
    if loop._listener is not None:  # the test failed before the drain
        loop._listener.close()
    loop._selector.close()


def held(broker: Broker, container: str, path: str, waiting: bool = False
         ) -> tuple[Conversation, socket.socket]:
    """A request the broker holds (admitted: its slot taken, as ``prepare`` takes it),
    or, ``waiting``, a connection accepted whose request has not arrived; the caller's
    end of its connection."""
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    ours.setblocking(False)
    theirs.settimeout(WAIT)
    who = callers.Caller(pid=1, uid=0, gid=0, pidfd=-1, container=container)
    work = Conversation(ours, who, time.monotonic() + 60)
    work.fields.update(cgroup=container, path=path)
    if waiting:
        broker.requests._waiting[ours.fileno()] = work
        broker.requests.receive(work)  # nothing to read: watched by the selector
        return work, theirs
    work.parsed = protocol.Request(op="mount", path=path, fuse_fd=3)
    work.slot = broker.admission.admit(container)
    work.advance(State.QUEUED)
    broker.helpers.queued.setdefault(container, collections.deque()).append(work)
    return work, theirs


def reply(sock: socket.socket) -> dict[str, str]:
    return protocol.decode(sock.recv(protocol.MAX_MESSAGE))


def hold_everything(broker: Broker, helpers: dict[str, GatedHelper]
                    ) -> tuple[dict[str, socket.socket], Conversation, socket.socket]:
    """What the broker holds in the test below when SIGTERM comes: the callers' ends of
    its connections, D's (no request yet) and one in the listen queue."""
    clients = {path: held(broker, container, f"/mnt/{path}")[1] for path, container in
               (("a1", A), ("a2", A), ("b1", B), ("b2", B), ("c1", C))}
    w, clients["d"] = held(broker, D, "(none yet)", waiting=True)
    for container in (A, B, C):
        broker.helpers.next(container)  # the first of each starts its helper
    helpers["/mnt/b1"].say()  # B's helper reports its mark, then stalls
    broker.requests.hear(broker.helpers.running[B])
    helpers["/mnt/c1"].say(2)  # C's is told to go on past the facts
    broker.requests.hear(broker.helpers.running[C])
    broker.requests.hear(broker.helpers.running[C])
    assert broker.helpers.running[C].acting
    assert not broker.helpers.running[B].acting
    helpers["/mnt/a1"].say(4)  # A's have everything to say, once heard
    helpers["/mnt/a2"].say(4)
    queued = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    queued.settimeout(WAIT)
    queued.connect(str(broker.socket_path))  # in the listen queue, never accepted
    queued.send(protocol.encode(v="2", op="unmount", path="/mnt/q"))
    return clients, w, queued


def test_the_drain_stops_accepting_serves_what_it_holds_and_refuses_the_rest_with_retry(
        broker: Broker, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """What the broker holds when SIGTERM comes: A's mount with its helper at work and a
    second one queued behind it, B's likewise but its helper stalls, C's helper already
    told to mount (past the facts), D's connection with no request yet, and a caller in
    the listen queue. The listener goes first; A's two are served; past the bound, D's,
    B's queued one and B's running one (killed) are refused with retry=1; C's finishes
    after the bound."""
    monkeypatch.setattr(server, "STOP_GRACE", 2.0)
    kernel = broker.records.fusectl
    for connection in (41, 42, 43):
        (kernel / str(connection)).mkdir()
    helpers = {"/mnt/a1": GatedHelper(mounting(41)), "/mnt/a2": GatedHelper(mounting(42)),
               "/mnt/b1": GatedHelper(mounting(44)), "/mnt/b2": GatedHelper(mounting(45)),
               "/mnt/c1": GatedHelper(mounting(43))}

    started: list[str] = []

    def start(program: Path, caller: callers.Caller, request: protocol.Request,
              deadline: float, charge: object = ()) -> GatedHelper:
        started.append(request.path)
        return helpers[request.path]

    monkeypatch.setattr(Job, "start", start)
    seen = Seen(broker.socket_path)
    broker.log.addHandler(seen)
    clients: dict[str, socket.socket] = {}
    try:
        clients, w, queued = hold_everything(broker, helpers)
        clients["queued"] = queued
        broker.stop()
        loop = threading.Thread(target=broker.run, name="broker")
        loop.start()
        # Past the bound: B's and D's are refused, with retry; C's is still at work.
        answers = {name: reply(clients[name]) for name in ("a1", "a2", "b1", "b2", "d")}
        helpers["/mnt/c1"].say(2)
        answers["c1"] = reply(clients["c1"])
        loop.join(WAIT)
        assert not loop.is_alive()
        with pytest.raises(ConnectionResetError):
            queued.recv(protocol.MAX_MESSAGE)  # what the shim asks again on
        with pytest.raises(FileNotFoundError), \
                socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as late:
            late.connect(str(broker.socket_path))
    finally:
        broker.log.removeHandler(seen)
        for helper in helpers.values():
            helper.close()
        for sock in clients.values():
            sock.close()

    assert {name: (a["status"], a.get("retry"), a.get("message")) for name, a in
            answers.items()} == {
        "a1": ("ok", None, None), "a2": ("ok", None, None), "c1": ("ok", None, None),
        "b1": ("error", "1", STOPPING), "b2": ("error", "1", STOPPING),
        "d": ("error", "1", STOPPING)}
    lines = [(event, fields.get("path"), fields.get("retry"), path_there)
             for event, fields, path_there in seen.lines]
    assert lines == [
        ("broker.mount", "/mnt/a1", None, False), ("broker.mount", "/mnt/a2", None, False),
        ("broker.refused", "(none yet)", True, False),
        ("broker.refused", "/mnt/b2", True, False), ("broker.refused", "/mnt/b1", True, False),
        ("broker.mount", "/mnt/c1", None, False), ("stopped", None, None, False)]
    assert [name for name, h in helpers.items() if h.killed_at is not None] == ["/mnt/b1"]
    assert started == ["/mnt/a1", "/mnt/b1", "/mnt/c1", "/mnt/a2"]  # B's second: never
    assert (broker.admission.in_flight, broker.admission.node()) == (0, 3)
    assert w.state is State.ANSWERED


def test_a_silent_connection_does_not_hold_the_drain(
        broker: Broker, monkeypatch: pytest.MonkeyPatch) -> None:
    """Nothing else held: a connection that sent nothing is refused with retry=1 at once,
    not at the bound (a tenant's silent connections would slow every rollout). One whose
    request had arrived when SIGTERM came is read and served as usual (here an unmount of
    nothing the broker made: refused by its rule, not handed on)."""
    monkeypatch.setattr(server, "STOP_GRACE", 3600.0)
    _, silent = held(broker, A, "(none yet)", waiting=True)
    _, arrived = held(broker, B, "(none yet)", waiting=True)
    arrived.send(protocol.encode(v="2", op="unmount", path="/mnt/x"))
    broker.stop()
    loop = threading.Thread(target=broker.run, name="broker")
    loop.start()
    loop.join(WAIT)
    assert not loop.is_alive()
    with silent, arrived:
        assert reply(silent) == {"status": "error", "retry": "1", "message": STOPPING}
        answer = reply(arrived)
    assert "retry" not in answer
    assert "not a mount the broker made for this container" in answer["message"]


def test_the_daemonsets_grace_period_covers_the_longest_drain() -> None:
    """SIGTERM to exit: the drain, then a helper already told to mount may take the rest
    of its deadline; the kubelet's SIGKILL must come after both, with time to exit."""
    daemonset = one(MANIFESTS / "broker" / "broker-daemonset.yaml", "DaemonSet")
    grace = pod_spec(daemonset)["terminationGracePeriodSeconds"]
    assert grace >= server.STOP_GRACE + scheduler.HELPER_DEADLINE + 5


# -- the shim -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def shim() -> Path:
    return broker_rig.shim()


def _listening(path: Path) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    sock.bind(str(path))
    sock.listen(1)
    sock.settimeout(WAIT)
    return sock


def _first_line(proc: subprocess.Popen[str]) -> str:
    assert proc.stderr is not None
    ready, _w, _x = select.select([proc.stderr], [], [], WAIT)
    assert ready, f"the shim said nothing within {WAIT:g}s"
    return proc.stderr.readline().rstrip("\n")


def _finish(proc: subprocess.Popen[str]) -> tuple[int, str]:
    try:
        _, err = proc.communicate(timeout=WAIT)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(WAIT)
    return proc.returncode, err


def _serve_one(listener: socket.socket, **answer: object) -> protocol.Request:
    conn, _ = listener.accept()
    with conn:
        request = protocol.parse_request(conn.recv(protocol.MAX_MESSAGE))
        replies.answer(conn, protocol.encode(**answer))
    return request



def test_shim_asks_the_next_broker_when_a_stopping_one_says_retry(
        shim: Path, tmp_path: Path) -> None:
    """A refusal with retry=1 is not the user's answer: the shim says once that it
    waits, and the broker that replaces the stopping one serves the request."""
    path = tmp_path / "b.sock"
    stopping = _listening(path)
    proc = subprocess.Popen([str(shim), "-u", str(tmp_path / "x")],
                            env={protocol.SOCKET_ENV: str(path)}, stderr=subprocess.PIPE,
                            text=True)
    try:
        with stopping:
            _serve_one(stopping, status="error", message=STOPPING,
                       **{protocol.RETRY_FIELD: 1})
        path.unlink()  # the stopping broker removed its socket when it stopped listening
        said = _first_line(proc)
        with _listening(path) as replacing:
            request = _serve_one(replacing, status="ok", mount_id=7)
    finally:
        status = _finish(proc)
    assert said == (f"fusermount3: the FUSE mount broker at {path} is not answering (it is "
                    "stopping); waiting up to 30 s for it to restart")
    assert (request.op, request.path) == ("unmount", str(tmp_path / "x"))
    assert status == (0, "")


@pytest.mark.parametrize("retry", ["1", "0"])
def test_shim_with_no_wait_or_without_retry_prints_the_refusal(
        shim: Path, tmp_path: Path, retry: str) -> None:
    """With no wait (FUSE_BROKER_WAIT=0) a retry=1 refusal is what the user sees, at
    once; and any other value of the field is no request to ask again."""
    path = tmp_path / "b.sock"
    env = {protocol.SOCKET_ENV: str(path)}
    if retry == "1":
        env[protocol.WAIT_ENV] = "0"
    with _listening(path) as stopping:
        proc = subprocess.Popen([str(shim), "-u", str(tmp_path / "x")], env=env,
                                stderr=subprocess.PIPE, text=True)
        try:
            _serve_one(stopping, status="error", message=STOPPING,
                       **{protocol.RETRY_FIELD: retry})
        finally:
            status = _finish(proc)
    assert status == (1, f"fusermount3: {STOPPING}\n")


def test_shim_in_a_real_brokers_listen_queue_asks_the_next_broker(
        shim: Path, tmp_path: Path) -> None:
    """The shim connected and sent while the broker was not accepting; the broker stops:
    closing its listener resets the connection, unread, and the shim waits for the next
    broker, which gets the request."""
    broker = Broker(BrokerSettings(directory=tmp_path / "dir", state=tmp_path / "state",
                                   lxcfs_dir=tmp_path / "lxcfs"),
                    logging.getLogger("test.drain"))
    broker.settings.directory.mkdir()
    broker._listen()
    assert broker._listener is not None
    proc = subprocess.Popen([str(shim), "-u", str(tmp_path / "x")],
                            env={protocol.SOCKET_ENV: str(broker.socket_path)},
                            stderr=subprocess.PIPE, text=True)
    try:
        # In the queue once the listener reads ready; sent once the shim waits for a reply
        # (the one thing it does after its send).
        ready, _w, _x = select.select([broker._listener], [], [], WAIT)
        assert ready, "the shim did not connect"
        wait_for(lambda: _in_recv(proc.pid), WAIT, "the shim to wait for its reply")
        broker.stop()
        broker.run()
        said = _first_line(proc)
        with _listening(broker.socket_path) as replacing:
            request = _serve_one(replacing, status="ok", mount_id=7)
    finally:
        status = _finish(proc)
    assert said == (f"fusermount3: the FUSE mount broker at {broker.socket_path} is not "
                    "answering (it closed the connection unread); waiting up to 30 s for "
                    "it to restart")
    assert request.op == "unmount"
    assert status == (0, "")


# recvfrom on x86-64 and arm64 (recvmsg too, for libcs that use it).
RECEIVES = {"45", "47", "207", "212"}


def _in_recv(pid: int) -> bool:
    """The process sits in a receive call (musl's recv is recvfrom)."""
    with open(f"/proc/{pid}/syscall") as status:
        call = status.read().split()
    return bool(call) and call[0] in RECEIVES
