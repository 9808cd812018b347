"""Issue 35: a plugin rollout that no pod notices. The real ``serve`` processes and the
kubelet stand-in, which keeps the device manager's books as kubelet 1.37.2 does: one
endpoint per socket path, devices marked unhealthy only when a resource's last endpoint
disconnects, pods admitted with the kubelet's checks. Every wait is on an event (a
registration, a log line, a stream's end, a process exit) with a deadline."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import grpc
import pytest

from fuse_plugin.api import api_pb2 as api
from fuse_plugin.api import api_pb2_grpc
from fuse_plugin.config import API_VERSION
from fuse_plugin.demo.kubelet import Rejected
from tests.lib.background import Repeating
from tests.lib.kubelet import KubeletStandIn, socket_files
from tests.lib.node import FakeNode
from tests.lib.plugin import RESOURCE, PluginProcess, StartPlugin
from tests.lib.probes import DEADLINE
from tests.lib.waiting import wait_for

SOCKET = "github.com_fuse.sock"
OLD, NEW = "github.com_fuse-old.sock", "github.com_fuse-new.sock"
NO_HEALTHY = f"no healthy devices present; cannot allocate unhealthy devices {RESOURCE}"
# Between two admissions: a pod every 20 ms keeps the stand-in busy, not the CPUs.
ADMIT_EVERY = 0.02


def healthy(devices: dict[str, str]) -> bool:
    return len(devices) == 8 and set(devices.values()) == {"Healthy"}


def logged(plugin: PluginProcess, event: str) -> list[dict[str, object]]:
    return wait_for(lambda: plugin.events(event), DEADLINE, f"the plugin to log {event}",
                    detail=lambda: plugin.log)


def registered(kubelet: KubeletStandIn, count: int) -> None:
    kubelet.wait_registered(count, DEADLINE)
    kubelet.wait_devices(RESOURCE, healthy, DEADLINE)


def knows_registered(kubelet: KubeletStandIn, plugin: PluginProcess) -> None:
    """The kubelet holds the plugin's registration and the plugin has its answer: the
    kubelet records a Register before its reply reaches the plugin, and only a plugin that
    knows it is registered hands off."""
    registered(kubelet, 1)
    logged(plugin, "registered")


def endpoints_are(kubelet: KubeletStandIn, names: list[str]) -> None:
    assert kubelet.wait_for(lambda: kubelet.endpoints(RESOURCE) == names, DEADLINE), \
        f"the kubelet's endpoints: {kubelet.endpoints(RESOURCE)}, expected {names}"


class Admissions(Repeating):
    """Pods asking for the resource one after another while the block runs, each gone
    again at once: what the kubelet admitted and what it rejected, with why."""

    def __init__(self, kubelet: KubeletStandIn) -> None:
        super().__init__(ADMIT_EVERY, "admissions", join_timeout=DEADLINE)
        self._kubelet = kubelet
        self.admitted = 0
        self.rejected: list[str] = []

    def step(self) -> None:
        try:
            ids = self._kubelet.admit(RESOURCE)
        except Rejected as err:
            self.rejected.append(str(err))
        else:
            self._kubelet.release(RESOURCE, ids)
            self.admitted += 1


# -- what the issue saw, and why ------------------------------------------------------

def test_a_plugin_restarted_on_its_one_socket_leaves_a_gap_pods_are_rejected_in(
        kubelet: KubeletStandIn, start_plugin: StartPlugin) -> None:
    """The old way (one socket name, the old pod gone before the new one starts): the
    old plugin's stream ends, it was the resource's last endpoint, the kubelet marks
    every slot unhealthy, and a pod admitted now is rejected for good."""
    old = start_plugin()
    registered(kubelet, 1)
    assert old.terminate() == 0
    kubelet.wait_devices(RESOURCE, lambda d: set(d.values()) == {"Unhealthy"}, DEADLINE)
    assert [m.endpoint for m in kubelet.unhealthy_marks] == [SOCKET]
    with pytest.raises(Rejected) as rejected:
        kubelet.admit(RESOURCE)
    assert str(rejected.value) == NO_HEALTHY
    start_plugin()
    registered(kubelet, 2)
    assert kubelet.admit(RESOURCE)


def test_a_second_register_on_a_connected_socket_is_refused_and_orphans_its_stream(
        kubelet: KubeletStandIn, start_plugin: StartPlugin) -> None:
    """Why the socket must be named per pod: a Register for a path the kubelet holds is
    refused ("device plugin already connected"), and the refusal drops every client of
    that path, so when the old stream ends nobody disconnects it. The slots stay
    Healthy behind an endpoint that is gone (kubelet 1.37.2, handler.go)."""
    plugin = start_plugin()
    registered(kubelet, 1)
    with grpc.insecure_channel(f"unix://{kubelet.socket}") as channel, \
            pytest.raises(grpc.RpcError) as refused:
        api_pb2_grpc.RegistrationStub(channel).Register(api.RegisterRequest(
            version=API_VERSION, endpoint=SOCKET, resource_name=RESOURCE), timeout=DEADLINE)
    assert refused.value.code() is grpc.StatusCode.UNKNOWN
    assert "device plugin already connected" in str(refused.value.details())
    assert plugin.terminate() == 0
    assert kubelet.wait_for(lambda: kubelet.streams_ended == 1, DEADLINE)
    assert kubelet.unhealthy_marks == []
    assert healthy(kubelet.devices(RESOURCE))
    with pytest.raises(Rejected) as rejected:
        kubelet.admit(RESOURCE)
    assert "code = UNAVAILABLE" in str(rejected.value)


# -- a socket per instance --------------------------------------------------------------

def test_a_new_instance_registers_beside_the_old_one_and_takes_allocate(
        kubelet: KubeletStandIn, start_plugin: StartPlugin) -> None:
    old = start_plugin("--instance", "old", "--log-format", "json", "--log-level", "debug")
    registered(kubelet, 1)
    new = start_plugin("--instance", "new", "--log-format", "json", "--log-level", "debug")
    registered(kubelet, 2)
    endpoints_are(kubelet, [NEW, OLD])
    assert socket_files(kubelet.directory) == sorted(["kubelet.sock", NEW, OLD])
    assert kubelet.admit(RESOURCE) == ["fuse-0"]
    logged(new, "allocate")
    assert not old.events("allocate")
    assert old.terminate() == 0
    endpoints_are(kubelet, [NEW])
    assert kubelet.unhealthy_marks == []
    assert healthy(kubelet.devices(RESOURCE))
    assert kubelet.admit(RESOURCE) == ["fuse-1"]


def test_rollout_surge_then_stop_no_pod_rejected(kubelet: KubeletStandIn,
                                                 start_plugin: StartPlugin) -> None:
    """What a maxSurge rollout does on a node: the new pod starts and registers, then
    the old one is stopped. Pods arrive all along; the kubelet never lacks a healthy
    endpoint."""
    old = start_plugin("--instance", "old")
    registered(kubelet, 1)
    with Admissions(kubelet) as admissions:
        start_plugin("--instance", "new")
        registered(kubelet, 2)
        assert old.terminate() == 0
        endpoints_are(kubelet, [NEW])
        during = admissions.admitted
        wait_for(lambda: admissions.admitted > during, DEADLINE, "a pod admitted after")
    assert admissions.rejected == []
    assert kubelet.unhealthy_marks == []
    assert admissions.admitted > 0


def test_stale_socket_of_an_earlier_instance_is_removed_at_start(
        node: FakeNode, kubelet: KubeletStandIn, start_plugin: StartPlugin) -> None:
    """A pod killed with SIGKILL leaves its socket; no later pod binds that name again."""
    first = start_plugin("--instance", "old")
    registered(kubelet, 1)
    first.kill()
    assert (node.plugin_dir / OLD).exists()
    second = start_plugin("--instance", "new", "--log-format", "json")
    registered(kubelet, 2)
    [removed] = logged(second, "socket.stale_removed")
    assert removed["socket"] == str(node.plugin_dir / OLD)
    assert socket_files(kubelet.directory) == sorted(["kubelet.sock", NEW])


# -- the hand-off on SIGTERM ------------------------------------------------------------

def test_sigterm_keeps_serving_until_the_successor_registered(
        kubelet: KubeletStandIn, start_plugin: StartPlugin) -> None:
    """A deleted pod is replaced while it terminates: the old plugin keeps its socket and
    its place with the kubelet until the new one says it is registered, then goes."""
    old = start_plugin("--instance", "old", "--handoff-wait", "60", "--log-format", "json")
    knows_registered(kubelet, old)
    with Admissions(kubelet) as admissions:
        old.proc.send_signal(signal.SIGTERM)
        logged(old, "handoff.waiting")
        served_while_waiting = admissions.admitted
        wait_for(lambda: admissions.admitted > served_while_waiting, DEADLINE,
                 "a pod admitted while the old plugin waits")
        assert old.proc.poll() is None
        assert kubelet.endpoints(RESOURCE) == [OLD]
        start_plugin("--instance", "new")
        assert old.proc.wait(DEADLINE) == 0
        endpoints_are(kubelet, [NEW])
    [done] = old.events("handoff.done")
    assert done["successor"] == NEW
    assert kubelet.registrations[1].endpoint == NEW
    assert admissions.rejected == []
    assert kubelet.unhealthy_marks == []


def test_handoff_gives_up_at_its_deadline(kubelet: KubeletStandIn,
                                          start_plugin: StartPlugin) -> None:
    old = start_plugin("--instance", "old", "--handoff-wait", "1", "--log-format", "json")
    knows_registered(kubelet, old)
    old.proc.send_signal(signal.SIGTERM)
    assert old.proc.wait(DEADLINE) == 0
    assert old.events("handoff.timeout")
    assert [m.endpoint for m in kubelet.unhealthy_marks] == [OLD]


def test_a_second_signal_gives_the_handoff_up(kubelet: KubeletStandIn,
                                              start_plugin: StartPlugin) -> None:
    old = start_plugin("--instance", "old", "--handoff-wait", "60", "--log-format", "json")
    knows_registered(kubelet, old)
    old.proc.send_signal(signal.SIGTERM)
    logged(old, "handoff.waiting")
    old.proc.send_signal(signal.SIGINT)
    assert old.proc.wait(DEADLINE) == 0
    assert old.events("handoff.abandoned")


def test_handoff_does_not_take_another_resources_plugin_for_a_successor(
        kubelet: KubeletStandIn, start_plugin: StartPlugin) -> None:
    """``github.com_fuse-x.sock`` could be instance ``x`` of github.com/fuse, or the
    plugin of github.com/fuse-x: it is asked, and its answer names the latter."""
    old = start_plugin("--instance", "old", "--handoff-wait", "3", "--log-format", "json")
    registered(kubelet, 1)
    other = start_plugin("--resource-name", "github.com/fuse-x", "--log-format", "json")
    kubelet.wait_registered(2, DEADLINE)
    logged(other, "registered")
    old.proc.send_signal(signal.SIGTERM)
    assert old.proc.wait(DEADLINE) == 0
    assert old.events("handoff.timeout")
    assert not old.events("handoff.done")


def test_an_unregistered_plugin_stops_at_once(node: FakeNode,
                                              start_plugin: StartPlugin) -> None:
    """No kubelet has an endpoint of ours to lose: nothing to hand over."""
    plugin = start_plugin("--instance", "old", "--handoff-wait", "60", "--log-format", "json")
    logged(plugin, "serving")
    assert plugin.terminate(DEADLINE) == 0
    assert not plugin.events("handoff.waiting")


@pytest.mark.parametrize(("args", "message"), [
    (["--handoff-wait", "5"], "--handoff-wait needs --instance"),
    (["--instance", "a/b"], "--instance: must be empty or 1-63 characters"),
    (["--instance", "x" * 64], "--instance: must be empty or 1-63 characters"),
    (["--handoff-wait", "-1", "--instance", "a"], "--handoff-wait: must be a whole number"),
    (["--handoff-wait", "301", "--instance", "a"], "from 0 to 300, got '301'"),
])
def test_bad_rollout_flags_exit_2_with_one_line(args: list[str], message: str,
                                                tmp_path: Path) -> None:
    result = subprocess.run([sys.executable, "-m", "fuse_plugin", "serve",
                             "--device-plugin-dir", str(tmp_path), *args],
                            capture_output=True, text=True, timeout=30, check=False)
    assert result.returncode == 2, result.stderr
    assert message in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr
