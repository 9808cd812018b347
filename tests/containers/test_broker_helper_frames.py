"""The helper cannot be told less than it must do (issue 26).

The broker's loop used to tell its helper what to do in ``key=value`` text read into a
16 KiB buffer. A caller with 3,000 supplementary groups (a pod's ``supplementalGroups``)
made that request longer; the kernel cut it, and the fields after the groups, "check as
the caller" and "do not walk into FUSE", were lost: the helper looked the path up inside
the tenant's own FUSE mount as uid 0. Now the messages are framed and typed
(``fuse_plugin/broker/frames.py``), a message is refused whole rather than cut, and the
checks as the caller and the FUSE rule are not fields at all.

Here: a uid-1000 tenant with 3,000 groups (runc's ``additionalGids``, containerd's
default capabilities, the real RuntimeDefault rules) asks for a mountpoint under its own
FUSE stub, which records every request the kernel sends it; and its 3,000th group decides
a permission both ways. Then the helper binary itself is fed random and mutated frames.
"""

from __future__ import annotations

import json
import os
import random
import socket
import struct
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from fuse_plugin.api import api_pb2 as api
from fuse_plugin.broker import frames
from fuse_plugin.broker.scheduler import HELPER_DEADLINE
from tests.lib import broker as broker_rig
from tests.lib import oci, profiles, workloads
from tests.lib.broker import BrokerProcess, Held, attack

TENANT = 1000
GROUPS = tuple(range(20000, 23000))  # 3,000 groups: ~20 KiB as text, beyond 16 KiB
LAST_GROUP = GROUPS[-1]
FUSE_INIT = 26
FUSE_LOOKUP = 1
RECORD = "/tmp/requests.jsonl"


@pytest.fixture(scope="module")
def frames_broker(broker_dir: Path, tmp_path_factory: pytest.TempPathFactory
                  ) -> Iterator[BrokerProcess]:
    broker = BrokerProcess(broker_dir, tmp_path_factory.mktemp("frames") / "broker",
                           broker_rig.shim())
    broker.start()
    try:
        yield broker
    finally:
        broker.stop()


@pytest.fixture
def tenant(frames_broker: BrokerProcess, broker_allocation: api.ContainerAllocateResponse
           ) -> Iterator[oci.RuncContainer]:
    """uid 1000 with 3,000 supplementary groups, a tmpfs at /mnt, the runtime's defaults."""
    request = oci.ContainerRequest(
        args=workloads.HOLD, allocation=broker_allocation, user=(TENANT, TENANT),
        groups=GROUPS, seccomp=profiles.runtime_default(), tmpfs=("/mnt",),
        binds=[broker_rig.attacker_bind()])
    with oci.Runc() as runc:
        yield runc.create(oci.build_spec(request), "groups").start()


def groups_of(pid: int) -> list[int]:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("Groups:"):
            return [int(g) for g in line.split()[1:]]
    return []


def requests_seen(container: oci.RuncContainer) -> list[dict[str, Any]]:
    path = Path(f"/proc/{container.pid}/root{RECORD}")
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_a_caller_with_3000_groups_is_refused_inside_its_own_fuse_mount(
        tenant: oci.RuncContainer, frames_broker: BrokerProcess) -> None:
    """The request is refused by the FUSE rule, and the tenant's daemon, which records
    every request the kernel sends it, saw no lookup at all: none as uid 0, none as
    anyone."""
    assert groups_of(tenant.pid) == list(GROUPS)
    tenant.sh("mkdir -p /mnt/a/f").check()
    # The container's root serves the stub (the old broker could not mount for a uid
    # with 3,000 groups at all); uid 1000, with all of them, asks.
    stub = Held(tenant, "serve", "/mnt/a/f", RECORD, user="0:0")
    assert stub.answer["status"] == "ok"
    refused = [attack(tenant, "ask", "--fuse", "op=mount", f"path=/mnt/a/f/{name}")
               for name in ("x", "x/y")]
    for answer in refused:
        assert answer["status"] == "error"
        assert "is at or inside the fuse mount at '/mnt/a/f'" in answer["message"]
    seen = [r for r in requests_seen(tenant) if r["opcode"] != FUSE_INIT]
    assert [r for r in seen if r["uid"] == 0] == []
    assert [r for r in seen if r["opcode"] == FUSE_LOOKUP] == []
    assert frames_broker.events("broker.stalled") == []
    assert frames_broker.events("broker.failed") == []
    stub.release()


