"""``fuse-device-plugin doctor`` on fake node trees (healthy, then broken one part at a
time), against a real plugin answering on a real unix socket, and ``--explain``."""

from __future__ import annotations

import json
import os
import shutil
import socket
import stat
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from concurrent import futures
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import grpc
import pytest

from fuse_plugin import cli, logs, sockets
from fuse_plugin.api import api_pb2_grpc
from fuse_plugin.config import Settings
from fuse_plugin.demo import make_node
from fuse_plugin.deviceplugin import plugin
from fuse_plugin.deviceplugin.servicer import WORKERS, FuseServicer
from fuse_plugin.devices import DeviceState
from fuse_plugin.doctor import checks as doctor
from fuse_plugin.doctor import explain as fuse_errors
from fuse_plugin.stats import Stats
from tests.lib.doctor_tree import (
    PLUGIN_DIR,
    SECCOMP_DIR,
    SECCOMP_OK,
    SOCKET,
    apparmor_listing,
    build_static_tree,
    put,
)
from tests.lib.kubelet import KubeletStandIn
from tests.lib.node import FakeNode
from tests.lib.plugin import PluginProcess
from tests.lib.waiting import wait_notified

ALL_LINES = ["fuse filesystem", "fuse device", "fuse device mode", "device-plugin dir",
             "kubelet socket", "plugin socket", "apparmor", "apparmor profiles",
             "seccomp profiles", "cgroup"]
needs_root = pytest.mark.skipif(
    os.geteuid() != 0, reason="needs root: the fake node's /dev/fuse is made with mknod")


@pytest.fixture
def root() -> Iterator[Path]:
    """A short path: unix socket names in the tree must fit in 107 bytes."""
    path = Path(tempfile.mkdtemp(prefix="fdp-doctor-", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


def make_device(root: Path, major: int = 10, minor: int = 229, mode: int = 0o666) -> Path:
    device = root / "dev" / "fuse"
    device.parent.mkdir(parents=True, exist_ok=True)
    return make_node(device, major, minor, mode)


@contextmanager
def listening(path: Path) -> Iterator[None]:
    """Something accepting connections at ``path``: enough for the kubelet socket check."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.bind(str(path))
        sock.listen()
        yield


def stale_socket(path: Path) -> None:
    """A socket file nobody listens on, as a crashed process leaves behind."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.bind(str(path))


@contextmanager
def fuse_plugin(directory: Path, device: Path, instance: str = "") -> Iterator[None]:
    """The plugin exactly as ``serve`` builds it, serving in ``directory``."""
    settings = Settings(device_plugin_dir=directory, fuse_device=device, slots=4,
                        log_level="error", instance=instance)
    with plugin.in_background(settings, logs.get()) as running:
        assert wait_notified(running.lifecycle.turned, running.lifecycle.owns_socket), \
            "never served"
        yield


@contextmanager
def answering_moved(bind: Path, device: Path, move_to: Path) -> Iterator[None]:
    """The servicer on a socket bound at a short path and then moved to ``move_to``: a
    path longer than a socket address holds, which no plugin could bind there itself."""
    state = DeviceState(device, 4)
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=WORKERS))
    api_pb2_grpc.add_DevicePluginServicer_to_server(FuseServicer(state, logs.get(), Stats()),
                                                    server)
    server.add_insecure_port(f"unix://{bind}")
    server.start()
    os.rename(bind, move_to)
    try:
        yield
    finally:
        state.close()
        server.stop(None).wait()


@pytest.fixture
def healthy(root: Path) -> Iterator[Path]:
    """A complete healthy node: device 0666, kubelet listening, our plugin answering."""
    if os.geteuid() != 0:
        pytest.skip("needs root: the fake node's /dev/fuse is made with mknod")
    build_static_tree(root)
    device = make_device(root)
    with listening(root / PLUGIN_DIR / "kubelet.sock"), \
            fuse_plugin(root / PLUGIN_DIR, device):
        yield root


Run = Callable[..., tuple[int, dict[str, dict[str, str]], list[str]]]
Explain = Callable[[str], tuple[int, dict[str, Any]]]


