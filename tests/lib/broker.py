"""Broker mode's real parts for the tests and the benchmark: the fusermount3 shim and
fuse-broker-helper built by the project's own script (cached outside the work tree by a
hash of their sources), the
real ``fuse-device-plugin broker`` process, and the plugin's broker-mode Allocate answer.
"""

from __future__ import annotations

import hashlib
import json
import select
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from fuse_plugin.api import api_pb2 as api
from fuse_plugin.broker import protocol
from fuse_plugin.broker.node import install_shim
from tests.lib import oci, plugin
from tests.lib.servers import stop_process
from tests.lib.waiting import wait_for

ROOT = Path(__file__).resolve().parents[2]
NATIVE = ROOT / "fuse_plugin" / "broker" / "native"
SHIM_SOURCE = NATIVE / "fusermount3.c"
BUILD_SCRIPT = ROOT / "scripts" / "build-native"
CACHE = Path("/var/cache/fuse-device-plugin/native")
ATTACKER = Path(__file__).with_name("attacker.py")
# Where the hostile tenant's toolkit is bound inside a container.
ATTACKER_DIR = "/opt/attacker"
ATTACKER_IN_CONTAINER = f"{ATTACKER_DIR}/attacker.py"


def shim(cache: Path = CACHE) -> Path:
    """The shim built by scripts/build-native (fuse-broker-helper beside it), rebuilt only
    when a source changes."""
    digest = hashlib.sha256(b"".join(p.read_bytes() for p in
                                     (*sorted(NATIVE.glob("*.[ch]")), BUILD_SCRIPT)))
    out = cache / digest.hexdigest()[:16]
    if not (out / protocol.SHIM_NAME).exists():
        result = subprocess.run([str(BUILD_SCRIPT), str(out)], capture_output=True,
                                text=True, timeout=120, check=False)
        if result.returncode != 0:
            raise AssertionError(f"scripts/build-native failed: {result.stderr}")
    return out / protocol.SHIM_NAME


class BrokerProcess:
    """The real broker, as its DaemonSet runs it, serving in ``directory`` (what the
    plugin's --broker-dir names) and logging JSON lines to ``workdir``."""

    def __init__(self, directory: Path, workdir: Path, shim_path: Path, *extra: str) -> None:
        self.workdir = workdir
        self.directory = directory
        self.state = workdir / "state"
        self.shim = shim_path
        self.extra = extra
        self.log_path = workdir / "broker.log"
        self.proc: subprocess.Popen[bytes] | None = None
        # How Python runs the command: a benchmark may start it through code of its own.
        self.launch: tuple[str, ...] = ("-m", "fuse_plugin")

    @property
    def socket(self) -> Path:
        return self.directory / protocol.SOCKET_NAME

    def start(self, timeout: float = 30.0) -> BrokerProcess:
        self.workdir.mkdir(parents=True, exist_ok=True)
        served = len(self.events("broker.serving"))
        with self.log_path.open("ab") as log:
            self.proc = subprocess.Popen(
                [sys.executable, *self.launch, "broker", "--dir", str(self.directory),
                 "--shim", str(self.shim), "--state-dir", str(self.state),
                 # Its own lxcfs socket, never the node's (an ``extra`` one wins: last).
                 "--lxcfs-dir", str(self.workdir / "lxcfs"),
                 "--log-format", "json", *self.extra],
                stdout=log, stderr=subprocess.STDOUT)
        proc = self.proc
        wait_for(lambda: proc.poll() is not None or len(self.events("broker.serving")) > served,
                 timeout, "the broker to serve")
        if proc.poll() is not None:
            raise AssertionError(f"broker exited {proc.returncode}: {self.log()}")
        return self

    def log(self) -> str:
        return self.log_path.read_text() if self.log_path.exists() else ""

    def events(self, name: str | None = None) -> list[dict[str, Any]]:
        return events_in(self.log(), name)

    def kill(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)

    def stop(self) -> None:
        stop_process(self.proc)

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid


def events_in(log: str, name: str | None = None) -> list[dict[str, Any]]:
    """The JSON log lines (``--log-format json``) of one event, or all of them."""
    found = []
    for line in log.splitlines():
        try:
            event = json.loads(line)
        except json.JSONDecodeError:
            continue
        if name is None or event.get("event") == name:
            found.append(event)
    return found


def allocation(workdir: Path, broker_dir: Path) -> api.ContainerAllocateResponse:
    """The real plugin's Allocate answer with ``--broker-dir``: the plugin's slots are
    healthy only once a broker has installed its shim there, so it is installed first,
    as the broker does."""
    broker_dir.mkdir(parents=True, exist_ok=True)
    install_shim(broker_dir, shim().read_bytes())
    return plugin.allocate(workdir, extra=("--broker-dir", str(broker_dir)))


def without_socket(allocation: api.ContainerAllocateResponse
                   ) -> api.ContainerAllocateResponse:
    """The same answer minus the socket directory's bind: the shim is there, the broker
    cannot be reached."""
    out = api.ContainerAllocateResponse()
    out.CopyFrom(allocation)
    del out.mounts[:]
    out.mounts.extend(m for m in allocation.mounts
                      if m.container_path != protocol.CONTAINER_DIR)
    return out


def attacker_bind() -> oci.Bind:
    """The toolkit, read-only in the container (python3 comes from the stand-in image)."""
    return oci.Bind(ATTACKER.parent, ATTACKER_DIR, True)


