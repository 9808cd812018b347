"""Broker mode without containers: the wire format, every policy rule as a function, the
shim built by scripts/build-native and run for its own errors, the broker process's start,
stop and restart, and the plugin's broker-mode Allocate answer over its real socket."""

from __future__ import annotations

import logging
import os
import re
import signal
import socket
import struct
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from fuse_plugin.broker import policy, protocol
from fuse_plugin.broker.policy import MountEntry, Refused
from fuse_plugin.broker.server import Broker, BrokerSettings
from fuse_plugin.sim.kubelet import KubeletStandIn
from tests.conftest import RESOURCE, StartPlugin
from tests.containers import broker as broker_rig

# -- the wire -----------------------------------------------------------------------------


def test_shim_and_protocol_agree_on_constants() -> None:
    source = broker_rig.SHIM_SOURCE.read_text()
    defines = dict(re.findall(r'^#define (\w+) "?([^"\n]*)"?$', source, re.MULTILINE))
    assert defines["BROKER_SOCKET"] == protocol.CONTAINER_SOCKET
    assert defines["SOCKET_ENV"] == protocol.SOCKET_ENV
    assert defines["PROTOCOL_VERSION"] == protocol.VERSION
    assert int(defines["MAX_MESSAGE"]) == protocol.MAX_MESSAGE


def test_a_shim_request_parses() -> None:
    data = protocol.encode(v="1", op="mount", path="/mnt/x",
                           options="rw,nosuid,nodev,fsname=a\\,b,subtype=sshfs")
    assert protocol.parse_request(data) == protocol.Request(
        op="mount", path="/mnt/x", options="rw,nosuid,nodev,fsname=a\\,b,subtype=sshfs")
    unmount = protocol.parse_request(protocol.encode(
        v="1", op="unmount", path="/mnt/x", flags="lazy,auto", mount_id="77"))
    assert unmount.flags == {"lazy", "auto"}
    assert unmount.mount_id == 77


@pytest.mark.parametrize(("data", "words"), [
    (b"", "malformed message"),
    (b"v=1\0op=mount\0path=/x", "malformed message"),  # no final NUL
    (b"v=1\0op=mount\0path=/x\0path=/y\0", "given twice"),
    (b"v=1\0op=mount\0path=/x\0pid=1\0", "unknown request field(s): pid"),
    (b"v=1\0op=mount\0path\0", "expected key=value"),
    (b"v=1\0op=mount\0path=\xff\0", "must be UTF-8"),
    (b"op=mount\0path=/x\0", "protocol version None"),
    (b"v=1\0op=chmod\0path=/x\0", "unknown op 'chmod'"),
    (b"v=1\0op=mount\0", "names no path"),
    (b"v=1\0op=mount\0path=/x\0flags=lazy\0", "flags apply to unmount only"),
    (b"v=1\0op=unmount\0path=/x\0flags=force\0", "unknown flag(s): force"),
    (b"v=1\0op=unmount\0path=/x\0mount_id=-1\0", "mount_id must be a number"),
    (b"v=1\0op=mount\0path=/" + b"x" * protocol.MAX_MESSAGE + b"\0", "malformed message"),
])
def test_bad_requests_are_refused_with_a_reason(data: bytes, words: str) -> None:
    with pytest.raises(protocol.BadRequest, match=re.escape(words)):
        protocol.parse_request(data)


# -- policy -------------------------------------------------------------------------------


@pytest.mark.parametrize(("given", "passed"), [
    # what libfuse 3 (sshfs) and libfuse 2 (s3fs) send through the helper
    ("rw,nosuid,nodev,fsname=127.0.0.1:/srv,subtype=sshfs",
     "rw,nosuid,nodev,fsname=127.0.0.1:/srv,subtype=sshfs,nosuid,nodev"),
    ("rw,nosuid,nodev,allow_other,default_permissions,fsname=s3fs,subtype=s3fs",
     "rw,nosuid,nodev,allow_other,default_permissions,fsname=s3fs,subtype=s3fs,"
     "nosuid,nodev"),
    ("", "nosuid,nodev"),
    ("ro,max_read=131072,noatime", "ro,max_read=131072,noatime,nosuid,nodev"),
    ("fsname=a\\,suid", "fsname=a\\,suid,nosuid,nodev"),  # escaped: part of the name
])
def test_allowed_options_pass_with_nosuid_nodev_last(given: str, passed: str) -> None:
    assert policy.options(given) == passed


