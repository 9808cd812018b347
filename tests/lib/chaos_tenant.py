"""A hostile tenant's loops for the broker's chaos run, run *inside* a container (stdlib
only; the container's python3 is the host's). Used by bench/broker_chaos.py. Each command
attacks for SECONDS, keeps every request's fate (answered, with what; or closed or timed
out without an answer) and how long it waited, and prints one JSON object at the end.

    chaos_tenant.py SOCKET VERSION stall SECONDS      a FUSE mount whose daemon never
                                                      answers, and a rename race through it
    chaos_tenant.py SOCKET VERSION chroot SECONDS     unmount /keys and /irq while the
                                                      root flips to decoys and to /proc
    chaos_tenant.py SOCKET VERSION silent SECONDS N   N connections at a time that never
                                                      say a word
    chaos_tenant.py SOCKET VERSION descriptors SECONDS N
                                                      N requests at a time, each carrying a
                                                      TCP socket whose close lingers
    chaos_tenant.py SOCKET VERSION pin SECONDS N      mount, pin (O_PATH), lazily unmount,
                                                      N times; let go; again
    chaos_tenant.py SOCKET VERSION flood SECONDS THREADS
                                                      requests as fast as THREADS threads
                                                      can send them
    chaos_tenant.py SOCKET VERSION foreign SECONDS THREADS
                                                      a file in its own FUSE stub that never
                                                      answers FLUSH, named as fuse_fd
    chaos_tenant.py SOCKET VERSION bigflood SECONDS THREADS
                                                      refusals with 60 KiB paths and
                                                      3,000-byte options

The toolkit of tests/lib/attacker.py does each of these once; here they go on for
a while, all at once, and every answer is counted.
"""

from __future__ import annotations

import collections
import contextlib
import json
import os
import selectors
import socket
import struct
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tests.lib import attacker
else:  # in the container, beside it: the tenant's client of the broker's protocol
    import attacker

CLIENT_TIMEOUT = 30.0  # longer than any answer may take: past it, a request is unanswered
SOCKET = ""
VERSION = ""


@dataclass
class Reply:
    status: str  # ok, error (answered); closed, timeout (not); unreachable (no connection)
    message: str = ""
    mount_id: str = ""

    @property
    def answered(self) -> bool:
        return self.status in ("ok", "error")


class Tally:
    """Every request's fate and wait, shared by threads."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.status: collections.Counter[str] = collections.Counter()
        self.messages: collections.Counter[str] = collections.Counter()
        self.waits: list[float] = []

    def add(self, reply: Reply, waited: float) -> Reply:
        with self._lock:
            self.status[reply.status] += 1
            if reply.message:
                self.messages[reply.message[:200]] += 1
            if reply.answered:
                self.waits.append(waited)
        return reply

    def summary(self) -> dict[str, Any]:
        with self._lock:
            waits = sorted(self.waits)
            return {
                "requests": sum(self.status.values()),
                "status": dict(self.status),
                # No answer, for any reason: closed or reset, timed out, never connected.
                "unanswered": (self.status["closed"] + self.status["timeout"]
                               + self.status["unreachable"]),
                "wait_ms": {"p50": _pick(waits, 0.5), "p99": _pick(waits, 0.99),
                            "max": waits[-1] * 1000 if waits else 0.0},
                "messages": dict(self.messages.most_common(8)),
            }


def _pick(ordered: list[float], q: float) -> float:
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1000 if ordered else 0.0


def encode(fields: list[str]) -> bytes:
    return attacker.encode([f"v={VERSION}", *fields])


def decode(data: bytes) -> Reply:
    if not data:
        return Reply("closed")
    fields = attacker.fields_of(data)
    return Reply(fields.get("status", "closed"), fields.get("message", ""),
                 fields.get("mount_id", ""))


def connect() -> socket.socket:
    """Connect as the shim does: a blocking connect, which waits while the broker's
    listen backlog is full. Bounded here: connect and send wait at most SO_SNDTIMEO,
    the answer at most SO_RCVTIMEO (CLIENT_TIMEOUT each)."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    limit = struct.pack("ll", int(CLIENT_TIMEOUT), 0)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, limit)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, limit)
    try:
        sock.connect(SOCKET)
    except BaseException:
        sock.close()
        raise
    return sock


def not_connected(err: OSError) -> Reply:
    """A connect that failed: still waiting at SO_SNDTIMEO (the backlog never had room:
    unanswered), or no broker listening (the SIGTERM round)."""
    if isinstance(err, BlockingIOError):
        return Reply("timeout", "connect: the listen backlog stayed full")
    return Reply("unreachable", err.strerror or str(err))


