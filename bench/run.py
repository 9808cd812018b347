"""Benchmarks what the kubelet and a node feel, against targets (issues 7 and 13).

Run from the repository root::

    .venv/bin/python -m bench            # full run, a few minutes
    .venv/bin/python -m bench --quick    # smoke run, well under a minute

Everything is measured against the real ``fuse-device-plugin serve`` process, run with
the flags the DaemonSet gives it (read from ``manifests/plugin-daemonset.yaml``; the
metrics port moved to a free one), with the kubelet stand-in (``fuse_plugin.demo.kubelet``)
in this process over real unix sockets, on a fake node in a temp dir (a real char device
10:229 made with mknod, so: root). Every figure is also taken against the floor
(``bench/floor.py``: a bare grpcio server that answers constants) with the same client
code, so the table shows how far from the floor each one is. Prints a table with
median, p99 and PASS/FAIL per target; writes JSON to ``bench/results/latest.json`` (or
``--out``).
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import platform
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import ExitStack, contextmanager, suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import yaml

from bench import deployed
from fuse_plugin.api import api_pb2 as api
from fuse_plugin.api import api_pb2_grpc
from fuse_plugin.args import ENV_PREFIX
from fuse_plugin.config import API_VERSION, Settings
from fuse_plugin.devices import slot_ids
from tests.lib.kubelet import KubeletStandIn
from tests.lib.node import FakeNode
from tests.lib.servers import stop_process

HERE = Path(__file__).resolve().parent
DAEMONSET = HERE.parent / "manifests" / "plugin-daemonset.yaml"
RESULTS = HERE / "results" / "latest.json"
RESOURCE = "github.com/fuse"
FLOOR_RESOURCE = "bench.floor/fuse"
FLOOR_SOCKET = "bench.floor.sock"
MIB = 1024 * 1024
CLK_TCK = os.sysconf("SC_CLK_TCK")
RPC_TIMEOUT = 5.0
WAIT = 10.0
RSS_MIB = 38  # as deployed: after registration, Allocates, scrapes and probes
RSS_STORM_MIB = 40  # after a storm of kubelet restarts (issue 7)
IDLE_MS_PER_S = 0.2
# Exit code when the run completed but a target was missed (a crash exits 1).
EXIT_TARGET_MISSED = 3


@dataclass(frozen=True)
class Sizes:
    """How much of each thing one run does; --quick shrinks all of it."""

    rereg: int = 40
    starts: int = 10
    health: int = 40
    streams: int = 4
    # Allocate against the floor: this many rounds, each process in turn, each round a
    # sequential run of seq_calls and conc_seconds of conc_clients concurrent clients.
    alloc_rounds: int = 30
    seq_calls: int = 500
    conc_clients: int = 32
    conc_seconds: float = 0.4
    scale_slots: tuple[int, ...] = (10, 1000, 10_000)
    scale_streams: int = 30
    scale_calls: int = 3000
    scale_rounds: int = 10
    deployed_calls: int = 10_000  # Allocates, and as many scrapes and probes, before RSS
    mem_allocates: int = 100_000
    mem_restarts: int = 1000
    mem_budget: float = 150.0  # seconds for both memory loops together, at most
    idle_seconds: float = 20.0
    slots: int = 1000


FULL = Sizes()
QUICK = Sizes(rereg=5, starts=2, health=5, alloc_rounds=3, seq_calls=100, conc_seconds=0.2,
              scale_streams=3, scale_calls=300, scale_rounds=3, deployed_calls=500,
              mem_allocates=2000, mem_restarts=20, mem_budget=30.0, idle_seconds=2.0)


# -- numbers -----------------------------------------------------------------------------

def write_report(out: Path, result: dict[str, Any], text: str) -> None:
    """Print a benchmark's table and write its JSON result to ``out``."""
    print(text)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"JSON written to {out}")


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (q in 0..100)."""
    ordered = sorted(values)
    rank = max(1, -(-len(ordered) * q // 100))
    return ordered[int(rank) - 1]


def summary(values_s: list[float]) -> dict[str, Any]:
    """Median and p99 in milliseconds of samples given in seconds."""
    ms = [v * 1000 for v in values_s]
    return {"median_ms": round(statistics.median(ms), 4), "p99_ms": round(percentile(ms, 99), 4),
            "min_ms": round(min(ms), 4), "max_ms": round(max(ms), 4), "n": len(ms)}


# -- the fake node and the processes -----------------------------------------------------

@contextmanager
def fake_node() -> Iterator[FakeNode]:
    root = Path(tempfile.mkdtemp(prefix="fuse-bench-"))
    try:
        yield FakeNode.create(root)
    finally:
        shutil.rmtree(root, ignore_errors=True)


@dataclass
class Proc:
    popen: subprocess.Popen[bytes]
    log: Path
    socket: Path
    resource: str
    started: float
    metrics_port: int = 0
    handoff: bool = False

    @property
    def pid(self) -> int:
        return self.popen.pid

    def status(self) -> dict[str, int]:
        keys = ("VmRSS", "RssAnon", "RssFile", "Threads")
        return {k: _status_kib(self.pid, k) for k in keys}

    def tasks(self) -> list[int]:
        return [int(t) for t in os.listdir(f"/proc/{self.pid}/task")]

    def cpu_seconds(self) -> float:
        """CPU time of every thread, in nanoseconds (schedstat) rather than the 10 ms
        ticks of /proc/PID/stat, which are too coarse for a 100 ms round."""
        return sum(_schedstat(self.pid, tid)[0] for tid in self.tasks()) / 1e9

    def stop(self) -> None:
        if self.handoff and self.popen.poll() is None:
            self.popen.send_signal(signal.SIGINT)
        stop_process(self.popen)


def _status_kib(pid: int, key: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1])
    raise KeyError(key)


def _schedstat(pid: int, tid: int) -> tuple[int, int]:
    """(ns on a CPU, times scheduled) of one thread; a thread gone meanwhile counts 0."""
    try:
        fields = Path(f"/proc/{pid}/task/{tid}/schedstat").read_text().split()
    except OSError:
        return 0, 0
    return int(fields[0]), int(fields[2])


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def deployed_flags() -> list[str]:
    """``serve``'s flags as the DaemonSet passes them, read from its manifest: its args,
    then its environment twins (the instance, from the pod UID)."""
    return [*deployed.flags(DAEMONSET, "serve"), *deployed.env_flags(DAEMONSET, ENV_PREFIX)]


def plugin_command() -> list[str]:
    exe = Path(sys.executable).parent / "fuse-device-plugin"
    if exe.exists():
        return [str(exe)]
    return [sys.executable, "-m", "fuse_plugin"]


def start_plugin(node: FakeNode, slots: int, flags: Sequence[str]) -> Proc:
    """``serve`` with ``flags``; a metrics port among them is moved to a free one, so
    that several plugins (and one already on this machine) can run at once."""
    port = 0
    argv = [*plugin_command(), "serve", "--device-plugin-dir", str(node.plugin_dir),
            "--fuse-device", str(node.device), "--slots", str(slots)]
    for flag in flags:
        if flag.split("=", 1)[0] == "--metrics-port" and flag != "--metrics-port=0":
            port = free_port()
            argv.append(f"--metrics-port={port}")
        else:
            argv.append(flag)
    log = node.root / f"plugin-{time.monotonic_ns()}.log"
    instance = next((f.split("=", 1)[1] for f in flags if f.startswith("--instance=")), "")
    socket_name = Settings(resource_name=RESOURCE, instance=instance).socket_name
    # A plugin told to hand off (--handoff-wait) has no successor here: a second stop
    # signal stops it at once (SIGINT: a second SIGTERM may merge with the first).
    handoff = any(f.startswith("--handoff-wait=") for f in flags)
    with log.open("wb") as out:
        started = time.perf_counter()
        popen = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT)
    return Proc(popen, log, node.plugin_dir / socket_name, RESOURCE, started, port,
                handoff=handoff)


def write_floor_constants(directory: Path, device: Path, slots: int) -> None:
    """The floor's answers, serialised here so the floor process imports only grpc."""
    directory.mkdir(parents=True, exist_ok=True)
    ids = slot_ids(slots)
    blobs = {
        "options": api.DevicePluginOptions(get_preferred_allocation_available=True),
        "allocate": api.AllocateResponse(container_responses=[api.ContainerAllocateResponse(
            devices=[api.DeviceSpec(container_path="/dev/fuse", host_path=str(device),
                                    permissions="rw")])]),
        "healthy": api.ListAndWatchResponse(
            devices=[api.Device(ID=i, health="Healthy") for i in ids]),
        "unhealthy": api.ListAndWatchResponse(
            devices=[api.Device(ID=i, health="Unhealthy") for i in ids]),
        "register": api.RegisterRequest(
            version=API_VERSION, endpoint=FLOOR_SOCKET, resource_name=FLOOR_RESOURCE,
            options=api.DevicePluginOptions(get_preferred_allocation_available=True)),
    }
    for name, message in blobs.items():
        (directory / f"{name}.bin").write_bytes(message.SerializeToString())


