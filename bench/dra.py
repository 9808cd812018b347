"""The DRA driver beside the device plugin: what the kubelet and a node feel (issue 27).

Run from the repository root, as root (the fake node's FUSE device is made with mknod)::

    .venv/bin/python -m bench.dra            # about a minute
    .venv/bin/python -m bench.dra --quick    # a few seconds

The real ``fuse-device-plugin dra`` process runs with the flags its DaemonSet gives it
(read from ``manifests/dra/driver-daemonset.yaml``, the probe port moved to a free one)
against a fake node in a temp dir and a fake API server over real HTTP on 127.0.0.1
(``tests/lib/apiserver.py``: claims, the node, ResourceSlices). The kubelet's side is
this process, over the driver's real unix sockets. Beside it, the real ``serve`` with its
DaemonSet's flags and the kubelet stand-in, measured the same way.

Figures (no targets: the device plugin's are in bench/README.md): process start to
answering (GetInfo; Register for ``serve``); NodePrepareResources of one claim (a GET
from the API server, a CDI spec written and synced) and NodeUnprepareResources, in both
modes, against ``serve``'s Allocate; a repeated prepare of claims already prepared,
answered from their records, warm and after a restart of the driver; RSS after start and
after the calls; idle CPU and wake-ups per second of both, side by side, and the API
requests the driver made while idle (per minute; its slice watch counts once). Prints a
table, writes JSON (``bench/results/dra.json`` or ``--out``).
"""

from __future__ import annotations

import argparse
import os
import platform
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import yaml

from bench import deployed
from bench.run import (
    ALLOCATE,
    Proc,
    _per_thread,
    channel_to,
    deployed_flags,
    fake_node,
    free_port,
    plugin_command,
    plugin_starter,
    running,
    settle,
    summary,
    write_report,
)
from fuse_plugin.api import api_pb2_grpc, dra_pb2_grpc, pluginregistration_pb2_grpc
from fuse_plugin.api import dra_pb2 as dra
from fuse_plugin.api import pluginregistration_pb2 as reg
from fuse_plugin.broker import protocol
from fuse_plugin.dra.settings import DRIVER_NAME
from tests.lib import apiserver
from tests.lib.apiserver import FakeApiServer, claim, opaque
from tests.lib.node import FakeNode

HERE = Path(__file__).resolve().parent
DAEMONSET = HERE.parent / "manifests" / "dra" / "driver-daemonset.yaml"
RESULTS = HERE / "results" / "dra.json"
NODE = "bench-node"
RPC_TIMEOUT = 10.0
WAIT = 15.0
KIB_PER_MIB = 1024


@dataclass(frozen=True)
class Sizes:
    calls: int = 1000  # Prepare+Unprepare pairs per mode, and as many Allocates
    starts: int = 5
    idle_seconds: float = 20.0


FULL = Sizes()
QUICK = Sizes(calls=50, starts=1, idle_seconds=2.0)


def driver_flags() -> list[str]:
    """``dra``'s flags as its DaemonSet passes them."""
    return deployed.flags(DAEMONSET, "dra")


def start_driver(node: FakeNode, api: FakeApiServer, flags: list[str]) -> Proc:
    root = node.root
    kubeconfig = api.kubeconfig(root / "kubeconfig")
    argv = [*plugin_command(), "dra", "--node-name", NODE,
            "--plugins-dir", str(root / "plugins"), "--registry-dir", str(root / "registry"),
            "--cdi-dir", str(root / "cdi"), "--fuse-device", str(node.device),
            "--broker-dir", str(root / "broker")]
    for flag in flags:
        argv.append(f"--probe-port={free_port()}" if flag.startswith("--probe-port") else flag)
    log = root / f"dra-{time.monotonic_ns()}.log"
    with log.open("wb") as out:
        started = time.perf_counter()
        popen = subprocess.Popen(
            argv, stdout=out, stderr=out,
            env={**os.environ, "KUBECONFIG": str(kubeconfig), "GRPC_VERBOSITY": "ERROR"})
    return Proc(popen, log, root / "registry" / f"{DRIVER_NAME}-reg.sock", DRIVER_NAME,
                started)


