"""The benchmark's quick mode runs end to end and reports every figure.

No time is asserted here (tests never assert wall-clock times): the benchmark itself
prints PASS/FAIL per target. This only checks that it runs against the real plugin and
the floor and that its JSON has every figure with a number in it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
# Exit codes of `python -m bench`: 0 all targets met, 3 some missed (both are a full run).
COMPLETED = (0, 3)
FIGURES = (
    "reregister", "reregister_received", "reregister_listed", "start",
    "health_unhealthy", "health_healthy", "allocate_sequential", "allocate_concurrent",
    "throughput_sequential", "throughput_concurrent", "allocate_cpu", "allocate_concurrent_cpu",
    "scale_10_list", "scale_10_allocate", "scale_1000_list", "scale_1000_allocate",
    "scale_10000_list", "scale_10000_allocate",
    "rss_start", "rss_deployed", "rss_allocates_done", "rss_restarts_done", "rss_growth",
    "rss_after_stress", "idle_cpu", "idle_python_cpu", "idle_cpu_beyond_floor",
)
FLOORED = ("reregister", "start", "health_unhealthy", "health_healthy",
           "allocate_sequential", "allocate_concurrent", "allocate_cpu", "throughput_concurrent",
           "scale_10000_list", "scale_10000_allocate", "rss_start", "rss_after_stress",
           "idle_cpu", "idle_python_cpu")
# Compared with the floor round by round: the ratio is reported with its quartiles.
RATIOS = ("allocate_sequential", "allocate_cpu", "throughput_concurrent")


@pytest.mark.timeout(300)
def test_quick_benchmark_reports_every_figure(tmp_path: Path) -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root: the fake node's FUSE device is made with mknod (CAP_MKNOD)")
    out = tmp_path / "bench.json"
    run = subprocess.run([sys.executable, "-m", "bench", "--quick", "--out", str(out)],
                         check=False, cwd=ROOT, capture_output=True, text=True, timeout=280)
    assert run.returncode in COMPLETED, run.stdout + run.stderr
    assert f"JSON written to {out}" in run.stdout
    result = json.loads(out.read_text())
    assert result["mode"] == "quick"
    figures = result["figures"]
    assert set(FIGURES) <= set(figures), sorted(set(FIGURES) - set(figures))
    for key in FIGURES:
        assert isinstance(figures[key]["median"], (int, float)), key
    for key in FLOORED:
        assert isinstance(figures[key]["floor_median"], (int, float)), key
    targets = [key for key, figure in figures.items() if figure["target"]]
    assert all(isinstance(figures[key]["pass"], bool) for key in targets)
    assert len(targets) == result["passed"] + len(result["failed"])
    for key in ("median", "p99"):
        assert isinstance(figures["allocate_sequential"][key], float)
    for key in RATIOS:
        ratio = figures[key]["vs_floor"]
        assert ratio["q1"] <= ratio["median"] <= ratio["q3"], key
    # The plugin ran as the DaemonSet runs it (its metrics port moved to a free one).
    # and with the pod UID its environment gives it as --instance.
    *flags, instance = result["serve_flags"]
    assert flags == ["--metrics-port=9402", "--handoff-wait=20"]
    assert uuid.UUID(instance.removeprefix("--instance="))
    assert figures["rss_deployed"]["figure"].endswith("scrapes")


# -- bench/broker.py: where a mount's time goes, read from `perf trace` -------------------

BROKER_PID = 100
# One mount through the broker as perf trace prints it (perf 6.1): the program, the
# shim, the broker's loop (python) and its helper. A call that blocked shows up twice:
# entered ("...") and then "[continued]" with its start and duration.
BROKERED_RUN = """\
2000.000 ( 0.100 ms): squashfuse/300 execve(filename: 0x1, argv: 0x2, envp: 0x3) = 0
2001.000 ( 0.020 ms): squashfuse/300 mount(flags: NOSUID|NODEV) = -1 EPERM
2001.500 ( 0.100 ms): fusermount3/301 execve(filename: 0x1, argv: 0x2, envp: 0x3) = 0
2001.700 ( 0.030 ms): fusermount3/301 connect(fd: 7, uservaddr: 0x1, addrlen: 110)               = 0
2001.800 ( 0.020 ms): python/100 accept4(fd: 6, flags: 524288) = 11
2001.850 ( 0.010 ms): python/100 accept4(fd: 6, flags: 524288) = -1 EAGAIN
2001.900 ( 0.020 ms): fusermount3/301 sendto(fd: 7, buff: 0x1, len: 82, flags: NOSIGNAL) = 82
2001.950 (         ): fusermount3/301 recvfrom(fd: 7, ubuf: 0x1, size: 16383)                 ...
2002.000 ( 0.020 ms): python/100 recvfrom(fd: 11, ubuf: 0x1, size: 16385)                   = 82
         ? (         ): python/302  ... [continued]: vfork())      = 0
