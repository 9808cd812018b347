"""The broker at its node-wide caps (issue 34): what a node full of pods at their shares
can make it hold, in descriptors and memory.

Run from the repository root, as root::

    .venv/bin/python -m bench.broker_full_node            # about 2 minutes
    .venv/bin/python -m bench.broker_full_node --quick    # fewer parked helpers, shorter holds

Each node-wide cap is a pod's share times --max-pods (``fuse_plugin/broker/shares.py``:
1,760 open requests, 220 helpers and 7,040 mounts at the default 110), so the broker's
descriptors and its pod's memory limit are sized for those caps. The real broker runs
with its DaemonSet's flags (``--max-pods`` among them), moved into a memory cgroup of
its own once it serves (what it charges from then on is counted there, as in its pod's).
What the broker sees of a container is the cgroup of the process that connects, so the
tenants here are processes of this benchmark, each moved into a cgroup of its own
under a pod-like parent (``.../fuse-bench-pod<hex>/c<i>``), the way the kubelet nests a
pod's containers; no runc is needed to fill the caps. Four loads:

1. *silent*: --max-pods pods of 4 containers each hold 4 silent connections a container
   (the open-request cap, 1,760), each one replaced as soon as the broker answers it at
   its 5 s deadline; held for ``--hold`` seconds.
2. *queued*: --max-pods pods of 4 containers each keep 4 mount requests open a
   container: two containers of each pod at their helper (the pod's share), and every
   other request read and queued (the caller's namespaces open), so the open-request
   cap and the helper cap (220) are both full. The broker runs a stand-in helper here
   (``sleep``: it never answers), and its helper deadline is raised from 5 s to a minute
   (the only change to the broker: starting every helper takes this loaded machine
   longer than 5 s, and a helper killed at its deadline would leave its place before
   the last one had come); what a real helper costs is the next figure.
3. *helpers*: ``--helpers`` real ``fuse-broker-helper`` processes, each serving a mount
   request of one process (a worker of this benchmark started in a memory cgroup of its
   own, root on the node, a /dev/fuse of its own for each), parked at each step in
   turn: after its first report (the caller's fd taken, its namespaces entered), after
   the facts (the path walked), and after the mount is built (a detached FUSE
   superblock held, its PID-namespace child gone). The
   memory cgroup they were started in is read at each step: what each helper costs the
   broker's pod, less the worker's own objects (the growth of its anonymous memory).
   Twice: for a caller with no supplementary groups, and for one with 32,768 (the most
   the broker accepts; the helper takes them all).
4. *records*: the records of ``--max-mounts-node`` mounts (one small file each in the
   state directory, a tmpfs on the node, charged to the broker's pod) written by a
   worker in a memory cgroup of its own, with its Python objects for them.

For each: the broker's RSS, its open descriptors and the memory its cgroup was charged,
sampled every half second, the most of each; and the descriptors set against
``NodeCaps.descriptors`` (exit 3 if the broker held more than the caps were sized for).
JSON goes to ``bench/results/broker_full_node.json``. The DaemonSet's memory limit cites
these figures.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import selectors
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from bench.broker import DAEMONSET, deployed_flags, fd_count, rss_kib
from fuse_plugin.broker import caller as callers
from fuse_plugin.broker import cgroups, frames, messages, protocol, records, reports, shares
from fuse_plugin.broker.conversation import Conversation, State
from fuse_plugin.broker.helper import NAME as HELPER_NAME
from fuse_plugin.broker.helper import Job
from fuse_plugin.broker.settings import DEFAULT_MAX_MOUNTS_POD
from tests.lib import broker as broker_rig
from tests.lib.waiting import wait_for

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results" / "broker_full_node.json"
CGROUP = Path("/sys/fs/cgroup")
EXIT_TARGET_MISSED = 3
SAMPLE_EVERY = 0.5  # seconds
FILL_DEADLINE = 120.0  # seconds for a load to reach its caps
STEP_DEADLINE = 30.0  # seconds for parked helpers to reach a step
MIB = 1024 * 1024
# The broker, with a helper deadline long enough for every helper of the queued load to
# be alive at once (sys.argv: "-c" and the command's own arguments); server is imported
# first, so its drain's STOP_GRACE keeps the default deadline.
LAUNCH = ("import sys; from fuse_plugin.broker import scheduler, server; "
          "scheduler.HELPER_DEADLINE = 60.0; "
          "from fuse_plugin.cli import main; sys.exit(main())")


@dataclass(frozen=True)
class Sizes:
    hold: float = 20.0  # seconds each load is held at its caps
    helpers: int = 200  # real helpers parked at once
    quick: bool = False


# -- cgroups --------------------------------------------------------------------------------


def unified() -> bool:
    return (CGROUP / "cgroup.controllers").exists()


def container_hierarchy() -> Path:
    """Where the broker reads a caller's container from (``caller._cgroup``): the devices
    controller's hierarchy on cgroup v1, the unified one on v2."""
    return CGROUP if unified() else CGROUP / "devices"


