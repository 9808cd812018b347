"""A node's plugin rollout as the kubelet's device manager sees it (issue 35).

Run from the repository root, as root (the fake node's FUSE device is made with mknod)::

    .venv/bin/python -m bench.rollout            # about a minute
    .venv/bin/python -m bench.rollout --quick    # a few seconds

The real ``serve`` processes, with the DaemonSet's flags (``bench.run.deployed_flags``:
its args and the pod UID as ``--instance``, a fresh one per pod), against the kubelet
stand-in, which keeps the device manager's books as kubelet 1.37.2 does
(``fuse_plugin/demo/kubelet.py``). Three ways a node's plugin is replaced:

- **one socket**: the release before this one (no ``--instance``): the old process
  stops, the new one starts at once. The figure is how long the kubelet holds the slots
  unhealthy, from its mark to the new plugin's first device list; a pod admitted then
  is rejected for good. A DaemonSet adds the old pod's termination and the new pod's
  start to this (~6 s in the issue).
- **surge**: what ``maxSurge: 1, maxUnavailable: 0`` does: the new pod starts and
  registers, then the old one gets SIGTERM (its hand-off is over at once).
- **hand-off**: a deleted pod: the old one gets SIGTERM first and waits
  (``--handoff-wait``) while the new one starts and registers.

For each: process start to registered, the old plugin's SIGTERM to its exit, how long
both endpoints were up, and the slots' unhealthy time (0 unless the kubelet marked
them). Prints a table; writes JSON (``bench/results/rollout.json`` or ``--out``). No
targets: the figures are in bench/README.md.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import grpc

from bench.run import Proc, deployed_flags, fake_node, start_plugin, summary, write_report
from tests.lib.kubelet import KubeletStandIn
from tests.lib.node import FakeNode

RESOURCE = "github.com/fuse"
RESULTS = Path(__file__).parent / "results" / "rollout.json"
SLOTS = 1000
WAIT = 30.0
FULL, QUICK = 10, 1


def healthy(devices: dict[str, str]) -> bool:
    return len(devices) == SLOTS and "Unhealthy" not in devices.values()


def plugin_flags(instance: bool) -> list[str]:
    """The DaemonSet's flags with a fresh pod UID; without ``instance`` the release
    before this one: no instance, no hand-off."""
    flags = deployed_flags()
    if instance:
        return flags
    return [f for f in flags if not f.startswith(("--instance=", "--handoff-wait="))]


class Rig:
    """A fake node, the stand-in, and the plugin processes started on it."""

    def __init__(self, node: FakeNode, kubelet: KubeletStandIn) -> None:
        self.node = node
        self.kubelet = kubelet

    def start(self, instance: bool) -> tuple[Proc, float]:
        """A plugin, and when the stand-in had its full healthy device list."""
        count = len(self.kubelet.registrations) + 1
        proc = start_plugin(self.node, SLOTS, plugin_flags(instance))
        self.kubelet.wait_registered(count, WAIT)
        self.kubelet.wait_devices(RESOURCE, healthy, WAIT)
        return proc, time.perf_counter()

    def sigterm(self, proc: Proc) -> float:
        proc.popen.terminate()
        return time.perf_counter()

    def exited(self, proc: Proc) -> float:
        proc.popen.wait(WAIT)
        return time.perf_counter()

    def only(self, proc: Proc) -> None:
        """Wait until the kubelet holds ``proc``'s endpoint alone (the old one's
        disconnect handled)."""
        name = proc.socket.name
        if not self.kubelet.wait_for(lambda: self.kubelet.endpoints(RESOURCE) == [name],
                                     WAIT):
            raise TimeoutError(f"endpoints {self.kubelet.endpoints(RESOURCE)}, not [{name}]")

    def unhealthy_for(self, marks_before: int, healthy_at: float) -> float:
        """Seconds from the stand-in's unhealthy mark (if any) to ``healthy_at``."""
        marks = self.kubelet.unhealthy_marks[marks_before:]
        return max(0.0, healthy_at - marks[0].at) if marks else 0.0