def start_floor(node: FakeNode, slots: int, watch: bool) -> Proc:
    consts = node.root / f"floor-consts-{slots}"
    if not consts.exists():
        write_floor_constants(consts, node.device, slots)
    log = node.root / f"floor-{time.monotonic_ns()}.log"
    sock = node.plugin_dir / FLOOR_SOCKET
    argv = [sys.executable, str(HERE / "floor.py"), str(sock), str(consts)]
    if watch:
        argv += ["--watch", str(node.device)]
    env = {**os.environ, "GRPC_VERBOSITY": "ERROR"}
    with log.open("wb") as out:
        started = time.perf_counter()
        popen = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env)
    return Proc(popen, log, sock, FLOOR_RESOURCE, started)


Starter = Callable[[FakeNode, int], Proc]


def plugin_starter(flags: Sequence[str]) -> Starter:
    def start(node: FakeNode, slots: int) -> Proc:
        return start_plugin(node, slots, flags)
    return start


def floor_starter(node: FakeNode, slots: int) -> Proc:
    return start_floor(node, slots, watch=False)


def floor_watch_starter(node: FakeNode, slots: int) -> Proc:
    return start_floor(node, slots, watch=True)


@contextmanager
def running(node: FakeNode, start: Starter, slots: int,
            kubelet: KubeletStandIn | None = None) -> Iterator[tuple[Proc, KubeletStandIn]]:
    """A stand-in and a started process that has registered and listed its devices."""
    own = kubelet is None
    standin = kubelet or KubeletStandIn(node.plugin_dir).start()
    proc = start(node, slots)
    try:
        count = len(standin.registrations) + 1
        standin.wait_registered(count, WAIT)
        standin.wait_devices(proc.resource, lambda d: len(d) == slots, WAIT)
        yield proc, standin
    finally:
        proc.stop()
        if own:
            standin.close()


def channel_to(proc: Proc) -> grpc.Channel:
    return grpc.insecure_channel(f"unix://{proc.socket}")


ALLOCATE = api.AllocateRequest(container_requests=[api.ContainerAllocateRequest(
    devices_ids=["fuse-1"])])


def settle(proc: Proc, seconds: float = 0.3) -> None:
    """Let start-up work finish before a memory reading."""
    time.sleep(seconds)
    if proc.popen.poll() is not None:
        raise RuntimeError(f"process {proc.pid} exited: {proc.log.read_text()[-2000:]}")


# -- 1. re-registration after a kubelet restart ------------------------------------------

