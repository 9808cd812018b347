#!/usr/bin/env python3
"""Start and stop the real-kubelet e2e node: a private containerd, a standalone
kubelet (built by setup.sh) and, on request, our device plugin.

    node.py up [--slots N]   start containerd + kubelet (+ `fuse-device-plugin serve`)
    node.py down             tear down by recorded PIDs, unmount what was mounted
    node.py status           show recorded processes and the kubelet's pods

Every process is started here and recorded in $STATE/pids/NAME.json with its PID
and its start time (from /proc/PID/stat); teardown signals only a recorded PID
whose start time still matches, so a recycled PID is never hit.  Processes are
never looked up or killed by name.  The test module imports this file.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import http.client
import json
import os
import re
import shutil
import signal
import stat
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

from fuse_plugin.broker import mountinfo
from tests.lib import waiting
from tests.lib.waiting import Timeout

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
STATE = Path(os.environ.get("FDP_E2E_STATE", "/run/fuse-device-plugin-e2e"))
DATA = Path(os.environ.get("FDP_E2E_DATA", "/var/lib/fuse-device-plugin-e2e"))
LOGDIR = Path(os.environ.get("FDP_E2E_LOGDIR", "/var/log/fuse-device-plugin-e2e"))
CACHE = Path(os.environ.get("FDP_CACHE", "/var/cache/fuse-device-plugin"))
# The kubelet hard-codes /var/lib/kubelet/device-plugins/kubelet.sock (and the DRA plugin
# registry under the same root), so the kubelet root must be /var/lib/kubelet.
KUBELET_ROOT = Path("/var/lib/kubelet")
DEVICE_PLUGIN_DIR = KUBELET_ROOT / "device-plugins"
SECCOMP_ROOT = KUBELET_ROOT / "seccomp"
NODE_NAME = "fdp-e2e-node"
READONLY = "http://127.0.0.1:10255"
HEALTHZ = "http://127.0.0.1:10248/healthz"
CONTAINERD_SOCK = STATE / "containerd" / "containerd.sock"
MANIFESTS = STATE / "manifests"
PIDS = STATE / "pids"
# One e2e node at a time on this machine: this stage and tests/cluster take this lock.
LOCK = DATA / "lock"
RESOURCE = "github.com/fuse"
RUN_ANNOTATION = "fuse-device-plugin.e2e/run"

# teardown order: consumers before what they consume
STOP_ORDER = ["kubelet", "plugin", "broker", "sshd", "installer", "containerd"]

T = TypeVar("T")


def log(msg: str) -> None:
    print(f"[node {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# What a node's parts raise while they come up (connection refused, a half-written
# answer, a pod not listed yet, ctr failing): polled again, reported at the deadline.
NOT_YET: tuple[type[Exception], ...] = (
    OSError, ValueError, LookupError, RuntimeError, http.client.HTTPException,
    subprocess.SubprocessError)


def wait_for(pred: Callable[[], T | None], timeout: float, what: str, interval: float = 0.2,
             detail: Callable[[], str] | None = None) -> T:
    """``tests.lib.waiting.wait_for`` with the node's NOT_YET errors retried."""
    return waiting.wait_for(pred, timeout, what, interval=interval, detail=detail,
                            retry_on=NOT_YET)


# ---------------------------------------------------------------- processes


def proc_start_time(pid: int) -> int | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat[stat.rindex(")") + 2 :].split()
    if fields[0] == "Z":
        return None
    return int(fields[19])


