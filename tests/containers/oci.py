"""OCI bundles for runc, built the way the kubelet and containerd build them for a pod.

A pod asking for ``github.com/fuse`` goes kubelet -> containerd (CRI) -> runc. This module
plays the kubelet and containerd's CRI plugin: ``build_spec`` turns one container's
request, with the plugin's real ``ContainerAllocateResponse`` (fetched over the plugin's
real socket, see ``plugin.allocate``), into the ``config.json`` containerd would hand
runc. Nothing below is privileged unless a test asks for the privileged control.

The mapping (what containerd does with the CRI CreateContainer request):

======================================  ==================================================
kubelet / CRI request                   OCI config.json (containerd's CRI plugin)
======================================  ==================================================
DeviceSpec{host_path, container_path,   ``linux.devices``: ``{path: container_path, type:
permissions} from Allocate              "c"|"b", major, minor, fileMode, uid, gid}``, all
                                        read by stat(host_path) on the node; and an allow
                                        rule ``{allow: true, type, major, minor, access:
                                        permissions}`` in ``linux.resources.devices``
(always, unless privileged)             ``linux.resources.devices`` starts with deny-all
                                        ``{allow: false, access: "rwm"}`` then containerd's
                                        default rules (``DEFAULT_DEVICE_RULES``: null,
                                        random, full, tty, zero, urandom, console, pts,
                                        ptmx, tun); the plugin's rules come after them.
                                        runc itself then appends its own defaults, among
                                        them ``c *:* m`` and ``b *:* m``: mknod of any node
                                        succeeds, but opening it is refused (EPERM).
Mount{host_path, container_path,        a bind mount: ``{destination: container_path,
read_only} from Allocate; volumes       type: bind, source: host_path, options: [rbind,
                                        rprivate, ro|rw]}``
envs from Allocate; container env       ``process.env`` ``K=V``, after PATH
annotations from Allocate               ``annotations``
CDI devices from Allocate               containerd resolves them through CDI specs; this
                                        plugin sends none, and ``build_spec`` refuses them
securityContext.capabilities.add        ``process.capabilities`` bounding, effective and
                                        permitted: containerd's default set
                                        (``DEFAULT_CAPABILITIES``) plus the additions
seccompProfile Localhost (profile JSON  ``linux.seccomp``: the JSON read straight into
made by ``profile seccomp``)            the OCI struct (``load_seccomp``); Docker-style
                                        ``archMap``/``includes``/``excludes`` are dropped
seccompProfile Unconfined / privileged  no ``linux.seccomp``
privileged: false                       ``/dev`` is a fresh tmpfs with only runc's
                                        standard nodes (null, zero, full, tty, random,
                                        urandom, ptmx -> pts/ptmx, pts, shm, mqueue) plus
                                        ``linux.devices``; masked and read-only /proc and
                                        /sys paths; /sys and /sys/fs/cgroup read-only
privileged: true (the control only)     every device node of the host /dev (here: a fake
                                        host /dev directory), ``{allow: true, access:
                                        "rwm"}``, all capabilities the runtime has, no
                                        seccomp, no masks, writable /sys
resources.limits memory / cpuset        ``linux.resources.memory.limit``,
                                        ``linux.resources.cpu.cpus``
hostUsers: false                        a user namespace: ``uidMappings``/``gidMappings``
                                        container 0 -> host ``USERNS_HOST_ID`` (65536 ids);
                                        runc then bind-mounts device nodes from the host
                                        instead of making them, and /sys is a read-only
                                        bind of the host's (a fresh sysfs mount is refused
                                        in a user namespace that keeps the host network)
command / args                          ``process.args``
======================================  ==================================================

What differs from a real node, on purpose: the image is the host's own /usr and /etc,
bind-mounted read-only into an empty root (made in well under a second, and it has
s3fs, sshfs and lxcfs); the container keeps the host network namespace so it can reach
the test servers on 127.0.0.1 (a pod has its own network namespace); the cgroup driver
is cgroupfs with a cgroup per container under ``/fuse-e2e-<id>``.

``Runc`` and ``Container`` run the bundle with runc: every ``exec`` has a deadline, and
when it passes, every FUSE connection mounted inside the container is aborted through
fusectl (``/sys/fs/fuse/connections/N/abort``) before the process is killed, so a hung
FUSE daemon can never leave an unkillable process behind. ``Container.delete`` always
aborts the container's FUSE connections, then ``runc delete --force``.
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
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fuse_plugin.api import api_pb2 as api

Spec = dict[str, Any]

RUNC = "runc"
FUSECTL = Path("/sys/fs/fuse/connections")
USERNS_HOST_ID = 100000
USERNS_SIZE = 65536
PATH_ENV = "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"

# containerd's default capability set for a container (oci.WithDefaultUnixSpec).
DEFAULT_CAPABILITIES = (
    "CAP_CHOWN", "CAP_DAC_OVERRIDE", "CAP_FSETID", "CAP_FOWNER", "CAP_MKNOD", "CAP_NET_RAW",
    "CAP_SETGID", "CAP_SETUID", "CAP_SETFCAP", "CAP_SETPCAP", "CAP_NET_BIND_SERVICE",
    "CAP_SYS_CHROOT", "CAP_KILL", "CAP_AUDIT_WRITE",
)
# Every capability, in bit order (CAP_CHOWN is bit 0).
ALL_CAPABILITIES = (
    "CAP_CHOWN", "CAP_DAC_OVERRIDE", "CAP_DAC_READ_SEARCH", "CAP_FOWNER", "CAP_FSETID",
    "CAP_KILL", "CAP_SETGID", "CAP_SETUID", "CAP_SETPCAP", "CAP_LINUX_IMMUTABLE",
    "CAP_NET_BIND_SERVICE", "CAP_NET_BROADCAST", "CAP_NET_ADMIN", "CAP_NET_RAW",
    "CAP_IPC_LOCK", "CAP_IPC_OWNER", "CAP_SYS_MODULE", "CAP_SYS_RAWIO", "CAP_SYS_CHROOT",
    "CAP_SYS_PTRACE", "CAP_SYS_PACCT", "CAP_SYS_ADMIN", "CAP_SYS_BOOT", "CAP_SYS_NICE",
    "CAP_SYS_RESOURCE", "CAP_SYS_TIME", "CAP_SYS_TTY_CONFIG", "CAP_MKNOD", "CAP_LEASE",
    "CAP_AUDIT_WRITE", "CAP_AUDIT_CONTROL", "CAP_SETFCAP", "CAP_MAC_OVERRIDE",
    "CAP_MAC_ADMIN", "CAP_SYSLOG", "CAP_WAKE_ALARM", "CAP_BLOCK_SUSPEND", "CAP_AUDIT_READ",
    "CAP_PERFMON", "CAP_BPF", "CAP_CHECKPOINT_RESTORE",
)

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

_SECCOMP_FIELDS = ("defaultAction", "defaultErrnoRet", "architectures", "flags",
                   "listenerPath", "listenerMetadata")
_SECCOMP_RULE_FIELDS = ("names", "action", "errnoRet", "args")


@dataclass(frozen=True)
class Bind:
    """A volume: a host path bind-mounted into the container."""

    source: Path
    destination: str
    readonly: bool = False


@dataclass
class ContainerRequest:
    """One container of a pod, reduced to what these tests vary.

    ``allocation`` is the plugin's ContainerAllocateResponse for this container (None: the
    pod did not ask for github.com/fuse). ``seccomp`` is a profile as JSON text or a
    parsed dict, None for Unconfined.
    """

    args: Sequence[str]
    allocation: api.ContainerAllocateResponse | None = None
    add_capabilities: Sequence[str] = ()
    drop_capabilities: Sequence[str] = ()
    seccomp: str | Mapping[str, Any] | None = None
    env: Mapping[str, str] = field(default_factory=dict)
    binds: Sequence[Bind] = ()
    memory_limit: int | None = None
    cpuset: str | None = None
    host_users: bool = True
    privileged: bool = False
    host_dev: Path = Path("/dev")
    hostname: str = "fuse-e2e"


def device_from_path(host_path: str, container_path: str) -> tuple[dict[str, Any], str, int, int]:
    """linux.devices entry for a host node, as containerd's DeviceFromPath reads it."""
    st = os.stat(host_path)
    if stat.S_ISCHR(st.st_mode):
        kind = "c"
    elif stat.S_ISBLK(st.st_mode):
        kind = "b"
    else:
        raise ValueError(f"{host_path} is not a device node")
    major, minor = os.major(st.st_rdev), os.minor(st.st_rdev)
    device = {"path": container_path, "type": kind, "major": major, "minor": minor,
              "fileMode": stat.S_IMODE(st.st_mode), "uid": st.st_uid, "gid": st.st_gid}
    return device, kind, major, minor


