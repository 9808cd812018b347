"""Broker mode without containers: the wire format, every policy rule as a function, the
records of what the broker mounted, the shim and the helper built by scripts/build-native,
the broker process's start, stop, restart and limits, and the plugin's broker-mode side
(Allocate's binds, slots healthy only once the shim is installed)."""

from __future__ import annotations

import logging
import os
import re
import select
import signal
import socket
import struct
import subprocess
import sys
import threading
from pathlib import Path

import grpc
import pytest

from fuse_plugin.broker import mountinfo, policy, protocol, replies, scheduler, server, shares
from fuse_plugin.broker.node import install_shim
from fuse_plugin.broker.policy import Existing, Mark, MountOptions, Owner, Refused, Target
from fuse_plugin.broker.records import Record, Records
from fuse_plugin.broker.server import Broker
from fuse_plugin.broker.settings import BrokerSettings
from tests.lib import broker as broker_rig
from tests.lib.kubelet import KubeletStandIn
from tests.lib.plugin import RESOURCE, StartPlugin
from tests.lib.probes import get
from tests.lib.servers import free_port
from tests.lib.waiting import wait_for

# Digits, but not ASCII ones: int() and str.isdigit() take them, fusermount3 does not.
ARABIC_INDIC = "\u0661\u0662"

# -- the wire -----------------------------------------------------------------------------


def test_shim_and_protocol_agree_on_constants() -> None:
    source = broker_rig.SHIM_SOURCE.read_text()
    defines = dict(re.findall(r'^#define (\w+) "?([^"\n]*)"?$', source, re.MULTILINE))
    assert defines["BROKER_SOCKET"] == protocol.CONTAINER_SOCKET
    assert defines["SOCKET_ENV"] == protocol.SOCKET_ENV
    assert defines["WAIT_ENV"] == protocol.WAIT_ENV
    assert defines["PROTOCOL_VERSION"] == protocol.VERSION
    assert defines["RETRY_FIELD"] == protocol.RETRY_FIELD
    assert int(defines["MAX_MESSAGE"]) == protocol.MAX_MESSAGE


def test_a_shim_request_parses() -> None:
    data = protocol.encode(v="2", op="mount", path="/mnt/x", fuse_fd="5",
                           options="rw,nosuid,nodev,fsname=a\\,b,subtype=sshfs")
    assert protocol.parse_request(data) == protocol.Request(
        op="mount", path="/mnt/x", options="rw,nosuid,nodev,fsname=a\\,b,subtype=sshfs",
        fuse_fd=5)
    unmount = protocol.parse_request(protocol.encode(
        v="2", op="unmount", path="/mnt/x", flags="lazy,auto", mount_id="77"))
    assert unmount.flags == {"lazy", "auto"}
    assert unmount.mount_id == 77


@pytest.mark.parametrize(("data", "words"), [
    (b"", "malformed message"),
    (b"v=2\0op=mount\0path=/x", "malformed message"),  # no final NUL
    (b"v=2\0op=mount\0path=/x\0path=/y\0", "given twice"),
    (b"v=2\0op=mount\0path=/x\0pid=1\0", "unknown request field(s): pid"),
    (b"v=2\0op=mount\0path\0", "expected key=value"),
    (b"v=2\0op=mount\0path=\xff\0", "must be UTF-8"),
    (b"op=mount\0path=/x\0", "protocol version None"),
    (b"v=1\0op=mount\0path=/x\0", "protocol version '1' is not '2'"),
    (b"v=2\0op=chmod\0path=/x\0", "unknown op 'chmod'"),
    (b"v=2\0op=mount\0fuse_fd=3\0", "names no path"),
    (b"v=2\0op=mount\0path=/x\0", "must name the caller's /dev/fuse fd"),
    (b"v=2\0op=unmount\0path=/x\0fuse_fd=3\0", "fuse_fd applies to mount only"),
    (b"v=2\0op=mount\0path=/x\0fuse_fd=3\0flags=lazy\0", "flags apply to unmount only"),
    (b"v=2\0op=unmount\0path=/x\0flags=force\0", "unknown flag(s): force"),
    (b"v=2\0op=unmount\0path=/x\0mount_id=-1\0", "mount_id must be a number"),
    (f"v=2\0op=unmount\0path=/x\0mount_id={ARABIC_INDIC}\0".encode(), "mount_id must be a number"),
    (b"v=2\0op=mount\0path=/x\0fuse_fd= 3\0", "fuse_fd must be a number"),
    (b"v=2\0op=mount\0path=/" + b"x" * protocol.MAX_MESSAGE + b"\0", "malformed message"),
])
def test_bad_requests_are_refused_with_a_reason(data: bytes, words: str) -> None:
    with pytest.raises(protocol.BadRequest, match=re.escape(words)):
        protocol.parse_request(data)


# -- policy: options, read once -----------------------------------------------------------


@pytest.mark.parametrize(("given", "wanted"), [
    # what libfuse 3 (sshfs) and libfuse 2 (s3fs) send through the helper
    ("rw,nosuid,nodev,fsname=127.0.0.1:/srv,subtype=sshfs",
     MountOptions(source="127.0.0.1:/srv", subtype="sshfs")),
    ("rw,nosuid,nodev,allow_other,default_permissions,fsname=s3fs,subtype=s3fs",
     MountOptions(source="s3fs", subtype="s3fs",
                  flags=("allow_other", "default_permissions"))),
    ("", MountOptions()),
    ("ro,max_read=131072,noatime,sync,dirsync",
     MountOptions(max_read="131072", flags=("ro", "sync", "dirsync"),
                  attrs=("ro", "noatime"))),
    ("ro,rw,noexec,exec,nonempty", MountOptions()),  # the last one wins, as in fusermount3
    # An escaped comma is part of the name: the kernel gets it as one parameter.
    ("fsname=a\\,suid", MountOptions(source="a,suid")),
    ("fsname=back\\\\slash", MountOptions(source="back\\slash")),
])
def test_allowed_options_are_read_into_the_mounts_parameters(given: str,
                                                             wanted: MountOptions) -> None:
    assert policy.options(given) == wanted