def measure_reregistration(kubelet: KubeletStandIn, proc: Proc, runs: int) -> dict[str, Any]:
    received, answered, listed = [], [], []
    for _ in range(runs):
        count = len(kubelet.registrations) + 1
        kubelet.restart()
        registration = kubelet.wait_registered(count, WAIT)
        kubelet.wait_devices(proc.resource, bool, WAIT)
        done = time.perf_counter()
        received.append(registration.received - kubelet.started_at)
        answered.append(registration.answered - kubelet.started_at)
        listed.append(done - kubelet.started_at)
    return {"answered": summary(answered), "received": summary(received),
            "listed": summary(listed)}


# -- 2. process start to registered ------------------------------------------------------

def measure_start(starters: dict[str, Starter], slots: int, runs: int
                  ) -> dict[str, dict[str, Any]]:
    """Start each implementation ``runs`` times, taking turns; stop it once registered."""
    samples: dict[str, list[float]] = {name: [] for name in starters}
    with fake_node() as node, KubeletStandIn(node.plugin_dir) as kubelet:
        for _ in range(runs):
            for name, start in starters.items():
                count = len(kubelet.registrations) + 1
                proc = start(node, slots)
                try:
                    registration = kubelet.wait_registered(count, WAIT)
                    samples[name].append(registration.answered - proc.started)
                    kubelet.wait_devices(proc.resource, lambda d: len(d) == slots, WAIT)
                finally:
                    proc.stop()
    return {name: summary(values) for name, values in samples.items()}


# -- 3. health: device node removed and restored -----------------------------------------

class _Watcher:
    """Open ListAndWatch streams straight on the plugin's socket; stamps each message."""

    def __init__(self, proc: Proc, streams: int) -> None:
        self._cond = threading.Condition()
        self._latest: list[tuple[float, str]] = [(0.0, "")] * streams
        self._channels = [channel_to(proc) for _ in range(streams)]
        self._calls = [api_pb2_grpc.DevicePluginStub(c).ListAndWatch(api.Empty())
                       for c in self._channels]
        self._threads = [threading.Thread(target=self._read, args=(i,), daemon=True)
                         for i in range(streams)]
        for thread in self._threads:
            thread.start()

    def _read(self, index: int) -> None:
        with suppress(grpc.RpcError):
            for message in self._calls[index]:
                arrived = time.perf_counter()
                with self._cond:
                    self._latest[index] = (arrived, message.devices[0].health)
                    self._cond.notify_all()

    def wait_all(self, health: str, after: float) -> float:
        """When the last stream got ``health`` (a message that arrived after ``after``)."""
        def ready() -> bool:
            return all(h == health and t >= after for t, h in self._latest)
        with self._cond:
            if not self._cond.wait_for(ready, WAIT):
                raise TimeoutError(f"streams did not all show {health}: {self._latest}")
            return max(t for t, _ in self._latest)

    def close(self) -> None:
        for call in self._calls:
            call.cancel()
        for channel in self._channels:
            channel.close()
        for thread in self._threads:
            thread.join(5)


def measure_health(node: FakeNode, kubelet: KubeletStandIn, proc: Proc, runs: int,
                   streams: int) -> dict[str, Any]:
    watcher = _Watcher(proc, streams)
    down, up = [], []
    try:
        watcher.wait_all("Healthy", 0.0)
        for _ in range(runs):
            started = time.perf_counter()
            node.remove_device()
            down.append(watcher.wait_all("Unhealthy", started) - started)
            kubelet.wait_devices(proc.resource, lambda d: d.get("fuse-0") == "Unhealthy", WAIT)
            time.sleep(0.005)
            started = time.perf_counter()
            node.restore_device()
            up.append(watcher.wait_all("Healthy", started) - started)
            kubelet.wait_devices(proc.resource, lambda d: d.get("fuse-0") == "Healthy", WAIT)
            time.sleep(0.005)
    finally:
        watcher.close()
    return {"unhealthy": summary(down), "healthy": summary(up), "streams": streams + 1}


# -- 4. Allocate latency and throughput --------------------------------------------------

class _Clients:
    """``count`` client threads, each with its own channel, each with one call in flight."""

    def __init__(self, proc: Proc, count: int) -> None:
        self.channels = [channel_to(proc) for _ in range(count)]
        self.stubs = [api_pb2_grpc.DevicePluginStub(c).Allocate for c in self.channels]
        for allocate in self.stubs:
            for _ in range(5):
                allocate(ALLOCATE, timeout=RPC_TIMEOUT)

    def round(self, seconds: float) -> tuple[list[float], float]:
        """All clients call until the deadline; returns latencies and the elapsed time."""
        count = len(self.stubs)
        barrier = threading.Barrier(count + 1)
        samples: list[list[float]] = [[] for _ in range(count)]
        deadline = [0.0]

        def client(index: int) -> None:
            allocate, mine = self.stubs[index], samples[index]
            barrier.wait()
            end = deadline[0]
            while (t := time.perf_counter()) < end:
                allocate(ALLOCATE, timeout=RPC_TIMEOUT)
                mine.append(time.perf_counter() - t)

        threads = [threading.Thread(target=client, args=(i,)) for i in range(count)]
        for thread in threads:
            thread.start()
        started = time.perf_counter()
        deadline[0] = started + seconds
        barrier.wait()
        for thread in threads:
            thread.join()
        return [x for mine in samples for x in mine], time.perf_counter() - started

    def close(self) -> None:
        for channel in self.channels:
            channel.close()


