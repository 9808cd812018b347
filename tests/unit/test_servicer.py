"""Unit tests of the DevicePlugin RPCs through grpcio-testing's in-process server."""

from __future__ import annotations

import logging
import threading
from collections.abc import Generator
from concurrent import futures
from pathlib import Path
from typing import cast

import grpc
import grpc_testing  # type: ignore[import-untyped]
import pytest

from fuse_plugin.api import api_pb2 as api
from fuse_plugin.demo import make_node
from fuse_plugin.deviceplugin.servicer import FuseServicer, add_to_server
from fuse_plugin.devices import DeviceState, Health, Probe
from fuse_plugin.stats import Stats
from tests.lib.node import FakeNode

SERVICE = api.DESCRIPTOR.services_by_name["DevicePlugin"]
DEVICE = Path("/dev/fuse")


class Device:
    """A FUSE node whose presence the test switches: the RPCs' logic needs no real node
    (and no root to make one); the real node's checks are tested at the end."""

    def __init__(self) -> None:
        self.present = True

    def __call__(self, path: Path) -> Probe:
        if self.present:
            return Probe(Health.HEALTHY, f"{path} is char 10:229")
        return Probe(Health.UNHEALTHY, f"{path} does not exist")


@pytest.fixture
def device() -> Device:
    return Device()


@pytest.fixture
def state(device: Device) -> DeviceState:
    return DeviceState(DEVICE, 4, device)


@pytest.fixture
def stats() -> Stats:
    return Stats()


@pytest.fixture
def server(state: DeviceState, stats: Stats) -> grpc_testing.Server:
    plugin = FuseServicer(state, logging.getLogger("test"), stats)
    return grpc_testing.server_from_dictionary({SERVICE: plugin},
                                               grpc_testing.strict_real_time())


def unary(server: grpc_testing.Server, method: str, request: object
          ) -> tuple[object, grpc.StatusCode, str]:
    rpc = server.invoke_unary_unary(SERVICE.methods_by_name[method], (), request, None)
    response, _, code, details = rpc.termination()
    return response, code, details


def allocate(server: grpc_testing.Server, *containers: list[str]
             ) -> tuple[api.AllocateResponse, grpc.StatusCode, str]:
    request = api.AllocateRequest(container_requests=[
        api.ContainerAllocateRequest(devices_ids=ids) for ids in containers])
    response, code, details = unary(server, "Allocate", request)
    return response, code, details  # type: ignore[return-value]


def test_options_offer_preferred_allocation_and_no_prestart(server: grpc_testing.Server) -> None:
    response, code, _ = unary(server, "GetDevicePluginOptions", api.Empty())
    assert code is grpc.StatusCode.OK
    assert response == api.DevicePluginOptions(get_preferred_allocation_available=True,
                                               pre_start_required=False)


def test_allocate_answers_each_container_with_the_fuse_device(
        server: grpc_testing.Server) -> None:
    response, code, _ = allocate(server, ["fuse-0"], ["fuse-1"])
    assert code is grpc.StatusCode.OK
    assert len(response.container_responses) == 2
    for container in response.container_responses:
        assert list(container.devices) == [api.DeviceSpec(
            container_path="/dev/fuse", host_path=str(DEVICE), permissions="rw")]
        assert not container.mounts
        assert not container.envs
        assert not container.cdi_devices


@pytest.mark.parametrize(("containers", "expected"), [
    ([["fuse-7"]], "unknown device IDs: fuse-7"),
    ([["fuse-0", "gpu-0"]], "unknown device IDs: gpu-0"),
    ([["fuse-1"], ["fuse-1"]], "duplicate device IDs: fuse-1"),
    ([], "empty allocation request"),
    ([[]], "empty allocation request"),
])
def test_allocate_refuses_bad_ids_naming_them(server: grpc_testing.Server,
                                              containers: list[list[str]], expected: str) -> None:
    _, code, details = allocate(server, *containers)
    assert code is grpc.StatusCode.INVALID_ARGUMENT
    assert expected in details


