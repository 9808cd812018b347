"""Handing the resource over to a successor, so that the kubelet never sees it go.

kubelet 1.37 keeps one endpoint per socket path and marks a resource's devices unhealthy
only when its *last* endpoint disconnects (``PluginDisconnected`` in
``pkg/kubelet/cm/devicemanager/manager.go``). A new plugin pod on a socket of its own
(``--instance``) that registers before the old pod stops therefore takes over without a
gap; pods admitted meanwhile are never rejected. The DaemonSet's ``maxSurge`` rollout
deletes the old pod only once the new one is ready (registered), and a deleted pod is
replaced at once while the old one terminates: ``--handoff-wait`` keeps the old plugin
serving after SIGTERM until a successor has registered, for that case.

How the old plugin knows: every plugin serves one more method on its socket,
``Registered``, which answers once that plugin's Register was accepted, with the
resource it serves. The old one asks every other socket of its resource in the
directory (``Successors``). The kubelet never calls it; it sees only the DevicePlugin
service.
"""

from __future__ import annotations

import errno
import logging
import threading
from collections.abc import Callable
from pathlib import Path

import grpc

from fuse_plugin import files, logs, sockets
from fuse_plugin.config import Settings, sibling_socket

SERVICE = "fusedeviceplugin.v1.Handoff"
METHOD = f"/{SERVICE}/Registered"
# A Registered call waits at most this long on the answering side; the asker asks again.
MAX_ANSWER_WAIT = 30.0
# Calls waiting at once: each holds a gRPC worker, which Allocate must always find.
MAX_WAITING = 2
CHANNEL_OPTIONS = [("grpc.use_local_subchannel_pool", 1), ("grpc.enable_retries", 0)]


def add_to_server(server: grpc.Server, resource: str,
                  registered: Callable[[float], bool]) -> None:
    """Serve ``Registered`` on ``server``: the resource's name, once ``registered(timeout)``
    says the kubelet accepted us (it waits up to ``timeout`` seconds); UNAVAILABLE if it
    did not within the call's deadline."""
    waiting = threading.BoundedSemaphore(MAX_WAITING)
    answer = resource.encode()

    def handle(_request: bytes, context: grpc.ServicerContext) -> bytes:
        remaining = context.time_remaining()
        timeout = MAX_ANSWER_WAIT if remaining is None else min(remaining, MAX_ANSWER_WAIT)
        if registered(0.0):
            return answer
        if not waiting.acquire(blocking=False):
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                          f"at most {MAX_WAITING} Registered calls may wait at once")
        try:
            if registered(max(0.0, timeout)):
                return answer
        finally:
            waiting.release()
        context.abort(grpc.StatusCode.UNAVAILABLE, "not registered with the kubelet yet")

    handler: grpc.RpcMethodHandler[bytes, bytes] = grpc.unary_unary_rpc_method_handler(handle)
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler(SERVICE, {"Registered": handler}),))


def siblings(settings: Settings) -> list[Path]:
    """The other sockets in the directory that a plugin for our resource may serve."""
    pattern = sibling_socket(settings.resource_name)
    try:
        names = [e.name for e in settings.device_plugin_dir.iterdir()]
    except OSError:
        return []
    return [settings.device_plugin_dir / n for n in sorted(names)
            if n != settings.socket_name and pattern.fullmatch(n)]


def remove_stale(settings: Settings, log: logging.Logger) -> list[Path]:
    """Remove our resource's sockets that refuse connections: what a plugin pod killed
    with SIGKILL leaves, on a name no later pod will bind again. Only a refusal counts;
    a socket that answers, or that cannot be judged, is left alone."""
    removed = []
    for path in siblings(settings):
        refused = sockets.refusal(path)
        if refused is None or refused.errno != errno.ECONNREFUSED:
            continue
        try:
            path.unlink()
        except FileNotFoundError:
            continue
        except OSError as err:
            logs.event(log, "socket.stale_kept", logging.WARNING, socket=str(path),
                       error=err.strerror)
            continue
        removed.append(path)
        logs.event(log, "socket.stale_removed", socket=str(path),
                   reason="an earlier instance's socket, refusing connections")
    return removed


class Successors:
    """The asking side: one Registered call in flight per sibling socket, until one of
    them answers with our resource. Calls run as futures whose completion calls
    ``wake``, so the lifecycle's loop never blocks on them."""

    def __init__(self, settings: Settings, deadline: float, clock: Callable[[], float],
                 wake: Callable[[], None]) -> None:
        self._settings = settings
        self._deadline = deadline
        self._clock = clock
        self._wake = wake
        self._calls: dict[Path, tuple[files.Identity, grpc.Channel,
                                      grpc.Future[bytes]]] = {}
        self.found: str = ""

    def look(self) -> None:
        """Ask every sibling socket not asked yet (or replaced since it was asked)."""
        for path in siblings(self._settings):
            identity = files.identity(path)
            if identity is None:
                continue
            asked = self._calls.get(path)
            if asked is not None and asked[0] == identity:
                continue
            if asked is not None:
                self._forget(path)
            self._ask(path, identity)

    def _ask(self, path: Path, identity: files.Identity) -> None:
        timeout = self._deadline - self._clock()
        if timeout <= 0:
            return
        channel = grpc.insecure_channel(f"unix://{path}", CHANNEL_OPTIONS)
        registered: grpc.UnaryUnaryMultiCallable[bytes, bytes] = channel.unary_unary(METHOD)
        call = registered.future(b"", timeout=timeout, wait_for_ready=True)
        call.add_done_callback(lambda _call: self._wake())
        self._calls[path] = (identity, channel, call)

    def collect(self) -> str:
        """The name of a sibling socket that answered with our resource, once one did;
        a sibling that failed is forgotten, to be asked again at the next ``look``."""
        wanted = self._settings.resource_name.encode()
        for path, (_identity, _channel, call) in list(self._calls.items()):
            if not call.done():
                continue
            try:
                answer = call.result()
            except (grpc.RpcError, grpc.FutureCancelledError):
                self._forget(path)
                continue
            if answer == wanted:
                self.found = path.name
                return self.found
        return ""

    def _forget(self, path: Path) -> None:
        _identity, channel, call = self._calls.pop(path)
        call.cancel()
        channel.close()

    def close(self) -> None:
        for path in list(self._calls):
            self._forget(path)
