"""Our socket, the gRPC server, Register, watching the kubelet, and shutdown.

Follow a kubelet restart here: the kubelet deletes every socket in its directory and
then creates a new ``kubelet.sock``. watchdog (inotify) reports both; the loop below
re-creates our socket, serves on it, and calls Register at once. A slow periodic check
catches anything a lost event would miss. The device model and the RPCs live in
``devices`` and ``servicer``; nothing here knows what a FUSE device is.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from concurrent import futures
from dataclasses import dataclass
from pathlib import Path

import grpc
from watchdog.events import FileSystemEvent, FileSystemEventHandler
from watchdog.observers import Observer

from fuse_plugin import logs
from fuse_plugin.api import api_pb2 as api
from fuse_plugin.api import api_pb2_grpc
from fuse_plugin.config import API_VERSION, Settings
from fuse_plugin.devices import DeviceState
from fuse_plugin.servicer import WORKERS, FusePlugin

# How often the safety net re-checks sockets and the device when no event arrives.
SAFETY_INTERVAL = 5.0
# Register retries back off from FIRST to CAP seconds; an inotify event resets them.
BACKOFF_FIRST = 0.02
BACKOFF_CAP = 5.0
# The kubelet answers Register after dialling us back; it never takes seconds.
REGISTER_TIMEOUT = 5.0
STOP_GRACE = 1.0


def _identity(path: Path) -> tuple[int, int] | None:
    """Inode and ctime together: ext4 hands a re-created socket the same inode."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_ino, st.st_ctime_ns


@dataclass
class Status:
    """What the loop has done, read by probes and metrics. Written by the loop, except
    ``registered``, which the watcher also clears when kubelet.sock disappears."""

    registered: bool = False
    serving: bool = False
    registrations: int = 0
    registration_failures: int = 0
    kubelet_restarts: int = 0
    last_error: str = ""


class _Events(FileSystemEventHandler):
    """Turns inotify events into flags for the loop; runs on watchdog's thread."""

    def __init__(self, plugin: Lifecycle) -> None:
        self._plugin = plugin

    def on_any_event(self, event: FileSystemEvent) -> None:
        plugin = self._plugin
        dest = getattr(event, "dest_path", "") or ""
        paths = {os.fsdecode(event.src_path), os.fsdecode(dest)}
        if str(plugin.settings.fuse_device) in paths:
            plugin.device_changed()
        if str(plugin.settings.kubelet_socket) in paths:
            if event.event_type == "deleted":
                plugin.kubelet_gone()
            else:
                plugin.kubelet_appeared()
        if str(plugin.settings.socket_path) in paths and event.event_type == "deleted":
            plugin.socket_deleted()