@pytest.mark.parametrize(("given", "words"), [
    ("suid", "always nosuid,nodev"),
    ("rw,dev", "always nosuid,nodev"),
    ("fsname=a\\\\,suid", "always nosuid,nodev"),  # an escaped backslash, then a comma
    ("fsname=a\\", "ends in an unfinished escape"),  # would swallow what a joiner adds
    ("blkdev", "fuseblk"),
    ("blksize=4096", "fuseblk"),
    ("auto_unmount", "handled by the fusermount3 shim"),
    ("user_id=1000", "sets fd=, rootmode=, user_id="),
    ("fd=3", "sets fd="),
    ("context=system_u:object_r:tmp_t", "unknown mount option"),
    ("max_read=lots", "max_read must be a number"),
    (f"max_read={ARABIC_INDIC}", "max_read must be a number"),  # digits, but not ASCII ones
    ("max_read= 12", "max_read must be a number"),
    ("max_read=4294967296", "max_read must be a number"),
    ("subtype=", "needs a value"),
    ("fsname=a\nb", "control character"),
    ("x" * (policy.MAX_OPTIONS + 1), "longer than"),
])
def test_refused_options(given: str, words: str) -> None:
    with pytest.raises(Refused, match=re.escape(words)) as refused:
        policy.options(given)
    assert refused.value.kind == "option"


def test_options_split_like_fusermount3() -> None:
    """A backslash escapes only inside fsname= and subtype= values, as in fusermount3."""
    assert policy.split_options("fsname=a\\,b,rw") == ["fsname=a\\,b", "rw"]
    assert policy.split_options("fsname=a\\\\,suid") == ["fsname=a\\\\", "suid"]
    assert policy.split_options("max_read=1\\,suid") == ["max_read=1\\", "suid"]
    assert policy.split_options("rw,,ro") == ["rw", "", "ro"]


# -- policy: paths, callers, targets ------------------------------------------------------


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


def test_a_chrooted_caller_and_a_namespace_mapping_node_root_are_refused() -> None:
    policy.caller("/", maps_node_root=False)
    with pytest.raises(Refused, match="not its mount namespace's root"):
        policy.caller("/etc", maps_node_root=False)
    with pytest.raises(Refused, match="maps the node's uid 0"):
        policy.caller("/", maps_node_root=True)


def test_only_a_namespace_holding_the_brokers_directory_may_ask() -> None:
    ours = Mark("254:0", "/var/lib/fuse-device-plugin/broker")
    policy.allocated(Mark("254:0", "/var/lib/fuse-device-plugin/broker"), ours)
    for theirs in (Mark("", ""), Mark("254:0", "/elsewhere"), Mark("0:99", ours.root)):
        with pytest.raises(Refused, match="not given broker mode") as refused:
            policy.allocated(theirs, ours)
        assert refused.value.kind == "allocation"


def test_quotas_per_container_and_for_the_node() -> None:
    policy.room_for_another(3, 4, 10, 11)
    with pytest.raises(Refused, match=r"already holds 4 FUSE mounts.*--max-mounts 4"):
        policy.room_for_another(4, 4, 10, 100)
    with pytest.raises(Refused, match=r"node already holds 11.*--max-mounts-node 11"):
        policy.room_for_another(0, 4, 11, 11)


def target(**changes: object) -> Target:
    fields: dict[str, object] = dict(
        mount_id=40, fstype="overlay", mount_point="/", shared=False, mode=0o755,
        owner=1000, writable=True, uid=1000, gid=1000)
    fields.update(changes)
    return Target(**fields)  # type: ignore[arg-type]


@pytest.mark.parametrize(("changes", "node_root", "words"), [
    ({"fstype": "proc", "mount_point": "/mnt/p"}, True, "on a proc filesystem"),
    ({"fstype": "fuse.sshfs", "mount_point": "/mnt/f"}, True, "on a fuse.sshfs filesystem"),
    ({"fstype": "fuseblk", "mount_point": "/mnt/b"}, True, "on a fuseblk filesystem"),
    ({"fstype": "tmpfs", "mount_point": "/dev"}, True, "on the mount at '/dev'"),
    ({"shared": True, "mount_point": "/mnt/vol"}, True, "is on a shared mount"),
    ({"fstype": "tmpfs", "mount_point": "/run/fuse-broker"}, True, "under /run/fuse-broker"),
    ({"writable": False, "owner": 0}, False, "may not write the mountpoint"),
    ({"mode": 0o1777, "owner": 0}, False, "sticky and owned by uid 0"),
])
def test_targets_refused(changes: dict[str, object], node_root: bool, words: str) -> None:
    with pytest.raises(Refused, match=re.escape(words)):
        policy.may_mount(target(**changes), MountOptions(), node_root, allow_other=False)


def test_targets_allowed_and_the_node_decides_allow_other() -> None:
    policy.may_mount(target(), MountOptions(), node_root=False, allow_other=False)
    policy.may_mount(target(mode=0o1777, owner=1000), MountOptions(), False, False)
    policy.may_mount(target(writable=None, owner=0), MountOptions(), True, False)
    other = MountOptions(flags=("allow_other",))
    policy.may_mount(target(), other, node_root=True, allow_other=False)
    policy.may_mount(target(), other, node_root=False, allow_other=True)
    # a user-namespaced caller: the kernel confines allow_other to its own namespace
    policy.may_mount(target(), other, node_root=False, allow_other=False,
                     user_namespaced=True)
    with pytest.raises(Refused, match="allow_other is not allowed on this node"):
        policy.may_mount(target(), other, node_root=False, allow_other=False)


