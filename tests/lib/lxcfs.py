"""The node's lxcfs for LXCFS views through the broker, as its DaemonSet runs it: the real
``fuse-device-plugin lxcfs`` command (which runs the real lxcfs) in a mount namespace of
its own, with a tmpfs over /run and over the mount point, as a container's fresh
namespace would have, and only the capabilities the DaemonSet adds (read from
``manifests/broker/lxcfs-daemonset.yaml``: a capability it lacks fails here too). The
host sees none of its mounts; killing it leaves nothing on the host, so a test can
restart it as the kubelet restarts a container.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import yaml

from fuse_plugin.broker import lxcfs
from tests.lib.broker import events_in
from tests.lib.servers import stop_process
from tests.lib.waiting import wait_for

DAEMONSET = Path(__file__).resolve().parents[2] / "manifests" / "broker" / "lxcfs-daemonset.yaml"
MEMTOTAL = re.compile(r"^MemTotal:\s+(\d+) kB$", re.MULTILINE)


class LxcfsInstance:
    """One run of the lxcfs DaemonSet's container; ``start`` again for the next."""

    def __init__(self, lxcfs_dir: Path, workdir: Path) -> None:
        self.lxcfs_dir = lxcfs_dir
        self.workdir = workdir
        self.log_path = workdir / "lxcfs.log"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, timeout: float = 30.0) -> LxcfsInstance:
        self.workdir.mkdir(parents=True, exist_ok=True)
        announced = len(self.events("lxcfs.announced"))
        script = (f"mount -t tmpfs lxcfs-run /run && mount -t tmpfs lxcfs-dir "
                  f"{lxcfs.MOUNTPOINT} && exec \"$@\"")
        with self.log_path.open("ab") as log:
            self.proc = subprocess.Popen(
                ["unshare", "--mount", "--propagation", "private", "sh", "-c", script, "lxcfs",
                 "setpriv", f"--bounding-set=-all,{daemonset_capabilities()}", "--",
                 sys.executable, "-m", "fuse_plugin", "lxcfs", "--lxcfs-dir",
                 str(self.lxcfs_dir), "--log-format", "json"],
                stdout=log, stderr=subprocess.STDOUT)
        proc = self.proc
        wait_for(lambda: proc.poll() is not None
                 or len(self.events("lxcfs.announced")) > announced,
                 timeout, "lxcfs to announce itself to the broker", detail=self.log)
        if proc.poll() is not None:
            raise AssertionError(f"lxcfs exited {proc.returncode}: {self.log()}")
        return self

    def log(self) -> str:
        return self.log_path.read_text() if self.log_path.exists() else ""

    def events(self, name: str) -> list[dict[str, Any]]:
        return events_in(self.log(), name)

    @property
    def lxcfs_pid(self) -> int:
        """The lxcfs process itself (the command's child)."""
        return int(self.events("lxcfs.mounted")[-1]["pid"])

    def kill_lxcfs(self) -> int:
        """SIGKILL lxcfs, as a crash or the OOM killer would; the command then exits 1,
        as the container would end. Its exit status."""
        assert self.proc is not None
        os.kill(self.lxcfs_pid, signal.SIGKILL)
        return self.proc.wait(30)

    def stop(self) -> None:
        stop_process(self.proc)


def daemonset_capabilities() -> str:
    """The DaemonSet's added capabilities as setpriv names them (+sys_admin,...)."""
    for doc in yaml.safe_load_all(DAEMONSET.read_text()):
        if doc and doc.get("kind") == "DaemonSet":
            [container] = doc["spec"]["template"]["spec"]["containers"]
            return ",".join(f"+{c.lower()}" for c in container["securityContext"]
                            ["capabilities"]["add"])
    raise AssertionError(f"no DaemonSet in {DAEMONSET}")


def memtotal_kb(text: str) -> int:
    match = MEMTOTAL.search(text)
    assert match, text
    return int(match.group(1))