def get_info(proc: Proc) -> reg.PluginInfo | None:
    """GetInfo on the registration socket, or None while it is not answering yet."""
    if not proc.socket.exists():
        return None
    with grpc.insecure_channel(f"unix://{proc.socket}") as channel:
        stub = pluginregistration_pb2_grpc.RegistrationStub(channel)
        try:
            info: reg.PluginInfo = stub.GetInfo(reg.InfoRequest(), timeout=RPC_TIMEOUT)
        except grpc.RpcError:
            return None
    return info


@contextmanager
def driver_running(node: FakeNode, api: FakeApiServer, flags: list[str]
                   ) -> Iterator[tuple[Proc, reg.PluginInfo, float]]:
    """The driver, answering GetInfo; with the seconds from Popen to the answer."""
    proc = start_driver(node, api, flags)
    try:
        deadline = time.monotonic() + WAIT
        while (info := get_info(proc)) is None:
            if proc.popen.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"dra did not answer: {proc.log.read_text()[-2000:]}")
            time.sleep(0.002)
        took = time.perf_counter() - proc.started
        with grpc.insecure_channel(f"unix://{proc.socket}") as channel:
            pluginregistration_pb2_grpc.RegistrationStub(channel).NotifyRegistrationStatus(
                reg.RegistrationStatus(plugin_registered=True), timeout=RPC_TIMEOUT)
        yield proc, info, took
    finally:
        proc.stop()


def prepare_pairs(api: FakeApiServer, endpoint: str, calls: int, mode: str
                  ) -> tuple[list[float], list[float]]:
    """``calls`` new claims, each prepared then unprepared, as the kubelet calls them."""
    config = [opaque(DRIVER_NAME, {"mode": mode})] if mode != "direct" else []
    prepares, unprepares = [], []
    with grpc.insecure_channel(f"unix://{endpoint}") as channel:
        stub = dra_pb2_grpc.DRAPluginStub(channel)
        for index in range(calls):
            uid = str(uuid.uuid4())
            name = f"claim-{mode}-{index}"
            api.add_claim(claim("bench", name, uid, DRIVER_NAME, config=config))
            one = [dra.Claim(namespace="bench", name=name, uid=uid)]
            started = time.perf_counter()
            answer = stub.NodePrepareResources(dra.NodePrepareResourcesRequest(claims=one),
                                               timeout=RPC_TIMEOUT)
            prepares.append(time.perf_counter() - started)
            if answer.claims[uid].error:
                raise RuntimeError(f"prepare failed: {answer.claims[uid].error}")
            started = time.perf_counter()
            stub.NodeUnprepareResources(dra.NodeUnprepareResourcesRequest(claims=one),
                                        timeout=RPC_TIMEOUT)
            unprepares.append(time.perf_counter() - started)
    return prepares, unprepares


def held_claims(api: FakeApiServer, endpoint: str, calls: int) -> list[dra.Claim]:
    """``calls`` claims prepared and kept, as a node's running pods hold theirs."""
    held = []
    with grpc.insecure_channel(f"unix://{endpoint}") as channel:
        stub = dra_pb2_grpc.DRAPluginStub(channel)
        for index in range(calls):
            uid = str(uuid.uuid4())
            name = f"held-{index}"
            api.add_claim(claim("bench", name, uid, DRIVER_NAME))
            one = dra.Claim(namespace="bench", name=name, uid=uid)
            answer = stub.NodePrepareResources(
                dra.NodePrepareResourcesRequest(claims=[one]), timeout=RPC_TIMEOUT)
            if answer.claims[uid].error:
                raise RuntimeError(f"prepare failed: {answer.claims[uid].error}")
            held.append(one)
    return held