def existing(fstype: str = "fuse.sshfs", mount_id: int = 50) -> Existing:
    return Existing(mount_id=mount_id, fstype=fstype, connection=60)


@pytest.mark.parametrize(("found", "owner", "uid", "node_root", "mount_id", "words"), [
    (existing("tmpfs"), Owner("/c", 0), 0, True, None, "not a FUSE mount (it is tmpfs)"),
    (existing(), None, 0, True, None, "not a mount the broker made for this container"),
    (existing(), Owner("/other", 0), 0, True, None, "not a mount the broker made"),
    (existing(), Owner("/c", 1000), 1001, False, None, "belongs to uid 1000"),
    (existing(mount_id=51), Owner("/c", 0), 0, True, 50, "now a different mount"),
])
def test_unmounts_refused(found: Existing, owner: Owner | None, uid: int,  # noqa: PLR0917
                          node_root: bool, mount_id: int | None, words: str) -> None:
    with pytest.raises(Refused, match=re.escape(words)):
        policy.may_unmount(found, owner, container="/c", uid=uid, node_root=node_root,
                           mount_id=mount_id)


def test_unmounts_allowed() -> None:
    policy.may_unmount(existing(), Owner("/c", 1000), container="/c", uid=1000,
                       node_root=False, mount_id=50)
    policy.may_unmount(existing(), Owner("/c", 1000), container="/c", uid=0,
                       node_root=True, mount_id=None)


def test_fuseblk_is_fuse_for_every_rule() -> None:
    """Block-device FUSE has a daemon too: the broker never resolves a path through it,
    never mounts on it, and treats it as FUSE when asked to unmount."""
    assert all(policy.is_fuse(t) for t in ("fuse", "fuse.sshfs", "fuseblk", "fuseblk.ntfs"))
    assert not any(policy.is_fuse(t) for t in ("fusectl", "fuseblkx", "tmpfs", "overlay"))
    assert {"fuse", "fuse.", "fuseblk", "fuseblk.", "autofs"} <= set(policy.NO_WALK)
    assert not policy.MOUNTABLE & {"fuse", "fuseblk", "autofs", "proc", "sysfs"}


# -- mountinfo and records ----------------------------------------------------------------


TABLE = """\
22 1 254:0 / / rw,relatime shared:1 - ext4 /dev/vda rw
30 22 0:30 / /tmp rw,nosuid,nodev - tmpfs tmpfs rw
31 22 254:0 /var/lib/fuse-device-plugin/broker /var/lib/fuse-device-plugin/broker rw \
- ext4 /dev/vda rw
32 22 0:40 / /mnt/with\\040space rw,nosuid,nodev - fuse.sshfs host:/ rw,user_id=0
"""


def test_a_directory_is_known_by_its_filesystem_and_its_path_there() -> None:
    entries = mountinfo.parse(TABLE)
    assert [e.mountpoint for e in entries] == [
        "/", "/tmp", "/var/lib/fuse-device-plugin/broker", "/mnt/with space"]
    assert mountinfo.mark_of(Path("/var/lib/fuse-device-plugin/broker"), TABLE) == \
        Mark("254:0", "/var/lib/fuse-device-plugin/broker")
    assert mountinfo.mark_of(Path("/tmp/pytest/broker-dir"), TABLE) == \
        Mark("0:30", "/pytest/broker-dir")
    assert mountinfo.mark_of(Path("/srv/b"), TABLE) == Mark("254:0", "/srv/b")


def record(connection: int, inode: int, container: str = "/c", uid: int = 0) -> Record:
    return Record(connection=connection, ctl_inode=inode, container=container, uid=uid,
                  namespace=4026531840, mount_id=connection + 100, path="/mnt/x")


def test_records_count_what_the_kernel_still_holds(tmp_path: Path) -> None:
    """A record lives exactly as long as its connection's fusectl directory, and a
    re-used connection number (another inode) is not the broker's mount any more."""
    fusectl = tmp_path / "connections"
    for n in (40, 41, 42):
        (fusectl / str(n)).mkdir(parents=True)
    kept = Records(tmp_path / "state", fusectl)
    kept.load()
    for n in (40, 41, 42):
        kept.add(record(n, (fusectl / str(n)).stat().st_ino, "/c" if n < 42 else "/d",
                        uid=n))
    assert (kept.held("/c"), kept.held("/d"), kept.total) == (2, 1, 3)
    assert kept.owner(41) == Owner("/c", 41)
    (fusectl / "41").rmdir()
    (fusectl / "42").rmdir()
    (fusectl / "42").mkdir()  # the number again: a new connection, not ours
    assert kept.owner(42) is None
    assert kept.held("/c") == 1
    restarted = Records(tmp_path / "state", fusectl)
    (tmp_path / "state" / "garbage.json").write_text("{not json")
    live = record(40, (fusectl / "40").stat().st_ino).name
    # A write a killed broker left before its rename: not a record, and removed.
    (tmp_path / "state" / f".{live}").write_bytes((tmp_path / "state" / live).read_bytes())
    assert restarted.load() == 1
    assert restarted.owner(40) == Owner("/c", 40)
    left = record(40, (fusectl / "40").stat().st_ino).name
    assert sorted(p.name for p in (tmp_path / "state").iterdir()) == [left]
    assert oct((tmp_path / "state").stat().st_mode & 0o777) == "0o700"


# -- the shim and the helper --------------------------------------------------------------


@pytest.fixture(scope="module")
def shim() -> Path:
    return broker_rig.shim()


