"""The broker under chaos (issue 20): several hostile containers at once, while
well-behaved ones keep mounting.

Run from the repository root, as root, with runc, /dev/fuse and squashfuse::

    .venv/bin/python -m bench.broker_chaos            # full run, about 75 seconds
    .venv/bin/python -m bench.broker_chaos --quick    # smoke run

The real broker runs with its DaemonSet's flags (``manifests/broker/
broker-daemonset.yaml``; the metrics port moved to a free one). Containers get the real
plugin's broker-mode Allocate answer. Eight hostile tenants (``tests/lib/chaos_tenant.py``,
each in a container of its own, root with the runtime's default capabilities and
seccomp rules) attack at once:

- *stall*: a FUSE mount whose daemon never answers, and a rename race through it;
- *chroot*: unmount /keys and /irq while the root flips between decoy mounts and /proc
  (the runtime's masks over /proc/keys and /proc/irq);
- *silent*: connections that never say a word, 200 at a time;
- *descriptors*: requests carrying a TCP socket whose close lingers (SCM_RIGHTS);
- *pin*: mount, pin with O_PATH, lazily unmount, past the quota, again and again;
- *flood*: requests as fast as 8 threads can send them;
- *foreign*: a file in its own FUSE stub that never answers FLUSH, named as fuse_fd
  (a helper that took it to look would block closing it);
- *bigflood*: refusals with 60 KiB paths and 3,000-byte options (log volume).

Meanwhile two well-behaved containers, one root and one uid 1000 with a restricted
context, mount squashfuse through the shim, read a file and unmount, in a loop
(``bench/broker_probe.py cycle``). A round lasts 30 s; there are two, then a third in
which the broker gets SIGTERM.

Every tenant is a pod: its container's cgroup nested in a pod cgroup of its own, as the
kubelet nests them (the broker's shares count pods). The node is full to its maxPods
(the DaemonSet's ``--max-pods``, 110): besides the broker and these ten, the other 99
pods (processes of this benchmark in pod cgroups of four container cgroups each, as in
``bench.broker_full_node``) hold their whole share of silent connections during each
round, 16 a pod, each replaced as soon as the broker answers it at its deadline.

CPU weights are those of that full node. The broker runs with the weight the kubelet gives
its DaemonSet's CPU request, and every other pod with the weight of an equal part of what
that request leaves of the node's CPUs (2 CPUs, 110 pods: 17m each), set on its pod
cgroup and its container's: the scheduler places pods so that their CPU requests fit the
node, and that fit is what makes a request a share the broker gets under contention.
Each helper runs in its caller's cgroups (``fuse_plugin/broker/cgroups.py``), so a
tenant's helpers run at its pod's weight. ``--tenant-cpu-request 1000`` weights each
tenant as a whole CPU instead, a node overcommitted tenfold that no scheduler would fill
(the broker then gets a fraction of its request).

Figures and targets (issue 20's): the well-behaved mount latency (p50, p99 < 100 ms) and
failures (none); every request answered (good and hostile: no connection closed or left
without a reply); the longest wait of a complete request (<= the helper deadline,
scheduler.HELPER_DEADLINE) and of a silent connection (<= the request deadline and a loop
turn); helpers killed at their deadline (broker.stalled) and alive at most (killed ones
included, <= the node's cap at the default --max-pods, the DaemonSet's); the broker's
log lines and KiB a second during the attack; the broker's RSS and open fds before,
during and after (fds back to the baseline once the attackers have left, RSS flat from
one round to the next); /healthz
answers during the chaos; SIGTERM during the chaos to exit (0, within the pod's
terminationGracePeriodSeconds). Prints a table,
writes JSON to ``bench/results/broker_chaos.json`` (or ``--out``), exits 3 when a
target is missed.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
import uuid
from collections.abc import Callable, Sequence
from contextlib import ExitStack
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from bench import broker as bench
from bench import broker_full_node as full_node
from fuse_plugin.broker import protocol, shares
from fuse_plugin.broker.requests import REQUEST_DEADLINE
from fuse_plugin.broker.scheduler import HELPER_DEADLINE
from fuse_plugin.broker.server import TURN
from fuse_plugin.broker.settings import BrokerSettings
from tests.lib import broker as broker_rig
from tests.lib import oci, waiting
from tests.lib.node import UDEV_MODE, host_fuse_mode

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results" / "broker_chaos.json"
TOOL = f"{broker_rig.ATTACKER_DIR}/chaos_tenant.py"
MOUNTPOINT = "/mnt/good"
EXIT_TARGET_MISSED = 3
P99_TARGET_MS = 100.0
RSS_FLAT_MIB = 1.0  # growth from the first round's end to the last one's
SETTLE_TIMEOUT = 30.0  # for the fds to come back once the attackers have left
GOOD = ("good-root", "good-nonroot")
HOSTILE = ("stall", "chroot", "silent", "descriptors", "pin", "flood", "foreign", "bigflood")
# Tools whose connections never carry a complete request: answered at the request
# deadline, or refused at accept.
SILENT = ("silent", "descriptors")
# Helpers alive at most on the node at the default --max-pods, the DaemonSet's.
NODE_HELPERS = BrokerSettings().caps.helpers
NODE_PODS = full_node.max_pods(bench.deployed_flags())  # the DaemonSet's --max-pods
CONTAINERS_PER_POD = 4  # the silent pods': each holds its container share


@dataclass(frozen=True)
class Sizes:
    seconds: float = 30.0  # one chaos round
    rounds: int = 2  # then the SIGTERM round
    stop_seconds: float = 8.0  # the SIGTERM round's attack
    silent: int = 200
    descriptors: int = 16
    pin: int = 40
    flood_threads: int = 8
    foreign_threads: int = 2
    bigflood_threads: int = 2
    # The node's other pods, at their share of silent connections: the broker's own pod
    # and the ten tenants' make it full to its maxPods.
    silent_pods: int = NODE_PODS - 1 - len(GOOD) - len(HOSTILE)


FULL = Sizes()
QUICK = Sizes(seconds=6.0, rounds=1, stop_seconds=6.0, silent=50, descriptors=8, pin=36,
              flood_threads=4, foreign_threads=1, bigflood_threads=1, silent_pods=8)


def blockers() -> list[str]:
    return oci.runc_blockers() + [f"{tool} is not installed" for tool in
                                  ("squashfuse", "mksquashfs") if shutil.which(tool) is None]


def tool_args(name: str, seconds: float, sizes: Sizes) -> list[str]:
    extra = {"silent": [sizes.silent], "descriptors": [sizes.descriptors],
             "pin": [sizes.pin], "flood": [sizes.flood_threads],
             "foreign": [sizes.foreign_threads],
             "bigflood": [sizes.bigflood_threads]}.get(name, [])
    return ["python3", TOOL, protocol.CONTAINER_SOCKET, protocol.VERSION, name,
            str(seconds), *map(str, extra)]


def good_args(seconds: float) -> list[str]:
    return ["python3", bench.PROBE, "cycle", bench.IMAGE, MOUNTPOINT, bench.BIG,
            str(seconds), "fusermount3", "-u"]


# -- watching the broker ------------------------------------------------------------------


@dataclass
class Watch:
    """The broker's RSS and fds, and its /healthz, sampled while a round runs."""

    pid: int
    port: int
    rss_kib: list[int] = field(default_factory=list)
    fds: list[int] = field(default_factory=list)
    helpers: list[int] = field(default_factory=list)  # alive, killed ones included
    healthz_ok: int = 0
    healthz_failed: list[str] = field(default_factory=list)
    healthz_max_ms: float = 0.0

    def __post_init__(self) -> None:
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> Watch:
        self._sched = schedstat(self.pid)
        self._wall = time.monotonic()
        self._thread.start()
        return self

    def stop(self) -> None:
        self._done.set()
        self._thread.join()
        wall = time.monotonic() - self._wall
        ran, waited = schedstat(self.pid)
        self.cpu_share = (ran - self._sched[0]) / wall
        self.wait_share = (waited - self._sched[1]) / wall

    def _run(self) -> None:
        while not self._done.wait(0.25):
            try:
                self.rss_kib.append(bench.rss_kib(self.pid))
                self.fds.append(bench.fd_count(self.pid))
                self.helpers.append(bench.children(self.pid))
            except OSError:
                return  # the broker has exited (the SIGTERM round)
            if self.port:
                self._probe()

    def _probe(self) -> None:
        started = time.perf_counter()
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/healthz",
                                        timeout=5) as answer:
                status = answer.status
        except OSError as err:
            if not self._done.is_set():
                self.healthz_failed.append(str(err)[:120])
            return
        self.healthz_max_ms = max(self.healthz_max_ms, (time.perf_counter() - started) * 1000)
        if status == 200:
            self.healthz_ok += 1
        else:
            self.healthz_failed.append(f"HTTP {status}")