class Lifecycle:
    """Serve, register, re-register; one loop thread owns every state change."""

    def __init__(self, settings: Settings, state: DeviceState, servicer: FusePlugin,
                 log: logging.Logger) -> None:
        self.settings = settings
        self.state = state
        self.servicer = servicer
        self.status = Status()
        self._log = log
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._need_serve = True
        self._need_register = True
        self._kubelet_seen: tuple[int, int] | None = None
        self._our_socket: tuple[int, int] | None = None
        self._server: grpc.Server | None = None
        self._executor = futures.ThreadPoolExecutor(max_workers=WORKERS,
                                                    thread_name_prefix="grpc")
        self._observer = Observer()
        self.alive = False

    # -- called from other threads -------------------------------------------------

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()

    def kubelet_appeared(self) -> None:
        self._need_register = True
        self._wake.set()

    def kubelet_gone(self) -> None:
        """The kubelet stopped: unready until a new kubelet.sock accepts us."""
        if self.status.registered:
            logs.event(self._log, "kubelet.gone", socket=str(self.settings.kubelet_socket))
        self.status.registered = False

    def socket_deleted(self) -> None:
        self._need_serve = True
        self._wake.set()

    def device_changed(self) -> None:
        changed = self.state.refresh()
        if changed:
            logs.event(self._log, "device.health", health=changed.health.value,
                       reason=changed.reason, slots=len(self.state.ids))

    # -- the loop ------------------------------------------------------------------

    def run(self) -> int:
        """Run until ``stop()``; returns the process exit code."""
        self._watch()
        logs.event(self._log, "start", socket=str(self.settings.socket_path),
                   device=str(self.state.device), health=self.state.health.value,
                   slots=len(self.state.ids))
        backoff = BACKOFF_FIRST
        next_safety = time.monotonic() + SAFETY_INTERVAL
        self.alive = True
        try:
            while not self._stop.is_set():
                self._wake.clear()
                # Flags are cleared before acting, so an event that lands meanwhile
                # sets them again and is handled on the next turn, not lost.
                if self._need_serve:
                    self._need_serve = False
                    if not self._serving_our_socket():
                        self._serve()
                if self._need_register and self._registered_with_this_kubelet():
                    # A late event for the kubelet.sock we already registered with.
                    self._need_register = False
                if self._need_register and self._kubelet_present():
                    if self._register():
                        backoff = BACKOFF_FIRST
                    else:
                        self._wake.wait(backoff)
                        backoff = min(backoff * 2, BACKOFF_CAP)
                        continue
                timeout = max(0.0, next_safety - time.monotonic())
                if not self._wake.wait(timeout):
                    self._safety_check()
                    next_safety = time.monotonic() + SAFETY_INTERVAL
        finally:
            self.alive = False
            self._shutdown()
        return 0

    def _watch(self) -> None:
        handler = _Events(self)
        self._observer.schedule(handler, str(self.settings.device_plugin_dir))
        device_dir = self.settings.fuse_device.parent
        if device_dir != self.settings.device_plugin_dir and device_dir.is_dir():
            self._observer.schedule(handler, str(device_dir))
        self._observer.daemon = True
        self._observer.start()

    def _registered_with_this_kubelet(self) -> bool:
        """A second Register to the same kubelet makes it drop and re-open our stream."""
        return self.status.registered and \
            _identity(self.settings.kubelet_socket) == self._kubelet_seen

    def _kubelet_present(self) -> bool:
        return self.settings.kubelet_socket.exists()

    def _serving_our_socket(self) -> bool:
        """True when the socket file is the one our running server bound.

        Deletion events arrive after the fact, and we delete socket files ourselves (the
        stale one at start, the old one when re-serving): an event only means "re-serve"
        if the file at the path is no longer ours.
        """
        return self._server is not None and \
            _identity(self.settings.socket_path) == self._our_socket

    def _serve(self) -> None:
        """(Re)create our socket and serve on it; a stale file from a crash is removed."""
        started = time.perf_counter()
        if self._server is not None:
            # gRPC unlinks a unix socket's path when its listener shuts down: wait for
            # that to finish, or it would delete the socket the new server binds.
            self._server.stop(grace=None).wait()
            self._server = None
        path = self.settings.socket_path
        try:
            path.unlink()
            logs.event(self._log, "socket.stale_removed", socket=str(path))
        except FileNotFoundError:
            pass
        server = grpc.server(self._executor, options=[("grpc.so_reuseport", 0)])
        api_pb2_grpc.add_DevicePluginServicer_to_server(self.servicer, server)
        server.add_insecure_port(f"unix://{path}")
        server.start()
        self._server = server
        self._our_socket = _identity(path)
        self.status.serving = True
        # A new socket means the kubelet no longer knows us: register again.
        self._need_register = True
        self.status.registered = False
        logs.event(self._log, "serving", socket=str(path),
                   duration_ms=round((time.perf_counter() - started) * 1000, 2))

    def _register(self) -> bool:
        started = time.perf_counter()
        kubelet = self.settings.kubelet_socket
        identity = _identity(kubelet)
        if self._kubelet_seen is not None and identity != self._kubelet_seen:
            self.status.kubelet_restarts += 1
            logs.event(self._log, "kubelet.restart_seen", socket=str(kubelet))
        self._kubelet_seen = identity
        request = api.RegisterRequest(
            version=API_VERSION, endpoint=self.settings.socket_name,
            resource_name=self.settings.resource_name,
            options=api.DevicePluginOptions(get_preferred_allocation_available=True))
        self._need_register = False
        try:
            with grpc.insecure_channel(f"unix://{kubelet}") as channel:
                api_pb2_grpc.RegistrationStub(channel).Register(request,
                                                                timeout=REGISTER_TIMEOUT)
        except grpc.RpcError as err:
            self._need_register = True
            self.status.registration_failures += 1
            self.status.last_error = f"{err.code().name}: {err.details()}"
            logs.event(self._log, "register.failed", logging.WARNING, kubelet=str(kubelet),
                       code=err.code().name, error=err.details())
            return False
        self.status.registrations += 1
        self.status.registered = True
        logs.event(self._log, "registered", endpoint=self.settings.socket_name,
                   slots=len(self.state.ids),
                   duration_ms=round((time.perf_counter() - started) * 1000, 2))
        return True

    def _safety_check(self) -> None:
        """Catch what a lost inotify event would hide; cheap: three stat calls."""
        self.device_changed()
        if _identity(self.settings.socket_path) != self._our_socket:
            logs.event(self._log, "socket.lost", socket=str(self.settings.socket_path))
            self._need_serve = True
        kubelet = _identity(self.settings.kubelet_socket)
        if kubelet is not None and kubelet != self._kubelet_seen:
            self._need_register = True
        if kubelet is None and self.status.registered:
            self.status.registered = False

    def _shutdown(self) -> None:
        self._observer.stop()
        self.state.close()
        if self._server is not None:
            self._server.stop(grace=STOP_GRACE).wait()
        # Remove the socket only if it is still ours: a successor may have replaced it.
        ours = self._our_socket
        if ours is not None and _identity(self.settings.socket_path) == ours:
            self.settings.socket_path.unlink(missing_ok=True)
        self._executor.shutdown(wait=False, cancel_futures=True)
        self.status.serving = False
        self.status.registered = False
        logs.event(self._log, "stopped", socket=str(self.settings.socket_path))
