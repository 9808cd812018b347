"""The DRA driver over real unix sockets, with claims served by a fake API server over real
HTTP: registration, NodePrepareResources / NodeUnprepareResources for direct and broker
claims, refusals with their messages, idempotence, and the CDI specs on disk."""

from __future__ import annotations

import concurrent.futures
import json
import logging
import os
import socket
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema  # type: ignore[import-untyped]
import pytest

from fuse_plugin import logs
from fuse_plugin.allocation import broker_binds
from fuse_plugin.broker import protocol
from fuse_plugin.dra.settings import DRIVER_NAME
from fuse_plugin.errors import Failure
from tests.lib.apiserver import FakeApiServer, opaque
from tests.lib.dra import (
    NS,
    Rig,
    add_claim,
    node_api_fixture,
    running_driver,
    short_root_fixture,
)
from tests.lib.probes import get
from tests.lib.servers import free_port
from tests.lib.waiting import wait_for

SCHEMA = json.loads((Path(__file__).parent / "data" / "cdi-spec.schema.json").read_text())
KIND = f"{DRIVER_NAME}/fuse"


root = short_root_fixture
api = node_api_fixture


@pytest.fixture
def rig(api: FakeApiServer) -> Iterator[Rig]:
    with running_driver(api, publish=False) as running:
        yield running


def spec_of(rig: Rig, uid: str) -> dict[str, Any]:
    path = rig.settings.cdi_dir / f"{DRIVER_NAME}-fuse_{uid}.json"
    data: dict[str, Any] = json.loads(path.read_text())
    return data


def test_registration_names_the_driver_its_endpoint_and_the_v1_service(rig: Rig) -> None:
    info = rig.kubelet.get_info()
    assert info.type == "DRAPlugin"
    assert info.name == DRIVER_NAME
    assert info.endpoint == str(rig.settings.plugins_dir / DRIVER_NAME / "dra.sock")
    assert list(info.supported_versions) == ["v1.DRAPlugin"]
    assert rig.settings.registration_socket.name == f"{DRIVER_NAME}-reg.sock"
    assert not rig.driver.ready()[0]
    rig.kubelet.notify(False, "bad version")
    assert rig.driver.registered.error == "bad version"
    rig.kubelet.notify(True)  # answered once the driver has taken it in
    assert rig.driver.registered.registered
    assert rig.driver.ready() == (True, "ready")


def test_direct_claim_gets_the_node_with_mode_0666_and_nothing_else(rig: Rig) -> None:
    ns, name, uid = add_claim(rig.api, "direct")
    response = rig.kubelet.prepare((ns, name, uid))
    assert list(response.claims) == [uid]
    result = response.claims[uid]
    assert result.error == ""
    (device,) = result.devices
    assert (list(device.request_names), device.pool_name, device.device_name) == (
        ["fuse"], "node-1", "fuse")
    assert list(device.cdi_device_ids) == [f"{KIND}={uid}"]
    assert not device.HasField("share_id")
    spec = spec_of(rig, uid)
    assert list(jsonschema.Draft7Validator(SCHEMA).iter_errors(spec)) == []
    assert spec["kind"] == KIND
    (cdi_device,) = spec["devices"]
    assert cdi_device["name"] == uid
    assert cdi_device["containerEdits"] == {"deviceNodes": [{
        "path": "/dev/fuse", "hostPath": str(rig.settings.fuse_device), "type": "c",
        "major": 10, "minor": 229, "permissions": "rw", "fileMode": 0o666}]}


def install_shim(rig: Rig) -> Path:
    rig.settings.broker_dir.mkdir(parents=True, exist_ok=True)
    shim = rig.settings.broker_dir / protocol.SHIM_NAME
    shim.write_bytes(b"#!/bin/true\n")
    return shim


def test_broker_claim_also_gets_the_brokers_read_only_binds(rig: Rig) -> None:
    install_shim(rig)
    ns, name, uid = add_claim(rig.api, "broker",
                              config=[opaque(DRIVER_NAME, {"mode": "broker"})])
    result = rig.kubelet.prepare((ns, name, uid)).claims[uid]
    assert result.error == ""
    spec = spec_of(rig, uid)
    assert list(jsonschema.Draft7Validator(SCHEMA).iter_errors(spec)) == []
    mounts = spec["devices"][0]["containerEdits"]["mounts"]
    expected = broker_binds(rig.settings.broker_dir)
    assert [(m["containerPath"], m["hostPath"]) for m in mounts] == expected
    assert all("ro" in m["options"] and m["type"] == "bind" for m in mounts)
    assert spec["devices"][0]["containerEdits"]["deviceNodes"][0]["fileMode"] == 0o666