@pytest.mark.parametrize("name", [protocol.SHIM_NAME, "fuse-broker-helper"])
def test_the_native_programs_are_small_and_static(shim: Path, name: str) -> None:
    data = (shim.parent / name).read_bytes()
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
    (("-u", "/tmp/x"), {protocol.SOCKET_ENV: "/nonexistent/b.sock"},
     "fusermount3: cannot reach the FUSE mount broker at /nonexistent/b.sock"),
    *((("-u", "/tmp/x"), {protocol.SOCKET_ENV: "/nonexistent/b.sock", protocol.WAIT_ENV: bad},
       f"fusermount3: {protocol.WAIT_ENV} must be a whole number of seconds from 0 to "
       f"3600, got '{bad}'") for bad in ("", " 5", "+5", "5s", "3601", ARABIC_INDIC)),
])
def test_shim_errors_are_one_line_and_exit_1(shim: Path, args: tuple[str, ...],
                                             env: dict[str, str], message: str) -> None:
    result = run_shim(shim, *args, env=env)
    assert result.returncode == 1
    assert result.stderr.startswith(message)
    assert len(result.stderr.splitlines()) == 1


def test_shim_says_why_it_cannot_open_dev_fuse(shim: Path, tmp_path: Path) -> None:
    """A uid that may not open /dev/fuse (a 0600 node, as on a node without udev, seen
    by a non-root or user-namespaced pod) gets the line docs/errors.md lists.
    The node's own /dev/fuse is left alone: a private mount namespace covers it with a
    root-owned 0600 file."""
    if os.geteuid() != 0:
        pytest.skip("needs root: covers /dev/fuse in a mount namespace of its own")
    private = tmp_path / "fuse-0600"
    private.touch(mode=0o600)
    result = subprocess.run(
        ["unshare", "--mount", "--propagation", "private", "sh", "-c",
         f"mount --bind {private} /dev/fuse && exec setpriv --reuid=65534 --regid=65534 "
         f"--clear-groups {shim} -o rw /tmp"],
        env={"_FUSE_COMMFD": "3", "PATH": "/usr/bin:/bin"}, capture_output=True, text=True,
        timeout=10, check=False)
    assert (result.returncode, result.stderr) == (
        1, "fusermount3: failed to open /dev/fuse: Permission denied\n")


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


def _fake_broker(path: Path) -> socket.socket:
    server_sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    server_sock.bind(str(path))
    server_sock.listen(1)
    return server_sock


def test_shim_names_its_own_dev_fuse_and_relays_the_refusal(shim: Path,
                                                            tmp_path: Path) -> None:
    """A socket that answers as a refusing broker: the request names the fd the shim
    opened (no descriptor crosses the socket), and the shim prints the message."""
    if not os.access("/dev/fuse", os.R_OK | os.W_OK):
        pytest.skip("needs /dev/fuse that this user may open")
    path = tmp_path / "b.sock"
    with _fake_broker(path) as fake:
        proc = subprocess.Popen([str(shim), "-o", "rw,suid", str(tmp_path)],
                                env={"_FUSE_COMMFD": "3", protocol.SOCKET_ENV: str(path)},
                                stderr=subprocess.PIPE, text=True)
        conn, _ = fake.accept()
        with conn:
            data, fds, flags, _ = socket.recv_fds(conn, protocol.MAX_MESSAGE, 4)
            request = protocol.parse_request(data)
            fd_target = os.readlink(f"/proc/{proc.pid}/fd/{request.fuse_fd}")
            conn.send(protocol.encode(status="error", message="broker refused: no"))
        _, err = proc.communicate(timeout=10)
    assert (fds, flags & socket.MSG_CTRUNC) == ([], 0)
    assert request.op == "mount"
    assert request.path == str(tmp_path)
    assert request.options == "rw,suid"
    assert fd_target == "/dev/fuse"
    assert (proc.returncode, err) == (1, "fusermount3: broker refused: no\n")


def test_shim_reads_a_refusal_given_before_its_request_arrived(shim: Path,
                                                               tmp_path: Path) -> None:
    """A busy broker answers at accept and closes: the shim's send then fails, and the
    answer is still what the user sees."""
    path = tmp_path / "b.sock"
    with _fake_broker(path) as fake:
        proc = subprocess.Popen([str(shim), "-u", str(tmp_path / "x")],
                                env={protocol.SOCKET_ENV: str(path)},
                                stderr=subprocess.PIPE, text=True)
        conn, _ = fake.accept()
        replies.answer(conn, protocol.encode(status="error",
                                             message="broker refused: busy"))
        _, err = proc.communicate(timeout=10)
    assert (proc.returncode, err) == (1, "fusermount3: broker refused: busy\n")


# -- the shim and a broker that is restarting (issue 35) ----------------------------------
#
# A rollout of the broker's DaemonSet leaves the node without a broker for a few seconds:
# the old one removed its socket (or, killed, left it stale) and the new one has not bound
# yet. The shim waits for it, said once, and asks again only when the broker cannot have
# taken the request.


def _shim_define(name: str) -> str:
    source = broker_rig.SHIM_SOURCE.read_text()
    found = re.search(rf"^#define {name} (\S+)$", source, re.MULTILINE)
    assert found, name
    return found.group(1)


def _waiting_line(path: Path, why: str, seconds: int | str) -> str:
    return (f"fusermount3: the FUSE mount broker at {path} is not answering ({why}); "
            f"waiting up to {seconds} s for it to restart")


def _unreachable_line(path: Path, why: str) -> str:
    return (f"fusermount3: cannot reach the FUSE mount broker at {path}: {why} (broker mode "
            "needs the broker running on this node and the pod's github.com/fuse allocation)")


def _first_line(proc: subprocess.Popen[str], timeout: float = 10.0) -> str:
    """The shim's first line on stderr, once it has said it."""
    assert proc.stderr is not None
    ready, _w, _x = select.select([proc.stderr], [], [], timeout)
    if not ready:
        raise AssertionError(f"the shim said nothing within {timeout:g}s")
    return proc.stderr.readline().rstrip("\n")


