"""The two gRPC services the kubelet calls, on the kubelet's plugin sockets.

- Registration (``pluginregistration.Registration``) on
  ``<registry-dir>/<driver>-reg.sock``: the kubelet's plugin watcher sees the socket
  appear (and re-reads the directory when the kubelet restarts), asks ``GetInfo``, and
  reports the outcome through ``NotifyRegistrationStatus``.
- The DRA service (``k8s.io.kubelet.pkg.apis.dra.v1.DRAPlugin``) on
  ``<plugins-dir>/<driver>/dra.sock``, the endpoint GetInfo names.

One gRPC server listens on both sockets; each claim of a call is answered on its own (an
error is that claim's ``error`` string, never a failed call), since the kubelet retries
only the claims that failed. A socket left by a killed driver is removed at start; one
that another process serves is left alone and the start fails, saying so.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import logging
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import grpc

from fuse_plugin import grpc_unix, logs, sockets
from fuse_plugin.api import dra_pb2 as dra
from fuse_plugin.api import dra_pb2_grpc, pluginregistration_pb2_grpc
from fuse_plugin.api import pluginregistration_pb2 as reg
from fuse_plugin.dra.claims import ClaimError
from fuse_plugin.dra.metrics import DraStats
from fuse_plugin.dra.prepare import Preparer
from fuse_plugin.errors import Failure

PLUGIN_TYPE = "DRAPlugin"
# The kubelet picks the DRA API by this gRPC service name (its DRAPluginService constant).
SUPPORTED_VERSIONS = ("v1.DRAPlugin",)
WORKERS = 8
# At SIGTERM: how long calls in flight may finish while we are still registered, then how
# long a call that arrives before the kubelet has deregistered us may; together within the
# DaemonSet's 10 s grace.
DRAIN_WAIT = 6.0
STOP_GRACE = 2.0


class Registered:
    """What the kubelet last said about our registration (for /readyz and the logs)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.registered = False
        self.error = ""

    def set(self, registered: bool, error: str) -> None:
        with self._lock:
            self.registered, self.error = registered, error


class InFlight:
    """The kubelet's calls being served, so a stopping driver can wait for them to end.

    Why it matters: the kubelet closes its connection to a driver the moment it
    deregisters it (``DRAPluginManager.remove``), which cuts every call in flight, and
    the pod whose Prepare was cut waits 10-15 s for the kubelet's retry. So a stopping
    driver finishes its calls before it removes its registration socket."""

    def __init__(self, log: logging.Logger) -> None:
        self._cond = threading.Condition()
        self._count = 0
        self._stopping = False
        self._log = log

    @contextlib.contextmanager
    def call(self, method: str) -> Iterator[None]:
        with self._cond:
            self._count += 1
            if self._stopping:
                logs.event(self._log, "call.while_stopping", method=method)
        try:
            yield
        finally:
            with self._cond:
                self._count -= 1
                self._cond.notify_all()

    def drain(self, timeout: float) -> int:
        """Mark the driver stopping and wait up to ``timeout`` for no call to be in
        flight; the number still in flight (0 when drained)."""
        with self._cond:
            self._stopping = True
            if self._count:
                logs.event(self._log, "calls.draining", in_flight=self._count)
            self._cond.wait_for(lambda: self._count == 0, timeout)
            return self._count


class RegistrationServicer(pluginregistration_pb2_grpc.RegistrationServicer):
    def __init__(self, driver: str, endpoint: Path, status: Registered,
                 log: logging.Logger) -> None:
        self._info = reg.PluginInfo(type=PLUGIN_TYPE, name=driver, endpoint=str(endpoint),
                                    supported_versions=list(SUPPORTED_VERSIONS))
        self._status = status
        self._log = log

    def GetInfo(self, request: reg.InfoRequest, context: grpc.ServicerContext
                ) -> reg.PluginInfo:
        logs.event(self._log, "registration.info_asked", level=logging.DEBUG)
        return self._info

    def NotifyRegistrationStatus(self, request: reg.RegistrationStatus,
                                 context: grpc.ServicerContext
                                 ) -> reg.RegistrationStatusResponse:
        self._status.set(request.plugin_registered, request.error)
        if request.plugin_registered:
            logs.event(self._log, "registered", driver=self._info.name)
        else:
            logs.event(self._log, "registration.refused", logging.ERROR,
                       driver=self._info.name, error=request.error)
        return reg.RegistrationStatusResponse()


