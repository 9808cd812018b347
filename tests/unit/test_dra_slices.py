"""The driver's ResourceSlice against a fake API server over real HTTP: published at
start with the Node as owner, kept current when the device goes and comes back, left
alone when nothing changed, re-created when wiped, counted devices when the API server
drops allowMultipleAllocations, and API failures reported, not raised."""

from __future__ import annotations

import logging
import shutil
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import kubernetes_validate  # type: ignore[import-untyped]
import pytest

from fuse_plugin import logs
from fuse_plugin.devices import DeviceState
from fuse_plugin.dra import driver
from fuse_plugin.dra.settings import DRIVER_NAME
from fuse_plugin.dra.slices import Publisher, slice_name
from tests.lib import apiserver, waiting
from tests.lib.apiserver import FakeApiServer
from tests.lib.dra import NODE, FlipProber, running_driver, short_root_fixture

NAME = slice_name(NODE, DRIVER_NAME)
WAIT = 10.0


root = short_root_fixture


@pytest.fixture
def api() -> Iterator[FakeApiServer]:
    with apiserver.running() as server:
        yield server


def the_slice(api: FakeApiServer) -> dict[str, Any]:
    return api.slices[NAME]


def device_names(api: FakeApiServer) -> list[str]:
    return [d["name"] for d in the_slice(api)["spec"].get("devices") or []]


def test_published_at_start_with_one_shared_device_owned_by_the_node(
        api: FakeApiServer) -> None:
    node_uid = api.add_node(NODE)
    with running_driver(api, slots=250):
        published = the_slice(api)
    assert published["metadata"]["name"] == f"{NODE}-{DRIVER_NAME}"
    assert published["metadata"]["ownerReferences"] == [
        {"apiVersion": "v1", "kind": "Node", "name": NODE, "uid": node_uid,
         "controller": True}]
    spec = published["spec"]
    assert (spec["driver"], spec["nodeName"]) == (DRIVER_NAME, NODE)
    assert spec["pool"] == {"name": NODE, "generation": 1, "resourceSliceCount": 1}
    assert spec["devices"] == [{
        "name": "fuse", "allowMultipleAllocations": True,
        "capacity": {"claims": {"value": "250", "requestPolicy": {
            "default": "1", "validValues": ["1"]}}}}]
    # Left in place at shutdown: a restarting driver keeps its pool.
    assert [verb for verb, _, _ in api.writes] == ["create"]
    written = {key: value for key, value in published.items()}
    written["metadata"] = {"name": published["metadata"]["name"],
                           "ownerReferences": published["metadata"]["ownerReferences"]}
    kubernetes_validate.validate(written, kubernetes_validate.latest_version(), strict=True)


def test_device_gone_empties_the_slice_and_back_restores_it(api: FakeApiServer) -> None:
    api.add_node(NODE)
    with running_driver(api) as rig:
        assert device_names(api) == ["fuse"]
        seen = len(api.writes)
        rig.prober.healthy = False
        rig.driver.wake()  # what the inotify watch on /dev does when the node goes
        assert api.wait_for_write(seen, WAIT), api.writes
        assert device_names(api) == []
        assert the_slice(api)["spec"]["pool"]["generation"] == 2
        assert not rig.driver.ready()[0]
        seen = len(api.writes)
        rig.prober.healthy = True
        rig.driver.wake()
        assert api.wait_for_write(seen, WAIT), api.writes
        assert device_names(api) == ["fuse"]
        assert the_slice(api)["spec"]["pool"]["generation"] == 3
        assert [verb for verb, _, _ in api.writes] == ["create", "update", "update"]


def test_device_node_removed_on_disk_updates_the_slice(api: FakeApiServer, root: Path) -> None:
    """The inotify watch on the device's directory wakes the loop: no wake() here."""
    api.add_node(NODE)
    with running_driver(api, root=root, prober=None) as rig:
        seen = len(api.writes)
        rig.prober.healthy = False
        rig.settings.fuse_device.write_text("")  # an inotify event in the device's dir
        assert api.wait_for_write(seen, WAIT), api.writes
        assert device_names(api) == []


