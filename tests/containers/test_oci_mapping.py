"""The CRI -> OCI mapping of ``oci.build_spec``, checked field by field (no root needed:
the device is /dev/null, which every machine has)."""

from __future__ import annotations

import json
import os
from pathlib import Path

from fuse_plugin.api import api_pb2 as api
from tests.lib import oci


def _response() -> api.ContainerAllocateResponse:
    return api.ContainerAllocateResponse(
        devices=[api.DeviceSpec(host_path="/dev/null", container_path="/dev/fuse",
                                permissions="rw")],
        mounts=[api.Mount(host_path="/etc", container_path="/host-etc", read_only=True)],
        envs={"FUSE_SLOT": "fuse-0"}, annotations={"example.com/slot": "fuse-0"})


def test_device_spec_becomes_a_node_and_one_allow_rule_after_the_defaults() -> None:
    spec = oci.build_spec(oci.ContainerRequest(args=["true"], allocation=_response()))
    st = os.stat("/dev/null")
    assert spec["linux"]["devices"] == [{
        "path": "/dev/fuse", "type": "c", "major": 1, "minor": 3, "fileMode": 0o666,
        "uid": st.st_uid, "gid": st.st_gid}]
    rules = spec["linux"]["resources"]["devices"]
    assert rules[0] == {"allow": False, "access": "rwm"}
    assert rules[1:-1] == list(oci.DEFAULT_DEVICE_RULES)
    assert rules[-1] == {"allow": True, "type": "c", "major": 1, "minor": 3, "access": "rw"}


def test_mounts_envs_annotations_and_no_host_dev() -> None:
    spec = oci.build_spec(oci.ContainerRequest(args=["true"], allocation=_response()))
    mounts = {m["destination"]: m for m in spec["mounts"]}
    assert mounts["/host-etc"] == {"destination": "/host-etc", "type": "bind",
                                   "source": "/etc", "options": ["rbind", "rprivate", "ro"]}
    assert mounts["/dev"]["type"] == "tmpfs"
    assert not [m for m in spec["mounts"] if m.get("source", "").startswith("/dev")]
    assert "FUSE_SLOT=fuse-0" in spec["process"]["env"]
    assert spec["annotations"] == {"example.com/slot": "fuse-0"}
    assert spec["linux"]["maskedPaths"] == list(oci.MASKED_PATHS)


def test_capabilities_are_the_default_set_plus_the_additions_only() -> None:
    spec = oci.build_spec(oci.ContainerRequest(
        args=["true"], allocation=_response(), add_capabilities=["CAP_SYS_ADMIN"]))
    caps = spec["process"]["capabilities"]
    assert caps["bounding"] == [*oci.DEFAULT_CAPABILITIES, "CAP_SYS_ADMIN"]
    assert caps["effective"] == caps["permitted"] == caps["bounding"]
    assert "inheritable" not in caps
    assert "ambient" not in caps


def test_seccomp_is_read_into_the_oci_struct_as_containerd_does() -> None:
    profile = {"defaultAction": "SCMP_ACT_ERRNO", "architectures": ["SCMP_ARCH_X86_64"],
               "archMap": [{"architecture": "SCMP_ARCH_X86_64"}],
               "syscalls": [{"names": ["mount"], "action": "SCMP_ACT_ALLOW",
                             "includes": {"caps": ["CAP_SYS_ADMIN"]}}]}
    spec = oci.build_spec(oci.ContainerRequest(args=["true"], seccomp=json.dumps(profile)))
    assert spec["linux"]["seccomp"] == {
        "defaultAction": "SCMP_ACT_ERRNO", "architectures": ["SCMP_ARCH_X86_64"],
        "syscalls": [{"names": ["mount"], "action": "SCMP_ACT_ALLOW"}]}
    assert "seccomp" not in oci.build_spec(oci.ContainerRequest(args=["true"]))["linux"]


def test_user_namespace_maps_root_and_binds_sys() -> None:
    spec = oci.build_spec(oci.ContainerRequest(args=["true"], host_users=False))
    assert {"type": "user"} in spec["linux"]["namespaces"]
    assert spec["linux"]["uidMappings"] == [
        {"containerID": 0, "hostID": oci.USERNS_HOST_ID, "size": oci.USERNS_SIZE}]
    sys_mount = next(m for m in spec["mounts"] if m["destination"] == "/sys")
    assert (sys_mount["type"], sys_mount["source"]) == ("bind", "/sys")


def test_remove_device_rule_removes_only_that_rule() -> None:
    spec = oci.build_spec(oci.ContainerRequest(args=["true"], allocation=_response()))
    without = oci.remove_device_rule(spec, "/dev/fuse")
    # /dev/null's own default rule (1:3) goes too: it is the same device number.
    assert without["linux"]["resources"]["devices"] == [
        r for r in spec["linux"]["resources"]["devices"]
        if (r.get("major"), r.get("minor")) != (1, 3)]
    assert without["linux"]["devices"] == spec["linux"]["devices"]


def test_host_devices_lists_nodes_only(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("")
    (tmp_path / "null").symlink_to("/dev/null")
    assert oci.host_devices(tmp_path) == []


def test_drop_all_read_only_root_own_network_and_empty_dirs() -> None:
    spec = oci.build_spec(oci.ContainerRequest(
        args=["true"], add_capabilities=["CAP_SYS_ADMIN", "CAP_SYS_CHROOT"],
        drop_capabilities=[oci.DROP_ALL], readonly_rootfs=True, host_network=False,
        tmpfs=["/run"]))
    assert spec["process"]["capabilities"]["bounding"] == ["CAP_SYS_ADMIN", "CAP_SYS_CHROOT"]
    assert spec["root"]["readonly"] is True
    assert {"type": "network"} in spec["linux"]["namespaces"]
    run = [m for m in spec["mounts"] if m["destination"] == "/run"]
    assert run == [{"destination": "/run", "type": "tmpfs", "source": "tmpfs",
                    "options": list(oci.EMPTY_DIR_OPTIONS)}]
    default = oci.build_spec(oci.ContainerRequest(args=["true"]))
    assert default["root"]["readonly"] is False
    assert {"type": "network"} not in default["linux"]["namespaces"]