class DraServicer(dra_pb2_grpc.DRAPluginServicer):
    def __init__(self, preparer: Preparer, stats: DraStats, calls: InFlight,
                 log: logging.Logger) -> None:
        self._preparer = preparer
        self._stats = stats
        self.calls = calls
        self._log = log

    def NodePrepareResources(self, request: dra.NodePrepareResourcesRequest,
                             context: grpc.ServicerContext
                             ) -> dra.NodePrepareResourcesResponse:
        response = dra.NodePrepareResourcesResponse()
        with self.calls.call("NodePrepareResources"):
            for claim in request.claims:
                response.claims[claim.uid].CopyFrom(self._prepare_one(claim))
        return response

    def _prepare_one(self, claim: dra.Claim) -> dra.NodePrepareResourceResponse:
        start = time.monotonic()
        answer, outcome = self._answer(claim)
        self._stats.observe("prepare", outcome, time.monotonic() - start)
        return answer

    def _answer(self, claim: dra.Claim) -> tuple[dra.NodePrepareResourceResponse, str]:
        try:
            prepared, recorded = self._preparer.prepare(claim.namespace, claim.name,
                                                        claim.uid)
        except ClaimError as err:
            logs.event(self._log, "claim.refused", logging.WARNING,
                       claim=f"{claim.namespace}/{claim.name}", uid=claim.uid, error=str(err))
            return dra.NodePrepareResourceResponse(error=str(err)), "refused"
        except Exception as err:  # a bug of ours: this claim fails, the call and the rest don't
            logs.event(self._log, "claim.internal_error", logging.ERROR,
                       claim=f"{claim.namespace}/{claim.name}", uid=claim.uid,
                       error=f"{type(err).__name__}: {err}")
            return dra.NodePrepareResourceResponse(
                error=f"internal error of the {PLUGIN_TYPE} preparing this claim: "
                      f"{type(err).__name__}: {err}"), "error"
        if recorded:
            logs.event(self._log, "claim.prepared_again", level=logging.DEBUG,
                       claim=f"{claim.namespace}/{claim.name}", uid=claim.uid)
        answer = dra.NodePrepareResourceResponse()
        for item in prepared:
            device = answer.devices.add(request_names=[item.request], pool_name=item.pool,
                                        device_name=item.device,
                                        cdi_device_ids=list(item.cdi_ids))
            if item.share_id is not None:
                device.share_id = item.share_id
        return answer, "recorded" if recorded else "prepared"

    def NodeUnprepareResources(self, request: dra.NodeUnprepareResourcesRequest,
                               context: grpc.ServicerContext
                               ) -> dra.NodeUnprepareResourcesResponse:
        response = dra.NodeUnprepareResourcesResponse()
        with self.calls.call("NodeUnprepareResources"):
            for claim in request.claims:
                self._unprepare_one(claim, response.claims[claim.uid])
        return response

    def _unprepare_one(self, claim: dra.Claim, entry: dra.NodeUnprepareResourceResponse
                       ) -> None:
        """``entry`` is present in the response even when empty, as required."""
        start = time.monotonic()
        try:
            self._preparer.unprepare(claim.uid)
        except ClaimError as err:
            logs.event(self._log, "claim.unprepare_failed", logging.WARNING,
                       claim=f"{claim.namespace}/{claim.name}", uid=claim.uid,
                       error=str(err))
            entry.error = str(err)
        self._stats.observe("unprepare", "failed" if entry.error else "unprepared",
                            time.monotonic() - start)


def _clear_stale(path: Path, log: logging.Logger) -> None:
    """Remove a socket a killed driver left; ``sockets.InUse`` when a process serves it."""
    try:
        sockets.take_over(path, log)
    except OSError as err:
        raise Failure(f"cannot remove the stale socket {path}: {err.strerror}") from None


def clear_other_instances(patterns: list[tuple[Path, str]], own: set[Path],
                          log: logging.Logger) -> None:
    """Remove the sockets earlier pods of this driver left under their own names (a pod
    killed in a rolling update never removes them); a socket a live process serves (the
    old pod of a rolling update, still draining) is left alone."""
    for directory, pattern in patterns:
        for path in sorted(directory.glob(pattern)):
            if path not in own:
                with contextlib.suppress(sockets.InUse):
                    _clear_stale(path, log)


class Sockets:
    """The gRPC server on the service socket and the registration socket."""

    def __init__(self, service: Path, registration: Path, dra_servicer: DraServicer,
                 reg_servicer: RegistrationServicer, log: logging.Logger) -> None:
        self.service = service
        self.registration = registration
        self._calls = dra_servicer.calls
        self._log = log
        self._executor = concurrent.futures.ThreadPoolExecutor(WORKERS,
                                                               thread_name_prefix="dra")
        self._server = grpc_unix.server(self._executor)
        dra_pb2_grpc.add_DRAPluginServicer_to_server(dra_servicer, self._server)
        pluginregistration_pb2_grpc.add_RegistrationServicer_to_server(reg_servicer,
                                                                      self._server)

    def start(self) -> None:
        """Bind the service socket first: once the registration socket appears the kubelet
        may dial the endpoint at once."""
        for path in (self.service, self.registration):
            try:
                path.parent.mkdir(parents=True, exist_ok=True)
            except OSError as err:
                raise Failure(f"cannot create {path.parent}: {err.strerror}") from None
            try:
                _clear_stale(path, self._log)
            except sockets.InUse:
                raise Failure(f"another process serves {path}: is a second driver running "
                              "on this node?") from None
            if not grpc_unix.bind(self._server, path):
                raise Failure(f"cannot bind {path}")
        self._server.start()
        logs.event(self._log, "serving", service=str(self.service),
                   registration=str(self.registration))

    def stop(self) -> None:
        """Finish the calls in flight, deregister, then stop serving.

        In a rolling update the kubelet already sends new calls to the new pod (the
        newest connected registration), so the calls here end and no new ones come. Only
        then does the registration socket go: the kubelet's plugin watcher deregisters
        us and closes its connection at once, cutting whatever it had sent us. A call
        that still arrives (we were the only instance) gets STOP_GRACE."""
        left = self._calls.drain(DRAIN_WAIT)
        logs.event(self._log, "calls.drained" if not left else "calls.left",
                   logging.INFO if not left else logging.WARNING, in_flight=left)
        self.registration.unlink(missing_ok=True)
        self._server.stop(grace=STOP_GRACE).wait()
        self._executor.shutdown(wait=True)
        self.service.unlink(missing_ok=True)