def memory_hierarchy() -> Path:
    return CGROUP if unified() else CGROUP / "memory"


def charged(group: Path) -> int:
    """Bytes of memory the cgroup is charged now (kernel memory included)."""
    name = "memory.current" if unified() else "memory.usage_in_bytes"
    return int((group / name).read_text())


@contextlib.contextmanager
def memory_group(tag: str) -> Iterator[Path]:
    """A fresh memory cgroup; whatever is left in it at the end goes back to the root."""
    group = memory_hierarchy() / f"fuse-bench-{tag}-{uuid.uuid4().hex[:8]}"
    group.mkdir()
    try:
        yield group
    finally:
        for pid in (group / "cgroup.procs").read_text().split():
            with contextlib.suppress(OSError):
                (memory_hierarchy() / "cgroup.procs").write_text(pid)
        with contextlib.suppress(OSError):
            group.rmdir()


@contextlib.contextmanager
def pods(count: int, containers: int) -> Iterator[list[Path]]:
    """``count`` pod cgroups of ``containers`` container cgroups each, named as the
    kubelet names them (``policy.POD_CGROUP``); their ``cgroup.procs`` files, removed at
    the end (once their processes have gone)."""
    root = container_hierarchy()
    made = [root / f"fuse-bench-pod{uuid.uuid4().hex[:12]}" for _ in range(count)]
    procs = []
    try:
        for pod in made:
            pod.mkdir()
            for i in range(containers):
                (pod / f"c{i}").mkdir()
                procs.append(pod / f"c{i}" / "cgroup.procs")
        yield procs
    finally:
        for pod in made:
            for child in pod.glob("c*"):
                with contextlib.suppress(OSError):
                    child.rmdir()
            with contextlib.suppress(OSError):
                pod.rmdir()


# -- tenants --------------------------------------------------------------------------------


def tenant(procs: Path, socket_path: str, count: int, request: bytes | None, stop: int
           ) -> None:
    """A forked child: into its container's cgroup, then ``count`` connections (each
    sending ``request``, or silent), each replaced as soon as the broker answers it,
    until ``stop`` (a pipe) closes."""
    procs.write_text(str(os.getpid()))
    chooser = selectors.DefaultSelector()
    chooser.register(stop, selectors.EVENT_READ, None)

    def make() -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        sock.connect(socket_path)
        if request is not None:
            with contextlib.suppress(OSError):
                sock.send(request)
        sock.setblocking(False)
        chooser.register(sock, selectors.EVENT_READ, sock)

    for _ in range(count):
        make()
    while True:
        for key, _ in chooser.select():
            if key.data is None:
                return
            sock = key.data
            chooser.unregister(sock)
            with contextlib.suppress(OSError):
                sock.recv(protocol.MAX_MESSAGE + 1)
            sock.close()
            make()


@contextlib.contextmanager
def tenants(procs: list[Path], socket_path: str, count: int, request: bytes | None
            ) -> Iterator[None]:
    """One forked tenant per container cgroup; all stopped (their pipe closed) and
    reaped at the end."""
    stop_r, stop_w = os.pipe()
    children = []
    try:
        for path in procs:
            pid = os.fork()
            if pid == 0:  # the child: never returns into the benchmark
                code = 0
                try:
                    os.close(stop_w)
                    tenant(path, socket_path, count, request, stop_r)
                except BaseException:  # a child says so by its exit code
                    code = 1
                os._exit(code)
            children.append(pid)
        os.close(stop_r)
        yield
    finally:
        os.close(stop_w)
        for pid in children:
            os.waitpid(pid, 0)


# -- the broker -----------------------------------------------------------------------------


