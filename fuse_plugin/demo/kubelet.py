"""A kubelet stand-in that speaks the real device-plugin wire protocol on real sockets.

The kubelet of ``fuse-device-plugin demo``; the tests and the benchmarks use it too
(``tests/lib/kubelet.py`` adds their hooks). It does what the
kubelet's device manager does, in the order it does it:

- serves ``Registration`` on ``<dir>/kubelet.sock``;
- on Register, checks the version and resource name, dials the plugin's endpoint and
  calls GetDevicePluginOptions *before* answering (newer kubelets do this; a plugin
  that blocks its only worker in Register deadlocks here), then opens ListAndWatch;
- keeps the latest device list per resource; when the stream breaks, marks every
  device of that resource unhealthy, as the kubelet does;
- ``restart()`` stops, deletes every socket in the directory, and serves again.
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


@dataclass
class Registration:
    """One accepted Register call, with when it arrived and when it was answered."""

    resource: str
    endpoint: str
    options: api.DevicePluginOptions
    received: float
    answered: float = 0.0


@dataclass
class _Endpoint:
    channel: grpc.Channel
    stub: api_pb2_grpc.DevicePluginStub
    devices: dict[str, str] = field(default_factory=dict)
    updates: int = 0


class KubeletStandIn(api_pb2_grpc.RegistrationServicer):
    def __init__(self, directory: Path) -> None:
        self.directory = Path(directory)
        self.registrations: list[Registration] = []
        self.refusals: list[str] = []
        self._endpoints: dict[str, _Endpoint] = {}
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
        if self._server is not None:
            # A grace period lets a Register already answered here reach the plugin:
            # tests count registrations, and a reply cut off in flight would make the
            # plugin (rightly) register again. Only short Register calls run on this
            # server, so the grace never waits long.
            self._server.stop(grace=STOP_GRACE).wait()
            self._server = None
        with self._cond:
            endpoints, self._endpoints = self._endpoints, {}
        for endpoint in endpoints.values():
            endpoint.channel.close()
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
        problem = self.validate(request)
        if problem:
            with self._cond:
                self.refusals.append(problem)
                self._cond.notify_all()
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, problem)
        # Like the kubelet's grpc.Dial, a connection of its own per registration: grpcio would
        # otherwise share one subchannel (and its reconnect backoff) per target.
        channel = grpc.insecure_channel(f"unix://{self.directory / request.endpoint}",
                                        [("grpc.use_local_subchannel_pool", 1)])
        stub = api_pb2_grpc.DevicePluginStub(channel)
        try:
            options = stub.GetDevicePluginOptions(api.Empty(), timeout=DIAL_TIMEOUT,
                                                  wait_for_ready=True)
        except grpc.RpcError as err:
            channel.close()
            context.abort(grpc.StatusCode.UNAVAILABLE,
                          f"failed to dial device plugin {request.endpoint}: {err.details()}")
        endpoint = _Endpoint(channel, stub)
        with self._cond:
            old = self._endpoints.pop(request.resource_name, None)
            self._endpoints[request.resource_name] = endpoint
        if old is not None:
            old.channel.close()
        self._executor.submit(self._list_and_watch, request.resource_name, endpoint)
        registration = Registration(request.resource_name, request.endpoint, options, received)
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

    def _list_and_watch(self, resource: str, endpoint: _Endpoint) -> None:
        stream = endpoint.stub.ListAndWatch(api.Empty())
        try:
            for message in stream:
                with self._cond:
                    endpoint.devices = {d.ID: d.health for d in message.devices}
                    endpoint.updates += 1
                    self._cond.notify_all()
        except grpc.RpcError:
            pass
        with self._cond:
            # The kubelet keeps the devices but marks them unhealthy when a stream ends.
            endpoint.devices = dict.fromkeys(endpoint.devices, "Unhealthy")
            endpoint.updates += 1
            self._cond.notify_all()

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
        """Latest device list seen for ``resource`` (empty before registration)."""
        endpoint = self._endpoints.get(resource)
        return dict(endpoint.devices) if endpoint else {}

    def capacity(self, resource: str) -> tuple[int, int]:
        """(capacity, allocatable) as the kubelet would report them."""
        devices = self.devices(resource)
        return len(devices), sum(1 for h in devices.values() if h == "Healthy")

    def wait_devices(self, resource: str, predicate: Callable[[dict[str, str]], bool],
                     timeout: float = 10.0) -> dict[str, str]:
        def check() -> bool:
            endpoint = self._endpoints.get(resource)
            return endpoint is not None and endpoint.updates > 0 and predicate(
                endpoint.devices)
        if not self.wait_for(check, timeout):
            raise TimeoutError(f"{resource}: device list {self.devices(resource)!r} "
                               f"did not reach the expected state within {timeout}s")
        return self.devices(resource)

    def stub(self, resource: str) -> api_pb2_grpc.DevicePluginStub:
        endpoint = self._endpoints.get(resource)
        if endpoint is None:
            raise LookupError(f"{resource} is not registered")
        return endpoint.stub

    def allocate(self, resource: str, containers: Sequence[Sequence[str]],
                 timeout: float = 5.0) -> api.AllocateResponse:
        """One Allocate for a pod: one ContainerAllocateRequest per container."""
        request = api.AllocateRequest(container_requests=[
            api.ContainerAllocateRequest(devices_ids=list(ids)) for ids in containers])
        response: api.AllocateResponse = self.stub(resource).Allocate(request, timeout=timeout)
        return response


def socket_files(directory: Path) -> list[str]:
    return sorted(e.name for e in Path(directory).iterdir()
                  if stat.S_ISSOCK(os.lstat(e).st_mode))
