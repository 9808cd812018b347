"""The DevicePlugin RPCs the kubelet calls on our socket.

Follow an Allocate from the socket to the response here: ``add_to_server`` hands its
bytes to ``FuseServicer.allocate_wire``; the kubelet's usual request (one container, one
slot) is answered from a table, anything else is parsed and ``Allocate`` checks every ID
against ``DeviceState`` and answers each container with the same DeviceSpec for the FUSE
node. Nothing here does I/O or waits on anything but the state's condition, so Allocate
can never block.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator
from typing import Any, NoReturn

import grpc
from google.protobuf.message import DecodeError

from fuse_plugin import logs
from fuse_plugin.allocation import Grant
from fuse_plugin.api import api_pb2 as api
from fuse_plugin.api import api_pb2_grpc
from fuse_plugin.devices import DeviceState, Health
from fuse_plugin.stats import Stats

SERVICE = api.DESCRIPTOR.services_by_name["DevicePlugin"].full_name  # v1beta1.DevicePlugin
# The kubelet opens one ListAndWatch stream per registration. The sync gRPC server gives
# each stream a worker thread, so streams are capped below the pool size: unary calls
# (Allocate above all) always find a free worker.
MAX_STREAMS = 16
WORKERS = MAX_STREAMS + 8
# A refusal names at most this many IDs: a status detail travels in a header that gRPC
# caps at 16 KiB, and a request naming 100,000 bad IDs must still get its answer.
MAX_NAMED = 10
# ...and shows at most this many characters of each: a 3 MiB ID would make a 6-million-
# character log line and a refusal too big for that header (RESOURCE_EXHAUSTED instead
# of INVALID_ARGUMENT). Our own IDs are "fuse-<index>", far shorter.
MAX_ID_SHOWN = 64


class FuseServicer(api_pb2_grpc.DevicePluginServicer):
    """Answers the kubelet from ``DeviceState``; responses are prebuilt where they can be."""

    def __init__(self, state: DeviceState, log: logging.Logger, stats: Stats,
                 grant: Grant | None = None) -> None:
        self._state = state
        self._log = log
        self._stats = stats
        self._streams = 0
        self._streams_lock = threading.Lock()
        # Both possible device lists are built once: building one in Python costs many
        # times serialising it, and grows with --slots (bench/README.md, "Slots").
        self._lists = {
            health: api.ListAndWatchResponse(
                devices=[api.Device(ID=i, health=health.value) for i in state.ids])
            for health in Health
        }
        # Every container gets the same answer (allocation.Grant decides what it holds).
        self._container = (grant or Grant(state.device)).response()
        # The kubelet sends one Allocate per container, and a pod asks for one slot: the
        # exact bytes of every such request, mapped to its slot (memory per slot: bench/).
        self._usual = {
            api.AllocateRequest(container_requests=[api.ContainerAllocateRequest(
                devices_ids=[i])]).SerializeToString(): i for i in state.ids}
        self._usual_answer = api.AllocateResponse(
            container_responses=[self._container]).SerializeToString()

    @property
    def open_streams(self) -> int:
        return self._streams

    def GetDevicePluginOptions(self, request: api.Empty, context: grpc.ServicerContext
                               ) -> api.DevicePluginOptions:
        return api.DevicePluginOptions(pre_start_required=False,
                                       get_preferred_allocation_available=True)

    def ListAndWatch(self, request: api.Empty, context: grpc.ServicerContext
                     ) -> Iterator[api.ListAndWatchResponse]:
        with self._streams_lock:
            if self._streams >= MAX_STREAMS:
                context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                              f"at most {MAX_STREAMS} ListAndWatch streams may be open")
            self._streams += 1
        context.add_callback(self._state.wake)
        try:
            version, health = self._state.snapshot()
            logs.event(self._log, "listandwatch.open", health=health.value,
                       slots=len(self._state.ids), streams=self._streams)
            yield self._lists[health]
            while True:
                seen = version
                version, health = self._state.wait_for_change(
                    seen, stop=lambda: not context.is_active())
                if version == seen:  # closed, or the kubelet went away
                    break
                yield self._lists[health]
        finally:
            with self._streams_lock:
                self._streams -= 1
            logs.event(self._log, "listandwatch.closed", streams=self._streams)

    def GetPreferredAllocation(self, request: api.PreferredAllocationRequest,
                               context: grpc.ServicerContext) -> api.PreferredAllocationResponse:
        responses = []
        for container in request.container_requests:
            size = container.allocation_size
            must = list(dict.fromkeys(container.must_include_deviceIDs))
            if size < len(must):
                context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                              f"allocation_size {size} is smaller than the "
                              f"{len(must)} must_include_deviceIDs")
            available = set(container.available_deviceIDs)
            missing = [i for i in must if i not in available]
            if missing:
                context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                              f"must_include_deviceIDs not in available_deviceIDs: "
                              f"{_some(missing)}")
            chosen = set(must)
            # Lowest slots first, so allocations pack and the list is deterministic.
            extra = sorted((i for i in available if i not in chosen), key=self._slot_order)
            picked = must + extra[:size - len(must)]
            if len(picked) < size:
                context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                              f"allocation_size {size} exceeds the "
                              f"{len(available)} available_deviceIDs")
            responses.append(api.ContainerPreferredAllocationResponse(deviceIDs=picked))
        return api.PreferredAllocationResponse(container_responses=responses)

    def allocate_wire(self, request: bytes, context: grpc.ServicerContext) -> bytes:
        """Allocate as it comes off the wire: bytes in, bytes out.

        Parsing the request, walking its IDs and building the answer cost about a tenth
        of the CPU of an Allocate (gRPC's own work is the rest): a table lookup and a
        prebuilt answer put the usual request at the cost of a server that answers
        constants. What the table does not hold, or any request while the device is
        unhealthy, goes through ``Allocate`` and its checks.
        """
        slot = self._usual.get(request)
        if slot is None or self._state.health is not Health.HEALTHY:
            try:
                parsed = api.AllocateRequest.FromString(request)
            except DecodeError:
                self._refuse(context, "the AllocateRequest does not parse", [])
            return self.Allocate(parsed, context).SerializeToString()
        self._stats.allocated(1)
        if self._log.isEnabledFor(logging.DEBUG):
            self._audit(1, [slot])
        return self._usual_answer

    def Allocate(self, request: api.AllocateRequest, context: grpc.ServicerContext
                 ) -> api.AllocateResponse:
        containers = request.container_requests
        ids = [i for container in containers for i in container.devices_ids]
        if not containers or any(not c.devices_ids for c in containers):
            self._refuse(context, "empty allocation request: every container request "
                         "must name at least one device ID", ids)
        problems = self._state.problems(ids)
        if problems:
            detail = "; ".join(f"{kind} device IDs: {_some(found)}"
                               for kind, found in problems.items())
            if "unhealthy" in problems:
                detail += f" ({self._state.reason})"
            self._refuse(context, detail, ids)
        self._stats.allocated(len(containers))
        if self._log.isEnabledFor(logging.DEBUG):
            self._audit(len(containers), ids)
        return api.AllocateResponse(container_responses=[self._container] * len(containers))

    def _audit(self, containers: int, ids: list[str]) -> None:
        """The allocation trail, at DEBUG: at INFO it cost more than the rest of Allocate,
        and the kubelet keeps which pod holds which ID in its checkpoint anyway.
        ``--log-level debug`` turns it on."""
        logs.event(self._log, "allocate", logging.DEBUG, containers=containers, ids=ids,
                   host_path=str(self._state.device))

    def PreStartContainer(self, request: api.PreStartContainerRequest,
                          context: grpc.ServicerContext) -> api.PreStartContainerResponse:
        return api.PreStartContainerResponse()

    def _refuse(self, context: grpc.ServicerContext, detail: str, ids: list[str]) -> NoReturn:
        self._stats.refused()
        logs.event(self._log, "allocate.refused", logging.WARNING,
                   ids=[_shown(i) for i in ids[:MAX_NAMED]], count=len(ids), reason=detail)
        context.abort(grpc.StatusCode.INVALID_ARGUMENT, detail)

    def _slot_order(self, device_id: str) -> tuple[int, str]:
        """Our slots in index order; an ID that is not ours sorts after them, by name."""
        return self._state.order.get(device_id, len(self._state.order)), device_id


def add_to_server(servicer: FuseServicer, server: grpc.Server) -> None:
    """Serve ``servicer`` as ``v1beta1.DevicePlugin``.

    What the generated ``add_DevicePluginServicer_to_server`` does, except that Allocate
    gets its request as bytes (``allocate_wire``), and that only the generic handler is
    added: the floor we measure against does the same, and the registered-method path
    gained nothing here.
    """
    handlers: dict[str, grpc.RpcMethodHandler[Any, Any]] = {
        "GetDevicePluginOptions": grpc.unary_unary_rpc_method_handler(
            servicer.GetDevicePluginOptions, api.Empty.FromString,
            api.DevicePluginOptions.SerializeToString),
        "ListAndWatch": grpc.unary_stream_rpc_method_handler(
            servicer.ListAndWatch, api.Empty.FromString,
            api.ListAndWatchResponse.SerializeToString),
        "GetPreferredAllocation": grpc.unary_unary_rpc_method_handler(
            servicer.GetPreferredAllocation, api.PreferredAllocationRequest.FromString,
            api.PreferredAllocationResponse.SerializeToString),
        "Allocate": grpc.unary_unary_rpc_method_handler(servicer.allocate_wire),
        "PreStartContainer": grpc.unary_unary_rpc_method_handler(
            servicer.PreStartContainer, api.PreStartContainerRequest.FromString,
            api.PreStartContainerResponse.SerializeToString),
    }
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler(SERVICE, handlers),))


def _shown(device_id: str) -> str:
    """An ID as a refusal or a log line shows it: whole if short, else its first
    ``MAX_ID_SHOWN`` characters and its length, so that any request gets its answer
    and its log line stays a line."""
    if len(device_id) <= MAX_ID_SHOWN:
        return device_id
    return f"{device_id[:MAX_ID_SHOWN]}... ({len(device_id)} characters)"


def _some(ids: list[str]) -> str:
    """At most ``MAX_NAMED`` IDs, each bounded, and how many more there were."""
    shown = ", ".join(_shown(i) for i in ids[:MAX_NAMED])
    return shown if len(ids) <= MAX_NAMED else f"{shown} and {len(ids) - MAX_NAMED} more"
