"""Our socket, the gRPC server, Register, watching the kubelet, and shutdown.

Follow a kubelet restart here: the kubelet deletes every socket in its directory and
then creates a new ``kubelet.sock``. watchdog (inotify) reports both; its thread only
marks what changed and wakes the loop, and the loop thread alone changes state: it
re-creates our socket, serves on it, and registers. Register runs as a future, so a
kubelet that restarts mid-call is dropped at once for the new one. A slow periodic
check catches anything a lost event would miss, whatever else is failing. The device
model and the RPCs live in ``devices`` and ``servicer``; nothing here knows what a FUSE
device is.

Follow a rollout here too: with ``--instance`` our socket's name is ours alone, so a new
pod serves and registers beside the old one (the kubelet keeps both endpoints). On
SIGTERM, ``--handoff-wait`` keeps the loop turning until another instance for our
resource says it is registered (``handoff``); only then does the socket go.
"""

from __future__ import annotations

import enum
import logging
import threading
import time
from collections.abc import Sequence
from concurrent import futures
from dataclasses import dataclass
from pathlib import Path

import grpc
from watchdog.events import FileSystemEvent, FileSystemEventHandler
from watchdog.observers import Observer

from fuse_plugin import files, grpc_unix, logs, sockets
from fuse_plugin.api import api_pb2 as api
from fuse_plugin.api import api_pb2_grpc
from fuse_plugin.config import API_VERSION, Settings, sibling_socket
from fuse_plugin.deviceplugin import handoff
from fuse_plugin.deviceplugin.servicer import WORKERS, FuseServicer, add_to_server
from fuse_plugin.devices import DeviceState
from fuse_plugin.stats import Stats
from fuse_plugin.watches import DirectoryWatches, event_paths

# How often the safety net re-checks sockets, the directory and the device.
SAFETY_INTERVAL = 5.0
# Retries of Register and of serving back off from FIRST to CAP seconds; any event
# about the kubelet or our socket retries at once.
BACKOFF_FIRST = 0.02
BACKOFF_CAP = 5.0
# The kubelet answers Register after dialling us back; it never takes seconds.
REGISTER_TIMEOUT = 5.0
STOP_GRACE = 1.0
# Liveness: the loop turns at least every SAFETY_INTERVAL; three missed turns mean stuck.
STUCK_AFTER = 3 * SAFETY_INTERVAL
# Each Register gets a channel of its own with its own subchannels: grpcio otherwise
# shares subchannels between every channel to the same target, so a connection that a
# restarting kubelet reset mid-write could outlive the channel that made it.
REGISTER_CHANNEL_OPTIONS = [("grpc.use_local_subchannel_pool", 1),
                            ("grpc.enable_retries", 0)]

@dataclass
class Status:
    """What the loop has done, for probes and metrics. Written by the loop thread only."""

    registered: bool = False
    serving: bool = False
    last_error: str = ""
    # time.monotonic() of the loop's last turn: the liveness probe's heartbeat.
    last_turn: float = 0.0


class Change(enum.Enum):
    """What an inotify event (or the safety net) says changed; the loop acts on them."""

    DEVICE = "device"  # one of the device's files (``Lifecycle.device_files``)
    KUBELET = "kubelet"  # a kubelet.sock appeared or went
    SOCKET = "socket"  # our socket file
    DIRECTORY = "directory"  # the device-plugin directory itself went or came back
    SIBLING = "sibling"  # another socket our resource's plugins may serve


@dataclass
class _Registration:
    """A Register call in flight: its future, its own channel, and when to give up."""

    call: grpc.Future[api.Empty]
    channel: grpc.Channel
    deadline: float


