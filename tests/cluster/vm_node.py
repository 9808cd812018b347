"""A node of the cluster stage that runs the kernel users' nodes run (issue 45): Debian's
own Linux 6.12 under qemu (TCG: this machine offers no KVM), with AppArmor enforcing and
cgroup v2 alone, its own containerd, runc and kubelet, joined to the cluster's API server
as a Node like any other.

- **The guest** (``vm/build-guest.sh``, cached): the kernel, a Debian root in an
  initramfs (an overlay over it, so runc can pivot_root), the modules a node loads.
- **The stack** is the host's, read over 9p at the host's own paths (the cache of
  binaries and images, the cluster's certificates), so the kubelet's flags, its
  kubeconfig and containerd's configuration name the same files on both sides.
- **The node's directory** (``state``, shared read-write) holds what the host wrote for
  it (``node.env``, ``containerd.toml``, ``kubelet.sh``, the CNI config) and what the
  guest writes back: its facts (kernel, cgroup, AppArmor), each part's log and the
  kernel's list of loaded AppArmor profiles (``vm/node.sh``).
- **Network**: a tap on the cluster's bridge; in the guest a bridge of the same name holds
  the NIC and the node's address, so the API server reaches its kubelet (logs, exec) and
  its pods, on their own range of the /24, reach the API server, all on one link, as
  the second node's (``worker.py``) do.
"""

from __future__ import annotations

import contextlib
import hashlib
import shlex
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

from tests.cluster import cluster as clustermod
from tests.cluster.cluster import Cluster, node_ready
from tests.cluster.worker import further_kubelet_argv, issue_node_pki
from tests.kubelet import node as nodemod
from tests.kubelet.node import log, tail, wait_for

HERE = Path(__file__).resolve().parent / "vm"
QEMU = "qemu-system-x86_64"
MEMORY_MB = 6144
CPUS = 2
# One host thread runs both vCPUs in turn: with one thread each (MTTCG), the kernel's
# live text patching (int3, then an IPI) raced the other vCPU and panicked the guest
# at boot ("Oops: int3" in enqueue_timer), 1 boot in 3 here.
TCG_THREADS = "single"
# Inside the guest: containerd's state and root, and the pods' address book (tmpfs).
GUEST_STATE = Path("/run/fdp-vm")
GUEST_DATA = Path("/var/lib/fdp-vm")
# TCG: every step of the guest is emulated.
BOOT_TIMEOUT = 300  # to the node's facts (the kernel, init, the shares)
READY_TIMEOUT = 600  # from there to Ready: containerd, the images, the kubelet
DISK_SIZE = "8G"  # sparse: what the images take, and room for the pods' layers
# The images its pods use (tests/kubelet/images.sh's and tests/cluster/images.sh's names).
VM_IMAGES = ("PAUSE_IMAGE", "PLUGIN_IMAGE", "EXAMPLE_SSHFS_IMAGE",
             "EXAMPLE_SSHFS_NONROOT_IMAGE", "EXAMPLE_S3FS_IMAGE", "EXAMPLE_LXCFS_IMAGE")


def build_guest() -> Path:
    """The cached guest (kernel, root); built on first use."""
    r = subprocess.run([str(HERE / "build-guest.sh")], capture_output=True, text=True,
                       timeout=1800, check=False)
    if r.returncode != 0:
        raise RuntimeError(f"vm/build-guest.sh failed ({r.returncode}):\n{r.stderr[-3000:]}")
    return Path(r.stdout.strip().splitlines()[-1])


def facts_of(text: str) -> dict[str, str]:
    return dict(line.split("=", 1) for line in text.splitlines() if "=" in line)