def test_broker_claim_on_a_node_without_the_broker_is_refused_saying_so(rig: Rig) -> None:
    ns, name, uid = add_claim(rig.api, "nobroker",
                              config=[opaque(DRIVER_NAME, {"mode": "broker"})])
    error = rig.kubelet.prepare((ns, name, uid)).claims[uid].error
    assert "broker mode" in error
    assert "manifests/broker" in error
    assert not list(rig.settings.cdi_dir.glob("*.json"))


@pytest.mark.parametrize(("parameters", "complaint"), [
    ({"mode": "fast"}, 'mode "fast" is not direct or broker'),
    ({"mode": "broker", "uid": 0}, "unknown field(s) 'uid'"),
    (["broker"], "parameters must be a JSON object, got list"),
    ("broker", "parameters must be a JSON object, got str"),
    ({"mode": 1}, "mode 1 is not direct or broker"),
])
def test_bad_config_is_refused_with_a_message_for_the_pods_events(
        rig: Rig, parameters: object, complaint: str) -> None:
    ns, name, uid = add_claim(rig.api, "bad", config=[opaque(DRIVER_NAME, parameters)])
    error = rig.kubelet.prepare((ns, name, uid)).claims[uid].error
    assert complaint in error
    assert f"claim {ns}/{name}" in error
    assert 'expected {"mode": "direct"} or {"mode": "broker"}' in error or "mode" in error
    assert not list(rig.settings.cdi_dir.glob("*.json"))


def test_another_drivers_config_is_not_ours_to_judge(rig: Rig) -> None:
    ns, name, uid = add_claim(rig.api, "other", config=[
        opaque("gpu.example.com", {"anything": True})])
    assert rig.kubelet.prepare((ns, name, uid)).claims[uid].error == ""


def test_claims_that_cannot_be_prepared_say_why(rig: Rig) -> None:
    missing = (NS, "missing", str(uuid.uuid4()))
    unallocated = add_claim(rig.api, "pending", allocated=False)
    foreign = add_claim(rig.api, "foreign", results=[
        {"request": "gpu", "driver": "gpu.example.com", "pool": "p", "device": "gpu-0"}])
    ns, name, _ = add_claim(rig.api, "recreated")
    stale_uid = (ns, name, str(uuid.uuid4()))
    traversal = (NS, "direct", "../../etc/x")
    bad_name = (NS, "../nodes/x", str(uuid.uuid4()))
    response = rig.kubelet.prepare(missing, unallocated, foreign, stale_uid, traversal,
                                   bad_name)
    errors = {uid: response.claims[uid].error for uid in response.claims}
    assert "cannot read claim team-a/missing from the API server: 404" in errors[missing[2]]
    assert errors[unallocated[2]] == "claim team-a/pending is not allocated"
    assert errors[foreign[2]] == f"claim team-a/foreign has no device of driver {DRIVER_NAME}"
    assert "the claim was deleted and made again" in errors[stale_uid[2]]
    assert "is not a CDI device name" in errors[traversal[2]]
    assert "not a namespace and a ResourceClaim name" in errors[bad_name[2]]
    assert not any("/nodes/" in path for _, path in rig.api.requests)
    assert not list(rig.settings.cdi_dir.glob("*"))


def test_one_bad_claim_does_not_fail_the_others(rig: Rig) -> None:
    good = add_claim(rig.api, "good")
    bad = add_claim(rig.api, "bad", config=[opaque(DRIVER_NAME, {"mode": "x"})])
    response = rig.kubelet.prepare(good, bad)
    assert response.claims[good[2]].error == ""
    assert response.claims[bad[2]].error != ""


