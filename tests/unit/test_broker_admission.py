"""Admission that reserves (issue 34, fuse_plugin/broker/admission.py): the mount caps
are one count of the mounts held (the records) and the requests in flight (slots).

First the count itself (admit, commit, release); then the loop's bookkeeping with
stand-in helpers: a mount request's slot is given back on every way a request ends, and
turned into the record on success. The race in real containers is
tests/containers/test_broker_admission.py."""

from __future__ import annotations

import collections
import logging
import socket
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import cast

import pytest

from fuse_plugin.broker import caller as callers
from fuse_plugin.broker import messages, protocol, server
from fuse_plugin.broker.admission import Admission, Limits
from fuse_plugin.broker.conversation import Conversation, State
from fuse_plugin.broker.helper import Job
from fuse_plugin.broker.policy import Refused
from fuse_plugin.broker.records import Record, Records
from fuse_plugin.broker.server import Broker
from fuse_plugin.broker.settings import BrokerSettings

POD = "/kubepods/pod0f1e2d3c-4b5a-6978-8796-a5b4c3d2e1f0"
A, B, C = (f"{POD}/{name}" for name in ("a", "b", "c"))
ELSEWHERE = "/kubepods/pod11111111-2222-3333-4444-555555555555/x"


class Kernel:
    """A stand-in fusectl: a connection lives as long as its directory."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.next = 40
        root.mkdir()

    def connect(self) -> int:
        number, self.next = self.next, self.next + 1
        (self.root / str(number)).mkdir()
        return number

    def end(self, number: int) -> None:
        (self.root / str(number)).rmdir()

    def record(self, number: int, container: str) -> Record:
        return Record(connection=number, ctl_inode=(self.root / str(number)).stat().st_ino,
                      container=container, uid=0, namespace=1, mount_id=0, path="/mnt/x")


@pytest.fixture
def kernel(tmp_path: Path) -> Kernel:
    return Kernel(tmp_path / "connections")


def counted(tmp_path: Path, kernel: Kernel, per_container: int = 2, per_pod: int = 3,
            node: int = 5) -> Admission:
    held = Records(tmp_path / "state", kernel.root)
    held.load()
    return Admission(held, Limits(per_container=per_container, per_pod=per_pod, node=node))


# -- the count ----------------------------------------------------------------------------


def test_requests_in_flight_count_against_the_containers_cap(tmp_path: Path,
                                                             kernel: Kernel) -> None:
    count = counted(tmp_path, kernel)
    count.admit(A)
    count.admit(A)  # nothing is mounted yet: two requests in flight
    with pytest.raises(Refused, match=r"already holds 2 FUSE mounts.*--max-mounts 2") as no:
        count.admit(A)
    assert no.value.kind == "quota"
    assert (count.container(A), count.container(B), count.in_flight) == (2, 0, 2)


def test_requests_in_flight_count_against_the_pods_share(tmp_path: Path,
                                                         kernel: Kernel) -> None:
    count = counted(tmp_path, kernel)
    for container in (A, A, B):
        count.admit(container)
    with pytest.raises(Refused, match=r"the pod .* already holds 3 .*--max-mounts-pod 3"):
        count.admit(C)
    assert count.pod(POD) == 3
    count.admit(ELSEWHERE)  # another pod's share is its own


def test_requests_in_flight_count_against_the_nodes_cap(tmp_path: Path,
                                                        kernel: Kernel) -> None:
    count = counted(tmp_path, kernel, node=4)
    slot = count.admit(A)
    count.commit(slot, kernel.record(kernel.connect(), A))  # one held
    for container in (A, B, ELSEWHERE):  # three in flight
        count.admit(container)
    with pytest.raises(Refused, match=r"node already holds 4 .*--max-mounts-node 4"):
        count.admit(f"{ELSEWHERE}2")
    assert count.node() == 4


def test_a_committed_slot_is_its_record_and_counts_once(tmp_path: Path,
                                                        kernel: Kernel) -> None:
    count = counted(tmp_path, kernel)
    slot = count.admit(A)
    connection = kernel.connect()
    count.commit(slot, kernel.record(connection, A))
    assert (count.container(A), count.pod(POD), count.node(), count.in_flight) == (1, 1, 1, 0)
    count.release(slot)  # the request's end, after its record took the slot: nothing
    assert count.container(A) == 1
    kernel.end(connection)  # the kernel let the mount go
    assert count.container(A) == 0


def test_a_released_slot_counts_no_more_and_releasing_twice_is_harmless(
        tmp_path: Path, kernel: Kernel) -> None:
    count = counted(tmp_path, kernel)
    first, second = count.admit(A), count.admit(A)
    count.release(first)
    count.release(first)
    count.release(None)  # a request that never took a slot (an unmount, a refusal)
    assert (count.container(A), count.in_flight) == (1, 1)
    count.admit(A)
    count.release(second)
    assert count.container(A) == 1


def test_a_record_that_cannot_be_written_leaves_the_slot_until_the_request_ends(
        tmp_path: Path, kernel: Kernel) -> None:
    count = counted(tmp_path, kernel)
    slot = count.admit(A)
    connection = kernel.connect()
    count.records.directory = tmp_path / "gone"  # no directory: the write fails
    with pytest.raises(FileNotFoundError):
        count.commit(slot, kernel.record(connection, A))
    assert count.records.owner(connection) is None  # no record, no mount
    assert (count.container(A), count.in_flight) == (1, 1)
    count.release(slot)
    assert count.container(A) == 0


def test_a_mount_the_broker_unmounted_counts_no_more_once_the_kernel_lets_it_go(
        tmp_path: Path, kernel: Kernel) -> None:
    count = counted(tmp_path, kernel)
    pinned, gone = kernel.connect(), kernel.connect()
    for connection in (pinned, gone):
        count.commit(count.admit(A), kernel.record(connection, A))
    kernel.end(gone)
    count.unmounted(gone)
    count.unmounted(pinned)  # lazily unmounted but held open: the kernel still holds it
    count.unmounted(99)  # not the broker's: nothing
    assert count.node() == 1  # counted without another check of the records


def test_after_a_restart_only_the_records_count(tmp_path: Path, kernel: Kernel) -> None:
    """Slots die with the broker, as its requests in flight do."""
    count = counted(tmp_path, kernel)
    count.commit(count.admit(A), kernel.record(kernel.connect(), A))
    count.admit(A)
    count.admit(B)
    restarted = counted(tmp_path, kernel)
    assert (restarted.container(A), restarted.pod(POD), restarted.node()) == (1, 1, 1)
    assert restarted.in_flight == 0


# -- every way a request ends, in the loop --------------------------------------------------


class StandInJob:
    """A helper that says what the test has it say; ``receive`` hands out ``said``."""

    def __init__(self, said: list[dict[str, str]], deadline: float) -> None:
        self.said = said
        self.deadline = deadline
        self.sent: list[messages.Answer] = []
        self.killed_at: float | None = None
        self.aborted = False
        self.ctl = -1
        self.pidfd = -1

    def receive(self) -> dict[str, str] | None:
        return self.said.pop(0) if self.said else None

    def send(self, answer: messages.Answer) -> None:
        self.sent.append(answer)

    def kill(self) -> None:
        self.killed_at = time.monotonic()

    def exited(self) -> bool:
        return True

    def close(self) -> None:
        pass


@pytest.fixture
def loop(tmp_path: Path, kernel: Kernel, monkeypatch: pytest.MonkeyPatch) -> Iterator[Broker]:
    monkeypatch.setattr(server, "STOP_GRACE", 0.0)  # stop: no turns waiting on stand-ins
    broker = Broker(BrokerSettings(directory=tmp_path / "dir", state=tmp_path / "state",
                                   lxcfs_dir=tmp_path / "lxcfs",
                                   max_mounts=2), logging.getLogger("test"))
    broker.records.fusectl = kernel.root
    broker.records.load()
    yield broker
    broker._selector.close()


def mount_request(broker: Broker, container: str = A,
                  pid: int = 1) -> tuple[Conversation, socket.socket]:
    """An admitted mount request (its place among the open requests taken, as accept
    takes it, and its slot, as ``prepare`` takes it); the caller's end of its
    connection."""
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    who = callers.Caller(pid=pid, uid=0, gid=0, pidfd=-1, container=container)
    work = Conversation(ours, who, time.monotonic() + 5, ticket=broker.open.admit(container))
    work.parsed = protocol.Request(op="mount", path="/mnt/x", fuse_fd=3)
    work.slot = broker.admission.admit(container)
    return work, theirs


def running(broker: Broker, said: list[dict[str, str]],
            deadline: float | None = None) -> tuple[Conversation, socket.socket, StandInJob]:
    """An admitted mount request whose helper is at work."""
    work, theirs = mount_request(broker)
    job = StandInJob(said, deadline if deadline is not None else time.monotonic() + 5)
    work.job = cast("Job", job)
    work.advance(State.QUEUED)
    work.advance(State.RUNNING)
    broker.helpers.running[work.container] = work
    return work, theirs, job


def answer(sock: socket.socket) -> str:
    sock.setblocking(False)
    fields = protocol.decode(sock.recv(protocol.MAX_MESSAGE))
    return fields.get("message") or fields["status"]


MARK = {"status": "mark", "mark_dev": "", "mark_root": ""}  # the loop's own, unstarted
FACTS = {"status": "facts", "mount": "41", "fstype": "ext4", "mount_point": "/mnt",
         "shared": "0", "mode": "755", "owner": "0", "writable": "1", "uid": "0",
         "gid": "0"}


def refused_by_the_helper(broker: Broker, patch: pytest.MonkeyPatch) -> socket.socket:
    work, theirs, _ = running(broker, [{"status": "refused", "message": "no", "kind": "path"}])
    broker.requests.hear(work)
    return theirs


def helper_died(broker: Broker, patch: pytest.MonkeyPatch) -> socket.socket:
    work, theirs, _ = running(broker, [MARK])
    broker.requests.hear(work)  # a step, then it is gone without a word
    broker.requests.exited(work)
    return theirs


def past_its_deadline(broker: Broker, patch: pytest.MonkeyPatch) -> socket.socket:
    _, theirs, _ = running(broker, [], deadline=time.monotonic() - 1)
    broker._expire(time.monotonic())
    return theirs


def broker_stopping(broker: Broker, patch: pytest.MonkeyPatch) -> socket.socket:
    _, theirs, _ = running(broker, [MARK])
    broker._close()
    return theirs


def broker_stopping_while_queued(broker: Broker, patch: pytest.MonkeyPatch
                                 ) -> socket.socket:
    work, theirs = mount_request(broker)
    work.advance(State.QUEUED)
    broker.helpers.queued[work.container] = collections.deque([work])
    broker._close()
    return theirs


def caller_gone(broker: Broker, patch: pytest.MonkeyPatch) -> socket.socket:
    """Admitted, then its process is found gone when its namespaces are opened: the
    real ``prepare`` takes the slot and the refusal gives it back."""
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    exited = subprocess.Popen(["true"])
    exited.wait()
    who = callers.Caller(pid=exited.pid, uid=0, gid=0, pidfd=-1, container=A)
    work = Conversation(ours, who, time.monotonic() + 5, ticket=broker.open.admit(A))
    broker.requests._waiting[ours.fileno()] = work
    theirs.send(protocol.encode(v="2", op="mount", path="/mnt/x", fuse_fd="3"))
    broker.requests.receive(work)
    return theirs


def helper_cannot_start(broker: Broker, patch: pytest.MonkeyPatch) -> socket.socket:
    def start(*args: object) -> None:
        raise OSError(5, "stand-in: no helper is run here")

    patch.setattr(Job, "start", start)
    work, theirs = mount_request(broker)
    work.advance(State.QUEUED)
    broker.helpers.queued[work.container] = collections.deque([work])
    broker.helpers.next(work.container)
    return theirs


End = Callable[[Broker, pytest.MonkeyPatch], socket.socket]
ENDS: dict[str, tuple[End, str]] = {
    "refused by the helper": (refused_by_the_helper, "broker refused: no"),
    "helper died": (helper_died, "exited without an answer"),
    "past its deadline": (past_its_deadline, "did not finish within"),
    "broker stopping": (broker_stopping, "the broker is stopping"),
    "broker stopping, queued": (broker_stopping_while_queued, "the broker is stopping"),
    "caller gone": (caller_gone, "has exited"),
    "helper cannot start": (helper_cannot_start, "cannot start fuse-broker-helper"),
}


@pytest.mark.parametrize("end", list(ENDS))
def test_every_end_of_a_request_gives_its_slot_back(
        loop: Broker, end: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """And its place among the open requests (``shares.OpenRequests``)."""
    drive, words = ENDS[end]
    theirs = drive(loop, monkeypatch)
    assert words in answer(theirs)
    assert (loop.admission.in_flight, loop.admission.container(A)) == (0, 0)
    assert len(loop.open) == 0


def test_a_mount_done_turns_its_slot_into_its_record(loop: Broker, kernel: Kernel) -> None:
    connection = kernel.connect()
    built = {"status": "built", "dev": f"0:{connection}"}
    done = {"status": "ok", "mnt_id": "77", "dev": f"0:{connection}", "options": "rw"}
    work, theirs, job = running(loop, [MARK, FACTS, built, done])
    for _ in range(3):
        loop.requests.hear(work)
    # Recorded while still detached: the record has taken the slot, counted once.
    assert (loop.admission.in_flight, loop.admission.container(A)) == (0, 1)
    assert loop.records.owner(connection) is not None
    loop.requests.hear(work)
    assert answer(theirs) == "ok"
    assert [s.go for s in job.sent] == [True, True, True]
    assert (loop.admission.in_flight, loop.admission.container(A)) == (0, 1)
    assert len(loop.open) == 0


def test_an_unmount_done_counts_its_mount_no_more(loop: Broker, kernel: Kernel) -> None:
    connection = kernel.connect()
    loop.admission.commit(loop.admission.admit(A), kernel.record(connection, A))
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    work = Conversation(ours, callers.Caller(pid=1, uid=0, gid=0, pidfd=-1, container=A),
                        time.monotonic() + 5)
    work.parsed = protocol.Request(op="unmount", path="/mnt/x")
    facts = {"status": "facts", "mount": "77", "fstype": "fuse", "dev": f"0:{connection}"}
    work.job = cast("Job", StandInJob([MARK, facts, {"status": "ok", "mnt_id": "77"}],
                                      time.monotonic() + 5))
    work.advance(State.QUEUED)
    work.advance(State.RUNNING)
    loop.helpers.running[A] = work
    loop.requests.hear(work)
    loop.requests.hear(work)
    kernel.end(connection)  # what the helper's umount2 did
    loop.requests.hear(work)
    assert answer(theirs) == "ok"
    assert (loop.admission.node(), loop.admission.mounts_held) == (0, {})