2002.300 (         ): python/100 vfork()      ...
2002.500 ( 0.100 ms): fuse-broker-he/302 execve(filename: 0x1, argv: 0x2, envp: 0x3) = 0
2002.300 ( 0.400 ms): python/100  ... [continued]: vfork())      = 302
2002.800 ( 0.020 ms): python/100 sendto(fd: 14, buff: 0x1, len: 105)                        = 105
SETGROUPS
2003.000 ( 0.020 ms): fuse-broker-he/302 sendto(fd: 15, buff: 0x1, len: 58, flags: NOSIGNAL) = 58
2003.100 ( 0.020 ms): python/100 sendto(fd: 14, buff: 0x1, len: 5)                          = 5
2003.300 ( 0.020 ms): fuse-broker-he/302 sendto(fd: 15, buff: 0x1, len: 102, flags: NOSIGNAL) = 102
2003.400 ( 0.020 ms): python/100 sendto(fd: 14, buff: 0x1, len: 56)                         = 56
2003.800 ( 0.020 ms): fuse-broker-he/302 sendto(fd: 15, buff: 0x1, len: 111, flags: NOSIGNAL) = 111
2004.300 ( 0.020 ms): python/100 sendto(fd: 11, buff: 0x1, len: 23)                         = 23
2001.950 ( 2.400 ms): fusermount3/301  ... [continued]: recvfrom())      = 23
2004.400 ( 0.020 ms): fusermount3/301 sendmsg(fd: 4, msg: 0x1, flags: NOSIGNAL)                  = 1
2004.900 (         ): squashfuse/300 exit_group()      = ?
"""
DIRECT_RUN = """\
1000.000 ( 0.100 ms): squashfuse/200 execve(filename: 0x1, argv: 0x2, envp: 0x3) = 0
1001.000 ( 0.050 ms): squashfuse/200 mount(flags: NOSUID|NODEV) = 0
1001.500 (         ): squashfuse/200 exit_group()      = ?
"""


def _shifted(text: str, ms: float, pids: int) -> str:
    """The same run later, with other pids (the broker's own stays)."""
    out = []
    for line in text.splitlines():
        stamp, sep, rest = line.partition(" (")
        if stamp.strip() not in ("?", "SETGROUPS"):
            stamp = f"{float(stamp) + ms:.3f}"
        for pid in (300, 301, 302):
            rest = rest.replace(f"/{pid} ", f"/{pid + pids} ").replace(
                f"= {pid}", f"= {pid + pids}")
        out.append(stamp + sep + rest)
    return "\n".join(out) + "\n"


def test_broker_breakdown_reads_every_step_of_a_mount_from_perf_trace() -> None:
    from bench import broker as bench_broker

    root = BROKERED_RUN.replace("SETGROUPS\n", "")
    nonroot = _shifted(BROKERED_RUN, 1000, 100).replace(
        "SETGROUPS", "3002.650 ( 0.010 ms): fuse-broker-he/402 setgroups(gidsetsize: 0, "
                     "grouplist: 0x1) = 0")
    events = bench_broker.parse_trace(DIRECT_RUN + root + nonroot + "garbage line\n")
    runs = bench_broker.classify(events, BROKER_PID)
    assert [len(runs[mode]) for mode in bench_broker.MODES] == [1, 1, 1]
    [direct] = runs["direct"]
    assert direct == pytest.approx({"program": 1.05, "daemonize": 0.45, "total": 1.5})
    expected = {"program": 1.02, "shim": 0.71, "accept": 0.09, "identify": 0.2,
                "prepare": 0.28, "spawn": 0.4, "enter": 0.42, "walk": 0.3, "verdict": 0.1,
                "mount": 0.4, "reply": 0.5, "handback": 0.1, "daemonize": 0.48,
                "total": 4.9, "broker_side": 2.5}
    for mode in ("broker", "broker-nonroot"):
        [run] = runs[mode]
        assert run == pytest.approx(expected), mode
    # Every step of the brokered path is a row of the table, in order.
    assert [key for key, _ in bench_broker.BROKER_PHASES] == list(expected)[:13]


def test_broker_breakdown_skips_a_run_the_trace_lost_a_step_of() -> None:
    from bench import broker as bench_broker

    lost = "".join(line + "\n" for line in BROKERED_RUN.replace("SETGROUPS\n", "")
                   .splitlines() if "sendmsg" not in line)
    runs = bench_broker.classify(bench_broker.parse_trace(lost), BROKER_PID)
    assert runs == {mode: [] for mode in bench_broker.MODES}
