"""LXCFS views through the broker: the node's lxcfs files bound over a container's own
/proc files, on the container's one request, and bound again whenever lxcfs comes back.

Three parties (docs/broker-internals.md, "LXCFS views"):

- **lxcfs**, one per node, in its own DaemonSet (``lxcfs_daemon``): it mounts lxcfs at
  MOUNTPOINT inside its own container's mount namespace (never on the host, so no stale
  host mount can outlive it or block its re-creation) and announces itself on the
  broker's lxcfs socket (``--lxcfs-dir``, a host directory bound into the broker and
  lxcfs pods only, never into a tenant's). The connection stays open: its end is lxcfs's.
- **a consumer**: a container holding the device runs ``fusermount3 --lxcfs -- CMD``
  (the shim, bound into it by Allocate). It sends ``op=lxcfs`` and nothing else: no
  path, no option. The kernel names the caller (``caller.identify``) as for a mount.
- **the broker** (``Views``, in the loop's selector): for a request, and for every
  recorded consumer when a new lxcfs announces itself, it runs ``fuse-broker-lxcfs``
  (``native/lxcfs.c``), which clones lxcfs's files in lxcfs's namespace and moves them
  over exactly FILES in the consumer's namespace, after checking Allocate's bind is
  there and removing only binds of lxcfs left by an earlier one. It records the asking
  process (a pidfd and its mount namespace) and drops the record when that process
  exits: the wrapper execs CMD, so the record lives as long as the workload.

A request while no lxcfs serves is refused with ``later=1``; the shim asks again for up
to its wait (``FUSE_BROKER_WAIT``, 30 s) and then fails without running CMD, so a pod
that starts before lxcfs waits, and one that waits too long restarts.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import os
import selectors
import signal
import socket
import struct
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from fuse_plugin import logs, sockets
from fuse_plugin.broker import caller as callers
from fuse_plugin.broker import cgroups, policy, protocol
from fuse_plugin.broker.conversation import Conversation
from fuse_plugin.broker.lxcfs_records import Consumer, ConsumerRecords

OP = "lxcfs"
TOOL_NAME = "fuse-broker-lxcfs"
SOCKET_NAME = "lxcfs.sock"
DEFAULT_DIR = Path("/run/fuse-device-plugin/lxcfs")
# Where lxcfs is mounted inside its own container (native/lxcfs.c's LXCFS_DIR).
MOUNTPOINT = "/var/lib/lxcfs"
# The files bound, and nothing else (native/lxcfs.c's TARGETS; a unit test compares).
FILES = ("/proc/cpuinfo", "/proc/meminfo", "/proc/stat", "/proc/uptime",
         "/proc/diskstats", "/proc/swaps", "/proc/loadavg", "/sys/devices/system/cpu/online")
# In a refusal: no lxcfs serves on this node yet; the shim asks again within its wait.
LATER_FIELD = "later"
BIND_DEADLINE = 5.0  # seconds a bind may take (lxcfs answers lookups); then it is killed
PER_CONTAINER = 4  # processes of one container recorded as consumers at once
RUNNING = 8  # binds at work at once, node-wide; heals queue behind them
REFUSED_EXIT = 2  # fuse-broker-lxcfs: a rule said no (1: the kernel did)


@dataclass(eq=False)
class Instance:
    """An lxcfs that announced itself: its connection, and its mount namespace."""

    sock: socket.socket
    pid: int
    mnt_ns: int

    def close(self) -> None:
        self.sock.close()
        with contextlib.suppress(OSError):
            os.close(self.mnt_ns)


@dataclass(eq=False)
class Bind:
    """One run of fuse-broker-lxcfs for a consumer: for its request (``conversation``) or a
    heal (no ``conversation``)."""

    consumer: Consumer
    instance: Instance
    conversation: Conversation | None
    proc: subprocess.Popen[bytes] | None = None
    pidfd: int = -1
    deadline: float = 0.0
    killed: bool = False  # past its deadline and sent SIGKILL: its pod's until it exits
    started: float = field(default_factory=time.perf_counter)

    @property
    def pod(self) -> str:
        return policy.pod_of(self.consumer.container)


@dataclass(frozen=True)
class Event:
    """What the selector hands back for this module's files."""

    kind: str  # listen, instance, bind, consumer
    target: object