def schedstat(pid: int) -> tuple[float, float]:
    """Seconds the process's threads have spent on a CPU, and runnable waiting for one
    (/proc/PID/task/*/schedstat); zeros once it has exited."""
    ran = waited = 0
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return 0.0, 0.0
    for tid in tasks:
        try:
            fields = Path(f"/proc/{pid}/task/{tid}/schedstat").read_text().split()
            ran, waited = ran + int(fields[0]), waited + int(fields[1])
        except (OSError, IndexError, ValueError):
            continue
    return ran / 1e9, waited / 1e9


# -- the scene ----------------------------------------------------------------------------


class Scene:
    """A broker with its DaemonSet's flags, two well-behaved containers and eight hostile
    ones, all from the real plugin's broker-mode Allocate answer."""

    def __init__(self, stack: ExitStack, work: Path, cpu_request: int = 0,
                 tenant_request: int = 0, silent_pods: int = 0) -> None:
        self.work = work
        image = bench.make_image(work / "image", 1)
        broker_dir = work / "broker-dir"
        self.broker, self.flags = bench.start_broker(broker_dir, work / "broker")
        stack.callback(self.broker.stop)
        if cpu_request:
            stack.enter_context(bench.cpu_request(self.broker.pid, cpu_request,
                                                  f"fuse-chaos-broker-{os.getpid()}"))
        self.port = next((int(f.split("=", 1)[1]) for f in self.flags
                          if f.startswith("--metrics-port=")), 0)
        self.rss_start_kib = bench.rss_kib(self.broker.pid)
        self.fds_start = bench.fd_count(self.broker.pid)
        allocation = broker_rig.allocation(work / "plugin", broker_dir)
        runc = stack.enter_context(oci.Runc(prefix="fuse-chaos"))
        binds = [oci.Bind(image, bench.IMAGE, True), oci.Bind(HERE, "/bench", True),
                 broker_rig.attacker_bind()]
        requests = {"good-root": bench.root_pod(allocation, binds),
                    "good-nonroot": bench.restricted_pod(allocation, binds, work)}
        requests |= {name: bench.root_pod(allocation, binds) for name in HOSTILE}
        if tenant_request:
            for request in requests.values():
                request.cpu_shares = bench.millicores_to_shares(tenant_request)
        self.containers = {}
        for name, request in requests.items():
            pod = f"fuse-chaos-pod{uuid.uuid4().hex[:12]}"
            self.containers[name] = runc.create(oci.build_spec(request), name, pod=pod).start()
            if tenant_request:  # the pod's weight, as the kubelet sets it: its request
                pod_cpu_shares(pod, bench.millicores_to_shares(tenant_request))
        self.cgroups = {name: cgroup_of(c.pid) for name, c in self.containers.items()}
        self.silent_procs = stack.enter_context(full_node.pods(silent_pods,
                                                               CONTAINERS_PER_POD))
        # Their CPU weight: that of their requests together (17m each on a full node), in
        # a CPU cgroup of their own (cgroup v1: on v2 a cgroup is all controllers at once,
        # and they stay in their pods' cgroups at the default weight).
        v1 = (bench.CGROUP / "cpu" / "cpu.shares").exists()
        self.silent_cpu = stack.enter_context(bench.cpu_request(
            os.getpid(), tenant_request * silent_pods, f"fuse-chaos-silent-{os.getpid()}",
            move=False)) if tenant_request and silent_pods and v1 else None
        self.outputs = work / "outputs"
        self.outputs.mkdir()

    def spawn(self, name: str, args: Sequence[str], tag: str) -> tuple[subprocess.Popen[bytes],
                                                                       Path]:
        container = self.containers[name]
        out = self.outputs / f"{tag}-{name}.out"
        with out.open("wb") as stdout, (self.outputs / f"{tag}-{name}.err").open("wb") as err:
            proc = subprocess.Popen(container.runc.command("exec", container.id, *args),
                                    stdin=subprocess.DEVNULL, stdout=stdout, stderr=err)
        container.daemons.append(proc)
        return proc, out

    def events_since(self, mark: int) -> list[dict[str, Any]]:
        return self.broker.events()[mark:]

    def log_since(self, mark: int) -> tuple[int, int]:
        """Lines and bytes the broker logged after its ``mark``-th line."""
        lines = self.broker.log().splitlines()[mark:]
        return len(lines), sum(len(line.encode()) + 1 for line in lines)


