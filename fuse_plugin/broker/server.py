"""The broker's loop: one thread, one ``selectors`` loop, every tenant's requests.

Follow a request from the socket to the mount here. The loop serves a
``SOCK_SEQPACKET`` socket in the broker directory, which Allocate binds into containers;
what its selector hands back is one small type per kind of file (``events``), each
matched to its handler in ``_dispatch``:

1. accept: the kernel names the caller (``caller.identify``); per-container, per-pod and
   node-wide limits on open connections (``shares``: each node-wide cap is a pod's share
   times --max-pods); a connection that sent nothing is answered at its deadline. The
   socket refuses descriptors (``SO_PASSRIGHTS``), so a tenant cannot make the loop own
   the last reference of a file whose close blocks.
2. the request arrives: ``Conversation.prepare`` (``conversation.py``) checks the
   message, the path and option rules (``policy``), admits a mount under the caps
   (``admission``: it takes a slot, which its record replaces or the end of the request
   gives back) and opens the caller's namespaces (``Caller.open``); it waits for its
   container's helper (``scheduler``: one per container, a pod's share, deadlines,
   helpers stuck in the kernel).
3. the helper (``helper.Job``, ``native/helper.c``) judges the caller's /dev/fuse fd
   from /proc and takes it, enters its namespaces, resolves the path from the
   namespace's root and reports each step (``reports``); the conversation judges
   (``policy.may_mount`` / ``may_unmount``) and records a new mount before it is
   attached; the loop answers go or no, and replies when the helper is done.

A request moves through named states (``conversation.State``) and ends in one reply or
a drop (``replies``). The loop does no path walk, no close of a tenant's file and no
call that a tenant's FUSE daemon could stall: the helper does, with a deadline. Every
request is logged in one line: ``broker.mount``, ``broker.unmount``, ``broker.refused``
(a rule) or ``broker.failed`` (the kernel or a deadline said no). The command around
the loop is ``command.py``, its settings ``settings.py``.
"""
from __future__ import annotations

import contextlib
import errno
import functools
import logging
import os
import selectors
import signal
import socket
import threading
import time
from collections.abc import Callable

from fuse_plugin import files, logs, sockets
from fuse_plugin.broker import (
    events,
    lxcfs,
    mountinfo,
    node,
    policy,
    protocol,
    records,
    scheduler,
    shares,
)
from fuse_plugin.broker.admission import Admission, Limits
from fuse_plugin.broker.conversation import Conversation
from fuse_plugin.broker.helper import NAME as HELPER_NAME
from fuse_plugin.broker.replies import Replies
from fuse_plugin.broker.reports import HelperFailed
from fuse_plugin.broker.requests import Requests
from fuse_plugin.broker.scheduler import Answers, Scheduler
from fuse_plugin.broker.settings import DEFAULT_SHIM, BrokerSettings
from fuse_plugin.broker.stats import BrokerStats
from fuse_plugin.errors import EXIT_USAGE, Failure

ACCEPT_PAUSE = 1.0  # out of fds: the backlog waits this long before the next accept
# SIGTERM: the drain. Requests already held go on for this long (a helper at work then
# reaches its own deadline within it); see Broker._close.
STOP_GRACE = scheduler.HELPER_DEADLINE
PRUNE_EVERY = 10.0  # records of connections that ended are dropped this often
TURN = 1.0  # the loop turns at least this often (the liveness probe watches it)
SO_PASSRIGHTS = 83  # Linux 6.16+


