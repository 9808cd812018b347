"""What the DRA driver remembers and decides on its own: the record of each prepared
claim in its CDI spec (answered again without the API server, found again after a
restart, orphans and leftovers removed, a SIGKILL at any point reconciled), the mode of a
claim that chose none (the node's), the slice put back by its watch, and the metrics."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import uuid
from pathlib import Path

from fuse_plugin.broker import protocol
from fuse_plugin.dra import checkpoint
from fuse_plugin.dra.settings import DRIVER_NAME
from tests.lib.apiserver import FakeApiServer, claim, opaque
from tests.lib.dra import (
    NODE,
    NS,
    Kubelet,
    Rig,
    add_claim,
    node_api_fixture,
    running_driver,
    settings_in,
    short_root_fixture,
)
from tests.lib.probes import get
from tests.lib.servers import free_port, stop_process
from tests.lib.waiting import wait_for

PREFIX = f"{DRIVER_NAME}-fuse"


api = node_api_fixture
root = short_root_fixture


def spec_path(rig: Rig, uid: str) -> Path:
    return rig.settings.cdi_dir / f"{PREFIX}_{uid}.json"


def claim_gets(api: FakeApiServer) -> list[str]:
    return [path for method, path in api.requests if "/resourceclaims/" in path]


def install_shim(rig: Rig) -> None:
    rig.settings.broker_dir.mkdir(parents=True, exist_ok=True)
    (rig.settings.broker_dir / protocol.SHIM_NAME).write_bytes(b"#!/bin/false\n")


# -- the record ---------------------------------------------------------------------


def test_the_spec_records_the_claim_and_the_answer(api: FakeApiServer) -> None:
    with running_driver(api, publish=False) as rig:
        ns, name, uid = add_claim(api, "noted")
        answer = rig.kubelet.prepare((ns, name, uid)).claims[uid]
        record = checkpoint.read(DRIVER_NAME, uid, spec_path(rig, uid))
        spec = json.loads(spec_path(rig, uid).read_text())
    assert answer.error == ""
    assert record is not None
    assert (record.namespace, record.name, record.mode) == (ns, name, "direct")
    assert [d.cdi_ids for d in record.devices] == [tuple(answer.devices[0].cdi_device_ids)]
    assert spec["cdiVersion"] == "0.6.0"  # the first version with a spec's annotations


def test_after_a_restart_a_prepared_claim_is_answered_from_its_record(
        api: FakeApiServer, root: Path) -> None:
    """The kubelet prepares again after its own restart or a timeout: the driver, itself
    restarted, answers from the spec's record without reading the claim, and the claim
    still unprepares."""
    ns, name, uid = add_claim(api, "kept")
    with running_driver(api, publish=False, root=root) as rig:
        first = rig.kubelet.prepare((ns, name, uid))
    before = len(claim_gets(api))
    with running_driver(api, publish=False, root=root) as rig:
        # The one read of the orphan check at start, then none for the prepare.
        wait_for(lambda: len(claim_gets(api)) > before or None, 30, "the orphan check")
        settled = len(claim_gets(api))
        again = rig.kubelet.prepare((ns, name, uid))
        assert again == first
        assert len(claim_gets(api)) == settled
        assert rig.kubelet.unprepare((ns, name, uid)).claims[uid].error == ""
        assert not spec_path(rig, uid).exists()


def test_orphans_and_leftovers_are_removed_at_start_and_live_claims_kept(
        api: FakeApiServer, root: Path) -> None:
    """Specs whose claim is gone (deleted, or made again under a new UID) while the
    driver was away are removed at start; a temp file a killed write left is removed; a
    live claim's spec and a spec an older release wrote without a record are kept."""
    live = add_claim(api, "live")
    deleted = add_claim(api, "deleted")
    remade = add_claim(api, "remade")
    with running_driver(api, publish=False, root=root) as rig:
        for c in (live, deleted, remade):
            assert rig.kubelet.prepare(c).claims[c[2]].error == ""
        cdi_dir = rig.settings.cdi_dir
    del api.claims[(NS, "deleted")]
    api.add_claim(claim(NS, "remade", str(uuid.uuid4()), DRIVER_NAME))
    old = cdi_dir / f"{PREFIX}_{uuid.uuid4()}.json"
    old.write_text(json.dumps({"cdiVersion": "0.5.0", "kind": f"{DRIVER_NAME}/fuse",
                               "devices": []}))
    leftover = cdi_dir / f".{PREFIX}_{uuid.uuid4()}.json.abc123.tmp"
    leftover.write_text("{")
    with running_driver(api, publish=False, root=root) as rig:
        gone = wait_for(lambda: (not spec_path(rig, deleted[2]).exists()
                                 and not spec_path(rig, remade[2]).exists()) or None,
                        30, "the orphans' specs to go",
                        detail=lambda: str(sorted(p.name for p in cdi_dir.iterdir())))
        assert gone
        assert spec_path(rig, live[2]).exists()
        assert old.exists()
        assert not leftover.exists()
        assert rig.driver.preparer.prepared == 2


