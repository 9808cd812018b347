"""The plugin image for linux/arm64 as well as linux/amd64, one manifest list of both
(issue 37), and the arm64 image's programs run under emulation.

``images.sh multiarch`` builds the repository's ``Dockerfile``, unchanged, for each
platform on a debootstrapped Debian base of that architecture (arm64's with
``--arch arm64``), every arm64 step running under Debian's qemu-user-static, which it
registers with binfmt_misc itself; the images are cached by a hash of their inputs, as
the cluster stage's are. Here the arm64 image's own programs run, emulated: the plugin's
Python, broker mode's static shim and helper (C, built for arm64 in the emulated
builder stage), and the image's Python talking to that helper in the broker's framed
wire format.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from fuse_plugin import __version__
from fuse_plugin.broker import protocol
from tests.kubelet.node import tail

HERE = Path(__file__).resolve().parent
FDP_CACHE = Path(os.environ.get("FDP_CACHE", "/var/cache/fuse-device-plugin"))
PODMAN = ("podman", "--root", str(FDP_CACHE / "cluster/podman"),
          "--runroot", "/run/fuse-device-plugin-cluster/podman", "--storage-driver", "overlay",
          "--cgroup-manager", "cgroupfs", "--events-backend", "file")
# Cold: a debootstrap whose second stage runs under emulation, then the Dockerfile's
# apt-get and pip steps emulated too (bench/README.md has the figures).
BUILD_TIMEOUT = 2700
RUN_TIMEOUT = 300  # one emulated container: Python starts in seconds, not minutes
LIBEXEC = "/usr/local/libexec/fuse-device-plugin"
EM_AARCH64, EM_X86_64 = 183, 62
PT_DYNAMIC, PT_INTERP = 2, 3
# Podman's default rlimits for a container are its own, raised as far as it may; runc's
# init is refused setting those here (EPERM on RLIMIT_NOFILE and RLIMIT_NPROC in this
# sandbox). These programs need few of either.
LIMITS = ("--ulimit", "nofile=1024:1024", "--ulimit", "nproc=1024:1024")

# Runs in the arm64 image, under its own (emulated) Python: the broker's side of a helper
# conversation as the broker's loop has it (fuse_plugin/broker/helper.py), with the
# image's own frames module. Two unmount requests in the container's own namespaces:
# /proc (a mountpoint: the helper reports its facts, and is told not to go on) and /usr
# (not one: refused). Each request's reports and exit status are printed as JSON, with
# the number of threads the Python process has.
HELPER_CHECK = """
import json, os, socket, subprocess
from fuse_plugin.broker import frames
def converse(path):
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    fds = [theirs.fileno(), os.pidfd_open(os.getpid()), os.open("/proc/self/ns/mnt", os.O_RDONLY)]
    proc = subprocess.Popen([HELPER, *map(str, fds)], pass_fds=fds, env={})
    for fd in fds:
        os.close(fd)
    ours.settimeout(120)
    ours.send(frames.encode(frames.REQUEST, {"op": "unmount", "path": path, "uid": 0,
                                             "gid": 0, "groups": ()}))
    reports = []
    while data := ours.recv(frames.MAX_FRAME + 1):
        report = frames.decode(data, frames.REPORT)
        reports.append(report)
        if report["status"] in ("mark", "facts"):
            go = "1" if report["status"] == "mark" else "0"
            ours.send(frames.encode(frames.ANSWER, {"go": go}))
    return {"exit": proc.wait(120), "reports": reports}