@pytest.fixture
def run_doctor(capsys: pytest.CaptureFixture[str]) -> Run:
    """``doctor --output json`` through the CLI: exit code, lines by name, names in order."""
    def run(root: Path, *args: str) -> tuple[int, dict[str, dict[str, str]], list[str]]:
        code = cli.main(["doctor", "--root", str(root), "--output", "json", *args])
        document = json.loads(capsys.readouterr().out)
        assert document["root"] == str(root)
        checks = document["checks"]
        worst = max((c["verdict"] for c in checks), key=["ok", "warn", "fail"].index)
        assert document["verdict"] == worst
        return code, {c["name"]: c for c in checks}, [c["name"] for c in checks]
    return run


def verdicts(lines: dict[str, dict[str, str]]) -> dict[str, str]:
    return {name: line["verdict"] for name, line in lines.items()}


# -- the healthy node ----------------------------------------------------------------

def test_healthy_node_is_all_ok(healthy: Path, run_doctor: Run) -> None:
    code, lines, order = run_doctor(healthy)
    assert order == ALL_LINES
    assert set(verdicts(lines).values()) == {"ok"}, lines
    assert code == 0
    assert lines["fuse device"]["detail"] == "/dev/fuse is char 10:229"
    assert "answers GetDevicePluginOptions (preferred allocation: yes)" in \
        lines["plugin socket"]["detail"]
    assert lines["cgroup"]["detail"].startswith("v2")


def test_real_serve_process_registered_with_the_kubelet_stand_in(root: Path,
                                                                 run_doctor: Run) -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root: the fake node's /dev/fuse is made with mknod")
    build_static_tree(root)
    node = FakeNode(root, root / PLUGIN_DIR, make_device(root))
    with ExitStack() as stack:
        kubelet = stack.enter_context(KubeletStandIn(node.plugin_dir))
        plugin = PluginProcess(node)
        stack.callback(plugin.close)
        kubelet.wait_registered()
        code, lines, _ = run_doctor(root)
        assert verdicts(lines)["kubelet socket"] == "ok"
        assert verdicts(lines)["plugin socket"] == "ok", lines["plugin socket"]
        assert code == 0
        assert plugin.terminate() == 0
    code, lines, _ = run_doctor(root)
    # serve removes its socket on SIGTERM: the node now has no plugin.
    assert "does not exist: the plugin is not running" in lines["plugin socket"]["detail"]
    assert code == 1