def attack(container: oci.RuncContainer, *args: str, timeout: float = 120.0,
           prefix: tuple[str, ...] = (), env: dict[str, str] | None = None,
           user: str | None = None) -> dict[str, Any]:
    """Run one toolkit command in the container to its end (as ``user``, UID:GID, if
    given); its JSON answer."""
    result = container.exec(*prefix, "python3", ATTACKER_IN_CONTAINER, *args,
                            timeout=timeout, env=env, user=user)
    if result.returncode != 0:
        raise AssertionError(f"attacker {args[0]} failed: {result.output}")
    answer: dict[str, Any] = json.loads(result.stdout)
    return answer


class Held:
    """A toolkit command that holds something (a mount, connections) until released:
    its JSON answer is read, then it waits for its stdin to close."""

    def __init__(self, container: oci.RuncContainer, *args: str,
                 env: dict[str, str] | None = None, user: str | None = None) -> None:
        extra = [arg for k, v in (env or {}).items() for arg in ("--env", f"{k}={v}")]
        extra += ["--user", user] if user is not None else []
        self.proc = subprocess.Popen(
            container.runc.command("exec", *extra, container.id, "python3",
                                   ATTACKER_IN_CONTAINER, *args),
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        container.daemons.append(self.proc)
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        try:
            self.answer: dict[str, Any] = json.loads(line)
        except json.JSONDecodeError:
            raise AssertionError(f"attacker {args[0]} said: {line!r}") from None

    def release(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        self.proc.wait(30)


class Burst:
    """One container's ``attacker.py burst``: ``asks`` mount requests under
    ``directory`` whose connections all open on ``go`` before any is sent, so the broker
    has them all in flight at once; its mounts are unmounted on ``release``."""

    LINE_DEADLINE = 60.0  # seconds for it to say it is ready, or its outcome

    def __init__(self, container: oci.RuncContainer, asks: int, directory: str) -> None:
        self.proc = subprocess.Popen(
            container.runc.command("exec", container.id, "python3", ATTACKER_IN_CONTAINER,
                                   "burst", str(asks), directory),
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            bufsize=0)
        container.daemons.append(self.proc)

    def line(self) -> dict[str, Any]:
        """Its next JSON line, read with a deadline (it prints whole lines, flushed)."""
        assert self.proc.stdout is not None
        deadline = time.monotonic() + self.LINE_DEADLINE
        text = b""
        while not text.endswith(b"\n"):
            left = deadline - time.monotonic()
            ready, _, _ = select.select([self.proc.stdout], [], [], max(0.0, left))
            if not ready:
                raise AssertionError(f"attacker burst said nothing within "
                                     f"{self.LINE_DEADLINE:g}s (so far: {text!r})")
            byte = self.proc.stdout.read(1)
            if not byte:
                raise AssertionError(f"attacker burst ended: {text!r}")
            text += byte
        try:
            answer: dict[str, Any] = json.loads(text)
        except json.JSONDecodeError:
            raise AssertionError(f"attacker burst said: {text!r}") from None
        return answer

    def go(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(b"go\n")

    def release(self) -> None:
        """Its stdin closes: it unmounts what it got, through the broker, and exits."""
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        self.proc.wait(self.LINE_DEADLINE)


# A stand-in for the broker's helper that ends up where a helper would if a tenant's
# daemon ever caught it: blocked in the kernel, beyond SIGKILL's reach. A child takes the
# lock of the caller's never-answering FUSE root (mkdir in it waits on the daemon while
# holding the directory's lock), then this process looks a name up there and waits on
# that lock, uninterruptibly.
STUCK_HELPER_BODY = """pidfd = int(sys.argv[2])
info = open(f"/proc/self/fdinfo/{pidfd}").read()
pid = int(re.search(r"^Pid:\\s+(\\d+)", info, re.M).group(1))
stall = f"/proc/{pid}/root/mnt/stall"
child = os.fork()
if child == 0:
    try:
        os.mkdir(stall + "/x")
    finally:
        os._exit(0)
for _ in range(2000):  # until the child waits inside mkdir, holding the lock
    call = open(f"/proc/{child}/syscall").read().split()[0]
    if call in ("83", "258", "34", "39"):  # mkdir, mkdirat (x86-64; arm64: 34)
        break
    os.sched_yield()
os.stat(stall + "/y")
"""


def stuck_helper(imports: str = "os, re, sys", prelude: str = "") -> str:
    """The stand-in's script: ``prelude`` runs first (after ``import IMPORTS``)."""
    return f"#!/usr/bin/env python3\nimport {imports}\n{prelude}{STUCK_HELPER_BODY}"


def with_stand_in_helper(real: BrokerProcess, script: str, workdir: Path) -> BrokerProcess:
    """A broker like ``real`` (stopped here) whose fuse-broker-helper is ``script``, with
    real's records, so the mounts real made stay its own; not started yet."""
    real.stop()
    fake = workdir / "fake-bin"
    fake.mkdir(parents=True)
    (fake / protocol.SHIM_NAME).write_bytes(shim().read_bytes())
    (fake / "fuse-broker-helper").write_text(script)
    for program in fake.iterdir():
        program.chmod(0o755)
    stand_in = BrokerProcess(real.directory, workdir / "broker", fake / protocol.SHIM_NAME)
    stand_in.state = real.state
    return stand_in
