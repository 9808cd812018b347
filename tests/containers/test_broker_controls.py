"""Hostile requests to the broker from a broker-mode container, sent the way a container's
root could send them: straight over the socket (tests/lib/attacker.py), not
through the shim. Each is refused with a reason in the reply, logged in one line (a
flood past the tenant's log budget: counted in a summary line), and leaves no mount
anywhere: not in the caller, not in a neighbour, not on the node."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from fuse_plugin.api import api_pb2 as api
from tests.lib import broker as broker_rig
from tests.lib import oci, profiles, waiting, workloads
from tests.lib.broker import BrokerProcess, attack

MAX_MOUNTS = 8
SETUP = ("mkdir -p /mnt/ok /mnt/real && ln -sfn /etc /mnt/to-etc && "
         "ln -sfn ../../../../.. /mnt/up && ln -sfn /proc/1/root /mnt/magic && "
         "touch /mnt/file")
MOUNT = ["op=mount"]


class Rig:
    """One broker (--max-mounts 8) and two broker-mode containers: the attacker and a
    neighbour whose mount table must never change."""

    def __init__(self, broker: BrokerProcess, attacker: oci.RuncContainer,
                 neighbour: oci.RuncContainer) -> None:
        self.broker = broker
        self.attacker = attacker
        self.neighbour = neighbour

    def send(self, *fields: str, container: oci.RuncContainer | None = None,
             prefix: tuple[str, ...] = ()) -> dict[str, Any]:
        """A request as the toolkit sends it; a mount names the caller's own /dev/fuse."""
        fuse = ("--fuse",) if "op=mount" in fields else ()
        return attack(container or self.attacker, "ask", *fuse, *fields, prefix=prefix)

    def assert_nothing_mounted(self) -> None:
        assert self.attacker.mounts() == []
        assert self.neighbour.mounts() == []
        assert oci.fuse_mounts_of(os.getpid()) == []  # the node's namespace


def pod(allocation: api.ContainerAllocateResponse) -> oci.ContainerRequest:
    return oci.ContainerRequest(
        args=workloads.HOLD, allocation=allocation, seccomp=profiles.runtime_default(),
        binds=[broker_rig.attacker_bind()])


@pytest.fixture(scope="module")
def rig(broker_dir: Path, broker_allocation: api.ContainerAllocateResponse,
        tmp_path_factory: pytest.TempPathFactory) -> Iterator[Rig]:
    broker = BrokerProcess(broker_dir, tmp_path_factory.mktemp("hostile-broker"),
                           broker_rig.shim(), "--max-mounts", str(MAX_MOUNTS))
    with oci.Runc() as runc:
        try:
            broker.start()
            attacker = runc.create(oci.build_spec(pod(broker_allocation)), "attacker").start()
            neighbour = runc.create(oci.build_spec(pod(broker_allocation)),
                                    "neighbour").start()
            attacker.sh(SETUP).check()
            yield Rig(broker, attacker, neighbour)
        finally:
            broker.stop()


# (what, request fields, the refusal's words)
HOSTILE = [
    ("symlink to /etc", [*MOUNT, "path=/mnt/to-etc"], "a symlink is on the way"),
    ("symlink climbing out", [*MOUNT, "path=/mnt/up/etc"], "a symlink is on the way"),
    ("magic link to the node's root", [*MOUNT, "path=/mnt/magic"], "a symlink is on the way"),
    ("dot-dot", [*MOUNT, "path=/mnt/../etc"], "is not a canonical path"),
    ("relative path", [*MOUNT, "path=mnt/ok"], "must be an absolute path"),
    ("/etc itself", [*MOUNT, "path=/etc"], "is under /etc"),
    ("the root", [*MOUNT, "path=/"], "is not a canonical path"),
    ("into /proc", [*MOUNT, "path=/proc/sys"], "is under /proc"),
    ("a file", [*MOUNT, "path=/mnt/file"], "it is not a directory"),
    ("missing directory", [*MOUNT, "path=/mnt/nope"], "it does not exist"),
    ("suid", [*MOUNT, "path=/mnt/ok", "options=rw,suid"], "always nosuid,nodev"),
    ("dev", [*MOUNT, "path=/mnt/ok", "options=dev"], "always nosuid,nodev"),
    ("fuseblk", [*MOUNT, "path=/mnt/ok", "options=blkdev"], "fuseblk"),
    ("tmpfs as an option", [*MOUNT, "path=/mnt/ok", "options=type=tmpfs"],
     "unknown mount option 'type=tmpfs'"),
    ("tmpfs as a field", [*MOUNT, "path=/mnt/ok", "fstype=tmpfs"],
     "unknown request field(s): fstype"),
    ("its own user_id", [*MOUNT, "path=/mnt/ok", "options=user_id=1000"],
     "sets fd=, rootmode=, user_id="),
    ("a dangling escape that would swallow what follows",
     [*MOUNT, "path=/mnt/ok", "options=fsname=a\\"], "unfinished escape"),
    ("digits that are not ASCII", [*MOUNT, "path=/mnt/ok", "options=max_read=\u0661\u0662"],
     "max_read must be a number"),
    ("unknown op", ["op=bind", "path=/mnt/ok"], "unknown op 'bind'"),
    ("malformed", ["nonsense"], "malformed field"),
    ("unmount a runtime mount", ["op=unmount", "path=/tmp"],
     "not a mount the broker made for this container"),
    ("unmount a /proc mask", ["op=unmount", "path=/proc/kcore"], "is under /proc"),
]


