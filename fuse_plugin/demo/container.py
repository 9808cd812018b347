"""The demo's container: an OCI bundle for runc built the way the kubelet and containerd
build one for a pod, run once with a deadline that can never leave a hung FUSE daemon
behind. ``demo --mount`` hands it the plugin's Allocate answer and mounts a squashfs
image with squashfuse inside it, unprivileged and confined by the generated seccomp
profile. The container tests extend it (``tests/lib/oci.py``: users, user namespaces,
privileged pods, exec); how each pod field maps to the bundle is in docs/oci-harness.md.
"""

from __future__ import annotations

import copy
import json
import os
import shutil
import signal
import stat
import subprocess
import tempfile
import uuid
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any, TypeVar

from fuse_plugin import profiles
from fuse_plugin.api import api_pb2 as api
from fuse_plugin.broker import mountinfo, records
from fuse_plugin.broker.policy import is_fuse
from fuse_plugin.config import DEFAULT_FUSE_DEVICE
from fuse_plugin.devices import Health, probe

Spec = dict[str, Any]
R = TypeVar("R", bound="Runc")

RUNC = "runc"
FUSECTL = records.FUSECTL
PROC = Path("/proc")
PATH_ENV = "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
RUN_TIMEOUT = 60.0

# containerd's default capability set for a container (oci.WithDefaultUnixSpec).
DEFAULT_CAPABILITIES = (
    "CAP_CHOWN", "CAP_DAC_OVERRIDE", "CAP_FSETID", "CAP_FOWNER", "CAP_MKNOD", "CAP_NET_RAW",
    "CAP_SETGID", "CAP_SETUID", "CAP_SETFCAP", "CAP_SETPCAP", "CAP_NET_BIND_SERVICE",
    "CAP_SYS_CHROOT", "CAP_KILL", "CAP_AUDIT_WRITE",
)
# In ``drop_capabilities``: start from no capabilities (the CRI's "ALL").
DROP_ALL = "ALL"

DENY_ALL_DEVICES: dict[str, Any] = {"allow": False, "access": "rwm"}


def _allow(major: int, minor: int | None, access: str = "rwm") -> dict[str, Any]:
    rule: dict[str, Any] = {"allow": True, "type": "c", "major": major, "access": access}
    if minor is not None:
        rule["minor"] = minor
    return rule


# containerd's oci.WithDefaultUnixDevices, in its order.
DEFAULT_DEVICE_RULES: tuple[dict[str, Any], ...] = (
    _allow(1, 3),      # /dev/null
    _allow(1, 8),      # /dev/random
    _allow(1, 7),      # /dev/full
    _allow(5, 0),      # /dev/tty
    _allow(1, 5),      # /dev/zero
    _allow(1, 9),      # /dev/urandom
    _allow(5, 1),      # /dev/console
    _allow(136, None),  # /dev/pts/*
    _allow(5, 2),      # /dev/ptmx
    _allow(10, 200),   # /dev/net/tun
)

# containerd's default mounts for a CRI container (populateDefaultUnixSpec, minus /run,
# plus the read-only cgroup mount the CRI plugin adds).
DEFAULT_MOUNTS: tuple[dict[str, Any], ...] = (
    {"destination": "/proc", "type": "proc", "source": "proc",
     "options": ["nosuid", "noexec", "nodev"]},
    {"destination": "/dev", "type": "tmpfs", "source": "tmpfs",
     "options": ["nosuid", "strictatime", "mode=755", "size=65536k"]},
    {"destination": "/dev/pts", "type": "devpts", "source": "devpts",
     "options": ["nosuid", "noexec", "newinstance", "ptmxmode=0666", "mode=0620", "gid=5"]},
    {"destination": "/dev/shm", "type": "tmpfs", "source": "shm",
     "options": ["nosuid", "noexec", "nodev", "mode=1777", "size=65536k"]},
    {"destination": "/dev/mqueue", "type": "mqueue", "source": "mqueue",
     "options": ["nosuid", "noexec", "nodev"]},
    {"destination": "/sys", "type": "sysfs", "source": "sysfs",
     "options": ["nosuid", "noexec", "nodev", "ro"]},
    {"destination": "/sys/fs/cgroup", "type": "cgroup", "source": "cgroup",
     "options": ["nosuid", "noexec", "nodev", "relatime", "ro"]},
)
MASKED_PATHS = (
    "/proc/acpi", "/proc/asound", "/proc/kcore", "/proc/keys", "/proc/latency_stats",
    "/proc/timer_list", "/proc/timer_stats", "/proc/sched_debug", "/proc/scsi",
    "/sys/firmware", "/sys/devices/virtual/powercap",
)
READONLY_PATHS = ("/proc/bus", "/proc/fs", "/proc/irq", "/proc/sys", "/proc/sysrq-trigger")