@dataclass
class Peak:
    """The most the broker held during one load."""

    load: str
    connections: int = 0  # what the tenants keep open
    rss_kib: int = 0
    fds: int = 0
    charged_mib: float = 0.0  # memory charged to its cgroup since it was moved there
    helpers: int = 0  # its children: helpers alive (stand-ins here), killed ones included
    cpu: float = 0.0  # the broker's CPU time over the hold, per second of it
    samples: int = 0


def helpers_of(pid: int) -> int:
    """The broker's children (its helpers), from its threads' children lists."""
    count = 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        with contextlib.suppress(OSError):
            count += len((task / "children").read_text().split())
    return count


def hold(broker_pid: int, peak: Peak, ready: Callable[[], bool], *, group: Path,
         base: int, seconds: float) -> Peak:
    """Wait until the load is at its caps (``ready``), then sample for ``seconds``."""
    wait_for(ready, FILL_DEADLINE, f"the {peak.load} load to reach the caps",
             interval=SAMPLE_EVERY)
    start, cpu_start = time.monotonic(), cpu_seconds(broker_pid)
    end = start + seconds
    while time.monotonic() < end:
        peak.rss_kib = max(peak.rss_kib, rss_kib(broker_pid))
        peak.fds = max(peak.fds, fd_count(broker_pid))
        peak.charged_mib = max(peak.charged_mib, (charged(group) - base) / MIB)
        peak.helpers = max(peak.helpers, helpers_of(broker_pid))
        peak.samples += 1
        time.sleep(SAMPLE_EVERY)
    peak.cpu = (cpu_seconds(broker_pid) - cpu_start) / (time.monotonic() - start)
    return peak


def cpu_seconds(pid: int) -> float:
    """The process's user and system time so far (its helpers' not included)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def stand_in_bin(work: Path) -> Path:
    """The real shim beside a stand-in helper that never answers (``sleep``, holding the
    descriptors the broker hands it): the broker keeps it until its deadline."""
    fake = work / "fake-bin"
    fake.mkdir()
    shutil.copy(broker_rig.shim(), fake / protocol.SHIM_NAME)
    (fake / HELPER_NAME).write_text("#!/bin/sh\nexec sleep 3600\n")
    for program in fake.iterdir():
        program.chmod(0o755)
    return fake / protocol.SHIM_NAME


def max_pods(flags: list[str]) -> int:
    for flag in flags:
        if flag.startswith("--max-pods="):
            return int(flag.split("=", 1)[1])
    return shares.DEFAULT_MAX_PODS


def broker_loads(work: Path, sizes: Sizes) -> tuple[list[Peak], dict[str, Any]]:
    """Loads 1 and 2 against the real broker (a stand-in helper)."""
    flags = [f for f in deployed_flags() if not f.startswith("--metrics-port")]
    caps = shares.NodeCaps.for_pods(max_pods(flags), DEFAULT_MAX_MOUNTS_POD)
    broker = broker_rig.BrokerProcess(work / "dir", work / "broker", stand_in_bin(work),
                                      *flags)
    broker.launch = ("-c", LAUNCH)
    broker.start()
    peaks = []
    try:
        serving = broker.events("broker.serving")[-1]
        with memory_group("broker") as group:
            (group / "cgroup.procs").write_text(str(broker.pid))
            base = charged(group)
            idle = Peak("idle", rss_kib=rss_kib(broker.pid), fds=fd_count(broker.pid))
            peaks.append(idle)
            sock = str(broker.socket)
            per_container = shares.PER_CONTAINER
            with pods(caps.max_pods, shares.PER_POD // per_container) as procs, \
                    tenants(procs, sock, per_container, None):
                peak = Peak("silent", connections=caps.requests)
                fill = caps.requests + idle.fds
                peaks.append(hold(broker.pid, peak, lambda: fd_count(broker.pid) >= fill,
                                  group=group, base=base, seconds=sizes.hold))
            mount = protocol.encode(v=protocol.VERSION, op="mount", path="/mnt/x",
                                    fuse_fd="3")
            with pods(caps.max_pods, shares.PER_POD // per_container) as procs, \
                    tenants(procs, sock, per_container, mount):
                peak = Peak("queued", connections=caps.requests)
                peaks.append(hold(broker.pid, peak,
                                  lambda: helpers_of(broker.pid) >= caps.helpers,
                                  group=group, base=base, seconds=sizes.hold))
    finally:
        broker.stop()
    # Why the broker refused, from its log (lines within each tenant's budget, and the
    # one line a second of refusals at accept with how many it stands for).
    refused: Counter[str] = Counter()
    for event in broker.events("broker.refused"):
        refused[str(event.get("reason"))] += int(event.get("connections", 1))
    return peaks, {"serving": serving, "refused": dict(refused), "caps": asdict(caps),
                   "flags": flags}


# -- real helpers, parked -------------------------------------------------------------------


def anon_kib(pid: int) -> int:
    """The process's own anonymous memory (a worker's Python objects)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("RssAnon:"):
            return int(line.split()[1])
    raise ProcessLookupError(f"process {pid} has exited")


