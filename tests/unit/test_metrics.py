"""Metrics and probes of the real ``serve`` process, scraped over HTTP."""

from __future__ import annotations

import logging
import signal
import socket
import threading
from collections.abc import Iterator
from http import HTTPStatus
from pathlib import Path
from typing import cast

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from fuse_plugin import http_port
from fuse_plugin.deviceplugin import metrics
from fuse_plugin.deviceplugin.lifecycle import Lifecycle
from fuse_plugin.errors import Failure
from fuse_plugin.http_port import TEXT, Answer, HttpPort
from fuse_plugin.stats import Stats
from tests.lib.kubelet import KubeletStandIn
from tests.lib.node import FakeNode
from tests.lib.plugin import RESOURCE, PluginProcess, StartPlugin
from tests.lib.probes import DEADLINE, get
from tests.lib.servers import free_port
from tests.lib.waiting import wait_for


def metric(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} not in the scrape:\n{text}")


@pytest.fixture
def plugin(start_plugin: StartPlugin) -> tuple[PluginProcess, int]:
    port = free_port()
    process = start_plugin("--metrics-port", str(port), "--metrics-address", "127.0.0.1",
                           slots=4)
    wait_for(lambda: _answers(port), DEADLINE, "the metrics port answering")
    return process, port


def _answers(port: int) -> bool:
    try:
        return get(port, "/healthz")[0] == 200
    except OSError:
        return False


def test_probes_follow_registration_and_device_health(node: FakeNode,
                                                      plugin: tuple[PluginProcess, int]) -> None:
    _, port = plugin
    # Serving but no kubelet yet: alive, not ready.
    wait_for(lambda: get(port, "/readyz") == (503, "not registered with the kubelet\n"), DEADLINE,
               "readyz saying it is not registered")
    assert get(port, "/healthz")[0] == 200
    with KubeletStandIn(node.plugin_dir) as kubelet:
        kubelet.wait_registered()
        wait_for(lambda: get(port, "/readyz")[0] == 200, DEADLINE, "readyz turning 200")
        node.remove_device()
        wait_for(lambda: get(port, "/readyz")[0] == 503, DEADLINE, "readyz turning 503")
        assert "device unhealthy" in get(port, "/readyz")[1]
        assert get(port, "/healthz")[0] == 200
        node.restore_device()
        wait_for(lambda: get(port, "/readyz")[0] == 200, DEADLINE, "readyz back to 200")
    # The kubelet went away (its socket deleted): no longer ready, still alive.
    wait_for(lambda: get(port, "/readyz")[0] == 503, DEADLINE, "readyz after the kubelet left")
    assert get(port, "/healthz")[0] == 200
    assert get(port, "/nope")[0] == 404


def test_metrics_count_real_registrations_and_allocates(
        node: FakeNode, kubelet: KubeletStandIn, plugin: tuple[PluginProcess, int]) -> None:
    _, port = plugin
    kubelet.wait_registered(1)
    # A kubelet that dies before its answer reaches us leaves a Register we cannot count.
    wait_for(lambda: metric(get(port, "/metrics")[1],
                            "fuse_device_plugin_registrations_total") == 1,
             DEADLINE, "registration")
    kubelet.restart()
    kubelet.wait_registered(2)
    kubelet.wait_devices(RESOURCE, lambda d: len(d) == 4)
    kubelet.allocate(RESOURCE, [["fuse-0"], ["fuse-1"]])
    kubelet.allocate(RESOURCE, [["fuse-2"]])
    with pytest.raises(grpc.RpcError):
        kubelet.allocate(RESOURCE, [["fuse-9"]])
    # The kubelet can use us before our side has read its answer to Register.
    wait_for(lambda: metric(get(port, "/metrics")[1],
                            "fuse_device_plugin_registrations_total") == 2,
             DEADLINE, "two registrations")
    code, text = get(port, "/metrics")
    assert code == 200
    assert metric(text, "fuse_device_plugin_registered") == 1
    assert metric(text, "fuse_device_plugin_kubelet_restarts_total") == 1
    assert metric(text, "fuse_device_plugin_allocations_total") == 3
    assert metric(text, "fuse_device_plugin_allocate_refusals_total") == 1
    assert 'fuse_device_plugin_slots{health="Healthy"} 4.0' in text
    assert 'fuse_device_plugin_slots{health="Unhealthy"} 0.0' in text
    assert metric(text, "fuse_device_plugin_listandwatch_streams") == 1
    assert metric(text, "fuse_device_plugin_registration_failures_total") == 0