def test_a_claim_that_cannot_be_read_at_start_is_kept(api: FakeApiServer,
                                                      root: Path) -> None:
    c = add_claim(api, "unreadable")
    with running_driver(api, publish=False, root=root) as rig:
        assert rig.kubelet.prepare(c).claims[c[2]].error == ""
    api.fail["GET claim"] = 503
    with running_driver(api, publish=False, root=root) as rig:
        wait_for(lambda: claim_gets(api) or None, 30, "the orphan check to ask")
        assert rig.kubelet.prepare(c).claims[c[2]].error == ""  # from the record
        assert spec_path(rig, c[2]).exists()


def test_a_spec_without_a_record_is_read_from_the_api_and_recorded(
        api: FakeApiServer, root: Path) -> None:
    """An older release's spec: prepared again by reading the claim, then recorded."""
    ns, name, uid = add_claim(api, "older")
    settings = settings_in(root)
    settings.cdi_dir.mkdir(parents=True)
    path = settings.cdi_dir / f"{PREFIX}_{uid}.json"
    path.write_text(json.dumps({"cdiVersion": "0.5.0", "kind": f"{DRIVER_NAME}/fuse",
                                "devices": [{"name": uid, "containerEdits": {}}]}))
    with running_driver(api, publish=False, root=root) as rig:
        assert rig.driver.preparer.prepared == 1
        assert rig.kubelet.prepare((ns, name, uid)).claims[uid].error == ""
        assert claim_gets(api)
        assert checkpoint.read(DRIVER_NAME, uid, path) is not None


def test_sigkill_at_any_point_leaves_nothing_a_restart_cannot_reconcile(
        api: FakeApiServer, root: Path, tmp_path: Path) -> None:
    """The real command, killed with SIGKILL while it prepares a burst of claims, again
    and again: after each restart every spec on disk has its record or is gone, no temp
    file stays, every claim prepares (the same answer for the recorded ones), and
    unpreparing them all leaves the directory empty."""
    settings = settings_in(root)
    kubeconfig = api.kubeconfig(tmp_path / "kubeconfig")
    command = [sys.executable, "-m", "fuse_plugin", "dra", "--node-name", NODE,
               "--publish", "false", "--plugins-dir", str(settings.plugins_dir),
               "--registry-dir", str(settings.registry_dir), "--cdi-dir",
               str(settings.cdi_dir), "--fuse-device", "/dev/fuse",
               "--broker-dir", str(settings.broker_dir)]
    env = {**os.environ, "KUBECONFIG": str(kubeconfig)}
    claims = [add_claim(api, f"burst-{i}") for i in range(12)]
    kubelet = Kubelet(settings)
    answers: dict[str, list[str]] = {}
    for round_ in range(6):
        proc = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL,
                                stderr=subprocess.PIPE)
        try:
            wait_for(lambda: settings.service_socket.exists() or None, 30,
                     "the driver's socket")
            wait_for(lambda: _answers(kubelet) or None, 30, "the driver to answer")
            batch = claims[round_ * 2:] + claims[:round_ * 2]

            def burst(chosen: list[tuple[str, str, str]] = batch) -> None:
                try:
                    for c in chosen:
                        kubelet.prepare(c)
                except Exception:  # the kill cuts the call: that is the point
                    return

            worker = threading.Thread(target=burst)
            worker.start()
            wait_for(lambda: any(settings.cdi_dir.glob(f"{PREFIX}_*.json")) or None, 30,
                     "a first spec")
            proc.send_signal(signal.SIGKILL)
            proc.wait(30)
            worker.join(30)
        finally:
            stop_process(proc)
        for path in settings.cdi_dir.glob(f"{PREFIX}_*.json"):
            uid = path.name[len(PREFIX) + 1:-5]
            assert checkpoint.read(DRIVER_NAME, uid, path) is not None, path.read_text()
    proc = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE)
    try:
        wait_for(lambda: _answers(kubelet) or None, 30, "the driver to answer")
        assert not list(settings.cdi_dir.glob(".*.tmp"))
        for c in claims:
            response = kubelet.prepare(c).claims[c[2]]
            assert response.error == ""
            answers[c[2]] = list(response.devices[0].cdi_device_ids)
            assert answers[c[2]] == [f"{DRIVER_NAME}/fuse={c[2]}"]
        for c in claims:
            assert kubelet.unprepare(c).claims[c[2]].error == ""
        assert list(settings.cdi_dir.iterdir()) == []
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(30)


def _answers(kubelet: Kubelet) -> bool:
    try:
        kubelet.get_info()
    except Exception:
        return False
    return True


# -- the mode of a claim that chose none ------------------------------------------------


