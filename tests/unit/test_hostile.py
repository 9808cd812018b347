"""Issue 15 on the serve side: what a crash-looping kubelet, a second copy of the plugin,
a confused operator or a hostile client can do. Every case ends in a one-line error or a
gRPC status and the plugin comes back by itself; nothing here waits on a clock."""

from __future__ import annotations

import json
import os
import selectors
import socket
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import cast

import grpc
import pytest

from fuse_plugin import logs
from fuse_plugin.api import api_pb2 as api
from fuse_plugin.config import Settings
from fuse_plugin.deviceplugin import plugin
from fuse_plugin.deviceplugin.metrics import MAX_CONNECTIONS
from fuse_plugin.devices import Health, Probe
from tests.lib.kubelet import KubeletStandIn
from tests.lib.manifests import MANIFESTS, containers, one
from tests.lib.node import FakeNode
from tests.lib.plugin import RESOURCE, PluginProcess, StartPlugin
from tests.lib.probes import DEADLINE, get
from tests.lib.servers import free_port
from tests.lib.waiting import wait_for, wait_notified, wait_until

SOCKET = "github.com_fuse.sock"
# The plugin's RSS after a storm; it idles at ~36 MiB, and the storm that once grew it
# by half a gigabyte a second is caught long before this.
STORM_RSS_LIMIT_MIB = 48


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError(f"no VmRSS for {pid}")


def healthy(count: int) -> Callable[[dict[str, str]], bool]:
    return lambda devices: len(devices) == count and set(devices.values()) == {"Healthy"}


# -- bad flags and environment twins ---------------------------------------------------

LONG_DOMAIN = "a" * 60 + ".example.com"
BAD_SERVE_ARGS = [
    (["--resource-name", "notkubernetes.io/fuse"], "reserved for native resources"),
    (["--resource-name", "requests.example.com/fuse"], "is a quota name"),
    (["--resource-name", "example.com/fuse\n"], "must be 1-63 characters"),
    (["--resource-name", "b" * 250 + ".io/fuse"], "at most 244 characters"),
    (["--resource-name", f"{LONG_DOMAIN}/fuse-with-a-long-name"],
     "more than a unix socket path holds (107)"),
    (["--device-plugin-dir", "/" + "d" * 5000], "must be at most 4095 bytes"),
    (["--device-plugin-dir", "/tmp/a,b"], "must not contain a comma"),
    (["--device-plugin-dir", "/tmp/" + "x" * 90], "more than a unix socket path holds"),
    (["--metrics-address", "::g"], "must be an IP address"),
    # Numbers are ASCII digits only: int() would take spaces, signs, underscores and
    # any script's digits (' 5', '+5', '5_0', '\u0661\u0662'), and isdigit() takes '\u00b2'.
    *((["--slots", value], f"must be a whole number from 1 to 100000, got {value!r}")
      for value in (" 5", "5 ", "5\n", "+5", "5_0", "\u0661\u0662", "\u00b2")),
    *((["--metrics-port", value], f"must be a TCP port from 0 to 65535, got {value!r}")
      for value in (" 80", "80\n", "+80", "8_0", "\u0668\u0660", "\u00b2", "65536")),
    *(([flag, "9" * 5000], f"got '{'9' * 100}'... (5000 characters)")
      for flag in ("--slots", "--metrics-port")),
]


def serve(args: list[str] | list[bytes], env: dict[str, str] | None = None
          ) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "fuse_plugin", "serve", *args],
                          capture_output=True, text=True, timeout=30, check=False,
                          env={**os.environ, **(env or {})})


def assert_one_line_usage_error(result: subprocess.CompletedProcess[str], message: str) -> None:
    assert result.returncode == 2, result.stderr
    assert message in result.stderr, result.stderr
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize(("args", "message"), BAD_SERVE_ARGS)
def test_bad_serve_flag_is_one_line(args: list[str], message: str) -> None:
    assert_one_line_usage_error(serve(args), message)