@contextmanager
def pinned(procs: Iterable[Proc]) -> Iterator[None]:
    """Every server on the last CPU, this process (the clients) on the others.

    Unpinned, each Allocate wakes gRPC's threads on whichever CPU is free, and where the
    scheduler puts them moved a process's CPU per call by 10-20 % between two runs of the
    same code, more than the differences measured here. Pinned, two floors agree within
    a few per cent. (Absolute figures drop too: one CPU keeps its caches warm.)
    """
    cpus = os.sched_getaffinity(0)
    if len(cpus) < 2:
        yield
        return
    server, clients = {max(cpus)}, cpus - {max(cpus)}
    for proc in procs:
        for tid in proc.tasks():
            with suppress(OSError):
                os.sched_setaffinity(tid, server)
    mine = [int(t) for t in os.listdir("/proc/self/task")]
    for tid in mine:
        with suppress(OSError):
            os.sched_setaffinity(tid, clients)
    try:
        yield
    finally:
        for task in os.listdir("/proc/self/task"):
            with suppress(OSError):
                os.sched_setaffinity(int(task), cpus)


def allocate_turns(procs: dict[str, Proc], sizes: Sizes) -> dict[str, dict[str, Any]]:
    """Allocate against every process in turns, ``sizes.alloc_rounds`` times.

    Each turn is a sequential run (one channel, one call at a time: the kubelet's
    pattern) and then ``conc_clients`` threads, each with its own channel and one call
    always in flight. The order flips every round. Each figure is also divided by the
    floor's in the same round, and the median of those ratios is reported: load that
    comes and goes falls on both sides of each ratio.
    """
    names = list(procs)
    seq: dict[str, list[list[float]]] = {n: [] for n in names}
    conc: dict[str, list[list[float]]] = {n: [] for n in names}
    seq_cpu: dict[str, list[float]] = {n: [] for n in names}
    conc_cpu: dict[str, list[float]] = {n: [] for n in names}
    seq_rate: dict[str, list[float]] = {n: [] for n in names}
    conc_rate: dict[str, list[float]] = {n: [] for n in names}
    with ExitStack() as stack:
        stubs = {}
        for name, proc in procs.items():
            channel = stack.enter_context(channel_to(proc))
            stubs[name] = api_pb2_grpc.DevicePluginStub(channel).Allocate
            for _ in range(200):  # warm up the channel and the server's threads
                stubs[name](ALLOCATE, timeout=RPC_TIMEOUT)
        pools = {name: _Clients(proc, sizes.conc_clients) for name, proc in procs.items()}
        for pool in pools.values():
            stack.callback(pool.close)
        stack.enter_context(pinned(procs.values()))
        for turn in range(sizes.alloc_rounds):
            for name in names if turn % 2 == 0 else reversed(names):
                proc, allocate = procs[name], stubs[name]
                latencies = []
                cpu = proc.cpu_seconds()
                started = time.perf_counter()
                for _ in range(sizes.seq_calls):
                    t = time.perf_counter()
                    allocate(ALLOCATE, timeout=RPC_TIMEOUT)
                    latencies.append(time.perf_counter() - t)
                seq_rate[name].append(sizes.seq_calls / (time.perf_counter() - started))
                seq_cpu[name].append((proc.cpu_seconds() - cpu) / sizes.seq_calls)
                seq[name].append(latencies)
                cpu = proc.cpu_seconds()
                latencies, took = pools[name].round(sizes.conc_seconds)
                conc_rate[name].append(len(latencies) / took)
                conc_cpu[name].append((proc.cpu_seconds() - cpu) / max(1, len(latencies)))
                conc[name].append(latencies)
    out: dict[str, dict[str, Any]] = {}
    for name in names:
        sequential = summary([x for r in seq[name] for x in r])
        sequential["per_second"] = round(statistics.median(seq_rate[name]))
        sequential["server_cpu_us"] = round(statistics.median(seq_cpu[name]) * 1e6, 1)
        concurrent = summary([x for r in conc[name] for x in r])
        concurrent["per_second"] = round(statistics.median(conc_rate[name]))
        concurrent["server_cpu_us"] = round(statistics.median(conc_cpu[name]) * 1e6, 1)
        concurrent["clients"] = sizes.conc_clients
        # Little's law: with every client always waiting, the mean latency can be no
        # lower than clients / throughput, whatever the server does with its time.
        concurrent["queueing_bound_ms"] = round(
            sizes.conc_clients / concurrent["per_second"] * 1000, 3)
        out[name] = {"sequential": sequential, "concurrent": concurrent}
    base = names[-1]  # the floor comes last

    def ratio(values: dict[str, list[float]], name: str) -> dict[str, float]:
        ratios = sorted(a / b for a, b in zip(values[name], values[base], strict=True))
        return {"median": round(statistics.median(ratios), 3),
                "q1": round(percentile(ratios, 25), 3), "q3": round(percentile(ratios, 75), 3)}

    p50 = {n: [statistics.median(r) for r in seq[n]] for n in names}
    for name in names:
        out[name]["vs_floor"] = {
            "sequential_p50": ratio(p50, name), "sequential_cpu": ratio(seq_cpu, name),
            "concurrent_throughput": ratio(conc_rate, name),
            "concurrent_cpu": ratio(conc_cpu, name)}
    return out


# -- 5. scale: slot count vs ListAndWatch and Allocate -----------------------------------