def _stale_socket(path: Path) -> None:
    """What a broker that was killed leaves: the socket file, and nobody listening."""
    _fake_broker(path).close()


def _finish(proc: subprocess.Popen[str]) -> tuple[int, str]:
    try:
        _, err = proc.communicate(timeout=10)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    return proc.returncode, err


@pytest.mark.parametrize(("left", "why"), [("nothing", "No such file or directory"),
                                           ("a stale socket", "Connection refused")])
def test_shim_waits_for_a_restarting_broker_and_its_mount_is_then_served(
        shim: Path, tmp_path: Path, left: str, why: str) -> None:
    """No broker listening at a socket whose directory is there: the shim says once that
    it waits (the default wait, no setting), the broker that comes up gets the mount
    request, and libfuse gets the /dev/fuse fd, as if the broker had always been there."""
    if not os.access("/dev/fuse", os.R_OK | os.W_OK):
        pytest.skip("needs /dev/fuse that this user may open")
    path = tmp_path / "b.sock"
    if left == "a stale socket":
        _stale_socket(path)
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    ours.settimeout(10)
    with ours, theirs:
        proc = subprocess.Popen([str(shim), "-o", "rw", str(tmp_path)],
                                env={"_FUSE_COMMFD": str(theirs.fileno()),
                                     protocol.SOCKET_ENV: str(path)},
                                pass_fds=(theirs.fileno(),), stderr=subprocess.PIPE,
                                text=True)
        try:
            said = _first_line(proc)
            path.unlink(missing_ok=True)  # as a new broker replaces a stale socket
            with _fake_broker(path) as fake:
                fake.settimeout(10)
                conn, _ = fake.accept()
                with conn:
                    request = protocol.parse_request(conn.recv(protocol.MAX_MESSAGE))
                    replies.answer(conn, protocol.encode(status="ok", mount_id=7))
            _, fds, _flags, _addr = socket.recv_fds(ours, 1, 1)
        finally:
            status = _finish(proc)
    for fd in fds:
        target = os.readlink(f"/proc/self/fd/{fd}")
        os.close(fd)
    assert said == _waiting_line(path, why, _shim_define("WAIT_SECONDS"))
    assert (request.op, request.path, request.options) == ("mount", str(tmp_path), "rw")
    assert (len(fds), target) == (1, "/dev/fuse")
    assert status == (0, "")


@pytest.mark.parametrize("accepted", [False, True])
def test_shim_asks_again_when_the_broker_went_away_without_reading_its_request(
        shim: Path, tmp_path: Path, accepted: bool) -> None:
    """A broker that exits with the shim's connection in its backlog, or accepted but
    its request unread: the kernel resets the connection, nothing of the request was
    acted on, and the shim asks the next broker."""
    path = tmp_path / "b.sock"
    going = _fake_broker(path)
    proc = subprocess.Popen([str(shim), "-u", str(tmp_path / "x")],
                            env={protocol.SOCKET_ENV: str(path)}, stderr=subprocess.PIPE,
                            text=True)
    try:
        with going:
            ready, _w, _x = select.select([going], [], [], 10)
            assert ready, "the shim did not connect"
            if accepted:
                going.accept()[0].close()
        path.unlink()
        said = _first_line(proc)
        with _fake_broker(path) as fake:
            fake.settimeout(10)
            conn, _ = fake.accept()
            with conn:
                request = protocol.parse_request(conn.recv(protocol.MAX_MESSAGE))
                replies.answer(conn, protocol.encode(status="ok", mount_id=7))
    finally:
        status = _finish(proc)
    assert said == _waiting_line(path, "it closed the connection unread",
                                 _shim_define("WAIT_SECONDS"))
    assert (request.op, request.path) == ("unmount", str(tmp_path / "x"))
    assert status == (0, "")


def test_shim_does_not_ask_again_once_the_broker_has_read_its_request(
        shim: Path, tmp_path: Path) -> None:
    """The broker read the request and went away without answering (killed mid-request):
    it may have made the mount, so the shim says so instead of asking again. The socket
    stays listening: a second request would hang the shim on its reply."""
    path = tmp_path / "b.sock"
    with _fake_broker(path) as fake:
        fake.settimeout(10)
        proc = subprocess.Popen([str(shim), "-u", str(tmp_path / "x")],
                                env={protocol.SOCKET_ENV: str(path)},
                                stderr=subprocess.PIPE, text=True)
        try:
            conn, _ = fake.accept()
            with conn:
                conn.recv(protocol.MAX_MESSAGE)
        finally:
            status = _finish(proc)
    assert status == (1, "fusermount3: the FUSE mount broker closed the connection "
                         "(restarting?)\n")


@pytest.mark.parametrize(("left", "why"), [("nothing", "No such file or directory"),
                                           ("a stale socket", "Connection refused")])
def test_shim_gives_up_on_a_broker_that_does_not_come_back(
        shim: Path, tmp_path: Path, left: str, why: str) -> None:
    """Past its wait (1 s here, through the caller's environment) the shim fails with the
    line it would have printed at once, after the one that said it waits."""
    path = tmp_path / "b.sock"
    if left == "a stale socket":
        _stale_socket(path)
    result = run_shim(shim, "-u", str(tmp_path / "x"),
                      env={protocol.SOCKET_ENV: str(path), protocol.WAIT_ENV: "1"})
    assert result.returncode == 1
    assert result.stderr.splitlines() == [_waiting_line(path, why, 1),
                                          _unreachable_line(path, why)]