def weigh(procs: Sequence[Path], group: Path) -> None:
    """The silent pods' processes (each in its container's cgroup as soon as it is
    forked) into their CPU cgroup."""
    pids: list[str] = []

    def joined() -> bool:
        pids[:] = [pid for path in procs for pid in path.read_text().split()]
        return len(pids) >= len(procs)

    waiting.wait_for(joined, 60, "the silent pods' processes to start")
    for pid in pids:
        (group / "cgroup.procs").write_text(pid)


def pod_cpu_shares(pod: str, shares: int) -> None:
    """The pod cgroup's CPU weight (cgroup v1 cpu.shares, or v2 cpu.weight)."""
    v1 = bench.CGROUP / "cpu" / pod / "cpu.shares"
    if v1.exists():
        v1.write_text(str(shares))
    else:
        (bench.CGROUP / pod / "cpu.weight").write_text(str(1 + (shares - 2) * 9999 // 262142))


def cgroup_of(pid: int) -> str:
    """As the broker names a caller's container (caller._cgroup): the unified path."""
    lines = [line.split(":", 2) for line in
             Path(f"/proc/{pid}/cgroup").read_text().splitlines()]
    return next((path for _, controllers, path in lines if controllers == ""), lines[0][2])


# -- one round ----------------------------------------------------------------------------


@dataclass
class Round:
    tools: dict[str, dict[str, Any]]
    events: dict[str, Any]
    rss_max_kib: int
    fds_max: int
    healthz: dict[str, Any]
    cpu_share: float = 0.0  # of one CPU, over the round
    wait_share: float = 0.0  # runnable, waiting for a CPU (summed over its threads)
    fds_after: int = -1
    fds_settle_s: float = 0.0
    rss_after_kib: int = 0
    stop: dict[str, Any] = field(default_factory=dict)
    helpers_max: int = 0
    log_lines_per_s: float = 0.0
    log_kib_per_s: float = 0.0


def attack(scene: Scene, sizes: Sizes, seconds: float, tag: str,
           during: Callable[[int], dict[str, Any]] | None = None) -> Round:
    """Every hostile tool and every well-behaved loop at once, for ``seconds``."""
    mark = len(scene.broker.events())
    log_mark = len(scene.broker.log().splitlines())
    started = time.monotonic()
    node = ExitStack()  # the node's other pods, at their share (forked before any thread)
    node.enter_context(full_node.tenants(scene.silent_procs, str(scene.broker.socket),
                                         shares.PER_CONTAINER, None))
    if scene.silent_cpu is not None:
        weigh(scene.silent_procs, scene.silent_cpu)
    watch = Watch(scene.broker.pid, scene.port).start()
    running = {name: scene.spawn(name, tool_args(name, seconds, sizes), tag)
               for name in HOSTILE}
    running |= {name: scene.spawn(name, good_args(seconds), tag) for name in GOOD}
    stop = during(mark) if during is not None else {}
    tools: dict[str, dict[str, Any]] = {}
    for name, (proc, out) in running.items():
        try:
            proc.wait(seconds + 120)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
            raise AssertionError(f"{tag}: {name} did not finish") from None
        text = out.read_text(errors="replace")
        if proc.returncode != 0 or not text.strip():
            err = out.with_suffix(".err").read_text(errors="replace")
            raise AssertionError(f"{tag}: {name} exited {proc.returncode}: {text}{err}")
        tools[name] = json.loads(text.strip().splitlines()[-1])
    watch.stop()
    node.close()
    lines, size = scene.log_since(log_mark)
    elapsed = time.monotonic() - started
    return Round(helpers_max=max(watch.helpers, default=0),
                 log_lines_per_s=round(lines / elapsed, 1),
                 log_kib_per_s=round(size / 1024 / elapsed, 1), tools=tools,
                 events=tally_events(scene, scene.events_since(mark)),
                 rss_max_kib=max(watch.rss_kib, default=0), fds_max=max(watch.fds, default=0),
                 healthz={"ok": watch.healthz_ok, "failed": len(watch.healthz_failed),
                          "failures": watch.healthz_failed[:5],
                          "max_ms": round(watch.healthz_max_ms, 2)},
                 cpu_share=round(watch.cpu_share, 3), wait_share=round(watch.wait_share, 3),
                 stop=stop)


def tally_events(scene: Scene, events: list[dict[str, Any]]) -> dict[str, Any]:
    """What the broker's log says about the round: helpers killed at their deadline,
    connections aborted, failures, and what the well-behaved containers got."""
    names = {cgroup: name for name, cgroup in scene.cgroups.items()}
    counts: dict[str, dict[str, int]] = {}
    durations: dict[str, list[float]] = {name: [] for name in GOOD}
    for event in events:
        kind = str(event.get("event", ""))
        if not kind.startswith("broker."):
            continue
        who = names.get(str(event.get("cgroup", "")), "other")
        # A tenant's refusals past its log budget are summed up in one line per kind.
        kind = "broker.refused" if kind == "broker.refused_summary" else kind
        counts.setdefault(kind, {}).setdefault(who, 0)
        # A refusal at accept is one line a second for any number of connections.
        counts[kind][who] += int(event.get("connections", event.get("suppressed", 1)))
        if who in GOOD and kind == "broker.mount":
            durations[who].append(float(event["duration_ms"]))
    return {
        "counts": counts,
        "stalled": sum(counts.get("broker.stalled", {}).values()),
        "aborted": len([e for e in events if e.get("event") == "broker.aborted"]),
        "good_failed": sum(counts.get("broker.failed", {}).get(n, 0) for n in GOOD),
        "good_stalled": sum(counts.get("broker.stalled", {}).get(n, 0) for n in GOOD),
        "good_refused": sum(counts.get("broker.refused", {}).get(n, 0) for n in GOOD),
        "good_broker_side_ms": {n: _quantiles(v) for n, v in durations.items()},
    }


def settle_after(scene: Scene, result: Round) -> None:
    """The attackers have left: the broker's fds must come back to the baseline."""
    pid = scene.broker.pid
    result.fds_after, result.fds_settle_s = bench.settle(
        lambda: bench.fd_count(pid), scene.fds_start, SETTLE_TIMEOUT)
    result.rss_after_kib = bench.rss_kib(pid)


def sigterm_during(scene: Scene, grace: float) -> Callable[[int], dict[str, Any]]:
    """Once the chaos is under way (well-behaved mounts and hostile requests in the
    broker's log since the round began), SIGTERM; then wait for the exit, at most the
    pod's grace period."""
    def during(mark: int) -> dict[str, Any]:
        good = {scene.cgroups[n] for n in GOOD}
        hostile = {scene.cgroups[n] for n in HOSTILE}

        def under_way() -> bool:
            events = scene.events_since(mark)
            return (sum(1 for e in events if e.get("event") == "broker.mount"
                        and e.get("cgroup") in good) >= 2
                    and any(e.get("cgroup") in hostile for e in events))

        waiting.wait_for(under_way, 60, "the chaos to be under way")
        proc = scene.broker.proc
        assert proc is not None
        started = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        try:
            code: int | None = proc.wait(grace)
        except subprocess.TimeoutExpired:
            code = None
        seconds = time.monotonic() - started
        if code is None:
            proc.kill()
            proc.wait(10)
        return {"exit_code": code, "seconds": round(seconds, 3), "grace_s": grace,
                "stopped_event": bool(scene.broker.events("stopped"))}
    return during


# -- the run ------------------------------------------------------------------------------


@dataclass
class Report:
    flags: list[str]
    rss_start_kib: int
    fds_start: int
    rounds: list[Round]
    final: Round
    cgroups: dict[str, str]


def full_node_share(cpu_request: int, pods: int = NODE_PODS) -> int:
    """Each other pod's CPU request (millicores) when ``pods`` pods, the broker's among
    them, fill what the broker's request leaves of this machine's CPUs."""
    return max(1, ((os.cpu_count() or 1) * 1000 - cpu_request) // (pods - 1))


def run(sizes: Sizes, cpu_request: int = 0, tenant_request: int = 0) -> Report:
    """The rounds and the SIGTERM round. ``cpu_request`` (millicores): run the broker in
    a CPU cgroup of its own with the weight of a pod that requests that much (0: where
    the benchmark runs); ``tenant_request``: each tenant container's (0: the runtime's
    default weight, that of a 1-CPU request)."""
    with ExitStack() as stack:
        work = Path(tempfile.mkdtemp(prefix="fuse-bench-chaos-"))
        stack.callback(shutil.rmtree, work, True)
        scene = Scene(stack, work, cpu_request, tenant_request, sizes.silent_pods)
        rounds = []
        for k in range(sizes.rounds):
            result = attack(scene, sizes, sizes.seconds, f"round{k + 1}")
            settle_after(scene, result)
            rounds.append(result)
        final = attack(scene, sizes, sizes.stop_seconds, "sigterm",
                       sigterm_during(scene, bench.grace_period()))
        return Report(scene.flags, scene.rss_start_kib, scene.fds_start, rounds, final,
                      scene.cgroups)


# -- figures ------------------------------------------------------------------------------


def _quantiles(values: Sequence[float]) -> dict[str, float]:
    if not values:
        return {"n": 0, "p50": 0.0, "p99": 0.0, "max": 0.0}
    return {"n": len(values), "p50": round(statistics.median(values), 2),
            "p99": round(bench.percentile(values, 99), 2), "max": round(max(values), 2)}


@dataclass
class Figure:
    label: str
    value: str
    target: str = ""
    ok: bool | None = None


def figures(report: Report) -> list[Figure]:
    rounds = report.rounds
    out: list[Figure] = []
    for name in GOOD:
        mounts = [v for r in rounds for v in r.tools[name]["mount_ms"]]
        failed = sum(r.tools[name]["failed"] for r in rounds)
        q = _quantiles(mounts)
        out.append(Figure(f"{name}: mount latency p50 / p99 / max",
                          f"{q['p50']:.1f} / {q['p99']:.1f} / {q['max']:.1f} ms "
                          f"({q['n']} mounts)", f"p99 < {P99_TARGET_MS:g} ms",
                          q["n"] > 0 and q["p99"] < P99_TARGET_MS))
        inside = [r.events["good_broker_side_ms"][name] for r in rounds]
        out.append(Figure("  of which in the broker (accept to reply): p50 / p99 per round",
                          ", ".join(f"{b['p50']:.1f} / {b['p99']:.1f}" for b in inside)
                          + " ms"))
        out.append(Figure(f"{name}: failed mounts, reads or unmounts", str(failed), "0",
                          failed == 0 and q["n"] > 0))
    unanswered = {name: sum(r.tools[name]["requests"]["unanswered"] for r in rounds)
                  for name in HOSTILE}
    requests = {name: sum(r.tools[name]["requests"]["requests"] for r in rounds)
                for name in HOSTILE}
    out.append(Figure("hostile requests and connections / left without an answer",
                      f"{sum(requests.values()):,} / {sum(unanswered.values())} "
                      f"({', '.join(f'{n} {requests[n]:,}' for n in HOSTILE)})",
                      "all answered", sum(unanswered.values()) == 0))
    complete = max(r.tools[n]["requests"]["wait_ms"]["max"] for r in rounds
                   for n in HOSTILE if n not in SILENT)
    silent = max(r.tools[n]["requests"]["wait_ms"]["max"] for r in rounds for n in SILENT)
    out.append(Figure("longest wait of a complete request", f"{complete:.1f} ms",
                      f"<= {HELPER_DEADLINE:g} s (helper deadline)",
                      complete <= HELPER_DEADLINE * 1000))
    out.append(Figure("longest wait of a silent connection for its answer",
                      f"{silent:.1f} ms",
                      f"<= {REQUEST_DEADLINE + TURN:g} s (request deadline + a turn)",
                      silent <= (REQUEST_DEADLINE + TURN) * 1000))
    out.append(Figure("broker on a CPU / runnable waiting for one, per round",
                      ", ".join(f"{r.cpu_share:.0%} / {r.wait_share:.0%}" for r in rounds)
                      + " of the time"))
    stalled = sum(r.events["stalled"] for r in rounds)
    good_bad = sum(r.events["good_failed"] + r.events["good_stalled"] for r in rounds)
    out.append(Figure("helpers killed at their deadline (broker.stalled) / aborted",
                      f"{stalled} / {sum(r.events['aborted'] for r in rounds)}"))
    out.append(Figure("broker.failed or broker.stalled for a well-behaved container",
                      str(good_bad), "0", good_bad == 0))
    rss = [r.rss_after_kib / 1024 for r in rounds]
    out.append(Figure("broker RSS: start / max during / after each round",
                      f"{report.rss_start_kib / 1024:.1f} / "
                      f"{max(r.rss_max_kib for r in rounds) / 1024:.1f} / "
                      + ", ".join(f"{v:.1f}" for v in rss) + " MiB",
                      f"flat: last - first round <= {RSS_FLAT_MIB:g} MiB" if len(rss) > 1
                      else "", rss[-1] - rss[0] <= RSS_FLAT_MIB if len(rss) > 1 else None))
    fds_ok = all(r.fds_after == report.fds_start for r in rounds)
    out.append(Figure("broker open fds: start / max during / after each round",
                      f"{report.fds_start} / {max(r.fds_max for r in rounds)} / "
                      + ", ".join(f"{r.fds_after} (in {r.fds_settle_s:.1f} s)"
                                  for r in rounds),
                      "back to the start", fds_ok))
    out.append(Figure("broker helpers alive (killed ones included): max during a round",
                      ", ".join(str(r.helpers_max) for r in rounds),
                      f"<= {NODE_HELPERS} (the node's cap)",
                      all(r.helpers_max <= NODE_HELPERS for r in rounds)))
    out.append(Figure("broker log during the attack: lines/s, KiB/s per round",
                      ", ".join(f"{r.log_lines_per_s:g}, {r.log_kib_per_s:g}"
                                for r in rounds)))
    health = [r.healthz for r in rounds]
    out.append(Figure("/healthz during the chaos: answered 200 / failed / slowest",
                      f"{sum(h['ok'] for h in health)} / {sum(h['failed'] for h in health)} / "
                      f"{max(h['max_ms'] for h in health):.1f} ms"))
    stop = report.final.stop
    out.append(Figure("SIGTERM during the chaos until the broker exits",
                      f"{stop['seconds']:.2f} s, exit code {stop['exit_code']}",
                      f"exit 0 within {stop['grace_s']:g} s (grace period)",
                      stop["exit_code"] == 0))
    reset = sum(t["requests"]["status"].get("closed", 0)
                for n, t in report.final.tools.items() if n in HOSTILE)
    out.append(Figure("  at the stop: connections reset without an answer",
                      f"{reset} (in the listen backlog when it closed)"))
    return out


def as_json(report: Report, table: list[Figure], sizes: Sizes,
            load_before: tuple[float, float, float], *, cpu_request: int = 0,
            tenant_request: int = 0) -> dict[str, Any]:
    def slim(r: Round) -> dict[str, Any]:
        out = asdict(r)
        for name in GOOD:  # the samples are long: their quantiles are enough here
            tool = out["tools"][name]
            tool["mount_q"] = _quantiles(tool.pop("mount_ms"))
            tool["unmount_q"] = _quantiles(tool.pop("unmount_ms"))
        return out

    return {
        "machine": {"cpus": os.cpu_count(), "kernel": platform.release(),
                    "loadavg_before": load_before, "loadavg_after": os.getloadavg()},
        "broker_flags": report.flags,
        "broker_cpu_request_millicores": cpu_request,
        "tenant_cpu_request_millicores": tenant_request,
        "sizes": asdict(sizes),
        "cgroups": report.cgroups,
        "broker": {"rss_start_kib": report.rss_start_kib, "fds_start": report.fds_start},
        "rounds": [slim(r) for r in report.rounds],
        "sigterm_round": slim(report.final),
        "figures": [asdict(f) for f in table],
        "passed": all(f.ok is not False for f in table),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.broker_chaos", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="a short smoke run")
    parser.add_argument("--out", type=Path, default=RESULTS, help=f"JSON (default {RESULTS})")
    parser.add_argument("--broker-cpu-request", type=int, default=bench.cpu_request_millicores(),
                        metavar="MILLICORES",
                        help="run the broker with the CPU weight of a pod requesting this "
                             "much (default: its DaemonSet's request, "
                             f"{bench.cpu_request_millicores()}m); 0: no cgroup of its own, "
                             "the weight of the benchmark's process")
    parser.add_argument("--tenant-cpu-request", type=int, default=None, metavar="MILLICORES",
                        help="each tenant container's CPU weight as a request (default: "
                             "an equal part of what the broker's request leaves of the "
                             "machine's CPUs, a full node; 0: the runtime's default, a "
                             "1-CPU weight each)")
    args = parser.parse_args(argv)
    problems = blockers()
    if problems:
        print(f"bench.broker_chaos: cannot run here: {'; '.join(problems)}", file=sys.stderr)
        return 1
    sizes = QUICK if args.quick else FULL
    tenants = (args.tenant_cpu_request if args.tenant_cpu_request is not None
               else full_node_share(args.broker_cpu_request) if args.broker_cpu_request else 0)
    load_before = os.getloadavg()
    with host_fuse_mode(UDEV_MODE):  # the uid-1000 neighbour opens /dev/fuse itself
        report = run(sizes, args.broker_cpu_request, tenants)
    table = figures(report)
    weight = (f"the broker weighted as a {args.broker_cpu_request}m CPU request"
              if args.broker_cpu_request else "the broker in the benchmark's CPU cgroup")
    weight += (f", each of the {len(GOOD) + len(HOSTILE)} tenant pods as {tenants}m" if tenants
               else ", each tenant with the runtime's default weight (a 1-CPU request)")
    weight += (f"; {sizes.silent_pods} more pods of {CONTAINERS_PER_POD} containers hold "
               f"their share of silent connections ({NODE_PODS} pods on the node with the "
               "broker's)")
    print(f"1-minute load before the run {load_before[0]:.2f}, after {os.getloadavg()[0]:.2f} "
          f"({os.cpu_count()} CPUs); {sizes.rounds} rounds of {sizes.seconds:g} s, then "
          f"SIGTERM in a third; {weight}\n")
    for f in table:
        verdict = "" if f.ok is None else ("PASS" if f.ok else "FAIL")
        print(f"{f.label:<62} {f.value:<48} {f.target:<36} {verdict}")
    if load_before[0] / (os.cpu_count() or 1) > bench.BUSY_PER_CPU:
        print(f"\nwarning: the machine was busy before the run (1-minute load "
              f"{load_before[0]:.1f} on {os.cpu_count()} CPUs): latencies include waiting "
              "for a CPU")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(as_json(report, table, sizes, load_before,
                                           cpu_request=args.broker_cpu_request,
                                           tenant_request=tenants), indent=1))
    print(f"\nJSON: {args.out}")
    return 0 if all(f.ok is not False for f in table) else EXIT_TARGET_MISSED


if __name__ == "__main__":
    sys.exit(main())