def measure_scale(starters: dict[str, Starter], sizes: Sizes) -> dict[str, dict[str, Any]]:
    """One process per implementation and slot count, all running at once, measured in
    turns (plugin 10, 1000, 10000, floor 10, ..., then again), so background load falls
    evenly on every slot count and on the floor."""
    rounds = max(1, sizes.scale_rounds)
    keys = [(name, n) for name in starters for n in sizes.scale_slots]
    lists: dict[tuple[str, int], list[float]] = {k: [] for k in keys}
    calls: dict[tuple[str, int], list[float]] = {k: [] for k in keys}
    size: dict[tuple[str, int], int] = {}
    with ExitStack() as stack:
        stubs = {}
        for name, slots in keys:
            node = stack.enter_context(fake_node())
            proc, _ = stack.enter_context(running(node, starters[name], slots))
            channel = stack.enter_context(channel_to(proc))
            stub = api_pb2_grpc.DevicePluginStub(channel)
            for _ in range(200):  # warm up the channel and the server's threads
                stub.Allocate(ALLOCATE, timeout=RPC_TIMEOUT)
            stubs[name, slots] = stub
        for _ in range(rounds):
            for key, stub in stubs.items():
                for _ in range(max(1, sizes.scale_streams // rounds)):
                    started = time.perf_counter()
                    call = stub.ListAndWatch(api.Empty(), timeout=WAIT)
                    first = next(call)
                    lists[key].append(time.perf_counter() - started)
                    size[key] = first.ByteSize()
                    call.cancel()
                for _ in range(max(1, sizes.scale_calls // rounds)):
                    t = time.perf_counter()
                    stub.Allocate(ALLOCATE, timeout=RPC_TIMEOUT)
                    calls[key].append(time.perf_counter() - t)
    return {name: {str(n): {"list": {**summary(lists[name, n]), "bytes": size[name, n]},
                            "allocate": summary(calls[name, n])}
                   for n in sizes.scale_slots} for name in starters}


# -- 6. memory ---------------------------------------------------------------------------

PROBES = ("/metrics", "/healthz", "/readyz")


def scrape(proc: Proc, path: str) -> None:
    """One GET as Prometheus or the kubelet's probe sends it: a connection of its own."""
    connection = http.client.HTTPConnection("127.0.0.1", proc.metrics_port, timeout=WAIT)
    try:
        connection.request("GET", path)
        connection.getresponse().read()
    finally:
        connection.close()


def memory_soak(kubelet: KubeletStandIn, proc: Proc, sizes: Sizes) -> dict[str, Any]:
    """RSS after start; as deployed, after Allocates and as many scrapes and probes; then
    halfway and after N Allocates and M kubelet restarts.

    The Allocates come the way the kubelet sends them: one at a time on the stand-in's
    own channel. (RSS after a 32-client stress is reported apart, as ``stress``.)
    """
    deadline = time.monotonic() + sizes.mem_budget
    out: dict[str, Any] = {"start": proc.status()}

    def allocates(count: int, scrapes: bool = False) -> int:
        allocate = kubelet.stub(proc.resource).Allocate
        for done in range(count):
            if time.monotonic() > deadline:
                return done
            allocate(ALLOCATE, timeout=RPC_TIMEOUT)
            if scrapes and proc.metrics_port:
                scrape(proc, PROBES[done % len(PROBES)])
        return count

    def restarts(count: int) -> int:
        for done in range(count):
            if time.monotonic() > deadline:
                return done
            registrations = len(kubelet.registrations) + 1
            kubelet.restart()
            kubelet.wait_registered(registrations, WAIT)
            kubelet.wait_devices(proc.resource, bool, WAIT)
        return count

    out["deployed_calls"] = allocates(sizes.deployed_calls, scrapes=True)
    out["scraped"] = bool(proc.metrics_port)
    out["deployed"] = proc.status()
    half = sizes.mem_allocates // 2
    out["allocates"] = out["deployed_calls"] + allocates(half - sizes.deployed_calls)
    out["allocates_half"] = proc.status()
    out["allocates"] += allocates(sizes.mem_allocates - half)
    out["allocates_done"] = proc.status()
    half = sizes.mem_restarts // 2
    out["restarts"] = restarts(half)
    out["restarts_half"] = proc.status()
    out["restarts"] += restarts(sizes.mem_restarts - half)
    time.sleep(0.3)
    out["restarts_done"] = proc.status()
    return out


# -- 7. idle -----------------------------------------------------------------------------

def measure_idle(starters: dict[str, Starter], sizes: Sizes) -> dict[str, dict[str, Any]]:
    """CPU and wake-ups of each process, registered, with the kubelet's one ListAndWatch
    stream open and nothing happening, all measured over the same seconds."""
    with ExitStack() as stack:
        procs = {}
        for name, start in starters.items():
            node = stack.enter_context(fake_node())
            procs[name], _ = stack.enter_context(running(node, start, sizes.slots))
        for proc in procs.values():
            settle(proc, 2.0)  # start-up's own work done (the stream is already open)
        before = {name: _per_thread(proc) for name, proc in procs.items()}
        started = time.perf_counter()
        time.sleep(sizes.idle_seconds)
        took = time.perf_counter() - started
        out = {}
        for name, proc in procs.items():
            after = _per_thread(proc)
            busy = {tid: (ns - before[name].get(tid, (0, 0, ""))[0],
                          count - before[name].get(tid, (0, 0, ""))[1], comm)
                    for tid, (ns, count, comm) in after.items()}
            # Threads Python starts keep the process's name; gRPC core names its own.
            python = after[proc.pid][2]
            out[name] = {
                "cpu_ms_per_s": round(sum(b[0] for b in busy.values()) / 1e6 / took, 3),
                "python_cpu_ms_per_s": round(
                    sum(b[0] for b in busy.values() if b[2] == python) / 1e6 / took, 3),
                "wakeups_per_s": round(sum(b[1] for b in busy.values()) / took, 2),
                "threads": len(after), "seconds": round(took, 1),
                # Where it went, busiest first: gRPC names its threads, Python's share
                # the process name.
                "by_thread": [f"{comm} {ns / 1e6 / took:.3f} ms/s {count / took:.1f}/s"
                              for ns, count, comm in sorted(busy.values(), reverse=True)
                              if count]}
        return out


def _per_thread(proc: Proc) -> dict[int, tuple[int, int, str]]:
    """Per thread: (ns on a CPU, times scheduled, its name)."""
    out = {}
    for tid in proc.tasks():
        ns, count = _schedstat(proc.pid, tid)
        try:
            comm = Path(f"/proc/{proc.pid}/task/{tid}/comm").read_text().strip()
        except OSError:
            continue
        out[tid] = (ns, count, comm)
    return out


# -- putting it together -----------------------------------------------------------------

def measure_all(sizes: Sizes, flags: Sequence[str], progress: Callable[[str], None]
                ) -> tuple[dict[str, Any], dict[str, Any]]:
    """Every figure for the plugin (run with ``flags``) and for the floor; where a figure
    is compared with the floor, the two take turns so that load falls on both alike."""
    plugin: dict[str, Any] = {"flags": list(flags)}
    floor: dict[str, Any] = {}
    both = {"plugin": plugin, "floor": floor}
    ours = plugin_starter(flags)
    starters: dict[str, Starter] = {"plugin": ours, "floor": floor_starter}
    progress("start -> registered")
    for name, figure in measure_start(starters, sizes.slots, sizes.starts).items():
        both[name]["start"] = figure
    progress("re-registration and health")
    watchers: dict[str, Starter] = {"plugin": ours, "floor": floor_watch_starter}
    for name, watcher in watchers.items():
        with fake_node() as node, running(node, watcher, sizes.slots) as (proc, kubelet):
            both[name]["reregister"] = measure_reregistration(kubelet, proc, sizes.rereg)
            both[name]["health"] = measure_health(node, kubelet, proc, sizes.health,
                                                  sizes.streams)
    progress("Allocate, taking turns with the floor")
    with ExitStack() as stack:
        procs: dict[str, Proc] = {}
        for name, starter in starters.items():
            node = stack.enter_context(fake_node())
            procs[name], _ = stack.enter_context(running(node, starter, sizes.slots))
        for proc in procs.values():
            settle(proc)
        before = {name: proc.status() for name, proc in procs.items()}
        for name, figure in allocate_turns(procs, sizes).items():
            both[name]["allocate"] = figure
            both[name]["stress"] = {"start": before[name], "after": procs[name].status()}
    progress("scale")
    for name, figure in measure_scale(starters, sizes).items():
        both[name]["scale"] = figure
    progress("idle, one ListAndWatch open")
    for name, figure in measure_idle(starters, sizes).items():
        both[name]["idle"] = figure
    progress("memory soak (Allocates and scrapes, Allocates, then kubelet restarts)")
    with fake_node() as node, running(node, ours, sizes.slots) as (proc, kubelet):
        settle(proc)
        plugin["memory"] = memory_soak(kubelet, proc, sizes)
    return plugin, floor


@dataclass
class Row:
    figure: str
    median: float | None
    p99: float | None
    unit: str
    floor_median: float | None = None
    floor_p99: float | None = None
    target: str = ""
    ok: bool | None = None
    key: str = ""
    ratio: float | None = None  # to the floor, when not simply median / floor median
    extra: dict[str, Any] = field(default_factory=dict)


def _ms(stats: dict[str, Any]) -> tuple[float, float]:
    return stats["median_ms"], stats["p99_ms"]


def _allocate_rows(rows: list[Row], alloc: dict[str, Any], falloc: dict[str, Any]) -> int:
    """Allocate against the floor: the ratios are medians of per-round ratios."""
    seq, fseq = alloc["sequential"], falloc["sequential"]
    conc, fconc = alloc["concurrent"], falloc["concurrent"]
    vs = alloc["vs_floor"]

    def against_floor(key: str, figure: str, *, ours: float, base: float, unit: str,
                      ratio: dict[str, float], at_most: float | None = None,
                      at_least: float | None = None, p99: float | None = None,
                      floor_p99: float | None = None) -> None:
        ok, target = None, ""
        if at_most is not None:
            ok, target = ratio["median"] <= at_most, f"<= {at_most:g}x floor"
        elif at_least is not None:
            ok, target = ratio["median"] >= at_least, f">= {at_least:g}x floor"
        rows.append(Row(figure, ours, p99, unit, base, floor_p99, target, ok, key,
                        ratio=ratio["median"], extra={"vs_floor": ratio}))

    against_floor("allocate_sequential", "4. Allocate, 1 client sequential (p50)",
                  ours=seq["median_ms"], base=fseq["median_ms"], unit="ms",
                  ratio=vs["sequential_p50"], at_most=1.05, p99=seq["p99_ms"],
                  floor_p99=fseq["p99_ms"])
    against_floor("allocate_cpu", "   server CPU per Allocate (sequential)",
                  ours=seq["server_cpu_us"], base=fseq["server_cpu_us"], unit="us",
                  ratio=vs["sequential_cpu"], at_most=1.05)
    rows.append(Row("   throughput, sequential", seq["per_second"], None, "/s",
                    fseq["per_second"], key="throughput_sequential"))
    clients = conc["clients"]
    against_floor("throughput_concurrent", f"   throughput, {clients} concurrent clients",
                  ours=conc["per_second"], base=fconc["per_second"], unit="/s",
                  ratio=vs["concurrent_throughput"], at_least=0.95)
    # No target for latency under 32 clients: it is clients / throughput (Little's law).
    rows.append(Row(f"   Allocate, {clients} concurrent clients (p50)", conc["median_ms"],
                    conc["p99_ms"], "ms", fconc["median_ms"], fconc["p99_ms"],
                    key="allocate_concurrent"))
    against_floor("allocate_concurrent_cpu", f"   server CPU per Allocate ({clients} clients)",
                  ours=conc["server_cpu_us"], base=fconc["server_cpu_us"], unit="us",
                  ratio=vs["concurrent_cpu"])
    return int(clients)


def _timing(rows: list[Row], key: str, figure: str, ours: dict[str, Any],
            base: dict[str, Any] | None, *, limit: float | None = None,
            on: str = "p99") -> None:
    """A latency row: median and p99 against the floor's, with a target on one of them."""
    median, p99 = _ms(ours)
    fmed, fp99 = _ms(base) if base else (None, None)
    ok = None
    target = ""
    if limit is not None:
        ok = (median if on == "median" else p99) <= limit
        target = f"{on} <= {limit:g} ms"
    rows.append(Row(figure, median, p99, "ms", fmed, fp99, target, ok, key))


def _event_rows(rows: list[Row], plugin: dict[str, Any], floor: dict[str, Any]) -> None:
    """1-3: re-registration, start-up and health changes."""
    rr, frr = plugin["reregister"], floor["reregister"]
    _timing(rows, "reregister",
            "1. kubelet.sock appears -> Register answered (incl. dial-back)",
            rr["answered"], frr["answered"], limit=25, on="median")
    _timing(rows, "reregister_received", "   ... -> Register received", rr["received"],
            frr["received"])
    _timing(rows, "reregister_listed", "   ... -> devices listed to the kubelet again",
            rr["listed"], frr["listed"])
    _timing(rows, "start", "2. process start -> registered", plugin["start"], floor["start"],
            limit=1000)
    h, fh = plugin["health"], floor["health"]
    n = h["streams"]
    _timing(rows, "health_unhealthy", f"3. device removed -> Unhealthy on all {n} streams",
            h["unhealthy"], fh["unhealthy"], limit=25)
    _timing(rows, "health_healthy", f"   device restored -> Healthy on all {n} streams",
            h["healthy"], fh["healthy"], limit=25)


def _scale_rows(rows: list[Row], plugin: dict[str, Any], floor: dict[str, Any],
                sizes: Sizes) -> None:
    """5: the first list and Allocate as the slot count grows (Allocate must not)."""
    scale, fscale = plugin["scale"], floor["scale"]
    smallest, largest = str(min(sizes.scale_slots)), str(max(sizes.scale_slots))
    for slots in (str(s) for s in sizes.scale_slots):
        ours, base = scale[slots], fscale[slots]
        _timing(rows, f"scale_{slots}_list",
                f"{'5.' if slots == smallest else '  '} {int(slots):,} slots: ListAndWatch "
                f"first list ({ours['list']['bytes']:,} B)", ours["list"], base["list"])
        ok = None
        target = ""
        if slots == largest:
            # Allocate must not grow with slots: within 25% (or 0.1 ms) of the smallest.
            low = scale[smallest]["allocate"]["median_ms"]
            ok = ours["allocate"]["median_ms"] <= max(low * 1.25, low + 0.1)
            target = f"median <= {smallest}-slot median +25%"
        median, p99 = _ms(ours["allocate"])
        fmed, fp99 = _ms(base["allocate"])
        rows.append(Row(f"   {int(slots):,} slots: Allocate", median, p99, "ms", fmed, fp99,
                        target, ok, f"scale_{slots}_allocate"))


def _memory_rows(rows: list[Row], plugin: dict[str, Any], floor: dict[str, Any],
                 clients: int) -> None:
    """6: RSS after registration, as deployed, after the loops, and its growth."""
    mem, stress, fstress = plugin["memory"], plugin["stress"], floor["stress"]
    fstart = fstress["start"]["VmRSS"] / 1024
    scraped = f" and {mem['deployed_calls']:,} scrapes" if mem["scraped"] else ""
    for key, label, floor_value, limit in (
            ("start", "6. RSS after registration", fstart, RSS_MIB),
            ("deployed", f"   RSS after {mem['deployed_calls']:,} Allocates{scraped}", None,
             RSS_MIB),
            ("allocates_done", f"   RSS after {mem['allocates']:,} Allocates (kubelet's client)",
             None, RSS_MIB),
            # A thousand kubelet restarts leave ~1 MiB of heap behind once (flat after).
            ("restarts_done", f"   RSS after {mem['restarts']:,} kubelet restarts", None,
             RSS_STORM_MIB)):
        value = mem[key]["VmRSS"] / 1024
        rows.append(Row(label, round(value, 1), None, "MiB",
                        round(floor_value, 1) if floor_value else None,
                        target=f"<= {limit} MiB", ok=value <= limit, key=f"rss_{key}",
                        extra={"rss_anon_mib": round(mem[key]["RssAnon"] / 1024, 1),
                               "rss_file_mib": round(mem[key]["RssFile"] / 1024, 1),
                               "threads": mem[key]["Threads"]}))
    # Flat: the second half of each loop adds at most 1 MiB (no leak per call).
    grow_alloc = (mem["allocates_done"]["VmRSS"] - mem["allocates_half"]["VmRSS"]) / 1024
    grow_restart = (mem["restarts_done"]["VmRSS"] - mem["restarts_half"]["VmRSS"]) / 1024
    growth = max(grow_alloc, grow_restart)
    rows.append(Row("   RSS growth over each loop's 2nd half", round(growth, 2), None,
                    "MiB", target="<= 1 MiB (flat)", ok=growth <= 1, key="rss_growth",
                    extra={"allocates": round(grow_alloc, 2),
                           "restarts": round(grow_restart, 2)}))
    after = stress["after"]["VmRSS"] / 1024
    rows.append(Row(f"   RSS after the Allocate stress ({clients} clients; no target)",
                    round(after, 1), None, "MiB", round(fstress["after"]["VmRSS"] / 1024, 1),
                    key="rss_after_stress",
                    extra={"threads": stress["after"]["Threads"]}))


def _idle_rows(rows: list[Row], plugin: dict[str, Any], floor: dict[str, Any]) -> None:
    """7: idle CPU, the whole process and the plugin's own share."""
    idle, fidle = plugin["idle"], floor["idle"]
    rows.append(Row("7. idle CPU, one ListAndWatch open", idle["cpu_ms_per_s"], None, "ms/s",
                    fidle["cpu_ms_per_s"], key="idle_cpu",
                    extra={"wakeups_per_s": idle["wakeups_per_s"],
                           "floor_wakeups_per_s": fidle["wakeups_per_s"]}))
    rows.append(Row("   of which Python's threads", idle["python_cpu_ms_per_s"], None, "ms/s",
                    fidle["python_cpu_ms_per_s"], key="idle_python_cpu"))
    # gRPC core's threads (event engine, timer, lifeguard) wake a few times a second in
    # any grpcio server and vary from process to process by more than 0.2 ms/s, so they
    # are left out on both sides; the floor's Python threads are gRPC's completion-queue
    # poll (every 200 ms), which the plugin has too. What remains is the plugin's own.
    beyond = round(idle["python_cpu_ms_per_s"] - fidle["python_cpu_ms_per_s"], 3)
    rows.append(Row("   the plugin's own (its Python threads beyond the floor's)", beyond,
                    None, "ms/s", target=f"<= {IDLE_MS_PER_S} ms/s",
                    ok=beyond <= IDLE_MS_PER_S, key="idle_cpu_beyond_floor"))


def build_rows(plugin: dict[str, Any], floor: dict[str, Any], sizes: Sizes) -> list[Row]:
    """Every figure of the table, in its order, each beside the floor's."""
    rows: list[Row] = []
    _event_rows(rows, plugin, floor)
    clients = _allocate_rows(rows, plugin["allocate"], floor["allocate"])
    _scale_rows(rows, plugin, floor, sizes)
    _memory_rows(rows, plugin, floor, clients)
    _idle_rows(rows, plugin, floor)
    return rows


def _fmt(value: float | None, unit: str) -> str:
    if value is None:
        return "-"
    if unit in ("/s",):
        return f"{value:,.0f}{unit}"
    if unit == "us":
        return f"{value:.0f} us"
    if unit == "MiB":
        return f"{value:.1f} MiB"
    if unit == "ms/s":
        return f"{value:.2f} ms/s"
    return f"{value:.3f}" if value < 10 else f"{value:.1f}"


def table(rows: list[Row]) -> str:
    head = ("figure (ms unless shown)", "median", "p99", "floor med", "floor p99", "x floor",
            "target", "result")
    lines = []
    for row in rows:
        ratio = ""
        if row.ratio is not None:
            ratio = f"{row.ratio:.3f}x"
        elif row.median is not None and row.floor_median:
            ratio = f"{row.median / row.floor_median:.2f}x"
        result = "" if row.ok is None else ("PASS" if row.ok else "FAIL")
        lines.append((row.figure, _fmt(row.median, row.unit), _fmt(row.p99, row.unit),
                      _fmt(row.floor_median, row.unit), _fmt(row.floor_p99, row.unit), ratio,
                      row.target, result))
    widths = [max(len(str(r[i])) for r in [head, *lines]) for i in range(len(head))]
    out = []
    for i, line in enumerate([head, *lines]):
        out.append("  ".join(str(c).ljust(w) if j in (0, 6) else str(c).rjust(w)
                             for j, (c, w) in enumerate(zip(line, widths, strict=True))).rstrip())
        if i == 0:
            out.append("  ".join("-" * w for w in widths))
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small smoke run (seconds)")
    parser.add_argument("--out", type=Path, default=RESULTS, help=f"JSON path ({RESULTS})")
    parser.add_argument("--serve-flags", metavar="FLAGS", type=str.split,
                        help="run serve with these flags instead of the DaemonSet's "
                             "(e.g. '--metrics-port=0' for a plugin without metrics)")
    args = parser.parse_args(argv)
    if os.geteuid() != 0:
        print("bench: needs root (the fake node's FUSE device is made with mknod)",
              file=sys.stderr)
        return 2
    os.environ.setdefault("GRPC_VERBOSITY", "ERROR")
    sizes = QUICK if args.quick else FULL
    began = time.monotonic()
    load_before = os.getloadavg()

    def progress(what: str) -> None:
        print(f"[{time.monotonic() - began:6.1f}s] {what}", file=sys.stderr, flush=True)

    try:
        flags = deployed_flags() if args.serve_flags is None else args.serve_flags
    except (OSError, ValueError, yaml.YAMLError) as err:
        print(f"bench: cannot read the DaemonSet's flags: {err}", file=sys.stderr)
        return 2
    progress(f"serve {' '.join(flags)} (the plugin's flags)")
    plugin, floor = measure_all(sizes, flags, progress)
    rows = build_rows(plugin, floor, sizes)
    targets = [r for r in rows if r.ok is not None]
    result = {
        "mode": "quick" if args.quick else "full",
        "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "seconds": round(time.monotonic() - began, 1),
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(),
                    "grpcio": grpc.__version__, "kernel": platform.release(),
                    "loadavg_before": load_before, "loadavg_after": os.getloadavg()},
        "sizes": {k: getattr(sizes, k) for k in sizes.__dataclass_fields__},
        "serve_flags": flags,
        "figures": {r.key: {"figure": r.figure.strip(" .").strip(), "median": r.median,
                            "p99": r.p99, "unit": r.unit, "floor_median": r.floor_median,
                            "floor_p99": r.floor_p99, "target": r.target or None,
                            "pass": r.ok, **r.extra} for r in rows},
        "passed": sum(1 for r in targets if r.ok),
        "failed": [r.key for r in targets if not r.ok],
        "raw": {"plugin": plugin, "floor": floor},
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(table(rows))
    # The run itself keeps about 2 CPUs busy, so only the load before it says whether
    # something else was competing.
    busy = load_before[0]
    if busy > (os.cpu_count() or 1) * 0.5:
        print(f"\nwarning: the machine was busy before the run (1-minute load {busy:.1f} on "
              f"{os.cpu_count()} CPUs): timings include waiting for a CPU; re-run when quiet")
    print(f"\n{result['passed']}/{len(targets)} targets met in {result['seconds']} s "
          f"({result['mode']} run); JSON written to {args.out}")
    return 0 if not result["failed"] else EXIT_TARGET_MISSED
