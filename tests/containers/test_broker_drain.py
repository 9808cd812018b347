"""A broker rollout fails no mount (issue 35): the real broker gets SIGTERM while a
container's mounts are in flight, and every one of them ends as a mount.

The old broker's helper is the real one behind a gate (a FIFO the test opens), so the
test knows where each request is when SIGTERM comes: three squashfuse mounts asked at
once, all three held by the broker (the first one's helper at the gate, two queued
behind it, one container having one helper at a time). On SIGTERM the broker stops
listening; mounts asked from then on wait in the shim. The test lets the first helper
through: the old broker finishes that mount while it drains. The second one's helper
then waits at the gate past the drain's bound: the broker kills it and refuses it, and
the third, with retry=1. The test starts the new broker (the real helper) once the old
one has exited, as the DaemonSet does, and the four waiting shims get their mounts from
it. The drain's order with stand-in helpers is tests/unit/test_broker_drain.py."""

from __future__ import annotations

import contextlib
import errno
import os
import signal
import subprocess
from pathlib import Path

from fuse_plugin.api import api_pb2 as api
from fuse_plugin.broker import scheduler, server
from tests.lib import broker as broker_rig
from tests.lib import oci, profiles, waiting, workloads
from tests.lib.broker import BrokerProcess
from tests.lib.workloads import HELLO, squash_image

IMAGE = "/data/image.sqfs"
POINTS = "/mnt/drain"
WAIT = 30.0  # seconds for any one step

# The real helper, held at its start until the test opens the gate's other end once.
GATED_HELPER = """#!/usr/bin/env python3
import os, sys
open({gate!r}).close()
os.execv({real!r}, [{real!r}, *sys.argv[1:]])
"""


def mounts(container: oci.RuncContainer, names: list[str], log: Path
           ) -> subprocess.Popen[bytes]:
    """squashfuse at each of ``names``, started together from one shell (so their shims
    ask within milliseconds of each other); exit 0 when every one has mounted."""
    script = "; ".join([f"mkdir -p {' '.join(f'{POINTS}/{n}' for n in names)}", "pids=''",
                        *(f"squashfuse {IMAGE} {POINTS}/{n} & pids=\"$pids $!\""
                          for n in names),
                        "rc=0", "for p in $pids; do wait $p || rc=1; done", "exit $rc"])
    with log.open("wb") as sink:
        proc = subprocess.Popen(container.runc.command("exec", container.id, "/bin/sh", "-c",
                                                       script),
                                stdin=subprocess.DEVNULL, stdout=sink, stderr=subprocess.STDOUT)
    container.daemons.append(proc)
    return proc


def held_connections(broker: BrokerProcess, container: oci.RuncContainer) -> int:
    """The container's connections that the broker has accepted and holds: the server
    ends of connections to its socket (the kernel makes them in the caller's network
    namespace, and lists them there, connected) that are in the broker's fd table.
    Those still in the listen queue are in no process's."""
    ours = set()
    for fd in os.listdir(f"/proc/{broker.pid}/fd"):
        with contextlib.suppress(FileNotFoundError):
            ours.add(os.readlink(f"/proc/{broker.pid}/fd/{fd}"))
    count = 0
    for line in Path(f"/proc/{container.pid}/net/unix").read_text().splitlines()[1:]:
        fields = line.split()  # Num RefCount Protocol Flags Type St Inode Path
        if fields[5:6] == ["03"] and fields[7:8] == [str(broker.socket)]:
            count += f"socket:[{fields[6]}]" in ours
    return count


def let_one_through(gate: Path) -> bool:
    """Open the gate's write end once a helper waits at its read end, and close it: that
    helper goes on, the next one to come waits."""
    try:
        fd = os.open(gate, os.O_WRONLY | os.O_NONBLOCK)
    except OSError as err:
        if err.errno == errno.ENXIO:  # no helper waiting yet
            return False
        raise
    os.close(fd)
    return True


def test_mounts_in_flight_at_sigterm_all_end_as_mounts(
        broker_allocation: api.ContainerAllocateResponse, broker: BrokerProcess,
        runc: oci.Runc, tmp_path: Path) -> None:
    gate = tmp_path / "gate"
    os.mkfifo(gate)
    real = broker.shim.parent / "fuse-broker-helper"
    old = broker_rig.with_stand_in_helper(
        broker, GATED_HELPER.format(gate=str(gate), real=str(real)), tmp_path / "old")
    try:
        old.start()
        assert old.proc is not None
        image = squash_image(tmp_path)
        container = runc.create(oci.build_spec(oci.ContainerRequest(
            args=workloads.HOLD, allocation=broker_allocation,
            seccomp=profiles.runtime_default(), binds=[oci.Bind(image, IMAGE, True)])),
            "drain").start()
        before = mounts(container, ["a", "b", "c"], tmp_path / "before.log")
        waiting.wait_for(lambda: before.poll() is not None
                         or held_connections(old, container) == 3, WAIT,
                         "the old broker to hold the three requests",
                         detail=(tmp_path / "before.log").read_text)
        assert before.poll() is None, (tmp_path / "before.log").read_text()
        old.proc.send_signal(signal.SIGTERM)
        waiting.wait_for(lambda: not old.socket.exists(), WAIT,
                         "the old broker to stop listening")
        after = mounts(container, ["d", "e"], tmp_path / "after.log")  # wait in the shim
        waiting.wait_for(lambda: let_one_through(gate), WAIT, "the first helper at the gate")
        assert old.proc.wait(server.STOP_GRACE + scheduler.HELPER_DEADLINE + WAIT) == 0
    finally:
        old.stop()
    broker.start()  # the new broker, the real helper; the old one's records

    for proc, log in ((before, "before.log"), (after, "after.log")):
        assert proc.wait(WAIT) == 0, (tmp_path / log).read_text()
    for name in "abcde":
        assert container.exec("cat", f"{POINTS}/{name}/hello.txt").check().stdout == HELLO

    # The old broker: SIGTERM, the first mount served in the drain, the rest refused
    # with retry (one more may have slipped through the gate before it closed), no
    # failure; every other mount, the new broker's.
    said = [e for e in old.events() if e["event"] in (
        "signal", "broker.mount", "broker.refused", "broker.failed", "stopped")]
    assert [e["event"] for e in said[:2]] + [said[-1]["event"]] == [
        "signal", "broker.mount", "stopped"], said
    served = [e["path"] for e in said if e["event"] == "broker.mount"]
    refused = [e for e in said if e["event"] == "broker.refused"]
    assert len(served) + len(refused) == 3, said
    assert refused, said
    assert all(e.get("retry") is True for e in refused), refused
    newly = [e["path"] for e in broker.events("broker.mount")]
    assert sorted(served + newly) == [f"{POINTS}/{n}" for n in "abcde"]
