"""One small, real, unprivileged runc container that mounts a FUSE filesystem.

Used by ``fuse-device-plugin demo --mount``. It does by hand what the kubelet and
containerd do for a pod that asked for ``github.com/fuse: 1``: the Allocate answer's
DeviceSpec becomes a device node plus a device-cgroup rule, the container gets
CAP_SYS_ADMIN and nothing else (not ``privileged``), and the seccomp profile is the
generated one, as a pod's ``seccompProfile: Localhost`` would load it.

The root filesystem is read-only binds of the host's /usr (Debian's merged /usr has
every program the demo runs), so nothing is downloaded and no image store is needed.
The FUSE filesystem is squashfuse over an image made with mksquashfs: the smallest real
FUSE filesystem in Debian that needs no daemon, network or credentials.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import os
import shutil
import stat
import subprocess
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fuse_plugin.config import DEFAULT_FUSE_DEVICE
from fuse_plugin.devices import Health, probe

SECCOMP_PRESET = "generic"
RUN_TIMEOUT = 60.0
# The same paths the runtime default spec hides or freezes; a demo container should look
# like a pod's, not like a privileged one.
MASKED = ("/proc/acpi", "/proc/asound", "/proc/kcore", "/proc/keys", "/proc/latency_stats",
          "/proc/timer_list", "/proc/timer_stats", "/proc/sched_debug", "/proc/scsi",
          "/sys/firmware")
READ_ONLY = ("/proc/bus", "/proc/fs", "/proc/irq", "/proc/sys", "/proc/sysrq-trigger")
MOUNTPOINT = "/mnt/fuse"
IMAGE = "/data/demo.sqfs"
SCRIPT = f"""set -e
mkdir -p {MOUNTPOINT}
squashfuse {IMAGE} {MOUNTPOINT}
echo "$ grep fuse /proc/self/mounts"; grep fuse /proc/self/mounts
echo "$ ls -l {MOUNTPOINT}"; ls -l {MOUNTPOINT}
echo "$ cat {MOUNTPOINT}/hello.txt"; cat {MOUNTPOINT}/hello.txt
echo "$ ls /dev"; echo $(ls /dev)
echo "$ unshare --mount true"
unshare --mount true 2>&1 || echo "refused: the profile allows FUSE mounts, not new namespaces"
echo "$ grep -E '^(CapEff|Seccomp):' /proc/self/status"
grep -E '^(CapEff|Seccomp):' /proc/self/status
umount {MOUNTPOINT}
echo "unmounted {MOUNTPOINT}"
"""
HELLO = "hello from squashfuse, mounted in a container that is not privileged\n"


class ContainerError(Exception):
    """The container could not be made or did not run; the message is one line."""


@dataclass
class MountResult:
    setup: list[str] = field(default_factory=list)
    output: list[str] = field(default_factory=list)


def mount_blockers(device: Path = DEFAULT_FUSE_DEVICE) -> list[str]:
    """Why this machine cannot run the container part; empty when it can."""
    blockers = []
    if os.geteuid() != 0:
        blockers.append("needs root: runc makes namespaces and cgroups (run it with sudo)")
    found = probe(device)
    if found.health is not Health.HEALTHY:
        blockers.append(f"{found.reason}: load the fuse module (modprobe fuse)")
    for program, package in (("runc", "runc"), ("squashfuse", "squashfuse"),
                             ("mksquashfs", "squashfs-tools")):
        if shutil.which(program) is None:
            blockers.append(f"{program} is not installed (apt-get install {package})")
    if importlib.util.find_spec("fuse_plugin.profiles") is None:
        blockers.append("the seccomp profile generator (fuse_plugin.profiles) is missing")
    return blockers


def seccomp_profile(preset: str = SECCOMP_PRESET) -> dict[str, Any]:
    """The generated profile, as a pod's ``seccompProfile: Localhost`` would load it."""
    # Imported by name: the generator is its own subpackage and the demo must still run
    # (and say why --mount is skipped) on an install that lacks it.
    profiles = importlib.import_module("fuse_plugin.profiles")
    rendered: object = profiles.render_seccomp(preset)
    profile = json.loads(rendered) if isinstance(rendered, (str, bytes)) else rendered
    if not isinstance(profile, dict):
        raise ContainerError(f"seccomp preset {preset!r} did not render to a JSON object")
    return profile


