"""Look before you take (issue 26).

Container A serves a FUSE stub that answers everything but FLUSH, opens a file in it and
hands that descriptor (SCM_RIGHTS, over a socket in a directory A and B share) to
container B, which names it as its ``fuse_fd`` 400 times. The old helper took each
descriptor to look at it; closing it waited on A's daemon for a FLUSH that never came, so
every helper stayed alive, holding the broker's descriptors (1,600 helpers and 3,215
broker descriptors with four Bs in the issue's run). Now the helper judges the
descriptor from /proc (its fdinfo and the caller's mount table) without taking it: every
request is refused, A's daemon never hears a FLUSH from the broker, no helper is left and
the broker's descriptors are back where they were.

Both containers have containerd's default capabilities and the real RuntimeDefault rules.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

from fuse_plugin.api import api_pb2 as api
from tests.lib import broker as broker_rig
from tests.lib import oci, profiles, waiting, workloads
from tests.lib.broker import BrokerProcess, Held, attack

ASKS = 400
FUSE_FLUSH = 25
RECORD = "/tmp/requests.jsonl"


def helpers_of(pid: int) -> list[int]:
    """The broker's child processes (its helpers), zombies included."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            if int(stat.rpartition(")")[2].split()[1]) == pid:
                found.append(int(entry))
    return found


def fds_of(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def settled(broker: BrokerProcess, baseline: int) -> None:
    """Wait until every helper has exited and the broker's fds are back to ``baseline``."""
    waiting.wait_for(lambda: helpers_of(broker.pid) == [], 30, "every helper to have exited",
                     detail=lambda: f"alive: {helpers_of(broker.pid)}")
    waiting.wait_for(lambda: fds_of(broker.pid) <= baseline, 30,
                     f"the broker's descriptors back to {baseline}",
                     detail=lambda: f"now {fds_of(broker.pid)}")


@pytest.mark.parametrize(("whose", "why"), [
    ("another's", "its mount is not in the caller's namespace"),
    ("its own", "it is a file in a FUSE mount"),
])
def test_a_descriptor_in_a_fuse_mount_is_never_taken(
        broker: BrokerProcess, broker_allocation: api.ContainerAllocateResponse,
        tmp_path: Path, whose: str, why: str) -> None:
    """B names A's file (another tenant's FUSE mount), or A names its own."""
    shared = tmp_path / "shared"
    shared.mkdir(mode=0o777)
    request = oci.ContainerRequest(
        args=workloads.HOLD, allocation=broker_allocation, seccomp=profiles.runtime_default(),
        binds=[broker_rig.attacker_bind(), oci.Bind(shared, "/shared")])
    with oci.Runc() as runc:
        a = runc.create(oci.build_spec(request), "giver").start()
        b = runc.create(oci.build_spec(request), "taker").start()
        for container in (a, b):
            container.sh("mkdir -p /mnt/stub /mnt/b").check()
        stub = Held(a, "serve", "/mnt/stub", RECORD, "--no-flush")
        assert stub.answer["status"] == "ok"
        giver = Held(a, "pass-fd", "/mnt/stub/file", "/shared/fd.sock")
        if whose == "its own":
            b = a
        baseline = fds_of(broker.pid)
        # B's process keeps the descriptor until released: its own close would wait on
        # A's FLUSH, which A answers only by going away.
        taker = Held(b, "ask-with-fd", "/shared/fd.sock", str(ASKS), "op=mount",
                     "path=/mnt/b")
        tally = taker.answer
        try:
            assert tally["counts"] == {"error": ASKS}, tally
            [message] = tally["messages"]
            assert f"is not /dev/fuse opened for reading and writing ({why})" in message
            settled(broker, baseline)
            flushes = [r for r in requests_seen(a) if r["opcode"] == FUSE_FLUSH]
            assert flushes == [], f"a FLUSH reached A's daemon: {flushes} {who(flushes)}"
            assert broker.events("broker.stalled") == []
        finally:
            stub.release()  # A's daemon goes: the waiting closes end
            taker.release()
            giver.release()
        # B is still served for what it may have.
        answer = attack(b, "ask", "--fuse", "op=mount", "path=/mnt/b")
        assert answer["status"] == "ok", answer


def who(records: list[dict[str, Any]]) -> list[str]:
    """The command lines of the processes named in FUSE requests, while they last."""
    found = []
    for record in records:
        try:
            found.append(Path(f"/proc/{record['pid']}/cmdline").read_bytes()
                         .replace(b"\0", b" ").decode(errors="replace"))
        except OSError:
            found.append(f"{record['pid']} (gone)")
    return found


def requests_seen(container: oci.RuncContainer) -> list[dict[str, Any]]:
    path = Path(f"/proc/{container.pid}/root{RECORD}")
    return [json.loads(line) for line in path.read_text().splitlines()]


SWAPS = 400


def test_a_descriptor_swapped_between_judgement_and_take_is_bounded(
        broker: BrokerProcess, broker_allocation: api.ContainerAllocateResponse) -> None:
    """The one window left: the caller swaps its fd (dup2) between the helper's judgement
    and its take. A helper that takes the FUSE file refuses it, and its exit waits on the
    stub, which never answers a FLUSH from outside the container (the helper's, pid 0
    there). Such a helper counts against its container, which gets no other until it has
    exited (the broker aborts the container's own FUSE connections to free it): every
    request is answered, and afterwards no helper is left and the broker's descriptors
    are back to their baseline."""
    request = oci.ContainerRequest(
        args=workloads.HOLD, allocation=broker_allocation, seccomp=profiles.runtime_default(),
        binds=[broker_rig.attacker_bind()])
    with oci.Runc() as runc:
        tenant = runc.create(oci.build_spec(request), "swapper").start()
        tenant.sh("mkdir -p /mnt/stub /mnt/r").check()
        stub = Held(tenant, "serve", "/mnt/stub", RECORD, "--no-flush-from-outside")
        assert stub.answer["status"] == "ok"
        baseline = fds_of(broker.pid)
        try:
            tally = attack(tenant, "swap-ask", "/mnt/r", str(SWAPS), "/mnt/stub/file",
                           timeout=600)
            assert set(tally["counts"]) <= {"ok", "error"}, tally
            assert sum(tally["counts"].values()) == SWAPS
            assert tally["swaps"] > 0
            settled(broker, baseline)
        finally:
            stub.release()


def test_one_dev_fuse_mounts_once(broker: BrokerProcess,
                                  broker_allocation: api.ContainerAllocateResponse) -> None:
    """The kernel mounts a /dev/fuse that already serves a mount as one more mount of the
    same superblock: one connection, as many mount points as asked, and the quota (which
    counts connections) never saw them. The broker refuses the second and later ones."""
    request = oci.ContainerRequest(
        args=workloads.HOLD, allocation=broker_allocation, seccomp=profiles.runtime_default(),
        binds=[broker_rig.attacker_bind()])
    with oci.Runc() as runc:
        tenant = runc.create(oci.build_spec(request), "reuser").start()
        tally = attack(tenant, "ask", "--one-fuse", "--repeat", "20", "--mkdir", "op=mount",
                       "path=/mnt/again/{i}")
        assert tally["counts"] == {"ok": 1, "error": 19}, tally
        [message] = tally["messages"]
        assert "this /dev/fuse already serves a mount" in message
        assert len(tenant.mounts()) == 1