def host_devices(dev_dir: Path) -> list[tuple[str, str]]:
    """(host path, container path) of every node under a host /dev, as containerd's
    HostDevices() lists them for a privileged container."""
    found = []
    for root, _dirs, files in os.walk(dev_dir):
        for name in sorted(files):
            path = Path(root, name)
            mode = path.lstat().st_mode
            if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
                found.append((str(path), "/dev/" + str(path.relative_to(dev_dir))))
    return found


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


def runtime_capabilities() -> list[str]:
    """What a privileged container gets: every capability in the runtime's own bounding
    set (containerd reads its own; a runtime inside a container may lack some)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("CapBnd:"):
            mask = int(line.split()[1], 16)
            return [c for bit, c in enumerate(ALL_CAPABILITIES) if mask >> bit & 1]
    return list(ALL_CAPABILITIES)


def _capabilities(request: ContainerRequest) -> list[str]:
    if request.privileged:
        return runtime_capabilities()
    caps = [c for c in DEFAULT_CAPABILITIES if c not in request.drop_capabilities]
    caps += [c for c in request.add_capabilities
             if c not in caps and c not in request.drop_capabilities]
    return caps


def _devices(request: ContainerRequest, allocation: api.ContainerAllocateResponse
             ) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(linux.devices, linux.resources.devices)."""
    devices: list[dict[str, Any]] = []
    rules: list[dict[str, Any]] = [dict(DENY_ALL_DEVICES), *map(dict, DEFAULT_DEVICE_RULES)]
    if request.privileged:
        devices = [device_from_path(host, inside)[0]
                   for host, inside in host_devices(request.host_dev)]
        rules = [{"allow": True, "access": "rwm"}]
    for spec in allocation.devices:
        device, kind, major, minor = device_from_path(spec.host_path, spec.container_path)
        devices = [d for d in devices if d["path"] != spec.container_path] + [device]
        if not request.privileged:
            rules.append({"allow": True, "type": kind, "major": major, "minor": minor,
                          "access": spec.permissions})
    return devices, rules