def test_metrics_port_in_use_is_a_clear_error(start_plugin: StartPlugin) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        process = start_plugin("--metrics-port", str(port), "--metrics-address", "127.0.0.1")
        assert process.proc.wait(30) == 1
    assert f"cannot serve metrics on 127.0.0.1:{port}: Address already in use" in process.log
    assert "Traceback" not in process.log


@pytest.mark.parametrize("address", ["127.0.0.1", "::1"])
def test_a_port_in_use_names_the_address_as_a_url_would(address: str) -> None:
    """The plugin's, the broker's and the DRA driver's ports say it alike; an IPv6
    address in brackets, or ``::1:8080`` reads as an address without a port (the
    broker's and the driver's messages did not bracket it)."""
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    with socket.socket(family) as taken:
        try:
            taken.bind((address, 0))
        except OSError:
            pytest.skip(f"no {address} here")
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(Failure) as failure, \
                http_port.serving({}, address, port, name="metrics",
                                  log=logging.getLogger("test")):
            pass
    shown = f"[{address}]" if ":" in address else address
    assert str(failure.value) == f"cannot serve metrics on {shown}:{port}: " \
        "Address already in use"


@pytest.mark.parametrize("stop", [signal.SIGTERM, signal.SIGHUP])
def test_cdi_spec_written_allocate_names_it_and_removed_on_stop(
        node: FakeNode, kubelet: KubeletStandIn, start_plugin: StartPlugin,
        stop: signal.Signals) -> None:
    cdi_dir = node.root / "cdi"
    plugin = start_plugin("--cdi", "--cdi-dir", str(cdi_dir))
    kubelet.wait_registered()
    spec = cdi_dir / "github.com-fuse.json"
    assert spec.exists(), plugin.log
    response = kubelet.allocate(RESOURCE, [["fuse-0"]])
    container = response.container_responses[0]
    assert [d.name for d in container.cdi_devices] == ["github.com/fuse=fuse"]
    assert container.devices[0].container_path == "/dev/fuse"
    plugin.proc.send_signal(stop)
    assert plugin.proc.wait(10) == 0
    assert not spec.exists()
    assert list(cdi_dir.iterdir()) == []
    assert not (node.plugin_dir / "github.com_fuse.sock").exists()
    assert f"signal={stop.name}" in plugin.log


def test_scrape_parses_with_the_reference_parser(
        kubelet: KubeletStandIn, plugin: tuple[PluginProcess, int]) -> None:
    """The text format is written by hand; prometheus-client's own parser must read it."""
    _, port = plugin
    kubelet.wait_registered(1)
    kubelet.allocate(RESOURCE, [["fuse-0"]])
    families = {f.name: f for f in text_string_to_metric_families(get(port, "/metrics")[1])}
    kinds = {name: family.type for name, family in families.items()}
    assert kinds == {
        "fuse_device_plugin_registered": "gauge", "fuse_device_plugin_slots": "gauge",
        "fuse_device_plugin_listandwatch_streams": "gauge",
        "fuse_device_plugin_allocations": "counter",
        "fuse_device_plugin_allocate_refusals": "counter",
        "fuse_device_plugin_kubelet_restarts": "counter",
        "fuse_device_plugin_registrations": "counter",
        "fuse_device_plugin_registration_failures": "counter"}
    assert families["fuse_device_plugin_allocations"].samples[0].value == 1


def _wakeups(thread_id: int) -> int:
    status = Path(f"/proc/self/task/{thread_id}/status").read_text()
    return sum(int(line.split()[1]) for line in status.splitlines()
               if "ctxt_switches:" in line)


def _waiting_in_epoll(thread_id: int) -> bool:
    """Asleep in epoll_wait, where an idle selector loop rests (the kernel's wait channel;
    where it hides that, plain "sleeping")."""
    task = Path(f"/proc/self/task/{thread_id}")
    channel = (task / "wchan").read_text()
    if channel not in ("", "0"):
        return "epoll" in channel
    return (task / "stat").read_text().rsplit(")", 1)[1].split()[0] == "S"


