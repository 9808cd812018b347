"""Issue 35 on the real kubelet 1.37.2: a plugin rollout that no pod notices.

The kubelet keeps one endpoint per socket path and marks the resource's devices
unhealthy only when its last endpoint disconnects (``PluginDisconnected``, log line
``Mark all resources Unhealthy for resource``); a pod admitted then is rejected for good.
First the old way, on one socket: the gap, and a pod rejected in it. Then the new way,
with a static pod asking for the resource every second throughout: the release before
this one (one socket, no hand-off) replaced by an instance, then six more replacements,
in turn as a ``maxSurge`` rollout does (the new one registered, then the old one
stopped) and as a deleted pod is (the old one stopped first; ``--handoff-wait`` keeps it
serving until its successor has registered).
Every pod must run; the kubelet must never log the mark. Times go to evidence.txt and
bench/README.md, not into assertions.
"""

from __future__ import annotations

import json
import re
import signal
import time
from typing import Any

from tests.kubelet import node as nodemod
from tests.kubelet.static_pods import (
    KUBELET_LOG,
    RESOURCE,
    SLOTS,
    PodRun,
    container,
    evidence,
    kubelet_lines,
    pod_spec,
    pods,
    wait_registered,
)
from tests.lib.background import Repeating

# Enough slots that pods arriving every second never run out while they overlap.
ROLL_SLOTS = 16
POD_EVERY = 1.0
HANDOFF_WAIT = 20
# Rollouts after the first: a surge, then a deleted pod, in turn.
ROUNDS = 6
MARK = r'"Mark all resources Unhealthy for resource" resourceName="github.com/fuse"'
HEALTHY = (r'"Processed device updates for resource" resourceName="github.com/fuse" '
           r'totalCount=\d+ healthyCount=[1-9]')
NO_HEALTHY = f"no healthy devices present; cannot allocate unhealthy devices {RESOURCE}"
KLOG_TIME = re.compile(r"^[IWEF]\d{4} (\d\d):(\d\d):(\d\d\.\d+)")


def klog_seconds(line: str) -> float:
    """A kubelet log line's time of day, in seconds (only differences are used)."""
    found = KLOG_TIME.match(line)
    assert found, f"not a klog line: {line!r}"
    hours, minutes, seconds = found.groups()
    return int(hours) * 3600 + int(minutes) * 60 + float(seconds)


def connected(instance_socket: str) -> str:
    return (r'"Connected to new client" resource="github.com/fuse" socketPath="[^"]*/'
            + re.escape(instance_socket) + '"')


def disconnected(instance_socket: str) -> str:
    return (r'"Deregistered client" name="github.com/fuse" socketPath="[^"]*/'
            + re.escape(instance_socket) + '"')


def socket_of(instance: str) -> str:
    return f"github.com_fuse-{instance}.sock"


def kubelet_line(since: int, pattern: str, what: str, timeout: float = 45) -> str:
    lines: list[str] = nodemod.wait_for(
        lambda: kubelet_lines(since, pattern), timeout, what, interval=0.2,
        detail=lambda: nodemod.tail(KUBELET_LOG, 30))
    return lines[0]


def plugin_events(name: str, event: str) -> list[dict[str, Any]]:
    """The JSON events ``event`` of the plugin's latest start: node.spawn appends to the
    log and adds a header line (``==== ... start``) per start, and an earlier run on the
    same machine left its own."""
    text = nodemod.read_log(nodemod.LOGDIR / f"{name}.log")
    latest = text.rsplit("\n==== ", 1)[-1]
    found = []
    for line in latest.splitlines():
        if line.startswith("{"):
            record = json.loads(line)
            if record.get("event") == event:
                found.append(record)
    return found


def start_instance(node: Any, name: str, instance: str) -> tuple[int, float]:
    """A plugin as the DaemonSet runs it now: its own socket, the hand-off on SIGTERM.
    Returns the kubelet log offset and the time before it started."""
    since = nodemod.log_size(KUBELET_LOG)
    started = time.monotonic()
    node.spawn(name, node.plugin_argv(ROLL_SLOTS, "--instance", instance, "--handoff-wait",
                                      str(HANDOFF_WAIT), "--log-format", "json"))
    return since, started