class Node:
    """A private containerd and a kubelet, processes recorded under ``state``/pids.

    ``state``, ``data`` and ``logdir`` default to this stage's; tests/cluster passes its
    own, so the two stages never share a containerd. They do share the kubelet's root
    (/var/lib/kubelet, hard-coded by the kubelet for device plugins) and so one lock.
    Every binary (kubelet, containerd and its shim, ctr, runc) comes from ``bins``, the
    stack tests/stack/build.sh built."""

    # teardown order: consumers before what they consume
    stop_order: tuple[str, ...] = tuple(STOP_ORDER)

    def __init__(
        self,
        kubelet_bin: Path | None = None,
        plugin_bin: Path | None = None,
        lock: bool = True,
        *,
        state: Path = STATE,
        data: Path = DATA,
        logdir: Path = LOGDIR,
    ) -> None:
        self.state, self.data, self.logdir = state, data, logdir
        self.bins = stack_bin()
        self.containerd_sock = state / "containerd" / "containerd.sock"
        self.manifests = state / "manifests"
        self.pids = state / "pids"
        self.kubelet_bin = kubelet_bin or Path(os.environ.get("FDP_KUBELET") or
                                               self.bins / "kubelet")
        self.plugin_bin = plugin_bin or find_plugin()
        self.children: dict[str, subprocess.Popen[bytes]] = {}
        self.images = read_images_env()
        self._lockf = None
        if lock:
            LOCK.parent.mkdir(parents=True, exist_ok=True)
            self._lockf = open(LOCK, "w")  # noqa: SIM115
            try:
                fcntl.flock(self._lockf, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                log(f"waiting for another e2e run holding {LOCK}")
                fcntl.flock(self._lockf, fcntl.LOCK_EX)

    def unlock(self) -> None:
        """Let the next e2e node have the machine. A pytest run holds stages in one
        process: a lock left to garbage collection would make the next stage's Node wait
        on its own process for ever."""
        if self._lockf is not None:
            fcntl.flock(self._lockf, fcntl.LOCK_UN)
            self._lockf.close()
            self._lockf = None

    # ---- recorded processes
    def spawn(
        self,
        name: str,
        argv: list[str],
        logfile: Path | None = None,
        env: dict[str, str] | None = None,
    ) -> subprocess.Popen[bytes]:
        self.pids.mkdir(parents=True, exist_ok=True)
        logfile = logfile or self.logdir / f"{name}.log"
        logfile.parent.mkdir(parents=True, exist_ok=True)
        out = open(logfile, "ab")  # noqa: SIM115
        out.write(f"\n==== {time.strftime('%F %T')} start {' '.join(argv)}\n".encode())
        out.flush()
        p = subprocess.Popen(
            argv,
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
            env=env,
        )
        out.close()
        st = proc_start_time(p.pid)
        (self.pids / f"{name}.json").write_text(
            json.dumps({"pid": p.pid, "start_time": st, "argv": argv, "log": str(logfile)})
        )
        self.children[name] = p
        log(f"started {name} pid {p.pid}: {' '.join(argv)}")
        return p

    def record(self, name: str) -> dict[str, Any] | None:
        try:
            rec: dict[str, Any] = json.loads((self.pids / f"{name}.json").read_text())
            return rec
        except (OSError, ValueError):
            return None

    def alive(self, name: str) -> bool:
        p = self.children.get(name)
        if p is not None:
            return p.poll() is None
        rec = self.record(name)
        return rec is not None and proc_start_time(rec["pid"]) == rec["start_time"]

    def pid(self, name: str) -> int | None:
        rec = self.record(name)
        return rec["pid"] if rec and self.alive(name) else None

    def send_signal(self, name: str, sig: int) -> bool:
        """Send sig to the recorded process if it is still the one we started."""
        rec = self.record(name)
        if rec is None or not self.alive(name):
            return False
        with contextlib.suppress(ProcessLookupError):
            os.kill(rec["pid"], sig)
        return True

    def stop(self, name: str, sig: int = signal.SIGTERM, timeout: float = 20) -> None:
        if self.send_signal(name, sig):
            log(f"stopping {name} (pid {self.record(name)['pid']}) with {signal.Signals(sig).name}")  # type: ignore[index]
            try:
                wait_for(lambda: not self.alive(name), timeout, f"{name} to exit")
            except Timeout:
                log(f"{name} did not exit on {signal.Signals(sig).name}: SIGKILL")
                self.send_signal(name, signal.SIGKILL)
                wait_for(lambda: not self.alive(name), 10, f"{name} to exit after SIGKILL")
        p = self.children.pop(name, None)
        if p is not None:
            p.wait()
        with contextlib.suppress(FileNotFoundError):
            (self.pids / f"{name}.json").unlink()

    # ---- containerd
    def ctr(self, *args: str, check: bool = True, timeout: float = 120) -> str:
        r = subprocess.run(
            [str(self.bins / "ctr"), "--address", str(self.containerd_sock), "--namespace",
             "k8s.io", *args],
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )
        if check and r.returncode != 0:
            raise RuntimeError(f"ctr {' '.join(args)} failed ({r.returncode}): {r.stderr.strip()}")
        return r.stdout

    def cni_dirs(self) -> tuple[Path, Path]:
        """(bin_dir, conf_dir) for containerd's CRI: empty here, so every pod is hostNetwork."""
        return self.state / "cni" / "bin", self.state / "cni" / "net.d"

    def wanted_images(self) -> list[tuple[str, str]]:
        """(reference, tarball) of every image the node's pods use, imported if missing."""
        return [(self.images[f"{k}_IMAGE"], self.images[f"{k}_TAR"]) for k in ("PAUSE", "WORKLOAD")]

    def start_containerd(self) -> None:
        cni_bin, cni_conf = self.cni_dirs()
        for d in [
            self.state / "containerd" / "state",
            self.data / "containerd" / "root",
            cni_bin,
            cni_conf,
        ]:
            d.mkdir(parents=True, exist_ok=True)
        # A user-namespaced container's root (an unprivileged uid of the node) must pass
        # through these to reach its rootfs under containerd's state; podman, which the
        # cluster stage's images.sh runs with a runroot in the state dir, makes it 0700.
        for d in (self.state, self.state / "containerd"):
            d.chmod(0o711)
        cfg = self.state / "containerd.toml"
        self.render(
            HERE / "containerd.toml.in",
            cfg,
            PAUSE_IMAGE=self.images["PAUSE_IMAGE"],
            CNI_BIN_DIR=str(cni_bin),
            CNI_CONF_DIR=str(cni_conf),
            RUNC=str(self.bins / "runc"),
        )
        # containerd finds containerd-shim-runc-v2 on its PATH.
        self.spawn("containerd", [str(self.bins / "containerd"), "--config", str(cfg)],
                   env={**os.environ, "PATH": f"{self.bins}:{os.environ.get('PATH', '')}"})
        wait_for(
            lambda: (
                self.alive("containerd")
                and subprocess.run(
                    [str(self.bins / "ctr"), "--address", str(self.containerd_sock),
                     "version"],
                    capture_output=True,
                    check=False,
                ).returncode
                == 0
            ),
            30,
            "containerd to serve its socket",
            detail=lambda: tail(self.logdir / "containerd.log"),
        )
        wanted = self.wanted_images()
        have = set(self.ctr("images", "ls", "-q").split())
        for tar in dict.fromkeys(tar for ref, tar in wanted if ref not in have):
            log(f"importing {tar}")
            self.ctr("images", "import", tar, timeout=600)
        have = set(self.ctr("images", "ls", "-q").split())
        missing = [ref for ref, _ in wanted if ref not in have]
        if missing:
            raise RuntimeError(
                f"images not in containerd after import: {missing}; have {sorted(have)}"
            )

    def render(self, src: Path, dst: Path, **extra: str) -> None:
        """Copy a template, filling @STATE@, @DATA@ and the @NAME@s given."""
        render(src, dst, STATE=str(self.state), DATA=str(self.data), **extra)

    # ---- kubelet
    node_name = NODE_NAME
    healthz = HEALTHZ

    def kubelet_argv(self) -> list[str]:
        """The standalone kubelet: static pods from a directory, no API server."""
        cfg = self.state / "kubelet-config.yaml"
        self.render(HERE / "kubelet-config.yaml.in", cfg)
        sock = f"unix://{self.containerd_sock}"
        return [
            str(self.kubelet_bin),
            f"--config={cfg}",
            f"--container-runtime-endpoint={sock}",
            f"--root-dir={KUBELET_ROOT}",
            f"--hostname-override={self.node_name}",
            "--v=2",
        ]

    def wait_kubelet_serving(self) -> None:
        wait_for(
            lambda: self.pods() is not None,
            30,
            "kubelet read-only port /pods",
            detail=lambda: tail(self.logdir / "kubelet.log"),
        )

    def cri_socket(self) -> Path:
        """The socket of the runtime the kubelet talks to (containerd here)."""
        return self.containerd_sock

    def start_kubelet(self) -> None:
        # The kubelet checks the runtime once and exits on "server is not initialized yet":
        # containerd serves its socket before its CRI service has loaded its state, which
        # on a loaded machine, after a run with many pods, takes seconds.
        wait_for(lambda: cri_ready(self.cri_socket()), 60,
                 f"the CRI service on {self.cri_socket()} to be initialized",
                 detail=lambda: tail(self.logdir / "containerd.log"))
        self.manifests.mkdir(parents=True, exist_ok=True)
        for d in [KUBELET_ROOT, DEVICE_PLUGIN_DIR, SECCOMP_ROOT]:
            d.mkdir(parents=True, exist_ok=True)
        # The kubelet bind-mounts its root dir onto itself to make it rshared;
        # remember that it was not a mount point so teardown undoes exactly that.
        if str(KUBELET_ROOT) not in mountpoints():
            (self.state / "kubelet-root-bind-mounted").touch()
        self.kubelet_log_offset = log_size(self.logdir / "kubelet.log")
        self.spawn("kubelet", self.kubelet_argv())
        wait_for(
            lambda: self.alive("kubelet") and http_get(self.healthz) == "ok",
            60,
            "kubelet healthz",
            detail=lambda: tail(self.logdir / "kubelet.log"),
        )
        self.wait_kubelet_serving()
        # The device manager serves kubelet.sock once it has started.
        wait_for(
            (DEVICE_PLUGIN_DIR / "kubelet.sock").is_socket,
            30,
            "kubelet.sock in the device-plugin dir",
            detail=lambda: tail(self.logdir / "kubelet.log"),
        )

    def restart_kubelet(self) -> None:
        self.stop("kubelet")
        self.start_kubelet()

    # ---- our plugin
    def plugin_argv(self, slots: int, *extra: str) -> list[str]:
        return [
            str(self.plugin_bin),
            "serve",
            "--device-plugin-dir",
            str(DEVICE_PLUGIN_DIR),
            "--fuse-device",
            "/dev/fuse",
            "--slots",
            str(slots),
            *extra,
        ]

    def start_plugin(self, slots: int, *extra: str) -> int:
        """Start the plugin (``extra``: more serve flags); returns the kubelet log offset
        before it started."""
        off = log_size(self.logdir / "kubelet.log")
        self.spawn("plugin", self.plugin_argv(slots, *extra))
        return off

    # ---- pods
    def pods(self) -> list[dict[str, Any]] | None:
        body = http_get(f"{READONLY}/pods")
        return json.loads(body).get("items") or []

    def add_pod(
        self, name: str, spec: dict[str, Any], annotations: dict[str, str] | None = None
    ) -> str:
        """Write a static pod manifest; returns the run id stamped into its annotations
        (static pod UIDs hash the manifest: a fresh annotation gives a fresh pod)."""
        if not re.fullmatch(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?", name):
            raise ValueError(f"pod name {name!r} is not a DNS-1123 label")
        run_id = uuid.uuid4().hex[:12]
        manifest = {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {
                "name": name,
                "namespace": "default",
                "annotations": {RUN_ANNOTATION: run_id, **(annotations or {})},
            },
            "spec": spec,
        }
        self.manifests.mkdir(parents=True, exist_ok=True)
        tmp = self.manifests / f".{name}.json.tmp"  # the kubelet ignores dot-files
        tmp.write_text(json.dumps(manifest, indent=1))
        tmp.rename(self.manifests / f"{name}.json")
        return run_id

    def remove_pod(self, name: str, timeout: float = 60) -> None:
        with contextlib.suppress(FileNotFoundError):
            (self.manifests / f"{name}.json").unlink()
        full = f"{name}-{NODE_NAME}"
        wait_for(
            lambda: all(p["metadata"]["name"] != full for p in (self.pods() or [])),
            timeout,
            f"pod {full} to be removed by the kubelet",
            detail=lambda: tail(self.logdir / "kubelet.log"),
        )

    def find_pod(self, name: str, run_id: str) -> dict[str, Any] | None:
        full = f"{name}-{NODE_NAME}"
        for p in self.pods() or []:
            md = p["metadata"]
            if md["name"] == full and (md.get("annotations") or {}).get(RUN_ANNOTATION) == run_id:
                return p
        return None

    def container_log(self, pod: dict[str, Any], container: str) -> str:
        """The container's log as the kubelet keeps it (CRI format lines -> text)."""
        md = pod["metadata"]
        d = Path("/var/log/pods") / f"{md['namespace']}_{md['name']}_{md['uid']}" / container
        out = []
        for f in sorted(d.glob("*.log")):
            for line in f.read_text(errors="replace").splitlines():
                parts = line.split(" ", 3)
                out.append(parts[3] if len(parts) == 4 else line)
        return "\n".join(out)

    # ---- whole node
    def up(self, slots: int | None = None, plugin_args: tuple[str, ...] = ()) -> None:
        self.down(quiet=True)
        self.logdir.mkdir(parents=True, exist_ok=True)
        for n in ["containerd", "kubelet", "plugin"]:
            with contextlib.suppress(FileNotFoundError):
                (self.logdir / f"{n}.log").unlink()
        self.start_containerd()
        if slots is not None:
            self.start_plugin(slots, *plugin_args)
        self.start_kubelet()

    def down(self, quiet: bool = False) -> None:
        manifests = list(self.manifests.glob("*")) if self.manifests.is_dir() else []
        for m in manifests:
            m.unlink()
        if self.alive("kubelet") and manifests:
            try:
                wait_for(lambda: not self.pods(), 60, "the kubelet to remove all static pods")
            except Timeout as exc:
                log(str(exc))
        for name in self.stop_order:
            if name == "containerd":
                self.remove_containers()
            self.stop(name)
        for rec in self.pids.glob("*.json") if self.pids.is_dir() else []:
            self.stop(rec.stem)
        self.kill_recorded_shims()
        self.unmount_all()
        # The kubelet leaves its registration socket behind; with no kubelet serving it, a
        # plugin started later would dial a dead socket. Ours re-creates it at every start.
        with contextlib.suppress(FileNotFoundError):
            (DEVICE_PLUGIN_DIR / "kubelet.sock").unlink()
        if not quiet:
            log("node is down")

    def remove_containers(self) -> None:
        """Kill and delete what the kubelet left in containerd (by container id)."""
        if not self.alive("containerd"):
            return
        for line in self.ctr("tasks", "ls", check=False).splitlines()[1:]:
            cid = line.split()[0]
            self.ctr("tasks", "kill", "-s", "SIGKILL", cid, check=False)
            self.ctr("tasks", "rm", "-f", cid, check=False)
        for cid in self.ctr("containers", "ls", "-q", check=False).split():
            self.ctr("containers", "rm", cid, check=False)

    def kill_recorded_shims(self) -> None:
        """Shims and container inits that containerd recorded under our private state dir."""
        tasks = self.state / "containerd" / "state" / "io.containerd.runtime.v2.task"
        if not tasks.is_dir():
            return
        for pidfile in list(tasks.glob("*/*/init.pid")) + list(tasks.glob("*/*/shim.pid")):
            with contextlib.suppress(OSError, ValueError):
                pid = int(pidfile.read_text().strip())
                exe = os.readlink(f"/proc/{pid}/exe")
                log(f"killing leftover {exe} pid {pid} recorded in {pidfile}")
                os.kill(pid, signal.SIGKILL)

    def unmount_all(self) -> None:
        roots = [str(self.state), str(self.data)]
        roots += [str(KUBELET_ROOT / "pods"), str(KUBELET_ROOT / "plugins")]
        marker = self.state / "kubelet-root-bind-mounted"
        if marker.exists():
            while str(KUBELET_ROOT) in mountpoints():
                subprocess.run(["umount", str(KUBELET_ROOT)], check=True)
                log(f"unmounted {KUBELET_ROOT} (the kubelet's rshared bind mount)")
            marker.unlink()
        for _ in range(3):
            mps = [
                mp for mp in mountpoints() if any(mp == r or mp.startswith(r + "/") for r in roots)
            ]
            if not mps:
                return
            for mp in sorted(mps, key=lambda m: m.count("/"), reverse=True):
                r = subprocess.run(["umount", mp], capture_output=True, text=True, check=False)
                if r.returncode != 0:
                    subprocess.run(["umount", "-l", mp], capture_output=True, check=False)
                log(f"unmounted {mp}")

    def status(self) -> str:
        lines = []
        for rec in sorted(self.pids.glob("*.json")) if self.pids.is_dir() else []:
            r = json.loads(rec.read_text())
            lines.append(
                f"{rec.stem:12} pid {r['pid']:>7} {'alive' if self.alive(rec.stem) else 'gone'}"
            )
        with contextlib.suppress(Exception):
            for p in self.pods() or []:
                lines.append(f"pod {p['metadata']['name']}: {p.get('status', {}).get('phase')}")
        return "\n".join(lines)


# ---------------------------------------------------------------- helpers


def skip_reason(stage: str) -> str | None:
    """Why this machine cannot run a stage that starts a kubelet, or None."""
    if os.geteuid() != 0:
        return f"{stage} needs root (it runs containerd, a kubelet and mounts)"
    try:
        st = os.stat("/dev/fuse")
    except FileNotFoundError:
        return f"{stage} needs /dev/fuse, which this machine lacks"
    if not stat.S_ISCHR(st.st_mode) or os.major(st.st_rdev) != 10 or os.minor(st.st_rdev) != 229:
        return "/dev/fuse here is not the FUSE char device 10:229"
    return None


def stack_bin() -> Path:
    """The directory of the stack's binaries (tests/stack/build.sh); nothing is built."""
    r = subprocess.run(
        [str(HERE / "setup.sh"), "dir"], capture_output=True, text=True, check=False
    )
    return Path(r.stdout.strip())


def find_plugin() -> Path:
    env = os.environ.get("FDP_PLUGIN_BIN")
    if env:
        return Path(env)
    for cand in [
        REPO / ".venv" / "bin" / "fuse-device-plugin",
        Path(sys.executable).parent / "fuse-device-plugin",
    ]:
        if cand.exists():
            return cand
    return Path(shutil.which("fuse-device-plugin") or "fuse-device-plugin")


def read_images_env() -> dict[str, str]:
    env = {}
    with contextlib.suppress(FileNotFoundError):
        for line in (CACHE / "images" / "images.env").read_text().splitlines():
            k, _, v = line.partition("=")
            env[k] = v
    return env


def render(src: Path, dst: Path, **extra: str) -> None:
    extra = {"STATE": str(STATE), "DATA": str(DATA), **extra}
    text = src.read_text()
    for k, v in extra.items():
        text = text.replace(f"@{k}@", v)
    dst.parent.mkdir(parents=True, exist_ok=True)
    dst.write_text(text)


def cri_ready(sock: Path) -> bool:
    """The runtime's CRI answers Version, the kubelet's first call (the request's one
    field left empty, so its wire form is no bytes; the answer is not read)."""
    import grpc

    with grpc.insecure_channel(f"unix://{sock}") as channel:
        version: grpc.UnaryUnaryMultiCallable[bytes, bytes] = channel.unary_unary(
            "/runtime.v1.RuntimeService/Version")
        try:
            version(b"", timeout=5)
        except grpc.RpcError:
            return False
    return True


def http_get(url: str, timeout: float = 5) -> str:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        body: bytes = r.read()
        return body.decode()


def log_size(path: Path) -> int:
    try:
        return path.stat().st_size
    except FileNotFoundError:
        return 0


def read_log(path: Path, since: int = 0) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(since)
            return f.read().decode(errors="replace")
    except FileNotFoundError:
        return ""


def grep_log(path: Path, pattern: str, since: int = 0) -> list[str]:
    rx = re.compile(pattern)
    return [line for line in read_log(path, since).splitlines() if rx.search(line)]


def tail(path: Path, n: int = 40) -> str:
    lines = read_log(path).splitlines()[-n:]
    return f"--- last {len(lines)} lines of {path}:\n" + "\n".join(lines)


def mountpoints() -> list[str]:
    return [entry.mountpoint
            for entry in mountinfo.parse(Path("/proc/self/mountinfo").read_text())]


@contextlib.contextmanager
def node_up(slots: int | None = None) -> Iterator[Node]:
    n = Node()
    try:
        n.up(slots)
        yield n
    finally:
        n.down()
        n.unlock()


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("cmd", choices=["up", "down", "status"])
    ap.add_argument("--slots", type=int, help="also start `fuse-device-plugin serve --slots N`")
    args = ap.parse_args()
    n = Node(lock=False)
    if args.cmd == "up":
        n.up(args.slots)
        # leave the processes running; `node.py down` stops them by recorded PID
        n.children.clear()
        print(n.status())
    elif args.cmd == "down":
        n.down()
    else:
        print(n.status())


if __name__ == "__main__":
    main()
