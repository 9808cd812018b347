"""The cluster stage's container runtime, chosen by one variable: ``FUSE_E2E_RUNTIME``
is ``containerd`` (the default) or ``crio`` (tests/lib/runtimes.py reads it).

cluster.py keeps one code path: it calls ``start`` where the runtime comes up,
``endpoint`` for the kubelet's ``--container-runtime-endpoint`` and ``clean`` after
teardown. containerd's start-up is tests/kubelet/node.py's (shared with the kubelet
stage); CRI-O's is here: its config (``crio.conf.in``), its images imported into its own
storage with podman, the process recorded and stopped like every other one of the node.

CRI-O is tests/stack/build.sh's (built when the variable says crio, at
``CRIO`` in tests/stack/versions.env), with its pinns; conmon is Debian's.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
from pathlib import Path

from tests.kubelet import node as nodemod
from tests.kubelet.node import Node, log, tail, wait_for
from tests.lib.runtimes import is_crio

HERE = Path(__file__).resolve().parent
CONMON = Path("/usr/bin/conmon")
# The podman storage tests/cluster/images.sh builds the stage's images in (its PODMAN).
BUILDER_STORE = (nodemod.CACHE / "cluster" / "podman",
                 Path("/run/fuse-device-plugin-cluster/podman"))


# ---------------------------------------------------------------- CRI-O


def crio_dir(node: Node) -> Path:
    return node.state / "crio"


def crio_socket(node: Node) -> Path:
    return crio_dir(node) / "crio.sock"


def crio_store(node: Node) -> tuple[Path, Path]:
    """CRI-O's image store: its root and runroot, as crio.conf.in sets them."""
    return node.data / "crio" / "storage", node.state / "crio" / "storage"


def podman(store: tuple[Path, Path], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["podman", "--root", str(store[0]), "--runroot", str(store[1]),
                           "--storage-driver", "overlay", "--cgroup-manager", "cgroupfs",
                           "--events-backend", "file", *args],
                          capture_output=True, text=True, timeout=600, check=False)


def import_images(node: Node) -> None:
    """Every image the node's pods use, into CRI-O's store. The stage's own images are
    copied store to store from images.sh's podman storage, where every tag stays (the
    archive the containerd path imports is one per build and another run's set-up may
    replace it); the kubelet stage's pause and workload images are OCI archives, loaded
    under their short ref and tagged with the name the pods use."""
    mine = crio_store(node)
    target = f"containers-storage:[overlay@{mine[0]}+{mine[1]}]"
    for ref, tar in node.wanted_images():
        if podman(mine, "image", "exists", ref).returncode == 0:
            continue
        log(f"importing {ref} into CRI-O's store")
        if podman(BUILDER_STORE, "image", "exists", ref).returncode == 0:
            r = podman(BUILDER_STORE, "push", "--quiet", ref, target + ref)
        else:
            r = podman(mine, "load", "-i", tar)
            loaded = [line.split(":", 1)[1].strip() for line in r.stdout.splitlines()
                      if line.startswith("Loaded image")]
            if r.returncode == 0 and loaded and loaded != [ref]:
                r = podman(mine, "tag", loaded[-1], ref)
        if r.returncode != 0 or podman(mine, "image", "exists", ref).returncode != 0:
            raise RuntimeError(f"{ref} is not in CRI-O's store after import from {tar}: "
                               f"{r.stderr.strip()}")


def serving(path: Path) -> bool:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.connect(str(path))
    return True


def start_crio(node: Node) -> None:
    d = crio_dir(node)
    cni_bin, cni_conf = node.cni_dirs()
    for sub in (d, d / "hooks.d", d / "ns", d / "exits", d / "attach", cni_conf,
                node.data / "crio"):
        sub.mkdir(parents=True, exist_ok=True)
    # As for containerd (node.py): a user-namespaced container's root must pass through
    # these to its rootfs under the runroot.
    for sub in (node.state, d):
        sub.chmod(0o711)
    # Our images come from local archives, never a registry: accept them as they are.
    (d / "policy.json").write_text(json.dumps(
        {"default": [{"type": "insecureAcceptAnything"}]}))
    wrapper = d / "runc-node"
    node.render(HERE / "runc-node.in", wrapper, RUNC=str(node.bins / "runc"))
    wrapper.chmod(0o755)
    cfg = d / "crio.conf"
    node.render(HERE / "crio.conf.in", cfg, SOCKET=str(crio_socket(node)),
                PINNS=str(node.bins / "pinns"), RUNTIME=str(wrapper),
                CONMON=str(CONMON), PAUSE_IMAGE=node.images["PAUSE_IMAGE"],
                CNI_BIN_DIR=str(cni_bin), CNI_CONF_DIR=str(cni_conf))
    import_images(node)
    # --config-dir to an empty directory: no drop-in of the machine's /etc/crio applies.
    (d / "conf.d").mkdir(exist_ok=True)
    node.spawn("crio", [str(node.bins / "crio"), "--config", str(cfg),
                        "--config-dir", str(d / "conf.d"), "--log-level", "info"])
    wait_for(lambda: node.alive("crio") and serving(crio_socket(node)), 60,
             "CRI-O to serve its socket", detail=lambda: tail(node.logdir / "crio.log"))


def kill_conmons(node: Node) -> None:
    """conmon outlives CRI-O by design (it holds the container's stdio and exit code):
    after a failed run, kill the monitors and container inits CRI-O recorded under our
    runroot, by their pid files, never by name."""
    root = node.state / "crio" / "storage" / "overlay-containers"
    if not root.is_dir():
        return
    for pidfile in [*root.glob("*/userdata/pidfile"), *root.glob("*/userdata/conmon-pidfile")]:
        with contextlib.suppress(OSError, ValueError):
            pid = int(pidfile.read_text().strip())
            exe = os.readlink(f"/proc/{pid}/exe")
            log(f"killing leftover {exe} pid {pid} recorded in {pidfile}")
            os.kill(pid, signal.SIGKILL)


def oci_config(node: Node, container_id: str) -> Path:
    """The config.json the runtime handed runc for a container the API server names
    ``containerd://ID`` or ``cri-o://ID``."""
    kind, _, cid = container_id.partition("://")
    if kind == "cri-o":
        return (node.state / "crio" / "storage" / "overlay-containers" / cid / "userdata"
                / "config.json")
    if kind == "containerd":
        return (node.state / "containerd" / "state" / "io.containerd.runtime.v2.task"
                / "k8s.io" / cid / "config.json")
    raise ValueError(f"no runtime known for container id {container_id!r}")


# ---------------------------------------------------------------- the hooks


def start(node: Node) -> None:
    """Bring the chosen runtime up with the node's images in it."""
    if is_crio():
        kill_conmons(node)
        start_crio(node)
    else:
        node.start_containerd()


def endpoint(node: Node) -> str:
    """The kubelet's --container-runtime-endpoint."""
    return f"unix://{crio_socket(node) if is_crio() else node.containerd_sock}"


def clean(node: Node) -> None:
    """Before the node's processes are stopped and its mounts undone: containers the
    runtime would leave running on its own."""
    if is_crio():
        kill_conmons(node)
        shutil.rmtree(node.state / "crio" / "exits", ignore_errors=True)
