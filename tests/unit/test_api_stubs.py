"""The generated stubs are current, and the wire names match the kubelet's API."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from fuse_plugin.api import api_pb2

ROOT = Path(__file__).resolve().parents[2]


def test_generated_stubs_are_not_stale(tmp_path: Path) -> None:
    subprocess.run([sys.executable, str(ROOT / "scripts" / "gen_api.py"), "--out", str(tmp_path)],
                   check=True, capture_output=True)
    for name in ("api_pb2.py", "api_pb2.pyi", "api_pb2_grpc.py"):
        fresh = (tmp_path / "fuse_plugin" / "api" / name).read_text()
        committed = (ROOT / "fuse_plugin" / "api" / name).read_text()
        assert fresh == committed, (
            f"fuse_plugin/api/{name} is stale: run `python scripts/gen_api.py`")


def _fields(message: str) -> dict[str, tuple[int, str]]:
    descriptor = api_pb2.DESCRIPTOR.message_types_by_name[message]
    return {f.name: (f.number, f.message_type.name if f.message_type else str(f.type))
            for f in descriptor.fields}


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