def test_prepare_and_unprepare_are_idempotent(rig: Rig) -> None:
    claim_ = add_claim(rig.api, "again")
    first = rig.kubelet.prepare(claim_)
    inode = os.stat(rig.settings.cdi_dir / f"{DRIVER_NAME}-fuse_{claim_[2]}.json").st_ino
    gets = len(rig.api.requests)
    second = rig.kubelet.prepare(claim_)
    assert first == second
    # Answered from the record in the spec: no API call, the file left as it was.
    assert rig.api.requests[gets:] == []
    files = sorted(p.name for p in rig.settings.cdi_dir.iterdir())
    assert files == [f"{DRIVER_NAME}-fuse_{claim_[2]}.json"]  # no temp file left
    path = rig.settings.cdi_dir / files[0]
    assert path.stat().st_ino == inode
    for _ in range(2):
        response = rig.kubelet.unprepare(claim_)
        assert list(response.claims) == [claim_[2]]
        assert response.claims[claim_[2]].error == ""
        assert not path.exists()
    # A claim this driver never prepared (a kubelet's checkpoint from before a wipe).
    never = (NS, "never", str(uuid.uuid4()))
    assert rig.kubelet.unprepare(never).claims[never[2]].error == ""


def test_the_claims_own_config_wins_over_the_class_and_requests_pick_theirs(
        rig: Rig) -> None:
    install_shim(rig)
    ns, name, uid = add_claim(rig.api, "layers", config=[
        opaque(DRIVER_NAME, {"mode": "direct"}, source="FromClass"),
        opaque(DRIVER_NAME, {"mode": "broker"}, requests=["fuse"]),
        opaque(DRIVER_NAME, {"mode": "direct"}, requests=["other"])])
    assert rig.kubelet.prepare((ns, name, uid)).claims[uid].error == ""
    assert "mounts" in spec_of(rig, uid)["devices"][0]["containerEdits"]


def test_shared_device_answers_with_its_share_id_and_a_cdi_name_per_request(
        rig: Rig) -> None:
    """The kubelet hands a container the CDI IDs of the requests it names: each request
    needs the ID once, and only once."""
    share = str(uuid.uuid4())
    ns, name, uid = add_claim(rig.api, "shared", results=[
        {"request": "fuse", "driver": DRIVER_NAME, "pool": "node-1", "device": "fuse",
         "shareID": share},
        {"request": "fuse", "driver": DRIVER_NAME, "pool": "node-1", "device": "fuse-1"},
        {"request": "other", "driver": DRIVER_NAME, "pool": "node-1", "device": "fuse-2"}])
    result = rig.kubelet.prepare((ns, name, uid)).claims[uid]
    assert result.error == ""
    first, second, other = result.devices
    assert first.share_id == share
    assert list(first.cdi_device_ids) == [f"{KIND}={uid}"]
    assert list(second.cdi_device_ids) == []  # the same node, the same request
    assert list(other.cdi_device_ids) == [f"{KIND}={uid}"]
    assert list(other.request_names) == ["other"]


def test_mixed_modes_in_one_claim_are_refused(rig: Rig) -> None:
    ns, name, uid = add_claim(rig.api, "mixed", results=[
        {"request": "a", "driver": DRIVER_NAME, "pool": "node-1", "device": "fuse"},
        {"request": "b", "driver": DRIVER_NAME, "pool": "node-1", "device": "fuse"}],
        config=[opaque(DRIVER_NAME, {"mode": "direct"}, requests=["a"]),
                opaque(DRIVER_NAME, {"mode": "broker"}, requests=["b"])])
    error = rig.kubelet.prepare((ns, name, uid)).claims[uid].error
    assert "both direct and broker mode" in error


def test_a_mode_for_some_requests_and_none_for_others_is_refused(rig: Rig) -> None:
    """A request without a config takes the node's default, which may differ from its
    sibling's explicit mode: refused rather than guessed."""
    ns, name, uid = add_claim(rig.api, "half", results=[
        {"request": "a", "driver": DRIVER_NAME, "pool": "node-1", "device": "fuse"},
        {"request": "b", "driver": DRIVER_NAME, "pool": "node-1", "device": "fuse"}],
        config=[opaque(DRIVER_NAME, {"mode": "broker"}, requests=["b"])])
    error = rig.kubelet.prepare((ns, name, uid)).claims[uid].error
    assert "a mode for some requests and none for others" in error