def test_allocate_refuses_unhealthy_ids(server: grpc_testing.Server, state: DeviceState,
                                        device: Device) -> None:
    device.present = False
    assert state.refresh() is not None
    _, code, details = allocate(server, ["fuse-0", "fuse-2"])
    assert code is grpc.StatusCode.INVALID_ARGUMENT
    assert "unhealthy device IDs: fuse-0, fuse-2" in details
    assert "does not exist" in details


def test_preferred_allocation_includes_required_and_picks_from_available(
        server: grpc_testing.Server) -> None:
    request = api.PreferredAllocationRequest(container_requests=[
        api.ContainerPreferredAllocationRequest(
            available_deviceIDs=["fuse-3", "fuse-2", "fuse-1"],
            must_include_deviceIDs=["fuse-3"], allocation_size=2),
        api.ContainerPreferredAllocationRequest(available_deviceIDs=["fuse-0", "fuse-2"],
                                                allocation_size=1)])
    response, code, _ = unary(server, "GetPreferredAllocation", request)
    assert code is grpc.StatusCode.OK
    assert [list(c.deviceIDs) for c in response.container_responses] == [  # type: ignore[attr-defined]
        ["fuse-3", "fuse-1"], ["fuse-0"]]


@pytest.mark.parametrize(("available", "must", "size", "expected"), [
    (["fuse-0"], ["fuse-1"], 1, "not in available_deviceIDs: fuse-1"),
    (["fuse-0"], [], 2, "exceeds the 1 available_deviceIDs"),
    (["fuse-0", "fuse-1"], ["fuse-0", "fuse-1"], 1, "smaller than the 2 must_include"),
])
def test_preferred_allocation_refuses_impossible_requests(
        server: grpc_testing.Server, available: list[str], must: list[str], size: int,
        expected: str) -> None:
    request = api.PreferredAllocationRequest(container_requests=[
        api.ContainerPreferredAllocationRequest(available_deviceIDs=available,
                                                must_include_deviceIDs=must,
                                                allocation_size=size)])
    _, code, details = unary(server, "GetPreferredAllocation", request)
    assert code is grpc.StatusCode.INVALID_ARGUMENT
    assert expected in details


def test_prestart_answers_empty(server: grpc_testing.Server) -> None:
    response, code, _ = unary(server, "PreStartContainer",
                              api.PreStartContainerRequest(devices_ids=["fuse-0"]))
    assert code is grpc.StatusCode.OK
    assert response == api.PreStartContainerResponse()


def _stream(server: grpc_testing.Server) -> Generator[api.ListAndWatchResponse, None, None]:
    rpc = server.invoke_unary_stream(SERVICE.methods_by_name["ListAndWatch"], (),
                                     api.Empty(), None)
    try:
        while True:
            yield rpc.take_response()
    finally:
        rpc.cancel()


def _healths(message: api.ListAndWatchResponse) -> list[str]:
    return [device.health for device in message.devices]


def test_list_and_watch_sends_the_list_then_every_health_change(
        server: grpc_testing.Server, state: DeviceState, device: Device) -> None:
    stream = _stream(server)
    first = next(stream)
    assert [d.ID for d in first.devices] == ["fuse-0", "fuse-1", "fuse-2", "fuse-3"]
    assert _healths(first) == ["Healthy"] * 4
    device.present = False
    state.refresh()
    assert _healths(next(stream)) == ["Unhealthy"] * 4
    device.present = True
    state.refresh()
    assert _healths(next(stream)) == ["Healthy"] * 4
    stream.close()


def test_list_and_watch_ends_when_the_state_closes(server: grpc_testing.Server,
                                                   state: DeviceState) -> None:
    rpc = server.invoke_unary_stream(SERVICE.methods_by_name["ListAndWatch"], (),
                                     api.Empty(), None)
    rpc.take_response()
    done = threading.Event()

    def wait_for_end() -> None:
        rpc.termination()
        done.set()

    threading.Thread(target=wait_for_end, daemon=True).start()
    state.close()
    assert done.wait(5), "ListAndWatch did not end after the state closed"
    assert rpc.termination()[1] is grpc.StatusCode.OK