def test_the_3000th_group_decides_as_the_kernel_would(tenant: oci.RuncContainer) -> None:
    """A directory writable only through the caller's last group is its to mount on; one
    whose group bits refuse that group is not, though "others" may write it. A check that
    dropped groups past some count would judge the second as "others" and allow it."""
    root = "0:0"
    for name, mode in (("through-group", "0770"), ("group-denied", "0707")):
        result = tenant.exec("sh", "-c", f"mkdir /mnt/{name} && chgrp {LAST_GROUP} "
                             f"/mnt/{name} && chmod {mode} /mnt/{name}", user=root)
        assert result.returncode == 0, result.output
    allowed = attack(tenant, "ask", "--fuse", "op=mount", "path=/mnt/through-group")
    assert allowed["status"] == "ok", allowed
    assert attack(tenant, "ask", "op=unmount", "path=/mnt/through-group",
                  "flags=lazy")["status"] == "ok"
    denied = attack(tenant, "ask", "--fuse", "op=mount", "path=/mnt/group-denied")
    assert denied["status"] == "error"
    assert "may not write" in denied["message"], denied
    assert tenant.mounts() == []


# -- the helper's own input ---------------------------------------------------------------

FUZZ_RUNS = 400
SEED = 26


def field(key: str, value: bytes) -> bytes:
    name = key.encode()
    return bytes([len(name)]) + name + b"\0" + struct.pack("=I", len(value)) + value + b"\0"


def raw_frame(kind: int, items: list[tuple[str, bytes]], count: int | None = None) -> bytes:
    """A frame built by hand, so it can be wrong in ways ``frames.encode`` refuses."""
    body = b"".join(field(k, v) for k, v in items)
    head = struct.pack("=4sIBBH", frames.MAGIC, 12 + len(body), kind,
                       len(items) if count is None else count, 0)
    return head + body


def request_items(op: str) -> list[tuple[str, bytes]]:
    items = [("op", op.encode()), ("path", b"/mnt/x"), ("uid", b"1000"), ("gid", b"1000"),
             ("groups", struct.pack("=3I", *GROUPS[:3]))]
    return [*items, ("fuse_fd", b"0")] if op == "mount" else items


def crafted() -> list[tuple[str, bytes]]:
    """The regressions by name: a field that would switch a check off, one left out, one
    said twice, a frame longer than the helper reads, and lies about the frame itself."""
    mount = request_items("mount")
    return [
        ("check=0", raw_frame(frames.REQUEST, [*mount, ("check", b"0")])),
        ("nowalk=", raw_frame(frames.REQUEST, [*mount, ("nowalk", b"")])),
        ("no groups", raw_frame(frames.REQUEST, [i for i in mount if i[0] != "groups"])),
        ("no uid", raw_frame(frames.REQUEST, [i for i in mount if i[0] != "uid"])),
        ("uid twice", raw_frame(frames.REQUEST, [*mount, ("uid", b"0")])),
        ("groups of 5 bytes", raw_frame(frames.REQUEST, [
            *(i for i in mount if i[0] != "groups"), ("groups", b"\0" * 5)])),
        ("oversize", raw_frame(frames.REQUEST, [*mount, ("pad", b"x" * frames.MAX_FRAME)])),
        ("count says more", raw_frame(frames.REQUEST, mount, count=len(mount) + 1)),
        ("count says fewer", raw_frame(frames.REQUEST, mount, count=len(mount) - 1)),
        ("an answer first", raw_frame(frames.ANSWER, [("go", b"1")])),
        ("text", b"op=mount\0path=/mnt/x\0uid=1000\0gid=1000\0groups=\0check=0\0"),
        ("fuse_fd on unmount", raw_frame(frames.REQUEST, [*request_items("unmount"),
                                                          ("fuse_fd", b"0")])),
    ]


def mutated(rng: random.Random, frame: bytes) -> bytes:
    """One random change: bytes flipped, the frame cut or extended, its length, type or
    count rewritten, or noise."""
    data = bytearray(frame)
    how = rng.randrange(7)
    if how == 0:
        for _ in range(rng.randint(1, 8)):
            data[rng.randrange(len(data))] = rng.randrange(256)
    elif how == 1:
        del data[rng.randrange(len(data)):]
    elif how == 2:
        data += rng.randbytes(rng.randint(1, 64))
    elif how == 3:
        data[4:8] = struct.pack("=I", rng.choice([0, 1, len(data) - 1, len(data) + 1,
                                                  rng.randrange(1 << 32)]))
    elif how == 4:
        data[8] = rng.randrange(256)
    elif how == 5:
        data[9] = rng.randrange(256)
    else:
        data = bytearray(rng.randbytes(rng.randint(0, 256)))
    return bytes(data)