class VmNode(nodemod.Node):
    """The VM node: ``index`` 3 is named ``<cluster node>-vm``, has the address .3 on the
    cluster's /24 and its pods .200-.250."""

    stop_order = ("qemu",)

    def __init__(self, cluster: Cluster, index: int = 3) -> None:
        super().__init__(lock=False, state=cluster.state / "vm",
                         data=cluster.data / "vm", logdir=cluster.logdir / "vm")
        self.cluster = cluster
        self.node_name = f"{clustermod.NODE_NAME}-vm"
        prefix = clustermod.NODE_IP.rsplit(".", 1)[0]
        self.node_ip = f"{prefix}.{index}"
        self.pod_range = (f"{prefix}.200", f"{prefix}.250")
        self.tap = f"fdptap{index}"
        self.mac = f"02:fd:70:00:01:{index:02x}"
        self.bridge_mac = f"02:fd:70:00:00:{index:02x}"
        self.healthz = f"http://{self.node_ip}:{clustermod.KUBELET_HEALTHZ}/healthz"
        self.containerd_sock = GUEST_STATE / "containerd" / "containerd.sock"
        self.timings: dict[str, float] = {}

    @property
    def node_dir(self) -> Path:
        return self.state

    def facts(self) -> dict[str, str]:
        path = self.node_dir / "facts"
        return facts_of(path.read_text()) if path.exists() else {}

    def apparmor_profiles(self) -> dict[str, str]:
        """The guest kernel's loaded profiles (name -> mode), as aa-status lists them."""
        path = self.node_dir / "apparmor-profiles"
        found = {}
        for line in path.read_text().splitlines() if path.exists() else ():
            name, _, mode = line.rpartition(" (")
            found[name] = mode.rstrip(")")
        return found

    def guest_log(self, name: str, lines: int = 40) -> str:
        return tail(self.node_dir / name, lines)

    # ---- what the guest is given
    def make_pki(self) -> None:
        issue_node_pki(self.cluster, self.node_name, self.node_ip)

    def kubelet_argv(self) -> list[str]:
        """The first node's kubelet, with this node's name, address, certificate and
        runtime; its cgroups the guest kernel's own (v2, no cgroup root of its own, no
        leave to run on v1)."""
        return further_kubelet_argv(self.cluster, self.node_name, self.node_ip,
                                    self.node_dir / "kubelet-config.yaml",
                                    self.containerd_sock, failCgroupV1=None)

    def write_node_dir(self) -> None:
        d = self.node_dir
        with contextlib.suppress(FileNotFoundError):
            for old in d.iterdir():
                if old.is_file():
                    old.unlink()
        d.mkdir(parents=True, exist_ok=True)
        bins = self.cluster.bins
        nodemod.render(nodemod.HERE / "containerd.toml.in", d / "containerd.toml",
                       STATE=str(GUEST_STATE), DATA=str(GUEST_DATA),
                       PAUSE_IMAGE=self.cluster.images["PAUSE_IMAGE"],
                       CNI_BIN_DIR=str(bins / "cni"), CNI_CONF_DIR=str(d / "net.d"),
                       RUNC=str(bins / "runc"))
        clustermod.write_cni_config(d / "net.d", GUEST_STATE / "ipam", *self.pod_range)
        (d / "kubelet.sh").write_text("exec " + shlex.join(self.kubelet_argv()) + "\n")
        env = {"NODE_NAME": self.node_name, "NODE_IP": self.node_ip,
               "BRIDGE": clustermod.BRIDGE, "BRIDGE_MAC": self.bridge_mac,
               "NODE_DIR": str(d), "BINS": str(bins),
               "CONTAINERD_SOCK": str(self.containerd_sock)}
        (d / "node.env").write_text("".join(f"{k}={shlex.quote(v)}\n" for k, v in env.items()))
        (d / "node.sh").write_text((HERE / "node.sh").read_text())

    def containerd_disk(self) -> Path:
        """containerd's root for the guest with this node's images already in it: an
        ext4 image made on the host, where a containerd of the stack imports them
        natively from the first node's; cached by the images and the stack. Imported in
        the guest, under TCG, 790 MB of them took longer than a node's whole start. qemu
        runs the guest on a snapshot of it (its writes go to a scratch file)."""
        images = {**self.cluster.images, **self.cluster.cluster_images}
        refs = [images[k] for k in VM_IMAGES]
        key = hashlib.sha256("\n".join([*refs, str(self.cluster.bins)]).encode())
        disks = nodemod.CACHE / "vm-node" / "disks"
        disk = disks / f"containerd-{key.hexdigest()[:12]}.raw"
        if disk.exists():
            return disk
        disks.mkdir(parents=True, exist_ok=True)
        for old in disks.glob("containerd-*"):
            old.unlink()
        tmp = disk.with_suffix(".tmp")
        with tempfile.TemporaryDirectory(dir=self.data.parent) as work_dir:
            work = Path(work_dir)
            self.cluster.ctr("images", "export", "--platform", "linux/amd64",
                             str(work / "images.tar"), *refs, timeout=600)
            subprocess.run(["truncate", "-s", DISK_SIZE, str(tmp)], check=True)
            subprocess.run(["mkfs.ext4", "-q", "-F", str(tmp)], check=True,
                           capture_output=True)
            (work / "root").mkdir()
            subprocess.run(["mount", "-o", "loop", str(tmp), str(work / "root")], check=True,
                           capture_output=True)
            try:
                self.import_into(work / "root", work / "state", work / "images.tar")
            finally:
                subprocess.run(["umount", str(work / "root")], check=True,
                               capture_output=True)
        tmp.rename(disk)
        return disk

    def import_into(self, root: Path, state: Path, tar: Path) -> None:
        """A containerd of the stack with ``root`` as its data directory (the guest's
        configuration, these paths) imports ``tar`` and stops."""
        bins = self.cluster.bins
        config = state / "containerd.toml"
        nodemod.render(nodemod.HERE / "containerd.toml.in", config, STATE=str(state),
                       DATA=str(root), PAUSE_IMAGE=self.cluster.images["PAUSE_IMAGE"],
                       CNI_BIN_DIR=str(state / "cni"), CNI_CONF_DIR=str(state / "cni"),
                       RUNC=str(bins / "runc"))
        sock = state / "containerd" / "containerd.sock"
        ctr = [str(bins / "ctr"), "--address", str(sock), "--namespace", "k8s.io"]
        with open(state / "containerd.log", "wb") as out:
            proc = subprocess.Popen([str(bins / "containerd"), "--config", str(config)],
                                    stdout=out, stderr=subprocess.STDOUT)
        try:
            wait_for(lambda: subprocess.run([*ctr, "version"], capture_output=True,
                                            check=False).returncode == 0, 30,
                     "the import's containerd to serve",
                     detail=lambda: tail(state / "containerd.log"))
            subprocess.run([*ctr, "images", "import", str(tar)], check=True,
                           capture_output=True, timeout=600)
        finally:
            proc.terminate()
            proc.wait(30)
        shutil.rmtree(state / "containerd", ignore_errors=True)

    def shares(self) -> list[Path]:
        """Host paths the guest mounts at the same paths: the cache (stack binaries)
        and the cluster's certificates, read-only; the node's own directory,
        read-write."""
        return [nodemod.CACHE, self.cluster.pki.root, self.node_dir]

    def make_initrd(self, guest: Path) -> Path:
        """The cached root, then a second archive with this tree's /init."""
        extra = self.data / "init"
        extra.mkdir(parents=True, exist_ok=True)
        (extra / "init").write_bytes((HERE / "init").read_bytes())
        (extra / "init").chmod(0o755)
        packed = subprocess.run(["cpio", "-o", "-H", "newc", "--quiet", "-R", "0:0"],
                                input=b"init\n", cwd=extra, capture_output=True,
                                check=True).stdout
        initrd = self.data / "initrd.cpio"
        with initrd.open("wb") as out, (guest / "rootfs.cpio").open("rb") as root:
            while chunk := root.read(1 << 20):
                out.write(chunk)
            out.write(packed)
        return initrd

    def make_network(self) -> None:
        self.remove_network()
        for cmd in (["tuntap", "add", "dev", self.tap, "mode", "tap"],
                    ["link", "set", self.tap, "master", clustermod.BRIDGE, "up"]):
            subprocess.run(["ip", *cmd], check=True, capture_output=True)

    def remove_network(self) -> None:
        if Path(f"/sys/class/net/{self.tap}").exists():
            subprocess.run(["ip", "link", "del", self.tap], check=False, capture_output=True)

    def qemu_argv(self, guest: Path, initrd: Path, disk: Path) -> list[str]:
        shares = self.shares()
        cmdline = " ".join([
            "console=ttyS0", "rdinit=/init", "apparmor=1", "security=apparmor",
            "cgroup_no_v1=all", "panic=-1", "loglevel=4", "random.trust_cpu=on",
            f"fdp.node_dir={self.node_dir}",
            *(f"fdp.share={self.tag(i, path)}:{path}" for i, path in enumerate(shares))])
        argv = [QEMU, "-accel", f"tcg,thread={TCG_THREADS}", "-cpu", "max", "-smp", str(CPUS),
                "-m", str(MEMORY_MB), "-display", "none", "-monitor", "none",
                "-no-reboot", "-serial", f"file:{self.logdir / 'console.log'}",
                "-kernel", str(guest / "vmlinuz"), "-initrd", str(initrd),
                "-append", cmdline,
                "-netdev", f"tap,id=n0,ifname={self.tap},script=no,downscript=no",
                "-device", f"virtio-net-pci,netdev=n0,mac={self.mac}",
                "-drive", f"file={disk},format=raw,if=virtio,snapshot=on"]
        for i, path in enumerate(shares):
            ro = ",readonly=on" if path != self.node_dir else ""
            argv += ["-virtfs",
                     f"local,path={path},mount_tag={self.tag(i, path)},security_model=none{ro}"]
        return argv

    def tag(self, index: int, path: Path) -> str:
        """A share's 9p tag: w for the node's directory (the guest mounts it uncached: its
        logs reach the host as they are written), r for the read-only rest."""
        return f"{'w' if path == self.node_dir else 'r'}{index}"

    def running(self) -> bool:
        """Whether the guest still runs; an AssertionError with its console's end if
        not (a guest that stopped will not come back: no waiting out a deadline)."""
        if not self.alive("qemu"):
            raise AssertionError(f"{self.node_name}'s qemu has exited:\n"
                                 f"{tail(self.logdir / 'console.log', 30)}")
        return True

    # ---- whole node
    def up(self, slots: int | None = None, plugin_args: tuple[str, ...] = ()) -> None:
        del slots, plugin_args  # the plugin runs as the DaemonSet
        self.down(quiet=True)
        self.logdir.mkdir(parents=True, exist_ok=True)
        for f in self.logdir.glob("*.log"):
            f.unlink()
        prepared = time.monotonic()
        guest = build_guest()
        self.make_pki()
        self.write_node_dir()
        initrd = self.make_initrd(guest)
        disk = self.containerd_disk()
        self.timings["disk_s"] = time.monotonic() - prepared
        self.make_network()
        started = time.monotonic()
        self.spawn("qemu", self.qemu_argv(guest, initrd, disk))
        console = self.logdir / "console.log"
        wait_for(lambda: self.running() and self.facts().get("cgroup"), BOOT_TIMEOUT,
                 f"{self.node_name} to boot", interval=1,
                 detail=lambda: tail(console) + tail(self.logdir / "qemu.log"))
        self.timings["boot_s"] = time.monotonic() - started
        wait_for(lambda: node_ready(self.cluster.api.node(self.node_name))
                 if self.running() and (self.node_dir / "kubelet.log").exists() else None,
                 READY_TIMEOUT, f"Node {self.node_name} Ready", interval=2,
                 detail=lambda: "\n".join([tail(console, 10), self.guest_log("node.log"),
                                           self.guest_log("kubelet.log")]))
        self.timings["ready_s"] = time.monotonic() - started
        log(f"{self.node_name} Ready: {self.facts()} {self.timings}")

    def down(self, quiet: bool = False) -> None:
        self.stop("qemu", timeout=30)
        self.remove_network()
        if not quiet:
            log(f"{self.node_name} is down")

    def unmount_all(self) -> None:
        """Nothing: the node's mounts are in its own kernel, gone with it."""