def answer_of(sock: socket.socket) -> Reply:
    try:
        return decode(sock.recv(65536))
    except BlockingIOError:  # SO_RCVTIMEO passed
        return Reply("timeout")
    except OSError as err:
        return Reply("closed", err.strerror or str(err))


def ask(tally: Tally, fields: list[str]) -> Reply:
    """One request on a connection of its own, as the shim makes it."""
    started = time.monotonic()
    try:
        sock = connect()
    except OSError as err:
        return tally.add(not_connected(err), time.monotonic() - started)
    with sock:
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            sock.send(encode(fields))  # refused at accept: the answer is there to read
        return tally.add(answer_of(sock), time.monotonic() - started)


def mount_with_fuse(tally: Tally, path: str) -> tuple[Reply, int]:
    fd = attacker.open_fuse()
    return ask(tally, ["op=mount", f"path={path}", f"fuse_fd={fd}"]), fd


def await_all(tally: Tally, socks: list[tuple[socket.socket, float]]) -> None:
    """Wait for an answer (or the end) on every connection at once; each one's wait
    counts from its connect."""
    with selectors.DefaultSelector() as selector:
        for sock, started in socks:
            sock.setblocking(False)
            selector.register(sock, selectors.EVENT_READ, started)
        deadline = time.monotonic() + CLIENT_TIMEOUT
        while selector.get_map():
            left = deadline - time.monotonic()
            if left <= 0:
                for key in list(selector.get_map().values()):
                    tally.add(Reply("timeout"), CLIENT_TIMEOUT)
                    selector.unregister(key.fileobj)
                break
            for key, _ in selector.select(left):
                conn = key.fileobj
                assert isinstance(conn, socket.socket)
                try:
                    reply = decode(conn.recv(65536))
                except BlockingIOError:
                    continue
                except OSError as err:
                    reply = Reply("closed", err.strerror or str(err))
                tally.add(reply, time.monotonic() - key.data)
                selector.unregister(conn)
    for sock, _ in socks:
        sock.close()


def open_many(tally: Tally, n: int) -> list[tuple[socket.socket, float]]:
    opened = []
    for _ in range(n):
        started = time.monotonic()
        try:
            opened.append((connect(), started))
        except OSError as err:
            tally.add(not_connected(err), time.monotonic() - started)
    return opened


class Looping:
    """A thread that repeats ``step`` until stopped; counts the turns that worked."""

    def __init__(self, step: Any) -> None:
        self.turns = 0
        self._done = threading.Event()

        def loop() -> None:
            while not self._done.is_set():
                try:
                    step(self.turns)
                except OSError:
                    continue
                self.turns += 1

        self._thread = threading.Thread(target=loop, daemon=True)
        self._thread.start()

    def stop(self) -> int:
        self._done.set()
        self._thread.join()
        return self.turns


# -- the attacks --------------------------------------------------------------------------


def stall(seconds: float) -> dict[str, Any]:
    """B/a/f is a FUSE mount whose daemon (this process) never reads its device: any
    lookup in it waits. B/a and B/b swap all the time, and the requests name B/b/f/x and
    B/b/f: half the time the path leads through the stalled mount. Mounts that succeed
    are lazily unmounted again. (B is new for each run: the last run's stalled mount is
    still there, its connection gone.)"""
    tally, held = Tally(), Tally()
    base = f"/mnt/stall-{os.getpid()}"
    for d in ("a/f", "b/f/x", "a/plain"):
        os.makedirs(f"{base}/{d}")
    hold, hold_fd = mount_with_fuse(held, f"{base}/a/f")

    def swap(_: int) -> None:
        os.rename(f"{base}/a", f"{base}/spare")
        os.rename(f"{base}/b", f"{base}/a")
        os.rename(f"{base}/spare", f"{base}/b")

    swapper = Looping(swap)
    deadline = time.monotonic() + seconds
    i = 0
    while time.monotonic() < deadline:
        path = (f"{base}/b/f/x", f"{base}/b/f")[i % 2]
        i += 1
        reply, fd = mount_with_fuse(tally, path)
        os.close(fd)
        if reply.status == "ok":
            ask(tally, ["op=unmount", f"path={path}", "flags=lazy"])
    swaps = swapper.stop()
    os.close(hold_fd)
    return {"hold": hold.status, "requests": _merge(tally, held), "swaps": swaps}