def stop_and_wait(node: Any, name: str) -> float:
    """SIGTERM, then wait for the exit; the seconds it took."""
    started = time.monotonic()
    node.send_signal(name, signal.SIGTERM)
    nodemod.wait_for(lambda: not node.alive(name), HANDOFF_WAIT + 10, f"{name} to exit",
                     interval=0.1)
    node.stop(name)  # reaps it and drops its record
    return time.monotonic() - started


class PodStream(Repeating):
    """A static pod asking for the resource every second, on a thread, until stopped."""

    def __init__(self, node: Any) -> None:
        super().__init__(POD_EVERY, "pods")
        self.node = node
        self.runs: list[PodRun] = []

    def step(self) -> None:
        name = f"roll-{len(self.runs)}"
        self.runs.append(PodRun(self.node, name, pod_spec(
            container(self.node, "test -c /dev/fuse && echo FUSE_OK", fuse=1))))

    def finish(self) -> dict[str, str]:
        """Wait for every pod to end; their phases by name, then remove them all."""
        try:
            return {run.name: str(run.wait_done(180)["status"]["phase"]) for run in self.runs}
        finally:
            for run in self.runs:
                (self.node.manifests / f"{run.name}.json").unlink(missing_ok=True)
            names = {f"{run.name}-{nodemod.NODE_NAME}" for run in self.runs}
            nodemod.wait_for(
                lambda: not names & {p["metadata"]["name"] for p in self.node.pods() or []},
                120, "the rollout's pods to be removed", interval=0.5)

    def report(self) -> str:
        return "\n".join(run.report() for run in self.runs if run.phase != "Succeeded")


def restart_legacy(node: Any, slots: int) -> None:
    """The fixture's plugin (one socket, no hand-off: the release before this one), at
    ``slots``, registered."""
    if node.alive("plugin"):
        node.stop("plugin")
    since = node.start_plugin(slots)
    wait_registered(node, since, f"the one-socket plugin with {slots} slots")


def test_one_socket_restart_leaves_a_gap_a_pod_is_rejected_in(kube_node: Any) -> None:
    """What the issue saw, on demand: the one-socket plugin stops, the kubelet marks the
    slots unhealthy, a pod admitted now fails for good. Then the gap of a plain restart
    (stop, start at once), from the mark to the first healthy device list."""
    restart_legacy(kube_node, SLOTS)
    since = nodemod.log_size(KUBELET_LOG)
    kube_node.stop("plugin")
    mark = kubelet_line(since, MARK, "the kubelet to mark the slots unhealthy")
    with pods(kube_node, gap=pod_spec(container(kube_node, "true", fuse=1))) as runs:
        run = runs["gap"]
        pod = run.expect("Failed")
        status = pod["status"]
        assert status.get("reason") == "UnexpectedAdmissionError", run.report()
        assert NO_HEALTHY in status.get("message", ""), run.report()
    since = nodemod.log_size(KUBELET_LOG)
    restart_legacy(kube_node, SLOTS)
    healthy_again = kubelet_line(since, HEALTHY, "the restarted plugin's devices")
    # Restarts with nothing waited for: stop, start at once.
    gaps = []
    for _ in range(3):
        since = nodemod.log_size(KUBELET_LOG)
        kube_node.stop("plugin")
        kube_node.start_plugin(SLOTS)
        gap_start = kubelet_line(since, MARK, "the mark of the plain restart")
        gap_end = kubelet_line(since, HEALTHY, "the plain restart's devices")
        gaps.append(klog_seconds(gap_end) - klog_seconds(gap_start))
        wait_registered(kube_node, since, "after the plain restart")
    evidence("rollout-one-socket", [
        mark, f"pod admitted in the gap -> Failed: {status.get('message')}", healthy_again,
        "plain restarts (SIGTERM, the next process started once it exited): slots "
        "unhealthy for " + ", ".join(f"{g:.3f}" for g in gaps)
        + " s (kubelet log, mark -> first healthy list)",
    ])


