"""Broker mode against today's mode, in real runc containers (issues 14 and 21).

Run from the repository root, as root, with runc, /dev/fuse, squashfuse, sshfs and sshd::

    .venv/bin/python -m bench.broker            # full run, about 45 seconds
    .venv/bin/python -m bench.broker --quick    # smoke run

Three containers get the real plugin's Allocate answers:

- *direct*: today's recommended pod (root, CAP_SYS_ADMIN, the generated ``generic``
  seccomp profile): programs call mount(2) themselves;
- *broker-root* (``broker`` in the JSON): broker mode as root, no added capability and
  the runtime-default seccomp: programs mount through the shim and the real broker;
- *broker-nonroot*: broker mode for a restricted pod: uid 1000, no capability,
  noNewPrivileges, a read-only root, the mountpoint on a tmpfs emptyDir at /mnt.

The broker runs with its DaemonSet's flags (read from
``manifests/broker/broker-daemonset.yaml``). In each container, ``bench/broker_probe.py``
times, the three taking turns (who goes first rotates):

- mount latency: ``squashfuse IMAGE DIR`` until it returns (it daemonizes once mounted),
  and then the unmount (``umount`` direct, ``fusermount3 -u`` through the broker);
- read throughput: a file in an uncompressed squashfs image, on a fresh mount each round
  (nothing comes from the page cache);
- sshfs throughput against a private sshd on 127.0.0.1: writes (fsync'd) and reads of
  files created on the server.

And from the broker's side: its own time per mount (``duration_ms`` in its log), what
that time is made of (``perf trace`` of every process on the way, when perf is there),
and its RSS and open fds after start, after the benchmark and after 1,000 more
mount/unmount cycles.

Targets: each broker mode's median mount latency within 2 ms of direct's (on an idle
machine); throughput at least 90% of direct's (each round's ratio, the median over
rounds: rounds vary by +-30% on this machine, the modes within a round far less); the
broker's open fds after the cycles equal to those after start. Prints a table and writes JSON to
``bench/results/broker.json`` (or ``--out``); exits 3 when a target is missed.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from bench import deployed
from fuse_plugin.api import api_pb2 as api
from tests.lib import broker as broker_rig
from tests.lib import oci, plugin, profiles, waiting, workloads
from tests.lib.node import UDEV_MODE, host_fuse_mode
from tests.lib.servers import Sshd, free_port, stop_process

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results" / "broker.json"
DAEMONSET = HERE.parent / "manifests" / "broker" / "broker-daemonset.yaml"
PROBE = "/bench/broker_probe.py"
IMAGE = "/srv/image.sqfs"
BIG = "big.bin"
MOUNTPOINT = "/mnt/bench"
EXIT_TARGET_MISSED = 3
LATENCY_TARGET_MS = 2.0
THROUGHPUT_TARGET = 0.9
MOUNT_BATCH = 5
TENANT = 1000  # the restricted pod's uid
# "broker" is broker mode as root (named so in the JSON since issue 14's benchmark).
MODES = ("direct", "broker", "broker-nonroot")
BROKERED = ("broker", "broker-nonroot")
LABELS = {"direct": "direct", "broker": "broker-root", "broker-nonroot": "broker-nonroot"}
UNMOUNT = {"direct": ["umount"], "broker": ["fusermount3", "-u"],
           "broker-nonroot": ["fusermount3", "-u"]}
KEYS = ("mount_ms", "unmount_ms", "squashfs_read_mib_s", "sshfs_write_mib_s",
        "sshfs_read_mib_s")
BUSY_PER_CPU = 0.5  # 1-minute load per CPU above which the table warns


@dataclass(frozen=True)
class Sizes:
    mount_rounds: int = 60  # a multiple of MOUNT_BATCH
    read_rounds: int = 9
    read_mib: int = 256
    ssh_rounds: int = 9
    ssh_mib: int = 64
    cycles: int = 1000  # mount/unmount cycles before the broker's RSS and fds are read
    breakdown_rounds: int = 30  # mounts per mode under perf trace (0: none)


FULL = Sizes()
QUICK = Sizes(mount_rounds=10, read_rounds=2, read_mib=16, ssh_rounds=2, ssh_mib=8,
              cycles=20, breakdown_rounds=0)


def blockers() -> list[str]:
    found = oci.runc_blockers()
    found += [f"{tool} is not installed" for tool in ("squashfuse", "mksquashfs", "sshfs")
              if shutil.which(tool) is None]
    return found


def cpu_times() -> tuple[int, int]:
    """(busy, total) jiffies of every CPU since boot, from /proc/stat."""
    fields = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle = fields[3] + fields[4]  # idle, iowait
    return sum(fields) - idle, sum(fields)


def busy_share(before: tuple[int, int], after: tuple[int, int]) -> float:
    """How busy the machine's CPUs were in between (all processes, ours included)."""
    total = after[1] - before[1]
    return (after[0] - before[0]) / total if total else 0.0


