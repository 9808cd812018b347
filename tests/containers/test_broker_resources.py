"""The broker never exits on a resource error it can survive (issue 26).

Near its descriptor limit the broker used to exit with ``OSError: Too many open files:
'/proc/N/status'`` (a traceback): only accept() knew what EMFILE meant. Now every step
of the loop that opens something (the caller's pidfd, /proc files, its namespaces, the
helper's socket pair, pidfd and process, the record) refuses that one request "busy",
with the reason, and pauses accepting; the broker stays up and serves again once
descriptors are free.

Here the broker's RLIMIT_NOFILE is set (prlimit) to each number of free descriptors from
1 to 12 in turn, so that each of those opens is the one that fails, with a request at
each rung; then tenants in three containers (containerd's default capabilities, the real
RuntimeDefault rules) flood it at a low limit. Every request is answered, the broker
never exits, and with its limit back it mounts again.
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
from collections import Counter
from collections.abc import Iterator

import pytest

from fuse_plugin.api import api_pb2 as api
from tests.lib import broker as broker_rig
from tests.lib import oci, profiles, waiting, workloads
from tests.lib.broker import ATTACKER_IN_CONTAINER, BrokerProcess, Held, attack

RUNGS = range(1, 13)
FLOOD = 20  # requests per tenant
TENANTS = 3


@pytest.fixture
def tenants(broker: BrokerProcess, broker_allocation: api.ContainerAllocateResponse
            ) -> Iterator[list[oci.RuncContainer]]:
    request = oci.ContainerRequest(args=workloads.HOLD, allocation=broker_allocation,
                                   seccomp=profiles.runtime_default(),
                                   binds=[broker_rig.attacker_bind()])
    with oci.Runc() as runc:
        yield [runc.create(oci.build_spec(request), f"starver{i}").start()
               for i in range(TENANTS)]


def alive(broker: BrokerProcess) -> bool:
    return broker.proc is not None and broker.proc.poll() is None


def free_below(pid: int, count: int) -> int:
    """The limit that leaves the process exactly ``count`` free descriptor numbers."""
    used = {int(fd) for fd in os.listdir(f"/proc/{pid}/fd")}
    free = [n for n in range(len(used) + count + 1) if n not in used]
    return free[count - 1] + 1


def test_at_every_descriptor_count_a_request_is_answered_and_the_broker_stays(
        broker: BrokerProcess, tenants: list[oci.RuncContainer]) -> None:
    tenant = tenants[0]
    soft, hard = resource.prlimit(broker.pid, resource.RLIMIT_NOFILE)
    answers: Counter[str] = Counter()
    try:
        for rung in RUNGS:
            tenant.sh(f"mkdir -p /mnt/rung{rung}").check()
            resource.prlimit(broker.pid, resource.RLIMIT_NOFILE,
                             (free_below(broker.pid, rung), hard))
            answer = attack(tenant, "ask", "--fuse", "op=mount", f"path=/mnt/rung{rung}")
            assert answer["status"] in ("ok", "error"), (rung, answer)
            answers[answer["message"][:60] or "ok"] += 1
            assert alive(broker), f"the broker exited at {rung} free descriptors: " \
                f"{broker.log()[-2000:]}"
        limit = free_below(broker.pid, 6)
        resource.prlimit(broker.pid, resource.RLIMIT_NOFILE, (limit, hard))
        floods = [subprocess.Popen(
            t.runc.command("exec", t.id, "python3", ATTACKER_IN_CONTAINER, "ask", "--fuse",
                           "--repeat", str(FLOOD), "op=mount", "path=/mnt/none{i}"),
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT) for t in tenants]
        outputs = [f.communicate(timeout=300)[0] for f in floods]
    finally:
        resource.prlimit(broker.pid, resource.RLIMIT_NOFILE, (soft, hard))
    assert [f.returncode for f in floods] == [0] * TENANTS, outputs
    for output in outputs:  # every request answered: none closed without a word
        assert set(json.loads(output)["counts"]) <= {"ok", "error"}, output
    assert alive(broker)
    assert "Traceback" not in broker.log()
    short = [e for e in broker.events("broker.refused")
             if "short of resources" in str(e.get("reason", ""))]
    assert short, f"no request was refused for want of descriptors: {answers}"
    assert all(e["kind"] == "busy" for e in short)
    assert broker.events("broker.accept_paused")
    # Its limit back, the broker serves as before.
    tenant.sh("mkdir -p /mnt/after").check()
    after = attack(tenant, "ask", "--fuse", "op=mount", "path=/mnt/after")
    assert after["status"] == "ok", after
    assert attack(tenant, "ask", "op=unmount", "path=/mnt/after", "flags=lazy")["status"] \
        == "ok"


def test_out_of_descriptors_between_accept_and_request(
        broker: BrokerProcess, tenants: list[oci.RuncContainer]) -> None:
    """The issue's traceback: a connection accepted while descriptors were free, its
    request read when none are, so the first open for it (/proc/N/status) fails. The
    request is refused "busy" with the reason, and the broker stays."""
    tenant = tenants[0]
    tenant.sh("mkdir -p /mnt/later").check()
    before = len(os.listdir(f"/proc/{broker.pid}/fd"))
    later = Held(tenant, "ask-later", "--fuse", "op=mount", "path=/mnt/later")
    assert later.answer == {"connected": True}
    waiting.wait_for(lambda: len(os.listdir(f"/proc/{broker.pid}/fd")) >= before + 2, 30,
                     "the broker to accept the connection (its socket and pidfd)")
    soft, hard = resource.prlimit(broker.pid, resource.RLIMIT_NOFILE)
    try:
        resource.prlimit(broker.pid, resource.RLIMIT_NOFILE,
                         (free_below(broker.pid, 1) - 1, hard))  # no number free
        assert later.proc.stdin is not None
        assert later.proc.stdout is not None
        later.proc.stdin.write(b"go\n")
        later.proc.stdin.flush()
        answer = json.loads(later.proc.stdout.readline())
    finally:
        resource.prlimit(broker.pid, resource.RLIMIT_NOFILE, (soft, hard))
    later.release()
    assert answer["status"] == "error"
    assert "the broker is short of resources" in answer["message"], answer
    assert "Too many open files" in answer["message"]
    assert alive(broker)
    assert "Traceback" not in broker.log()
    tenant.sh("mkdir -p /mnt/again").check()
    assert attack(tenant, "ask", "--fuse", "op=mount", "path=/mnt/again")["status"] == "ok"
