"""The container tests' runc rig: the demo's container (``fuse_plugin.demo.container``)
plus what the tests vary and the demo never does: users and groups, user namespaces
(``hostUsers: false``), privileged pods, memory and cpuset limits, and containers that
stay up to be exec'd into. How each pod field maps to the bundle, and what differs from
a real node on purpose, is in docs/oci-harness.md.
"""

from __future__ import annotations

import contextlib
import copy
import json
import os
import stat
import subprocess
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from fuse_plugin.demo import container as base
from fuse_plugin.demo.container import (
    DEFAULT_CAPABILITIES,
    DEFAULT_DEVICE_RULES,
    DROP_ALL,
    EMPTY_DIR_OPTIONS,
    FUSECTL,
    HELLO,
    IMAGE,
    MASKED_PATHS,
    Bind,
    Container,
    ContainerError,
    ContainerTimeout,
    Result,
    Spec,
    device_entries,
    device_from_path,
    fuse_mounts_of,
    load_seccomp,
    mount_blockers,
    run_container,
    run_mount_demo,
    runc_blockers,
    seccomp_profile,
    write_bundle,
)
from tests.lib import runtimes

__all__ = [
    "ALL_CAPABILITIES",
    "DEFAULT_CAPABILITIES",
    "DEFAULT_DEVICE_RULES",
    "DROP_ALL",
    "EMPTY_DIR_OPTIONS",
    "FUSECTL",
    "HELLO",
    "IMAGE",
    "MASKED_PATHS",
    "USERNS_HOST_ID",
    "USERNS_SIZE",
    "Bind",
    "Container",
    "ContainerError",
    "ContainerRequest",
    "ContainerTimeout",
    "Result",
    "Runc",
    "RuncContainer",
    "Spec",
    "build_spec",
    "device_entries",
    "device_from_path",
    "ensure_fusectl",
    "fuse_mounts_of",
    "host_devices",
    "load_seccomp",
    "mount_blockers",
    "remove_device_rule",
    "run_container",
    "run_mount_demo",
    "runc_blockers",
    "runtime_capabilities",
    "seccomp_profile",
    "write_bundle",
]

USERNS_HOST_ID = 100000
USERNS_SIZE = 65536

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


@dataclass
class ContainerRequest(base.ContainerRequest):
    """One container of a pod, with the fields only the tests vary.

    ``user`` and ``groups`` are runAsUser/runAsGroup and supplementalGroups;
    ``no_new_privileges`` is allowPrivilegeEscalation: false; ``host_users: False`` runs
    it in a user namespace as the kubelet does for ``hostUsers: false``; ``privileged``
    gets what containerd gives a privileged container, with ``host_dev`` as the host's
    /dev (a fake one, for the GPU tests); ``proc_unmasked`` is ``procMount: Unmasked``
    (containerd then leaves out the masked and read-only /proc and /sys paths).
    """

    memory_limit: int | None = None
    cpuset: str | None = None
    cpu_shares: int | None = None  # the weight the kubelet gives the pod's CPU request
    user: tuple[int, int] = (0, 0)
    groups: Sequence[int] = ()
    no_new_privileges: bool = False
    host_users: bool = True
    privileged: bool = False
    host_dev: Path = Path("/dev")
    proc_unmasked: bool = False  # procMount: Unmasked


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