def test_an_idle_metrics_port_never_wakes_and_stops_at_once() -> None:
    """http.server's serve_forever polls twice a second; on every node, all day, that
    was a third of the plugin's own idle CPU. Our loop waits on the socket and a pipe."""
    lifecycle = cast(Lifecycle, None)  # the idle server never calls it; /nope neither
    with metrics.serving(lifecycle, Stats(), "127.0.0.1", 0, logging.getLogger("test")
                         ) as server:
        assert get(server.port, "/nope")[0] == 404  # serving
        thread = next(t for t in threading.enumerate() if t.name == "metrics")
        assert thread.native_id is not None
        thread_id = thread.native_id
        # The thread that wrote the answer closes the connection after it: settled once
        # it is back waiting in epoll.
        wait_for(lambda: _waiting_in_epoll(thread_id), DEADLINE, "the metrics thread settling")
        before = _wakeups(thread_id)
        threading.Event().wait(1.2)  # an observation window, not a synchronisation
        assert _wakeups(thread_id) == before
    # Leaving the block joined the thread: returning at all is the check.
    assert not thread.is_alive()


@pytest.mark.parametrize(("request_bytes", "status"), [
    (b"GET /healthz HTTP/1.1\r\nHost: x\r\nUser-Agent: kube-probe/1.30\r\n\r\n", b"200"),
    (b"GET /metrics?name[]=x HTTP/1.0\r\n\r\n", b"200"),
    (b"POST /metrics HTTP/1.0\r\nContent-Length: 0\r\n\r\n", b"405"),
    (b"HEAD /healthz HTTP/1.0\r\n\r\n", b"405"),
    (b"hello\r\n\r\n", b"400"),
    (b"GET /" + b"x" * 9000 + b" HTTP/1.0\r\n\r\n", b"400"),
])
def test_the_port_answers_requests_as_a_probe_would_send_them(
        plugin: tuple[PluginProcess, int], request_bytes: bytes, status: bytes) -> None:
    _, port = plugin
    with socket.create_connection(("127.0.0.1", port), timeout=10) as conn:
        conn.sendall(request_bytes)
        reply = b""
        while chunk := conn.recv(65536):  # the server closes after one answer
            reply += chunk
    head, _, body = reply.partition(b"\r\n\r\n")
    assert head.split(b"\r\n")[0].startswith(b"HTTP/1.0 " + status + b" ")
    assert f"Content-Length: {len(body)}".encode() in head


# -- the serving core on its own (fuse_plugin.http_port), as the broker will use it -------

def _exchange(port: int, request: bytes, shut: bool = False) -> bytes:
    """Send ``request`` (then half-close if ``shut``) and read until the server closes."""
    with socket.create_connection(("127.0.0.1", port), timeout=DEADLINE) as conn:
        conn.sendall(request)
        if shut:
            conn.shutdown(socket.SHUT_WR)
        reply = b""
        while chunk := conn.recv(65536):
            reply += chunk
    return reply


@pytest.fixture
def port_with_routes() -> Iterator[tuple[HttpPort, dict[str, int]]]:
    calls = {"big": 0}
    big = b"x" * (16 * 1024 * 1024)  # far more than a socket buffer holds

    def ok() -> Answer:
        return HTTPStatus.OK, b"fine\n", TEXT

    def broken() -> Answer:
        raise RuntimeError("a bug in a route")

    def large() -> Answer:
        calls["big"] += 1
        return HTTPStatus.OK, big, "application/octet-stream"

    server = HttpPort({"/ok": ok, "/broken": broken, "/big": large}, "127.0.0.1", 0,
                      name="test-port").start()
    try:
        yield server, calls
    finally:
        server.stop()