def _mounts(request: ContainerRequest, allocation: api.ContainerAllocateResponse
            ) -> list[dict[str, Any]]:
    mounts = [copy.deepcopy(m) for m in DEFAULT_MOUNTS]
    for m in mounts:
        if request.privileged and m["destination"] in ("/sys", "/sys/fs/cgroup"):
            m["options"] = [o for o in m["options"] if o != "ro"]
        if not request.host_users and m["destination"] == "/sys":
            # A fresh sysfs is refused in a userns that keeps the host network namespace.
            m.update(type="bind", source="/sys",
                     options=["rbind", "nosuid", "noexec", "nodev", "ro"])
    if not request.host_users:
        mounts = [m for m in mounts if m["destination"] != "/sys/fs/cgroup"]
    mounts += [{"destination": d, "type": "bind", "source": d, "options": ["rbind", "ro"]}
               for d in IMAGE_BINDS]
    mounts.append({"destination": "/tmp", "type": "tmpfs", "source": "tmpfs",
                   "options": ["nosuid", "nodev", "mode=1777"]})
    volumes = [Bind(Path(m.host_path), m.container_path, m.read_only)
               for m in allocation.mounts] + list(request.binds)
    mounts += [{"destination": b.destination, "type": "bind", "source": str(b.source),
                "options": ["rbind", "rprivate", "ro" if b.readonly else "rw"]}
               for b in volumes]
    return mounts