@pytest.mark.parametrize(("args", "message"), BAD_SERVE_ARGS)
def test_bad_environment_twin_is_one_line(args: list[str], message: str) -> None:
    flag, value = args
    env = {"FUSE_DEVICE_PLUGIN_" + flag.lstrip("-").replace("-", "_").upper(): value}
    assert_one_line_usage_error(serve([], env), message)


def test_non_utf8_device_plugin_dir_is_one_line() -> None:
    result = subprocess.run([sys.executable.encode(), b"-m", b"fuse_plugin", b"serve",
                             b"--device-plugin-dir", b"/tmp/\xff\xfe"],
                            capture_output=True, timeout=30, check=False)
    stderr = result.stderr.decode(errors="replace")
    assert result.returncode == 2, stderr
    assert "must be valid UTF-8" in stderr
    assert len(stderr.strip().splitlines()) == 1
    assert "Traceback" not in stderr


# -- the kubelet misbehaving ----------------------------------------------------------

def test_storm_of_back_to_back_kubelet_restarts(node: FakeNode, kubelet: KubeletStandIn,
                                                start_plugin: StartPlugin) -> None:
    """A crash-looping kubelet: stop, wipe every socket, start, 200 times without waiting
    (every third time only until our socket is back, so Register is caught mid-call)."""
    plugin = start_plugin()
    kubelet.wait_registered(1)
    ours = node.plugin_dir / SOCKET
    for restart in range(200):
        kubelet.restart()
        if restart % 3 == 0:
            wait_until(node.plugin_dir, ours.exists)
    arrived = kubelet.started_at
    assert kubelet.wait_for(
        lambda: any(r.received >= arrived for r in kubelet.registrations), 10), plugin.log
    kubelet.wait_devices(RESOURCE, healthy(8))
    assert kubelet.allocate(RESOURCE, [["fuse-0"]]).container_responses
    assert rss_mib(plugin.proc.pid) < STORM_RSS_LIMIT_MIB
    assert plugin.proc.poll() is None
    assert "Traceback" not in plugin.log


def test_kubelet_that_never_answers_register(node: FakeNode, start_plugin: StartPlugin) -> None:
    """A kubelet.sock that accepts and never answers: when a real kubelet replaces it,
    the Register in flight is dropped for the new one, not waited out and failed. (A
    dial in the moment between a listener's bind and listen is refused, and the plugin
    logs that UNAVAILABLE and dials again: the real kubelet's socket has the same moment,
    so only a Register that ran out its deadline counts here; the hung listener appears
    by rename, already listening.)"""
    plugin = start_plugin()
    hung = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    hung.bind(str(node.plugin_dir / "hung.sock"))
    hung.listen(8)
    hung.settimeout(10)
    (node.plugin_dir / "hung.sock").rename(node.plugin_dir / "kubelet.sock")
    try:
        conn, _ = hung.accept()  # the plugin's Register connecting
    finally:
        hung.close()
        (node.plugin_dir / "kubelet.sock").unlink()
    with conn, KubeletStandIn(node.plugin_dir) as kubelet:
        kubelet.wait_registered(1)
        kubelet.wait_devices(RESOURCE, healthy(8))
        waited_out = [ln for ln in plugin.log.splitlines()
                      if "register.failed" in ln and "UNAVAILABLE" not in ln]
        assert not waited_out, plugin.log


# -- a second copy of the plugin ------------------------------------------------------

