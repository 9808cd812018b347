"""A further node of the cluster stage, built as kind builds its nodes: a kubelet and a
containerd of its own in a mount and network namespace of their own, joined to the
cluster's API server under its own name.

Why namespaces and not a second kubelet beside the first: the kubelet hard-codes
/var/lib/kubelet/device-plugins/kubelet.sock (and the DRA registry under the same root),
and our DaemonSets use fixed hostPaths (/var/lib/fuse-device-plugin, /run/fuse-device-
plugin, /var/run/cdi). A holder process (`unshare --mount --net`, then `sleep`) keeps the
namespaces; in its mount namespace a directory of this node's own is bound over each of
those paths (NODE_PATHS), so every process this node starts through `nsenter`, and every
pod its kubelet runs, sees its own. Its network namespace has a bridge of the same name
as the cluster's, joined to the host's by a veth: one layer-2 segment, on which the node
has its own address and its pods their own range of the /24, so pods of both nodes and
the API server reach each other with no route and no forwarding. Its kubelet's cgroup
root is its own (`cgroupRoot`), so neither kubelet sees the other's pods as orphans.

The binaries, images and certificates come from the cluster (the same cached stack); the
node's state, data and logs are under the cluster's, in a directory named after it.
"""

from __future__ import annotations

import contextlib
import shutil
import subprocess
from pathlib import Path

import yaml

from fuse_plugin.broker import mountinfo
from tests.cluster import cluster as clustermod
from tests.cluster.cluster import Cluster, node_ready
from tests.kubelet import node as nodemod
from tests.kubelet.node import log, tail, wait_for

# The paths a node's parts share with no other node: the kubelet's root (device plugins,
# DRA registry, seccomp profiles, pod volumes), its pod logs, the runtime's default state
# (containerd 2 puts its shims' sockets under /run/containerd/s) and our DaemonSets'
# hostPaths (/run/fuse-broker is not one: it is where a pod sees the broker's directory).
# /etc/apparmor.d stays shared: there is no AppArmor here and the cluster's teardown
# removes what the installers wrote.
NODE_PATHS = (
    Path("/var/lib/kubelet"),
    Path("/var/log/pods"),
    Path("/var/log/containers"),
    Path("/run/containerd"),
    Path("/var/lib/fuse-device-plugin"),
    Path("/run/fuse-device-plugin"),
    Path("/run/cdi"),  # /var/run/cdi: /var/run is /run
)
HOLDER = "namespaces"
# Only the host side of the veth has a name to choose; the node's side is `uplink`.
UPLINK = "uplink"