def device_entries(specs: Sequence[Any]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """DeviceSpecs -> (linux.devices, device-cgroup rules), as containerd builds them.

    containerd copies the host node's type, numbers, mode and owner, and turns the
    spec's permissions ("rw") into the cgroup rule's access.
    """
    nodes, rules = [], []
    for spec in specs:
        st = os.stat(spec.host_path)
        if not stat.S_ISCHR(st.st_mode):
            raise ContainerError(f"{spec.host_path} is not a character device")
        major, minor = os.major(st.st_rdev), os.minor(st.st_rdev)
        nodes.append({"type": "c", "path": spec.container_path, "major": major,
                      "minor": minor, "fileMode": stat.S_IMODE(st.st_mode),
                      "uid": st.st_uid, "gid": st.st_gid})
        rules.append({"allow": True, "type": "c", "major": major, "minor": minor,
                      "access": spec.permissions})
    return nodes, rules


def _host_root_entries(rootfs: Path) -> list[dict[str, Any]]:
    """Recreate /bin, /lib... as the host has them: symlinks into /usr, or ro binds."""
    mounts = [_bind("/usr", "/usr")]
    for name in ("bin", "sbin", "lib", "lib32", "lib64", "libx32"):
        host = Path("/") / name
        if host.is_symlink():
            (rootfs / name).symlink_to(os.readlink(host))
        elif host.is_dir():
            (rootfs / name).mkdir()
            mounts.append(_bind(str(host), f"/{name}"))
    return mounts


def _bind(source: str, destination: str) -> dict[str, Any]:
    return {"destination": destination, "type": "bind", "source": source,
            "options": ["rbind", "ro", "nosuid", "nodev"]}


@dataclass(frozen=True)
class Container:
    """What a pod's container would get, reduced to what the demo and tests vary."""

    args: tuple[str, ...]
    devices: tuple[Any, ...]
    seccomp: dict[str, Any]
    capabilities: tuple[str, ...] = ("CAP_SYS_ADMIN",)
    # (host path, container path), read-only; and writable scratch dirs (emptyDirs).
    binds: tuple[tuple[str, str], ...] = ()
    tmpfs: tuple[str, ...] = ("/mnt",)


def bundle_config(rootfs: Path, container: Container) -> dict[str, Any]:
    """An OCI runtime config (runtime-spec 1.0) for one unprivileged container."""
    nodes, rules = device_entries(container.devices)
    caps = list(container.capabilities)
    mounts: list[dict[str, Any]] = [
        {"destination": "/proc", "type": "proc", "source": "proc"},
        {"destination": "/dev", "type": "tmpfs", "source": "tmpfs",
         "options": ["nosuid", "strictatime", "mode=755", "size=65536k"]},
        {"destination": "/dev/pts", "type": "devpts", "source": "devpts",
         "options": ["nosuid", "noexec", "newinstance", "ptmxmode=0666", "mode=0620"]},
        {"destination": "/dev/shm", "type": "tmpfs", "source": "shm",
         "options": ["nosuid", "noexec", "nodev", "mode=1777", "size=65536k"]},
        {"destination": "/sys", "type": "sysfs", "source": "sysfs",
         "options": ["nosuid", "noexec", "nodev", "ro"]},
        *_host_root_entries(rootfs),
        {"destination": "/etc/ld.so.cache", "type": "bind", "source": "/etc/ld.so.cache",
         "options": ["bind", "ro"]},
        *({"destination": target, "type": "bind", "source": source,
           "options": ["bind", "ro", "nosuid", "nodev"]} for source, target in container.binds),
        *({"destination": target, "type": "tmpfs", "source": "tmpfs",
           "options": ["nosuid", "nodev", "size=16m"]} for target in container.tmpfs),
    ]
    files = {"/etc/ld.so.cache"} | {target for source, target in container.binds
                                    if not Path(source).is_dir()}
    for entry in mounts:
        target = rootfs / entry["destination"].lstrip("/")
        if entry["destination"] in files:
            target.parent.mkdir(parents=True, exist_ok=True)
            target.touch()
        elif not target.is_symlink():
            target.mkdir(parents=True, exist_ok=True)
    return {
        "ociVersion": "1.0.2",
        "process": {
            "terminal": False,
            "user": {"uid": 0, "gid": 0},
            "args": list(container.args),
            "env": ["PATH=/usr/sbin:/usr/bin:/sbin:/bin", "LC_ALL=C"],
            "cwd": "/",
            "capabilities": {"bounding": caps, "effective": caps, "permitted": caps},
            # As the kubelet sets it for a container that adds SYS_ADMIN: Kubernetes
            # refuses allowPrivilegeEscalation: false together with CAP_SYS_ADMIN.
            "noNewPrivileges": False,
        },
        "root": {"path": str(rootfs), "readonly": True},
        "hostname": "fuse-demo",
        "mounts": mounts,
        "linux": {
            "namespaces": [{"type": kind} for kind in
                           ("pid", "network", "ipc", "uts", "mount")],
            "devices": nodes,
            "resources": {"devices": [{"allow": False, "access": "rwm"}, *rules]},
            "seccomp": container.seccomp,
            "maskedPaths": list(MASKED),
            "readonlyPaths": list(READ_ONLY),
        },
    }


def run_container(container: Container, timeout: float = RUN_TIMEOUT
                  ) -> subprocess.CompletedProcess[str]:
    """Run it once with runc in a temp bundle; always deleted afterwards, even on timeout."""
    with tempfile.TemporaryDirectory(prefix="fuse-oci-") as tmp:
        work = Path(tmp)
        rootfs = work / "rootfs"
        rootfs.mkdir()
        (work / "config.json").write_text(json.dumps(bundle_config(rootfs, container)))
        name = f"fuse-oci-{os.getpid()}-{work.name[-8:]}"
        state = work / "runc-state"
        runc = ["runc", "--root", str(state)]
        try:
            return subprocess.run([*runc, "run", "--bundle", str(work), name],
                                  capture_output=True, text=True, timeout=timeout,
                                  check=False)
        except subprocess.TimeoutExpired:
            raise ContainerError(f"the container did not finish within {timeout:.0f}s"
                                 ) from None
        finally:
            subprocess.run([*runc, "delete", "--force", name], capture_output=True,
                           check=False, timeout=30)


def make_image(source: Path, image: Path) -> None:
    source.mkdir()
    (source / "hello.txt").write_text(HELLO)
    (source / "numbers").mkdir()
    for number in range(1, 4):
        (source / "numbers" / f"{number}.txt").write_text(f"{number}\n")
    _run(["mksquashfs", str(source), str(image), "-noappend", "-all-root", "-no-progress",
          "-quiet"], "mksquashfs")


def run_mount_demo(specs: Sequence[Any]) -> MountResult:
    """Build the image, run the demo container once, and return what it printed."""
    result = MountResult()
    with tempfile.TemporaryDirectory(prefix="fuse-demo-image-") as tmp:
        image = Path(tmp) / "demo.sqfs"
        make_image(Path(tmp) / "src", image)
        profile = seccomp_profile()
        container = Container(args=("/bin/sh", "-c", SCRIPT), devices=tuple(specs),
                              seccomp=profile, binds=((str(image), IMAGE),))
        allowed = sum(len(rule.get("names", [])) for rule in profile.get("syscalls", [])
                      if rule.get("action") == "SCMP_ACT_ALLOW")
        nodes, _ = device_entries(container.devices)
        result.setup += [
            "root filesystem: the host's /usr, read-only; a squashfs image made with "
            "mksquashfs",
            "device from the Allocate answer: " + ", ".join(
                f"{n['path']} (c {n['major']}:{n['minor']}, cgroup rw)" for n in nodes),
            "capabilities: CAP_SYS_ADMIN only; not privileged; root filesystem read-only",
            f"seccomp: the generated {SECCOMP_PRESET!r} profile ({allowed} syscalls allowed, "
            f"default action {profile.get('defaultAction')})",
            "AppArmor: not applied by this demo (the pod's Localhost profile does that on "
            "a node)",
        ]
        proc = run_container(container)
    if proc.returncode != 0:
        said = (proc.stderr.strip() or proc.stdout.strip()).splitlines()
        raise ContainerError(f"the container failed (exit {proc.returncode}): "
                             f"{said[-1] if said else 'no output'}")
    result.output = proc.stdout.rstrip("\n").splitlines()
    return result


def _run(command: list[str], what: str) -> None:
    proc = subprocess.run(command, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        said = (proc.stderr.strip() or proc.stdout.strip()).splitlines()
        raise ContainerError(f"{what} failed (exit {proc.returncode}): "
                             f"{said[-1] if said else 'no output'}")
