"""Broker mode against today's mode, in real runc containers (issue 14).

Run from the repository root, as root, with runc, /dev/fuse, squashfuse, sshfs and sshd::

    .venv/bin/python -m bench.broker            # full run, about a minute
    .venv/bin/python -m bench.broker --quick    # smoke run

Two containers get the real plugin's Allocate answers. *direct* is today's recommended
pod: CAP_SYS_ADMIN and the generated ``generic`` seccomp profile, so programs mount
themselves. *broker* is broker mode: no added capability and the runtime-default
seccomp, so programs mount through the shim and the real broker. In each one,
``bench/broker_probe.py`` times:

- mount latency: ``squashfuse IMAGE DIR`` until it returns (it daemonizes once mounted),
  and then the unmount (``umount`` direct, ``fusermount3 -u`` through the broker);
- read throughput: a file in an uncompressed squashfs image, on a fresh mount each round
  (nothing comes from the page cache);
- sshfs throughput against a private sshd on 127.0.0.1: writes (fsync'd) and reads of
  files created on the server.

Targets (the issue's): broker mount latency within 5 ms of direct (median), throughput
within 10% (median). Prints a table and writes JSON to ``bench/results/broker.json``
(or ``--out``); exits 3 when a target is missed.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fuse_plugin.api import api_pb2 as api
from fuse_plugin.sim import oci
from tests.containers import broker as broker_rig
from tests.containers import plugin, profiles, workloads
from tests.containers.servers import Sshd

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results" / "broker.json"
PROBE = "/bench/broker_probe.py"
IMAGE = "/srv/image.sqfs"
BIG = "big.bin"
MOUNTPOINT = "/mnt/bench"
EXIT_TARGET_MISSED = 3
LATENCY_TARGET_MS = 5.0
MOUNT_BATCH = 5
UNMOUNT = {"direct": ["umount"], "broker": ["fusermount3", "-u"]}
KEYS = ("mount_ms", "unmount_ms", "squashfs_read_mib_s", "sshfs_write_mib_s",
        "sshfs_read_mib_s")
THROUGHPUT_TARGET = 0.9


@dataclass(frozen=True)
class Sizes:
    mount_rounds: int = 40  # a multiple of MOUNT_BATCH
    read_rounds: int = 5
    read_mib: int = 256
    ssh_rounds: int = 5
    ssh_mib: int = 64


FULL = Sizes()
QUICK = Sizes(mount_rounds=10, read_rounds=2, read_mib=16, ssh_rounds=2, ssh_mib=8)


def blockers() -> list[str]:
    found = oci.runc_blockers()
    found += [f"{tool} is not installed" for tool in ("squashfuse", "mksquashfs", "sshfs")
              if shutil.which(tool) is None]
    return found


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
    image.read_bytes()  # in the host's page cache before either mode reads it
    return image


def probe(container: oci.RuncContainer, *args: str, timeout: float = 600) -> dict[str, Any]:
    result = container.exec("python3", PROBE, *args, timeout=timeout).check()
    answer: dict[str, Any] = json.loads(result.stdout)
    return answer


def measure(containers: dict[str, oci.RuncContainer], sshd: Sshd, data: Path,
             sizes: Sizes) -> dict[str, dict[str, list[float]]]:
    """Every figure, the two modes taking turns (and swapping who goes first), so that
    background load and warm caches fall on both alike."""
    results: dict[str, dict[str, list[float]]] = {
        mode: {key: [] for key in KEYS} for mode in containers}

    def turns(round_: int) -> list[tuple[str, oci.RuncContainer]]:
        order = list(containers.items())
        return order if round_ % 2 == 0 else order[::-1]

    for batch in range(sizes.mount_rounds // MOUNT_BATCH):
        for mode, container in turns(batch):
            got = probe(container, "mount", IMAGE, MOUNTPOINT, str(MOUNT_BATCH),
                        *UNMOUNT[mode])
            results[mode]["mount_ms"] += got["mount_ms"]
            results[mode]["unmount_ms"] += got["unmount_ms"]
    for round_ in range(sizes.read_rounds):
        for mode, container in turns(round_):
            got = probe(container, "read", IMAGE, MOUNTPOINT, BIG, "1", *UNMOUNT[mode])
            results[mode]["squashfs_read_mib_s"] += got["read_mib_s"]
    work = workloads.sshfs(sshd, data)
    for container in containers.values():
        workloads.mount(container, work).check()
    block = os.urandom(1 << 20)
    for round_ in range(sizes.ssh_rounds):
        for mode, container in turns(round_):
            got = probe(container, "write", workloads.SSH_MOUNT, f"{mode}-write-{round_}",
                        str(sizes.ssh_mib))
            results[mode]["sshfs_write_mib_s"] += got["write_mib_s"]
            # A fresh file written on the server: nothing of it is in the client's cache.
            name = f"{mode}-read-{round_}"
            with (sshd.export / name).open("wb") as out:
                for _ in range(sizes.ssh_mib):
                    out.write(block)
            got = probe(container, "readfile", f"{workloads.SSH_MOUNT}/{name}")
            results[mode]["sshfs_read_mib_s"] += got["read_mib_s"]
    for mode, container in containers.items():
        container.exec(*UNMOUNT[mode], workloads.SSH_MOUNT).check()
    return results


def pods(image: Path, data: Path, direct: api.ContainerAllocateResponse,
         brokered: api.ContainerAllocateResponse) -> dict[str, oci.ContainerRequest]:
    binds = [oci.Bind(image, IMAGE, True), oci.Bind(HERE, "/bench", True),
             oci.Bind(data, workloads.DATA, True)]
    return {
        "direct": oci.ContainerRequest(
            args=workloads.HOLD, allocation=direct, binds=binds,
            add_capabilities=profiles.capabilities("generic"),
            seccomp=profiles.seccomp("generic")),
        "broker": oci.ContainerRequest(
            args=workloads.HOLD, allocation=brokered, binds=binds,
            seccomp=profiles.runtime_default()),
    }


@dataclass
class Row:
    label: str
    direct: float
    broker: float
    unit: str
    ok: bool | None

    def line(self) -> str:
        verdict = "" if self.ok is None else ("PASS" if self.ok else "FAIL")
        return (f"{self.label:<44} {self.direct:>10.2f} {self.broker:>10.2f} "
                f"{self.broker - self.direct:>+9.2f} {self.unit:<6} {verdict}")


def rows(results: dict[str, dict[str, list[float]]]) -> list[Row]:
    def med(mode: str, key: str) -> float:
        return statistics.median(results[mode][key])

    out = []
    for key, label in (("mount_ms", "mount latency (squashfuse returns)"),
                       ("unmount_ms", "unmount latency")):
        d, b = med("direct", key), med("broker", key)
        out.append(Row(label, d, b, "ms",
                       b - d <= LATENCY_TARGET_MS if key == "mount_ms" else None))
    for key, label in (("squashfs_read_mib_s", "squashfs read, fresh mount"),
                       ("sshfs_write_mib_s", "sshfs write (fsync)"),
                       ("sshfs_read_mib_s", "sshfs read")):
        d, b = med("direct", key), med("broker", key)
        out.append(Row(label, d, b, "MiB/s", b >= THROUGHPUT_TARGET * d))
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.broker", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="a short smoke run")
    parser.add_argument("--out", type=Path, default=RESULTS, help=f"JSON (default {RESULTS})")
    args = parser.parse_args(argv)
    problems = blockers()
    if problems:
        print(f"bench.broker: cannot run here: {'; '.join(problems)}", file=sys.stderr)
        return 1
    sizes = QUICK if args.quick else FULL
    load_before = os.getloadavg()
    with ExitStack() as stack:
        work = Path(tempfile.mkdtemp(prefix="fuse-bench-broker-"))
        stack.callback(shutil.rmtree, work, True)
        image = make_image(work / "image", sizes.read_mib)
        sshd = Sshd(work / "sshd").start()
        stack.callback(sshd.stop)
        broker_dir = work / "broker-dir"
        broker = broker_rig.BrokerProcess(broker_dir, work / "broker", broker_rig.shim()
                                          ).start()
        stack.callback(broker.stop)
        direct = plugin.allocate(work / "plugin-direct")
        brokered = broker_rig.allocation(work / "plugin-broker", broker_dir)
        runc = stack.enter_context(oci.Runc(prefix="fuse-bench"))
        data = work / "data"
        sshd.client_files(data)
        containers = {mode: runc.create(oci.build_spec(request), mode).start()
                      for mode, request in pods(image, data, direct, brokered).items()}
        results = measure(containers, sshd, data, sizes)
        broker_side = [e["duration_ms"] for e in broker.events("broker.mount")]
    table = rows(results)
    print(f"{'figure (median)':<44} {'direct':>10} {'broker':>10} {'delta':>9}")
    for row in table:
        print(row.line())
    print(f"{'broker-side time per mount request':<44} {'':>10} "
          f"{statistics.median(broker_side):>10.2f} {'':>9} ms")
    report = {
        "machine": {"cpus": os.cpu_count(), "kernel": platform.release(),
                    "loadavg_before": load_before, "loadavg_after": os.getloadavg()},
        "sizes": sizes.__dict__,
        "samples": results,
        "broker_side_mount_ms": broker_side,
        "figures": [row.__dict__ for row in table],
    }
    busy = load_before[0] / (os.cpu_count() or 1)
    if busy > 0.75:
        print(f"\nwarning: the machine was busy before the run (1-minute load "
              f"{load_before[0]:.1f} on {os.cpu_count()} CPUs): the broker's path has four "
              "processes take turns on a CPU (the shim, the broker, fusermount3, "
              "fuse-broker-enter), so its mount latency grows with load")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1))
    print(f"\nJSON: {args.out}")
    return 0 if all(r.ok is not False for r in table) else EXIT_TARGET_MISSED


if __name__ == "__main__":
    sys.exit(main())