def test_second_instance_leaves_the_live_socket_alone(node: FakeNode, kubelet: KubeletStandIn,
                                                      start_plugin: StartPlugin) -> None:
    port = free_port()
    first = start_plugin()
    kubelet.wait_registered(1)
    ours = node.plugin_dir / SOCKET
    inode = ours.stat().st_ino
    second = start_plugin("--metrics-port", str(port), "--metrics-address", "127.0.0.1")
    wait_for(lambda: "socket.in_use" in second.log, DEADLINE, "the second instance noticing")
    wait_for(lambda: _status(port, "/readyz")[0] == 503, DEADLINE, "the second instance unready")
    assert "another process serves" in get(port, "/readyz")[1]
    assert get(port, "/healthz")[0] == 200
    assert ours.stat().st_ino == inode, second.log
    assert "socket.stale_removed" not in second.log
    assert kubelet.allocate(RESOURCE, [["fuse-0"]]).container_responses
    assert len(kubelet.registrations) == 1
    # The first one goes away (its socket with it): the second takes over.
    assert first.terminate() == 0
    kubelet.wait_registered(2)
    wait_for(lambda: _status(port, "/readyz")[0] == 200, DEADLINE, "the second instance ready")
    kubelet.wait_devices(RESOURCE, healthy(8))


def _status(port: int, path: str) -> tuple[int, str]:
    try:
        return get(port, path)
    except OSError as err:
        return 0, str(err)


_PROBER = """
import json, sys
from tests.lib.probes import get
statuses = []
for _ in range(int(sys.argv[2])):
    try:
        statuses.append(get(int(sys.argv[1]), sys.argv[3])[0])
    except OSError:
        statuses.append(0)
print(json.dumps(statuses))
"""


def _statuses_from_another_process(port: int, path: str, count: int) -> list[int]:
    """``count`` probes, one after another, from a process of their own, as the kubelet
    probes: a probe in this process shares the interpreter lock with the flood's thread
    and can wait milliseconds to send its request after connecting, which no real prober
    does, while the server churns through the flood's connections."""
    result = subprocess.run([sys.executable, "-c", _PROBER, str(port), str(count), path],
                            capture_output=True, text=True, timeout=120, check=True,
                            cwd=Path(__file__).resolve().parents[2])
    statuses: list[int] = json.loads(result.stdout)
    return statuses


# -- the node changing under it --------------------------------------------------------

def test_device_plugin_dir_deleted_and_recreated(node: FakeNode, start_plugin: StartPlugin) -> None:
    plugin = start_plugin()
    with KubeletStandIn(node.plugin_dir) as kubelet:
        kubelet.wait_registered(1)
    for entry in node.plugin_dir.iterdir():
        entry.unlink()
    node.plugin_dir.rmdir()
    wait_for(lambda: "serve.failed" in plugin.log, DEADLINE,
             "the plugin noticing the directory went")
    node.plugin_dir.mkdir()
    with KubeletStandIn(node.plugin_dir) as kubelet:
        kubelet.wait_registered(1)
        kubelet.wait_devices(RESOURCE, healthy(8))
    assert plugin.proc.poll() is None
    assert "Traceback" not in plugin.log


# -- hostile gRPC requests and log injection -----------------------------------------

def test_device_id_with_a_newline_cannot_forge_a_log_line(
        kubelet: KubeletStandIn, start_plugin: StartPlugin) -> None:
    plugin = start_plugin()
    kubelet.wait_registered()
    forged = "fuse-0\nFORGED\tINFO\tallocate"
    with pytest.raises(grpc.RpcError) as refused:
        kubelet.allocate(RESOURCE, [[forged]])
    assert refused.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert plugin.terminate() == 0
    lines = plugin.log.splitlines()
    assert not any(line.startswith("FORGED") for line in lines), plugin.log
    assert sum("allocate.refused" in line for line in lines) == 1


def test_huge_allocate_gets_a_status(kubelet: KubeletStandIn,
                                     start_plugin: StartPlugin) -> None:
    start_plugin(slots=8)
    kubelet.wait_registered()
    request = api.AllocateRequest(container_requests=[
        api.ContainerAllocateRequest(devices_ids=[f"fuse-{i}" for i in range(100_000)])])
    with pytest.raises(grpc.RpcError) as refused:
        kubelet.stub(RESOURCE).Allocate(request, timeout=10)
    assert refused.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert str(refused.value.details()).endswith("fuse-17 and 99982 more")
    assert kubelet.allocate(RESOURCE, [["fuse-1"]]).container_responses


