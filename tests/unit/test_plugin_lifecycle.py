"""Scenarios of issue 2: the real ``serve`` process and the kubelet stand-in on real unix
sockets. Every wait is on an event (a registration, a device-list update, an inotify
event, a process exit) with a deadline."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable

import grpc
import pytest

from fuse_plugin.api import api_pb2 as api
from tests.lib.kubelet import KubeletStandIn, socket_files
from tests.lib.node import FakeNode
from tests.lib.plugin import RESOURCE, StartPlugin
from tests.lib.probes import DEADLINE
from tests.lib.waiting import wait_for, wait_until

SOCKET = "github.com_fuse.sock"


def all_health(health: str, count: int = 8) -> Callable[[dict[str, str]], bool]:
    def check(devices: dict[str, str]) -> bool:
        return len(devices) == count and set(devices.values()) == {health}
    return check


def test_registers_and_advertises_every_slot(kubelet: KubeletStandIn,
                                             start_plugin: StartPlugin) -> None:
    start_plugin(slots=8)
    registration = kubelet.wait_registered()
    assert (registration.resource, registration.endpoint) == (RESOURCE, SOCKET)
    assert registration.options.get_preferred_allocation_available
    devices = kubelet.wait_devices(RESOURCE, all_health("Healthy"))
    assert sorted(devices, key=lambda i: int(i.split("-")[1])) == [f"fuse-{i}" for i in range(8)]
    assert kubelet.capacity(RESOURCE) == (8, 8)


def test_plugin_up_before_the_kubelet(node: FakeNode, start_plugin: StartPlugin) -> None:
    plugin = start_plugin()
    assert wait_until(node.plugin_dir, (node.plugin_dir / SOCKET).exists), plugin.log
    with KubeletStandIn(node.plugin_dir) as kubelet:
        kubelet.wait_registered()
        kubelet.wait_devices(RESOURCE, all_health("Healthy"))
        assert kubelet.allocate(RESOURCE, [["fuse-0"]]).container_responses
        # One kubelet, one Register: a second one would make the kubelet drop our stream.
        assert len(kubelet.registrations) == 1, plugin.log
    assert plugin.proc.poll() is None


def test_kubelet_restarted_twenty_times_in_a_row(kubelet: KubeletStandIn,
                                                  start_plugin: StartPlugin) -> None:
    plugin = start_plugin("--log-format", "json")
    kubelet.wait_registered(1)
    for restart in range(20):
        kubelet.restart()
        registration = kubelet.wait_registered(restart + 2)
        assert registration.endpoint == SOCKET
        kubelet.wait_devices(RESOURCE, all_health("Healthy"))
    assert socket_files(kubelet.directory) == sorted(["kubelet.sock", SOCKET])
    assert len(plugin.events("kubelet.restart_seen")) == 20
    # Exactly one serve and one registration per kubelet start: no re-serve loop.
    kubelet.allocate(RESOURCE, [["fuse-0"]])
    assert len(kubelet.registrations) == 21, plugin.log
    assert len(plugin.events("serving")) == 21, plugin.log


def test_kubelet_refusing_register_is_retried(kubelet: KubeletStandIn,
                                              start_plugin: StartPlugin) -> None:
    kubelet.refuse_next = 3
    plugin = start_plugin("--log-format", "json")
    kubelet.wait_registered(1)
    assert len(kubelet.refusals) == 3
    assert len(plugin.events("register.failed")) == 3
    assert plugin.proc.poll() is None


def test_own_socket_deleted_under_it_is_recreated(node: FakeNode, kubelet: KubeletStandIn,
                                                  start_plugin: StartPlugin) -> None:
    start_plugin()
    kubelet.wait_registered(1)
    (node.plugin_dir / SOCKET).unlink()
    kubelet.wait_registered(2)
    assert (node.plugin_dir / SOCKET).exists()
    kubelet.wait_devices(RESOURCE, all_health("Healthy"))


def test_device_removed_and_recreated_flips_health_on_the_stream(
        node: FakeNode, kubelet: KubeletStandIn, start_plugin: StartPlugin) -> None:
    plugin = start_plugin()
    kubelet.wait_registered()
    kubelet.wait_devices(RESOURCE, all_health("Healthy"))
    node.remove_device()
    kubelet.wait_devices(RESOURCE, all_health("Unhealthy"))
    assert kubelet.capacity(RESOURCE) == (8, 0)
    with pytest.raises(grpc.RpcError) as refused:
        kubelet.allocate(RESOURCE, [["fuse-0"]])
    assert refused.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert "unhealthy device IDs: fuse-0" in str(refused.value.details())
    node.restore_device()
    kubelet.wait_devices(RESOURCE, all_health("Healthy"))
    assert kubelet.allocate(RESOURCE, [["fuse-0"]]).container_responses
    assert "device.health health=Unhealthy" in plugin.log


def test_wrong_device_type_is_unhealthy(node: FakeNode, kubelet: KubeletStandIn,
                                        start_plugin: StartPlugin) -> None:
    node.remove_device()
    node.device.write_text("not a device")
    start_plugin()
    kubelet.wait_registered()
    kubelet.wait_devices(RESOURCE, all_health("Unhealthy"))


def test_allocate_two_containers_and_refuse_unknown_ids(
        node: FakeNode, kubelet: KubeletStandIn, start_plugin: StartPlugin) -> None:
    start_plugin()
    kubelet.wait_registered()
    response = kubelet.allocate(RESOURCE, [["fuse-0"], ["fuse-5"]])
    expected = api.DeviceSpec(container_path="/dev/fuse", host_path=str(node.device),
                              permissions="rw")
    assert [list(c.devices) for c in response.container_responses] == [[expected]] * 2
    with pytest.raises(grpc.RpcError) as refused:
        kubelet.allocate(RESOURCE, [["fuse-0", "fuse-99", "nvidia0"]])
    assert refused.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert refused.value.details() == "unknown device IDs: fuse-99, nvidia0"


def test_sigterm_stops_cleanly_and_removes_the_socket(node: FakeNode, kubelet: KubeletStandIn,
                                                       start_plugin: StartPlugin) -> None:
    plugin = start_plugin()
    kubelet.wait_registered()
    kubelet.wait_devices(RESOURCE, all_health("Healthy"))
    assert plugin.terminate() == 0
    assert not (node.plugin_dir / SOCKET).exists()
    # The kubelet sees the stream end and marks the devices unhealthy, as it does.
    kubelet.wait_devices(RESOURCE, all_health("Unhealthy"))
    assert "stopped" in plugin.log
    assert "Traceback" not in plugin.log


def test_restart_after_sigkill_replaces_the_stale_socket(
        node: FakeNode, kubelet: KubeletStandIn, start_plugin: StartPlugin) -> None:
    first = start_plugin()
    kubelet.wait_registered(1)
    first.kill()
    assert (node.plugin_dir / SOCKET).exists(), "SIGKILL should leave the socket behind"
    second = start_plugin("--log-format", "json")
    kubelet.wait_registered(2)
    kubelet.wait_devices(RESOURCE, all_health("Healthy"))
    assert second.events("socket.stale_removed")
    # Removing the stale file must not start a loop of re-serving on our own deletes:
    # one kubelet restart later, the plugin has served twice and registered twice.
    kubelet.restart()
    kubelet.wait_registered(3)
    kubelet.wait_devices(RESOURCE, all_health("Healthy"))
    assert kubelet.allocate(RESOURCE, [["fuse-0"]]).container_responses
    assert len(kubelet.registrations) == 3, second.log
    assert len(second.events("serving")) == 2, second.log


def test_json_logs_are_one_object_per_line(kubelet: KubeletStandIn,
                                           start_plugin: StartPlugin) -> None:
    plugin = start_plugin("--log-format", "json", "--log-level", "debug")
    kubelet.wait_registered()
    kubelet.allocate(RESOURCE, [["fuse-1"]])
    # The stand-in counts a Register when it answers; the plugin logs it when the answer
    # arrives, which may be after the Allocate.
    wait_for(lambda: plugin.events("registered"), DEADLINE, "the plugin's registered event")
    assert plugin.terminate() == 0
    events = [json.loads(line) for line in plugin.log.splitlines()]
    names = [e["event"] for e in events]
    assert {"start", "serving", "registered", "allocate", "stopped"} <= set(names)
    allocation = events[names.index("allocate")]
    assert allocation["ids"] == ["fuse-1"]
    assert allocation["resource"] == RESOURCE
    assert all({"ts", "level"} <= set(e) for e in events)


@pytest.mark.parametrize(("args", "message"), [
    (["--slots", "0"], "--slots: must be a whole number from 1 to 100000, got '0'"),
    (["--slots", "many"], "--slots: must be a whole number"),
    (["--slots", " 5"], "--slots: must be a whole number from 1 to 100000, got ' 5'"),
    (["--metrics-port", " 80"], "--metrics-port: must be a TCP port from 0 to 65535, got ' 80'"),
    (["--resource-name", "fuse"], "not an extended resource name"),
    (["--resource-name", "kubernetes.io/fuse"], "reserved for native resources"),
    (["--resource-name", "Github.com/fuse"], "not a lowercase DNS subdomain"),
    (["--fuse-device", "dev/fuse"], "--fuse-device: must be an absolute path"),
    (["--log-format", "xml"], "--log-format: must be one of text, json"),
    (["--bogus"], "unrecognized arguments: --bogus"),
])
def test_bad_flags_exit_2_with_one_clear_line(args: list[str], message: str) -> None:
    result = subprocess.run([sys.executable, "-m", "fuse_plugin", "serve", *args],
                            capture_output=True, text=True, timeout=30, check=False)
    assert result.returncode == 2
    assert message in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert "Traceback" not in result.stderr


def test_bad_environment_value_names_the_variable() -> None:
    result = subprocess.run([sys.executable, "-m", "fuse_plugin", "serve"],
                            env={"FUSE_DEVICE_PLUGIN_SLOTS": "-3", "PATH": "/usr/bin:/bin"},
                            capture_output=True, text=True, timeout=30, check=False)
    assert result.returncode == 2
    assert "$FUSE_DEVICE_PLUGIN_SLOTS" in result.stderr