result = {path: converse(path) for path in ("/proc", "/usr")}
result["tasks"] = len(os.listdir("/proc/self/task"))  # qemu-user adds a thread of its own
print(json.dumps(result))
"""


@dataclass(frozen=True)
class Images:
    amd64: str
    arm64: str
    manifest: str


def podman(*args: str, timeout: float = RUN_TIMEOUT) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*PODMAN, *args], capture_output=True, text=True, timeout=timeout,
                          check=False)


def run(ref: str, arch: str, *args: str, entrypoint: str | None = None,
        podman_args: tuple[str, ...] = ()) -> subprocess.CompletedProcess[str]:
    """One container of ``ref``, asked for by platform as a node would."""
    ep = ("--entrypoint", entrypoint) if entrypoint else ()
    return podman("run", "--rm", "--network", "none", "--platform", f"linux/{arch}",
                  *LIMITS, *podman_args, *ep, ref, *args)


def run_arm64(images: Images, *args: str, entrypoint: str | None = None
              ) -> subprocess.CompletedProcess[str]:
    return run(images.arm64, "arm64", *args, entrypoint=entrypoint)


@pytest.fixture(scope="module")
def images(tmp_path_factory: pytest.TempPathFactory) -> Images:
    if os.geteuid() != 0:
        pytest.skip("needs root: debootstrap, binfmt_misc and podman's private storage")
    if shutil.which("podman") is None:  # setup.sh installs it; only by hand is it missing
        pytest.skip("needs podman: apt-get install podman (scripts/apt-packages.txt)")
    # Not the cluster stage's log directory: a cluster bring-up empties that.
    log = tmp_path_factory.mktemp("multiarch") / "setup.log"
    t0 = time.monotonic()
    with open(log, "w") as out:
        r = subprocess.run([str(HERE / "setup.sh"), "multiarch"], stdout=out,
                           stderr=subprocess.STDOUT, timeout=BUILD_TIMEOUT, check=False)
    assert r.returncode == 0, f"setup.sh multiarch failed ({r.returncode}):\n{tail(log, 60)}"
    print(f"multiarch images ready in {time.monotonic() - t0:.0f}s ({log})", file=sys.stderr)
    env = dict(line.split("=", 1) for line in
               (FDP_CACHE / "cluster/images/multiarch.env").read_text().splitlines())
    return Images(env["PLUGIN_IMAGE_AMD64"], env["PLUGIN_IMAGE_ARM64"], env["PLUGIN_MANIFEST"])


def inspect(ref: str) -> dict[str, Any]:
    r = podman("image", "inspect", ref)
    assert r.returncode == 0, r.stderr
    found: dict[str, Any] = json.loads(r.stdout)[0]
    return found


def test_the_manifest_list_carries_both_platforms(images: Images) -> None:
    """One name for every node: the list has exactly linux/amd64 and linux/arm64, each
    entry the digest of that platform's image."""
    r = podman("manifest", "inspect", images.manifest)
    assert r.returncode == 0, r.stderr
    entries = json.loads(r.stdout)["manifests"]
    platforms = {(e["platform"]["os"], e["platform"]["architecture"]): e["digest"]
                 for e in entries}
    assert sorted(platforms) == [("linux", "amd64"), ("linux", "arm64")]
    assert len(entries) == 2
    for arch, ref in (("amd64", images.amd64), ("arm64", images.arm64)):
        image = inspect(ref)
        assert image["Architecture"] == arch
        assert image["Os"] == "linux"
        assert platforms[("linux", arch)] == image["Digest"]


def test_the_list_pushes_whole_with_both_images(images: Images, tmp_path: Path) -> None:
    """The README's last step, `podman manifest push --all`, into an OCI layout instead
    of a registry (none is reachable): the pushed tag is an index of exactly the two
    platforms, each manifest's config names its architecture, and every layer is there."""
    dest = tmp_path / "oci"
    r = podman("manifest", "push", "--all", images.manifest, f"oci:{dest}:{__version__}")
    assert r.returncode == 0, r.stderr

    def blob(digest: str) -> Any:
        algorithm, value = digest.split(":", 1)
        return json.loads((dest / "blobs" / algorithm / value).read_text())

    [tag] = json.loads((dest / "index.json").read_text())["manifests"]
    assert tag["annotations"]["org.opencontainers.image.ref.name"] == __version__
    pushed = blob(tag["digest"])["manifests"]
    assert sorted((m["platform"]["os"], m["platform"]["architecture"]) for m in pushed) == [
        ("linux", "amd64"), ("linux", "arm64")]
    for entry in pushed:
        manifest = blob(entry["digest"])
        assert blob(manifest["config"]["digest"])["architecture"] == \
            entry["platform"]["architecture"]
        for layer in manifest["layers"]:
            algorithm, value = layer["digest"].split(":", 1)
            assert (dest / "blobs" / algorithm / value).stat().st_size == layer["size"]


def elf_facts(ref: str, path: str) -> tuple[int, set[int]]:
    """The e_machine of a file in an image, read from the image's own layers, and the
    kinds of its program headers."""
    r = podman("create", ref)
    assert r.returncode == 0, r.stderr
    container = r.stdout.strip()
    try:
        r = podman("mount", container)
        assert r.returncode == 0, r.stderr
        data = (Path(r.stdout.strip()) / path.lstrip("/")).read_bytes()
    finally:
        podman("rm", container)
    assert data[:4] == b"\x7fELF"
    phoff, = struct.unpack_from("<Q", data, 0x20)
    phentsize, phnum = struct.unpack_from("<HH", data, 0x36)
    kinds = {struct.unpack_from("<I", data, phoff + i * phentsize)[0] for i in range(phnum)}
    return int.from_bytes(data[18:20], "little"), kinds


