"""``fuse-device-plugin lxcfs``: the node's one lxcfs, served to pods through the broker.

Its DaemonSet (``manifests/broker/lxcfs-daemonset.yaml``) holds what lxcfs needs (host
PID, so that lxcfs sees readers' pids and cgroups; CAP_SYS_ADMIN for its mount and its
private namespace; /dev/fuse) and nothing else of the broker's. It runs lxcfs at
``lxcfs.MOUNTPOINT`` inside its own container's mount namespace: the mount is never on
the host, so it dies with the container, and no stale host mount can block the next
one (the usual hostPath design's deadlock). Then it announces itself on the broker's
lxcfs socket and keeps that connection open (``lxcfs.Views``): the broker binds the
files from this namespace into consumers, and on each new announcement binds every
recorded consumer again. A broker that restarts is announced to again as soon as its
socket answers.

lxcfs exiting ends this command (exit 1), so the kubelet restarts the container with a
fresh namespace and a fresh lxcfs, which heals the consumers. SIGTERM stops lxcfs and
exits 0. One log line per event.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import logging
import os
import selectors
import signal
import socket
import subprocess
import time
from pathlib import Path

from fuse_plugin import args as flags
from fuse_plugin import logs
from fuse_plugin.broker import lxcfs, protocol, settings
from fuse_plugin.errors import Failure
from fuse_plugin.signals import stop_on_signals

START_DEADLINE = 30.0  # seconds for lxcfs to mount
STOP_DEADLINE = 10.0  # seconds for lxcfs to exit on SIGTERM; then SIGKILL
CLONE_NEWCGROUP = 0x02000000
RECONNECT = 1.0  # seconds between tries while the broker's socket does not answer


def add_flags(parser: argparse.ArgumentParser) -> None:
    """The broker's --lxcfs-dir (one declaration, one default: they must meet there), the
    lxcfs program, and the log flags."""
    flags.add_table(parser, settings.FLAGS, settings.BrokerSettings, only={"--lxcfs-dir"})
    flags.add(parser, "--lxcfs", str, "lxcfs", "the lxcfs program, from PATH")
    flags.add_log_flags(parser)


def run(args: argparse.Namespace) -> int:
    log = logs.setup(args.log_format, args.log_level)
    wake_r, wake_w = socket.socketpair()
    stopping: list[bool] = []

    def stop() -> None:
        stopping.append(True)
        with contextlib.suppress(OSError):
            wake_w.send(b"\0")

    stop_on_signals(log, stop)
    _host_cgroup_namespace(log)
    proc = _start_lxcfs(args.lxcfs, log)
    try:
        return _announce(args.lxcfs_dir / lxcfs.SOCKET_NAME, proc, wake_r, stopping, log)
    finally:
        _stop_lxcfs(proc, log)


def _host_cgroup_namespace(log: logging.Logger) -> None:
    """lxcfs reads readers' cgroups by the paths /proc/PID/cgroup names: in a cgroup
    namespace of its own (cgroup v2 runtimes give containers one) those of other pods
    would be outside its view. With host PID, pid 1's namespace is the node's."""
    try:
        own, host = (os.stat(f"/proc/{p}/ns/cgroup").st_ino for p in ("self", "1"))
    except PermissionError:  # no CAP_SYS_PTRACE over pid 1: this namespace it is
        logs.event(log, "lxcfs.cgroup_namespace", kept="its own (pid 1's is not readable)")
        return
    if own == host:
        return
    fd = os.open("/proc/1/ns/cgroup", os.O_RDONLY | os.O_CLOEXEC)
    try:  # os.setns is Python 3.12+; the image runs 3.11
        if ctypes.CDLL(None, use_errno=True).setns(fd, CLONE_NEWCGROUP) != 0:
            err = ctypes.get_errno()
            raise Failure(f"cannot enter the node's cgroup namespace: {os.strerror(err)} "
                          "(the lxcfs pod needs host PID and CAP_SYS_ADMIN)")
    finally:
        os.close(fd)
    logs.event(log, "lxcfs.cgroup_namespace", entered="the node's")


def _start_lxcfs(program: str, log: logging.Logger) -> subprocess.Popen[bytes]:
    """lxcfs in the foreground at MOUNTPOINT, a directory of this container only (an
    emptyDir: fresh in every container, so no earlier lxcfs can be mounted there)."""
    point = Path(lxcfs.MOUNTPOINT)
    point.mkdir(parents=True, exist_ok=True)
    try:
        proc = subprocess.Popen([program, "--foreground", "--enable-loadavg",
                                 "--enable-cfs", str(point)], stdin=subprocess.DEVNULL)
    except OSError as err:
        raise Failure(f"cannot run {program}: {err.strerror or err}") from None
    deadline = time.monotonic() + START_DEADLINE
    while not (point / "proc" / "meminfo").exists():
        if proc.poll() is not None:
            raise Failure(f"lxcfs exited {proc.returncode} before it mounted {point}")
        if time.monotonic() > deadline:
            proc.kill()
            proc.wait()
            raise Failure(f"lxcfs did not mount {point} within {START_DEADLINE:g}s")
        time.sleep(0.05)
    logs.event(log, "lxcfs.mounted", pid=proc.pid, mountpoint=str(point))
    return proc


def _announce(path: Path, proc: subprocess.Popen[bytes], wake: socket.socket,
              stopping: list[bool], log: logging.Logger) -> int:
    """Announce lxcfs to the broker and stay connected; again after a broker restart.
    Ends when lxcfs exits (1) or on SIGTERM (0)."""
    pidfd = os.pidfd_open(proc.pid)
    selector = selectors.DefaultSelector()
    selector.register(pidfd, selectors.EVENT_READ, "lxcfs")
    selector.register(wake, selectors.EVENT_READ, "stop")
    said_waiting = False
    try:
        while not stopping:
            conn = _connect(path)
            if conn is None:
                if not said_waiting:
                    logs.event(log, "lxcfs.waiting_for_broker", socket=str(path))
                    said_waiting = True
                events = selector.select(RECONNECT)
            else:
                said_waiting = False
                logs.event(log, "lxcfs.announced", socket=str(path))
                selector.register(conn, selectors.EVENT_READ, "broker")
                events = selector.select()
                selector.unregister(conn)
                conn.close()
            for key, _ in events:
                if key.data == "lxcfs":
                    logs.event(log, "lxcfs.exited", logging.ERROR,
                               status=proc.wait(), reason="the container restarts with a "
                               "fresh lxcfs, which heals the consumers")
                    return 1
                if key.data == "broker":
                    logs.event(log, "lxcfs.broker_gone", logging.WARNING, socket=str(path))
        return 0
    finally:
        selector.close()
        os.close(pidfd)


def _connect(path: Path) -> socket.socket | None:
    """A connection on which the broker took the announcement, or None."""
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        conn.settimeout(5.0)
        conn.connect(str(path))
        conn.send(protocol.encode(v=protocol.VERSION, op="serving"))
        reply = protocol.decode(conn.recv(protocol.MAX_MESSAGE))
    except (OSError, protocol.BadRequest):
        conn.close()
        return None
    if reply.get("status") != "ok":
        conn.close()
        return None
    return conn


def _stop_lxcfs(proc: subprocess.Popen[bytes], log: logging.Logger) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(STOP_DEADLINE)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    logs.event(log, "stopped", lxcfs_status=proc.returncode)