# The stand-in image: the host's /usr and /etc, read-only, in an empty root.
IMAGE_BINDS = ("/usr", "/etc")
TOP_LEVEL_LINKS = ("bin", "sbin", "lib", "lib32", "lib64", "libx32")
ROOTFS_DIRS = ("proc", "dev", "sys", "tmp", "mnt", "root", "run", "var/lib", "var/tmp",
               "data", "usr", "etc")
# An emptyDir: enough for sockets, pid files and a mount point.
EMPTY_DIR_OPTIONS = ("nosuid", "nodev", "size=16m")

_SECCOMP_FIELDS = ("defaultAction", "defaultErrnoRet", "architectures", "flags",
                   "listenerPath", "listenerMetadata")
_SECCOMP_RULE_FIELDS = ("names", "action", "errnoRet", "args")


class ContainerError(Exception):
    """The container could not be made or run, or a command in it failed."""


class ContainerTimeout(ContainerError):
    """A command in the container passed its deadline; its FUSE connections were aborted."""


# -- what a pod asks for -----------------------------------------------------------------


@dataclass(frozen=True)
class Bind:
    """A volume: a host path bind-mounted into the container."""

    source: Path
    destination: str
    readonly: bool = False
    propagation: str = "rprivate"  # mountPropagation: rslave (HostToContainer), rshared


@dataclass
class ContainerRequest:
    """One container of a pod, reduced to what the demo varies (the tests' rig adds
    users, user namespaces, privileged pods and limits).

    ``allocation`` is the plugin's ContainerAllocateResponse for this container (None: the
    pod did not ask for github.com/fuse). ``seccomp`` is a profile as JSON text or a
    parsed dict, None for Unconfined. ``tmpfs`` lists emptyDir mount points.
    """

    args: Sequence[str]
    allocation: api.ContainerAllocateResponse | None = None
    add_capabilities: Sequence[str] = ()
    drop_capabilities: Sequence[str] = ()
    seccomp: str | Mapping[str, Any] | None = None
    env: Mapping[str, str] = field(default_factory=dict)
    binds: Sequence[Bind] = ()
    tmpfs: Sequence[str] = ()
    readonly_rootfs: bool = False
    host_network: bool = True
    hostname: str = "fuse-e2e"


@dataclass(frozen=True)
class Container:
    """The short form for a container that runs to its end, as the demo and the manifest
    examples write it: ``drop: [ALL]`` plus ``capabilities``, a read-only root, its own
    network namespace, the DeviceSpecs as an Allocate answer would give them."""

    args: tuple[str, ...]
    devices: tuple[api.DeviceSpec, ...]
    seccomp: Mapping[str, Any]
    capabilities: tuple[str, ...] = ("CAP_SYS_ADMIN",)
    # (host path, container path), read-only; and writable scratch dirs (emptyDirs).
    binds: tuple[tuple[str, str], ...] = ()
    tmpfs: tuple[str, ...] = ("/mnt",)

    def request(self) -> ContainerRequest:
        """The full request it stands for: ``build_spec`` does the rest, so these
        containers are made exactly as the tests' are."""
        return ContainerRequest(
            args=self.args,
            allocation=api.ContainerAllocateResponse(devices=list(self.devices)),
            add_capabilities=self.capabilities, drop_capabilities=(DROP_ALL,),
            seccomp=self.seccomp, env={"LC_ALL": "C"},
            binds=[Bind(Path(source), target, readonly=True) for source, target in self.binds],
            tmpfs=self.tmpfs, readonly_rootfs=True, host_network=False, hostname="fuse-demo")


# -- the config.json ---------------------------------------------------------------------