def _announcer(sock: socket.socket) -> tuple[int, int]:
    """The announcing process's pid and mount namespace, held by its pidfd: the namespace
    is opened through /proc/PID and kept only if that pidfd still names a live process
    then, so a pid reused after lxcfs died never hands the broker another process's
    namespace to bind from. ``policy.Refused`` if it has exited."""
    creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED,
                            struct.calcsize(callers.UCRED))
    pid = struct.unpack(callers.UCRED, creds)[0]
    pidfd = callers.peer_pidfd(sock, pid)
    try:
        mnt_ns = os.open(f"/proc/{pid}/ns/mnt", os.O_RDONLY | os.O_CLOEXEC)
        if not callers.alive(pidfd):
            os.close(mnt_ns)
            raise policy.Refused(f"the announcing process {pid} has exited", "caller")
    finally:
        os.close(pidfd)
    return pid, mnt_ns


def asks(data: bytes) -> bool:
    """Whether a message on the broker socket is this module's request (op=lxcfs)."""
    try:
        return protocol.decode(data).get("op") == OP
    except protocol.BadRequest:
        return False


def check_request(data: bytes) -> None:
    """The request is fixed: ``v`` and ``op`` and nothing else, so nothing a caller
    sends can name a path, a file or another container."""
    fields = protocol.decode(data)
    extra = sorted(set(fields) - {"v", "op"})
    if extra:
        raise policy.Refused(f"an lxcfs request takes no field but v and op, got "
                             f"{', '.join(extra)[:100]}: the files and where they go are "
                             "fixed", "request")
    if fields.get("v") != protocol.VERSION:
        raise policy.Refused(f"protocol version {fields.get('v', '')[:10]!r} is not "
                             f"{protocol.VERSION!r}: the shim and the broker come from "
                             "different releases", "request")