def build_spec(request: ContainerRequest) -> Spec:
    """The config.json containerd would give runc for ``request`` (see the module doc)."""
    allocation = request.allocation or api.ContainerAllocateResponse()
    if allocation.cdi_devices:
        raise NotImplementedError("CDI devices in an AllocateResponse are not modelled here")
    caps = _capabilities(request)
    devices, rules = _devices(request, allocation)
    mounts = _mounts(request, allocation)

    env = [PATH_ENV, f"HOSTNAME={request.hostname}"]
    env += [f"{k}={v}" for k, v in allocation.envs.items()]
    env += [f"{k}={v}" for k, v in request.env.items()]

    resources: dict[str, Any] = {"devices": rules}
    if request.memory_limit is not None:
        resources["memory"] = {"limit": request.memory_limit}
    if request.cpuset is not None:
        resources["cpu"] = {"cpus": request.cpuset}

    namespaces = [{"type": t} for t in ("pid", "ipc", "uts", "mount")]
    linux: dict[str, Any] = {
        "resources": resources,
        "namespaces": namespaces,
        "devices": devices,
    }
    if not request.privileged:
        linux["maskedPaths"] = list(MASKED_PATHS)
        linux["readonlyPaths"] = list(READONLY_PATHS)
        if request.seccomp is not None:
            linux["seccomp"] = load_seccomp(request.seccomp)
    if not request.host_users:
        namespaces.append({"type": "user"})
        mapping = [{"containerID": 0, "hostID": USERNS_HOST_ID, "size": USERNS_SIZE}]
        linux["uidMappings"] = mapping
        linux["gidMappings"] = copy.deepcopy(mapping)

    return {
        "ociVersion": "1.0.2",
        "process": {
            "terminal": False,
            "user": {"uid": 0, "gid": 0},
            "args": list(request.args),
            "env": env,
            "cwd": "/",
            "capabilities": {"bounding": caps, "effective": caps, "permitted": caps},
            "noNewPrivileges": False,
        },
        "root": {"path": "rootfs", "readonly": False},
        "hostname": request.hostname,
        "mounts": mounts,
        "annotations": dict(allocation.annotations),
        "linux": linux,
    }


def remove_device_rule(spec: Spec, container_path: str) -> Spec:
    """The spec without the devices-cgroup allow rule for one of its linux.devices."""
    out = copy.deepcopy(spec)
    device = next(d for d in out["linux"]["devices"] if d["path"] == container_path)
    out["linux"]["resources"]["devices"] = [
        r for r in out["linux"]["resources"]["devices"]
        if not (r.get("allow") and r.get("type") == device["type"]
                and r.get("major") == device["major"] and r.get("minor") == device["minor"])]
    return out


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


def write_bundle(bundle: Path, spec: Spec) -> Path:
    """config.json and rootfs/ under ``bundle``; returns ``bundle``."""
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
    (bundle / "config.json").write_text(json.dumps(spec, indent=1))
    return bundle


# -- FUSE connections ---------------------------------------------------------------


def ensure_fusectl() -> bool:
    """Mount fusectl on /sys/fs/fuse/connections if it is not (systemd mounts it at boot;
    this VM has no systemd). True when the abort files are usable."""
    if _is_fusectl():
        return True
    if not FUSECTL.is_dir():
        return False
    result = subprocess.run(["mount", "-t", "fusectl", "fusectl", str(FUSECTL)],
                            capture_output=True, text=True, check=False)
    return result.returncode == 0 and _is_fusectl()


def _is_fusectl() -> bool:
    try:
        mounts = Path("/proc/self/mounts").read_text()
    except OSError:
        return False
    return any(line.split()[1:3] == [str(FUSECTL), "fusectl"] for line in mounts.splitlines())


def fuse_connections_of(pid: int) -> set[int]:
    """fusectl connection numbers of the FUSE mounts in ``pid``'s mount namespace: the
    minor of the superblock's device (``0:N``) in its mountinfo."""
    found: set[int] = set()
    try:
        text = Path(f"/proc/{pid}/mountinfo").read_text()
    except OSError:
        return found
    for line in text.splitlines():
        left, _, right = line.partition(" - ")
        fstype = right.split(" ", 1)[0]
        if _is_fuse(fstype):
            major, _, minor = left.split()[2].partition(":")
            if major == "0":
                found.add(int(minor))
    return found


def _is_fuse(fstype: str) -> bool:
    return fstype in ("fuse", "fuseblk") or fstype.startswith(("fuse.", "fuseblk."))


def abort_fuse_connection(number: int) -> bool:
    try:
        (FUSECTL / str(number) / "abort").write_text("1")
    except OSError:
        return False
    return True


# -- running ------------------------------------------------------------------------


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
            raise AssertionError(f"{self.args} exited {self.returncode}\n"
                                 f"stdout: {self.stdout}\nstderr: {self.stderr}")
        return self


class ContainerTimeout(AssertionError):
    pass


