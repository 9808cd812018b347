"""``fuse-device-plugin demo``: the newcomer's first command must work and say the right
things; ``demo --mount`` runs a real unprivileged runc container where the machine can."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from fuse_plugin import demo
from fuse_plugin.api import api_pb2 as api
from fuse_plugin.demo import container, make_node
from fuse_plugin.devices import Health, probe


def run_demo(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "fuse_plugin", "demo", *args],
                          capture_output=True, text=True, timeout=timeout, check=False)


def test_demo_shows_the_whole_flow_and_exits_0() -> None:
    proc = run_demo()
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert "registered: resource github.com/fuse, endpoint github.com_fuse.sock" in out
    assert "registered again in" in out
    assert "capacity github.com/fuse: 8" in out
    assert "its socket is removed" in out
    assert "the kubelet marks the slots Unhealthy" in out
    assert "Traceback" not in out + proc.stderr
    if os.geteuid() == 0 or probe(Path("/dev/fuse")).health is Health.HEALTHY:
        assert "8 slots, all Healthy" in out
        assert "device container_path=/dev/fuse host_path=" in out
        assert "permissions=rw" in out


def test_demo_slots_flag_and_its_validation() -> None:
    proc = run_demo("--slots", "3")
    assert proc.returncode == 0, proc.stderr
    assert "3 slots" in proc.stdout
    bad = run_demo("--slots", "0")
    assert bad.returncode == 2
    assert "--slots" in bad.stderr
    assert len(bad.stderr.strip().splitlines()) == 1


def test_pick_device_prefers_the_real_node(tmp_path: Path) -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root: the node is made with mknod")
    host = tmp_path / "host-fuse"
    make_node(host)
    chosen = demo.pick_device(tmp_path / "work", host_device=host)
    assert chosen.path == host
    assert "only stat()s it" in chosen.note


def test_pick_device_makes_a_stand_in_when_the_host_has_none(tmp_path: Path) -> None:
    chosen = demo.pick_device(tmp_path, host_device=tmp_path / "missing")
    assert chosen.path == tmp_path / "dev" / "fuse"
    if os.geteuid() == 0:
        st = os.stat(chosen.path)
        assert stat.S_ISCHR(st.st_mode)
        assert (os.major(st.st_rdev), os.minor(st.st_rdev)) == (10, 229)
        assert "stand-in with mknod" in chosen.note
    else:
        assert "Unhealthy" in chosen.note


def test_describe_allocation_names_every_device_mount_and_env() -> None:
    response = api.AllocateResponse(container_responses=[api.ContainerAllocateResponse(
        devices=[api.DeviceSpec(container_path="/dev/fuse", host_path="/dev/fuse",
                                permissions="rw")],
        mounts=[api.Mount(container_path="/c", host_path="/h")],
        envs={"A": "1"})])
    assert demo.describe_allocation(response) == [
        "container 0: device container_path=/dev/fuse host_path=/dev/fuse permissions=rw",
        "container 0: mount /h -> /c",
        "container 0: env A=1",
    ]


def test_demo_container_is_a_pod_that_is_not_privileged(tmp_path: Path) -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root: the device node is made with mknod")
    node = tmp_path / "fuse"
    make_node(node)
    spec = api.DeviceSpec(container_path="/dev/fuse", host_path=str(node), permissions="rw")
    seccomp = {"defaultAction": "SCMP_ACT_ERRNO", "syscalls": []}
    image = tmp_path / "image"
    image.write_text("")
    config = container.build_spec(container.Container(
        args=("/bin/true",), devices=(spec,), seccomp=seccomp,
        binds=((str(image), container.IMAGE),)).request())
    bundle = container.write_bundle(tmp_path / "bundle", config)
    process, linux = config["process"], config["linux"]
    assert process["capabilities"]["effective"] == ["CAP_SYS_ADMIN"]
    assert "ambient" not in process["capabilities"]
    assert config["root"]["readonly"] is True
    assert linux["seccomp"] == seccomp
    assert {"type": "network"} in linux["namespaces"]
    assert linux["devices"] == [{"type": "c", "path": "/dev/fuse", "major": 10, "minor": 229,
                                 "fileMode": 0o600, "uid": 0, "gid": 0}]
    # Deny all devices first, then containerd's defaults, then the allocated node: what a
    # pod gets.
    rules = linux["resources"]["devices"]
    assert rules[0] == {"allow": False, "access": "rwm"}
    assert rules[1:-1] == list(container.DEFAULT_DEVICE_RULES)
    assert rules[-1] == {"allow": True, "type": "c", "major": 10, "minor": 229, "access": "rw"}
    assert {m["destination"] for m in config["mounts"]} >= {"/proc", "/dev", "/usr", "/mnt"}
    assert (bundle / "rootfs" / container.IMAGE.lstrip("/")).is_file()
    assert not any(m["source"] == "/dev" for m in config["mounts"])
    assert "/proc/kcore" in linux["maskedPaths"]


def test_device_entries_refuse_a_non_device(tmp_path: Path) -> None:
    plain = tmp_path / "plain"
    plain.write_text("")
    spec = api.DeviceSpec(container_path="/dev/fuse", host_path=str(plain), permissions="rw")
    with pytest.raises(container.ContainerError, match="not a device node"):
        container.device_entries([spec])


@pytest.mark.slow
def test_demo_mount_runs_a_real_unprivileged_fuse_container() -> None:
    blockers = container.mount_blockers()
    if blockers:
        pytest.skip("demo --mount cannot run here: " + "; ".join(blockers))
    proc = run_demo("--mount", timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout
    assert "fuse.squashfuse" in out
    assert container.HELLO.strip() in out
    assert "CapEff:\t0000000000200000" in out  # CAP_SYS_ADMIN (bit 21) and nothing else
    assert "Seccomp:\t2" in out  # a seccomp filter is in force
    assert "unshare failed: Operation not permitted" in out  # and it is the FUSE profile
    assert "unmounted /mnt/fuse" in out
    assert "skipped" not in out


def test_fuse_mounts_are_read_from_mountinfo_unescaped(tmp_path: Path) -> None:
    """The kernel writes a space in a mount point as \\040; the demo's own parser once
    kept the escape, so a mount point with a space never matched its path."""
    (tmp_path / "42").mkdir()
    (tmp_path / "42" / "mountinfo").write_text(
        "22 1 0:21 / /proc rw - proc proc rw\n"
        "90 22 0:53 / /mnt/my\\040data rw,nosuid - fuse.squashfuse squashfuse rw\n"
        "91 22 8:1 /x /mnt/tab\\011here rw - ext4 /dev/sda1 rw\n")
    assert container.fuse_mounts_of(42, tmp_path) == [
        ("/mnt/my data", "fuse.squashfuse", "0:53")]
    assert container.fuse_connections_of(42, tmp_path) == {53}
    assert container.fuse_mounts_of(43, tmp_path) == []  # the process has gone


def test_aborting_a_connection_writes_its_abort_switch(tmp_path: Path) -> None:
    from fuse_plugin.broker import records

    (tmp_path / "53").mkdir()
    (tmp_path / "53" / "abort").write_text("")
    assert records.abort(53, tmp_path)
    assert (tmp_path / "53" / "abort").read_text() == "1"
    assert not records.abort(54, tmp_path)  # gone already