@pytest.mark.parametrize(("what", "fields", "words"), HOSTILE, ids=[h[0] for h in HOSTILE])
def test_hostile_request_is_refused_logged_and_mounts_nothing(
        rig: Rig, what: str, fields: list[str], words: str) -> None:
    before = len(rig.broker.events("broker.refused"))
    answer = rig.send(*fields)
    assert answer["status"] == "error"
    assert words in answer["message"]
    assert answer["message"].startswith("broker refused: ")
    refused = rig.broker.events("broker.refused")
    assert len(refused) == before + 1
    assert words in refused[-1]["reason"]
    assert rig.broker.events("broker.mount") == []
    rig.assert_nothing_mounted()


def test_other_protocol_versions_are_refused(rig: Rig) -> None:
    answer = attack(rig.attacker, "ask", "v=1", "op=mount", "path=/mnt/ok")
    assert "protocol version '2,1'" in answer["message"] or \
        "given twice" in answer["message"]
    rig.assert_nothing_mounted()


def test_naming_another_process_is_refused(rig: Rig) -> None:
    answer = rig.send(*MOUNT, "path=/mnt/ok", f"pid={rig.neighbour.pid}")
    assert answer["message"] == "broker refused: unknown request field(s): pid"
    rig.assert_nothing_mounted()


@pytest.mark.parametrize(("fd", "words"), [
    ("0", "is not /dev/fuse"),  # its stdin
    ("999", "has no open fd 999"),
])
def test_a_fd_that_is_not_the_callers_dev_fuse_is_refused(rig: Rig, fd: str,
                                                          words: str) -> None:
    answer = attack(rig.attacker, "ask", "--fd", fd, *MOUNT, "path=/mnt/ok")
    assert words in answer["message"]
    rig.assert_nothing_mounted()


def test_a_caller_that_has_exited_is_refused(rig: Rig) -> None:
    answer = attack(rig.attacker, "ask", "--orphan", *MOUNT, "path=/mnt/ok", "fuse_fd=0")
    assert answer["status"] == "error"
    assert "has exited" in answer["message"]
    rig.assert_nothing_mounted()


def test_the_shim_resolves_links_and_the_broker_still_refuses_etc(rig: Rig) -> None:
    """Through the shim a link to /etc becomes /etc (the container's view), which the
    path rules refuse: the user sees the broker's reason as fusermount3's message."""
    result = rig.attacker.exec("fusermount3", "/mnt/to-etc",
                               env={"_FUSE_COMMFD": "1"})
    assert result.returncode == 1
    assert result.stderr.strip() == ("fusermount3: broker refused: mountpoint '/etc' is "
                                     "under /etc: the broker does not mount there")
    rig.assert_nothing_mounted()


def test_a_thousand_requests_hit_the_cap_and_the_broker_keeps_serving(rig: Rig) -> None:
    """Runs last in this module: it leaves the attacker with MAX_MOUNTS mounts."""
    before = len(rig.broker.events())
    result = attack(rig.attacker, "ask", "--fuse", "--repeat", "1000", "--mkdir", *MOUNT,
                    "path=/mnt/flood/{i}", "options=rw")
    assert result["counts"] == {"ok": MAX_MOUNTS, "error": 1000 - MAX_MOUNTS}
    [(message, count)] = list(result["messages"].items())
    assert count == 1000 - MAX_MOUNTS
    assert f"already holds {MAX_MOUNTS} FUSE mounts" in message
    points = sorted(point for point, _ in rig.attacker.mounts())
    assert points == sorted(f"/mnt/flood/{i}" for i in range(MAX_MOUNTS))
    assert rig.neighbour.mounts() == []
    assert oci.fuse_mounts_of(os.getpid()) == []
    # Every request is in the log: a line each up to the tenant's budget, then counted
    # in a summary line when the interval ends (issue 26).
    names = ("broker.mount", "broker.refused", "broker.refused_summary")

    def accounted() -> int:
        return sum(int(e.get("suppressed", 1)) for e in rig.broker.events()[before:]
                   if e["event"] in names)

    waiting.wait_for(lambda: accounted() >= 1000, 30,
                     "the log's lines and summaries to account for every request")
    events = rig.broker.events()[before:]
    assert accounted() == 1000
    assert {e["event"] for e in events} == set(names)
    assert len([e for e in events if e["event"] == "broker.refused"]) < 1000 - MAX_MOUNTS
    # The neighbour is not affected by the attacker's count.
    assert rig.send(*MOUNT, "path=/mnt", "options=rw", container=rig.neighbour)[
        "status"] == "ok"
    assert [p for p, _ in rig.neighbour.mounts()] == ["/mnt"]