def test_wrong_device_node_is_unhealthy(tmp_path: Path, node: FakeNode) -> None:
    wrong = tmp_path / "not-fuse"
    make_node(wrong, 195, 0)
    state = DeviceState(wrong, 1)
    assert state.health.value == "Unhealthy"
    assert "195:0, not 10:229" in state.reason


def test_allocations_and_refusals_reach_the_stats(server: grpc_testing.Server,
                                                  stats: Stats) -> None:
    allocate(server, ["fuse-0"], ["fuse-1"])
    allocate(server, ["fuse-9"])
    counts = stats.snapshot()
    assert (counts.allocations, counts.refusals) == (2, 1)


LONG_ID = "fuse-" + "9" * 100_000
LONG_SHOWN = f"{LONG_ID[:64]}... ({len(LONG_ID)} characters)"


def test_allocate_refusal_and_its_log_show_each_id_bounded(
        server: grpc_testing.Server, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="test"):
        _, code, details = allocate(server, [LONG_ID, "gpu-0"])
    assert code is grpc.StatusCode.INVALID_ARGUMENT
    assert details == f"unknown device IDs: {LONG_SHOWN}, gpu-0"
    (record,) = [r for r in caplog.records if r.getMessage() == "allocate.refused"]
    fields = record.fields  # type: ignore[attr-defined]
    assert fields["ids"] == [LONG_SHOWN, "gpu-0"]
    assert fields["count"] == 2


def test_preferred_allocation_refusal_shows_each_id_bounded(
        server: grpc_testing.Server) -> None:
    request = api.PreferredAllocationRequest(container_requests=[
        api.ContainerPreferredAllocationRequest(available_deviceIDs=["fuse-0"],
                                                must_include_deviceIDs=[LONG_ID, "x"],
                                                allocation_size=2)])
    _, code, details = unary(server, "GetPreferredAllocation", request)
    assert code is grpc.StatusCode.INVALID_ARGUMENT
    assert details == f"must_include_deviceIDs not in available_deviceIDs: {LONG_SHOWN}, x"


@pytest.mark.parametrize("odd", ["fuse-\N{SUPERSCRIPT TWO}", "fuse-" + "9" * 5000,
                                 "fuse--1", "gpu-0", ""])
def test_preferred_allocation_ranks_ids_that_are_not_ours_last(server: grpc_testing.Server,
                                                               odd: str) -> None:
    request = api.PreferredAllocationRequest(container_requests=[
        api.ContainerPreferredAllocationRequest(available_deviceIDs=[odd, "fuse-3", "fuse-1"],
                                                allocation_size=2)])
    response, code, details = unary(server, "GetPreferredAllocation", request)
    assert code is grpc.StatusCode.OK, details
    assert list(response.container_responses[0].deviceIDs) == [  # type: ignore[attr-defined]
        "fuse-1", "fuse-3"]


# -- Allocate off the wire: what the kubelet's socket really calls ----------------------

@pytest.fixture
def wire(tmp_path: Path, state: DeviceState, stats: Stats
         ) -> Generator[tuple[FuseServicer, grpc.UnaryUnaryMultiCallable[bytes, bytes]],
                        None, None]:
    """The servicer behind a real gRPC server on a unix socket, called with raw bytes."""
    plugin = FuseServicer(state, logging.getLogger("test"), stats)
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    add_to_server(plugin, server)
    server.add_insecure_port(f"unix://{tmp_path / 'plugin.sock'}")
    server.start()
    channel = grpc.insecure_channel(f"unix://{tmp_path / 'plugin.sock'}")
    try:
        yield plugin, channel.unary_unary(f"/{SERVICE.full_name}/Allocate")
    finally:
        channel.close()
        server.stop(None)