def device_from_path(host_path: str, container_path: str) -> dict[str, Any]:
    """linux.devices entry for a host node, as containerd's DeviceFromPath reads it."""
    st = os.stat(host_path)
    if stat.S_ISCHR(st.st_mode):
        kind = "c"
    elif stat.S_ISBLK(st.st_mode):
        kind = "b"
    else:
        raise ContainerError(f"{host_path} is not a device node")
    return {"path": container_path, "type": kind, "major": os.major(st.st_rdev),
            "minor": os.minor(st.st_rdev), "fileMode": stat.S_IMODE(st.st_mode),
            "uid": st.st_uid, "gid": st.st_gid}


def device_entries(specs: Iterable[api.DeviceSpec]
                   ) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """DeviceSpecs -> (linux.devices, their device-cgroup allow rules).

    containerd copies the host node's type, numbers, mode and owner, and turns the
    spec's permissions ("rw") into the rule's access.
    """
    nodes, rules = [], []
    for spec in specs:
        node = device_from_path(spec.host_path, spec.container_path)
        nodes.append(node)
        rules.append({"allow": True, "type": node["type"], "major": node["major"],
                      "minor": node["minor"], "access": spec.permissions})
    return nodes, rules


def load_seccomp(profile: str | Mapping[str, Any]) -> dict[str, Any]:
    """``linux.seccomp`` from a Localhost profile, as containerd loads it: the JSON is
    read straight into the OCI ``LinuxSeccomp`` struct, so only its fields survive;
    Docker-style ``archMap``/``includes``/``excludes`` are dropped without a word (a
    rule meant only for CAP_SYS_ADMIN then applies to every container)."""
    data = json.loads(profile) if isinstance(profile, str) else copy.deepcopy(dict(profile))
    out = {k: data[k] for k in _SECCOMP_FIELDS if k in data}
    out["syscalls"] = [{k: rule[k] for k in _SECCOMP_RULE_FIELDS if k in rule}
                       for rule in data.get("syscalls") or []]
    return out


def capabilities(request: ContainerRequest) -> list[str]:
    """containerd's default set, minus what the pod drops, plus what it adds."""
    drop = set(request.drop_capabilities)
    base = () if DROP_ALL in drop else DEFAULT_CAPABILITIES
    caps = [c for c in base if c not in drop]
    caps += [c for c in request.add_capabilities if c not in caps and c not in drop]
    return caps


def mounts(request: ContainerRequest, allocation: api.ContainerAllocateResponse
           ) -> list[dict[str, Any]]:
    """The runtime's defaults, the stand-in image, the Allocate answer's mounts, the
    pod's volumes and emptyDirs, in the order containerd lists them."""
    found = [copy.deepcopy(m) for m in DEFAULT_MOUNTS]
    found += [{"destination": d, "type": "bind", "source": d, "options": ["rbind", "ro"]}
              for d in IMAGE_BINDS]
    found.append({"destination": "/tmp", "type": "tmpfs", "source": "tmpfs",
                  "options": ["nosuid", "nodev", "mode=1777"]})
    volumes = [Bind(Path(m.host_path), m.container_path, m.read_only)
               for m in allocation.mounts] + list(request.binds)
    found += [{"destination": b.destination, "type": "bind", "source": str(b.source),
               "options": ["rbind", b.propagation, "ro" if b.readonly else "rw"]}
              for b in volumes]
    found += [{"destination": target, "type": "tmpfs", "source": "tmpfs",
               "options": list(EMPTY_DIR_OPTIONS)} for target in request.tmpfs]
    return found


def build_spec(request: ContainerRequest) -> Spec:
    """The config.json containerd would give runc for ``request`` (see the module doc)."""
    allocation = request.allocation or api.ContainerAllocateResponse()
    if allocation.cdi_devices:
        raise NotImplementedError("CDI devices in an AllocateResponse are not modelled here")
    caps = capabilities(request)
    devices, allowed = device_entries(allocation.devices)
    rules = [dict(DENY_ALL_DEVICES), *map(dict, DEFAULT_DEVICE_RULES), *allowed]

    env = [PATH_ENV, f"HOSTNAME={request.hostname}"]
    env += [f"{k}={v}" for k, v in allocation.envs.items()]
    env += [f"{k}={v}" for k, v in request.env.items()]

    kinds = ("pid", "ipc", "uts", "mount") if request.host_network else (
        "pid", "network", "ipc", "uts", "mount")
    linux: dict[str, Any] = {
        "resources": {"devices": rules},
        "namespaces": [{"type": t} for t in kinds],
        "devices": devices,
        "maskedPaths": list(MASKED_PATHS),
        "readonlyPaths": list(READONLY_PATHS),
    }
    if request.seccomp is not None:
        linux["seccomp"] = load_seccomp(request.seccomp)

    return {
        "ociVersion": "1.0.2",
        "process": {
            "terminal": False,
            "user": {"uid": 0, "gid": 0},
            "args": list(request.args),
            "env": env,
            "cwd": "/",
            "capabilities": {"bounding": caps, "effective": caps, "permitted": caps},
            # False as the kubelet sets it for a container that adds SYS_ADMIN (Kubernetes
            # refuses allowPrivilegeEscalation: false together with CAP_SYS_ADMIN).
            "noNewPrivileges": False,
        },
        "root": {"path": "rootfs", "readonly": request.readonly_rootfs},
        "hostname": request.hostname,
        "mounts": mounts(request, allocation),
        "annotations": dict(allocation.annotations),
        "linux": linux,
    }