def wait_for(predicate: Callable[[], Any], timeout: float, what: str,
             interval: float = 0.02) -> Any:
    """Poll real state until ``predicate()`` is truthy; fail with ``what`` at the deadline."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise TimeoutError(f"{what}: not within {timeout}s")
        time.sleep(interval)


class Runc:
    """runc with a private state root, so these containers never mix with a node's."""

    def __init__(self, base: Path | None = None) -> None:
        base = base or Path(tempfile.mkdtemp(prefix="fuse-e2e-", dir="/run"))
        # World-traversable: in a user namespace the container's root must reach its rootfs.
        base.chmod(0o711)
        self.base = base
        self.root = base / "runc"
        self.containers: list[Container] = []

    def command(self, *args: str) -> list[str]:
        return [RUNC, "--root", str(self.root), *args]

    def create(self, spec: Spec, name: str = "c") -> Container:
        cid = f"fuse-e2e-{name}-{uuid.uuid4().hex[:8]}"
        spec = copy.deepcopy(spec)
        spec["linux"]["cgroupsPath"] = f"/{cid}"
        bundle = write_bundle(self.base / cid, spec)
        container = Container(self, cid, bundle)
        self.containers.append(container)
        return container

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
            raise RuntimeError("cleanup failed: " + "; ".join(errors))


class Container:
    def __init__(self, runc: Runc, cid: str, bundle: Path) -> None:
        self.runc = runc
        self.id = cid
        self.bundle = bundle
        self.pid = 0
        self.started = False
        self.deleted = False
        self._execs = 0
        # ``runc exec`` processes left running (a foreground daemon); reaped on delete.
        self.daemons: list[subprocess.Popen[bytes]] = []

    # -- lifecycle -------------------------------------------------------------------

    def start(self, timeout: float = 20.0) -> Container:
        """``runc run --detach``; the init process is the spec's args (a long-lived one)."""
        log = self.bundle / "init.log"
        with log.open("wb") as out:
            proc = subprocess.run(
                self.runc.command("run", "--detach", "--bundle", str(self.bundle),
                                  "--pid-file", str(self.bundle / "init.pid"), self.id),
                stdin=subprocess.DEVNULL, stdout=out, stderr=out, timeout=timeout,
                check=False)
        self.started = True
        if proc.returncode != 0:
            raise AssertionError(f"runc run {self.id} failed ({proc.returncode}): "
                                 f"{log.read_text(errors='replace')}")
        self.pid = int((self.bundle / "init.pid").read_text())
        return self

    def run_to_end(self, timeout: float = 30.0) -> Result:
        """``runc run`` in the foreground: the spec's args run as the container's init;
        returns its exit status and output. For commands that fail fast (controls)."""
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
                raise RuntimeError(f"runc delete {self.id}: {proc.stderr.strip()}")
        raise RuntimeError(f"runc delete {self.id} did not finish")

    def _reap(self) -> None:
        for daemon in self.daemons:
            try:
                daemon.wait(10)
            except subprocess.TimeoutExpired:
                daemon.kill()
                daemon.wait(10)
        self.daemons.clear()

    # -- inside ----------------------------------------------------------------------

    def exec(self, *args: str, timeout: float = 20.0, detach: bool = False,
             env: Mapping[str, str] | None = None) -> Result:
        """``runc exec`` with a deadline; the process gets the container's capabilities,
        seccomp profile and cgroup. At the deadline every FUSE connection mounted in the
        container is aborted and the exec is killed (``ContainerTimeout``).

        Output goes to files, not pipes: a FUSE daemon that forks (sshfs's ssh child)
        keeps inherited pipes open long after the command itself returned."""
        self._execs += 1
        stem = self.bundle / f"exec{self._execs}"
        extra: list[str] = []
        for k, v in (env or {}).items():
            extra += ["--env", f"{k}={v}"]
        if detach:
            extra.append("--detach")
        out, err = stem.with_suffix(".out"), stem.with_suffix(".err")
        with out.open("wb") as o, err.open("wb") as e:
            proc = subprocess.Popen(self.runc.command("exec", *extra, self.id, *args),
                                    stdin=subprocess.DEVNULL, stdout=o, stderr=e)
            rc = self._wait(proc, timeout, " ".join(args))
        return Result(list(args), rc, out.read_text(errors="replace"),
                      err.read_text(errors="replace"))

    def sh(self, script: str, timeout: float = 20.0) -> Result:
        return self.exec("/bin/sh", "-c", script, timeout=timeout)

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
            if abort_fuse_connection(number):
                aborted.add(number)
        return aborted

    def mounts(self) -> list[tuple[str, str]]:
        """(mount point, fstype) of the FUSE mounts in the container's mount namespace."""
        found: list[tuple[str, str]] = []
        try:
            text = Path(f"/proc/{self.pid}/mountinfo").read_text()
        except OSError:
            return found
        for line in text.splitlines():
            left, _, right = line.partition(" - ")
            fstype = right.split(" ", 1)[0]
            if _is_fuse(fstype):
                found.append((left.split()[4], fstype))
        return found