@pytest.mark.parametrize(("where", "wait"), [("no directory", "3600"), ("no socket", "0")])
def test_shim_does_not_wait_without_the_socket_directory_or_with_no_wait(
        shim: Path, tmp_path: Path, where: str, wait: str) -> None:
    """No /run/fuse-broker at all: Allocate did not put the container in broker mode, no
    broker will come, and the shim fails at once with its one line, however long it
    would wait. A wait of 0 fails at once as well. (A wait would outlast run_shim's
    deadline.)"""
    path = tmp_path / ("absent" if where == "no directory" else "") / "b.sock"
    result = run_shim(shim, "-u", str(tmp_path / "x"),
                      env={protocol.SOCKET_ENV: str(path), protocol.WAIT_ENV: wait})
    assert (result.returncode, result.stderr.splitlines()) == (
        1, [_unreachable_line(path, "No such file or directory")])


# -- the broker process -------------------------------------------------------------------


def broker_command(tmp_path: Path, shim: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "fuse_plugin", "broker", "--dir", str(tmp_path / "dir"),
            "--shim", str(shim), "--state-dir", str(tmp_path / "state"),
            "--lxcfs-dir", str(tmp_path / "lxcfs"), *extra]


def test_a_pip_installed_broker_says_in_one_line_how_to_get_its_programs(
        tmp_path: Path) -> None:
    """``pip install .`` into a fresh venv, then ``fuse-device-plugin broker`` as a user
    would run it: the wheel carries no compiled programs, and the default --shim (the
    image's path) is missing, so the command names the one that builds them."""
    root = Path(__file__).resolve().parents[2]
    wheels, venv = tmp_path / "wheels", tmp_path / "venv"
    for step in ([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps",
                  "--no-build-isolation", "-w", str(wheels), str(root)],
                 [sys.executable, "-m", "venv", str(venv)]):
        subprocess.run(step, capture_output=True, text=True, timeout=120, check=True)
    [wheel] = wheels.glob("*.whl")
    subprocess.run([str(venv / "bin" / "pip"), "install", "-q", "--no-deps", "--no-index",
                    str(wheel)], capture_output=True, text=True, timeout=120, check=True)
    result = subprocess.run([str(venv / "bin" / "fuse-device-plugin"), "broker", "--dir",
                             str(tmp_path / "dir"), "--state-dir", str(tmp_path / "state")],
                            capture_output=True, text=True, timeout=30, check=False)
    assert result.returncode == 2
    assert "scripts/build-native DIR" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr


@pytest.mark.parametrize(("extra", "message"), [
    (("--max-mounts", "0"), "--max-mounts: must be a whole number from 1 to 10000"),
    (("--max-mounts", " 5"), "--max-mounts: must be a whole number from 1 to 10000"),
    (("--max-mounts-node", "+5"), "--max-mounts-node: must be a whole number"),
    (("--dir", "relative"), "--dir: must be an absolute path"),
    (("--state-dir", "relative"), "--state-dir: must be an absolute path"),
    (("--allow-other", "maybe"), "--allow-other"),
    (("--shim", "/nonexistent/fusermount3"),
     "--shim /nonexistent/fusermount3 is not an executable file"),
    (("--shim", "/bin/true"), "fuse-broker-helper (beside --shim) /bin/fuse-broker-helper "
                              "is not an executable file"),
])
def test_broker_bad_flags_exit_2_with_one_line(shim: Path, tmp_path: Path,
                                               extra: tuple[str, ...], message: str) -> None:
    result = subprocess.run(broker_command(tmp_path, shim, *extra), capture_output=True,
                            text=True, timeout=30, check=False)
    assert result.returncode == 2
    assert message in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr


@pytest.fixture
def root() -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root: the broker reads other processes' namespaces")


def test_broker_starts_installs_the_shim_stops_and_replaces_a_stale_socket(
        root: None, shim: Path, tmp_path: Path) -> None:
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
    # The killed broker's socket went, and the line says so (sockets.take_over).
    assert [e["event"] for e in again.events()] == [
        "socket.stale_removed", "broker.serving", "signal", "stopped"]


def test_a_node_where_the_runtime_made_a_directory_of_the_shim_recovers(
        shim: Path, tmp_path: Path) -> None:
    """A container that started before the shim existed left an empty directory at the
    bind source (the runtime creates a missing source as one), and an interrupted
    install a temp file: the next install removes both. An identical shim is kept (the
    very file containers bind)."""
    (tmp_path / protocol.SHIM_NAME).mkdir()
    (tmp_path / f".{protocol.SHIM_NAME}.x1y2.tmp").write_bytes(b"half")
    installed = install_shim(tmp_path, shim.read_bytes())
    assert installed.read_bytes() == shim.read_bytes()
    assert sorted(p.name for p in tmp_path.iterdir()) == [protocol.SHIM_NAME]
    inode = installed.stat().st_ino
    assert install_shim(tmp_path, shim.read_bytes()).stat().st_ino == inode


def test_the_socket_refuses_descriptors(root: None, shim: Path, tmp_path: Path) -> None:
    """SO_PASSRIGHTS (Linux 6.16): a client that attaches a descriptor fails in its own
    sendmsg, so the broker never holds a reference to a tenant's file."""
    broker = broker_rig.BrokerProcess(tmp_path / "dir", tmp_path / "b", shim).start()
    try:
        if not broker.events("broker.serving")[0]["refuses_descriptors"]:
            pytest.skip("this kernel has no SO_PASSRIGHTS (Linux 6.16+)")
        with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as sock, \
                open("/dev/null") as null:
            sock.connect(str(broker.socket))
            with pytest.raises(PermissionError):
                socket.send_fds(sock, [protocol.encode(v="2", op="unmount", path="/x")],
                                [null.fileno()])
    finally:
        broker.stop()