# -- the broker as deployed ---------------------------------------------------------------


def cpu_request_millicores() -> int:
    """The broker container's CPU request in its DaemonSet ("100m" or "0.5"), in
    millicores: the weight the kubelet gives it when tenants keep the node busy."""
    text = str(deployed.container(DAEMONSET)["resources"]["requests"]["cpu"])
    return int(text[:-1]) if text.endswith("m") else int(float(text) * 1000)


def deployed_flags() -> list[str]:
    """The broker's flags as its DaemonSet passes them, minus the directories (the rig
    gives temp ones) and with the metrics port moved to a free one."""
    flags = []
    for arg in deployed.flags(DAEMONSET, "broker"):
        name = arg.split("=", 1)[0]
        if name in ("--dir", "--state-dir"):
            continue
        flags.append(f"--metrics-port={free_port()}" if name == "--metrics-port" else arg)
    return flags


def start_broker(directory: Path, workdir: Path) -> tuple[broker_rig.BrokerProcess, list[str]]:
    """The real broker with its DaemonSet's flags, serving on its socket and its metrics
    port (a free port; tried again if another process took it in between)."""
    problem = ""
    for _attempt in range(3):
        flags = deployed_flags()
        broker = broker_rig.BrokerProcess(directory, workdir, broker_rig.shim(), *flags)
        try:
            broker.start()
        except AssertionError as err:
            problem = str(err)
            continue
        if _serving_metrics(broker, flags):
            return broker, flags
        problem = f"broker exited: {broker.log()}"
    raise AssertionError(problem)


def _serving_metrics(broker: broker_rig.BrokerProcess, flags: list[str]) -> bool:
    proc = broker.proc
    assert proc is not None
    if any(flag.startswith("--metrics-port=") for flag in flags):
        waiting.wait_for(lambda: proc.poll() is not None
                           or broker.events("metrics.serving"), 30,
                           "the broker's metrics port")
    return proc.poll() is None


CGROUP = Path("/sys/fs/cgroup")


def millicores_to_shares(millicores: int) -> int:
    """The kubelet's conversion of a CPU request to cgroup v1 cpu.shares."""
    return max(2, millicores * 1024 // 1000)


@contextlib.contextmanager
def cpu_request(pid: int, millicores: int, name: str, move: bool = True) -> Iterator[Path]:
    """Run ``pid`` in a CPU cgroup of its own, with the weight the kubelet gives a pod
    that requests ``millicores`` (cgroup v1 cpu.shares, or v2 cpu.weight); its helpers
    run in their callers' cgroups. Moved back and removed at the end. ``move`` False:
    the cgroup only, for the caller to move processes into."""
    shares = millicores_to_shares(millicores)
    if (CGROUP / "cpu" / "cpu.shares").exists():
        parent, knob, value = CGROUP / "cpu", "cpu.shares", shares
    else:
        parent, knob, value = CGROUP, "cpu.weight", 1 + (shares - 2) * 9999 // 262142
    group = parent / name
    group.mkdir()
    try:
        (group / knob).write_text(str(value))
        if move:  # else the caller moves processes in itself
            (group / "cgroup.procs").write_text(str(pid))
        yield group
    finally:
        for task in (group / "cgroup.procs").read_text().split():
            with contextlib.suppress(OSError):
                (parent / "cgroup.procs").write_text(task)
        with contextlib.suppress(OSError):
            group.rmdir()


def grace_period() -> float:
    """terminationGracePeriodSeconds of the broker's pod: how long SIGTERM may take."""
    return float(deployed.daemonset(DAEMONSET)["spec"]["template"]["spec"]
                 ["terminationGracePeriodSeconds"])


def rss_kib(pid: int) -> int:
    """The process's resident memory; ProcessLookupError once it has exited (a zombie's
    status has no VmRSS line)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise ProcessLookupError(f"process {pid} has exited")


def fd_count(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def children(pid: int) -> int:
    """The process's children alive or not yet reaped (the broker's helpers)."""
    count = 0
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue  # gone meanwhile
        if int(stat.rpartition(")")[2].split()[1]) == pid:
            count += 1
    return count


def settle(read: Callable[[], int], want: int, timeout: float) -> tuple[int, float]:
    """Poll ``read()`` until it equals ``want`` or ``timeout`` passes: (last value,
    seconds it took). The broker closes a helper's fds once it has seen it exit, which
    may be a loop turn after the reply."""
    started = time.monotonic()
    while True:
        value = read()
        waited = time.monotonic() - started
        if value == want or waited >= timeout:
            return value, waited
        time.sleep(0.05)


# -- the containers -----------------------------------------------------------------------


def passwd_file(directory: Path) -> Path:
    """The image's /etc/passwd: root and the tenant (ssh insists on an entry)."""
    path = directory / "passwd"
    path.write_text(f"root:x:0:0::/root:/bin/sh\ntenant:x:{TENANT}:{TENANT}::/tmp:/bin/sh\n")
    path.chmod(0o644)
    return path