class Worker(nodemod.Node):
    """One more node: ``index`` 2 is named ``<cluster node>2``, has the address .2 on the
    cluster's /24 and its pods .130-.199 (the first node's are .10-.127, the VM node's
    .200-.250)."""

    stop_order = ("kubelet", "containerd", HOLDER)

    def __init__(self, cluster: Cluster, index: int) -> None:
        super().__init__(lock=False, state=cluster.state / f"node{index}",
                         data=cluster.data / f"node{index}",
                         logdir=cluster.logdir / f"node{index}")
        self.cluster = cluster
        self.node_name = f"{clustermod.NODE_NAME}{index}"
        self.node_ip = clustermod.NODE_IP.rsplit(".", 1)[0] + f".{index}"
        self.veth = f"fdpv{index}"
        self.cgroup_root = f"/{self.node_name}"
        self.healthz = f"http://{self.node_ip}:{clustermod.KUBELET_HEALTHZ}/healthz"
        self.kubelet_root = self.private(nodemod.KUBELET_ROOT)

    # ---- where this node's private paths live as the host sees them
    def private(self, path: Path) -> Path:
        """The host's view of this node's ``path`` (one of NODE_PATHS or under one)."""
        base = self.state if path.is_relative_to("/run") else self.data
        return base / "root" / path.relative_to("/")

    def holder_pid(self) -> int:
        pid = self.pid(HOLDER)
        if pid is None:
            raise RuntimeError(f"{self.node_name}: its namespaces' holder is not running")
        return pid

    def inside(self, argv: list[str]) -> list[str]:
        """``argv`` run in this node's mount and network namespaces."""
        return ["nsenter", f"--target={self.holder_pid()}", "--mount", "--net", "--", *argv]

    def run_inside(self, *argv: str) -> str:
        r = subprocess.run(self.inside(list(argv)), capture_output=True, text=True,
                           timeout=60, check=False)
        if r.returncode != 0:
            raise RuntimeError(f"{self.node_name}: {' '.join(argv)} failed "
                               f"({r.returncode}): {r.stderr.strip()}")
        return r.stdout

    def spawn(self, name: str, argv: list[str], logfile: Path | None = None,
              env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
        if name != HOLDER:
            argv = self.inside(argv)
        return super().spawn(name, argv, logfile, env)

    # ---- namespaces, paths, network, cgroups
    def make_namespaces(self) -> None:
        self.spawn(HOLDER, ["unshare", "--mount", "--net", "--propagation", "private",
                            "--", "sleep", "infinity"])
        # The holder is ready once its mount namespace is no longer ours.
        own = Path("/proc/self/ns/mnt").resolve()
        wait_for(lambda: Path(f"/proc/{self.holder_pid()}/ns/mnt").resolve() != own,
                 10, f"{self.node_name}'s namespaces")
        for path in NODE_PATHS:
            src = self.private(path)
            shutil.rmtree(src, ignore_errors=True)  # a node starts empty, as kind's do
            src.mkdir(parents=True)
            path.mkdir(parents=True, exist_ok=True)
            self.run_inside("mount", "--bind", str(src), str(path))

    def make_network(self) -> None:
        pid = str(self.holder_pid())
        subprocess.run(["ip", "link", "add", self.veth, "type", "veth", "peer", "name",
                        UPLINK, "netns", pid], check=True, capture_output=True)
        subprocess.run(["ip", "link", "set", self.veth, "master", clustermod.BRIDGE, "up"],
                       check=True, capture_output=True)
        for cmd in (["link", "set", "lo", "up"],
                    ["link", "add", clustermod.BRIDGE, "address",
                     clustermod.BRIDGE_MAC[:-2] + "02", "type", "bridge"],
                    ["addr", "add", f"{self.node_ip}/24", "dev", clustermod.BRIDGE],
                    ["link", "set", clustermod.BRIDGE, "up"],
                    ["link", "set", UPLINK, "master", clustermod.BRIDGE, "up"]):
            self.run_inside("ip", *cmd)
        prefix = clustermod.NODE_IP.rsplit(".", 1)[0]
        clustermod.write_cni_config(self.cni_dirs()[1], self.state / "cni" / "ipam",
                                    f"{prefix}.130", f"{prefix}.199")

    def make_cgroups(self) -> None:
        """The kubelet's cgroup root in every hierarchy: the kubelet refuses a root that
        does not exist, and a cpuset child starts with no CPUs and no memory nodes."""
        for hierarchy in cgroup_hierarchies():
            d = hierarchy / self.cgroup_root.lstrip("/")
            d.mkdir(exist_ok=True)
            for f in ("cpuset.cpus", "cpuset.mems"):
                if (d / f).exists() and not (d / f).read_text().strip():
                    (d / f).write_text((hierarchy / f).read_text())

    def remove_cgroups(self) -> None:
        """The cgroup root and what the kubelet made under it, deepest first (a cgroup
        directory goes with rmdir once it has no tasks and no children)."""
        for hierarchy in cgroup_hierarchies():
            root = hierarchy / self.cgroup_root.lstrip("/")
            if not root.is_dir():
                continue
            dirs = [p for p in root.rglob("*") if p.is_dir()] + [root]
            for d in sorted(dirs, key=lambda p: len(p.parts), reverse=True):
                with contextlib.suppress(OSError):
                    d.rmdir()

    # ---- what containerd is given: the cluster's CNI plugins and images
    def cni_dirs(self) -> tuple[Path, Path]:
        return self.cluster.bins / "cni", self.state / "cni" / "net.d"

    def wanted_images(self) -> list[tuple[str, str]]:
        return self.cluster.wanted_images()

    # ---- kubelet
    def make_pki(self) -> None:
        issue_node_pki(self.cluster, self.node_name, self.node_ip)

    def kubelet_argv(self) -> list[str]:
        """The first node's kubelet, with this node's name, address, certificate and
        cgroup root."""
        return further_kubelet_argv(self.cluster, self.node_name, self.node_ip,
                                    self.state / "kubelet-config.yaml", self.containerd_sock,
                                    cgroupRoot=self.cgroup_root)

    def start_kubelet(self) -> None:
        self.spawn("kubelet", self.kubelet_argv())
        wait_for(lambda: self.alive("kubelet") and nodemod.http_get(self.healthz) == "ok",
                 60, f"{self.node_name}'s kubelet healthz",
                 detail=lambda: tail(self.logdir / "kubelet.log"))
        wait_for(lambda: node_ready(self.cluster.api.node(self.node_name)), 90,
                 f"Node {self.node_name} Ready", interval=0.5,
                 detail=lambda: tail(self.logdir / "kubelet.log"))
        wait_for((self.kubelet_root / "device-plugins" / "kubelet.sock").is_socket, 30,
                 f"kubelet.sock in {self.node_name}'s device-plugin dir",
                 detail=lambda: tail(self.logdir / "kubelet.log"))

    # ---- whole node
    def up(self, slots: int | None = None, plugin_args: tuple[str, ...] = ()) -> None:
        del slots, plugin_args  # the plugin runs as the DaemonSet
        self.down(quiet=True)
        self.logdir.mkdir(parents=True, exist_ok=True)
        for f in self.logdir.glob("*.log"):
            f.unlink()
        self.make_namespaces()
        self.make_network()
        self.make_cgroups()
        self.make_pki()
        self.start_containerd()
        self.start_kubelet()

    def down(self, quiet: bool = False) -> None:
        """Stop the kubelet, the node's containers, containerd and the holder: the
        namespaces, and every mount made in them, go with their last process."""
        self.stop("kubelet")
        self.remove_containers()
        self.stop("containerd")
        self.kill_recorded_shims()
        self.stop(HOLDER)
        for rec in self.pids.glob("*.json") if self.pids.is_dir() else []:
            self.stop(rec.stem)
        if Path(f"/sys/class/net/{self.veth}").exists():
            subprocess.run(["ip", "link", "del", self.veth], check=False, capture_output=True)
        self.remove_cgroups()
        if not quiet:
            log(f"{self.node_name} is down")

    def unmount_all(self) -> None:
        """Nothing: this node's mounts are in its own namespace, gone with it."""


def issue_node_pki(cluster: Cluster, name: str, ip: str) -> None:
    """A further node's serving certificate and kubeconfig, from the cluster's CA."""
    p = cluster.pki
    p.issue(f"{name}-serving", name, server=True, sans=(f"DNS:{name}", f"IP:{ip}"))
    p.kubeconfig(name, clustermod.SERVER,
                 p.issue(name, f"system:node:{name}", orgs=("system:nodes",)))


def further_kubelet_argv(cluster: Cluster, name: str, ip: str, config: Path, runtime: Path,
                         **settings: object) -> list[str]:
    """The first node's kubelet as a further node's: its name, address, certificates
    (``issue_node_pki``) and runtime socket, and KubeletConfiguration fields of its own
    (None removes one); its configuration written to ``config``."""
    argv = cluster.kubelet_argv()
    first = cluster.state / "kubelet-config.yaml"
    pki = cluster.pki.root
    cfg = yaml.safe_load(first.read_text())
    cfg.update(address=ip, healthzBindAddress=ip, tlsCertFile=f"{pki}/{name}-serving.crt",
               tlsPrivateKeyFile=f"{pki}/{name}-serving.key", **settings)
    config.write_text(yaml.safe_dump({k: v for k, v in cfg.items() if v is not None}))
    swap = {f"--config={first}": f"--config={config}",
            f"--kubeconfig={pki}/kubelet.kubeconfig": f"--kubeconfig={pki}/{name}.kubeconfig"}
    drop = ("--hostname-override=", "--node-ip=", "--container-runtime-endpoint=")
    return [swap.get(a, a) for a in argv if not a.startswith(drop)] + [
        f"--hostname-override={name}", f"--node-ip={ip}",
        f"--container-runtime-endpoint=unix://{runtime}"]


def cgroup_hierarchies() -> list[Path]:
    """Every cgroup hierarchy mounted on this machine (v1 controllers, v2's unified)."""
    return [Path(e.mountpoint)
            for e in mountinfo.parse(Path("/proc/self/mountinfo").read_text())
            if e.fstype in ("cgroup", "cgroup2")]