def test_a_caller_gets_its_share_of_connections_and_no_more(root: None, shim: Path,
                                                            tmp_path: Path) -> None:
    """Silent connections from one container (here: this test's cgroup) take only its
    own share: the next one is answered at once, and logged once, not per connection."""
    broker = broker_rig.BrokerProcess(tmp_path / "dir", tmp_path / "b", shim).start()
    held: list[socket.socket] = []
    try:
        for _ in range(shares.PER_CONTAINER):
            held.append(socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET))
            held[-1].connect(str(broker.socket))
        answers = []
        for _ in range(20):
            with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as extra:
                extra.connect(str(broker.socket))
                answers.append(protocol.decode(extra.recv(protocol.MAX_MESSAGE)))
        assert {a["message"] for a in answers} == {
            f"broker refused: this container has {shares.PER_CONTAINER} requests open, "
            "the most it may; try again"}
        [line] = [e for e in broker.events("broker.refused") if e.get("kind") == "busy"]
        assert line["connections"] >= 1
    finally:
        for sock in held:
            sock.close()
        broker.stop()


def test_a_request_from_outside_any_container_is_refused(root: None, shim: Path,
                                                         tmp_path: Path) -> None:
    """A node process (this test) with its own /dev/fuse and a real directory: its
    namespace has no bind of the broker's directory, so Allocate never gave it broker
    mode, and nothing is mounted."""
    broker = broker_rig.BrokerProcess(tmp_path / "dir", tmp_path / "b", shim).start()
    (tmp_path / "mnt").mkdir()
    fuse = os.open("/dev/fuse", os.O_RDWR)
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as sock:
            sock.connect(str(broker.socket))
            sock.send(protocol.encode(v="2", op="mount", path=str(tmp_path / "mnt"),
                                      fuse_fd=fuse))
            answer = protocol.decode(sock.recv(protocol.MAX_MESSAGE))
    finally:
        os.close(fuse)
        broker.stop()
    assert "was not given broker mode" in answer["message"]
    assert not os.path.ismount(tmp_path / "mnt")