class Broker:
    """The loop: start, the selector's turns, the drain on stop. What a turn's events
    lead to is ``requests`` (and ``scheduler`` for released helpers); how a request
    ends, ``replies``."""

    def __init__(self, settings: BrokerSettings, log: logging.Logger) -> None:
        self.settings = settings
        self.log = log
        self.stats = BrokerStats()
        self.socket_path = settings.directory / protocol.SOCKET_NAME
        self.helper_binary = settings.shim.parent / HELPER_NAME
        self.records = records.Records(settings.state)
        self.caps = settings.caps
        # The caps, on one count of the mounts held (the records) and in flight.
        self.admission = Admission(self.records, Limits(
            per_container=settings.max_mounts, per_pod=settings.max_mounts_pod,
            node=self.caps.mounts))
        self.open = shares.OpenRequests(self.caps)
        self.turned = time.monotonic()
        self._selector = selectors.DefaultSelector()
        self._listener: socket.socket | None = None
        self._identity: files.Identity | None = None
        # Wakes the loop: signals (set_wakeup_fd, armed in start) and stop().
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._selector.register(self._wake_r, selectors.EVENT_READ, events.Woken())
        self._signals_wake = False
        self._stopping = False
        self._closed = False
        self._refuses_descriptors = False
        self._paused_until = 0.0
        self._pruned = 0.0
        self.replies = Replies(log, self.stats, self.admission, self.open)
        self.helpers = Scheduler(
            self._selector, self.caps, helper_binary=self.helper_binary, store=self.records,
            stats=self.stats, log=log,
            answers=Answers(refuse=self.replies.refuse, fail=self.replies.fail,
                            pause=self._pause))
        self.requests = Requests(self._selector, settings, admission=self.admission,
                                 open_requests=self.open, store=self.records,
                                 helpers=self.helpers, replies=self.replies,
                                 pause=self._pause)
        self.views: lxcfs.Views | None = None  # LXCFS views (lxcfs.py), from start

    # -- start and stop ------------------------------------------------------------------

    def start(self) -> None:
        """Check the inputs, install the shim, load the records, listen."""
        settings = self.settings
        for what, path in (("--shim", settings.shim),
                           (f"{HELPER_NAME} (beside --shim)", self.helper_binary)):
            if not os.access(path, os.X_OK) or not path.is_file():
                raise Failure(f"{what} {path} is not an executable file; the image has both "
                              f"in {DEFAULT_SHIM.parent}, and a pip install builds none: "
                              "`scripts/build-native DIR` from the source tree (Debian: gcc "
                              "musl-tools), then --shim DIR/fusermount3", EXIT_USAGE)
        try:
            self.helpers.charge = node.charge()
            node.ensure_fusectl()
            held = self.records.load()
        except OSError as err:
            raise Failure(f"cannot read the FUSE connections or the records in "
                          f"{settings.state}: {err.strerror or err} (the broker needs "
                          "CAP_SYS_ADMIN to mount fusectl)") from None
        try:
            settings.directory.mkdir(parents=True, exist_ok=True)
            # Every container user must reach the socket through the directory's bind.
            settings.directory.chmod(0o755)
            shim = node.install_shim(settings.directory, settings.shim.read_bytes())
            mark = mountinfo.mark_of(settings.directory)
            self._listen()
            self.views = lxcfs.Views(
                self._selector, tool=self.helper_binary.parent / lxcfs.TOOL_NAME,
                directory=settings.lxcfs_dir, state=settings.state / "lxcfs",
                mark=mark, charge=self.helpers.charge, log=self.log,
                answer=self.requests.answer_lxcfs)
            self.views.start()
            self.requests.serve(mark, self.views)
        except OSError as err:
            raise Failure(f"cannot serve in {settings.directory}: {err.strerror or err}") \
                from None
        signal.set_wakeup_fd(self._wake_w.fileno(), warn_on_full_buffer=False)
        self._signals_wake = True
        caps = self.caps
        fd_limit = shares.raise_fd_limit(caps.descriptors)
        logs.event(self.log, "broker.serving", socket=str(self.socket_path),
                   shim=str(shim), max_mounts=settings.max_mounts,
                   max_mounts_node=caps.mounts, max_mounts_pod=settings.max_mounts_pod,
                   max_pods=caps.max_pods, max_requests=caps.requests,
                   max_helpers=caps.helpers, fd_limit=fd_limit, held=held,
                   charged=self.helpers.charge.names,
                   allow_other=settings.allow_other,
                   refuses_descriptors=self._refuses_descriptors)
        self._say_short(caps, fd_limit)

    def _say_short(self, caps: shares.NodeCaps, fd_limit: int) -> None:
        """Where the settings let pods at their share fill a node-wide cap, so that the
        shares no longer hold on a full node, say so at start: one line each."""
        reasons = list(caps.short)
        if fd_limit < caps.descriptors:
            reasons.append(
                f"the open-file limit is {fd_limit} (its hard limit), enough for "
                f"{caps.pods_within(fd_limit)} pods at their share; --max-pods "
                f"{caps.max_pods} needs {caps.descriptors}")
        for reason in reasons:
            logs.event(self.log, "broker.shares_short", logging.WARNING, reason=reason)

    def _listen(self) -> None:
        path = self.socket_path
        try:
            sockets.take_over(path, self.log, socket.SOCK_SEQPACKET)
        except sockets.InUse:
            raise Failure(f"another broker is serving on {path}") from None
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        # Before bind: connections inherit it, so no client can queue a descriptor.
        try:
            listener.setsockopt(socket.SOL_SOCKET, SO_PASSRIGHTS, 0)
            self._refuses_descriptors = True
        except OSError:  # before Linux 6.16 (docs/security.md says what that costs)
            self._refuses_descriptors = False
        listener.bind(str(path))
        # Anyone who can reach the socket may ask; the kernel names them, policy decides.
        os.chmod(path, 0o666)
        listener.listen(128)
        listener.setblocking(False)
        self._identity = files.identity(path)
        self._listener = listener
        self._selector.register(listener, selectors.EVENT_READ, events.Listening())

    @property
    def serving(self) -> bool:
        """Ready: listening, and the socket at the path is still ours."""
        if self._listener is None or self._stopping:
            return False
        return self._owns_socket()

    def _owns_socket(self) -> bool:
        """The socket file at the path is the one this broker bound ("no file" is never
        "our file")."""
        current = files.identity(self.socket_path)
        return current is not None and current == self._identity

    def stop(self) -> None:
        """Stop the loop from any thread (SIGTERM's handler calls this from a thread of
        its own); the loop is woken as well, since it may be waiting."""
        self._stopping = True
        with contextlib.suppress(OSError):  # full: a wake-up is pending anyway
            self._wake_w.send(b"\0")

    def _close(self) -> None:
        """SIGTERM: drain, so that a rollout fails no mount (issue 35). New connections
        go at once: the listening socket is closed and its path removed, so the shim
        waits for the next broker (the connections still in the listen queue are reset,
        which the shim takes as "not read": it asks again). The requests already held
        (queued, with a helper at work) are served as usual for up to STOP_GRACE, and
        connections whose request is still arriving meanwhile; past it, or once nothing
        else is held (a silent connection does not hold the drain), those not yet acted
        on are refused with ``retry``, which the shim asks the next broker again for, and
        their helpers killed. A helper already told to mount or unmount cannot be undone
        and asked again elsewhere: it finishes, or fails at its own deadline. Once closed,
        closing again does nothing."""
        if self._closed:
            return
        self._closed = True
        self._stop_listening()
        end = time.monotonic() + STOP_GRACE
        self._turn(0.0)  # requests that arrived since the last turn: held from now on
        self._turn_while(lambda: self.helpers.holding, end)
        stopping = policy.Refused("the broker is stopping and did nothing of this "
                                  "request; try again", "busy")
        waiting = self.requests.take_waiting()
        queued = self.helpers.take_queued()
        for conversation in [*waiting, *queued]:
            self.replies.refuse(conversation, stopping, retry=True)
        running = self.helpers.running
        for conversation in [w for w in running.values() if not w.acting]:
            self.replies.refuse(conversation, stopping, retry=True)
            self.helpers.release(conversation)
        self._turn_while(lambda: bool(running), end + scheduler.HELPER_DEADLINE)
        for conversation in list(running.values()):  # past their deadlines: not expired yet
            if conversation.job is not None:
                conversation.job.kill()
            self.replies.fail(conversation, HelperFailed("the broker is stopping"))
        self.helpers.close()
        if self.views is not None:
            self.views.close()
        if self._signals_wake and threading.current_thread() is threading.main_thread():
            signal.set_wakeup_fd(-1)
        self._selector.close()
        self.replies.summarise(time.monotonic(), everything=True)
        logs.event(self.log, "stopped")

    def _stop_listening(self) -> None:
        if self._listener is None:
            return
        with contextlib.suppress(KeyError):  # unregistered while accepting paused
            self._selector.unregister(self._listener)
        self._listener.close()
        if self._owns_socket():
            with contextlib.suppress(OSError):
                self.socket_path.unlink()
        self._listener = None
        self._paused_until = 0.0  # no listener to take back

    def _turn_while(self, held: Callable[[], bool], end: float) -> None:
        while held() and time.monotonic() < end:
            self._turn(min(TURN, max(0.0, end - time.monotonic())))

    # -- the loop ------------------------------------------------------------------------

    def run(self) -> int:
        try:
            while not self._stopping:
                self._turn(TURN)
        finally:
            self._close()
        return 0

    def _turn(self, longest: float) -> None:
        now = time.monotonic()
        self.turned = now
        deadlines = self._soonest()
        if self._paused_until:
            deadlines.append(self._paused_until)
        timeout = max(0.0, min([now + longest, *deadlines]) - now)
        # Requests already under way first (their helpers' messages), new connections
        # last: under load a mount in progress moves on every turn, however many new
        # connections a flood has queued.
        ready: list[events.Event] = sorted(
            (key.data for key, _ in self._selector.select(timeout)), key=events.urgency)
        for event in ready:
            self._survive(functools.partial(self._dispatch, event), events.request_of(event))
        self._survive(functools.partial(self._expire, time.monotonic()))

    def _soonest(self) -> list[float]:
        """The next deadline of a request not yet complete and of a helper. Each table
        is kept in the order its deadlines fall (an entry's deadline is the time it was
        added plus a constant, and entries are only ever added at the end), so its first
        entry has the soonest: a turn costs the same however many are open (listing
        every deadline cost a full node's silent connections a large share of the loop's
        time: bench/README.md, "The broker at its caps")."""
        soonest = self.requests.soonest() + self.helpers.soonest()
        return soonest + (self.views.soonest() if self.views is not None else [])

    def _dispatch(self, event: events.Event) -> None:
        """Each kind of file the loop watches to its handler (``events``)."""
        match event:
            case events.Listening():
                self._accept()
            case events.Woken():
                with contextlib.suppress(BlockingIOError):
                    self._wake_r.recv(512)
            case events.FromCaller(conversation):
                self.requests.receive(conversation)
            case events.FromHelper(conversation):
                self.requests.hear(conversation)
            case events.HelperExited(conversation):
                self.requests.exited(conversation)
            case events.HelperGone(exiting):
                self.helpers.reap(exiting)
            case lxcfs.Event():
                if self.views is not None:
                    self.views.handle(event)

    def _survive(self, step: Callable[[], None],
                 conversation: Conversation | None = None) -> None:
        """Run one step of the loop; the broker's own shortage of descriptors or memory
        anywhere in it (EMFILE, ENFILE, ENOMEM, ENOBUFS) pauses accepting and answers
        the request at hand "busy" instead of ending the broker (a traceback on
        /proc/N/status at the fd limit would let a tenant stop it). Any other error is a
        bug and still ends it."""
        try:
            step()
        except OSError as err:
            if not policy.out_of_resources(err):
                raise
            self._pause(err)
            if conversation is not None:
                self.requests.abandon(conversation,
                                      policy.OutOfResources("serving the request", err))

    def _accept(self) -> None:
        """One new connection a turn. Taking it reads its request and may start a
        helper, so a turn that took many would hold every mount already under way until
        all of them were done (bench/README.md, "The broker under chaos", says what one a
        turn did to the neighbours' tail). A flood waits in the kernel's backlog, and the
        listener, still readable, comes round again at once."""
        assert self._listener is not None
        try:
            sock, _ = self._listener.accept()
        except BlockingIOError:
            return
        except OSError as err:
            if err.errno in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM):
                self._pause(err)
            return
        sock.setblocking(False)
        self.requests.connected(sock)

    def _pause(self, err: OSError) -> None:
        """Out of fds: stop accepting for a moment (the backlog holds the callers) and
        say so once, instead of spinning on the same error."""
        if self._listener is None or self._paused_until:  # draining: nothing to pause
            return
        self._selector.unregister(self._listener)
        self._paused_until = time.monotonic() + ACCEPT_PAUSE
        self.stats.accept_paused()
        logs.event(self.log, "broker.accept_paused", logging.WARNING,
                   reason=err.strerror or str(err), seconds=ACCEPT_PAUSE)

    def _expire(self, now: float) -> None:
        if self._paused_until and now >= self._paused_until and self._listener is not None:
            self._paused_until = 0.0
            self._selector.register(self._listener, selectors.EVENT_READ, events.Listening())
        self.requests.expire(now)
        self.helpers.expire(now)
        if self.views is not None:
            self.views.expire(now)
        self.replies.summarise(now)
        if now - self._pruned >= PRUNE_EVERY:
            self._pruned = now
            self.admission.prune()