def root_pod(allocation: api.ContainerAllocateResponse, binds: Sequence[oci.Bind]
             ) -> oci.ContainerRequest:
    """Broker mode as root: no added capability, the runtime-default seccomp rules."""
    return oci.ContainerRequest(args=workloads.HOLD, allocation=allocation, binds=binds,
                                seccomp=profiles.runtime_default())


def restricted_pod(allocation: api.ContainerAllocateResponse, binds: Sequence[oci.Bind],
                   directory: Path) -> oci.ContainerRequest:
    """A complete restricted security context (as tests/containers/
    test_broker_restricted.py builds it): uid 1000, no capability, noNewPrivileges, a
    read-only root, the runtime-default seccomp rules, an emptyDir at /mnt."""
    return oci.ContainerRequest(
        args=workloads.HOLD, allocation=allocation, user=(TENANT, TENANT), groups=(),
        no_new_privileges=True, readonly_rootfs=True, drop_capabilities=(oci.DROP_ALL,),
        seccomp=profiles.runtime_default(()), tmpfs=("/mnt",),
        binds=[*binds, oci.Bind(passwd_file(directory), "/etc/passwd", True)])


def pods(work: Path, image: Path, data: dict[str, Path],
         direct: api.ContainerAllocateResponse, brokered: api.ContainerAllocateResponse
         ) -> dict[str, oci.ContainerRequest]:
    def binds(mode: str) -> list[oci.Bind]:
        return [oci.Bind(image, IMAGE, True), oci.Bind(HERE, "/bench", True),
                oci.Bind(data[mode], workloads.DATA, True)]

    return {
        "direct": oci.ContainerRequest(
            args=workloads.HOLD, allocation=direct, binds=binds("direct"),
            add_capabilities=profiles.capabilities("generic"),
            seccomp=profiles.seccomp("generic")),
        "broker": root_pod(brokered, binds("broker")),
        "broker-nonroot": restricted_pod(brokered, binds("broker-nonroot"), work),
    }


def make_image(directory: Path, mib: int) -> Path:
    """An uncompressed squashfs image: reads measure FUSE, not decompression."""
    source = directory / "src"
    source.mkdir(parents=True)
    with (source / BIG).open("wb") as out:
        for _ in range(mib):
            out.write(os.urandom(1 << 20))
    image = directory / "image.sqfs"
    subprocess.run(["mksquashfs", str(source), str(image), "-noI", "-noD", "-noF", "-noX",
                    "-no-xattrs", "-noappend", "-quiet", "-no-progress"],
                   check=True, capture_output=True, timeout=300)
    image.chmod(0o644)
    image.read_bytes()  # in the host's page cache before any mode reads it
    return image


def probe(container: oci.RuncContainer, *args: str, timeout: float = 600) -> dict[str, Any]:
    result = container.exec("python3", PROBE, *args, timeout=timeout).check()
    answer: dict[str, Any] = json.loads(result.stdout)
    return answer


def rotated(items: Sequence[str], turn: int) -> list[str]:
    """Who goes first rotates every turn, so that load and warm caches fall on all."""
    k = turn % len(items)
    return [*items[k:], *items[:k]]