def test_text_output_is_a_table_with_fixes_for_what_is_not_ok(
        healthy: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (healthy / "dev" / "fuse").chmod(0o600)
    assert cli.main(["doctor", "--root", str(healthy)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].split() == ["CHECK", "VERDICT", "DETAIL"]
    mode = next(i for i, line in enumerate(out) if line.startswith("fuse device mode"))
    assert out[mode].split()[3] == "warn"
    assert out[mode + 1].strip().startswith("fix: chmod 0666 /dev/fuse")
    assert out[-1] == "9 ok, 1 warn, 0 fail"
    assert sum(line.strip().startswith("fix:") for line in out) == 1


# -- broken nodes, one part at a time ------------------------------------------------

def test_kernel_without_fuse_fails(healthy: Path, run_doctor: Run) -> None:
    put(healthy, "proc/filesystems", "nodev\tsysfs\nnodev\tfusectl\n\tfuseblk\n")
    code, lines, _ = run_doctor(healthy)
    assert verdicts(lines)["fuse filesystem"] == "fail"
    assert "modprobe fuse" in lines["fuse filesystem"]["fix"]
    assert code == 1


@needs_root
@pytest.mark.parametrize(("make", "detail"), [
    (lambda d: None, "/dev/fuse does not exist"),
    (lambda d: d.write_text(""), "/dev/fuse is not a character device"),
    (lambda d: os.mknod(d, 0o666 | stat.S_IFCHR, os.makedev(1, 3)),
     "/dev/fuse is char 1:3, not 10:229"),
    (lambda d: os.mknod(d, 0o666 | stat.S_IFBLK, os.makedev(10, 229)),
     "/dev/fuse is not a character device"),
])
def test_wrong_device_fails(root: Path, run_doctor: Run, make: Callable[[Path], None],
                            detail: str) -> None:
    build_static_tree(root)
    (root / "dev").mkdir()
    make(root / "dev" / "fuse")
    code, lines, order = run_doctor(root)
    assert lines["fuse device"]["verdict"] == "fail"
    assert lines["fuse device"]["detail"] == detail
    assert "mknod -m 0666 /dev/fuse c 10 229" in lines["fuse device"]["fix"]
    assert "fuse device mode" not in order  # nothing to say about a mode of the wrong thing
    assert code == 1


def test_mode_0600_warns_but_does_not_fail(healthy: Path, run_doctor: Run) -> None:
    (healthy / "dev" / "fuse").chmod(0o600)
    code, lines, _ = run_doctor(healthy)
    line = lines["fuse device mode"]
    assert line["verdict"] == "warn"
    assert line["detail"].startswith("0600: only its owner")
    assert "hostUsers: false" in line["detail"]
    assert 'MODE="0666"' in line["fix"]
    assert code == 0


def test_custom_device_path(healthy: Path, run_doctor: Run) -> None:
    (healthy / "dev" / "fuse").rename(healthy / "dev" / "fuse-alt")
    _, lines, _ = run_doctor(healthy, "--fuse-device", "/dev/fuse-alt")
    assert lines["fuse device"]["detail"] == "/dev/fuse-alt is char 10:229"


def test_no_kubelet_socket_fails(root: Path, run_doctor: Run) -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root: the fake node's /dev/fuse is made with mknod")
    build_static_tree(root)
    with fuse_plugin(root / PLUGIN_DIR, make_device(root)):
        code, lines, _ = run_doctor(root)
    assert lines["kubelet socket"]["verdict"] == "fail"
    assert lines["kubelet socket"]["detail"] == (
        f"/{PLUGIN_DIR}/kubelet.sock does not exist: the kubelet is not running")
    assert lines["plugin socket"]["verdict"] == "ok"
    assert code == 1


def test_stale_kubelet_socket_fails(healthy: Path, run_doctor: Run) -> None:
    kubelet = healthy / PLUGIN_DIR / "kubelet.sock"
    kubelet.unlink()
    stale_socket(kubelet)
    code, lines, _ = run_doctor(healthy)
    assert "refuses connections: a stale socket, the kubelet died" in \
        lines["kubelet socket"]["detail"]
    assert code == 1


def test_no_device_plugin_dir_fails_without_socket_lines(healthy: Path, run_doctor: Run) -> None:
    code, lines, order = run_doctor(healthy, "--device-plugin-dir", "/var/lib/elsewhere")
    assert (lines["device-plugin dir"]["verdict"], lines["device-plugin dir"]["detail"]) == (
        "fail", "/var/lib/elsewhere does not exist")
    assert "kubelet socket" not in order
    assert "plugin socket" not in order
    assert code == 1


def test_device_plugin_dir_from_the_serve_environment_twin(
        healthy: Path, run_doctor: Run, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FUSE_DEVICE_PLUGIN_DEVICE_PLUGIN_DIR", "/var/lib/elsewhere")
    _, lines, _ = run_doctor(healthy)
    assert lines["device-plugin dir"]["detail"] == "/var/lib/elsewhere does not exist"


def test_plugin_socket_missing_fails(root: Path, run_doctor: Run) -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root: the fake node's /dev/fuse is made with mknod")
    build_static_tree(root)
    make_device(root)
    with listening(root / PLUGIN_DIR / "kubelet.sock"):
        code, lines, _ = run_doctor(root)
    assert lines["plugin socket"]["verdict"] == "fail"
    assert "does not exist: the plugin is not running" in lines["plugin socket"]["detail"]
    assert code == 1


def test_stale_plugin_socket_is_told_by_connect_not_by_a_deadline(root: Path,
                                                                   run_doctor: Run) -> None:
    """connect(2) refuses a socket nobody serves: the check says so from that answer (a
    gRPC call would only have timed out, and said DEADLINE_EXCEEDED)."""
    if os.geteuid() != 0:
        pytest.skip("needs root: the fake node's /dev/fuse is made with mknod")
    build_static_tree(root)
    make_device(root)
    stale_socket(root / PLUGIN_DIR / SOCKET)
    with listening(root / PLUGIN_DIR / "kubelet.sock"):
        code, lines, _ = run_doctor(root)
    assert lines["plugin socket"]["verdict"] == "fail"
    assert lines["plugin socket"]["detail"] == (
        f"/{PLUGIN_DIR}/{SOCKET} refuses connections: a stale socket, the plugin died")
    assert code == 1


@needs_root
def test_both_plugins_of_a_rollout_answer_and_a_stale_one_warns(root: Path,
                                                                run_doctor: Run) -> None:
    """The DaemonSet names each pod's socket by its UID: without --instance the doctor
    checks every socket of the resource; with it (kubectl exec into the plugin pod sets
    it), only that pod's."""
    build_static_tree(root)
    device = make_device(root)
    plugins = root / PLUGIN_DIR
    with listening(plugins / "kubelet.sock"), fuse_plugin(plugins, device, "old"), \
            fuse_plugin(plugins, device, "new"):
        code, lines, _ = run_doctor(root)
        assert (code, lines["plugin socket"]["verdict"]) == (0, "ok"), lines["plugin socket"]
        assert lines["plugin socket"]["detail"].startswith("2 plugins serve")
        _, lines, _ = run_doctor(root, "--instance", "new")
        assert lines["plugin socket"]["detail"].startswith(
            f"/{PLUGIN_DIR}/github.com_fuse-new.sock answers GetDevicePluginOptions")
        stale_socket(plugins / "github.com_fuse-gone.sock")
        code, lines, _ = run_doctor(root)
    line = lines["plugin socket"]
    assert (code, line["verdict"]) == (0, "warn"), line
    assert f"/{PLUGIN_DIR}/github.com_fuse-gone.sock refuses connections" in line["detail"]
    assert "earlier plugin pod" in line["fix"]


def test_plugin_socket_that_is_not_a_socket(root: Path) -> None:
    put(root, f"{PLUGIN_DIR}/{SOCKET}", "")
    check = doctor.check_plugin_socket(doctor.Node(root=root))
    assert (check.verdict, check.detail) == (doctor.Verdict.FAIL,
                                             f"/{PLUGIN_DIR}/{SOCKET} is not a socket")


def test_plugin_socket_that_accepts_but_does_not_answer(root: Path) -> None:
    (root / PLUGIN_DIR).mkdir(parents=True)
    with listening(root / PLUGIN_DIR / SOCKET):
        check = doctor.check_plugin_socket(doctor.Node(root=root), timeout=0.3)
    assert check.verdict is doctor.Verdict.FAIL
    assert check.detail.endswith("accepts connections but GetDevicePluginOptions failed: "
                                 "DEADLINE_EXCEEDED")


def test_plugin_socket_deeper_than_a_socket_name_allows(tmp_path: Path) -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root: the fake node's /dev/fuse is made with mknod")
    deep = tmp_path / ("d" * 60) / ("e" * 60)
    deep.mkdir(parents=True)
    (deep / PLUGIN_DIR).mkdir(parents=True)
    target = deep / PLUGIN_DIR / SOCKET
    assert len(os.fsencode(target)) > sockets.SUN_PATH_MAX
    short = Path(tempfile.mkdtemp(prefix="fdp-", dir="/tmp"))
    try:
        with answering_moved(short / "p.sock", make_device(deep), target):
            check = doctor.check_plugin_socket(doctor.Node(root=deep))
    finally:
        shutil.rmtree(short)
    assert check.verdict is doctor.Verdict.OK, check


@pytest.mark.parametrize(("enabled", "detail"), [
    (None, "the kernel has no AppArmor (/sys/module/apparmor/parameters/enabled is missing)"),
    ("N\n", "AppArmor is disabled in the kernel (/sys/module/apparmor/parameters/enabled: N)"),
])
def test_apparmor_off_warns(healthy: Path, run_doctor: Run, enabled: str | None,
                            detail: str) -> None:
    flag = healthy / "sys/module/apparmor/parameters/enabled"
    if enabled is None:
        shutil.rmtree(healthy / "sys/module/apparmor")
    else:
        flag.write_text(enabled)
    code, lines, order = run_doctor(healthy)
    assert (lines["apparmor"]["verdict"], lines["apparmor"]["detail"]) == ("warn", detail)
    assert "SELinux" in lines["apparmor"]["fix"]
    assert "apparmor profiles" not in order
    assert code == 0


def test_apparmor_profiles_loaded_in_enforce_mode(healthy: Path, run_doctor: Run) -> None:
    _, lines, _ = run_doctor(healthy)
    assert lines["apparmor profiles"]["detail"] == (
        "loaded in enforce mode: s3fs, sshfs, generic, lxcfs, rootless-build")


def test_apparmor_profiles_missing_or_in_complain_mode_warn(healthy: Path,
                                                            run_doctor: Run) -> None:
    put(healthy, "sys/kernel/security/apparmor/profiles", apparmor_listing(
        "fuse-device-plugin-s3fs (enforce)", "fuse-device-plugin-sshfs (complain)"))
    code, lines, _ = run_doctor(healthy)
    line = lines["apparmor profiles"]
    assert line["verdict"] == "warn"
    assert line["detail"] == ("loaded in complain mode, not enforce: sshfs; not loaded: "
                              "generic, lxcfs, rootless-build; ok: s3fs")
    assert "install-profiles" in line["fix"]
    assert code == 0


def test_apparmor_profile_of_a_named_preset_must_be_loaded(healthy: Path,
                                                           run_doctor: Run) -> None:
    put(healthy, "sys/kernel/security/apparmor/profiles",
        apparmor_listing("fuse-device-plugin-s3fs (enforce)"))
    code, lines, _ = run_doctor(healthy, "--preset", "s3fs")
    assert verdicts(lines)["apparmor profiles"] == "ok"
    assert code == 0
    code, lines, _ = run_doctor(healthy, "--preset", "s3fs", "--preset", "lxcfs")
    assert (lines["apparmor profiles"]["verdict"], lines["apparmor profiles"]["detail"]) == (
        "fail", "not loaded: lxcfs; ok: s3fs")
    assert code == 1


def test_securityfs_not_mounted_warns(healthy: Path, run_doctor: Run) -> None:
    shutil.rmtree(healthy / "sys/kernel/security")
    _, lines, _ = run_doctor(healthy)
    assert lines["apparmor profiles"]["verdict"] == "warn"
    assert "mount -t securityfs" in lines["apparmor profiles"]["fix"]


def test_seccomp_profiles_present(healthy: Path, run_doctor: Run) -> None:
    _, lines, _ = run_doctor(healthy)
    assert lines["seccomp profiles"]["detail"] == (
        f"in /{SECCOMP_DIR}: s3fs, sshfs, generic, lxcfs, rootless-build")


def test_seccomp_profiles_missing_warn_and_fail_when_named(healthy: Path,
                                                           run_doctor: Run) -> None:
    shutil.rmtree(healthy / SECCOMP_DIR)
    code, lines, _ = run_doctor(healthy)
    assert (lines["seccomp profiles"]["verdict"], lines["seccomp profiles"]["detail"]) == (
        "warn", "missing: s3fs, sshfs, generic, lxcfs, rootless-build")
    assert f"--seccomp-dir /{SECCOMP_DIR}" in lines["seccomp profiles"]["fix"]
    assert code == 0
    code, lines, _ = run_doctor(healthy, "--preset", "sshfs")
    assert (lines["seccomp profiles"]["verdict"], lines["seccomp profiles"]["detail"]) == (
        "fail", "missing: sshfs")
    assert code == 1


def test_seccomp_profiles_the_kubelet_could_not_use_fail(healthy: Path,
                                                         run_doctor: Run) -> None:
    put(healthy, f"{SECCOMP_DIR}/s3fs.json", "{not json")
    put(healthy, f"{SECCOMP_DIR}/sshfs.json", json.dumps({"syscalls": []}))
    no_mount = {**SECCOMP_OK, "syscalls": [{"names": ["read", "umount2"],
                                            "action": "SCMP_ACT_ALLOW"}]}
    put(healthy, f"{SECCOMP_DIR}/lxcfs.json", json.dumps(no_mount))
    code, lines, _ = run_doctor(healthy)
    assert (lines["seccomp profiles"]["verdict"], lines["seccomp profiles"]["detail"]) == (
        "fail", "unreadable (not valid JSON): s3fs; is not an OCI seccomp profile "
        "(no defaultAction): sshfs; does not allow mount: lxcfs; ok: generic, rootless-build")
    assert code == 1


def test_seccomp_profile_elsewhere(healthy: Path, run_doctor: Run) -> None:
    shutil.move(healthy / SECCOMP_DIR, healthy / "etc/seccomp")
    _, lines, _ = run_doctor(healthy, "--seccomp-dir", "/etc/seccomp")
    assert lines["seccomp profiles"]["verdict"] == "ok"


@pytest.mark.parametrize(("layout", "verdict", "starts"), [
    ("cgroup.controllers", "ok", "v2 (unified)"),
    ("unified/cgroup.controllers", "ok", "hybrid"),
    ("devices/devices.list", "ok", "v1"),
    ("", "warn", "cannot tell"),
])
def test_cgroup_version(root: Path, layout: str, verdict: str, starts: str) -> None:
    (root / "sys/fs/cgroup").mkdir(parents=True)
    if layout:
        put(root, f"sys/fs/cgroup/{layout}", "")
    check = doctor.check_cgroup(doctor.Node(root=root))
    assert check.verdict.value == verdict
    assert check.detail.startswith(starts)


def test_root_must_be_a_directory(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    assert cli.main(["doctor", "--root", str(tmp_path / "nope")]) == 2
    assert capsys.readouterr().err == (
        f"fuse-device-plugin: error: --root {tmp_path / 'nope'} is not a directory\n")


def test_bad_preset_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["doctor", "--preset", "nfs"])
    assert exit_info.value.code == 2
    assert "invalid choice: 'nfs'" in capsys.readouterr().err


# -- --explain -----------------------------------------------------------------------

@pytest.mark.parametrize(("message", "keys"), [
    ("fuse: mount failed: Operation not permitted", ["eperm"]),
    ("mount(2) returned EPERM", ["eperm"]),
    ("fuse: mount failed: Permission denied", ["eacces"]),
    ("mount: EACCES", ["eacces"]),
    ("fuse: device not found, try 'modprobe fuse' first", ["device-not-found"]),
    ("ioctl: ENODEV", ["device-not-found"]),
    ("mount: /mnt: unknown filesystem type 'fuse.sshfs'.", ["device-not-found"]),
    ("fusermount3: mount failed: Operation not permitted", ["fusermount3", "eperm"]),
    ("fusermount3: mount failed: Permission denied", ["fusermount3", "eacces"]),
    ("fusermount: mount failed: Operation not permitted", ["fusermount3", "eperm"]),
    ("fuse: failed to open /dev/fuse: Permission denied", ["open-dev-fuse"]),
    ("fusermount3: failed to open /dev/fuse: Operation not permitted", ["open-dev-fuse"]),
    ("fuse: failed to open /dev/fuse: No such file or directory", ["open-dev-fuse"]),
    ("ls: cannot access '/mnt/s3': Transport endpoint is not connected", ["not-connected"]),
    ("top: failed /proc/stat open: Transport endpoint is not connected", ["not-connected"]),
    ("fusermount3: option allow_other only allowed if 'user_allow_other' is set in "
     "/etc/fuse.conf", ["allow-other"]),
    ("fusermount3: cannot reach the FUSE mount broker at /run/fuse-broker/broker.sock: "
     "No such file or directory", ["broker-unreachable"]),
    ("fusermount3: broker refused: the mountpoint is sticky and owned by uid 0",
     ["broker-refused"]),
    ("fusermount3: broker refused: this container was not given broker mode by the device "
     "plugin", ["broker-not-given"]),
    ("fusermount3: failed to open /dev/fuse: Permission denied", ["open-dev-fuse"]),
    ("fusermount3: failed to unmount /mnt/x: Permission denied", ["unmount-denied"]),
    ("fusermount3: broker refused: no lxcfs serves on this node (deploy "
     "manifests/broker/lxcfs-daemonset.yaml; it may be starting)", ["lxcfs-waiting"]),
    ('cannot load seccomp profile "/var/lib/kubelet/seccomp/fuse-device-plugin/s3fs.json": '
     "open: no such file or directory", ["seccomp-profile-missing"]),
])
def test_explain_known_messages(message: str, keys: list[str], run_explain: Explain) -> None:
    code, document = run_explain(message)
    assert code == 0
    assert [match["key"] for match in document["matches"]] == keys
    assert all(match["meaning"] for match in document["matches"])


@pytest.fixture
def run_explain(capsys: pytest.CaptureFixture[str]) -> Explain:
    def run(message: str) -> tuple[int, dict[str, Any]]:
        code = cli.main(["doctor", "--explain", message, "--output", "json"])
        document: dict[str, Any] = json.loads(capsys.readouterr().out)
        assert document["message"] == message
        return code, document
    return run


def causes(document: dict[str, Any], index: int = 0) -> list[str]:
    return [cause["cause"] for cause in document["matches"][index]["causes"]]


def test_open_failure_names_the_cause_for_its_errno(run_explain: Explain) -> None:
    _, denied = run_explain("fuse: failed to open /dev/fuse: Permission denied")
    (only,) = causes(denied)
    assert "mode 0600" in only
    _, refused = run_explain("fuse: failed to open /dev/fuse: Operation not permitted")
    (only,) = causes(refused)
    assert "device cgroup" in only
    _, absent = run_explain("fuse: failed to open /dev/fuse: No such file or directory")
    assert causes(absent) == ["the container has no /dev/fuse"]


def test_eperm_tells_seccomp_caps_and_device_cgroup_apart(run_explain: Explain) -> None:
    _, document = run_explain("fuse: mount failed: Operation not permitted")
    (match,) = document["matches"]
    text = json.dumps(match)
    for needle in ("device cgroup", "CAP_SYS_ADMIN", "CapEff", "seccomp", "mount/umount2",
                   "Seccomp /proc/self/status", "github.com/fuse"):
        assert needle in text, needle


def test_eacces_points_at_apparmor_and_the_device_mode(run_explain: Explain) -> None:
    _, document = run_explain("fuse: mount failed: Permission denied")
    text = json.dumps(document)
    for needle in ("deny mount", "Localhost", "fuse-device-plugin-<preset>", "0600", "0666"):
        assert needle in text, needle


def test_fusermount3_with_another_errno_skips_the_eperm_only_cause(run_explain: Explain) -> None:
    _, eacces = run_explain("fusermount3: mount failed: Permission denied")
    assert causes(eacces, 0) == []
    _, eperm = run_explain("fusermount3: mount failed: Operation not permitted")
    assert "allowPrivilegeEscalation" in causes(eperm, 0)[0]


def test_unreachable_broker_names_the_missing_binds_only_for_enoent(
        run_explain: Explain) -> None:
    """Refused: the broker is down (no bind is missing); ENOENT: either, told apart by
    whether the shim waited first."""
    broker = "fusermount3: cannot reach the FUSE mount broker at /run/fuse-broker/broker.sock"
    _, refused = run_explain(f"{broker}: Connection refused")
    assert causes(refused) == ["the broker has been down for longer than the wait"]
    _, missing = run_explain(f"{broker}: No such file or directory")
    assert len(causes(missing)) == 2
    assert "/run/fuse-broker" in causes(missing)[1]


def test_transport_endpoint_mentions_the_lxcfs_restart(run_explain: Explain) -> None:
    _, document = run_explain("Transport endpoint is not connected")
    assert any("lxcfs" in cause for cause in causes(document))


def test_explain_unknown_message(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["doctor", "--explain", "segfault in libfoo"]) == 1
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.startswith("fuse-device-plugin: error: no known FUSE error matches")
    assert "`fuse-device-plugin doctor` (without --explain)" in captured.err
    assert captured.err.count("\n") == 1


def test_explain_unknown_message_as_json(run_explain: Explain) -> None:
    code, document = run_explain("segfault in libfoo")
    assert code == 1
    assert document["matches"] == []
    assert "without --explain" in str(document["hint"])


def test_explain_empty_message_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["doctor", "--explain", "  "]) == 2
    assert "--explain needs the error message" in capsys.readouterr().err


def test_explain_text_output(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["doctor", "--explain",
                     "fusermount3: mount failed: Operation not permitted"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("fusermount3: the setuid-root helper")
    assert "\n\nEPERM: the kernel refused the mount" in out
    assert out.count("how to tell:") == 5
    assert out.count("fix:") == 5


def test_explain_runs_as_the_installed_command_without_root() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "fuse_plugin", "doctor", "--explain",
         "fuse: device not found, try 'modprobe fuse' first"],
        capture_output=True, text=True, timeout=60, check=False)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("ENODEV: ")


@pytest.mark.parametrize("entry", fuse_errors.ERRORS, ids=lambda e: e.key)
def test_every_example_is_explained_by_its_own_entry(entry: fuse_errors.KnownError) -> None:
    found = fuse_errors.explain(entry.example)
    assert found[0] is entry
    assert entry.causes_for(entry.example) or not entry.final


def test_markdown_table_has_a_row_per_cause() -> None:
    table = fuse_errors.markdown().splitlines()
    assert table[0] == "| Message | errno | Cause | How to tell | Fix |"
    assert len(table) == 2 + sum(len(e.causes) for e in fuse_errors.ERRORS)
    assert all(line.count(" | ") == 4 for line in table[2:])