# -- the bundle on disk ------------------------------------------------------------------


def make_rootfs(path: Path, owner: int | None = None) -> None:
    """An empty root for the stand-in image: mount points, and the host's top-level
    links (bin -> usr/bin on merged-/usr systems) or binds for real directories."""
    path.mkdir(parents=True, exist_ok=True)
    for name in ROOTFS_DIRS:
        (path / name).mkdir(parents=True, exist_ok=True)
    for name in TOP_LEVEL_LINKS:
        host = Path("/") / name
        if host.is_symlink():
            (path / name).symlink_to(os.readlink(host))
        elif host.is_dir():
            (path / name).mkdir(exist_ok=True)
    if owner is not None:
        for name in ("root", "tmp", "data", "var", "var/lib", "var/tmp", "mnt", "run"):
            os.chown(path / name, owner, owner)


def _image_dirs_binds() -> list[str]:
    return [f"/{n}" for n in TOP_LEVEL_LINKS
            if Path("/", n).is_dir() and not Path("/", n).is_symlink()]


def _tmpfs_mode(options: Sequence[str]) -> int:
    return next((int(o.split("=", 1)[1], 8) for o in options if o.startswith("mode=")),
                0o777)


def write_bundle(bundle: Path, spec: Spec) -> Path:
    """config.json and rootfs/ under ``bundle``, every mount point made beforehand (a
    read-only root cannot get them later); returns ``bundle``."""
    owner = None
    for m in spec["linux"].get("uidMappings", []):
        if m["containerID"] == 0:
            owner = m["hostID"]
    make_rootfs(bundle / "rootfs", owner)
    spec = copy.deepcopy(spec)
    spec["mounts"] += [{"destination": d, "type": "bind", "source": d,
                        "options": ["rbind", "ro"]} for d in _image_dirs_binds()]
    for m in spec["mounts"]:
        target = bundle / "rootfs" / m["destination"].lstrip("/")
        if m["type"] == "bind" and Path(m["source"]).is_file():
            target.parent.mkdir(parents=True, exist_ok=True)
            target.touch(exist_ok=True)
        elif not target.is_symlink():
            target.mkdir(parents=True, exist_ok=True)
            if m["type"] == "tmpfs":
                # runc gives a tmpfs the mode of the directory it covers: that of the
                # image's (/tmp 1777) or of a kubelet emptyDir (0777) unless it says.
                target.chmod(_tmpfs_mode(m["options"]))
    (bundle / "config.json").write_text(json.dumps(spec, indent=1))
    return bundle


# -- FUSE connections --------------------------------------------------------------------


def fuse_mounts_of(pid: int, proc: Path = PROC) -> list[tuple[str, str, str]]:
    """(mount point, fstype, superblock device ``major:minor``) of every FUSE mount in
    ``pid``'s mount namespace, from its mountinfo; empty once the process is gone."""
    try:
        text = (proc / str(pid) / "mountinfo").read_text()
    except OSError:
        return []
    return [(entry.mountpoint, entry.fstype, entry.dev)
            for entry in mountinfo.parse(text) if is_fuse(entry.fstype)]


def fuse_connections_of(pid: int, proc: Path = PROC) -> set[int]:
    """fusectl connection numbers of the FUSE mounts in ``pid``'s mount namespace: the
    minor of the superblock's device (``0:N``)."""
    found: set[int] = set()
    for _point, _fstype, device in fuse_mounts_of(pid, proc):
        major, _, minor = device.partition(":")
        if major == "0":
            found.add(int(minor))
    return found


