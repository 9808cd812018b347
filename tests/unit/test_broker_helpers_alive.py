"""Live helpers are counted (issue 26): a container whose released helper has not exited
gets no new one, and the node runs at most its cap (``shares``: 2 a pod times
--max-pods), killed ones included.

The loop's bookkeeping, with stand-in jobs: a helper that cannot exit needs a process
stuck in the kernel, which the container stage makes (test_broker_hostile.py's stuck
helper); here the rule itself is checked at each of its states."""

from __future__ import annotations

import collections
import logging
import socket
import time
from pathlib import Path
from typing import Any, cast

import pytest

from fuse_plugin.broker import caller as callers
from fuse_plugin.broker import protocol, scheduler
from fuse_plugin.broker.conversation import Conversation, State
from fuse_plugin.broker.helper import Job
from fuse_plugin.broker.server import Broker
from fuse_plugin.broker.settings import BrokerSettings


class StandInJob:
    """A released helper that has not exited (``exited`` is set by the test)."""

    def __init__(self, killed_at: float) -> None:
        self.killed_at: float | None = killed_at
        self.aborted = False
        self.is_gone = False
        self.pidfd = -1

    def exited(self) -> bool:
        return self.is_gone

    def close(self) -> None:
        pass


STARTED: list[Any] = []  # the helpers the loop started, in the test at hand


@pytest.fixture
def broker(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Broker:
    def start(*args: Any) -> None:
        STARTED.append(args)
        raise OSError(5, "stand-in: no helper is run here")

    STARTED.clear()
    monkeypatch.setattr(Job, "start", start)
    return Broker(BrokerSettings(directory=tmp_path / "dir", state=tmp_path / "state",
                                 lxcfs_dir=tmp_path / "lxcfs"),
                  logging.getLogger("test"))


def queue(loop: Broker, container: str) -> socket.socket:
    """A request of ``container`` waiting for its helper; the caller's end is returned."""
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    who = callers.Caller(pid=1, uid=0, gid=0, pidfd=-1, container=container)
    work = Conversation(ours, who, time.monotonic() + 5)
    work.parsed = protocol.Request(op="unmount", path="/mnt/x")
    work.advance(State.QUEUED)
    loop.helpers.queued.setdefault(container, collections.deque()).append(work)
    return theirs


def stuck(loop: Broker, container: str, killed_at: float) -> StandInJob:
    job = StandInJob(killed_at)
    loop.helpers.exiting.append(scheduler.Exiting(container, cast("Job", job)))  # what it uses
    return job


def answer(sock: socket.socket) -> str:
    sock.setblocking(False)
    return protocol.decode(sock.recv(protocol.MAX_MESSAGE))["message"]


def test_a_container_whose_helper_has_not_exited_waits_then_is_refused(
        broker: Broker) -> None:
    now = time.monotonic()
    job = stuck(broker, "/pod/a", killed_at=now)
    caller_end = queue(broker, "/pod/a")
    broker.helpers.next("/pod/a")
    assert STARTED == []
    assert len(broker.helpers.queued["/pod/a"]) == 1  # waits: the helper is only just killed
    job.killed_at = now - scheduler.KILL_GRACE  # still alive past the grace: stuck
    broker.helpers.next("/pod/a")
    assert STARTED == []
    assert "last helper is blocked in the kernel" in answer(caller_end)
    assert "/pod/a" not in broker.helpers.queued


def test_once_it_has_exited_the_container_gets_its_next_helper(broker: Broker) -> None:
    job = stuck(broker, "/pod/a", killed_at=time.monotonic())
    caller_end = queue(broker, "/pod/a")
    job.is_gone = True
    broker.helpers.reap(broker.helpers.exiting[0])
    assert len(STARTED) == 1
    assert "cannot start fuse-broker-helper" in answer(caller_end)


def test_the_node_runs_at_most_its_cap_of_helpers_killed_ones_included(
        broker: Broker) -> None:
    """The cap is only met on a node running more pods than --max-pods: here every
    container is a pod of its own (outside any pod cgroup)."""
    for n in range(broker.caps.helpers):
        stuck(broker, f"/pod/{n}", killed_at=time.monotonic())
    caller_end = queue(broker, "/pod/other")
    broker.helpers.next("/pod/other")
    assert STARTED == []
    assert f"{broker.caps.helpers} helpers alive, 2 for each of --max-pods 110 pods" \
        in answer(caller_end)


POD = "/kubepods/besteffort/pod0f1e2d3c-4b5a-6978-8796-a5b4c3d2e1f0"
NEIGHBOUR = "/kubepods/besteffort/pod11111111-2222-3333-4444-555555555555"


def test_a_pods_requests_beyond_its_share_of_helpers_wait_for_its_own(
        broker: Broker) -> None:
    """Two of the pod's containers have helpers alive (its share): a third container's
    request waits, neither refused nor started, while another pod's starts at once; when
    one of the pod's own helpers has gone, the waiting request starts."""
    first = stuck(broker, f"{POD}/a", killed_at=time.monotonic())
    stuck(broker, f"{POD}/b", killed_at=time.monotonic())
    waiting = queue(broker, f"{POD}/c")
    broker.helpers.next(f"{POD}/c")
    assert STARTED == []
    assert len(broker.helpers.queued[f"{POD}/c"]) == 1
    waiting.setblocking(False)
    with pytest.raises(BlockingIOError):  # no answer: it waits
        waiting.recv(protocol.MAX_MESSAGE)
    neighbour = queue(broker, f"{NEIGHBOUR}/a")
    broker.helpers.next(f"{NEIGHBOUR}/a")
    assert len(STARTED) == 1
    assert "cannot start fuse-broker-helper" in answer(neighbour)
    first.is_gone = True
    broker.helpers.reap(broker.helpers.exiting[0])
    assert len(STARTED) == 2
    assert "cannot start fuse-broker-helper" in answer(waiting)
    assert f"{POD}/c" not in broker.helpers.queued