HUGE_ID = "fuse-" + "7" * (3 * 1024 * 1024)  # one 3 MiB device ID
# Longest log line a refusal may write: a bounded ID, ten of them at most, and a reason.
LOG_LINE_LIMIT = 4096


def test_a_3_mib_device_id_is_refused_invalid_argument_with_a_short_log_line(
        kubelet: KubeletStandIn, start_plugin: StartPlugin) -> None:
    """One huge ID once wrote a 6-million-character log line, and the refusal naming it
    outgrew gRPC's metadata limit: RESOURCE_EXHAUSTED instead of INVALID_ARGUMENT."""
    plugin = start_plugin()
    kubelet.wait_registered()
    stub = kubelet.stub(RESOURCE)
    with pytest.raises(grpc.RpcError) as refused:
        stub.Allocate(api.AllocateRequest(container_requests=[
            api.ContainerAllocateRequest(devices_ids=[HUGE_ID])]), timeout=DEADLINE)
    assert refused.value.code() is grpc.StatusCode.INVALID_ARGUMENT, refused.value.details()
    assert "unknown device IDs: fuse-777" in str(refused.value.details())
    assert f"({len(HUGE_ID)} characters)" in str(refused.value.details())
    with pytest.raises(grpc.RpcError) as preferred:
        stub.GetPreferredAllocation(api.PreferredAllocationRequest(container_requests=[
            api.ContainerPreferredAllocationRequest(
                available_deviceIDs=["fuse-0"], must_include_deviceIDs=[HUGE_ID],
                allocation_size=1)]), timeout=DEADLINE)
    assert preferred.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert f"({len(HUGE_ID)} characters)" in str(preferred.value.details())
    assert kubelet.allocate(RESOURCE, [["fuse-1"]]).container_responses
    assert plugin.terminate() == 0
    lines = plugin.log.splitlines()
    refusals = [line for line in lines if "allocate.refused" in line]
    assert len(refusals) == 1
    assert f"({len(HUGE_ID)} characters)" in refusals[0]
    assert max(len(line) for line in lines) <= LOG_LINE_LIMIT


# -- the metrics port under abuse -----------------------------------------------------

@pytest.fixture
def metrics(start_plugin: StartPlugin) -> tuple[PluginProcess, int]:
    port = free_port()
    process = start_plugin("--metrics-port", str(port), "--metrics-address", "127.0.0.1")
    wait_for(lambda: _status(port, "/healthz")[0] == 200, DEADLINE, "the metrics port answering")
    return process, port


def _closed_by_server(conn: socket.socket) -> bool:
    conn.settimeout(30)
    try:
        return conn.recv(1) == b""
    except ConnectionResetError:
        return True


def test_idle_and_half_sent_connections_are_closed(metrics: tuple[PluginProcess, int]) -> None:
    _, port = metrics
    idle = socket.create_connection(("127.0.0.1", port))
    half = socket.create_connection(("127.0.0.1", port))
    half.sendall(b"GET /metrics")  # no version, no line end: the old server waited for ever
    try:
        assert _closed_by_server(idle)
        assert _closed_by_server(half)
    finally:
        idle.close()
        half.close()
    assert _status(port, "/healthz")[0] == 200