# -- running -----------------------------------------------------------------------------


@dataclass
class Result:
    args: list[str]
    returncode: int
    stdout: str
    stderr: str

    @property
    def output(self) -> str:
        return self.stdout + self.stderr

    def check(self) -> Result:
        if self.returncode != 0:
            raise ContainerError(f"{self.args} exited {self.returncode}\n"
                                 f"stdout: {self.stdout}\nstderr: {self.stderr}")
        return self


class Runc:
    """runc with a private state root, so these containers never mix with a node's."""

    def __init__(self, base: Path | None = None, prefix: str = "fuse-e2e") -> None:
        base = base or Path(tempfile.mkdtemp(prefix=f"{prefix}-", dir="/run"))
        # World-traversable: in a user namespace the container's root must reach its rootfs.
        base.chmod(0o711)
        self.base = base
        self.prefix = prefix
        self.root = base / "runc"
        self.containers: list[RuncContainer] = []

    def __enter__(self: R) -> R:
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 traceback: TracebackType | None) -> None:
        self.close()

    def command(self, *args: str) -> list[str]:
        return [RUNC, "--root", str(self.root), *args]

    def create(self, spec: Spec, name: str = "c") -> RuncContainer:
        cid = f"{self.prefix}-{name}-{uuid.uuid4().hex[:8]}"
        spec = copy.deepcopy(spec)
        spec["linux"]["cgroupsPath"] = f"/{cid}"
        bundle = write_bundle(self.base / cid, spec)
        container = self.made(cid, bundle)
        self.containers.append(container)
        return container

    def made(self, cid: str, bundle: Path) -> RuncContainer:
        """The object for a container just written to disk; the tests' rig returns one
        that can also be started and exec'd into."""
        return RuncContainer(self, cid, bundle)

    def close(self) -> None:
        """Delete every container made here (even after failures), then the directory."""
        errors = []
        for container in reversed(self.containers):
            try:
                container.delete()
            except Exception as err:  # keep cleaning the others
                errors.append(f"{container.id}: {err}")
        self.containers.clear()
        shutil.rmtree(self.base, ignore_errors=True)
        if errors:
            raise ContainerError("cleanup failed: " + "; ".join(errors))


class RuncContainer:
    """One container made by ``Runc.create``, run to its end and deleted."""

    def __init__(self, runc: Runc, cid: str, bundle: Path) -> None:
        self.runc = runc
        self.id = cid
        self.bundle = bundle
        self.pid = 0
        self.started = False
        self.deleted = False

    def run_to_end(self, timeout: float = 30.0) -> Result:
        """``runc run`` in the foreground: the spec's args run as the container's init;
        returns its exit status and output (the demo, and controls that fail fast)."""
        out, err = self.bundle / "run.out", self.bundle / "run.err"
        with out.open("wb") as o, err.open("wb") as e:
            proc = subprocess.Popen(
                self.runc.command("run", "--bundle", str(self.bundle), self.id),
                stdin=subprocess.DEVNULL, stdout=o, stderr=e)
            self.started = True
            rc = self._wait(proc, timeout, "runc run")
        return Result(["run"], rc, out.read_text(errors="replace"),
                      err.read_text(errors="replace"))

    def delete(self) -> None:
        """Abort the container's FUSE connections, then ``runc delete --force``."""
        if self.deleted or not self.started:
            self.deleted = True
            return
        for attempt in range(3):
            self.abort_fuse()
            try:
                proc = subprocess.run(self.runc.command("delete", "--force", self.id),
                                      capture_output=True, text=True, timeout=20, check=False)
            except subprocess.TimeoutExpired:
                continue
            if proc.returncode == 0 or "does not exist" in proc.stderr:
                self.deleted = True
                self._reap()
                return
            if attempt == 2:
                raise ContainerError(f"runc delete {self.id}: {proc.stderr.strip()}")
        raise ContainerError(f"runc delete {self.id} did not finish")

    def _reap(self) -> None:
        """After a delete: wait for what was started besides init (nothing, here)."""

    def _wait(self, proc: subprocess.Popen[bytes], timeout: float, what: str) -> int:
        try:
            return proc.wait(timeout)
        except subprocess.TimeoutExpired:
            aborted = self.abort_fuse()
            proc.send_signal(signal.SIGKILL)
            proc.wait(10)
            raise ContainerTimeout(
                f"{self.id}: {what!r} did not finish within {timeout}s; aborted FUSE "
                f"connections {sorted(aborted) or 'none'}") from None

    def pids(self) -> list[int]:
        proc = subprocess.run(self.runc.command("ps", "--format", "json", self.id),
                              capture_output=True, text=True, timeout=10, check=False)
        pids = json.loads(proc.stdout or "null") if proc.returncode == 0 else None
        return list(pids or ([self.pid] if self.pid else []))

    def fuse_connections(self) -> set[int]:
        """fusectl numbers of every FUSE mount visible to any process of the container."""
        found: set[int] = set()
        for pid in self.pids():
            found |= fuse_connections_of(pid)
        return found

    def abort_fuse(self) -> set[int]:
        """Abort the container's FUSE connections: frees any process stuck on them."""
        aborted = set()
        for number in self.fuse_connections():
            if records.abort(number):
                aborted.add(number)
        return aborted


