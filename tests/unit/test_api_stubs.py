"""The generated stubs are current, and the wire names match the kubelet's API."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from google.protobuf.descriptor import FileDescriptor

from fuse_plugin.api import api_pb2, dra_pb2, pluginregistration_pb2

ROOT = Path(__file__).resolve().parents[2]


def test_generated_stubs_are_not_stale(tmp_path: Path) -> None:
    subprocess.run([sys.executable, str(ROOT / "scripts" / "gen_api.py"), "--out", str(tmp_path)],
                   check=True, capture_output=True)
    names = [f"{proto}{suffix}" for proto in ("api", "dra", "pluginregistration")
             for suffix in ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py")]
    for name in names:
        fresh = (tmp_path / "fuse_plugin" / "api" / name).read_text()
        committed = (ROOT / "fuse_plugin" / "api" / name).read_text()
        assert fresh == committed, (
            f"fuse_plugin/api/{name} is stale: run `python scripts/gen_api.py`")


def _fields(message: str, file: FileDescriptor = api_pb2.DESCRIPTOR
            ) -> dict[str, tuple[int, str]]:
    descriptor = file.message_types_by_name[message]
    return {f.name: (f.number, f.message_type.name if f.message_type else str(f.type))
            for f in descriptor.fields}


def _services(file: FileDescriptor) -> dict[str, dict[str, tuple[str, str, bool]]]:
    return {s.full_name: {m.name: (m.input_type.full_name, m.output_type.full_name,
                                   m.server_streaming) for m in s.methods}
            for s in file.services_by_name.values()}


def test_services_and_methods_match_the_kubelet() -> None:
    services = {s.full_name: {m.name: (m.input_type.name, m.output_type.name,
                                       m.server_streaming) for m in s.methods}
                for s in api_pb2.DESCRIPTOR.services_by_name.values()}
    assert api_pb2.DESCRIPTOR.package == "v1beta1"
    assert services["v1beta1.Registration"] == {"Register": ("RegisterRequest", "Empty", False)}
    assert services["v1beta1.DevicePlugin"] == {
        "GetDevicePluginOptions": ("Empty", "DevicePluginOptions", False),
        "ListAndWatch": ("Empty", "ListAndWatchResponse", True),
        "GetPreferredAllocation": ("PreferredAllocationRequest",
                                   "PreferredAllocationResponse", False),
        "Allocate": ("AllocateRequest", "AllocateResponse", False),
        "PreStartContainer": ("PreStartContainerRequest", "PreStartContainerResponse", False),
    }


def test_field_numbers_match_the_kubelet() -> None:
    string, boolean, int32, int64 = "9", "8", "5", "3"
    assert _fields("DevicePluginOptions") == {
        "pre_start_required": (1, boolean), "get_preferred_allocation_available": (2, boolean)}
    assert _fields("RegisterRequest") == {
        "version": (1, string), "endpoint": (2, string), "resource_name": (3, string),
        "options": (4, "DevicePluginOptions")}
    assert _fields("Device") == {"ID": (1, string), "health": (2, string),
                                 "topology": (3, "TopologyInfo")}
    assert _fields("NUMANode") == {"ID": (1, int64)}
    assert _fields("ContainerPreferredAllocationRequest") == {
        "available_deviceIDs": (1, string), "must_include_deviceIDs": (2, string),
        "allocation_size": (3, int32)}
    assert _fields("ContainerAllocateRequest") == {"devices_ids": (1, string)}
    assert _fields("PreStartContainerRequest") == {"devices_ids": (1, string)}
    response = _fields("ContainerAllocateResponse")
    assert {k: v[0] for k, v in response.items()} == {
        "envs": 1, "mounts": 2, "devices": 3, "annotations": 4, "cdi_devices": 5}
    assert _fields("DeviceSpec") == {"container_path": (1, string), "host_path": (2, string),
                                     "permissions": (3, string)}
    assert _fields("Mount") == {"container_path": (1, string), "host_path": (2, string),
                                "read_only": (3, boolean)}
    assert _fields("CDIDevice") == {"name": (1, string)}


DRA = "k8s.io.kubelet.pkg.apis.dra.v1"


def test_dra_service_matches_the_kubelet() -> None:
    """The kubelet calls /k8s.io.kubelet.pkg.apis.dra.v1.DRAPlugin/<Method>: the package is
    the whole Go import path, not "v1"."""
    assert dra_pb2.DESCRIPTOR.package == DRA
    assert _services(dra_pb2.DESCRIPTOR) == {f"{DRA}.DRAPlugin": {
        "NodePrepareResources": (f"{DRA}.NodePrepareResourcesRequest",
                                 f"{DRA}.NodePrepareResourcesResponse", False),
        "NodeUnprepareResources": (f"{DRA}.NodeUnprepareResourcesRequest",
                                   f"{DRA}.NodeUnprepareResourcesResponse", False),
    }}


def test_dra_field_numbers_match_the_kubelet() -> None:
    string = "9"
    file = dra_pb2.DESCRIPTOR
    assert _fields("Claim", file) == {"namespace": (1, string), "uid": (2, string),
                                      "name": (3, string)}
    assert _fields("NodePrepareResourcesRequest", file) == {"claims": (1, "Claim")}
    assert _fields("NodeUnprepareResourcesRequest", file) == {"claims": (1, "Claim")}
    assert _fields("NodePrepareResourcesResponse", file) == {
        "claims": (1, "ClaimsEntry")}
    assert _fields("NodeUnprepareResourcesResponse", file) == {
        "claims": (1, "ClaimsEntry")}
    assert _fields("NodePrepareResourceResponse", file) == {
        "devices": (1, "Device"), "error": (2, string)}
    assert _fields("NodeUnprepareResourceResponse", file) == {"error": (1, string)}
    assert _fields("Device", file) == {
        "request_names": (1, string), "pool_name": (2, string), "device_name": (3, string),
        "cdi_device_ids": (4, string), "share_id": (5, string)}
    share_id = file.message_types_by_name["Device"].fields_by_name["share_id"]
    assert share_id.has_presence  # proto3 `optional`: unset differs from ""
    for response in ("NodePrepareResourcesResponse", "NodeUnprepareResourcesResponse"):
        entry = file.message_types_by_name[response].fields_by_name["claims"].message_type
        assert entry is not None
        assert entry.GetOptions().map_entry
        assert entry.fields_by_name["key"].type == entry.fields_by_name["key"].TYPE_STRING


def test_plugin_registration_matches_the_kubelet() -> None:
    """The plugin watcher calls /pluginregistration.Registration/GetInfo: the package is
    a bare "pluginregistration" although the Go package is v1."""
    file = pluginregistration_pb2.DESCRIPTOR
    assert file.package == "pluginregistration"
    assert _services(file) == {"pluginregistration.Registration": {
        "GetInfo": ("pluginregistration.InfoRequest", "pluginregistration.PluginInfo", False),
        "NotifyRegistrationStatus": ("pluginregistration.RegistrationStatus",
                                     "pluginregistration.RegistrationStatusResponse", False),
    }}
    string, boolean = "9", "8"
    assert _fields("PluginInfo", file) == {
        "type": (1, string), "name": (2, string), "endpoint": (3, string),
        "supported_versions": (4, string)}
    assert _fields("RegistrationStatus", file) == {
        "plugin_registered": (1, boolean), "error": (2, string)}
    assert _fields("InfoRequest", file) == {}
    assert _fields("RegistrationStatusResponse", file) == {}
