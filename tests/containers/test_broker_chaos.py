"""The broker under chaos (issue 20), a short run of bench/broker_chaos.py's scenario:
the real broker with its DaemonSet's flags, eight hostile pods attacking at once (a
daemon that never answers and a rename race through it, a chroot race against the
runtime's masks, silent connections, descriptors over SCM_RIGHTS, pinned and hidden
mounts past the quota, a request flood, a file of a stub that never answers FLUSH named
as fuse_fd, refusals with huge paths and options) while a root and a restricted uid 1000 pod
mount, read and unmount squashfuse through the shim, and more pods (eight in the quick
size, 99 in the full one: a node full to its maxPods) hold their share of silent
connections; then SIGTERM in the middle of it.

Only behaviour is asserted (the benchmark reports the times against its targets): every
well-behaved mount works, every connection gets an answer, the broker holds nothing
after the attackers leave, and it stops cleanly on SIGTERM.
"""

from __future__ import annotations

import json

import pytest

from bench import broker_chaos
from bench.broker_chaos import GOOD, HOSTILE, Report

pytestmark = pytest.mark.timeout(900)


@pytest.fixture(scope="module")
def chaos(machine: None) -> Report:
    problems = broker_chaos.blockers()
    if problems:
        pytest.fail("; ".join(problems))
    return broker_chaos.run(broker_chaos.QUICK)


def test_the_attacks_happened(chaos: Report) -> None:
    """The scenario is what it says: the stalled mount was made, the races ran, the
    flood and the silent connections reached the broker."""
    for result in chaos.rounds:
        tools = result.tools
        assert tools["stall"]["hold"] == "ok"
        assert tools["stall"]["swaps"] > 0
        assert any("is at or inside the fuse mount" in m
                   for m in tools["stall"]["requests"]["messages"])
        assert tools["chroot"]["flips"] > 0
        assert any("not its mount namespace's root (chroot)" in m
                   for m in tools["chroot"]["requests"]["messages"])
        assert tools["pin"]["mounted"] > 0
        assert tools["foreign"]["stub"] == "ok"
        assert any("is not /dev/fuse" in m for m in tools["foreign"]["requests"]["messages"])
        for name in HOSTILE:
            assert tools[name]["requests"]["requests"] > 0, name


def test_every_well_behaved_mount_read_and_unmount_worked(chaos: Report) -> None:
    for result in chaos.rounds:
        for name in GOOD:
            tool = result.tools[name]
            assert tool["failures"] == [], (name, tool["failures"])
            assert tool["failed"] == 0
            assert tool["mount_ms"], f"{name} mounted nothing"
            assert len(tool["unmount_ms"]) == len(tool["mount_ms"])


def test_every_request_and_connection_got_an_answer(chaos: Report) -> None:
    for result in chaos.rounds:
        for name in HOSTILE:
            requests = result.tools[name]["requests"]
            assert requests["unanswered"] == 0, (name, requests)
            assert set(requests["status"]) <= {"ok", "error"}, (name, requests["status"])


def test_no_failure_or_stall_for_the_well_behaved_containers(chaos: Report) -> None:
    for result in chaos.rounds:
        assert result.events["good_failed"] == 0, result.events["counts"]
        assert result.events["good_stalled"] == 0, result.events["counts"]
        mounts = result.events["counts"]["broker.mount"]
        assert all(mounts.get(name, 0) > 0 for name in GOOD)


def test_the_runtimes_masks_survive_the_chroot_race(chaos: Report) -> None:
    for result in chaos.rounds:
        assert result.tools["chroot"]["masks"] == ["/proc/irq", "/proc/keys"]
        # Nothing was unmounted for the chroot racer: every /keys and /irq was refused.
        assert result.events["counts"].get("broker.unmount", {}).get("chroot", 0) == 0


def test_the_brokers_fds_return_to_the_baseline_after_the_attackers_leave(
        chaos: Report) -> None:
    """Each round waits (with a deadline) for the count to come back; it must have."""
    for result in chaos.rounds:
        assert result.fds_max > chaos.fds_start  # the chaos did open connections
        assert result.fds_after == chaos.fds_start


def test_sigterm_during_the_chaos_stops_the_broker_with_exit_0(chaos: Report) -> None:
    """SIGTERM while every attack runs; the run waits for the exit at most the
    DaemonSet's terminationGracePeriodSeconds."""
    stop = chaos.final.stop
    assert stop["exit_code"] == 0, stop
    assert stop["stopped_event"]


def test_the_benchmark_reports_every_figure_of_the_run(chaos: Report) -> None:
    """What ``python -m bench.broker_chaos`` prints and writes comes from this run:
    every figure has a value, each target a verdict, and the JSON is complete."""
    table = broker_chaos.figures(chaos)
    assert all(f.value for f in table)
    assert all(isinstance(f.ok, bool) for f in table if f.target)
    report = json.loads(json.dumps(broker_chaos.as_json(
        chaos, table, broker_chaos.QUICK, (0.0, 0.0, 0.0))))
    assert [f["label"] for f in report["figures"]] == [f.label for f in table]
    assert report["sigterm_round"]["stop"]["exit_code"] == 0
    assert report["broker_flags"] == chaos.flags
    assert any(f.startswith("--metrics-port=") for f in report["broker_flags"])