def say(**fields: object) -> None:
    """A worker's line to the benchmark, with its own anonymous memory."""
    print(json.dumps({**fields, "anon_kib": anon_kib(os.getpid())}), flush=True)


def drive_helpers(directory: Path, count: int, groups: int, callers_group: str = "") -> None:
    """The worker ``drive-helpers``, started in a memory cgroup of its own (so that
    nothing it shares with the benchmark is charged there), with ``groups``
    supplementary groups: ``count`` real helpers serving its own mount requests, held at
    each step until a line arrives on stdin; it says when all are there. With
    ``callers_group``, a memory cgroup, each helper moves itself there first, as the
    broker has it join its caller's (``cgroups``): the worker's own cgroup stands for
    the broker's pod, that one for the caller's."""
    os.setgroups(list(range(100_000, 100_000 + groups)))
    caller = callers.Caller(pid=os.getpid(), uid=0, gid=0, pidfd=os.pidfd_open(os.getpid()),
                            container="/fuse-bench")
    caller.open()
    helper = broker_rig.shim().parent / HELPER_NAME
    unused, _ = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)  # no client here
    say(step="ready")
    sys.stdin.readline()
    works = []
    for i in range(count):
        point = directory / str(i)
        point.mkdir()
        fuse = os.open("/dev/fuse", os.O_RDWR)
        work = Conversation(unused, caller, time.monotonic() + 3600)
        work.parsed = protocol.Request(op="mount", path=str(point), fuse_fd=fuse)
        charge = [("memory", os.open(f"{callers_group}/cgroup.procs", os.O_WRONLY))] \
            if callers_group else []
        try:
            work.job = Job.start(helper, caller, work.request, time.monotonic() + 3600,
                                 charge)
        finally:
            cgroups.close(charge)
        work.advance(State.QUEUED)  # where the loop's scheduler puts a started request
        work.advance(State.RUNNING)
        works.append(work)
    for step in ("mark", "facts", "built"):
        pending = reach(works, directory)
        say(step=step, missing=len(pending))
        sys.stdin.readline()
        for work in works:
            assert work.job is not None
            if step == "mark":
                work.job.send(messages.GO)
            elif step == "facts":
                verdict = work.fields.get("verdict")
                assert isinstance(verdict, messages.MountVerdict)
                work.job.send(verdict)
            else:
                work.job.send(messages.STOP)  # the built mount is never attached
    for work in works:
        assert work.job is not None
        work.job.proc.wait(STEP_DEADLINE)
        work.job.close()


def reach(works: list[Conversation], directory: Path) -> list[Conversation]:
    """Hear each helper's next report (a mount's facts are judged, as the loop judges
    them); those that said nothing within the deadline."""
    pending = list(works)
    deadline = time.monotonic() + STEP_DEADLINE
    while pending and time.monotonic() < deadline:
        with selectors.DefaultSelector() as chooser:
            for work in pending:
                assert work.job is not None
                chooser.register(work.job.ctl, selectors.EVENT_READ, work)
            for key, _ in chooser.select(1.0):
                work = key.data
                assert work.job is not None
                message = work.job.receive()
                if message is None:
                    continue
                report = work.hear(message)
                if isinstance(report, reports.MountFacts):
                    work.fields["verdict"] = work.verdict(report, records.Records(directory),
                                                          True)
                pending.remove(work)
    return pending


@contextlib.contextmanager
def worker(group: Path, *args: str) -> Iterator[subprocess.Popen[str]]:
    """This benchmark run as one of its workers, in ``group`` from its start (it joins
    before it runs: ``preexec_fn``); killed at the end."""
    def join() -> None:
        (group / "cgroup.procs").write_text(str(os.getpid()))

    proc = subprocess.Popen([sys.executable, "-m", "bench.broker_full_node", *args],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                            cwd=HERE.parent, preexec_fn=join)  # noqa: PLW1509 - no threads
    try:
        yield proc
    finally:
        proc.kill()
        proc.wait()