def chroot(seconds: float) -> dict[str, Any]:
    """Decoy FUSE mounts at D/keys and D/irq; one thread flips the root between the real
    one and a decoy directory (D, then /proc, in turns); the
    main thread asks to unmount /keys and /irq. Read in the caller's root at the wrong
    moment, that would remove the runtime's masks over /proc/keys and /proc/irq."""
    tally, held = Tally(), Tally()
    decoy = f"/mnt/decoy-{os.getpid()}"
    os.makedirs(f"{decoy}/keys")
    os.makedirs(f"{decoy}/irq")
    decoys = [mount_with_fuse(held, f"{decoy}/{name}") for name in ("keys", "irq")]
    real = os.open("/", os.O_PATH | os.O_DIRECTORY)
    lock = threading.Lock()
    roots = {"now": decoy}

    def flip(_: int) -> None:
        with lock:
            os.chroot(roots["now"])
        with lock:
            os.fchdir(real)
            os.chroot(".")

    flipper = Looping(flip)
    deadline = time.monotonic() + seconds
    i = 0
    while time.monotonic() < deadline:
        if i % 100 == 0:
            roots["now"] = (decoy, "/proc")[(i // 100) % 2]
        path = ("/keys", "/irq")[i % 2]
        i += 1
        started = time.monotonic()
        with lock:
            os.fchdir(real)
            os.chroot(".")
            try:
                sock = connect()
            except OSError as err:
                tally.add(not_connected(err), time.monotonic() - started)
                continue
        with sock:
            with contextlib.suppress(BrokenPipeError, ConnectionResetError):
                sock.send(encode(["op=unmount", f"path={path}"]))
            tally.add(answer_of(sock), time.monotonic() - started)
    flips = flipper.stop()
    os.fchdir(real)
    os.chroot(".")
    with open("/proc/self/mountinfo") as table:
        points = [line.split()[4] for line in table]
    for _, fd in decoys:
        os.close(fd)
    return {"decoys": [r.status for r, _ in decoys], "requests": _merge(tally, held),
            "flips": flips,
            "masks": sorted(p for p in points if p in ("/proc/keys", "/proc/irq"))}


def silent(seconds: float, n: int) -> dict[str, Any]:
    """N connections at a time that never send anything; each must still be answered
    (refused at accept over the container's share, or at the request deadline)."""
    tally = Tally()
    deadline = time.monotonic() + seconds
    batches = 0
    while time.monotonic() < deadline:
        await_all(tally, open_many(tally, n))
        batches += 1
    return {"requests": tally.summary(), "batches": batches}


def descriptors(seconds: float, n: int) -> dict[str, Any]:
    """N requests at a time, each with a TCP socket attached (SCM_RIGHTS) whose close
    lingers: unacknowledged data to a peer that never reads, SO_LINGER an hour. A
    broker that ended up holding the last reference would block in close."""
    tally = Tally()
    outcome: collections.Counter[str] = collections.Counter()
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        server, peer, tcp = attacker.lingering_tcp()
        socks = open_many(tally, n)
        for sock, _ in socks:
            try:
                socket.send_fds(sock, [encode(["op=mount", "path=/mnt", "fuse_fd=0"])],
                                [tcp.fileno()])
                outcome["sent"] += 1
            except OSError as err:
                outcome[f"refused by the kernel: {err.strerror}"] += 1
        await_all(tally, socks)
        # Ours again: close at once instead of lingering in this process.
        tcp.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        for s in (tcp, peer, server):
            s.close()
    return {"requests": tally.summary(), "sendmsg": dict(outcome)}


def pin(seconds: float, n: int) -> dict[str, Any]:
    """Mount, keep the mount alive with an O_PATH fd, lazily unmount it so no table shows
    it; N times, then let every one go, and again: quota pressure the broker counts
    from the kernel's connections. (Each batch has directories of its own: a mount whose
    unmount was refused stays, its connection gone.)"""
    tally = Tally()
    deadline = time.monotonic() + seconds
    mounted = batches = 0
    while time.monotonic() < deadline:
        kept = []
        for i in range(n):
            point = f"/mnt/pin-{os.getpid()}/{batches}/{i}"
            os.makedirs(point)
            reply, fd = mount_with_fuse(tally, point)
            if reply.status != "ok":
                os.close(fd)
                continue
            mounted += 1
            kept += [fd, os.open(point, os.O_PATH)]
            ask(tally, ["op=unmount", f"path={point}", "flags=lazy"])
        for fd in kept:
            os.close(fd)
        batches += 1
    return {"requests": tally.summary(), "mounted": mounted, "batches": batches}


def flood(seconds: float, threads: int) -> dict[str, Any]:
    """As many requests as THREADS threads can send: unmounts of nothing (each costs the
    broker a helper), mounts on /proc (refused by the rules) and garbage (refused by the
    protocol)."""
    tally = Tally()
    os.makedirs("/mnt/none", exist_ok=True)
    kinds = (["op=unmount", "path=/mnt/none"],
             ["op=mount", "path=/proc/sys", "fuse_fd=0"],
             ["op=bogus", "path=/"])
    hammer(seconds, threads, lambda i: ask(tally, kinds[i % len(kinds)]))
    return {"requests": tally.summary()}


def foreign(seconds: float, threads: int) -> dict[str, Any]:
    """Its own FUSE stub (mounted through the broker) never answers FLUSH or RELEASE; a
    file opened in it is named as fuse_fd by THREADS threads, each request at a new
    directory. A helper that took the file to look at it would block closing it (the
    first round left 1,600 such helpers and 3,215 broker descriptors): the helper must
    judge it from /proc without taking it."""
    tally, held = Tally(), Tally()
    base = f"/mnt/foreign-{os.getpid()}"
    os.makedirs(f"{base}/stub")
    stub, dev = mount_with_fuse(held, f"{base}/stub")
    if stub.status != "ok":  # e.g. the broker got SIGTERM first: nothing to name
        os.close(dev)
        return {"stub": stub.status, "requests": _merge(tally, held)}
    threading.Thread(target=attacker.serve_fuse,
                     args=(dev, os.devnull, frozenset({attacker.FUSE_FLUSH,
                                                       attacker.FUSE_RELEASE}), False),
                     daemon=True).start()
    file = os.open(f"{base}/stub/f", os.O_RDWR)
    counter = iter(range(1 << 30))

    def name_it(_: int) -> None:
        point = f"{base}/{next(counter)}"
        os.makedirs(point)
        ask(tally, ["op=mount", f"path={point}", f"fuse_fd={file}"])

    hammer(seconds, threads, name_it)
    ask(held, ["op=unmount", f"path={base}/stub", "flags=lazy"])
    os.close(dev)  # the connection goes with its last device fd: the FLUSH then fails
    with contextlib.suppress(ConnectionAbortedError):  # as it does: ECONNABORTED
        os.close(file)
    return {"stub": stub.status, "requests": _merge(tally, held)}


def bigflood(seconds: float, threads: int) -> dict[str, Any]:
    """Refusals whose log lines would be large: 60 KiB paths and 3,000-byte options, as
    fast as THREADS threads can send them (the first round: 80-160 MB/s of log)."""
    tally = Tally()
    kinds = (["op=mount", "path=/proc/" + "x" * 61440, "fuse_fd=0"],
             ["op=mount", "path=/mnt/big", "fuse_fd=0", "options=" + "y" * 3000])
    hammer(seconds, threads, lambda i: ask(tally, kinds[i % len(kinds)]))
    return {"requests": tally.summary()}


def hammer(seconds: float, threads: int, step: Callable[[int], object]) -> None:
    """``step(i)`` again and again from THREADS threads (i counts each thread's turns),
    for SECONDS."""
    deadline = time.monotonic() + seconds

    def work() -> None:
        i = 0
        while time.monotonic() < deadline:
            step(i)
            i += 1

    workers = [threading.Thread(target=work) for _ in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()


def _merge(*tallies: Tally) -> dict[str, Any]:
    merged = Tally()
    for t in tallies:
        merged.status.update(t.status)
        merged.messages.update(t.messages)
        merged.waits += t.waits
    return merged.summary()


def main(argv: list[str]) -> int:
    global SOCKET, VERSION
    SOCKET, VERSION, kind, seconds = argv[0], argv[1], argv[2], float(argv[3])
    rest = [int(a) for a in argv[4:]]
    commands: dict[str, Callable[..., dict[str, Any]]] = {
        "stall": stall, "chroot": chroot, "silent": silent, "descriptors": descriptors,
        "pin": pin, "flood": flood, "foreign": foreign, "bigflood": bigflood}
    started = time.monotonic()
    result = commands[kind](seconds, *rest)
    result["seconds"] = round(time.monotonic() - started, 2)
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