class HelperRun:
    """The helper as the broker starts it, for one caller; this test plays the loop."""

    def __init__(self, program: Path, caller: int) -> None:
        self.ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.ours.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, frames.MAX_FRAME * 2)
        pidfd = os.pidfd_open(caller)
        mnt = os.open(f"/proc/{caller}/ns/mnt", os.O_RDONLY)
        fds = [theirs.fileno(), pidfd, mnt]
        try:
            self.proc = subprocess.Popen([str(program), *map(str, fds)], pass_fds=fds,
                                         env={}, stdin=subprocess.DEVNULL,
                                         stdout=subprocess.DEVNULL,
                                         stderr=subprocess.DEVNULL)
        finally:
            for fd in (pidfd, mnt):
                os.close(fd)
            theirs.close()
        self.ours.settimeout(HELPER_DEADLINE)
        self.reports: list[dict[str, str]] = []

    def send(self, data: bytes) -> None:
        try:
            self.ours.send(data)
        except OSError as err:
            self.reports.append({"status": "unsent", "message": str(err)})

    def converse(self, answer_mark: bytes | None = None) -> None:
        """Read reports to the end; answer a mark with ``answer_mark`` (else go=0) and
        facts with go=0, so that nothing this test sends can lead to a mount."""
        go0 = frames.encode(frames.ANSWER, {"go": "0"})
        while True:
            try:
                data = self.ours.recv(frames.MAX_FRAME + 1)
            except TimeoutError:
                self.reports.append({"status": "hung"})
                self.proc.kill()
                break
            if not data:
                break
            report = frames.decode(data, frames.REPORT)
            self.reports.append(report)
            if report["status"] == "mark":
                self.send(answer_mark if answer_mark is not None else go0)
            elif report["status"] == "facts":
                self.send(go0)
        self.proc.wait(HELPER_DEADLINE)
        self.ours.close()


def run_helper(program: Path, caller: int, first: bytes,
               answer_mark: bytes | None = None) -> tuple[int, list[dict[str, str]]]:
    run = HelperRun(program, caller)
    run.send(first)
    run.converse(answer_mark)
    return run.proc.returncode, run.reports


def acceptable(code: int, reports: list[dict[str, str]]) -> bool:
    """An error answered, or a non-zero exit; or a request it understood, taken no
    further than this test's go=0. Never an ok, never a hang."""
    statuses = [r["status"] for r in reports]
    if "ok" in statuses or "hung" in statuses:
        return False
    return code != 0 or statuses[-1:] in (["failed"], ["refused"], ["mark"], ["facts"])


@pytest.fixture
def caller(frames_broker: BrokerProcess, broker_allocation: api.ContainerAllocateResponse
           ) -> Iterator[oci.RuncContainer]:
    """A broker-mode container for the helper to enter: root, the runtime's defaults."""
    request = oci.ContainerRequest(args=workloads.HOLD, allocation=broker_allocation,
                                   seccomp=profiles.runtime_default())
    with oci.Runc() as runc:
        container = runc.create(oci.build_spec(request), "fuzzed").start()
        container.sh("mkdir -p /mnt/x").check()
        yield container


def test_crafted_frames_are_refused_whole(caller: oci.RuncContainer) -> None:
    program = broker_rig.shim().parent / "fuse-broker-helper"
    before = Path(f"/proc/{caller.pid}/mountinfo").read_text()
    for name, data in crafted():
        code, reports = run_helper(program, caller.pid, data)
        assert [r["status"] for r in reports] in (["failed"], ["unsent"]), (name, reports)
        if reports[0]["status"] == "failed":
            assert "bad message from the broker" in reports[0]["message"] \
                or "refused whole" in reports[0]["message"], (name, reports)
        assert code == 0 or reports[0]["status"] == "unsent", name
    assert Path(f"/proc/{caller.pid}/mountinfo").read_text() == before


def test_random_and_mutated_frames_never_mount_nor_hang(caller: oci.RuncContainer) -> None:
    """A bounded run of random and mutated frames, as the request and as the answer to
    the helper's first report: every run ends in an error, a non-zero exit or this
    test's go=0, within the helper's deadline; the caller's mount table never changes."""
    program = broker_rig.shim().parent / "fuse-broker-helper"
    rng = random.Random(SEED)
    before = Path(f"/proc/{caller.pid}/mountinfo").read_text()
    valid = [raw_frame(frames.REQUEST, request_items(op)) for op in ("mount", "unmount")]
    go1 = frames.encode(frames.ANSWER, {"go": "1"})
    bad = []
    for run in range(FUZZ_RUNS):
        if run % 3 == 2:  # a valid unmount request, then a mutated answer to the mark
            code, reports = run_helper(program, caller.pid, valid[1], mutated(rng, go1))
        else:
            code, reports = run_helper(program, caller.pid, mutated(rng, rng.choice(valid)))
        if not acceptable(code, reports):
            bad.append((run, code, reports))
    assert bad == [], f"seed {SEED}: {bad[:5]}"
    assert Path(f"/proc/{caller.pid}/mountinfo").read_text() == before
    assert oci.fuse_mounts_of(caller.pid) == []