def heard(proc: subprocess.Popen[str]) -> dict[str, Any]:
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if not line:
        raise AssertionError(f"a worker ended ({proc.wait()})")
    said: dict[str, Any] = json.loads(line)
    return said


def go_on(proc: subprocess.Popen[str]) -> None:
    assert proc.stdin is not None
    proc.stdin.write("go\n")
    proc.stdin.flush()


def parked_helpers(work: Path, sizes: Sizes, groups: int, to_caller: bool) -> dict[str, Any]:
    """Load 3: what real helpers cost their memory cgroup at each step they wait at,
    for a caller with ``groups`` supplementary groups. The worker's own objects (its
    anonymous memory's growth) are taken off: the broker has its own. ``to_caller``:
    each helper moves itself into the caller's memory cgroup first, as the broker has
    it do (``cgroups``): what stays with the broker's stand-in, and what the caller's
    cgroup is charged."""
    directory = work / f"mnt-{groups}-{'caller' if to_caller else 'broker'}"
    directory.mkdir()
    # A private tmpfs: a data filesystem the rules mount on, whatever the node's / is.
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8m", "fuse-bench", str(directory)],
                   check=True)
    subprocess.run(["mount", "--make-private", str(directory)], check=True)
    steps: dict[str, Any] = {}
    try:
        with memory_group("helpers") as group, memory_group("callers") as callers_group, \
                worker(group, "drive-helpers", str(directory), str(sizes.helpers),
                       str(groups), *([str(callers_group)] if to_caller else [])) as proc:
            ready = heard(proc)
            base, callers_base = charged(group), charged(callers_group)
            go_on(proc)
            for _ in range(3):
                said = heard(proc)
                pids = [int(p) for p in
                        Path(f"/proc/{proc.pid}/task/{proc.pid}/children").read_text().split()]
                grown = charged(group) - base - (said["anon_kib"] - ready["anon_kib"]) * 1024
                steps[said["step"]] = {
                    "helpers": len(pids), "missing": said["missing"],
                    "charged_mib": round(grown / MIB, 2),
                    "caller_mib": round((charged(callers_group) - callers_base) / MIB, 2),
                    "helpers_rss_kib": sum(rss_kib(p) for p in pids),
                    "worker_anon_growth_kib": said["anon_kib"] - ready["anon_kib"]}
                go_on(proc)
            proc.wait(STEP_DEADLINE * 2)
    finally:
        subprocess.run(["umount", "-l", str(directory)], check=False)
    return {"helpers": sizes.helpers, "groups": groups, "to_caller": to_caller,
            "steps": steps}


# -- records --------------------------------------------------------------------------------


def write_records(directory: Path, count: int) -> None:
    """The worker ``write-records``, in a memory cgroup of its own: ``count`` records
    written as the broker writes them, once a line arrives on stdin."""
    held = records.Records(directory)
    say(step="ready")
    sys.stdin.readline()
    for n in range(count):
        held.add(records.Record(connection=n + 1, ctl_inode=100_000 + n,
                                container=f"/kubepods/besteffort/pod{n % 110:032x}/c{n % 4}",
                                uid=0, namespace=4026531840, mount_id=1000 + n,
                                path=f"/mnt/data/volume-{n}"))
    say(step="written")
    sys.stdin.readline()