def test_a_claim_without_a_mode_takes_the_nodes_broker_mode_and_its_own_wins(
        api: FakeApiServer) -> None:
    """The claim the scheduler makes for `github.com/fuse: 1` names no mode: on a node
    whose broker installed its shim it gets broker mode's binds (as the device plugin's
    broker mode gives every pod), without the shim it is direct; a claim's own
    `mode: direct` still wins on a broker node."""
    with running_driver(api, publish=False) as rig:
        plain = add_claim(api, "plain-direct-node")
        assert rig.kubelet.prepare(plain).claims[plain[2]].error == ""
        edits = json.loads(spec_path(rig, plain[2]).read_text())["devices"][0]
        assert "mounts" not in edits["containerEdits"]
        install_shim(rig)
        onbroker = add_claim(api, "plain-broker-node")
        assert rig.kubelet.prepare(onbroker).claims[onbroker[2]].error == ""
        edits = json.loads(spec_path(rig, onbroker[2]).read_text())["devices"][0]
        binds = [m["containerPath"] for m in edits["containerEdits"]["mounts"]]
        assert protocol.CONTAINER_DIR in binds
        chosen = add_claim(api, "chooses-direct",
                           config=[opaque(DRIVER_NAME, {"mode": "direct"})])
        assert rig.kubelet.prepare(chosen).claims[chosen[2]].error == ""
        edits = json.loads(spec_path(rig, chosen[2]).read_text())["devices"][0]
        assert "mounts" not in edits["containerEdits"]
        record = checkpoint.read(DRIVER_NAME, onbroker[2], spec_path(rig, onbroker[2]))
        assert record is not None
        assert record.mode == "broker"


# -- the slice's watch and the metrics -----------------------------------------------


def test_a_deleted_slice_is_put_back_by_the_watch(api: FakeApiServer) -> None:
    """Someone deletes the driver's slice (resync an hour away): the watch sees it and
    the slice is written again; an edit of its devices is undone the same way."""
    with running_driver(api) as rig:
        wait_for(lambda: api.watches or None, 30, "the slice watch")
        name = rig.driver.publisher.name if rig.driver.publisher else ""
        writes = len(api.writes)
        api.delete_slice(name)
        wait_for(lambda: any(verb == "create" for verb, _, _ in api.writes_since(writes + 1))
                 or None, 30, "the slice to be created again",
                 detail=lambda: str(api.writes_since(writes)))
        assert name in api.slices
        with api._cond:
            api.slices[name]["spec"]["devices"] = []
            api._record("update", name, api.slices[name])
        writes = len(api.writes)
        wait_for(lambda: api.writes_since(writes) or None, 30, "the slice to be mended")
        assert api.slices[name]["spec"]["devices"][0]["name"] == "fuse"


def test_metrics_count_claims_by_outcome_and_the_claims_on_the_node(
        api: FakeApiServer) -> None:
    with running_driver(api, probe_port=free_port(), probe_address="127.0.0.1") as rig:
        port = rig.driver.probe_port
        assert port is not None
        good = add_claim(api, "counted")
        bad = add_claim(api, "refused", config=[opaque(DRIVER_NAME, {"mode": "x"})])
        rig.kubelet.prepare(good, bad)
        rig.kubelet.prepare(good)
        status, text = get(port, "/metrics")
        assert status == 200
        lines = set(text.splitlines())
        assert 'fuse_dra_prepare_claims_total{outcome="prepared"} 1.0' in lines
        assert 'fuse_dra_prepare_claims_total{outcome="recorded"} 1.0' in lines
        assert 'fuse_dra_prepare_claims_total{outcome="refused"} 1.0' in lines
        assert 'fuse_dra_claims_prepared 1.0' in lines
        assert 'fuse_dra_prepare_seconds_count{outcome="prepared"} 1.0' in lines
        assert 'fuse_dra_slice_writes_total 1.0' in lines
        rig.kubelet.unprepare(good)
        lines = set(get(port, "/metrics")[1].splitlines())
        assert 'fuse_dra_claims_prepared 0.0' in lines
        assert 'fuse_dra_unprepare_claims_total{outcome="unprepared"} 1.0' in lines


# -- instances side by side (a rolling update) ----------------------------------------


def test_two_instances_serve_side_by_side_and_a_killed_ones_sockets_are_removed(
        api: FakeApiServer, root: Path) -> None:
    """A rolling update's new pod (--instance from the pod's name) binds sockets of its
    own while the old pod still serves; the sockets a killed pod left under its name are
    removed at start, the live pod's are not."""
    import socket

    with running_driver(api, publish=False, root=root, instance="driver-old") as old:
        dead = settings_in(root, instance="driver-dead")
        for path in (dead.registration_socket, dead.service_socket):
            with socket.socket(socket.AF_UNIX) as sock:
                sock.bind(str(path))  # bound, never listened: nobody serves it
        with running_driver(api, publish=False, root=root, instance="driver-new") as new:
            assert old.settings.registration_socket != new.settings.registration_socket
            assert old.kubelet.get_info().endpoint == str(old.settings.service_socket)
            assert new.kubelet.get_info().endpoint == str(new.settings.service_socket)
            assert not dead.registration_socket.exists()
            assert not dead.service_socket.exists()
            c = add_claim(api, "during-rollout")
            assert new.kubelet.prepare(c).claims[c[2]].error == ""
            assert old.kubelet.unprepare(c).claims[c[2]].error == ""
        assert old.settings.registration_socket.exists()