@pytest.mark.parametrize(("given", "words"), [
    ("suid", "always nosuid,nodev"),
    ("rw,dev", "always nosuid,nodev"),
    ("fsname=a\\\\,suid", "always nosuid,nodev"),  # an escaped backslash, then a comma
    ("blkdev", "fuseblk"),
    ("blksize=4096", "fuseblk"),
    ("auto_unmount", "handled by the fusermount3 shim"),
    ("user_id=1000", "sets fd=, rootmode=, user_id="),
    ("fd=3", "sets fd="),
    ("context=system_u:object_r:tmp_t", "unknown mount option"),
    ("max_read=lots", "max_read must be a number"),
    ("subtype=", "needs a value"),
    ("fsname=a\nb", "control character"),
    ("x" * (policy.MAX_OPTIONS + 1), "longer than"),
])
def test_refused_options(given: str, words: str) -> None:
    with pytest.raises(Refused, match=re.escape(words)):
        policy.options(given)


def test_options_split_like_fusermount3() -> None:
    """A backslash escapes only inside fsname= and subtype= values, as in fusermount3."""
    assert policy.split_options("fsname=a\\,b,rw") == ["fsname=a\\,b", "rw"]
    assert policy.split_options("fsname=a\\\\,suid") == ["fsname=a\\\\", "suid"]
    assert policy.split_options("max_read=1\\,suid") == ["max_read=1\\", "suid"]
    assert policy.split_options("rw,,ro") == ["rw", "", "ro"]


@pytest.mark.parametrize("path", ["/mnt/x", "/data", "/var/lib/app/mnt", "/home/u/fs",
                                  "/tmp/a b", "/run/other"])
def test_paths_allowed(path: str) -> None:
    assert policy.path(path) == path


@pytest.mark.parametrize(("path", "words"), [
    ("mnt/x", "must be an absolute path"),
    ("/", "not a canonical path"),
    ("/mnt/../etc", "not a canonical path"),
    ("/mnt/./x", "not a canonical path"),
    ("/mnt//x", "not a canonical path"),
    ("/mnt/x/", "not a canonical path"),
    ("/proc", "is under /proc"),
    ("/sys/fs/cgroup", "is under /sys"),
    ("/dev/shm", "is under /dev"),
    ("/etc/ssl", "is under /etc"),
    ("/usr/local/bin", "is under /usr"),
    ("/run/fuse-broker", "is under /run/fuse-broker"),
    ("/" + "x" * policy.MAX_PATH, "at most"),
])
def test_paths_refused(path: str, words: str) -> None:
    with pytest.raises(Refused, match=re.escape(words)):
        policy.path(path)


MOUNTINFO = """\
22 1 0:21 / / rw,relatime shared:1 - ext4 /dev/vda rw
30 22 0:30 / /tmp rw,nosuid,nodev - tmpfs tmpfs rw
31 22 0:40 / /mnt/with\\040space rw,nosuid,nodev master:3 - fuse.sshfs host:/ rw,user_id=0
32 22 0:41 / /mnt/s3 rw,nosuid,nodev shared:7 - fuse.s3fs s3fs rw,user_id=0
33 30 0:42 / /tmp/plain rw - fuse /dev/fuse rw
34 22 0:43 / /proc/kcore ro - devtmpfs udev rw
"""


def test_mountinfo_is_read_with_escapes_and_propagation() -> None:
    entries = policy.mountinfo(MOUNTINFO)
    assert [(e.mount_id, e.mountpoint, e.fstype, e.shared) for e in entries] == [
        (22, "/", "ext4", True), (30, "/tmp", "tmpfs", False),
        (31, "/mnt/with space", "fuse.sshfs", False), (32, "/mnt/s3", "fuse.s3fs", True),
        (33, "/tmp/plain", "fuse", False), (34, "/proc/kcore", "devtmpfs", False)]