def one_socket(rig: Rig, old: Proc) -> tuple[dict[str, float], Proc]:
    marks = len(rig.kubelet.unhealthy_marks)
    stopped = rig.sigterm(old)
    exited = rig.exited(old)
    new, listed = rig.start(instance=False)
    return {"registered": listed - new.started, "old_exit": exited - stopped,
            "overlap": 0.0, "unhealthy": rig.unhealthy_for(marks, listed)}, new


def surge(rig: Rig, old: Proc) -> tuple[dict[str, float], Proc]:
    marks = len(rig.kubelet.unhealthy_marks)
    new, listed = rig.start(instance=True)
    stopped = rig.sigterm(old)
    exited = rig.exited(old)
    rig.only(new)
    return {"registered": listed - new.started, "old_exit": exited - stopped,
            "overlap": time.perf_counter() - listed,
            "unhealthy": rig.unhealthy_for(marks, time.perf_counter())}, new


def handoff(rig: Rig, old: Proc) -> tuple[dict[str, float], Proc]:
    marks = len(rig.kubelet.unhealthy_marks)
    stopped = rig.sigterm(old)
    new, listed = rig.start(instance=True)
    exited = rig.exited(old)
    rig.only(new)
    return {"registered": listed - new.started, "old_exit": exited - stopped,
            "overlap": time.perf_counter() - listed,
            "unhealthy": rig.unhealthy_for(marks, time.perf_counter())}, new


Way = Callable[[Rig, Proc], tuple[dict[str, float], Proc]]
WAYS: dict[str, tuple[bool, Way]] = {"one_socket": (False, one_socket),
                                     "surge": (True, surge), "handoff": (True, handoff)}


def measure(runs: int) -> dict[str, Any]:
    figures: dict[str, Any] = {}
    with fake_node() as node, KubeletStandIn(node.plugin_dir) as kubelet:
        rig = Rig(node, kubelet)
        for name, (instance, way) in WAYS.items():
            samples: dict[str, list[float]] = {}
            proc, _ = rig.start(instance)
            try:
                for _ in range(runs):
                    sample, proc = way(rig, proc)
                    for key, value in sample.items():
                        samples.setdefault(key, []).append(value)
            finally:
                proc.stop()
            figures[name] = {key: summary(values) for key, values in samples.items()}
            figures[name]["rejecting_runs"] = sum(1 for v in samples["unhealthy"] if v > 0)
    return figures


def table(figures: dict[str, Any]) -> str:
    rows = [f"{'way':<11} {'start->registered':>18} {'SIGTERM->exit':>14} "
            f"{'both up':>9} {'slots unhealthy':>16} {'runs w/ gap':>12}"]
    for name, figure in figures.items():
        cells = [f"{figure[key]['median_ms']:.0f} ms"
                 for key in ("registered", "old_exit", "overlap", "unhealthy")]
        rows.append(f"{name:<11} {cells[0]:>18} {cells[1]:>14} {cells[2]:>9} "
                    f"{cells[3]:>16} {figure['rejecting_runs']:>5}/{figure['unhealthy']['n']}")
    return "\n".join(rows) + "\n(medians; 'both up': the kubelet held two endpoints)"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.rollout",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="one run of each (seconds)")
    parser.add_argument("--out", type=Path, default=RESULTS, help=f"JSON path ({RESULTS})")
    args = parser.parse_args(argv)
    if os.geteuid() != 0:
        print("bench.rollout: needs root (the fake node's FUSE device is made with mknod)",
              file=sys.stderr)
        return 2
    os.environ.setdefault("GRPC_VERBOSITY", "ERROR")
    runs = QUICK if args.quick else FULL
    began = time.monotonic()
    figures = measure(runs)
    result = {"mode": "quick" if args.quick else "full", "runs": runs,
              "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
              "seconds": round(time.monotonic() - began, 1),
              "machine": {"cpus": os.cpu_count(), "python": platform.python_version(),
                          "grpcio": grpc.__version__, "loadavg": os.getloadavg()},
              "serve_flags": plugin_flags(True), "figures": figures}
    write_report(args.out, result, table(figures))
    return 0


if __name__ == "__main__":
    sys.exit(main())