def measure(containers: dict[str, oci.RuncContainer], sshd: Sshd, data: dict[str, Path],
            sizes: Sizes) -> dict[str, dict[str, list[float]]]:
    """Every figure, the modes taking turns."""
    results: dict[str, dict[str, list[float]]] = {
        mode: {key: [] for key in KEYS} for mode in containers}
    modes = list(containers)
    for batch in range(sizes.mount_rounds // MOUNT_BATCH):
        for mode in rotated(modes, batch):
            got = probe(containers[mode], "mount", IMAGE, MOUNTPOINT, str(MOUNT_BATCH),
                        *UNMOUNT[mode])
            results[mode]["mount_ms"] += got["mount_ms"]
            results[mode]["unmount_ms"] += got["unmount_ms"]
    for round_ in range(sizes.read_rounds):
        for mode in rotated(modes, round_):
            got = probe(containers[mode], "read", IMAGE, MOUNTPOINT, BIG, "1",
                        *UNMOUNT[mode])
            results[mode]["squashfs_read_mib_s"] += got["read_mib_s"]
    for mode, container in containers.items():
        owner = TENANT if mode == "broker-nonroot" else None
        workloads.mount(container, workloads.sshfs(sshd, data[mode], owner)).check()
    block = os.urandom(1 << 20)
    for round_ in range(sizes.ssh_rounds):
        for mode in rotated(modes, round_):
            got = probe(containers[mode], "write", workloads.SSH_MOUNT,
                        f"{mode}-write-{round_}", str(sizes.ssh_mib))
            results[mode]["sshfs_write_mib_s"] += got["write_mib_s"]
            # A fresh file written on the server: nothing of it is in the client's cache.
            name = f"{mode}-read-{round_}"
            with (sshd.export / name).open("wb") as out:
                for _ in range(sizes.ssh_mib):
                    out.write(block)
            got = probe(containers[mode], "readfile", f"{workloads.SSH_MOUNT}/{name}")
            results[mode]["sshfs_read_mib_s"] += got["read_mib_s"]
    for mode, container in containers.items():
        container.exec(*UNMOUNT[mode], workloads.SSH_MOUNT).check()
    return results


# -- the broker's own figures -------------------------------------------------------------


@dataclass
class BrokerProcessFigures:
    rss_start_kib: int = 0
    fds_start: int = 0
    rss_after_bench_kib: int = 0
    cycles: int = 0
    rss_half_cycles_kib: int = 0
    rss_after_cycles_kib: int = 0
    fds_after_cycles: int = 0
    fds_settle_s: float = 0.0

    @property
    def fds_equal(self) -> bool:
        return self.fds_after_cycles == self.fds_start


def cycle(container: oci.RuncContainer, rounds: int) -> list[float]:
    got = probe(container, "mount", IMAGE, MOUNTPOINT, str(rounds), *UNMOUNT["broker"])
    samples: list[float] = got["mount_ms"]
    return samples


def broker_cycles(broker: broker_rig.BrokerProcess, container: oci.RuncContainer,
                  figures: BrokerProcessFigures, cycles: int) -> None:
    """``cycles`` more mount/unmount cycles through the broker; its RSS halfway and at
    the end (growth over the second half: flat means no leak), and its fds once the
    last helper has been seen to exit."""
    figures.cycles = cycles
    figures.rss_after_bench_kib = rss_kib(broker.pid)
    half = cycles // 2
    cycle(container, half)
    figures.rss_half_cycles_kib = rss_kib(broker.pid)
    cycle(container, cycles - half)
    figures.rss_after_cycles_kib = rss_kib(broker.pid)
    figures.fds_after_cycles, figures.fds_settle_s = settle(
        lambda: fd_count(broker.pid), figures.fds_start, 10.0)


# -- where a mount's time goes: perf trace --------------------------------------------------

TRACED = ("execve,mount,connect,accept4,recvfrom,sendto,vfork,pidfd_getfd,setgroups,"
          "setns,fsopen,move_mount,exit_group,sendmsg")
LINE = re.compile(r"^\s*([\d.]+) \(\s*([\d.]*)\s*(?:ms)?\): (.+?)/(\d+) +"
                  r"(?:\.\.\. \[continued\]: )?(\w+)\((.*)$")
RESULT = re.compile(r"\)\s*= (.+)$")
BROKER_PHASES = (
    ("program", "FUSE program start until mount(2) fails with EPERM (libfuse)"),
    ("shim", "fork + exec of the shim, until it connects"),
    ("accept", "connect until the broker accepts (its loop wakes)"),
    ("identify", "accept until the request is read (identify the caller)"),
    ("prepare", "request until the helper is spawned (parse, policy, /proc, Popen)"),
    ("spawn", "vfork + exec of fuse-broker-helper"),
    ("enter", "helper: pidfd_getfd, setns, mount table, until it reports the mark"),
    ("walk", "mark until the facts (broker's go, the walk)"),
    ("verdict", "facts until the verdict (policy)"),
    ("mount", "verdict until the helper's ok (fsopen..move_mount, read-back)"),
    ("reply", "helper's ok until the reply is sent (connection, log line)"),
    ("handback", "reply until the shim hands the fd to libfuse"),
    ("daemonize", "fd until the program returns (libfuse init, daemonize)"),
)
DIRECT_PHASES = (
    ("program", "FUSE program start until mount(2) returns"),
    ("daemonize", "mount until the program returns (libfuse init, daemonize)"),
)


@dataclass(frozen=True)
class Event:
    start: float  # ms, when the call was entered
    at: float  # ms, when it returned (entered, for calls that do not return)
    comm: str
    tid: int
    call: str
    result: str


def parse_trace(text: str) -> list[Event]:
    """``perf trace`` lines, completed calls only (a call that blocked shows up twice:
    entered, then ``... [continued]`` with its start and duration)."""
    events = []
    for line in text.splitlines():
        found = LINE.match(line)
        if not found:
            continue
        start, duration, comm, tid, call, rest = found.groups()
        returned = RESULT.search(rest)
        result = returned.group(1).strip() if returned else ""
        if not duration and call != "exit_group":
            continue  # entered and not returned yet: its continuation follows
        at = float(start) + (float(duration) if duration else 0.0)
        events.append(Event(float(start), at, comm.strip(), int(tid), call, result))
    events.sort(key=lambda e: e.at)
    return events


def _ok(event: Event) -> bool:
    return not event.result.startswith("-1")


Test = Callable[[Event], bool]


def _steps(program: int, broker_pid: int, brokered: bool) -> list[tuple[str, str, Test]]:
    """The milestones of one mount, each the first matching call after an earlier one."""
    if not brokered:
        return [("mounted", "start", lambda e: e.tid == program and e.call == "mount"),
                ("end", "mounted", lambda e: e.tid == program and e.call == "exit_group")]
    found: dict[str, int] = {}

    def remember(name: str, comm: str | None, call: str, tid: int | None = None) -> Test:
        def test(e: Event) -> bool:
            if (e.call != call or not _ok(e) or (comm is not None and e.comm != comm)
                    or (tid is not None and e.tid != tid)):
                return False
            if call == "vfork" and not e.result.split(" ", 1)[0].isdigit():
                return False
            found[name] = int(e.result.split()[0]) if call == "vfork" else e.tid
            return True
        return test

    def by(name: str, call: str) -> Test:
        return lambda e: e.tid == found.get(name) and e.call == call and _ok(e)

    def broker(call: str) -> Test:
        return lambda e: e.tid == broker_pid and e.call == call and _ok(e)

    return [
        ("eperm", "start", lambda e: e.tid == program and e.call == "mount"),
        ("shim_exec", "eperm", remember("shim", "fusermount3", "execve")),
        ("connected", "shim_exec", by("shim", "connect")),
        ("accepted", "connected", broker("accept4")),
        ("request", "accepted", broker("recvfrom")),
        ("spawned", "request", remember("helper", None, "vfork", broker_pid)),
        ("helper_exec", "request", by("helper", "execve")),
        ("mark", "helper_exec", by("helper", "sendto")),
        ("go", "mark", broker("sendto")),
        ("facts", "go", by("helper", "sendto")),
        ("verdict", "facts", broker("sendto")),
        ("ok", "verdict", by("helper", "sendto")),
        ("reply", "ok", broker("sendto")),
        ("handed", "reply", by("shim", "sendmsg")),
        ("end", "handed", lambda e: e.tid == program and e.call == "exit_group"),
    ]


def _run(events: list[Event], i: int, broker_pid: int, brokered: bool
         ) -> tuple[dict[str, float], int, float] | None:
    """The phases (ms) of the squashfuse run whose execve is ``events[i]``, its helper's
    tid and its end; None if the trace misses a step."""
    begin = events[i]
    marks = {"start": begin.start}
    spawn_entry, helper = 0.0, 0
    for name, after, test in _steps(begin.tid, broker_pid, brokered):
        event = next((e for e in events[i + 1:] if e.at >= marks[after] and test(e)), None)
        if event is None:
            return None
        marks[name] = event.at
        if name == "spawned":
            spawn_entry, helper = event.start, int(event.result.split()[0])
    return _phases(marks, spawn_entry, brokered), helper, marks["end"]


def _phases(m: dict[str, float], spawn_entry: float, brokered: bool) -> dict[str, float]:
    if not brokered:
        return {"program": m["mounted"] - m["start"], "daemonize": m["end"] - m["mounted"],
                "total": m["end"] - m["start"]}
    return {
        "program": m["eperm"] - m["start"],
        "shim": m["connected"] - m["eperm"],
        "accept": m["accepted"] - m["connected"],
        "identify": m["request"] - m["accepted"],
        "prepare": spawn_entry - m["request"],
        # vfork returns to the broker once the child has exec'd the helper.
        "spawn": m["spawned"] - spawn_entry,
        "enter": m["mark"] - m["helper_exec"],
        "walk": m["facts"] - m["mark"],
        "verdict": m["verdict"] - m["facts"],
        "mount": m["ok"] - m["verdict"],
        "reply": m["reply"] - m["ok"],
        "handback": m["handed"] - m["reply"],
        "daemonize": m["end"] - m["handed"],
        "total": m["end"] - m["start"],
        "broker_side": m["reply"] - m["accepted"],
    }


def classify(events: list[Event], broker_pid: int) -> dict[str, list[dict[str, float]]]:
    """Each squashfuse run's phases, by mode: direct if its mount(2) succeeded; through
    the broker otherwise, as a non-root caller if the helper took the caller's groups
    (it does only for callers that are not root on the node)."""
    out: dict[str, list[dict[str, float]]] = {mode: [] for mode in MODES}
    for i, begin in enumerate(events):
        if not (begin.comm == "squashfuse" and begin.call == "execve" and _ok(begin)):
            continue
        mounted = next((e for e in events[i + 1:]
                        if e.tid == begin.tid and e.call == "mount"), None)
        if mounted is None:
            continue
        brokered = not _ok(mounted)
        run = _run(events, i, broker_pid, brokered)
        if run is None:
            continue
        phases, helper, ended = run
        mode = "direct"
        if brokered:
            nonroot = any(e.tid == helper and e.call == "setgroups"
                          for e in events if begin.at <= e.at <= ended)
            mode = "broker-nonroot" if nonroot else "broker"
        out[mode].append(phases)
    return out


def breakdown(broker: broker_rig.BrokerProcess, containers: dict[str, oci.RuncContainer],
              rounds: int, workdir: Path) -> dict[str, Any]:
    """Run ``rounds`` mounts per mode under ``perf trace`` (the calls that mark each
    step, of every process on the node) and take the median of every step."""
    perf = shutil.which("perf")
    if perf is None or rounds <= 0:
        return {"skipped": "perf is not installed" if perf is None else "not asked"}
    out, err = workdir / "perf-trace.txt", workdir / "perf.err"
    with err.open("wb") as errors:
        tracer = subprocess.Popen([perf, "trace", "-a", "-T", "-o", str(out), "-e", TRACED],
                                  stdout=subprocess.DEVNULL, stderr=errors)
    traced_ms: dict[str, list[float]] = {}
    try:
        time.sleep(2.0)  # perf attaches its tracepoints; it says nothing when it is ready
        if tracer.poll() is not None:
            return {"skipped": f"perf trace exited: {err.read_text(errors='replace')}"}
        for mode, container in containers.items():
            got = probe(container, "mount", IMAGE, MOUNTPOINT, str(rounds), *UNMOUNT[mode])
            traced_ms[mode] = got["mount_ms"]
        time.sleep(0.5)  # the last lines reach perf's buffer
    finally:
        stop_process(tracer, signal.SIGINT, grace=30)  # perf trace flushes on SIGINT
    runs = classify(parse_trace(out.read_text(errors="replace")), broker.pid)
    out.unlink(missing_ok=True)
    report: dict[str, Any] = {"rounds": rounds, "modes": {}}
    for mode in containers:
        keys = sorted({key for run in runs[mode] for key in run})
        report["modes"][mode] = {
            "probe_mount_ms_median": round(statistics.median(traced_ms[mode]), 3),
            "parsed": len(runs[mode]),
            "median_ms": {key: round(statistics.median(r[key] for r in runs[mode]), 3)
                          for key in keys},
            "mean_ms": {key: round(statistics.fmean(r[key] for r in runs[mode]), 3)
                        for key in keys},
        }
    return report


# -- the table ----------------------------------------------------------------------------


def percentile(values: Sequence[float], q: float) -> float:
    ordered = sorted(values)
    if not ordered:
        return float("nan")
    index = min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))
    return ordered[index]


