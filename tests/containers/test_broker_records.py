"""Crash-only records (issue 26): a broker killed at any instant leaves no mount it made
that it does not count and cannot remove.

The broker used to write a mount's record after its reply: killed in between (55-65
restarts while a container mounted in a loop left 2 to 15 such mounts), the mount was
live but unrecorded, so --max-mounts did not count it and ``fusermount3 -u`` was refused
as "not a mount the broker made". Now the helper reports the new connection while the
mount is still detached, the broker records it, and only then is it attached: a broker
that dies before leaves a detached mount that goes with its helper.

Here a tenant (containerd's default capabilities, the real RuntimeDefault rules) mounts
one directory after another while the broker is killed (SIGKILL) after a random 1 to 4
more mounts and restarted, again and again; then every FUSE mount in the tenant is a
recorded one, and the broker unmounts each at the tenant's request.
"""

from __future__ import annotations

import json
import random
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest

from fuse_plugin.api import api_pb2 as api
from tests.lib import broker as broker_rig
from tests.lib import oci, profiles, waiting, workloads
from tests.lib.broker import ATTACKER_IN_CONTAINER, BrokerProcess, attack

KILLS = 40
SEED = 26
LIMITS = ("--max-mounts", "1000", "--max-mounts-pod", "1000")


def served(broker: BrokerProcess, mounts: int) -> Callable[[], bool]:
    return lambda: len(broker.events("broker.mount")) >= mounts


def recorded(broker: BrokerProcess) -> set[int]:
    return {int(p.name.split("-")[0]) for p in broker.state.glob("*.json")
            if not p.name.startswith(".")}  # a write the kill interrupted: no record


@pytest.mark.timeout(600)
def test_a_broker_killed_at_any_instant_leaves_no_unrecorded_mount(
        broker_dir: Path, broker_allocation: api.ContainerAllocateResponse,
        tmp_path: Path) -> None:
    rng = random.Random(SEED)
    broker = BrokerProcess(broker_dir, tmp_path / "broker", broker_rig.shim(), *LIMITS)
    broker.start()
    request = oci.ContainerRequest(args=workloads.HOLD, allocation=broker_allocation,
                                   seccomp=profiles.runtime_default(),
                                   binds=[broker_rig.attacker_bind()])
    try:
        with oci.Runc() as runc:
            tenant = runc.create(oci.build_spec(request), "mounter").start()
            loop = subprocess.Popen(
                tenant.runc.command("exec", tenant.id, "python3",
                                    ATTACKER_IN_CONTAINER, "mount-loop", "/mnt/c"),
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
            tenant.daemons.append(loop)
            for _ in range(KILLS):
                target = len(broker.events("broker.mount")) + rng.randint(1, 4)
                waiting.wait_for(served(broker, target), 60, "the tenant's next mounts")
                broker.kill()
                broker.start()
            assert loop.stdin is not None
            out, _ = loop.communicate(b"", timeout=60)
            tally = json.loads(out)
            live = tenant.fuse_connections()
            assert live, tally
            assert live <= recorded(broker), (sorted(live - recorded(broker)), tally)
            undone = attack(tenant, "ask", "--repeat", str(tally["asked"]), "op=unmount",
                            "path=/mnt/c/{i}", "flags=lazy", timeout=300)
            assert undone["counts"].get("ok", 0) == len(live), undone
            assert tenant.fuse_connections() == set()
    finally:
        broker.stop()