class Flood:
    """Issue 20's attack from a thread of its own: ``count`` connections to the port held
    open, each one sending ``prefix`` (nothing: idle; a request with no end: half-sent)
    and re-opened the moment the server closes it, so that the port never has fewer
    such connections than the attacker wants. ``at_full_strength`` is set once all are
    open and the server has had to close one: the port is at its cap."""

    def __init__(self, port: int, count: int, prefix: bytes = b"",
                 source: str = "127.0.0.1") -> None:
        self._port = port
        self._source = source
        self._count = count
        self._prefix = prefix
        self._selector = selectors.DefaultSelector()
        self._stop_read, self._stop_write = socket.socketpair()
        self._selector.register(self._stop_read, selectors.EVENT_READ)
        self.opened = 0
        self.closed_by_server = 0
        self.at_full_strength = threading.Event()
        self._thread = threading.Thread(target=self._attack, daemon=True)

    def __enter__(self) -> Flood:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop_write.send(b"x")
        self._thread.join()
        for key in list(self._selector.get_map().values()):
            self._selector.unregister(key.fileobj)
            cast(socket.socket, key.fileobj).close()
        self._selector.close()
        self._stop_write.close()

    def _open(self) -> None:
        try:
            conn = socket.create_connection(("127.0.0.1", self._port), timeout=DEADLINE,
                                            source_address=(self._source, 0))
            if self._prefix:
                conn.sendall(self._prefix)
        except OSError:
            return  # the next closure tries again
        self._selector.register(conn, selectors.EVENT_READ)
        self.opened += 1

    def _attack(self) -> None:
        for _ in range(self._count):
            self._open()
        while True:
            if self.closed_by_server:
                self.at_full_strength.set()
            for key, _ in self._selector.select():
                if key.fileobj is self._stop_read:
                    return
                conn = cast(socket.socket, key.fileobj)
                try:
                    gone = conn.recv(4096) == b""
                except OSError:
                    gone = True
                if gone:
                    self._selector.unregister(conn)
                    conn.close()
                    self.closed_by_server += 1
                    self._open()


PROBES = 30


def liveness_failure_threshold() -> int:
    """How many failed liveness probes in a row make the kubelet restart the plugin, as
    manifests/plugin-daemonset.yaml sets it."""
    [c] = containers(one(MANIFESTS / "plugin-daemonset.yaml", "DaemonSet"))
    return int(c["livenessProbe"]["failureThreshold"])


@pytest.mark.parametrize("prefix", [b"", b"GET /healthz HTTP/1.0\r\nUser-Agent: x",
                                    b"GET /metr"], ids=["idle", "half-headers", "half-line"])
def test_probes_answer_while_more_connections_than_the_cap_are_held_and_renewed(
        metrics: tuple[PluginProcess, int], prefix: bytes) -> None:
    """Issue 20: 16 idle connections, renewed before they timed out, made most probes
    fail, and three failed probes restart the plugin. Here twice the cap are held and
    every one the server closes is re-opened at once, from the probes' own address (the
    harder case: the port makes room by closing the busiest address's oldest connection,
    so a kubelet probing from the node is never pushed out by a pod's flood). The kubelet
    would never restart the plugin: no run of the DaemonSet's liveness failureThreshold
    failed probes, and nearly all are 200. (On a loaded machine a prober descheduled
    between its connect and its request can, rarely, have its connection closed to make
    room for the flood's: one such probe in 30 was seen with Go builds running beside.)"""
    process, port = metrics
    threads_before = len(os.listdir(f"/proc/{process.proc.pid}/task"))
    with Flood(port, 2 * MAX_CONNECTIONS + 8, prefix) as flood:
        assert flood.at_full_strength.wait(DEADLINE), "the flood never reached the cap"
        answers = _statuses_from_another_process(port, "/healthz", PROBES)
        threads = len(os.listdir(f"/proc/{process.proc.pid}/task"))
    failed = PROBES - answers.count(200)
    threshold = liveness_failure_threshold()
    runs = "".join("x" if a != 200 else "." for a in answers)
    assert "x" * threshold not in runs, f"{failed} of {PROBES} probes got no 200: {answers}"
    assert failed <= PROBES // 10, f"{failed} of {PROBES} probes got no 200: {answers}"
    assert flood.opened > 2 * MAX_CONNECTIONS  # the attack really was over the cap
    # One thread serves them all; the room is for threads gRPC starts lazily (up to 8).
    assert threads <= threads_before + 16
    assert process.proc.poll() is None
    assert "Traceback" not in process.log