@dataclass
class Row:
    key: str
    label: str
    unit: str
    median: dict[str, float]
    p90: dict[str, float] | None
    target: str | None
    verdicts: dict[str, bool] | None
    # Throughput: each mode against direct within each round, the median over rounds.
    ratio: dict[str, float] | None = None

    @property
    def ok(self) -> bool | None:
        return None if self.verdicts is None else all(self.verdicts.values())


def rows(results: dict[str, dict[str, list[float]]]) -> list[Row]:
    modes = list(results)
    out = []
    for key, label in (("mount_ms", "mount latency (squashfuse returns)"),
                       ("unmount_ms", "unmount latency")):
        med = {m: statistics.median(results[m][key]) for m in modes}
        p90 = {m: percentile(results[m][key], 90) for m in modes}
        verdicts = ({m: med[m] - med["direct"] <= LATENCY_TARGET_MS
                     for m in modes if m != "direct"} if key == "mount_ms" else None)
        out.append(Row(key, label, "ms", med, p90,
                       f"median within {LATENCY_TARGET_MS:g} ms of direct"
                       if key == "mount_ms" else None, verdicts))
    for key, label in (("squashfs_read_mib_s", "squashfs read, fresh mount"),
                       ("sshfs_write_mib_s", "sshfs write (fsync)"),
                       ("sshfs_read_mib_s", "sshfs read")):
        med = {m: statistics.median(results[m][key]) for m in modes}
        ratio = {m: statistics.median(b / d for b, d in zip(results[m][key],
                                                            results["direct"][key],
                                                            strict=True))
                 for m in modes if m != "direct"}
        out.append(Row(key, label, "MiB/s", med, None,
                       f">= {THROUGHPUT_TARGET:.0%} of direct (median of per-round ratios)",
                       {m: r >= THROUGHPUT_TARGET for m, r in ratio.items()}, ratio))
    return out