class _Events(FileSystemEventHandler):
    """Turns inotify events into marks for the loop; runs on watchdog's thread."""

    def __init__(self, plugin: Lifecycle) -> None:
        self._plugin = plugin
        self._siblings = sibling_socket(plugin.settings.resource_name)

    def on_any_event(self, event: FileSystemEvent) -> None:
        settings = self._plugin.settings
        paths = event_paths(event)
        # A device file changed, or a directory holding one came or went.
        if paths & self._plugin.device_watch:
            self._plugin.mark(Change.DEVICE)
        if str(settings.kubelet_socket) in paths:
            self._plugin.mark(Change.KUBELET)
        if str(settings.socket_path) in paths:
            self._plugin.mark(Change.SOCKET)
        if str(settings.device_plugin_dir) in paths and event.event_type != "modified":
            self._plugin.mark(Change.DIRECTORY)  # the directory itself went or came back
        if any(self._is_sibling(Path(p)) for p in paths):
            self._plugin.mark(Change.SIBLING)

    def _is_sibling(self, path: Path) -> bool:
        settings = self._plugin.settings
        return path.parent == settings.device_plugin_dir and \
            path.name != settings.socket_name and bool(self._siblings.fullmatch(path.name))


class Lifecycle:
    """Serve, register, re-register; one loop thread owns every state change."""

    def __init__(self, settings: Settings, state: DeviceState, servicer: FuseServicer,
                 log: logging.Logger, stats: Stats, *,
                 device_files: Sequence[Path] = ()) -> None:
        """``device_files``: the files whose change may change the device's health (the
        prober reads them); the device node when none are given."""
        self.settings = settings
        self.state = state
        self.device_files = tuple(device_files) or (settings.fuse_device,)
        self.device_watch = {str(p) for f in self.device_files for p in (f, f.parent)}
        self.servicer = servicer
        self.status = Status()
        self._log = log
        self._stats = stats
        self._wake = threading.Event()
        self._stop = threading.Event()
        # Notified after every turn of the loop and when it stops: registered_within waits
        # on it.
        self.turned = threading.Condition()
        self._marks: set[Change] = set()
        self._marks_lock = threading.Lock()
        self._need_serve = True
        self._need_register = True
        self._kubelet_seen: files.Identity | None = None
        self._our_socket: files.Identity | None = None
        self._server: grpc.Server | None = None
        self._pending: _Registration | None = None
        self._register_started = 0.0
        self._asked_before = False  # any Register sent: a new kubelet.sock is a restart
        self._retry_at = 0.0
        self._backoff = BACKOFF_FIRST
        self._in_use_logged = False
        # After stop(): the successors asked (--handoff-wait), until when, and whether
        # the hand-off is over; a second stop() hurries it.
        self._handoff: handoff.Successors | None = None
        self._handoff_started = 0.0
        self._handoff_deadline = 0.0
        self._handoff_over = False
        self._hurry = threading.Event()
        self._stop_lock = threading.Lock()
        self._executor = futures.ThreadPoolExecutor(max_workers=WORKERS,
                                                    thread_name_prefix="grpc")
        # Its threads wake every `timeout` s to check for stop; the safety net is as slow.
        self._observer = Observer(timeout=SAFETY_INTERVAL)
        self._watches = DirectoryWatches(self._observer, _Events(self), log)
        self._running = False

    # -- called from other threads -------------------------------------------------

    def stop(self) -> None:
        """Stop: at once, or after the hand-off (``--handoff-wait``); a second call
        gives the hand-off up."""
        with self._stop_lock:  # two signals at once are two stops, not one
            if self._stop.is_set():
                self._hurry.set()
            self._stop.set()
        self._wake.set()

    def mark(self, what: Change) -> None:
        """Note that something changed; the loop acts on it at its next turn."""
        with self._marks_lock:
            self._marks.add(what)
        self._wake.set()

    def alive(self, now: float | None = None) -> bool:
        """Liveness: the loop runs and turned recently, and inotify still reports."""
        now = time.monotonic() if now is None else now
        return self._running and self._observer.is_alive() and \
            now - self.status.last_turn < STUCK_AFTER

    def registered_within(self, timeout: float) -> bool:
        """Whether the kubelet has accepted us, waiting up to ``timeout`` seconds for it
        (a successor's answer to an old plugin handing off); False once we stop."""
        with self.turned:
            self.turned.wait_for(lambda: self.status.registered or not self._running,
                                 timeout)
        return self.status.registered and self._running

    # -- the loop ------------------------------------------------------------------

    def run(self) -> int:
        """Run until ``stop()``; returns the process exit code."""
        self._observer.daemon = True
        self._observer.start()
        self._rewatch()
        handoff.remove_stale(self.settings, self._log)
        logs.event(self._log, "start", socket=str(self.settings.socket_path),
                   device=str(self.state.device), health=self.state.health.value,
                   slots=len(self.state.ids), reason=self.state.reason)
        next_safety = time.monotonic() + SAFETY_INTERVAL
        self._running = True
        try:
            while not self._stop.is_set() or self._handing_off(time.monotonic()):
                now = time.monotonic()
                self.status.last_turn = now
                self._wake.clear()
                if now >= next_safety:
                    self._safety_check()
                    next_safety = now + SAFETY_INTERVAL
                self._turn(now)
                with self.turned:
                    self.turned.notify_all()
                deadline = next_safety
                if self._retry_waits():
                    deadline = min(deadline, self._retry_at)
                if self._pending is not None:
                    deadline = min(deadline, self._pending.deadline)
                if self._handoff is not None:
                    deadline = min(deadline, self._handoff_deadline)
                self._wake.wait(max(0.0, deadline - time.monotonic()))
        finally:
            self._running = False
            self._shutdown()
        return 0

    def _take_marks(self) -> set[Change]:
        with self._marks_lock:
            marks, self._marks = self._marks, set()
        return marks

    def _turn(self, now: float) -> None:
        self._check_register()
        marks = self._take_marks()
        if Change.DIRECTORY in marks:
            self._rewatch()
        if Change.DEVICE in marks:
            self._refresh_device()
        if Change.SIBLING in marks and self._handoff is not None:
            self._handoff.look()
        if marks & {Change.SOCKET, Change.DIRECTORY} and not self.owns_socket():
            self._need_serve = True
            self._retry_at = now  # our socket went: no reason to wait
        if marks & {Change.KUBELET, Change.DIRECTORY}:
            self._kubelet_changed()
            self._retry_at = now
        if now < self._retry_at:
            return
        if self._server is not None and not self.owns_socket():
            self._need_serve = True
        if self._need_serve:
            self._serve()
        if not self._need_serve and self._need_register and self._pending is None:
            self._register()

    def _handing_off(self, now: float) -> bool:
        """After stop(): whether to keep serving because a successor may still register.

        Only a registered plugin hands off: the kubelet has no endpoint of ours to lose
        otherwise. The hand-off ends when a sibling socket answers that it is registered
        for our resource, at ``--handoff-wait``, or at a second stop().
        """
        if self._handoff_over:
            return False
        if self._handoff is None:
            if not self.settings.handoff_wait or not self.status.registered \
                    or self._hurry.is_set():
                self._handoff_over = True
                return False
            self._handoff_started = now
            self._handoff_deadline = now + self.settings.handoff_wait
            self._handoff = handoff.Successors(self.settings, self._handoff_deadline,
                                               time.monotonic, self._wake.set)
            logs.event(self._log, "handoff.waiting", socket=str(self.settings.socket_path),
                       seconds=self.settings.handoff_wait)
            self._handoff.look()
        found = self._handoff.collect()
        waited = round((now - self._handoff_started) * 1000, 1)
        if found:
            logs.event(self._log, "handoff.done", successor=found, waited_ms=waited)
        elif self._hurry.is_set():
            logs.event(self._log, "handoff.abandoned", logging.WARNING, waited_ms=waited,
                       reason="stopped again")
        elif now >= self._handoff_deadline:
            logs.event(self._log, "handoff.timeout", logging.WARNING, waited_ms=waited,
                       reason="no other instance registered for the resource: the kubelet "
                       "marks its devices unhealthy when this socket goes")
        else:
            return True
        self._end_handoff()
        return False

    def _end_handoff(self) -> None:
        self._handoff_over = True
        if self._handoff is not None:
            self._handoff.close()
            self._handoff = None

    def _retry_waits(self) -> bool:
        """Something waits only for its retry time. Register without a kubelet.sock waits
        for inotify (or the safety net) instead: counting it here spun the loop."""
        return self._need_serve or (self._need_register and self._pending is None
                                    and self.settings.kubelet_socket.exists())

    def _retry_later(self) -> None:
        self._retry_at = time.monotonic() + self._backoff
        self._backoff = min(self._backoff * 2, BACKOFF_CAP)

    def _refresh_device(self) -> None:
        changed = self.state.refresh()
        if changed:
            logs.event(self._log, "device.health", health=changed.health.value,
                       reason=changed.reason, slots=len(self.state.ids))

    def _kubelet_changed(self) -> None:
        """kubelet.sock appeared, went or was replaced: decide whether to register."""
        kubelet = files.identity(self.settings.kubelet_socket)
        if kubelet is None:
            if self.status.registered:
                logs.event(self._log, "kubelet.gone",
                           socket=str(self.settings.kubelet_socket))
            # A kubelet.sock made in the same clock tick may reuse inode and ctime: the
            # next one is a new kubelet even when its identity matches the last.
            self._kubelet_seen = None
            self.status.registered = False
            self._cancel_register()
            return
        if kubelet != self._kubelet_seen:
            self._cancel_register()  # a Register still in flight went to the old kubelet
            self._need_register = True
        elif not self.status.registered and self._pending is None:
            self._need_register = True

    def _watch_targets(self) -> list[Path]:
        targets = [self.settings.device_plugin_dir, self.settings.device_plugin_dir.parent]
        # Each device file's directory, and that one's parent: a directory may be made
        # after we start (the broker's, by the broker).
        for extra in (d for f in self.device_files for d in (f.parent, f.parent.parent)):
            if extra not in targets:
                targets.append(extra)
        return targets

    def _rewatch(self) -> None:
        """(Re)arm inotify on each directory we watch whose inode changed. Watching each
        one's parent as well tells us when it comes back, so its watch is re-armed at
        once."""
        self._watches.rearm(self._watch_targets())

    def owns_socket(self) -> bool:
        """True when the socket file at our path is the one our running server bound.

        Deletion events arrive after the fact, and we delete socket files ourselves (a
        stale one, the old one when re-serving): an event only means "re-serve" if the
        file at the path is no longer ours. "No file" is never "our file".
        """
        current = files.identity(self.settings.socket_path)
        return self._server is not None and current is not None and \
            current == self._our_socket

    def _serve(self) -> None:
        """(Re)create our socket and serve on it; a stale file from a crash is removed,
        a socket another process is serving on is left alone."""
        started = time.perf_counter()
        path = self.settings.socket_path
        self._stop_server()
        try:
            sockets.take_over(path, self._log)
        except sockets.InUse:
            if not self._in_use_logged:
                logs.event(self._log, "socket.in_use", logging.WARNING, socket=str(path),
                           reason="another process serves this socket; waiting")
                self._in_use_logged = True
            self.status.last_error = f"another process serves {path}"
            self._retry_later()
            return
        except OSError as err:
            self._serve_failed(f"cannot remove stale {path}: {err.strerror}")
            return
        server = grpc_unix.server(self._executor)
        add_to_server(self.servicer, server)
        handoff.add_to_server(server, self.settings.resource_name, self.registered_within)
        if not grpc_unix.bind(server, path):
            server.stop(None)
            where = path.parent
            reason = (f"{where} does not exist" if not where.is_dir()
                      else f"cannot bind {path}")
            self._serve_failed(reason)
            return
        server.start()
        identity = files.identity(path)
        self._server = server
        if identity is None:
            # Deleted between bind and now (a kubelet wiping the directory): serve again.
            self._serve_failed(f"{path} vanished right after it was bound")
            return
        self._our_socket = identity
        self._need_serve = False
        self._in_use_logged = False
        self._backoff = BACKOFF_FIRST
        self.status.serving = True
        # A new socket means the kubelet no longer knows us: register again (after
        # collecting or dropping a Register sent for the old socket).
        self._cancel_register()
        self._need_register = True
        self.status.registered = False
        logs.event(self._log, "serving", socket=str(path),
                   duration_ms=round((time.perf_counter() - started) * 1000, 2))

    def _serve_failed(self, reason: str) -> None:
        self.status.serving = False
        self.status.last_error = reason
        logs.event(self._log, "serve.failed", logging.WARNING,
                   socket=str(self.settings.socket_path), error=reason)
        self._retry_later()

    def _stop_server(self) -> None:
        if self._server is None:
            return
        # gRPC unlinks a unix socket's path when its listener shuts down: wait for that
        # to finish, or it would delete the socket a new server binds.
        self._server.stop(grace=None).wait()
        self._server = None
        self._our_socket = None
        self.status.serving = False

    def _register(self) -> None:
        kubelet = self.settings.kubelet_socket
        identity = files.identity(kubelet)
        if identity is None:
            return
        if not self.owns_socket():
            # Looked at after kubelet.sock: a kubelet wipes our socket before it creates
            # its own, so a socket still here now is one the new kubelet will dial.
            self._need_serve = True
            return
        if self._asked_before and identity != self._kubelet_seen:
            self._stats.kubelet_restarted()
            logs.event(self._log, "kubelet.restart_seen", socket=str(kubelet))
        self._kubelet_seen = identity
        self._asked_before = True
        request = api.RegisterRequest(
            version=API_VERSION, endpoint=self.settings.socket_name,
            resource_name=self.settings.resource_name,
            options=api.DevicePluginOptions(get_preferred_allocation_available=True))
        self._need_register = False
        channel = grpc.insecure_channel(f"unix://{kubelet}", REGISTER_CHANNEL_OPTIONS)
        call = api_pb2_grpc.RegistrationStub(channel).Register.future(
            request, timeout=REGISTER_TIMEOUT)
        call.add_done_callback(lambda _call: self._wake.set())
        self._pending = _Registration(call, channel,
                                      time.monotonic() + REGISTER_TIMEOUT + 0.1)
        self._register_started = time.perf_counter()

    def _check_register(self) -> None:
        """Collect a finished Register, if any."""
        if self._pending is None or not self._pending.call.done():
            return
        call, channel = self._pending.call, self._pending.channel
        self._pending = None
        channel.close()
        try:
            call.result()
        except grpc.FutureCancelledError:
            return
        except grpc.RpcError as err:
            code = err.code()
            self._need_register = True
            self._stats.registration_failed()
            self.status.last_error = f"{code.name}: {err.details()}"
            logs.event(self._log, "register.failed", logging.WARNING,
                       kubelet=str(self.settings.kubelet_socket), code=code.name,
                       error=err.details())
            self._retry_later()
            return
        self._stats.registered()
        self._need_register = False
        self._backoff = BACKOFF_FIRST
        self.status.registered = True
        self.status.last_error = ""
        logs.event(self._log, "registered", endpoint=self.settings.socket_name,
                   slots=len(self.state.ids),
                   duration_ms=round((time.perf_counter() - self._register_started) * 1000,
                                     2))

    def _cancel_register(self) -> None:
        self._check_register()  # an answer already in counts, even if its kubelet left
        if self._pending is None:
            return
        call, channel = self._pending.call, self._pending.channel
        self._pending = None
        call.cancel()
        channel.close()
        self._need_register = True

    def _safety_check(self) -> None:
        """Catch what a lost inotify event would hide; cheap: a few stat calls."""
        self._rewatch()
        self._refresh_device()
        if self._server is not None and not self.owns_socket():
            logs.event(self._log, "socket.lost", socket=str(self.settings.socket_path))
            self._need_serve = True
            self._retry_at = 0.0
        if self._pending is not None and time.monotonic() > self._pending.deadline:
            self._cancel_register()  # a lost completion: never wait on it for good
        if self._handoff is not None:
            self._handoff.look()  # a sibling whose event was lost, or that failed
        kubelet = files.identity(self.settings.kubelet_socket)
        if kubelet is None or kubelet != self._kubelet_seen or not self.status.registered:
            self._kubelet_changed()

    def _shutdown(self) -> None:
        with self.turned:
            self.turned.notify_all()  # Registered calls waiting on us: we stop
        self._end_handoff()
        self._observer.stop()
        self._cancel_register()
        self.state.close()
        if self._server is not None:
            self._server.stop(grace=STOP_GRACE).wait()
        # Remove the socket only if it is still ours: a successor may have replaced it.
        ours = self._our_socket
        if ours is not None and files.identity(self.settings.socket_path) == ours:
            self.settings.socket_path.unlink(missing_ok=True)
        self._executor.shutdown(wait=False, cancel_futures=True)
        self.status.serving = False
        self.status.registered = False
        logs.event(self._log, "stopped", socket=str(self.settings.socket_path))