def test_the_arm64_images_programs_are_built_for_arm64(images: Images) -> None:
    """The shim and the helper are static aarch64 programs in the arm64 image (no
    loader: the shim runs in any workload image) and x86-64 ones in the amd64 image: the
    builder stage ran for the target, not for the build machine."""
    for name in ("fusermount3", "fuse-broker-helper"):
        for ref, machine in ((images.arm64, EM_AARCH64), (images.amd64, EM_X86_64)):
            found, kinds = elf_facts(ref, f"{LIBEXEC}/{name}")
            assert found == machine, (ref, name)
            assert not kinds & {PT_DYNAMIC, PT_INTERP}, (ref, name, kinds)


def test_the_plugin_answers_help_under_emulation(images: Images) -> None:
    r = run_arm64(images, "--help")
    assert r.returncode == 0, r.stderr
    assert "usage: fuse-device-plugin" in r.stdout
    for command in ("serve", "broker", "install-profiles"):
        assert command in r.stdout
    # The interpreter that answered is the image's arm64 one, emulated.
    r = run_arm64(images, "-c", "import platform; print(platform.machine())",
                  entrypoint="python3")
    assert (r.returncode, r.stdout.strip()) == (0, "aarch64"), r.stderr


def test_the_shim_refuses_outside_broker_mode(images: Images) -> None:
    """A container without broker mode's socket directory (what Allocate gives only in
    broker mode) gets the shim's one line and exit 1, not a wait or a crash."""
    for args in (("-u", "/tmp/x"), ("/tmp",)):
        r = run_arm64(images, *args, entrypoint=f"{LIBEXEC}/fusermount3")
        assert r.returncode == 1, (args, r.stdout, r.stderr)
        assert len(r.stderr.splitlines()) == 1, r.stderr
    assert r.stderr.startswith("fusermount3: old style mounting not supported")
    r = run_arm64(images, "-u", "/tmp/x", entrypoint=f"{LIBEXEC}/fusermount3")
    assert r.stderr.startswith(f"fusermount3: cannot reach the FUSE mount broker at "
                               f"{protocol.CONTAINER_SOCKET}: "), r.stderr
    assert "broker mode needs the broker running on this node" in r.stderr


def helper_check(ref: str, arch: str) -> dict[str, Any]:
    """HELPER_CHECK in a container of ``ref`` with CAP_SYS_ADMIN (which the broker has:
    the helper enters the caller's mount namespace)."""
    script = f"HELPER = {LIBEXEC + '/fuse-broker-helper'!r}\n{HELPER_CHECK}"
    r = run(ref, arch, "-c", script, entrypoint="python3", podman_args=("--cap-add", "SYS_ADMIN"))
    assert r.returncode == 0, r.stderr
    found: dict[str, Any] = json.loads(r.stdout)
    return found


def statuses(conversation: dict[str, Any]) -> list[str]:
    return [report["status"] for report in conversation["reports"]]


def test_the_helper_converses_natively(images: Images) -> None:
    """The self-check's reference, on the amd64 image natively: the helper enters the
    container's mount namespace, reads its mount table, reports that no broker mark is
    mounted, then the facts of /proc (a proc mount) and stops when told not to go on;
    /usr, not a mountpoint, is refused with the message the broker passes on."""
    result = helper_check(images.amd64, "amd64")
    proc, usr = result["/proc"], result["/usr"]
    assert statuses(proc) == ["mark", "facts"], proc
    assert proc["reports"][0]["mark_dev"] == ""
    assert proc["reports"][1]["fstype"] == "proc", proc
    assert statuses(usr) == ["mark", "refused"], usr
    assert usr["reports"][1]["message"] == "'/usr' is not a mountpoint"
    assert proc["exit"] == usr["exit"] == 0
    assert result["tasks"] == 1


def test_the_helper_answers_the_brokers_frames_under_emulation(images: Images) -> None:
    """The helper's self-check on arm64, as far as qemu-user can take it: the arm64
    helper reads the broker's frame, checks it, takes the caller's ids and answers in a
    frame the image's Python decodes, exiting 0. It stops at setns into the mount
    namespace, which the kernel refuses (EINVAL) to a process sharing its filesystem
    context with another thread: under qemu-user every program has qemu's own second
    thread (``tasks`` is 2 below, 1 natively). So the namespace steps run on amd64 only
    (the test above and the broker's stages); an arm64 node runs them unemulated."""
    result = helper_check(images.arm64, "arm64")
    assert result["tasks"] == 2, result
    for path in ("/proc", "/usr"):
        conversation = result[path]
        assert statuses(conversation) == ["failed"], conversation
        assert conversation["reports"][0]["message"] == "setns mnt: Invalid argument"
        assert conversation["exit"] == 0