def verdict_text(ok: bool | None) -> str:
    return "" if ok is None else ("PASS" if ok else "FAIL")


def print_table(table: list[Row], broker_side: dict[str, list[float]],
                process: BrokerProcessFigures) -> None:
    modes = list(table[0].median)
    head = "".join(f"{LABELS[m]:>22}" for m in modes)
    print(f"{'figure (median; p90)':<38}{head}  target")
    for row in table:
        cells = []
        for m in modes:
            text = f"{row.median[m]:.2f}"
            if row.p90 is not None:
                text += f"; {row.p90[m]:.2f}"
            if m != "direct":
                delta = row.median[m] - row.median["direct"]
                text += (f" ({delta:+.2f})" if row.ratio is None
                         else f" ({row.ratio[m]:.0%})")
            cells.append(f"{text:>22}")
        verdicts = ""
        if row.verdicts is not None:
            verdicts = " ".join(f"{LABELS[m]} {verdict_text(v)}"
                                for m, v in row.verdicts.items())
        print(f"{row.label + ' ' + row.unit:<38}{''.join(cells)}  {row.target or ''} "
              f"{verdicts}")
    side = "".join(f"{'':>22}" if m == "direct" else
                   f"{statistics.median(broker_side[m]):>11.2f}; "
                   f"{percentile(broker_side[m], 90):>8.2f}" for m in modes)
    print(f"{'broker-side time per mount ms':<38}{side}")
    growth = (process.rss_after_cycles_kib - process.rss_half_cycles_kib) / 1024
    print(f"\nbroker RSS: {process.rss_start_kib / 1024:.1f} MiB after start, "
          f"{process.rss_after_bench_kib / 1024:.1f} after the benchmark, "
          f"{process.rss_after_cycles_kib / 1024:.1f} after {process.cycles} more "
          f"mount/unmount cycles ({growth:+.2f} MiB over the second half)")
    print(f"broker open fds: {process.fds_start} after start, {process.fds_after_cycles} "
          f"after the cycles (target: equal) {verdict_text(process.fds_equal)}")