def _request(*containers: list[str]) -> bytes:
    return api.AllocateRequest(container_requests=[
        api.ContainerAllocateRequest(devices_ids=ids) for ids in containers]).SerializeToString()


def test_the_usual_request_gets_what_allocate_answers(
        wire: tuple[FuseServicer, grpc.UnaryUnaryMultiCallable[bytes, bytes]],
        stats: Stats) -> None:
    plugin, call = wire
    # One container asking for one slot, as any protobuf encoder (Go's too) writes it:
    # field 1 (container_requests) holding field 1 (devices_ids) holding the ID.
    by_hand = b"\x0a\x08\x0a\x06fuse-3"
    assert by_hand == _request(["fuse-3"])
    context = cast(grpc.ServicerContext, None)  # only a refusal would use it
    expected = plugin.Allocate(api.AllocateRequest.FromString(by_hand), context
                               ).SerializeToString()
    assert call(by_hand, timeout=10) == expected
    assert api.AllocateResponse.FromString(expected).container_responses[0].devices[0] == \
        api.DeviceSpec(container_path="/dev/fuse", host_path=str(DEVICE), permissions="rw")
    assert stats.snapshot().allocations == 2  # ours above, and the wire's


@pytest.mark.parametrize(("containers", "expected"), [
    ([["fuse-0"], ["fuse-1"]], None),
    ([["fuse-0", "fuse-1"]], None),
    ([["fuse-7"]], "unknown device IDs: fuse-7"),
    ([["fuse-1"], ["fuse-1"]], "duplicate device IDs: fuse-1"),
    ([], "empty allocation request"),
])
def test_other_requests_off_the_wire_get_allocates_checks(
        wire: tuple[FuseServicer, grpc.UnaryUnaryMultiCallable[bytes, bytes]],
        containers: list[list[str]], expected: str | None) -> None:
    _, call = wire
    if expected is None:
        answer = api.AllocateResponse.FromString(call(_request(*containers), timeout=10))
        assert len(answer.container_responses) == len(containers)
        return
    with pytest.raises(grpc.RpcError) as refused:
        call(_request(*containers), timeout=10)
    assert refused.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert expected in (refused.value.details() or "")


def test_the_usual_request_is_refused_while_the_device_is_unhealthy(
        wire: tuple[FuseServicer, grpc.UnaryUnaryMultiCallable[bytes, bytes]],
        state: DeviceState, device: Device) -> None:
    _, call = wire
    device.present = False
    assert state.refresh() is not None
    with pytest.raises(grpc.RpcError) as refused:
        call(_request(["fuse-0"]), timeout=10)
    assert refused.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert "unhealthy device IDs: fuse-0 (/dev/fuse does not exist)" in (
        refused.value.details() or "")


def test_bytes_that_do_not_parse_are_an_invalid_argument(
        wire: tuple[FuseServicer, grpc.UnaryUnaryMultiCallable[bytes, bytes]],
        stats: Stats) -> None:
    _, call = wire
    with pytest.raises(grpc.RpcError) as refused:
        call(b"\x0a\xff\xff", timeout=10)
    assert refused.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert "does not parse" in (refused.value.details() or "")
    assert stats.snapshot().refusals == 1


def test_a_3_mib_id_off_the_wire_is_an_invalid_argument(
        wire: tuple[FuseServicer, grpc.UnaryUnaryMultiCallable[bytes, bytes]]) -> None:
    """The refusal travels in a header gRPC caps at 16 KiB: naming the whole ID made it
    RESOURCE_EXHAUSTED, which tells the kubelet nothing about what was wrong."""
    _, call = wire
    huge = "fuse-" + "7" * (3 * 1024 * 1024)
    with pytest.raises(grpc.RpcError) as refused:
        call(_request([huge]), timeout=10)
    assert refused.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert refused.value.details() == (
        f"unknown device IDs: {huge[:64]}... ({len(huge)} characters)")