class Views:
    """The broker's side of LXCFS views, driven by the loop (``server.Broker``)."""

    def __init__(self, selector: selectors.BaseSelector, *, tool: Path, directory: Path,
                 state: Path, mark: policy.Mark, charge: cgroups.Charge,
                 log: logging.Logger,
                 answer: Callable[[Conversation, policy.Refused | str | None, bool], None]
                 ) -> None:
        self.selector = selector
        self.tool = tool
        self.directory = directory
        self.mark = mark
        self.charge = charge  # the tool runs in its consumer's cgroups, as helpers do
        self.log = log
        # answer(conversation, None, _): ok; a Refused: refused (later: asks again); a str:
        # failed.
        self.answer = answer
        self.instance: Instance | None = None
        self.consumers: list[Consumer] = []
        self.running: list[Bind] = []
        self.queued: collections.deque[Bind] = collections.deque()
        self._listener: socket.socket | None = None
        self.records = ConsumerRecords(state)

    # -- lxcfs's side --------------------------------------------------------------------

    def start(self) -> None:
        """Listen for lxcfs on its own socket, in a directory only root may enter."""
        directory = self.directory
        directory.mkdir(parents=True, exist_ok=True)
        directory.chmod(0o700)
        path = directory / SOCKET_NAME
        try:
            sockets.take_over(path, self.log, socket.SOCK_SEQPACKET)
        except sockets.InUse:
            raise OSError(f"another broker is serving lxcfs on {path}") from None
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        listener.bind(str(path))
        os.chmod(path, 0o600)
        listener.listen(8)
        listener.setblocking(False)
        self._listener = listener
        self.selector.register(listener, selectors.EVENT_READ, Event("listen", listener))
        for consumer in self.records.load():  # a restarted broker's: healed from now on
            self._watch(consumer)
        if self.consumers:
            logs.event(self.log, "broker.lxcfs_consumers_loaded", count=len(self.consumers))

    def _watch(self, consumer: Consumer) -> None:
        self.consumers.append(consumer)
        self.selector.register(consumer.pidfd, selectors.EVENT_READ, Event("consumer", consumer))

    def handle(self, event: Event) -> None:
        if event.kind == "listen":
            self._accept()
        elif event.kind == "instance":
            assert isinstance(event.target, Instance)
            self._instance_spoke(event.target)
        elif event.kind == "bind":
            assert isinstance(event.target, Bind)
            self._finished(event.target)
        elif event.kind == "consumer":
            assert isinstance(event.target, Consumer)
            self._drop(event.target)

    def _accept(self) -> None:
        assert self._listener is not None
        try:
            sock, _ = self._listener.accept()
        except OSError:
            return
        try:
            pid, mnt_ns = _announcer(sock)
        except (OSError, policy.Refused) as err:
            logs.event(self.log, "broker.lxcfs_refused", logging.WARNING,
                       reason=f"cannot open the announcing process's mount namespace: "
                              f"{err.strerror if isinstance(err, OSError) else err}")
            sock.close()
            return
        sock.setblocking(False)
        instance = Instance(sock, pid, mnt_ns)
        self.selector.register(sock, selectors.EVENT_READ, Event("instance", instance))

    def _instance_spoke(self, instance: Instance) -> None:
        """Its announcement (op=serving), or the end of its connection: lxcfs is gone."""
        try:
            data = instance.sock.recv(protocol.MAX_MESSAGE)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        try:
            serving = bool(data) and protocol.decode(data).get("op") == "serving"
        except protocol.BadRequest:
            serving = False
        if not serving:
            self.selector.unregister(instance.sock)
            instance.close()
            if self.instance is instance:
                self.instance = None
                logs.event(self.log, "broker.lxcfs_gone", logging.WARNING, pid=instance.pid,
                           consumers=len(self.consumers))
            return
        with contextlib.suppress(OSError):
            instance.sock.send(protocol.encode(status="ok"))
        old, self.instance = self.instance, instance
        if old is not None and old is not instance:
            with contextlib.suppress(KeyError):
                self.selector.unregister(old.sock)
            old.close()
        logs.event(self.log, "broker.lxcfs_serving", pid=instance.pid,
                   healing=len(self.consumers))
        for consumer in self.consumers:
            self._queue(Bind(consumer, instance, None))

    # -- consumers -----------------------------------------------------------------------

    def request(self, conversation: Conversation, data: bytes) -> None:
        """A container asks for the views (op=lxcfs). Answered through ``answer``."""
        conversation.fields.update(op=OP)
        try:
            check_request(data)
            if any(b.consumer.container == conversation.container for b in (*self.running,
                                                                      *self.queued)):
                raise policy.Refused("an lxcfs bind for this container is under way; try "
                                     "again", "busy")
            if self._stuck(policy.pod_of(conversation.container)):
                raise policy.Refused("an earlier lxcfs bind for this pod was killed at its "
                                     "deadline and has not ended yet; try again", "busy")
            if sum(1 for c in self.consumers if c.container == conversation.container) \
                    >= PER_CONTAINER:
                raise policy.Refused(f"this container already has {PER_CONTAINER} "
                                     "processes recorded for lxcfs views", "quota")
            conversation.caller.open()
        except policy.Refused as refused:
            self.answer(conversation, refused, False)
            return
        if self.instance is None:
            self.answer(conversation, policy.Refused("no lxcfs serves on this node (deploy "
                                             "manifests/broker/lxcfs-daemonset.yaml; it "
                                             "may be starting)", "busy"), True)
            return
        who = conversation.caller
        try:
            consumer = Consumer(who.container, who.pid, os.dup(who.pidfd), os.dup(who.mnt_ns))
        except OSError as err:
            self.answer(conversation, policy.OutOfResources("recording the consumer", err), False)
            return
        self._queue(Bind(consumer, self.instance, conversation))

    def _queue(self, bind: Bind) -> None:
        self.queued.append(bind)
        self._next()

    def _stuck(self, pod: str) -> bool:
        """Whether a bind for this pod was killed and has not exited: one that waits in
        the kernel on something of the pod's costs the pod (no more binds for it), never
        the node's slots."""
        return any(b.killed and b.pod == pod for b in self.running)

    def _next(self) -> None:
        while self.queued and sum(not b.killed for b in self.running) < RUNNING:
            bind = self.queued.popleft()
            if bind.instance is not self.instance:  # superseded: the new one's heal binds
                self._settle(bind, "lxcfs restarted during the bind; try again")
                continue
            if self._stuck(bind.pod):
                self._settle(bind, "an earlier lxcfs bind for this pod has not ended")
                continue
            try:
                self._start(bind)
            except policy.Refused as refused:
                self._settle(bind, refused)
                continue
            except OSError as err:
                self._settle(bind, f"cannot start {TOOL_NAME}: {err.strerror or err}")
                continue
            bind.deadline = time.monotonic() + BIND_DEADLINE
            self.running.append(bind)
            self.selector.register(bind.pidfd, selectors.EVENT_READ, Event("bind", bind))

    def _start(self, bind: Bind) -> None:
        """The tool, in its consumer's cgroups (``cgroups``: it moves itself there before
        anything else), so the work done for a container is charged to it. Refused if
        the consumer has exited or its cgroups cannot be written."""
        consumer = bind.consumer
        charge = self.charge.open(consumer.pid)
        try:
            if not callers.alive(consumer.pidfd):  # the cgroups opened were another's
                raise policy.Refused(f"the calling process {consumer.pid} has exited",
                                     "caller")
            fds = (bind.instance.mnt_ns, consumer.mnt_ns, *(fd for _, fd in charge))
            bind.proc = subprocess.Popen(
                [str(self.tool), self.mark.dev, self.mark.root,
                 str(bind.instance.mnt_ns), str(consumer.mnt_ns)],
                pass_fds=fds, env=cgroups.environment(charge) if charge else {},
                stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
            bind.pidfd = os.pidfd_open(bind.proc.pid)  # not reaped yet: this process
        except OSError:
            if bind.proc is not None:  # started, but it cannot be watched: gone now
                bind.proc.kill()
                bind.proc.wait()
                bind.proc = None
            raise
        finally:
            cgroups.close(charge)

    def _finished(self, bind: Bind) -> None:
        """The tool has exited: its one line says how it went."""
        assert bind.proc is not None
        assert bind.proc.stdout is not None
        self.selector.unregister(bind.pidfd)
        os.close(bind.pidfd)
        self.running.remove(bind)
        code = bind.proc.wait()
        line = bind.proc.stdout.read(4096).decode(errors="replace").strip()
        bind.proc.stdout.close()
        word, _, reason = line.partition(" ")
        if code == 0 and word == "ok":
            self._settle(bind, None)
        elif code == REFUSED_EXIT and word == "refused":
            self._settle(bind, policy.Refused(reason, "allocation" if "broker mode" in reason
                                              else "path"))
        else:
            self._settle(bind, reason or line or f"{TOOL_NAME} exited {code}")
        self._next()

    def _settle(self, bind: Bind, outcome: policy.Refused | str | None) -> None:
        consumer, conversation = bind.consumer, bind.conversation
        took = round((time.perf_counter() - bind.started) * 1000, 2)
        if conversation is None:  # a heal
            logs.event(self.log, "broker.lxcfs_healed" if outcome is None
                       else "broker.lxcfs_heal_failed",
                       logging.INFO if outcome is None else logging.WARNING,
                       cgroup=consumer.container, pid=consumer.pid, duration_ms=took,
                       **({} if outcome is None else {"reason": str(outcome)}))
            return
        if outcome is None and not any(c.pid == consumer.pid for c in self.consumers):
            self._watch(consumer)
            self.records.save(consumer)
            if bind.instance is not self.instance and self.instance is not None:
                # A new lxcfs announced itself while this bind ran: its heal missed it.
                self._queue(Bind(consumer, self.instance, None))
        else:  # refused, or failed, or this process is recorded already
            consumer.close()
        self.answer(conversation, outcome, False)

    def _drop(self, consumer: Consumer) -> None:
        """The process that asked has exited: its record goes (a heal queued for it
        still runs; its namespace fd keeps until then)."""
        with contextlib.suppress(KeyError, ValueError):
            self.selector.unregister(consumer.pidfd)
        if consumer in self.consumers:
            self.consumers.remove(consumer)
        self.records.forget(consumer)
        if not any(b.consumer is consumer for b in (*self.running, *self.queued)):
            consumer.close()
        logs.event(self.log, "broker.lxcfs_consumer_gone", cgroup=consumer.container,
                   pid=consumer.pid)

    # -- deadlines and the end -----------------------------------------------------------

    def soonest(self) -> list[float]:
        """The next deadline of a bind not yet killed (a killed one is waited for on its
        pidfd, never polled)."""
        deadlines = [b.deadline for b in self.running if not b.killed]
        return [min(deadlines)] if deadlines else []

    def expire(self, now: float) -> None:
        """A bind past its deadline (lxcfs not answering) is killed, once; its exit
        ends it."""
        for bind in self.running:
            if bind.deadline <= now and not bind.killed:
                bind.killed = True
                with contextlib.suppress(ProcessLookupError):
                    signal.pidfd_send_signal(bind.pidfd, signal.SIGKILL)

    def close(self) -> None:
        """Kills what runs and waits for none of it: a tool held in the kernel must not
        hold the broker's stop (it is reaped by whoever inherits it)."""
        for bind in [*self.running, *self.queued]:
            if bind.proc is not None:
                with contextlib.suppress(ProcessLookupError):
                    signal.pidfd_send_signal(bind.pidfd, signal.SIGKILL)
                if bind.proc.stdout is not None:
                    bind.proc.stdout.close()
                os.close(bind.pidfd)
            if bind.conversation is not None:
                self.answer(bind.conversation,
                            policy.Refused("the broker is stopping", "busy"), False)
        self.running.clear()
        self.queued.clear()
        for consumer in self.consumers:
            consumer.close()
        self.consumers.clear()
        if self.instance is not None:
            self.instance.close()
        if self._listener is not None:
            self._listener.close()
            with contextlib.suppress(OSError):
                (self.directory / SOCKET_NAME).unlink()