def print_breakdown(report: dict[str, Any]) -> None:
    if "skipped" in report:
        print(f"\nbreakdown skipped: {report['skipped']}")
        return
    modes = list(report["modes"])
    print(f"\nwhere a mount's time goes: median ms of {report['rounds']} mounts per mode "
          "under perf trace (traced calls are slower: compare steps, not totals)")
    print(f"{'step':<70}" + "".join(f"{LABELS[m]:>16}" for m in modes))
    for key, text in (*BROKER_PHASES, ("total", "total, traced"),
                      ("broker_side", "the broker's side: accept until the reply")):
        cells = [report["modes"][m]["median_ms"].get(key) for m in modes]
        print(f"{text[:69]:<70}" + "".join(f"{'':>16}" if c is None else f"{c:>16.3f}"
                                         for c in cells))
    label = "the probe's own figure, traced"
    print(f"{label:<70}" + "".join(
        f"{report['modes'][m]['probe_mount_ms_median']:>16.3f}" for m in modes))
    print("direct's rows: " + "; ".join(f"{key}: {text}" for key, text in DIRECT_PHASES))


# -- main ---------------------------------------------------------------------------------


@dataclass
class Outcome:
    flags: list[str]
    results: dict[str, dict[str, list[float]]]
    broker_side: dict[str, list[float]]
    process: BrokerProcessFigures
    traced: dict[str, Any]
    load_measured: tuple[float, float, float]
    busy: float  # share of all CPUs in use during the latency and throughput rounds