def test_fuse_mount_rules() -> None:
    entries = policy.mountinfo(MOUNTINFO)
    assert policy.fuse_mount_at("/mnt/s3", entries).mount_id == 32
    with pytest.raises(Refused, match=re.escape("is not a FUSE mount (it is tmpfs)")):
        policy.fuse_mount_at("/tmp", entries)
    with pytest.raises(Refused, match=r"is not a FUSE mount$"):
        policy.fuse_mount_at("/mnt/none", entries)
    for inside in ("/mnt/s3", "/mnt/s3/deeper", "/tmp/plain/x"):
        with pytest.raises(Refused, match="at or inside the FUSE mount"):
            policy.inside_fuse(inside, entries)
    policy.inside_fuse("/mnt/s3x", entries)  # a sibling, not inside
    policy.room_for_another(entries, 4)
    with pytest.raises(Refused, match=re.escape("already has 3 FUSE mounts")):
        policy.room_for_another(entries, 3)


def test_only_root_callers() -> None:
    policy.caller(0)
    with pytest.raises(Refused, match="uid 100000 on the node"):
        policy.caller(100000)


def test_unmount_target_is_the_topmost_mount() -> None:
    stacked = [MountEntry(1, "/mnt/x", "fuse.a", False), MountEntry(2, "/mnt/x", "tmpfs", False)]
    with pytest.raises(Refused, match=re.escape("(it is tmpfs)")):
        policy.fuse_mount_at("/mnt/x", stacked)


# -- the shim -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def shim() -> Path:
    return broker_rig.shim()


def test_shim_is_small_and_static(shim: Path) -> None:
    data = shim.read_bytes()
    assert data[:4] == b"\x7fELF"
    assert len(data) < 100_000
    phoff, = struct.unpack_from("<Q", data, 0x20)
    phentsize, phnum = struct.unpack_from("<HH", data, 0x36)
    kinds = {struct.unpack_from("<I", data, phoff + i * phentsize)[0] for i in range(phnum)}
    assert 3 not in kinds  # no PT_INTERP: nothing is loaded from the image
    assert 2 not in kinds  # no PT_DYNAMIC


def run_shim(shim: Path, *args: str, env: dict[str, str] | None = None
             ) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(shim), *args], env=env or {}, capture_output=True, text=True,
                          timeout=10, check=False)


@pytest.mark.parametrize(("args", "env", "message"), [
    ((), {}, "fusermount3: missing mountpoint argument"),
    (("-z", "/tmp"), {}, "fusermount3: -z can only be used with -u"),
    (("/tmp", "/var"), {}, "fusermount3: extra arguments after the mountpoint"),
    (("/tmp",), {}, "fusermount3: old style mounting not supported"),
    (("/nonexistent/x",), {"_FUSE_COMMFD": "3"},
     "fusermount3: bad mountpoint '/nonexistent/x': No such file or directory"),
    (("-o", "rw", "/tmp"), {"_FUSE_COMMFD": "3", protocol.SOCKET_ENV: "/nonexistent/b.sock"},
     "fusermount3: cannot reach the FUSE mount broker at /nonexistent/b.sock: No such file "
     "or directory (broker mode needs the broker running on this node and the pod's "
     "github.com/fuse allocation)"),
    (("-u", "/tmp/x"), {protocol.SOCKET_ENV: "/nonexistent/b.sock"},
     "fusermount3: cannot reach the FUSE mount broker at /nonexistent/b.sock"),
])
def test_shim_errors_are_one_line_and_exit_1(shim: Path, args: tuple[str, ...],
                                             env: dict[str, str], message: str) -> None:
    result = run_shim(shim, *args, env=env)
    assert result.returncode == 1
    assert result.stderr.startswith(message)
    assert len(result.stderr.splitlines()) == 1


def test_shim_quiet_unmount_says_nothing(shim: Path) -> None:
    result = run_shim(shim, "-u", "-q", "/tmp/x",
                      env={protocol.SOCKET_ENV: "/nonexistent/b.sock"})
    assert (result.returncode, result.stderr) == (1, "")


