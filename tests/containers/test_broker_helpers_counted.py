"""Live helpers are counted until they exit (issue 26): a container whose helper was
killed but has not exited (blocked in the kernel on its FUSE daemon) gets no new one.

A stand-in for the helper ends up where a helper would if a tenant's daemon ever caught
it (blocked on the lock of the tenant's never-answering FUSE root, beyond SIGKILL), and
holds an flock for as long as it lives: a second stand-in that starts while the first
is still alive cannot take it and says so. The tenant asks twice in a row; the broker
kills the first at its deadline, frees it by aborting the container's FUSE connections,
and only then starts the second. The tenant has containerd's default capabilities and
the real RuntimeDefault rules.
"""

from __future__ import annotations

from pathlib import Path

from tests.lib import broker as broker_rig
from tests.lib import oci, profiles, waiting, workloads
from tests.lib.broker import BrokerProcess, Held, attack

# The stand-in: first the flock (held until this process is gone, stuck or not), then
# the stuck stand-in (tests/lib/broker.stuck_helper): a child takes the lock of the caller's
# never-answering FUSE root (mkdir in it waits on the daemon while holding the
# directory's lock), then this process looks a name up there and waits on that lock,
# uninterruptibly.
FLOCK_FIRST = """here = os.path.dirname(os.path.abspath(sys.argv[0]))
lock = open(os.path.join(here, "alive.lock"), "w")
with open(os.path.join(here, "starts.log"), "a") as log:
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        log.write(f"start {os.getpid()}\\n")
    except BlockingIOError:
        log.write(f"overlap {os.getpid()}\\n")
"""
COUNTED_HELPER = broker_rig.stuck_helper("fcntl, os, re, sys", FLOCK_FIRST)


def test_a_container_whose_helper_has_not_exited_gets_no_new_one(
        machine: None, tmp_path: Path) -> None:
    broker_dir = tmp_path / "broker-dir"
    allocation = broker_rig.allocation(tmp_path / "plugin", broker_dir)
    real = BrokerProcess(broker_dir, tmp_path / "real", broker_rig.shim()).start()
    request = oci.ContainerRequest(args=workloads.HOLD, allocation=allocation,
                                   seccomp=profiles.runtime_default(),
                                   binds=[broker_rig.attacker_bind()])
    with oci.Runc() as runc:
        tenant = runc.create(oci.build_spec(request), "counted").start()
        tenant.sh("mkdir -p /mnt/stall /mnt/other").check()
        stall = Held(tenant, "hold", "/mnt/stall")
        assert stall.answer["status"] == "ok"
        # The stall mount is the broker's (its records): it may abort it.
        counted = broker_rig.with_stand_in_helper(real, COUNTED_HELPER, tmp_path / "counted")
        counted.start()
        fake = counted.shim.parent  # the stand-in logs its starts beside itself
        try:
            first = attack(tenant, "ask", "--fuse", "op=mount", "path=/mnt/other")
            assert "did not finish within" in first["message"]
            # Asked while the killed helper is still alive: it waits, and once the helper
            # is stuck past the grace it is refused, never given a second helper.
            second = attack(tenant, "ask", "--fuse", "op=mount", "path=/mnt/other")
            assert "last helper is blocked in the kernel" in second["message"], second
            assert counted.events("broker.aborted")
            [stuck_pid] = [int(n) for n in (fake / "starts.log").read_text().split()[1::2]]
            waiting.wait_for(lambda: not Path(f"/proc/{stuck_pid}").exists(), 30,
                             "the freed helper to exit and be reaped")
            # Gone: the container gets a helper again.
            third = attack(tenant, "ask", "--fuse", "op=mount", "path=/mnt/other")
            assert third["status"] == "error"
            starts = (fake / "starts.log").read_text().split()
            assert starts[::2] == ["start", "start"], starts  # never an overlap
        finally:
            counted.stop()
            stall.release()