def record_costs(work: Path, count: int) -> dict[str, Any]:
    """Load 4: the records of a node's --max-mounts-node mounts, on a tmpfs."""
    state = work / "state"
    state.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256m", "fuse-bench", str(state)],
                   check=True)
    try:
        with memory_group("records") as group, \
                worker(group, "write-records", str(state), str(count)) as proc:
            ready = heard(proc)
            base = charged(group)
            go_on(proc)
            said = heard(proc)
            total = charged(group) - base
            return {"records": count, "charged_mib": round(total / MIB, 2),
                    "python_anon_growth_kib": said["anon_kib"] - ready["anon_kib"],
                    "per_record_bytes": total // count}
    finally:
        subprocess.run(["umount", "-l", str(state)], check=False)


# -- the run --------------------------------------------------------------------------------


@dataclass
class Report:
    machine: dict[str, Any]
    broker: dict[str, Any]
    peaks: list[Peak] = field(default_factory=list)
    helpers: list[dict[str, Any]] = field(default_factory=list)
    records: dict[str, Any] = field(default_factory=dict)


def run(sizes: Sizes) -> Report:
    with tempfile.TemporaryDirectory(prefix="fuse-bench-full-node-") as temp:
        work = Path(temp)
        peaks, broker = broker_loads(work, sizes)
        helpers = [parked_helpers(work, sizes, groups, to_caller)
                   for to_caller in (False, True) for groups in (0, frames.MAX_GROUPS)]
        caps = broker["caps"]
        kept = record_costs(work, caps["mounts"])
    machine = {"kernel": platform.release(), "cpus": os.cpu_count(),
               "cgroup": "v2" if unified() else "v1", "load_1m": os.getloadavg()[0]}
    return Report(machine, broker, peaks, helpers, kept)


def print_report(report: Report) -> bool:
    """The table; whether the broker's descriptors stayed within what the caps need."""
    caps = report.broker["caps"]
    needed = (shares.FDS_PER_REQUEST * caps["requests"] + shares.FDS_PER_HELPER
              * caps["helpers"] + shares.FDS_BESIDE)
    print(f"caps at --max-pods {caps['max_pods']}: {caps['requests']} open requests, "
          f"{caps['helpers']} helpers, {caps['mounts']} mounts; descriptors sized: {needed}; "
          f"fd_limit {report.broker['serving'].get('fd_limit')}")
    print(f"{'load':<8} {'open':>6} {'RSS MiB':>8} {'fds':>6} {'charged MiB':>12} "
          f"{'helpers':>8} {'CPU':>6}")
    for p in report.peaks:
        print(f"{p.load:<8} {p.connections:>6} {p.rss_kib / 1024:>8.1f} {p.fds:>6} "
              f"{p.charged_mib:>12.1f} {p.helpers:>8} {p.cpu:>6.1%}")
    for parked in report.helpers:
        count = parked["helpers"]
        for step, figures in parked["steps"].items():
            where = "charged to their caller" if parked["to_caller"] else "in the broker's"
            print(f"{count} real helpers ({where}), caller of {parked['groups']} groups, "
                  f"parked at {step!r}: {figures['charged_mib']} MiB charged to the broker "
                  f"({figures['charged_mib'] * 1024 / count:.0f} KiB each), "
                  f"{figures['caller_mib']} MiB to the caller "
                  f"({figures['caller_mib'] * 1024 / count:.0f} KiB each; their RSS "
                  f"{figures['helpers_rss_kib'] / count:.0f} KiB each; the worker's own "
                  f"{figures['worker_anon_growth_kib']} KiB taken off); "
                  f"{figures['missing']} not there")
    kept = report.records
    print(f"{kept['records']} records: {kept['charged_mib']} MiB charged "
          f"({kept['per_record_bytes']} bytes each; of which Python objects "
          f"{kept['python_anon_growth_kib'] / 1024:.1f} MiB)")
    ok = all(p.fds <= needed for p in report.peaks)
    print(f"descriptors within the caps' {needed}: {'PASS' if ok else 'FAIL'}")
    for reason, count in sorted(report.broker["refused"].items(), key=lambda r: -r[1]):
        print(f"refused {count}: {reason}")
    return ok


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["drive-helpers"]:  # the workers (``worker``)
        drive_helpers(Path(argv[1]), int(argv[2]), int(argv[3]), *argv[4:5])
        return 0
    if argv[:1] == ["write-records"]:
        write_records(Path(argv[1]), int(argv[2]))
        return 0
    parser = argparse.ArgumentParser(prog="python -m bench.broker_full_node",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="50 parked helpers, 5 s holds")
    parser.add_argument("--hold", type=float, default=Sizes.hold)
    parser.add_argument("--helpers", type=int, default=Sizes.helpers)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    if os.geteuid() != 0:
        print("bench.broker_full_node needs root (cgroups, mounts, the broker)",
              file=sys.stderr)
        return 2
    sizes = Sizes(hold=5.0, helpers=50, quick=True) if args.quick else \
        Sizes(hold=args.hold, helpers=args.helpers)
    report = run(sizes)
    ok = print_report(report)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(asdict(report), indent=1) + "\n")
    print(f"JSON: {args.out}; the DaemonSet: {DAEMONSET.relative_to(HERE.parent)}")
    return 0 if ok else EXIT_TARGET_MISSED


if __name__ == "__main__":
    sys.exit(main())