def test_a_helper_past_its_deadline_is_killed_and_the_caller_told(
        root: None, shim: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A helper that never answers (here a stand-in that sleeps) is killed at the
    deadline, the caller gets a reason, and the loop goes on."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / protocol.SHIM_NAME).write_bytes(shim.read_bytes())
    (bin_dir / "fuse-broker-helper").write_text("#!/bin/sh\nexec sleep 600\n")
    for program in bin_dir.iterdir():
        program.chmod(0o755)
    monkeypatch.setattr(scheduler, "HELPER_DEADLINE", 0.3)
    broker = Broker(BrokerSettings(directory=tmp_path / "dir", state=tmp_path / "state",
                                   lxcfs_dir=tmp_path / "lxcfs",
                                   shim=bin_dir / protocol.SHIM_NAME),
                    logging.getLogger("test"))
    broker.start()
    loop = threading.Thread(target=broker.run, name="broker")
    loop.start()
    try:
        fuse = os.open("/dev/fuse", os.O_RDWR)
        with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as sock:
            sock.connect(str(broker.socket_path))
            sock.send(protocol.encode(v="2", op="mount", path=str(tmp_path), fuse_fd=fuse))
            answer = protocol.decode(sock.recv(protocol.MAX_MESSAGE))
        os.close(fuse)
    finally:
        broker.stop()
        loop.join(10)
        signal.set_wakeup_fd(-1)  # start() armed it in this (the main) thread
    assert "did not finish within 0.3s" in answer["message"]
    assert broker.stats.snapshot().stalled == 1
    assert not loop.is_alive()


def test_the_brokers_probes_and_metrics(root: None, shim: Path, tmp_path: Path) -> None:
    """/healthz while the loop turns, /readyz while its socket is the one at the path,
    /metrics with the refusals by kind."""
    port = free_port()
    broker = broker_rig.BrokerProcess(tmp_path / "dir", tmp_path / "b", shim,
                                      "--metrics-port", str(port)).start()
    try:
        assert get(port, "/healthz") == (200, "ok\n")
        assert get(port, "/readyz") == (200, "ready\n")
        with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as sock:
            sock.connect(str(broker.socket))
            sock.send(protocol.encode(v="2", op="unmount", path="/etc/x"))
            sock.recv(protocol.MAX_MESSAGE)
        code, text = get(port, "/metrics")
        assert code == 200
        assert 'fuse_mount_broker_refusals_total{kind="path"} 1.0' in text
        assert 'fuse_mount_broker_requests_total{op="mount"} 0.0' in text
        broker.socket.unlink()  # another process took the path: not ready any more
        assert get(port, "/readyz")[0] == 503
    finally:
        broker.stop()


def test_a_turn_takes_one_new_connection(root: None, shim: Path, tmp_path: Path) -> None:
    """Taking a connection reads its request and may start a helper, so the loop takes
    one a turn: the helpers' reports of mounts under way are heard between any two
    (why, in figures: bench/README.md, "The broker under chaos"). Five requests queued at
    once are answered one a turn, in order."""
    broker = Broker(BrokerSettings(directory=tmp_path / "dir", state=tmp_path / "state",
                                   lxcfs_dir=tmp_path / "lxcfs",
                                   shim=shim), logging.getLogger("test"))
    broker.start()
    clients = []
    try:
        for k in range(5):
            client = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            clients.append(client)
            client.connect(str(broker.socket_path))
            client.send(protocol.encode(v="2", op="unmount", path=f"/nothing/{k}"))
        answered = []
        for _ in clients:
            broker._turn(0.0)
            ready, _w, _x = select.select(clients, [], [], 0)
            answered.append([clients.index(c) for c in ready])
    finally:
        broker.stop()
        broker.run()  # stopped already: closes what start() opened
        signal.set_wakeup_fd(-1)  # start() armed it in this (the main) thread
        for client in clients:
            client.close()
    assert answered == [[0], [0, 1], [0, 1, 2], [0, 1, 2, 3], [0, 1, 2, 3, 4]]


def test_liveness_fails_when_the_loop_has_stopped_turning(tmp_path: Path) -> None:
    """The loop turns every second whatever tenants do; one that has not turned for
    STUCK_AFTER is stuck, and the kubelet should restart the broker."""
    from fuse_plugin.broker import probes

    broker = Broker(BrokerSettings(directory=tmp_path, lxcfs_dir=tmp_path / "lxcfs"),
                    logging.getLogger("test"))
    assert probes.health(broker) == (True, "ok")
    broker.turned -= probes.STUCK_AFTER + 1
    ok, reason = probes.health(broker)
    assert not ok
    assert "the loop has not turned for" in reason


def test_a_caller_of_another_uid_is_alive_to_a_broker_without_cap_kill(root: None) -> None:
    """The DaemonSet grants no CAP_KILL, so signal 0 to a non-root caller answers EPERM:
    that process is there (a kubelet stage caught every non-root caller refused). The
    caller is asked once it says it runs as uid 1000 (before, it is still root's: the
    check proved nothing, and a kill without CAP_KILL failed when it came after), and
    ends when its stdin closes."""
    code = ("import os, subprocess, sys; from fuse_plugin.broker.caller import Caller\n"
            "p = subprocess.Popen(['setpriv', '--reuid=1000', '--regid=1000', "
            "'--clear-groups', sys.executable, '-c', "
            "'import os, sys; print(os.getuid(), flush=True); sys.stdin.read()'], "
            "stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)\n"
            "assert p.stdout is not None and p.stdin is not None\n"
            "assert p.stdout.readline() == '1000\\n'\n"
            "c = Caller(pid=p.pid, uid=1000, gid=1000, pidfd=os.pidfd_open(p.pid), "
            "container='')\n"
            "alive = c.alive(); p.stdin.close(); p.wait()\n"
            "print(alive, c.alive())")
    result = subprocess.run(["setpriv", "--inh-caps=-kill", "--bounding-set=-kill", "--",
                             sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=30, check=False)
    assert result.stdout.split() == ["True", "False"], result.stderr


# epoll_wait and epoll_pwait on x86-64 and arm64 (asm-generic has only epoll_pwait).
EPOLL_WAITS = {"232", "281", "22"}


def test_stop_from_another_thread_wakes_a_waiting_loop(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """SIGTERM's handler stops the broker from a thread of its own, which can come after
    the loop went back to waiting: the loop must wake, not sleep out its turn (CI once
    caught a broker that had not exited 10 s after SIGTERM)."""
    monkeypatch.setattr(server, "TURN", 60.0)
    broker = Broker(BrokerSettings(directory=tmp_path, lxcfs_dir=tmp_path / "lxcfs"),
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


def test_broker_command_imports_no_more_than_the_standard_library() -> None:
    """The broker runs from a plain python3 (the AppArmor guest has no venv): parsing its
    command line must not pull in watchdog, grpc or the profile modules."""
    code = ("import sys; from fuse_plugin import cli; "
            "cli.build_parser(['broker']).parse_args(['broker']); "
            "from fuse_plugin.broker import server; "
            "print(sorted(m for m in ('watchdog', 'grpc', 'fuse_plugin.profiles', "
            "'fuse_plugin.doctor', 'google.protobuf') if m in sys.modules))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=30, check=True)
    assert result.stdout.strip() == "[]"


# -- the plugin's side --------------------------------------------------------------------


def test_serve_with_broker_dir_binds_the_socket_dir_and_shim(
        kubelet: KubeletStandIn, start_plugin: StartPlugin, tmp_path: Path) -> None:
    broker_dir = tmp_path / "broker"
    broker_dir.mkdir()
    (broker_dir / protocol.SHIM_NAME).write_bytes(b"shim")
    start_plugin("--broker-dir", str(broker_dir))
    kubelet.wait_registered()
    [container] = kubelet.allocate(RESOURCE, [["fuse-0"]]).container_responses
    assert len(container.devices) == 1
    assert [(m.container_path, m.host_path, m.read_only) for m in container.mounts] == [
        ("/run/fuse-broker", str(broker_dir), True),
        *((target, str(broker_dir / protocol.SHIM_NAME), True)
          for target in protocol.SHIM_TARGETS)]


def test_in_broker_mode_slots_are_healthy_only_while_the_shim_is_installed(
        kubelet: KubeletStandIn, start_plugin: StartPlugin, tmp_path: Path) -> None:
    """A bind whose source is missing makes the runtime create a directory there and
    fail the container: until the broker has installed its shim, the node offers no
    slot; a shim replaced by a directory takes them away again."""
    broker_dir = tmp_path / "broker"
    broker_dir.mkdir()
    plugin = start_plugin("--broker-dir", str(broker_dir))
    kubelet.wait_registered()

    def health(wanted: str) -> None:
        assert kubelet.wait_devices(RESOURCE, lambda d: set(d.values()) == {wanted}), \
            plugin.log

    health("Unhealthy")
    assert "the broker has not installed its shim" in plugin.log
    shim = broker_dir / protocol.SHIM_NAME
    shim.write_bytes(b"shim")
    health("Healthy")
    shim.unlink()
    shim.mkdir()
    health("Unhealthy")

    def refusal() -> str:
        try:
            kubelet.allocate(RESOURCE, [["fuse-0"]])
        except grpc.RpcError as err:
            return str(err.details())
        return "allocated"

    # The reason follows the node as it is now (a directory), whatever was seen between.
    assert wait_for(lambda: "is not a regular file" in refusal(), 10,
                    "Allocate's refusal to name the directory at the shim's path")


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