def surge(node: Any, old: str, new: str) -> str:
    """What maxSurge does on a node: ``new`` starts and registers, then ``old`` gets
    SIGTERM; its hand-off is over at once. One line of times for the evidence."""
    since, started = start_instance(node, f"plugin-{new}", new)
    new_in = kubelet_line(since, connected(socket_of(new)), f"instance {new} connected")
    registered = time.monotonic() - started
    took = stop_and_wait(node, f"plugin-{old}")
    old_out = kubelet_line(since, disconnected(socket_of(old)), f"instance {old} disconnected")
    [done] = plugin_events(f"plugin-{old}", "handoff.done")
    assert done["successor"] == socket_of(new), done
    return (f"surge {old}->{new}: {new} registered {registered:.2f}s after its start; "
            f"{old} exited {took:.2f}s after SIGTERM (hand-off {done['waited_ms']} ms); "
            f"both endpoints up {klog_seconds(old_out) - klog_seconds(new_in):.3f}s")


def handoff(node: Any, old: str, new: str) -> str:
    """What a deleted pod is: ``old`` gets SIGTERM first and waits; its replacement
    ``new`` starts meanwhile and registers; then ``old`` goes."""
    since = nodemod.log_size(KUBELET_LOG)
    stopping = time.monotonic()
    node.send_signal(f"plugin-{old}", signal.SIGTERM)
    nodemod.wait_for(lambda: plugin_events(f"plugin-{old}", "handoff.waiting"), 10,
                     f"{old} to wait for a successor", interval=0.1)
    assert node.alive(f"plugin-{old}"), f"{old} exited instead of waiting for a successor"
    _, started = start_instance(node, f"plugin-{new}", new)
    new_in = kubelet_line(since, connected(socket_of(new)), f"instance {new} connected")
    registered = time.monotonic() - started
    nodemod.wait_for(lambda: not node.alive(f"plugin-{old}"), HANDOFF_WAIT + 10,
                     f"{old} to exit after the hand-off", interval=0.1)
    took = time.monotonic() - stopping
    node.stop(f"plugin-{old}")
    old_out = kubelet_line(since, disconnected(socket_of(old)), f"instance {old} disconnected")
    [done] = plugin_events(f"plugin-{old}", "handoff.done")
    assert done["successor"] == socket_of(new), done
    return (f"hand-off {old}->{new}: {new} registered {registered:.2f}s after its start; "
            f"{old} exited {took:.2f}s after SIGTERM (hand-off {done['waited_ms']} ms); "
            f"both endpoints up {klog_seconds(old_out) - klog_seconds(new_in):.3f}s")


def test_rollouts_with_a_pod_every_second_reject_none(kube_node: Any) -> None:
    node = kube_node
    restart_legacy(node, ROLL_SLOTS)
    begin = nodemod.log_size(KUBELET_LOG)
    stream = PodStream(node).start()
    steps: list[str] = []
    try:
        # The release before this one (one socket, no hand-off) replaced by an instance.
        since, started = start_instance(node, "plugin-r0", "r0")
        kubelet_line(since, connected(socket_of("r0")), "instance r0 connected")
        registered = time.monotonic() - started
        took = stop_and_wait(node, "plugin")
        steps.append(f"one-socket plugin -> r0: r0 registered {registered:.2f}s after its "
                     f"start; the one-socket plugin exited {took:.2f}s after SIGTERM")
        # Then rollouts and deleted pods in turn, the pods arriving all along.
        for round_ in range(1, ROUNDS + 1):
            roll = surge if round_ % 2 else handoff
            steps.append(roll(node, f"r{round_ - 1}", f"r{round_}"))
        more = len(stream.runs) + 3
        nodemod.wait_for(lambda: len(stream.runs) >= more, 10, "three more pods")
    finally:
        stream.stop()
    phases = stream.finish()
    marks = kubelet_lines(begin, MARK)
    failed = {name: phase for name, phase in phases.items() if phase != "Succeeded"}
    evidence("rollout-overlap", [*steps, f"{len(phases)} pods, one a second: "
                                 f"{len(phases) - len(failed)} Succeeded, "
                                 f"{len(failed)} not; 'Mark all resources Unhealthy' "
                                 f"lines: {len(marks)}"])
    assert not failed, f"pods that did not run: {failed}\n{stream.report()}"
    assert not marks, "the kubelet marked the slots unhealthy:\n" + "\n".join(marks)