def test_shim_takes_its_name_from_argv0_and_prints_a_version(shim: Path,
                                                             tmp_path: Path) -> None:
    link = tmp_path / "fusermount"
    link.symlink_to(shim)
    assert run_shim(link).stderr.startswith("fusermount: missing mountpoint")
    version = run_shim(shim, "--version")
    assert version.returncode == 0
    assert "fuse-device-plugin broker shim" in version.stdout


def test_shim_relays_the_broker_refusal(shim: Path, tmp_path: Path) -> None:
    """A socket that answers as a refusing broker: the shim prints its message."""
    path = tmp_path / "b.sock"
    with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as server:
        server.bind(str(path))
        server.listen(1)
        proc = subprocess.Popen([str(shim), "-o", "rw,suid", str(tmp_path)],
                                env={"_FUSE_COMMFD": "3", protocol.SOCKET_ENV: str(path)},
                                stderr=subprocess.PIPE, text=True)
        conn, _ = server.accept()
        with conn:
            request = protocol.parse_request(conn.recv(protocol.MAX_MESSAGE))
            conn.send(protocol.encode(status="error", message="broker refused: no"))
        _, err = proc.communicate(timeout=10)
    assert request == protocol.Request(op="mount", path=str(tmp_path), options="rw,suid")
    assert (proc.returncode, err) == (1, "fusermount3: broker refused: no\n")


# -- the broker process -------------------------------------------------------------------


def broker_command(tmp_path: Path, shim: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "fuse_plugin", "broker", "--dir", str(tmp_path / "dir"),
            "--shim", str(shim), "--staging-dir", str(tmp_path / "staging"), *extra]


@pytest.mark.parametrize(("extra", "message"), [
    (("--max-mounts", "0"), "--max-mounts: must be a whole number from 1 to 10000"),
    (("--dir", "relative"), "--dir: must be an absolute path"),
    (("--fusermount", "/nonexistent/fusermount3"),
     "--fusermount /nonexistent/fusermount3 is not an executable file"),
    (("--fusermount", "SHIM"), "is the broker's own shim; point it at the real fusermount3"),
])
def test_broker_bad_flags_exit_2_with_one_line(shim: Path, tmp_path: Path,
                                               extra: tuple[str, ...], message: str) -> None:
    extra = tuple(a.replace("SHIM", str(shim)) for a in extra)
    result = subprocess.run(broker_command(tmp_path, shim, *extra), capture_output=True,
                            text=True, timeout=30, check=False)
    assert result.returncode == 2
    assert message in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr


def test_broker_starts_installs_the_shim_stops_and_replaces_a_stale_socket(
        shim: Path, tmp_path: Path) -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root: the broker makes a private mount namespace")
    first = broker_rig.BrokerProcess(tmp_path / "dir", tmp_path / "one", shim).start()
    installed = tmp_path / "dir" / protocol.SHIM_NAME
    assert installed.read_bytes() == shim.read_bytes()
    assert oct(installed.stat().st_mode & 0o777) == "0o755"
    assert (tmp_path / "dir" / protocol.SOCKET_NAME).is_socket()
    second = subprocess.run(broker_command(tmp_path, shim), capture_output=True, text=True,
                            timeout=30, check=False)
    assert second.returncode == 1
    assert "another broker is serving on" in second.stderr
    first.kill()  # SIGKILL leaves the socket behind
    assert (tmp_path / "dir" / protocol.SOCKET_NAME).is_socket()
    again = broker_rig.BrokerProcess(tmp_path / "dir", tmp_path / "two", shim).start()
    assert again.proc is not None
    again.proc.send_signal(signal.SIGTERM)
    assert again.proc.wait(10) == 0
    assert not (tmp_path / "dir" / protocol.SOCKET_NAME).exists()
    assert [e["event"] for e in again.events()] == ["broker.serving", "signal", "stopped"]


# -- the plugin's side --------------------------------------------------------------------