def prepare_again(endpoint: str, held: list[dra.Claim]) -> list[float]:
    """Each held claim prepared once more (the kubelet's retry), timed."""
    took = []
    with grpc.insecure_channel(f"unix://{endpoint}") as channel:
        stub = dra_pb2_grpc.DRAPluginStub(channel)
        for one in held:
            started = time.perf_counter()
            answer = stub.NodePrepareResources(
                dra.NodePrepareResourcesRequest(claims=[one]), timeout=RPC_TIMEOUT)
            took.append(time.perf_counter() - started)
            if answer.claims[one.uid].error:
                raise RuntimeError(f"prepare again failed: {answer.claims[one.uid].error}")
    return took


def allocates(proc: Proc, calls: int) -> list[float]:
    took = []
    with channel_to(proc) as channel:
        stub = api_pb2_grpc.DevicePluginStub(channel)
        for _ in range(calls):
            started = time.perf_counter()
            stub.Allocate(ALLOCATE, timeout=RPC_TIMEOUT)
            took.append(time.perf_counter() - started)
    return took


def rss_mib(proc: Proc) -> float:
    return round(proc.status()["VmRSS"] / KIB_PER_MIB, 1)


def idle(procs: dict[str, Proc], seconds: float) -> dict[str, dict[str, float]]:
    """CPU ms/s and wake-ups/s of each process over the same quiet seconds."""
    before = {name: _per_thread(proc) for name, proc in procs.items()}
    started = time.perf_counter()
    time.sleep(seconds)
    took = time.perf_counter() - started
    out = {}
    for name, proc in procs.items():
        after = _per_thread(proc)
        ns = sum(v[0] - before[name].get(t, (0, 0, ""))[0] for t, v in after.items())
        count = sum(v[1] - before[name].get(t, (0, 0, ""))[1] for t, v in after.items())
        out[name] = {"cpu_ms_per_s": round(ns / 1e6 / took, 3),
                     "wakeups_per_s": round(count / took, 2), "threads": len(after)}
    return out


def measure(sizes: Sizes, flags: list[str], serve_flags: list[str]) -> dict[str, Any]:
    figures: dict[str, Any] = {}
    with ExitStack() as stack:
        api = stack.enter_context(apiserver.running())
        api.add_node(NODE)
        starts = []
        for _ in range(sizes.starts):
            node = stack.enter_context(fake_node())
            with driver_running(node, api, flags) as (_, _, took):
                starts.append(took)
        figures["dra_start"] = summary(starts)
        node = stack.enter_context(fake_node())
        proc, info, _ = stack.enter_context(driver_running(node, api, flags))
        settle(proc, 1.0)
        figures["dra_rss_start_mib"] = rss_mib(proc)
        (node.root / "broker").mkdir(exist_ok=True)
        (node.root / "broker" / protocol.SHIM_NAME).write_bytes(b"#!/bin/true\n")
        for mode in ("direct", "broker"):
            prepared, unprepared = prepare_pairs(api, info.endpoint, sizes.calls, mode)
            figures[f"prepare_{mode}"] = summary(prepared)
            figures[f"unprepare_{mode}"] = summary(unprepared)
        held = held_claims(api, info.endpoint, sizes.calls)
        figures["prepare_recorded"] = summary(prepare_again(info.endpoint, held))
        figures["dra_rss_after_calls_mib"] = rss_mib(proc)
        plugin_node = stack.enter_context(fake_node())
        plugin, _ = stack.enter_context(
            running(plugin_node, plugin_starter(serve_flags), 1000))
        settle(plugin, 1.0)
        figures["serve_start_s"] = round(time.perf_counter() - plugin.started, 3)
        figures["serve_rss_start_mib"] = rss_mib(plugin)
        figures["serve_allocate"] = summary(allocates(plugin, sizes.calls))
        figures["serve_rss_after_calls_mib"] = rss_mib(plugin)
        settle(proc, 1.0)
        asked = len(api.requests)
        quiet = idle({"dra": proc, "serve": plugin}, sizes.idle_seconds)
        figures["dra_idle"] = quiet["dra"]
        figures["serve_idle"] = quiet["serve"]
        figures["dra_api_requests_per_min_idle"] = round(
            (len(api.requests) - asked) * 60 / sizes.idle_seconds, 2)
        proc.stop()
        with driver_running(node, api, flags) as (_, again, _):
            figures["prepare_after_restart"] = summary(prepare_again(again.endpoint, held))
    return figures