def test_the_watch_comes_back_when_the_device_directory_is_made_anew(
        api: FakeApiServer, root: Path, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    """A deleted directory takes its inotify watch with it, and ext4 gives the one made
    anew the same inode: the loop puts the watch back on the new directory, so the
    device made there wakes it (the heartbeat is made longer than the wait, so only the
    watch can)."""
    monkeypatch.setattr(driver, "HEARTBEAT", 3600.0)
    api.add_node(NODE)
    with caplog.at_level(logging.INFO), running_driver(api, root=root, prober=None) as rig:
        directory = rig.settings.fuse_device.parent
        shutil.rmtree(directory)
        directory.mkdir()
        rig.driver.wake()  # as the heartbeat would: the loop looks again
        waiting.wait_for(lambda: "watch.rearmed" in caplog.text, WAIT,
                         "the watch to be put back on the new directory")
        seen = len(api.writes)
        rig.prober.healthy = False
        rig.settings.fuse_device.write_text("")  # an event in the new directory
        assert api.wait_for_write(seen, WAIT), api.writes
        assert device_names(api) == []


@pytest.mark.parametrize("slots", [1000, 1500, 100_000])
def test_restart_with_nothing_changed_writes_nothing(api: FakeApiServer, root: Path,
                                                     slots: int) -> None:
    """Also when the server writes the capacity back in another form ("1k")."""
    api.add_node(NODE)
    with running_driver(api, root=root, slots=slots):
        pass
    writes = len(api.writes)
    with running_driver(api, root=root, slots=slots) as rig:
        assert rig.driver.publisher is not None
        assert rig.driver.publisher.published is not None
        assert rig.driver.publisher.sync()
    assert len(api.writes) == writes
    assert the_slice(api)["spec"]["pool"]["generation"] == 1


def test_a_wiped_slice_is_made_again_and_strays_are_deleted(api: FakeApiServer) -> None:
    api.add_node(NODE)
    stray: dict[str, Any] = {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceSlice",
             "metadata": {"name": f"{NODE}-{DRIVER_NAME}-x7k2p", "resourceVersion": "1",
                          "uid": "u"},
             "spec": {"driver": DRIVER_NAME, "nodeName": NODE,
                      "pool": {"name": NODE, "generation": 7, "resourceSliceCount": 1},
                      "devices": [{"name": "fuse-0"}]}}
    other_node: dict[str, Any] = {
        **stray, "metadata": {**stray["metadata"], "name": "node-2-slice"},
        "spec": {**stray["spec"], "nodeName": "node-2"}}
    api.slices[stray["metadata"]["name"]] = stray
    api.slices["node-2-slice"] = other_node
    with running_driver(api) as rig:
        # An older release's slice of this node is gone; its generation is surpassed.
        assert sorted(api.slices) == sorted([NAME, "node-2-slice"])
        assert the_slice(api)["spec"]["pool"]["generation"] == 8
        del api.slices[NAME]  # the kubelet wiped it while the driver was away
        assert rig.driver.publisher is not None
        assert rig.driver.publisher.sync()
        assert device_names(api) == ["fuse"]


def test_counted_devices_when_the_api_server_drops_multiple_allocations(
        api: FakeApiServer, caplog: pytest.LogCaptureFixture) -> None:
    api.add_node(NODE)
    api.drop_fields.add("allowMultipleAllocations")
    with caplog.at_level(logging.WARNING), running_driver(api, slots=300) as rig:
        assert rig.driver.publisher is not None
        assert rig.driver.publisher.sharing == "counted"
    assert device_names(api) == [f"fuse-{i}" for i in range(128)]
    assert "slice.sharing_fallback" in caplog.text
    assert [verb for verb, _, _ in api.writes] == ["create", "update"]


def test_counted_on_request(api: FakeApiServer) -> None:
    api.add_node(NODE)
    with running_driver(api, slots=3, sharing="counted"):
        assert device_names(api) == ["fuse-0", "fuse-1", "fuse-2"]


def test_api_failures_are_reported_and_retried_not_raised(api: FakeApiServer) -> None:
    api.add_node(NODE)
    api.fail["list slices"] = 403
    with running_driver(api) as rig:
        publisher = rig.driver.publisher
        assert publisher is not None
        assert publisher.last_error == "list resourceslices: 403 injected failure for " \
                                       "list slices"
        rig.kubelet.notify(True)
        ready, reason = rig.driver.ready()
        assert not ready
        assert "ResourceSlice not published" in reason
        del api.fail["list slices"]
        assert publisher.sync()
        assert publisher.last_error == ""
        assert NAME in api.slices


def test_no_node_read_means_no_owner_but_a_slice(api: FakeApiServer) -> None:
    api.fail["GET node"] = 403
    with running_driver(api):
        assert the_slice(api)["metadata"]["ownerReferences"] == []
        assert device_names(api) == ["fuse"]


def test_unhealthy_at_start_publishes_an_empty_pool(api: FakeApiServer) -> None:
    api.add_node(NODE)
    with running_driver(api, prober=FlipProber(healthy=False)):
        assert device_names(api) == []
        assert the_slice(api)["spec"]["pool"]["generation"] == 1


class _Broken:
    """A SliceApi whose every call fails in a way no one planned for."""

    def node_uid(self, node: str) -> str | None:
        raise RuntimeError("surprise")

    def list_slices(self, driver: str, node: str) -> list[dict[str, Any]]:
        raise RuntimeError("surprise")

    def create(self, body: Mapping[str, Any]) -> dict[str, Any]:
        raise RuntimeError("surprise")

    def replace(self, body: Mapping[str, Any]) -> dict[str, Any]:
        raise RuntimeError("surprise")

    def delete(self, name: str) -> None:
        raise RuntimeError("surprise")

    def watch(self, driver: str, node: str) -> Iterator[str]:
        raise RuntimeError("surprise")


def test_an_unexpected_error_is_reported_and_the_loop_goes_on() -> None:
    state = DeviceState(Path("/dev/fuse"), 1, FlipProber())
    publisher = Publisher(_Broken(), driver=DRIVER_NAME, node=NODE, slots=1, sharing="auto",
                          state=state, log=logs.get())
    assert not publisher.sync()
    assert publisher.last_error == "internal error: RuntimeError: surprise"