def test_the_core_serves_any_routes_and_lists_them_on_404(
        port_with_routes: tuple[HttpPort, dict[str, int]]) -> None:
    server, _ = port_with_routes
    reply = _exchange(server.port, b"GET /ok?x=1 HTTP/1.1\r\nHost: x\r\n\r\n")
    assert reply == (b"HTTP/1.0 200 OK\r\nContent-Type: text/plain; charset=utf-8\r\n"
                     b"Content-Length: 5\r\n\r\nfine\n")
    assert _exchange(server.port, b"GET /nope HTTP/1.0\r\n\r\n").endswith(
        b"\r\n\r\ntry /ok, /broken or /big\n")


def test_a_route_that_raises_is_a_500_and_one_log_line(
        port_with_routes: tuple[HttpPort, dict[str, int]],
        caplog: pytest.LogCaptureFixture) -> None:
    server, _ = port_with_routes
    with caplog.at_level(logging.WARNING, logger="fuse_plugin"):
        reply = _exchange(server.port, b"GET /broken HTTP/1.0\r\n\r\n")
        assert reply.startswith(b"HTTP/1.0 500 Internal Server Error\r\n")
        assert _exchange(server.port, b"GET /ok HTTP/1.0\r\n\r\n").startswith(
            b"HTTP/1.0 200 ")  # the port lives on
    (record,) = [r for r in caplog.records if r.getMessage() == "test-port.error"]
    assert "a bug in a route" in record.fields["error"]  # type: ignore[attr-defined]


@pytest.mark.parametrize(("request_bytes", "status"), [
    (b"GET /ok HTTP/1.0\r\n", b"200"),  # headers never ended: answered on what came
    (b"GET /ok", b"400"),  # no version
])
def test_a_client_that_half_closes_is_answered_on_what_it_sent(
        port_with_routes: tuple[HttpPort, dict[str, int]], request_bytes: bytes,
        status: bytes) -> None:
    server, _ = port_with_routes
    reply = _exchange(server.port, request_bytes, shut=True)
    assert reply.startswith(b"HTTP/1.0 " + status + b" ")


@pytest.mark.parametrize("request_bytes", [
    b"GET /ok HTTP/1.0\r\n" + b"X-A: b\r\n" * 101 + b"\r\n",  # too many headers
    b"GET /ok HTTP/1.0\r\nX-A: " + b"b" * 9000 + b"\r\n\r\n",  # a header too long
    b"GET /ok HTTP/1.0\r\nX-A: " + b"b" * 20000,  # ... and never ended
])
def test_a_request_head_over_the_bounds_is_a_400(
        port_with_routes: tuple[HttpPort, dict[str, int]], request_bytes: bytes) -> None:
    server, _ = port_with_routes
    assert _exchange(server.port, request_bytes).startswith(b"HTTP/1.0 400 ")


def test_a_client_that_does_not_read_its_answer_blocks_nobody(
        port_with_routes: tuple[HttpPort, dict[str, int]]) -> None:
    """Answers are written without blocking: while 16 MiB wait for a reader that does not
    read, the port answers others; the slow reader still gets every byte."""
    server, calls = port_with_routes
    with socket.create_connection(("127.0.0.1", server.port), timeout=DEADLINE) as slow:
        slow.sendall(b"GET /big HTTP/1.0\r\n\r\n")
        wait_for(lambda: calls["big"] == 1, DEADLINE, "the large answer being made")
        for _ in range(5):
            assert _exchange(server.port, b"GET /ok HTTP/1.0\r\n\r\n").startswith(
                b"HTTP/1.0 200 ")
        reply = b""
        while chunk := slow.recv(1 << 20):
            reply += chunk
    head, _, body = reply.partition(b"\r\n\r\n")
    assert b"Content-Length: 16777216" in head
    assert len(body) == 16 * 1024 * 1024


def test_stop_returns_with_a_connection_open_and_closes_it() -> None:
    """stop() does not wait for clients: the thread ends, every socket is closed."""
    server = HttpPort({}, "127.0.0.1", 0).start()
    port = server.port
    idle = socket.create_connection(("127.0.0.1", port), timeout=DEADLINE)
    try:
        assert _exchange(port, b"GET / HTTP/1.0\r\n\r\n").endswith(b"\r\n\r\nnot found\n")
        server.stop()
        assert idle.recv(1) == b""
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection(("127.0.0.1", port), timeout=DEADLINE).close()
    finally:
        idle.close()