def table(figures: dict[str, Any]) -> str:
    def ms(key: str) -> str:
        f = figures[key]
        return f"{f['median_ms']:8.3f} {f['p99_ms']:8.3f}"

    lines = [f"{'figure':44} {'median':>8} {'p99':>8}  (ms)",
             f"{'dra: start to GetInfo answered':44} {ms('dra_start')}"]
    for mode in ("direct", "broker"):
        lines.append(f"{f'dra: NodePrepareResources, {mode}':44} {ms(f'prepare_{mode}')}")
        lines.append(f"{f'dra: NodeUnprepareResources, {mode}':44} {ms(f'unprepare_{mode}')}")
    lines.append(f"{'dra: prepare again, from the record':44} {ms('prepare_recorded')}")
    lines.append(f"{'dra: prepare again after a restart':44} {ms('prepare_after_restart')}")
    lines.append(f"{'serve: Allocate':44} {ms('serve_allocate')}")
    lines.append("")
    lines.append(f"{'RSS (MiB)':44} {'start':>8} {'after':>8}")
    for who in ("dra", "serve"):
        lines.append(f"{who:44} {figures[f'{who}_rss_start_mib']:8.1f} "
                     f"{figures[f'{who}_rss_after_calls_mib']:8.1f}")
    lines.append("")
    lines.append(f"{'idle':44} {'CPU ms/s':>8} {'wakes/s':>8}")
    for who in ("dra", "serve"):
        q = figures[f"{who}_idle"]
        lines.append(f"{who:44} {q['cpu_ms_per_s']:8.3f} {q['wakeups_per_s']:8.2f}")
    lines.append(f"{'dra: API requests per minute, idle':44} "
                 f"{figures['dra_api_requests_per_min_idle']:8.2f}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.dra",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small smoke run (seconds)")
    parser.add_argument("--out", type=Path, default=RESULTS, help=f"JSON path ({RESULTS})")
    args = parser.parse_args(argv)
    if os.geteuid() != 0:
        print("bench.dra: needs root (the fake node's FUSE device is made with mknod)",
              file=sys.stderr)
        return 2
    os.environ.setdefault("GRPC_VERBOSITY", "ERROR")
    sizes = QUICK if args.quick else FULL
    try:
        flags, serve_flags = driver_flags(), deployed_flags()
    except (OSError, ValueError, yaml.YAMLError) as err:
        print(f"bench.dra: cannot read the DaemonSets' flags: {err}", file=sys.stderr)
        return 2
    began = time.monotonic()
    load_before = os.getloadavg()
    figures = measure(sizes, flags, serve_flags)
    result = {"mode": "quick" if args.quick else "full",
              "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
              "seconds": round(time.monotonic() - began, 1),
              "machine": {"cpus": os.cpu_count(), "python": platform.python_version(),
                          "grpcio": grpc.__version__, "kernel": platform.release(),
                          "loadavg_before": load_before, "loadavg_after": os.getloadavg()},
              "sizes": {k: getattr(sizes, k) for k in sizes.__dataclass_fields__},
              "dra_flags": flags, "serve_flags": serve_flags, "figures": figures}
    write_report(args.out, result, table(figures))
    return 0


if __name__ == "__main__":
    sys.exit(main())
