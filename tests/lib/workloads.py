"""The FUSE workloads as a pod would run them: the mount command inside the container,
and the volumes (binds) the command needs. Shared by the tests and the benchmarks."""

from __future__ import annotations

import shutil
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fuse_plugin.api import api_pb2 as api
from tests.lib import profiles
from tests.lib.oci import Bind, ContainerRequest, Result, RuncContainer
from tests.lib.servers import LOOPBACK, Moto, Sshd
from tests.lib.waiting import wait_for

BUCKET = "fuse-e2e"
S3_MOUNT = "/mnt/s3"
SSH_MOUNT = "/mnt/ssh"
LXCFS_MOUNT = "/var/lib/lxcfs"
DATA = "/data"
TOOLS = {"s3fs": "s3fs", "sshfs": "sshfs", "lxcfs": "lxcfs"}


@dataclass
class Workload:
    """A FUSE filesystem to mount: ``mount`` runs in the container and returns once the
    filesystem is mounted (the daemon detaches); ``mountpoint`` is where it appears."""

    name: str
    preset: str
    mount: list[str]
    mountpoint: str
    binds: list[Bind] = field(default_factory=list)

    def unmount(self) -> list[str]:
        return ["umount", self.mountpoint]


def missing_tool(name: str) -> str:
    """Why the workload cannot run here, or '' (the package is named for the install)."""
    if shutil.which(TOOLS[name]) is None:
        return (f"{TOOLS[name]} is not installed: scripts/install --dev installs it from "
                "scripts/apt-packages.txt")
    return ""


def s3fs(moto: Moto, data: Path, owner: int | None = None) -> Workload:
    data.mkdir(parents=True, exist_ok=True)
    moto.passwd_file(data / "passwd-s3fs", owner)
    return Workload(
        "s3fs", "s3fs",
        ["sh", "-c", f"mkdir -p {S3_MOUNT} && exec s3fs {BUCKET} {S3_MOUNT} "
         f"-o passwd_file={DATA}/passwd-s3fs -o url={moto.url} -o use_path_request_style "
         f"-o endpoint={moto.REGION}"],
        S3_MOUNT, [Bind(data, DATA, readonly=True)])


def sshfs(sshd: Sshd, data: Path, owner: int | None = None) -> Workload:
    sshd.client_files(data, owner)
    return Workload(
        "sshfs", "sshfs",
        ["sh", "-c", f"mkdir -p {SSH_MOUNT} && exec sshfs -p {sshd.port} "
         f"-o IdentityFile={DATA}/id_ed25519 -o UserKnownHostsFile={DATA}/known_hosts "
         "-o StrictHostKeyChecking=yes -o BatchMode=yes "
         f"root@{LOOPBACK}:{sshd.export} {SSH_MOUNT}"],
        SSH_MOUNT, [Bind(data, DATA, readonly=True)])


def lxcfs() -> Workload:
    """lxcfs in the background (it has no daemon mode of its own that returns once
    mounted); callers wait for the mount to appear."""
    return Workload(
        "lxcfs", "lxcfs",
        ["sh", "-c", f"mkdir -p {LXCFS_MOUNT} && exec lxcfs --foreground "
         f"--pidfile=/run/lxcfs.pid {LXCFS_MOUNT}"],
        LXCFS_MOUNT)


HOLD = ["sleep", "infinity"]  # the container's init; workloads run with ``exec``


def container_request(workload: Workload, allocation: api.ContainerAllocateResponse | None,
                      **overrides: Any) -> ContainerRequest:
    """The pod the docs recommend for ``workload``: the plugin's device, the default
    capabilities plus the preset's, the preset's generated seccomp profile."""
    fields: dict[str, Any] = {
        "args": HOLD,
        "allocation": allocation,
        "add_capabilities": profiles.capabilities(workload.preset),
        "seccomp": profiles.seccomp(workload.preset),
        "binds": workload.binds,
    }
    fields.update(overrides)
    return ContainerRequest(**fields)


def mount(container: RuncContainer, workload: Workload, timeout: float = 20.0) -> Result:
    """Run the workload's mount command in the container. For a daemon that stays in the
    foreground (lxcfs) it runs detached, and this returns once the mount is there or the
    daemon has exited (its output is then the result)."""
    if workload.name != "lxcfs":
        return container.exec(*workload.mount, timeout=timeout)
    log = container.bundle / "lxcfs.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            container.runc.command("exec", container.id, *workload.mount),
            stdin=subprocess.DEVNULL, stdout=out, stderr=out)
    container.daemons.append(proc)

    def settled() -> bool:
        return proc.poll() is not None or any(
            point == workload.mountpoint for point, _ in container.mounts())

    wait_for(settled, timeout, f"{workload.name} to mount or exit")
    rc = proc.poll()
    return Result(list(workload.mount), 0 if rc is None else rc, "",
                  log.read_text(errors="replace"))


HELLO = "served through the broker\n"


def squash_image(directory: Path) -> Path:
    """A squashfs image holding hello.txt (``HELLO``), for squashfuse."""
    source, image = directory / "squash-src", directory / "image.sqfs"
    source.mkdir(parents=True, exist_ok=True)
    (source / "hello.txt").write_text(HELLO)
    subprocess.run(["mksquashfs", str(source), str(image), "-noappend", "-quiet",
                    "-no-progress"], check=True, capture_output=True, timeout=60)
    return image