def run_container(container: Container, timeout: float = RUN_TIMEOUT) -> Result:
    """Run ``container`` once, its args as init, to its end; whatever runc made for it is
    deleted afterwards, even on a timeout."""
    with Runc(prefix="fuse-demo") as runc:
        return runc.create(build_spec(container.request()), "run").run_to_end(timeout)


# -- the demo: squashfuse in an unprivileged container -----------------------------------

SECCOMP_PRESET = "generic"
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


@dataclass
class MountResult:
    setup: list[str] = field(default_factory=list)
    output: list[str] = field(default_factory=list)


def runc_blockers(device: Path = DEFAULT_FUSE_DEVICE) -> list[str]:
    """Why this machine cannot run a FUSE container with runc at all; empty when it can."""
    blockers = []
    if os.geteuid() != 0:
        blockers.append("needs root: runc makes namespaces and cgroups (run it with sudo)")
    found = probe(device)
    if found.health is not Health.HEALTHY:
        blockers.append(f"{found.reason}: load the fuse module (modprobe fuse)")
    if shutil.which(RUNC) is None:
        blockers.append("runc is not installed (apt-get install runc)")
    return blockers


def mount_blockers(device: Path = DEFAULT_FUSE_DEVICE) -> list[str]:
    """Why this machine cannot run the demo's container; empty when it can."""
    blockers = runc_blockers(device)
    for program, package in (("squashfuse", "squashfuse"), ("mksquashfs", "squashfs-tools")):
        if shutil.which(program) is None:
            blockers.append(f"{program} is not installed (apt-get install {package})")
    return blockers


def seccomp_profile(preset: str = SECCOMP_PRESET) -> dict[str, Any]:
    """The generated profile, as a pod's ``seccompProfile: Localhost`` would load it."""
    rendered: object = profiles.render_seccomp(preset)
    profile = json.loads(rendered) if isinstance(rendered, (str, bytes)) else rendered
    if not isinstance(profile, dict):
        raise ContainerError(f"seccomp preset {preset!r} did not render to a JSON object")
    return profile


def make_image(source: Path, image: Path) -> None:
    source.mkdir()
    (source / "hello.txt").write_text(HELLO)
    (source / "numbers").mkdir()
    for number in range(1, 4):
        (source / "numbers" / f"{number}.txt").write_text(f"{number}\n")
    _run(["mksquashfs", str(source), str(image), "-noappend", "-all-root", "-no-progress",
          "-quiet"], "mksquashfs")


def run_mount_demo(specs: Sequence[api.DeviceSpec]) -> MountResult:
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
            "root filesystem: the host's /usr and /etc, read-only; a squashfs image made "
            "with mksquashfs",
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
        raise _failed("the container", proc.returncode, proc.stdout, proc.stderr)
    result.output = proc.stdout.rstrip("\n").splitlines()
    return result


def _run(command: list[str], what: str) -> None:
    proc = subprocess.run(command, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise _failed(what, proc.returncode, proc.stdout, proc.stderr)


def _failed(what: str, returncode: int, stdout: str, stderr: str) -> ContainerError:
    """One line for the demo's user: the last thing the program said."""
    said = (stderr.strip() or stdout.strip()).splitlines()
    return ContainerError(f"{what} failed (exit {returncode}): "
                          f"{said[-1] if said else 'no output'}")
