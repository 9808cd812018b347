"""``fuse-device-plugin broker``: the node's FUSE mount broker.

One single-threaded loop (``selectors``) serves a ``SOCK_SEQPACKET`` socket in the broker
directory, which Allocate binds into containers. Each connection carries one request and
gets one reply. A connection is identified when it is accepted, and its request is
handled once it has arrived in full, so a client that connects and stays silent holds
nothing but its own slot until the deadline. Each request is short: one fusermount3 run and
one fuse-broker-enter run, each with a deadline.

Every request is logged in one line: ``broker.mount``, ``broker.unmount``,
``broker.refused`` (policy) or ``broker.failed`` (fusermount3 or the kernel said no).
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import selectors
import signal
import socket
import stat
import time
from dataclasses import dataclass
from pathlib import Path

from fuse_plugin import config, files, logs
from fuse_plugin.broker import caller as callers
from fuse_plugin.broker import kernel, policy, protocol
from fuse_plugin.broker.mounts import Mounter, MountFailed
from fuse_plugin.errors import EXIT_USAGE, Failure
from fuse_plugin.signals import stop_on_signals

DEFAULT_DIR = Path("/var/lib/fuse-device-plugin/broker")
DEFAULT_SHIM = Path("/usr/local/libexec/fuse-device-plugin/fusermount3")
DEFAULT_FUSERMOUNT = Path("/usr/bin/fusermount3")
DEFAULT_STAGING = Path("/run/fuse-broker-staging")
DEFAULT_MAX_MOUNTS = 32
# Built with the shim (scripts/build-native) and looked for beside it.
ENTER_NAME = "fuse-broker-enter"
MAX_CONNECTIONS = 64
REQUEST_DEADLINE = 5.0  # seconds from accept to a complete request


@dataclass(frozen=True)
class BrokerSettings:
    directory: Path = DEFAULT_DIR
    shim: Path = DEFAULT_SHIM
    fusermount: Path = DEFAULT_FUSERMOUNT
    staging: Path = DEFAULT_STAGING
    max_mounts: int = DEFAULT_MAX_MOUNTS
    log_format: str = "text"
    log_level: str = "info"


def _max_mounts(text: str) -> int:
    if not text.isdigit() or not 1 <= int(text) <= 10_000:
        raise argparse.ArgumentTypeError(f"must be a whole number from 1 to 10000, "
                                         f"got {text!r}")
    return int(text)


def add_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--dir", type=config.absolute_path, default=DEFAULT_DIR,
                        help="host directory for the socket and the shim; the plugin's "
                             f"--broker-dir (default: {DEFAULT_DIR})")
    parser.add_argument("--shim", type=config.absolute_path, default=DEFAULT_SHIM,
                        help=f"the built fusermount3 shim to install there; {ENTER_NAME} "
                             f"must be beside it (default: {DEFAULT_SHIM})")
    parser.add_argument("--fusermount", type=config.absolute_path,
                        default=DEFAULT_FUSERMOUNT,
                        help=f"the real fusermount3 (default: {DEFAULT_FUSERMOUNT})")
    parser.add_argument("--staging-dir", type=config.absolute_path, default=DEFAULT_STAGING,
                        help="where mounts are made before they move into the caller, in "
                             f"the broker's private namespace (default: {DEFAULT_STAGING})")
    parser.add_argument("--max-mounts", type=_max_mounts, default=DEFAULT_MAX_MOUNTS,
                        help="FUSE mounts one container may hold (default: "
                             f"{DEFAULT_MAX_MOUNTS})")
    parser.add_argument("--log-format", type=config.choice(logs.FORMATS), default="text",
                        help="text or json (default: text)")
    parser.add_argument("--log-level", type=config.choice(logs.LEVELS), default="info",
                        help="debug, info, warning or error (default: info)")


def command(args: argparse.Namespace) -> int:
    settings = BrokerSettings(
        directory=args.dir, shim=args.shim, fusermount=args.fusermount,
        staging=args.staging_dir, max_mounts=args.max_mounts,
        log_format=args.log_format, log_level=args.log_level)
    log = logs.setup(settings.log_format, settings.log_level)
    broker = Broker(settings, log)

    stop_on_signals(log, broker.stop)
    broker.start()
    return broker.run()


@dataclass
class _Connection:
    sock: socket.socket
    caller: callers.Caller | None
    refusal: str
    deadline: float


class Broker:
    def __init__(self, settings: BrokerSettings, log: logging.Logger) -> None:
        self.settings = settings
        self.log = log
        self.socket_path = settings.directory / protocol.SOCKET_NAME
        self.enter = settings.shim.parent / ENTER_NAME
        self.mounter = Mounter(settings.fusermount, self.enter, settings.staging)
        self._selector = selectors.DefaultSelector()
        self._listener: socket.socket | None = None
        self._inode = 0
        # Wakes the loop: signals (set_wakeup_fd, armed in start) and stop().
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._selector.register(self._wake_r, selectors.EVENT_READ, "wake")
        self._signals_wake = False
        self._stopping = False
        self._connections: dict[int, _Connection] = {}

    # -- start and stop ------------------------------------------------------------------

    def start(self) -> None:
        """Check the inputs, take a private namespace, install the shim, listen."""
        settings = self.settings
        for what, path in (("--shim", settings.shim), ("--fusermount", settings.fusermount),
                           (f"{ENTER_NAME} (beside --shim)", self.enter)):
            if not os.access(path, os.X_OK) or not path.is_file():
                raise Failure(f"{what} {path} is not an executable file", EXIT_USAGE)
        if settings.fusermount.read_bytes() == settings.shim.read_bytes():
            # In its own pod the broker gets broker mode's Allocate too, which binds the
            # shim over /usr/bin/fusermount3: it would be asking itself.
            raise Failure(f"--fusermount {settings.fusermount} is the broker's own shim; "
                          "point it at the real fusermount3", EXIT_USAGE)
        try:
            self.mounter.prepare()
        except OSError as err:
            raise Failure(f"cannot make the broker's private mount namespace: "
                          f"{err.strerror} (the broker needs CAP_SYS_ADMIN)") from None
        try:
            settings.directory.mkdir(parents=True, exist_ok=True)
            # Every container user must reach the socket through the directory's bind.
            settings.directory.chmod(0o755)
            shim = settings.directory / protocol.SHIM_NAME
            files.commit(files.staged(shim, settings.shim.read_bytes(), 0o755), shim)
            self._listen()
        except OSError as err:
            raise Failure(f"cannot serve in {settings.directory}: {err.strerror or err}") \
                from None
        signal.set_wakeup_fd(self._wake_w.fileno(), warn_on_full_buffer=False)
        self._signals_wake = True
        logs.event(self.log, "broker.serving", socket=str(self.socket_path),
                   shim=str(shim), fusermount=str(settings.fusermount),
                   max_mounts=settings.max_mounts)

    def _listen(self) -> None:
        path = self.socket_path
        if path.is_socket():
            with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as probe:
                try:
                    probe.connect(str(path))
                except OSError:
                    path.unlink()  # left by a broker that was killed
                else:
                    raise Failure(f"another broker is serving on {path}")
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        listener.bind(str(path))
        # Anyone who can reach the socket may ask; the kernel names them, policy decides.
        os.chmod(path, 0o666)
        listener.listen(64)
        listener.setblocking(False)
        self._inode = os.stat(path).st_ino
        self._listener = listener
        self._selector.register(listener, selectors.EVENT_READ, "listen")

    def stop(self) -> None:
        """Stop the loop from any thread (SIGTERM's handler calls this from a thread of
        its own). Setting the flag is not enough: the loop may have gone back to waiting
        after the signal's own wake-up and before the flag was set, and would then sleep
        up to a minute; so it is woken as well."""
        self._stopping = True
        with contextlib.suppress(OSError):  # full: a wake-up is pending anyway
            self._wake_w.send(b"\0")

    def _close(self) -> None:
        for conn in list(self._connections.values()):
            self._drop(conn)
        if self._listener is not None:
            self._listener.close()
            with contextlib.suppress(OSError):
                st = os.lstat(self.socket_path)
                if stat.S_ISSOCK(st.st_mode) and st.st_ino == self._inode:
                    self.socket_path.unlink()
        if self._signals_wake:
            signal.set_wakeup_fd(-1)
        self._selector.close()
        logs.event(self.log, "stopped")

    # -- the loop ------------------------------------------------------------------------

    def run(self) -> int:
        try:
            while not self._stopping:
                deadline = min((c.deadline for c in self._connections.values()),
                               default=time.monotonic() + 60)
                events = self._selector.select(max(0.0, deadline - time.monotonic()))
                for key, _ in events:
                    if key.data == "listen":
                        self._accept()
                    elif key.data == "wake":
                        with contextlib.suppress(BlockingIOError):
                            self._wake_r.recv(512)
                    else:
                        self._receive(key.data)
                self._expire()
                self.mounter.reap()
        finally:
            self._close()
        return 0

    def _accept(self) -> None:
        assert self._listener is not None
        while True:
            try:
                sock, _ = self._listener.accept()
            except BlockingIOError:
                return
            except OSError as err:  # out of fds: the request waits in the backlog
                logs.event(self.log, "broker.accept_failed", logging.ERROR,
                           reason=err.strerror or str(err))
                return
            sock.setblocking(False)
            conn = _Connection(sock, None, "", time.monotonic() + REQUEST_DEADLINE)
            if len(self._connections) >= MAX_CONNECTIONS:
                conn.refusal = (f"the broker is busy ({MAX_CONNECTIONS} requests open); "
                                "try again")
            else:
                try:
                    conn.caller = callers.identify(sock)
                except policy.Refused as refused:
                    conn.refusal = str(refused)
                except OSError as err:
                    conn.refusal = f"cannot identify the caller: {err.strerror or err}"
            self._connections[sock.fileno()] = conn
            self._selector.register(sock, selectors.EVENT_READ, conn)

    def _receive(self, conn: _Connection) -> None:
        try:
            data = conn.sock.recv(protocol.MAX_MESSAGE + 1)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if data:
            self._answer(conn, data)
        self._drop(conn)

    def _expire(self) -> None:
        now = time.monotonic()
        for conn in [c for c in self._connections.values() if c.deadline <= now]:
            self._reply(conn, protocol.encode(
                status="error", message=f"no complete request within {REQUEST_DEADLINE}s"))
            self._drop(conn)

    def _drop(self, conn: _Connection) -> None:
        self._connections.pop(conn.sock.fileno(), None)
        with contextlib.suppress(KeyError, ValueError):
            self._selector.unregister(conn.sock)
        conn.sock.close()
        if conn.caller is not None:
            conn.caller.close()

    def _reply(self, conn: _Connection, message: bytes, fds: tuple[int, ...] = ()) -> None:
        conn.sock.settimeout(1.0)
        with contextlib.suppress(OSError):
            socket.send_fds(conn.sock, [message], list(fds))

    # -- one request ---------------------------------------------------------------------

    def _answer(self, conn: _Connection, data: bytes) -> None:
        started = time.perf_counter()
        who = conn.caller
        fields: dict[str, object] = {}
        if who is not None:
            fields.update(pid=who.pid, uid=who.uid)
        fuse_fd = -1
        try:
            if conn.refusal:
                raise policy.Refused(conn.refusal)
            try:
                request = protocol.parse_request(data)
            except protocol.BadRequest as bad:
                raise policy.Refused(str(bad)) from None
            fields.update(op=request.op, path=request.path)
            if request.op == "mount":
                fields["options"] = request.options
            assert who is not None
            policy.caller(who.uid)
            who.open()
            fields.update(namespace=who.namespace, cgroup=who.cgroup)
            if request.op == "mount":
                fuse_fd, mount_id = self._mount(who, request)
                fields["mount_id"] = mount_id
                reply = protocol.encode(status="ok", mount_id=str(mount_id))
            else:
                fields["mount_id"] = self._unmount(who, request)
                reply = protocol.encode(status="ok")
            event, level = f"broker.{request.op}", logging.INFO
        except policy.Refused as refused:
            reply = protocol.encode(status="error", message=f"broker refused: {refused}")
            event, level, fields["reason"] = "broker.refused", logging.WARNING, str(refused)
        except (MountFailed, OSError) as failed:
            text = str(failed) if isinstance(failed, MountFailed) else \
                f"{failed.strerror or failed}"
            reply = protocol.encode(status="error", message=f"broker: {text}")
            event, level, fields["reason"] = "broker.failed", logging.ERROR, text
        except Exception as bug:  # one request must never take the node's broker down
            text = f"internal error ({type(bug).__name__}: {bug})"
            reply = protocol.encode(status="error", message=f"broker: {text}")
            event, level, fields["reason"] = "broker.failed", logging.ERROR, text
        # Logged before the reply: whoever sees the answer can already find its line.
        fields["duration_ms"] = round((time.perf_counter() - started) * 1000, 2)
        logs.event(self.log, event, level, **fields)
        try:
            self._reply(conn, reply, (fuse_fd,) if fuse_fd != -1 else ())
        finally:
            if fuse_fd != -1:
                os.close(fuse_fd)

    def _mount(self, who: callers.Caller, request: protocol.Request) -> tuple[int, int]:
        path = policy.path(request.path)
        options = policy.options(request.options)
        mounts = who.mounts()
        policy.inside_fuse(path, mounts)
        policy.room_for_another(mounts, self.settings.max_mounts)
        target = who.resolve(path)
        _not_shared(target, mounts)
        return self.mounter.mount(who.ns_fd, target, options)

    def _unmount(self, who: callers.Caller, request: protocol.Request) -> int:
        path = policy.path(request.path)
        mounts = who.mounts()
        entry = policy.fuse_mount_at(path, mounts)
        if request.mount_id is not None and request.mount_id != entry.mount_id:
            raise policy.Refused(f"{path!r} is now a different mount (id {entry.mount_id}, "
                                 f"not {request.mount_id})")
        parent, name = policy.parent_and_name(path)
        policy.inside_fuse(parent, mounts)
        self.mounter.unmount(who.ns_fd, who.resolve(parent), name,
                             lazy="lazy" in request.flags)
        return entry.mount_id


def _not_shared(target_fd: int, mounts: list[policy.MountEntry]) -> None:
    """Refuse a mountpoint on a shared mount: the FUSE mount would propagate to its
    peers, which may be outside the container."""
    mount_id = kernel.fd_mount_id(target_fd)
    if any(m.mount_id == mount_id and m.shared for m in mounts):
        raise policy.Refused("the mountpoint is on a shared mount: the FUSE mount would "
                             "propagate out of the container")