def test_serve_with_broker_dir_binds_the_socket_dir_and_shim(
        kubelet: KubeletStandIn, start_plugin: StartPlugin) -> None:
    start_plugin("--broker-dir", "/var/lib/fuse-device-plugin/broker")
    kubelet.wait_registered()
    [container] = kubelet.allocate(RESOURCE, [["fuse-0"]]).container_responses
    assert len(container.devices) == 1
    assert [(m.container_path, m.host_path, m.read_only) for m in container.mounts] == [
        ("/run/fuse-broker", "/var/lib/fuse-device-plugin/broker", True),
        *((target, "/var/lib/fuse-device-plugin/broker/fusermount3", True)
          for target in protocol.SHIM_TARGETS)]


def test_serve_without_broker_dir_adds_no_mount(kubelet: KubeletStandIn,
                                                start_plugin: StartPlugin) -> None:
    start_plugin()
    kubelet.wait_registered()
    [container] = kubelet.allocate(RESOURCE, [["fuse-0"]]).container_responses
    assert list(container.mounts) == []


@pytest.mark.parametrize(("env", "args", "message"), [
    ({}, ["--broker-dir", "relative/dir"], "--broker-dir: must be an absolute path"),
    ({"FUSE_DEVICE_PLUGIN_BROKER_DIR": "relative"}, [],
     "$FUSE_DEVICE_PLUGIN_BROKER_DIR"),
])
def test_bad_broker_dir_exits_2(env: dict[str, str], args: list[str], message: str) -> None:
    result = subprocess.run([sys.executable, "-m", "fuse_plugin", "serve", *args],
                            env={"PATH": "/usr/bin:/bin", **env}, capture_output=True,
                            text=True, timeout=30, check=False)
    assert result.returncode == 2
    assert message in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


def test_broker_command_imports_no_more_than_the_standard_library() -> None:
    """The broker runs from a plain python3 (the AppArmor guest has no venv): parsing its
    command line must not pull in watchdog, grpc or the profile modules."""
    code = ("import sys; from fuse_plugin import cli; "
            "cli.build_parser(all_flags=False, broker_flags=True).parse_args(['broker']); "
            "from fuse_plugin.broker import server; "
            "print(sorted(m for m in ('watchdog', 'grpc', 'fuse_plugin.profiles', "
            "'fuse_plugin.doctor', 'google.protobuf') if m in sys.modules))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=30, check=True)
    assert result.stdout.strip() == "[]"


def test_a_helper_past_its_deadline_is_killed_and_reaped_later(tmp_path: Path) -> None:
    from fuse_plugin.broker.mounts import Mounter, MountFailed
    from tests.containers.workloads import wait_for

    mounter = Mounter(Path("/usr/bin/fusermount3"), Path("/bin/false"), tmp_path,
                      timeout=0.2)
    with pytest.raises(MountFailed, match=r"^slow helper did not finish within 0.2s$"):
        mounter._run(["sleep", "30"], "slow helper", (), {})
    wait_for(lambda: mounter.reap() == 0, 10, "the killed helper to be reaped")
    with pytest.raises(MountFailed, match=r"^the step said no$"):
        mounter._run(["sh", "-c", "echo noise >&2; echo 'the step said no' >&2; exit 3"],
                     "step", (), {"PATH": "/usr/bin:/bin"})


# epoll_wait and epoll_pwait on x86-64 and arm64 (asm-generic has only epoll_pwait).
EPOLL_WAITS = {"232", "281", "22"}


def test_stop_from_another_thread_wakes_a_waiting_loop(tmp_path: Path) -> None:
    """SIGTERM's handler stops the broker from a thread of its own, which can come after
    the loop went back to waiting: the loop must wake, not sleep out its minute (CI once
    caught a broker that had not exited 10 s after SIGTERM)."""
    broker = Broker(BrokerSettings(directory=tmp_path, staging=tmp_path / "staging"),
                    logging.getLogger("test"))
    loop = threading.Thread(target=broker.run, name="broker")
    loop.start()
    waiting = threading.Event()
    for _ in range(1000):  # until the loop sits in epoll, a few ms; bounded
        syscall = Path(f"/proc/self/task/{loop.native_id}/syscall").read_text().split()
        if syscall and syscall[0] in EPOLL_WAITS:
            waiting.set()
            break
        threading.Event().wait(0.005)
    assert waiting.is_set(), "the broker's loop never waited in epoll"
    broker.stop()
    loop.join(10)
    assert not loop.is_alive()