def test_a_node_without_fuse_refuses_claims(rig: Rig) -> None:
    rig.prober.healthy = False
    ns, name, uid = add_claim(rig.api, "nofuse")
    assert "does not exist" in rig.kubelet.prepare((ns, name, uid)).claims[uid].error


def test_api_server_unreachable_is_a_per_claim_error(api: FakeApiServer) -> None:
    with running_driver(api, publish=False) as rig:
        ns, name, uid = add_claim(api, "down")
        api.fail["GET claim"] = 503
        error = rig.kubelet.prepare((ns, name, uid)).claims[uid].error
        assert error.startswith("cannot read claim team-a/down from the API server: 503")


def test_stale_sockets_are_replaced_and_a_live_one_is_refused(api: FakeApiServer,
                                                               root: Path) -> None:
    with running_driver(api, publish=False, root=root) as rig:
        settings = rig.settings
    # Stale: a socket file nobody serves (a driver killed with SIGKILL).
    for path in (settings.service_socket, settings.registration_socket):
        with socket.socket(socket.AF_UNIX) as sock:
            sock.bind(str(path))
    with running_driver(api, publish=False, root=root) as rig:
        assert rig.kubelet.get_info().name == DRIVER_NAME
        with pytest.raises(Failure, match="another process serves"), \
                running_driver(api, publish=False, root=root):
            pass
    assert not settings.service_socket.exists()
    assert not settings.registration_socket.exists()


def probe(port: int, path: str) -> tuple[int, str]:
    status, text = get(port, path)
    return status, text.strip()


def test_probes_say_alive_and_ready_with_the_reason(api: FakeApiServer) -> None:
    with running_driver(api, probe_port=free_port(), probe_address="127.0.0.1") as rig:
        port = rig.driver.probe_port
        assert port is not None
        assert probe(port, "/healthz") == (200, "ok")
        assert probe(port, "/readyz") == (503, "not registered with the kubelet")
        rig.kubelet.notify(True)
        assert probe(port, "/readyz") == (200, "ready")
        rig.prober.healthy = False
        rig.driver.wake()
        wait_for(lambda: probe(port, "/readyz")[0] == 503, 10, "readyz to turn 503")
        assert "device unhealthy" in probe(port, "/readyz")[1]
        rig.settings.registration_socket.unlink()
        status, reason = probe(port, "/healthz")
        assert status == 503
        assert reason.endswith("is gone")


class Events(logging.Handler):
    """The driver's event names, each with whether its registration socket still existed
    when it was logged."""

    def __init__(self, registration: Path) -> None:
        super().__init__()
        self.registration = registration
        self.seen: list[tuple[str, bool]] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.seen.append((record.getMessage(), self.registration.exists()))

    def names(self) -> list[str]:
        return [name for name, _ in self.seen]


def test_a_stopping_driver_finishes_its_calls_before_it_deregisters(
        api: FakeApiServer) -> None:
    """The kubelet cuts every call in flight when it deregisters a driver (it closes its
    connection), so the registration socket must outlive the calls: a Prepare waiting on
    the API server at SIGTERM is answered, and one that arrives meanwhile too."""
    log = logs.setup("text", "debug")
    with running_driver(api, publish=False, log=log) as rig:
        events = Events(rig.settings.registration_socket)
        log.addHandler(events)
        try:
            slow, late = add_claim(api, "slow"), add_claim(api, "late")
            release = threading.Event()
            api.hold["GET claim"] = release
            with concurrent.futures.ThreadPoolExecutor(3) as pool:
                first = pool.submit(rig.kubelet.prepare, slow)
                wait_for(lambda: any(slow[1] in path for _, path in api.requests), 10,
                         "the driver to ask the API server for the claim")
                stopping = pool.submit(rig.driver.sockets.stop)
                wait_for(lambda: "calls.draining" in events.names(), 10, "the drain")
                second = pool.submit(rig.kubelet.prepare, late)
                wait_for(lambda: "call.while_stopping" in events.names(), 10,
                         "the call that arrived while stopping")
                assert rig.settings.registration_socket.exists()
                release.set()
                assert not first.result(30).claims[slow[2]].error
                assert not second.result(30).claims[late[2]].error
                stopping.result(30)
        finally:
            log.removeHandler(events)
    assert dict(events.seen)["calls.drained"] is True  # logged before the socket went
    assert not rig.settings.registration_socket.exists()
