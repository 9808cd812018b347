"""A kubelet stand-in that speaks the real device-plugin wire protocol on real sockets.

The kubelet of ``fuse-device-plugin demo``; the tests and the benchmarks use it too
(``tests/lib/kubelet.py`` adds their hooks). It keeps the device manager's books the way
kubelet 1.37.2 keeps them (``pkg/kubelet/cm/devicemanager``), because what a plugin may
do during a restart or a rollout depends on exactly those books:

- ``Registration`` on ``<dir>/kubelet.sock``. Register checks the version and resource
  name, records a client for the endpoint's path (``plugin/v1beta1/handler.go``,
  ``registerClient``), dials it and calls GetDevicePluginOptions *before* answering
  (``PluginConnected``; a plugin that blocks its only worker in Register deadlocks
  here), then runs ListAndWatch on a thread of its own (``runClient``).
- Endpoints are kept per resource *and per socket path* (``endpointStore``): a second
  plugin for the same resource on another socket is added next to the first and becomes
  the one Allocate goes to. One on a path already connected is refused ("device plugin
  already connected"), and the refusal drops *every* client recorded for that path.
- When a stream ends, the first client recorded for that path is disconnected
  (``runClient``/``disconnectClient``); if none is left, nothing happens. Disconnecting
  removes that path's endpoint (``PluginDisconnected``); only when it was the resource's
  last endpoint are all its devices marked unhealthy (``markResourceUnhealthy``), and
  then a pod asking for the resource is rejected until a plugin lists healthy devices
  again. Those marks are recorded (``unhealthy_marks``) so that a test can say "never".
- The device lists are per resource (``healthyDevices``/``unhealthyDevices``): whichever
  endpoint sent the last ListAndWatch message decides them.
- ``admit`` is a pod admission's device part (``devicesToAllocate``, then
  ``allocateContainerResources``): the same checks in the same order, with the same
  messages, then Allocate on the resource's current endpoint.
- ``restart()`` stops, deletes every socket in the directory, and serves again; what the
  kubelet's checkpoint brings back (each resource known, no devices, a stopped endpoint)
  is brought back.
"""

from __future__ import annotations

import os
import stat
import threading
import time
from collections.abc import Callable, Sequence
from concurrent import futures
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from fuse_plugin.api import api_pb2 as api
from fuse_plugin.api import api_pb2_grpc
from fuse_plugin.config import API_VERSION, KUBELET_SOCKET, resource_name

DIAL_TIMEOUT = 5.0
STOP_GRACE = 2.0
HEALTHY = "Healthy"
UNHEALTHY = "Unhealthy"


@dataclass
class Registration:
    """One accepted Register call, with when it arrived and when it was answered."""

    resource: str
    endpoint: str
    options: api.DevicePluginOptions
    received: float
    answered: float = 0.0


@dataclass(eq=False)
class _Client:
    """The registration server's client for one Register (``plugin/v1beta1/client.go``):
    its own connection to the plugin's socket, closed on disconnect."""

    resource: str
    path: Path
    channel: grpc.Channel
    stub: api_pb2_grpc.DevicePluginStub


@dataclass(eq=False)
class _Endpoint:
    """The device manager's endpoint for one socket (``endpoint.go``); a stopped one
    refuses Allocate, as ``endpointImpl.allocate`` does."""

    path: Path | None
    stub: api_pb2_grpc.DevicePluginStub | None
    stopped: float = 0.0


@dataclass(frozen=True)
class UnhealthyMark:
    """``markResourceUnhealthy`` ran: the resource's last endpoint went."""

    resource: str
    endpoint: str
    at: float


class Rejected(Exception):
    """The kubelet would reject the pod (``UnexpectedAdmissionError``); the message is
    the error the kubelet puts after "Allocate failed due to"."""


@dataclass
class _Resource:
    """What the device manager holds for one resource name."""

    healthy: set[str] = field(default_factory=set)
    unhealthy: set[str] = field(default_factory=set)
    allocated: set[str] = field(default_factory=set)
    updates: int = 0