def test_a_fresh_probe_drops_the_oldest_idle_connection(
        metrics: tuple[PluginProcess, int]) -> None:
    """Over the cap, the oldest connection is closed to make room, never the newcomer:
    a port full of idle connections still lets a probe in."""
    _, port = metrics
    held = [socket.create_connection(("127.0.0.1", port)) for _ in range(MAX_CONNECTIONS)]
    try:
        assert _status(port, "/healthz")[0] == 200  # the port was full: the probe got in
        assert _closed_by_server(held[0])  # ... in the place of the oldest
        # The probe is answered and gone: one place is free. Nine more connections: one
        # takes it, and each of the eight others closes the oldest left.
        held += [socket.create_connection(("127.0.0.1", port)) for _ in range(9)]
        for conn in held[1:9]:
            assert _closed_by_server(conn)
        for conn in (held[9], held[-1]):  # still open: a request on them is answered
            conn.sendall(b"GET /healthz HTTP/1.0\r\n\r\n")
            conn.settimeout(DEADLINE)
            assert conn.recv(64).startswith(b"HTTP/1.0 200 ")
    finally:
        for conn in held:
            conn.close()


def test_a_late_probe_from_another_address_outlasts_a_flood(
        metrics: tuple[PluginProcess, int]) -> None:
    """Over the cap, the address holding the most loses its oldest connection: a flood
    from one pod pushes out only its own, so a probe from the node gets in even if it is
    slow to send its request (its process not scheduled while the flood runs)."""
    _, port = metrics
    probe = socket.create_connection(("127.0.0.1", port), timeout=DEADLINE)
    try:
        with Flood(port, 2 * MAX_CONNECTIONS + 8, source="127.0.0.2") as flood:
            assert flood.at_full_strength.wait(DEADLINE), "the flood never reached the cap"
            # The oldest connection of all is the probe's: with "close the oldest", the
            # first of these closures would have been it.
            wait_for(lambda: flood.closed_by_server > 2 * MAX_CONNECTIONS, DEADLINE,
                       "the flood pushing out twice the cap")
            probe.sendall(b"GET /healthz HTTP/1.0\r\n\r\n")
            assert probe.recv(64).startswith(b"HTTP/1.0 200 ")
    finally:
        probe.close()


def test_metrics_on_ipv6_loopback(start_plugin: StartPlugin) -> None:
    try:
        with socket.socket(socket.AF_INET6) as probe:
            probe.bind(("::1", 0))
    except OSError:
        pytest.skip("this machine has no IPv6 loopback")
    port = free_port()
    process = start_plugin("--metrics-port", str(port), "--metrics-address", "::1")

    def answers() -> bool:
        try:
            with socket.create_connection(("::1", port), timeout=5) as conn:
                conn.sendall(b"GET /healthz HTTP/1.0\r\n\r\n")
                return conn.recv(64).startswith(b"HTTP/1.0 200")
        except OSError:
            return False

    wait_for(answers, DEADLINE, "the IPv6 metrics port answering")
    assert process.terminate() == 0
    assert "Traceback" not in process.log


def test_loop_rests_while_no_kubelet_is_there(tmp_path: Path) -> None:
    """With no kubelet.sock, Register waits for inotify or the safety net: the loop turns
    a handful of times at start, then sleeps (it once retried without pause, a whole CPU)."""
    settings = Settings(device_plugin_dir=tmp_path, fuse_device=tmp_path / "fuse",
                        log_level="error")
    present = Probe(Health.HEALTHY, "a stand-in for char 10:229")
    turns = 0

    def count() -> bool:
        nonlocal turns
        turns += 1
        return turns > 50

    with plugin.in_background(settings, logs.get(), lambda _path: present) as running:
        assert wait_notified(running.lifecycle.turned, running.lifecycle.owns_socket)
        assert not wait_notified(running.lifecycle.turned, count, 2.0), f"{turns} turns in 2 s"