def run(sizes: Sizes) -> Outcome:
    """Every figure: the broker, the servers and the three containers, then the rounds."""
    process = BrokerProcessFigures()
    with ExitStack() as stack:
        work = Path(tempfile.mkdtemp(prefix="fuse-bench-broker-"))
        stack.callback(shutil.rmtree, work, True)
        image = make_image(work / "image", sizes.read_mib)
        sshd = Sshd(work / "sshd").start()
        stack.callback(sshd.stop)
        broker_dir = work / "broker-dir"
        broker, flags = start_broker(broker_dir, work / "broker")
        stack.callback(broker.stop)
        process.rss_start_kib = rss_kib(broker.pid)
        process.fds_start = fd_count(broker.pid)
        direct = plugin.allocate(work / "plugin-direct")
        brokered = broker_rig.allocation(work / "plugin-broker", broker_dir)
        runc = stack.enter_context(oci.Runc(prefix="fuse-bench"))
        data = {mode: sshd.client_files(work / f"data-{mode}",
                                        owner=TENANT if mode == "broker-nonroot" else None)
                for mode in MODES}
        containers = {mode: runc.create(oci.build_spec(request), mode).start()
                      for mode, request in pods(work, image, data, direct, brokered).items()}
        before = cpu_times()
        results = measure(containers, sshd, data, sizes)
        busy = busy_share(before, cpu_times())
        load_measured = os.getloadavg()
        broker_side: dict[str, list[float]] = {mode: [] for mode in BROKERED}
        for event in broker.events("broker.mount"):
            if event.get("path") == MOUNTPOINT:
                mode = "broker-nonroot" if event.get("uid") == TENANT else "broker"
                broker_side[mode].append(float(event["duration_ms"]))
        broker_cycles(broker, containers["broker"], process, sizes.cycles)
        traced = breakdown(broker, containers, sizes.breakdown_rounds, work)
    return Outcome(flags, results, broker_side, process, traced, load_measured, busy)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.broker", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="a short smoke run")
    parser.add_argument("--out", type=Path, default=RESULTS, help=f"JSON (default {RESULTS})")
    parser.add_argument("--no-breakdown", action="store_true",
                        help="skip the perf trace of where a mount's time goes")
    args = parser.parse_args(argv)
    problems = blockers()
    if problems:
        print(f"bench.broker: cannot run here: {'; '.join(problems)}", file=sys.stderr)
        return 1
    sizes = QUICK if args.quick else FULL
    if args.no_breakdown:
        sizes = Sizes(**{**asdict(sizes), "breakdown_rounds": 0})
    load_before = os.getloadavg()
    with host_fuse_mode(UDEV_MODE):  # broker-nonroot's caller opens /dev/fuse as uid 1000
        got = run(sizes)
    table = rows(got.results)
    print(f"1-minute load before the run {load_before[0]:.2f}, after the latency and "
          f"throughput rounds {got.load_measured[0]:.2f} ({os.cpu_count()} CPUs); the CPUs "
          f"were {got.busy:.0%} busy during those rounds (the benchmark's own work "
          "included)\n")
    print_table(table, got.broker_side, got.process)
    print_breakdown(got.traced)
    report = {
        "machine": {"cpus": os.cpu_count(), "kernel": platform.release(),
                    "loadavg_before": load_before, "loadavg_measured": got.load_measured,
                    "loadavg_after": os.getloadavg(), "cpu_busy_during_rounds": got.busy},
        "broker_flags": got.flags,
        "sizes": asdict(sizes),
        "samples": got.results,
        "broker_side_mount_ms": [v for m in BROKERED for v in got.broker_side[m]],
        "broker_side_by_mode_ms": got.broker_side,
        "broker_process": {**asdict(got.process), "fds_equal": got.process.fds_equal},
        "breakdown": got.traced,
        "figures": [asdict(row) | {"ok": row.ok} for row in table],
    }
    if load_before[0] / (os.cpu_count() or 1) > BUSY_PER_CPU:
        print(f"\nwarning: the machine was busy before the run (1-minute load "
              f"{load_before[0]:.1f} on {os.cpu_count()} CPUs): the broker's path has "
              "four processes take turns on a CPU (the program, the shim, the broker, "
              "its helper), so its mount latency grows with load; the 2 ms target is "
              "for an idle machine")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1))
    print(f"\nJSON: {args.out}")
    ok = all(r.ok is not False for r in table) and got.process.fds_equal
    return 0 if ok else EXIT_TARGET_MISSED


if __name__ == "__main__":
    sys.exit(main())