def runtime_capabilities() -> list[str]:
    """What a privileged container gets: every capability in the runtime's own bounding
    set (containerd reads its own; a runtime inside a container may lack some)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("CapBnd:"):
            mask = int(line.split()[1], 16)
            return [c for bit, c in enumerate(ALL_CAPABILITIES) if mask >> bit & 1]
    return list(ALL_CAPABILITIES)


def build_spec(request: base.ContainerRequest) -> Spec:
    """The demo's config.json, then the tests' fields applied the way containerd applies
    them."""
    spec = base.build_spec(request)
    if not isinstance(request, ContainerRequest):
        return spec
    process, linux = spec["process"], spec["linux"]
    # The chosen runtime's defaults (FUSE_E2E_RUNTIME): CRI-O's set, a subset of
    # containerd's, lacks SYS_CHROOT among others; what the pod adds stays.
    defaults = runtimes.default_capabilities()
    caps = [c for c in base.capabilities(request)
            if c in defaults or c in request.add_capabilities]
    process["capabilities"] = {"bounding": caps, "effective": caps, "permitted": caps}
    process["user"] = {"uid": request.user[0], "gid": request.user[1],
                       **({"additionalGids": list(request.groups)} if request.groups else {})}
    # True for a restricted pod (allowPrivilegeEscalation: false).
    process["noNewPrivileges"] = request.no_new_privileges
    if request.memory_limit is not None:
        linux["resources"]["memory"] = {"limit": request.memory_limit}
    if request.cpuset is not None:
        linux["resources"]["cpu"] = {"cpus": request.cpuset}
    if request.cpu_shares is not None:
        linux["resources"].setdefault("cpu", {})["shares"] = request.cpu_shares
    if request.proc_unmasked:
        linux["maskedPaths"] = []
        linux["readonlyPaths"] = []
    if request.privileged:
        _privileged(spec, request)
    if not request.host_users:
        _user_namespace(spec)
    return spec


def _privileged(spec: Spec, request: ContainerRequest) -> None:
    """Every capability of the runtime, every host device, no seccomp, no masked or
    read-only paths, sysfs and cgroupfs writable."""
    caps = runtime_capabilities()
    spec["process"]["capabilities"] = {"bounding": caps, "effective": caps,
                                       "permitted": caps}
    linux = spec["linux"]
    inside = {node["path"] for node in linux["devices"]}
    linux["devices"] = [base.device_from_path(path, target)
                        for path, target in host_devices(request.host_dev)
                        if target not in inside] + linux["devices"]
    linux["resources"]["devices"] = [{"allow": True, "access": "rwm"}]
    for key in ("maskedPaths", "readonlyPaths", "seccomp"):
        linux.pop(key, None)
    for m in spec["mounts"]:
        if m["destination"] in ("/sys", "/sys/fs/cgroup"):
            m["options"] = [o for o in m["options"] if o != "ro"]


def _user_namespace(spec: Spec) -> None:
    """A user namespace mapping the container's 0..65535 to the host's 100000.., as the
    kubelet asks for ``hostUsers: false``."""
    mounts = [m for m in spec["mounts"] if m["destination"] != "/sys/fs/cgroup"]
    for m in mounts:
        if m["destination"] == "/sys":
            # A fresh sysfs is refused in a userns that keeps the host network namespace.
            m.update(type="bind", source="/sys",
                     options=["rbind", "nosuid", "noexec", "nodev", "ro"])
    spec["mounts"] = mounts
    linux = spec["linux"]
    linux["namespaces"].append({"type": "user"})
    mapping = [{"containerID": 0, "hostID": USERNS_HOST_ID, "size": USERNS_SIZE}]
    linux["uidMappings"] = mapping
    linux["gidMappings"] = copy.deepcopy(mapping)


def remove_device_rule(spec: Spec, container_path: str) -> Spec:
    """The spec without the devices-cgroup allow rule for one of its linux.devices: the
    negative control that shows the rule, not the node, is what lets the open through."""
    out = copy.deepcopy(spec)
    device = next(d for d in out["linux"]["devices"] if d["path"] == container_path)
    out["linux"]["resources"]["devices"] = [
        r for r in out["linux"]["resources"]["devices"]
        if not (r.get("allow") and r.get("type") == device["type"]
                and r.get("major") == device["major"] and r.get("minor") == device["minor"])]
    return out


def ensure_fusectl() -> bool:
    """Mount fusectl on /sys/fs/fuse/connections if it is not (systemd mounts it at boot;
    a VM or container without systemd may not have it). True when the abort files are
    usable."""
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


# -- running -----------------------------------------------------------------------------


class Runc(base.Runc):
    """runc with a private state root whose containers can also be started and exec'd."""

    pods: set[str] | None = None  # pod cgroups made for ``create(..., pod=)``

    def made(self, cid: str, bundle: Path) -> RuncContainer:
        return RuncContainer(self, cid, bundle)

    def create(self, spec: Spec, name: str = "c", pod: str | None = None) -> RuncContainer:
        """With ``pod``, the container's cgroup is ``/POD/ID``, as the kubelet nests a
        pod's containers under the pod's cgroup (name it ``...-pod<hex>``)."""
        made = super().create(spec, name)
        assert isinstance(made, RuncContainer)
        if pod is not None:
            config = made.bundle / "config.json"
            written = json.loads(config.read_text())
            written["linux"]["cgroupsPath"] = f"/{pod}/{made.id}"
            config.write_text(json.dumps(written, indent=1))
            self.pods = {*(self.pods or ()), pod}
        return made

    def close(self) -> None:
        """The containers, then the pod cgroups their runc left behind (empty)."""
        try:
            super().close()
        finally:
            for pod in self.pods or ():
                root = Path("/sys/fs/cgroup")
                for directory in (root / pod, *root.glob(f"*/{pod}")):
                    with contextlib.suppress(OSError):
                        directory.rmdir()


class RuncContainer(base.RuncContainer):
    """A container that is started, exec'd into, and deleted with its FUSE daemons."""

    def __init__(self, runc: base.Runc, cid: str, bundle: Path) -> None:
        super().__init__(runc, cid, bundle)
        self._execs = 0
        # ``runc exec`` processes left running (a foreground daemon); reaped on delete.
        self.daemons: list[subprocess.Popen[bytes]] = []

    def start(self, timeout: float = 20.0) -> RuncContainer:
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
            raise ContainerError(f"runc run {self.id} failed ({proc.returncode}): "
                                 f"{log.read_text(errors='replace')}")
        self.pid = int((self.bundle / "init.pid").read_text())
        return self

    def _reap(self) -> None:
        for daemon in self.daemons:
            try:
                daemon.wait(10)
            except subprocess.TimeoutExpired:
                daemon.kill()
                daemon.wait(10)
        self.daemons.clear()

    def exec(self, *args: str, timeout: float = 20.0, detach: bool = False,
             env: Mapping[str, str] | None = None, user: str | None = None) -> Result:
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
        if user is not None:  # UID:GID, as the process's own (runc exec --user)
            extra += ["--user", user]
        out, err = stem.with_suffix(".out"), stem.with_suffix(".err")
        with out.open("wb") as o, err.open("wb") as e:
            proc = subprocess.Popen(self.runc.command("exec", *extra, self.id, *args),
                                    stdin=subprocess.DEVNULL, stdout=o, stderr=e)
            rc = self._wait(proc, timeout, " ".join(args))
        return Result(list(args), rc, out.read_text(errors="replace"),
                      err.read_text(errors="replace"))

    def sh(self, script: str, timeout: float = 20.0) -> Result:
        return self.exec("/bin/sh", "-c", script, timeout=timeout)

    def mounts(self) -> list[tuple[str, str]]:
        """(mount point, fstype) of the FUSE mounts in the container's mount namespace."""
        return [(point, fstype) for point, fstype, _ in fuse_mounts_of(self.pid)]