class KubeletStandIn(api_pb2_grpc.RegistrationServicer):
    def __init__(self, directory: Path) -> None:
        self.directory = Path(directory)
        self.registrations: list[Registration] = []
        self.refusals: list[str] = []
        self.unhealthy_marks: list[UnhealthyMark] = []
        self.streams_ended = 0  # ListAndWatch streams that ended, handled or not
        self._clients: dict[str, list[_Client]] = {}
        self._store: dict[str, dict[Path, _Endpoint]] = {}
        self._current: dict[str, _Endpoint] = {}
        self._resources: dict[str, _Resource] = {}
        self._cond = threading.Condition()
        self._server: grpc.Server | None = None
        self._executor = futures.ThreadPoolExecutor(max_workers=8,
                                                    thread_name_prefix="kubelet")
        self.started_at = 0.0

    @property
    def socket(self) -> Path:
        return self.directory / KUBELET_SOCKET

    # -- lifecycle -------------------------------------------------------------------

    def start(self) -> KubeletStandIn:
        self.directory.mkdir(parents=True, exist_ok=True)
        server = grpc.server(self._executor)
        api_pb2_grpc.add_RegistrationServicer_to_server(self, server)
        self.started_at = time.perf_counter()
        server.add_insecure_port(f"unix://{self.socket}")
        server.start()
        self._server = server
        return self

    def stop(self) -> None:
        """Stop as the kubelet process does: its connections go with it. What survives
        is what its checkpoint holds: each resource, with no devices and a stopped
        endpoint (``readCheckpoint``), so a pod asking for it is rejected until a plugin
        registers again."""
        if self._server is not None:
            # A grace period lets a Register already answered here reach the plugin:
            # tests count registrations, and a reply cut off in flight would make the
            # plugin (rightly) register again. Only short Register calls run on this
            # server, so the grace never waits long.
            self._server.stop(grace=STOP_GRACE).wait()
            self._server = None
        with self._cond:
            clients = [c for cs in self._clients.values() for c in cs]
            known = list(self._resources)
            self._clients, self._store = {}, {}
            self._current = {r: _Endpoint(None, None, time.perf_counter()) for r in known}
            self._resources = {r: _Resource() for r in known}
            self._cond.notify_all()
        for client in clients:
            client.channel.close()
        self.socket.unlink(missing_ok=True)

    def wipe(self) -> list[str]:
        """Delete every socket in the directory, as the kubelet does when it starts."""
        removed = []
        for entry in self.directory.iterdir():
            try:
                if stat.S_ISSOCK(entry.lstat().st_mode):
                    entry.unlink()
                    removed.append(entry.name)
            except FileNotFoundError:
                pass
        return removed

    def restart(self) -> None:
        self.stop()
        self.wipe()
        self.start()

    def close(self) -> None:
        self.stop()
        self._executor.shutdown(wait=False, cancel_futures=True)

    def __enter__(self) -> KubeletStandIn:
        return self.start()

    def __exit__(self, *_exc: object) -> None:
        self.close()

    # -- the Registration service --------------------------------------------------

    def Register(self, request: api.RegisterRequest, context: grpc.ServicerContext
                 ) -> api.Empty:
        received = time.perf_counter()
        resource = request.resource_name
        problem = self.validate(request)
        if problem:
            with self._cond:
                self.refusals.append(problem)
                self._cond.notify_all()
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, problem)
        path = self.directory / request.endpoint
        # Like the kubelet's grpc.Dial, a connection of its own per registration: grpcio
        # would otherwise share one subchannel (and its reconnect backoff) per target.
        channel = grpc.insecure_channel(f"unix://{path}",
                                        [("grpc.use_local_subchannel_pool", 1)])
        client = _Client(resource, path, channel, api_pb2_grpc.DevicePluginStub(channel))
        with self._cond:
            self._clients.setdefault(resource, []).append(client)
        try:
            options = client.stub.GetDevicePluginOptions(api.Empty(), timeout=DIAL_TIMEOUT,
                                                         wait_for_ready=True)
        except grpc.RpcError as err:
            self._refuse_client(client, f"failed to dial device plugin: {err.details()}")
            context.abort(grpc.StatusCode.UNAVAILABLE,
                          f"failed to dial device plugin {request.endpoint}: {err.details()}")
        with self._cond:
            connected = self._store.setdefault(resource, {})
            duplicate = path in connected
            if not duplicate:
                endpoint = _Endpoint(path, client.stub)
                connected[path] = endpoint
                self._current[resource] = endpoint
                self._resources.setdefault(resource, _Resource())
        if duplicate:
            reason = f"device plugin already connected: {path}"
            self._refuse_client(client, reason)
            context.abort(grpc.StatusCode.UNKNOWN, reason)
        self._executor.submit(self._run_client, client)
        registration = Registration(resource, request.endpoint, options, received)
        registration.answered = time.perf_counter()
        with self._cond:
            self.registrations.append(registration)
            self._cond.notify_all()
        return api.Empty()

    def validate(self, request: api.RegisterRequest) -> str:
        """Why the kubelet would refuse this Register; empty when it accepts it."""
        if request.version != API_VERSION:
            return f"unsupported device plugin API version {request.version!r}"
        try:
            resource_name(request.resource_name)
        except Exception as err:  # the message is the kubelet's refusal text
            return f"invalid resource name {request.resource_name!r}: {err}"
        if not request.endpoint or "/" in request.endpoint:
            return f"invalid endpoint {request.endpoint!r}"
        return ""

    def _refuse_client(self, client: _Client, reason: str) -> None:
        """A Register that failed after its client was recorded: as ``connectClient``,
        drop every client recorded for that path (not only this one) and leave the
        endpoints as they are."""
        with self._cond:
            self._drop_clients(client.resource, client.path)
            self.refusals.append(reason)
            self._cond.notify_all()
        client.channel.close()

    def _drop_clients(self, resource: str, path: Path) -> None:
        """``deregisterClient``: every client of ``resource`` at ``path`` goes. Holds the lock."""
        kept = [c for c in self._clients.get(resource, []) if c.path != path]
        if kept:
            self._clients[resource] = kept
        else:
            self._clients.pop(resource, None)

    def _run_client(self, client: _Client) -> None:
        """``runClient``: read the stream until it ends, then disconnect whichever client
        is recorded first for that path, if any is."""
        stream = client.stub.ListAndWatch(api.Empty())
        try:
            for message in stream:
                self._list(client.resource, message.devices)
        except grpc.RpcError:
            pass
        with self._cond:
            self.streams_ended += 1
            self._cond.notify_all()
            found = next((c for c in self._clients.get(client.resource, [])
                          if c.path == client.path), None)
            if found is None:
                return
            self._drop_clients(found.resource, found.path)
            self._plugin_disconnected(found.resource, found.path)
            self._cond.notify_all()
        found.channel.close()

    def _list(self, resource: str, devices: Sequence[api.Device]) -> None:
        """``genericDeviceUpdateCallback``: the message replaces the resource's lists."""
        with self._cond:
            state = self._resources.setdefault(resource, _Resource())
            state.healthy = {d.ID for d in devices if d.health == HEALTHY}
            state.unhealthy = {d.ID for d in devices if d.health != HEALTHY}
            state.updates += 1
            self._cond.notify_all()

    def _plugin_disconnected(self, resource: str, path: Path) -> None:
        """``PluginDisconnected``. Holds the lock."""
        connected = self._store.get(resource)
        if connected is None or path not in connected:
            return
        connected[path].stopped = time.perf_counter()
        if len(connected) == 1:
            del self._store[resource]
            state = self._resources[resource]
            state.unhealthy |= state.healthy
            state.healthy = set()
            state.updates += 1
            self.unhealthy_marks.append(
                UnhealthyMark(resource, path.name, time.perf_counter()))
        else:
            del connected[path]
            self._current[resource] = next(iter(connected.values()))

    # -- what tests and tools ask ----------------------------------------------------

    def wait_for(self, predicate: Callable[[], bool], timeout: float) -> bool:
        """Wait (with a deadline) until predicate() holds; evaluated under the lock."""
        with self._cond:
            return self._cond.wait_for(predicate, timeout)

    def wait_registered(self, count: int = 1, timeout: float = 10.0) -> Registration:
        if not self.wait_for(lambda: len(self.registrations) >= count, timeout):
            raise TimeoutError(f"no Register #{count} within {timeout}s "
                               f"(refusals: {self.refusals or 'none'})")
        return self.registrations[count - 1]

    def devices(self, resource: str) -> dict[str, str]:
        """The resource's devices and their health as the kubelet holds them (empty
        before any plugin listed them)."""
        with self._cond:
            state = self._resources.get(resource)
            if state is None:
                return {}
            return {**dict.fromkeys(state.unhealthy, UNHEALTHY),
                    **dict.fromkeys(state.healthy, HEALTHY)}

    def endpoints(self, resource: str) -> list[str]:
        """The socket names of the resource's connected endpoints, the current one (the
        one Allocate goes to) first."""
        with self._cond:
            connected = self._store.get(resource, {})
            current = self._current.get(resource)
            names = [p.name for p, e in connected.items() if e is not current]
            if current is not None and current.path in connected:
                names.insert(0, current.path.name)
            return names

    def capacity(self, resource: str) -> tuple[int, int]:
        """(capacity, allocatable) as the kubelet would report them."""
        devices = self.devices(resource)
        return len(devices), sum(1 for h in devices.values() if h == HEALTHY)

    def wait_devices(self, resource: str, predicate: Callable[[dict[str, str]], bool],
                     timeout: float = 10.0) -> dict[str, str]:
        def check() -> bool:
            state = self._resources.get(resource)
            return state is not None and state.updates > 0 and predicate(
                self.devices(resource))
        if not self.wait_for(check, timeout):
            raise TimeoutError(f"{resource}: device list {self.devices(resource)!r} "
                               f"did not reach the expected state within {timeout}s")
        return self.devices(resource)

    def stub(self, resource: str) -> api_pb2_grpc.DevicePluginStub:
        """The current endpoint's connection: the one the kubelet's Allocate uses."""
        with self._cond:
            endpoint = self._current.get(resource)
        if endpoint is None or endpoint.stub is None:
            raise LookupError(f"{resource} is not registered")
        return endpoint.stub

    def allocate(self, resource: str, containers: Sequence[Sequence[str]],
                 timeout: float = 5.0) -> api.AllocateResponse:
        """One Allocate straight to the current endpoint, one ContainerAllocateRequest
        per container, whatever the kubelet's books say (``admit`` checks them first)."""
        request = api.AllocateRequest(container_requests=[
            api.ContainerAllocateRequest(devices_ids=list(ids)) for ids in containers])
        response: api.AllocateResponse = self.stub(resource).Allocate(request, timeout=timeout)
        return response

    def admit(self, resource: str, count: int = 1, timeout: float = 5.0) -> list[str]:
        """Admit one container asking for ``count`` of ``resource``, as the kubelet's
        device manager does; returns the device IDs it holds until ``release``.

        Raises ``Rejected`` with the kubelet's own message where it would reject the
        pod: the checks of ``devicesToAllocate`` in their order, then Allocate on the
        current endpoint (a stopped one refuses; a plugin's refusal is the message).
        """
        with self._cond:
            state = self._resources.get(resource)
            if state is None:
                raise Rejected(f"cannot allocate unregistered device {resource}")
            if not state.healthy:
                raise Rejected(f"no healthy devices present; cannot allocate unhealthy "
                               f"devices {resource}")
            available = sorted(state.healthy - state.allocated)
            if len(available) < count:
                raise Rejected(f"requested number of devices unavailable for {resource}. "
                               f"Requested: {count}, Available: {len(available)}")
            ids = available[:count]
            state.allocated.update(ids)
            endpoint = self._current.get(resource)
        try:
            if endpoint is None:
                raise Rejected(f"unknown Device Plugin {resource}")
            if endpoint.stopped or endpoint.stub is None:
                raise Rejected(f"endpoint {resource} has been stopped")
            request = api.AllocateRequest(container_requests=[
                api.ContainerAllocateRequest(devices_ids=ids)])
            try:
                endpoint.stub.Allocate(request, timeout=timeout)
            except grpc.RpcError as err:
                raise Rejected(f"rpc error: code = {err.code().name} desc = "
                               f"{err.details()}") from None
        except Rejected:
            self.release(resource, ids)
            raise
        return ids

    def release(self, resource: str, ids: Sequence[str]) -> None:
        """The pod holding ``ids`` is gone: its devices are free again."""
        with self._cond:
            state = self._resources.get(resource)
            if state is not None:
                state.allocated.difference_update(ids)


def socket_files(directory: Path) -> list[str]:
    return sorted(e.name for e in Path(directory).iterdir()
                  if stat.S_ISSOCK(os.lstat(e).st_mode))
