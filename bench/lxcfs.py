"""LXCFS views through the broker: what a read of a /proc file costs through the view,
beside the same read of the kernel's file (issue 36).

Run from the repository root, as root, with runc, /dev/fuse and lxcfs::

    .venv/bin/python -m bench.lxcfs            # full run, about 20 seconds
    .venv/bin/python -m bench.lxcfs --quick    # smoke run

Real parts: the broker, ``fuse-device-plugin lxcfs`` running Debian's lxcfs in a mount
namespace of its own (``tests/lib/lxcfs.py``), and two runc containers with what a
restricted pod has (uid 1000, no capability, the runtime-default seccomp, 256 MiB and
one CPU): *view*, started through ``fusermount3 --lxcfs --``, and *plain*, not. In
each, a Python loop times ``open``/``read``/``close`` of each file N times (rounds
alternate between the containers). Prints medians and p99s per file and writes JSON to
``bench/results/lxcfs.json`` (or ``--out``). No target: the figure is what a reader
pays, for bench/README.md.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from contextlib import ExitStack
from pathlib import Path
from typing import Any

from fuse_plugin.broker import lxcfs
from tests.lib import broker as broker_rig
from tests.lib import oci, profiles
from tests.lib.lxcfs import LxcfsInstance
from tests.lib.waiting import wait_for

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results" / "lxcfs.json"
FILES = ("/proc/meminfo", "/proc/cpuinfo", "/proc/stat", "/proc/uptime")
# Times N reads of each file named on the command line; prints {file: [microseconds]}.
PROBE = """
import json, sys, time
n = int(sys.argv[1])
out = {}
for name in sys.argv[2:]:
    samples = []
    for _ in range(n):
        t = time.perf_counter_ns()
        with open(name, "rb") as f:
            f.read()
        samples.append((time.perf_counter_ns() - t) / 1000)
    out[name] = samples
print(json.dumps(out))
"""


def container(runc: oci.Runc, allocation: Any, name: str, wrapped: bool) -> oci.RuncContainer:
    hold = ["sleep", "infinity"]
    spec = oci.build_spec(oci.ContainerRequest(
        args=["/usr/bin/fusermount3", "--lxcfs", "--", *hold] if wrapped else hold,
        allocation=allocation, user=(1000, 1000), groups=(), no_new_privileges=True,
        readonly_rootfs=True, drop_capabilities=(oci.DROP_ALL,),
        seccomp=profiles.runtime_default(()), memory_limit=256 * 1024 * 1024, cpuset="0"))
    made: oci.RuncContainer = runc.create(spec, name).start()
    return made


def percentile(values: list[float], p: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(len(ordered) * p / 100))]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="bench.lxcfs", description=__doc__)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    reads, rounds = (200, 2) if args.quick else (2000, 5)
    samples: dict[str, dict[str, list[float]]] = {m: {f: [] for f in FILES}
                                                  for m in ("view", "plain")}
    with tempfile.TemporaryDirectory(prefix="bench-lxcfs-") as tmp, ExitStack() as stack:
        work = Path(tmp)
        broker_dir = work / "broker-dir"
        allocation = broker_rig.allocation(work / "plugin", broker_dir)
        broker = broker_rig.BrokerProcess(broker_dir, work / "broker", broker_rig.shim(),
                                          "--lxcfs-dir", str(work / "lxcfs-dir")).start()
        stack.callback(broker.stop)
        node_lxcfs = LxcfsInstance(work / "lxcfs-dir", work / "lxcfs").start()
        stack.callback(node_lxcfs.stop)
        runc = stack.enter_context(oci.Runc(prefix="fuse-bench-lxcfs"))
        made = {"view": container(runc, allocation, "view", True),
                "plain": container(runc, allocation, "plain", False)}
        wait_for(lambda: broker.events("broker.lxcfs"), 20, "the view to be bound")
        for n in range(rounds):
            order = ["view", "plain"] if n % 2 == 0 else ["plain", "view"]
            for mode in order:
                out = made[mode].exec("python3", "-c", PROBE, str(reads), *FILES,
                                      timeout=120).check().stdout
                for name, values in json.loads(out).items():
                    samples[mode][name] += values
        bound_ms = [e["duration_ms"] for e in broker.events("broker.lxcfs")]
    figures = {name: {mode: {"median_us": round(statistics.median(samples[mode][name]), 1),
                             "p99_us": round(percentile(samples[mode][name], 99), 1)}
                      for mode in samples} for name in FILES}
    print(f"{'file':16} {'view median':>12} {'p99':>9} {'plain median':>13} {'p99':>9}")
    for name, by in figures.items():
        print(f"{name:16} {by['view']['median_us']:>10.1f}us {by['view']['p99_us']:>7.1f}us "
              f"{by['plain']['median_us']:>11.1f}us {by['plain']['p99_us']:>7.1f}us")
    print(f"the bind (broker.lxcfs duration_ms, {len(lxcfs.FILES)} files): {bound_ms}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"reads_per_round": reads, "rounds": rounds,
                                    "figures": figures, "bind_ms": bound_ms,
                                    "samples": samples}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
