"""A hostile tenant's toolkit, run inside a test container (stdlib only): it speaks the
broker's protocol directly, as a container's own root (or any uid) could, instead of
going through the shim. Every command prints one JSON object on stdout.

    attacker.py ask [--fuse] [--fd N] [--repeat N] [--mkdir] [--orphan] [--one-fuse]
                    FIELD=VALUE...
    attacker.py chroot-ask DIR FIELD=VALUE...      connect, chroot(DIR), then ask
    attacker.py chroot-race DIR ITERATIONS FIELD=VALUE...
    attacker.py rename-race A B ITERATIONS PATH...
    attacker.py hold MOUNTPOINT                  mount, never serve, hold until stdin ends
    attacker.py silent N [--settle]              N connections that never say a word
    attacker.py keep N                           N silent connections, each replaced as
                                                 soon as the broker answers it; says how
                                                 many it held once settled, then keeps
                                                 them until killed (a container's init)
    attacker.py descriptors                      a lingering TCP socket over SCM_RIGHTS
    attacker.py pin-and-hide N DIR               mount, pin (O_PATH), lazy-unmount, repeat
    attacker.py swap-race DIR ITERATIONS         swap DIR/a (ours) and DIR/b (not) while
                                                 asking to mount on DIR/a
    attacker.py serve MOUNTPOINT RECORD [--no-flush] [--never-lookup]
                                                 mount a FUSE stub (one file in its root)
                                                 that writes every request's opcode, uid
                                                 and name to RECORD; --no-flush: FLUSH is
                                                 never answered; --never-lookup: LOOKUP is
                                                 read and never answered (whoever looks
                                                 up a name waits in the kernel, past
                                                 SIGKILL); hold until stdin ends
    attacker.py nested-ask UID SOURCE TARGET FIELD=VALUE...
                                                 in a user namespace of its own (its root
                                                 the node's UID) and a mount namespace it
                                                 owns, bind SOURCE over TARGET, then ask
                                                 from there; the answer (or none within
                                                 its wait) and the fuse.lxcfs mounts the
                                                 namespace holds after it
    attacker.py split-cgroups N M DIR           N processes, each moved by a process in
                                                 namespaces of its own (user, mount,
                                                 cgroup) into a cgroup it made below the
                                                 container's, mount M times each under
                                                 DIR; each one's cgroup and tally
    attacker.py swap-ask DIR N FILE              name one fd as fuse_fd N times (mounting
                                                 DIR/0...) while a thread swaps it between
                                                 /dev/fuse and FILE
    attacker.py pass-fd FILE SOCKET              open FILE, and hand it (SCM_RIGHTS) to
                                                 whoever connects to SOCKET
    attacker.py ask-later [--fuse] FIELD=VALUE... connect (and open /dev/fuse), say so,
                                                 send the request once a line arrives on
                                                 stdin, print the answer
    attacker.py mount-loop DIR                  mount DIR/0, DIR/1, ... until stdin ends,
                                                 waiting out a broker that is not there;
                                                 then print the tally
    attacker.py ask-with-fd SOCKET N FIELD=VALUE...
                                                 take an fd from SOCKET, then ask N times
                                                 naming it as fuse_fd; hold it until
                                                 stdin ends
    attacker.py burst N DIR                      say it is ready, and once a line arrives
                                                 on stdin mount DIR/0...DIR/N-1 at once
                                                 (N connections, then N requests); print
                                                 the tally and the FUSE mounts under DIR;
                                                 unmount them when stdin ends

``{i}`` in a field is replaced by the request's number. ``--fuse`` opens /dev/fuse and
names the fd (``fuse_fd=``), as the shim does. Commands that hold something print their
JSON, then wait for stdin to close.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import ctypes
import json
import os
import selectors
import socket
import struct
import sys
import threading
import time
from typing import Any

SOCKET = os.environ.get("FUSE_BROKER_SOCKET", "/run/fuse-broker/broker.sock")
VERSION = "2"
CLONE_NEWNS, CLONE_NEWCGROUP, CLONE_NEWUSER = 0x00020000, 0x02000000, 0x10000000
MS_BIND = 4096
ANSWER_WAIT = 20.0  # seconds a nested request waits for the broker's answer


def encode(fields: list[str]) -> bytes:
    """A request as the shim sends it: ``key=value`` fields, each ended by a NUL."""
    return b"".join(f.encode() + b"\0" for f in fields)


def fields_of(data: bytes) -> dict[str, str]:
    """The broker's reply, read the same way (what is not ``key=value`` is passed over)."""
    return dict(f.split("=", 1) for f in data.decode(errors="replace").split("\0") if "=" in f)


def reply_of(sock: socket.socket) -> dict[str, Any]:
    try:
        data = sock.recv(65536)
    except OSError as err:
        return {"status": "closed", "message": err.strerror or str(err)}
    fields = fields_of(data)
    return {"status": fields.get("status", "closed"), "message": fields.get("message", ""),
            "mount_id": fields.get("mount_id", "")}


def connect() -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    sock.connect(SOCKET)
    return sock


def send(sock: socket.socket, fields: list[str]) -> dict[str, Any]:
    with contextlib.suppress(BrokenPipeError):  # answered at accept: the answer waits
        sock.send(encode(fields))
    return reply_of(sock)


def with_fuse(fields: list[str], fd: int | None) -> list[str]:
    return [*fields, f"fuse_fd={fd}"] if fd is not None else fields


def open_fuse() -> int:
    return os.open("/dev/fuse", os.O_RDWR)


def ask_once(fields: list[str], fuse: bool, fd: int | None) -> dict[str, Any]:
    opened = open_fuse() if fuse else None
    try:
        with connect() as sock:
            return send(sock, with_fuse(fields, opened if opened is not None else fd))
    finally:
        if opened is not None:
            os.close(opened)


def orphan(fields: list[str]) -> dict[str, Any]:
    """A child connects the shared socket and exits; this process then sends on it, so
    the process the kernel names as the peer is gone (or its pid could be reused)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as sock:
        child = os.fork()
        if child == 0:
            sock.connect(SOCKET)
            os._exit(0)
        os.waitpid(child, 0)
        return send(sock, fields)


def tally(results: list[dict[str, Any]]) -> dict[str, Any]:
    counts = collections.Counter(str(r["status"]) for r in results)
    messages = collections.Counter(str(r["message"]) for r in results if r["message"])
    return {"counts": dict(counts), "messages": dict(messages)}


def cmd_ask(args: argparse.Namespace) -> dict[str, Any]:
    fields = [f"v={VERSION}", *args.fields]
    if args.orphan:
        return orphan(fields)
    if not args.repeat:
        return ask_once(fields, args.fuse, args.fd)
    if args.one_fuse:  # one /dev/fuse, named in every request
        args.fd, args.fuse = open_fuse(), False
    results = []
    for i in range(args.repeat):
        these = [f.replace("{i}", str(i)) for f in fields]
        if args.mkdir:
            os.makedirs(next(f.split("=", 1)[1] for f in these if f.startswith("path=")),
                        exist_ok=True)
        results.append(ask_once(these, args.fuse, args.fd))
    return tally(results)


def cmd_chroot_ask(args: argparse.Namespace) -> dict[str, Any]:
    """Connect and open /dev/fuse while the root is the container's, then chroot: the
    request is read while the process's root is DIR."""
    fd = open_fuse()
    sock = connect()
    os.chroot(args.dir)
    os.chdir("/")
    return send(sock, with_fuse([f"v={VERSION}", *args.fields], fd))


def cmd_chroot_race(args: argparse.Namespace) -> dict[str, Any]:
    """One thread flips the process's root between the container's and DIR as fast as
    it can; the main thread connects (with the real root) and asks, again and again."""
    real = os.open("/", os.O_PATH | os.O_DIRECTORY)
    lock = threading.Lock()
    done = threading.Event()

    def flip() -> None:
        while not done.is_set():
            with lock:
                os.chroot(args.dir)
            with lock:
                os.fchdir(real)
                os.chroot(".")

    flipper = threading.Thread(target=flip, daemon=True)
    flipper.start()
    results = []
    fields = [f"v={VERSION}", *args.fields]
    for _ in range(args.iterations):
        with lock:
            os.fchdir(real)
            os.chroot(".")
            sock = connect()
        with sock:
            results.append(send(sock, fields))
    done.set()
    flipper.join()
    return tally(results)


def cmd_rename_race(args: argparse.Namespace) -> dict[str, Any]:
    """Swap directories A and B (one holds a FUSE mount whose daemon never answers) while
    asking for PATHs through them: a broker that resolves a path through the swapped-in
    FUSE mount waits on its daemon."""
    done = threading.Event()
    swaps = 0

    def swap() -> None:
        nonlocal swaps
        spare = f"{args.a}.spare"
        while not done.is_set():
            os.rename(args.a, spare)
            os.rename(args.b, args.a)
            os.rename(spare, args.b)
            swaps += 1

    swapper = threading.Thread(target=swap, daemon=True)
    swapper.start()
    results = []
    for i in range(args.iterations):
        path = args.paths[i % len(args.paths)]
        results.append(ask_once([f"v={VERSION}", "op=mount", f"path={path}"], True, None))
    done.set()
    swapper.join()
    out = tally(results)
    out["swaps"] = swaps
    return out


def cmd_hold(args: argparse.Namespace) -> dict[str, Any]:
    """A FUSE mount whose daemon never reads its device: every request to it waits."""
    fd = open_fuse()
    answer = ask_once([f"v={VERSION}", "op=mount", f"path={args.mountpoint}"], False, fd)
    answer["held"] = True
    return answer


def cmd_silent(args: argparse.Namespace) -> dict[str, Any]:
    """With --settle, one more connection asks something after the N: the broker takes
    connections in order, so once it has answered that one, every refusal of the N has
    been sent; the N are then sorted into held and refused."""
    opened = [connect() for _ in range(args.n)]
    if not args.settle:
        globals()["_keep"] = opened
        return {"opened": len(opened)}
    held, refused = settled(opened)
    globals()["_keep"] = held
    return {"held": len(held), "refused": refused}


def settled(opened: list[socket.socket]) -> tuple[list[socket.socket], dict[str, int]]:
    """One more connection asks something after ``opened``: the broker takes connections
    in order, so once it has answered that one every refusal of ``opened`` has been
    sent. Returns those it holds (no answer yet) and the refusals of the others."""
    with connect() as last:
        send(last, [f"v={VERSION}", "op=unmount", "path=/nonexistent"])
    held: list[socket.socket] = []
    refused: collections.Counter[str] = collections.Counter()
    for sock in opened:
        sock.setblocking(False)
        try:
            data = sock.recv(65536)
        except BlockingIOError:
            held.append(sock)
            continue
        refused[data.decode(errors="replace").split("message=", 1)[-1].strip("\0")] += 1
        sock.close()
    return held, dict(refused)


# A connection answered sooner than this after it was made was refused at accept: the
# next one waits as long, a tenant's pace rather than a spin against a full broker.
REFUSED_WITHIN = 0.5


def cmd_keep(args: argparse.Namespace) -> None:
    """Hold N silent connections for as long as this process lives: the broker answers
    each one at its request deadline (or at once, refused), and it is replaced by a new
    one, so the container holds its share all the time. Prints, once settled, how many
    the broker held (those it already answered at their deadline among them) and why it
    refused the rest; then runs until killed."""
    held, refused = settled([connect() for _ in range(args.n)])
    # On a loaded node settling may outlast the request deadline: those the broker
    # answered at their deadline were held, not refused.
    expired = sum(refused.pop(m) for m in list(refused) if "no complete request" in m)
    print(json.dumps({"held": len(held) + expired, "expired": expired, "refused": refused}),
          flush=True)
    chooser = selectors.DefaultSelector()

    def hold(sock: socket.socket) -> None:
        sock.setblocking(False)
        chooser.register(sock, selectors.EVENT_READ, (sock, time.monotonic()))

    for sock in held:
        hold(sock)
    due = [0.0] * (args.n - len(held))  # when each missing one is made again
    while True:
        now = time.monotonic()
        for when in [w for w in due if w <= now]:
            due.remove(when)
            hold(connect())
        for key, _ in chooser.select(max(0.0, min(due) - now) if due else None):
            sock, made = key.data
            chooser.unregister(sock)
            with contextlib.suppress(OSError):
                sock.recv(65536)
            sock.close()
            at_once = time.monotonic() - made < REFUSED_WITHIN
            due.append(time.monotonic() + (REFUSED_WITHIN if at_once else 0.0))


def lingering_tcp() -> tuple[socket.socket, socket.socket, socket.socket]:
    """A listening socket, the peer it accepted and a TCP socket to it whose close
    lingers an hour (SO_LINGER): its send buffer is full of data the peer never reads.
    Whoever closes the last reference to it waits."""
    server = socket.create_server(("127.0.0.1", 0))
    tcp = socket.create_connection(server.getsockname())
    peer, _ = server.accept()
    peer.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    tcp.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 3600))
    tcp.setblocking(False)
    with contextlib.suppress(BlockingIOError):
        while True:
            tcp.send(b"x" * 65536)
    return server, peer, tcp


def cmd_descriptors(args: argparse.Namespace) -> dict[str, Any]:
    """A TCP socket whose close lingers (SO_LINGER, unacknowledged data to a peer that
    never reads), attached to a request: whoever drops its last reference waits."""
    server, peer, tcp = lingering_tcp()
    sock = connect()
    fields = encode([f"v={VERSION}", "op=mount", "path=/mnt", "fuse_fd=0"])
    try:
        socket.send_fds(sock, [fields], [tcp.fileno()])
        sent, error = True, ""
    except OSError as err:
        sent, error = False, err.strerror or str(err)
    if sent:
        tcp.close()  # the request now holds the only other reference
    else:  # ours again: at exit it closes at once instead of lingering in this process
        globals()["_cleanup"] = lambda: tcp.setsockopt(
            socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    globals()["_keep"] = (server, peer, sock, tcp)
    return {"sent": sent, "error": error}


def cmd_pin_and_hide(args: argparse.Namespace) -> dict[str, Any]:
    """Mount, keep the mount alive with an O_PATH fd, lazily unmount it so no table
    shows it, and go again: how many live FUSE connections can one container get?"""
    kept, results = [], []
    for i in range(args.n):
        point = os.path.join(args.dir, str(i))
        os.makedirs(point, exist_ok=True)
        fd = open_fuse()
        answer = ask_once([f"v={VERSION}", "op=mount", f"path={point}"], False, fd)
        results.append(answer)
        if answer["status"] != "ok":
            os.close(fd)
            continue
        kept += [fd, os.open(point, os.O_PATH)]
        ask_once([f"v={VERSION}", "op=unmount", f"path={point}", "flags=lazy"], False, None)
    globals()["_keep"] = kept
    out = tally(results)
    out["mounted"] = sum(1 for r in results if r["status"] == "ok")
    return out


def cmd_swap_race(args: argparse.Namespace) -> dict[str, Any]:
    """DIR/a is the caller's, DIR/b a directory it may not write. One thread swaps them
    by renames, and turns DIR/a into a symlink to DIR/b and back; the main thread asks
    for DIR/a again and again. Every mount that succeeds is checked: the directory under
    it (its inode, read from the parent's entries, which never asks the mount) must be
    the caller's own."""
    own = os.stat(os.path.join(args.dir, "a")).st_ino
    done = threading.Event()
    swaps = 0

    def swap() -> None:
        nonlocal swaps
        a, b, spare = (os.path.join(args.dir, n) for n in ("a", "b", "spare"))
        while not done.is_set():
            with contextlib.suppress(OSError):  # a mountpoint cannot move: EBUSY
                os.rename(a, spare)
                if swaps % 2:
                    os.symlink("b", a)
                    os.unlink(a)
                    os.rename(spare, a)
                else:
                    os.rename(b, a)
                    os.rename(spare, b)
            swaps += 1

    swapper = threading.Thread(target=swap, daemon=True)
    swapper.start()
    outcome: collections.Counter[str] = collections.Counter()
    for _ in range(args.iterations):
        fd = open_fuse()
        answer = ask_once([f"v={VERSION}", "op=mount", f"path={args.dir}/a"], False, fd)
        if answer["status"] != "ok":
            outcome["refused"] += 1
            os.close(fd)
            continue
        point = mountpoint_of(answer["mount_id"])
        name = os.path.basename(point)
        entry = next(e for e in os.scandir(os.path.dirname(point)) if e.name == name)
        outcome["own" if entry.inode() == own else "not own"] += 1
        ask_once([f"v={VERSION}", "op=unmount", f"path={point}", "flags=lazy"], False, None)
        os.close(fd)
    done.set()
    swapper.join()
    return {"outcome": dict(outcome), "swaps": swaps}


# -- a FUSE stub (the kernel's wire format, include/uapi/linux/fuse.h) ---------------------

FUSE_LOOKUP, FUSE_FORGET, FUSE_GETATTR, FUSE_OPEN, FUSE_RELEASE = 1, 2, 3, 14, 18
FUSE_FLUSH, FUSE_INIT, FUSE_INTERRUPT, FUSE_BATCH_FORGET = 25, 26, 36, 42
IN_HEADER = struct.Struct("=IIQQIIIHH")
OUT_HEADER = struct.Struct("=IiQ")
ATTR = struct.Struct("=QQQQQQIIIIIIIIII")
FILE_NODE = 2
NO_REPLY = (FUSE_FORGET, FUSE_BATCH_FORGET, FUSE_INTERRUPT)


def fuse_attr(node: int) -> bytes:
    """The root (a directory) or its one file, owned by whoever serves them."""
    mode = 0o40755 if node == 1 else 0o100644
    return ATTR.pack(node, 0, 0, 0, 0, 0, 0, 0, 0, mode, 2 if node == 1 else 1,
                     os.getuid(), os.getgid(), 0, 4096, 0)


def fuse_answer(opcode: int, node: int, body: bytes) -> tuple[int, bytes]:
    """(error, payload) for one request the stub understands; ENOSYS for the rest."""
    if opcode == FUSE_INIT:
        (readahead,) = struct.unpack_from("=I", body, 8)
        return 0, struct.pack("=IIIIHHIIHHII24x", 7, 31, readahead, 0, 16, 12, 65536, 1,
                              0, 0, 0, 0)
    if opcode == FUSE_LOOKUP:
        return 0, struct.pack("=QQQQII", FILE_NODE, 0, 60, 60, 0, 0) + fuse_attr(FILE_NODE)
    if opcode == FUSE_GETATTR:
        return 0, struct.pack("=QII", 60, 0, 0) + fuse_attr(node)
    if opcode == FUSE_OPEN:
        return 0, struct.pack("=QII", 1, 0, 0)
    if opcode in (FUSE_FLUSH, FUSE_RELEASE):
        return 0, b""
    return -38, b""  # ENOSYS


def serve_fuse(fd: int, record: str, never: frozenset[int], outside_only: bool) -> None:
    """Read requests forever: record each, answer what the stub knows (never the
    opcodes in ``never``; with ``outside_only``, never them from a process outside the
    container's PID namespace, which the kernel names as pid 0: the broker's helper)."""
    with open(record, "a", buffering=1) as log:
        while True:
            try:
                data = os.read(fd, 1 << 20)
            except OSError:
                return  # unmounted or aborted
            _, opcode, unique, node, uid, gid, pid, _, _ = IN_HEADER.unpack_from(data)
            body = data[IN_HEADER.size:]
            name = body.split(b"\0", 1)[0].decode(errors="replace") \
                if opcode == FUSE_LOOKUP else ""
            log.write(json.dumps({"opcode": opcode, "uid": uid, "gid": gid, "pid": pid,
                                  "name": name}) + "\n")
            if opcode in NO_REPLY or (opcode in never and (pid == 0 or not outside_only)):
                continue
            error, payload = fuse_answer(opcode, node, body)
            with contextlib.suppress(OSError):
                os.write(fd, OUT_HEADER.pack(OUT_HEADER.size + len(payload), error, unique)
                         + payload)


def cmd_serve(args: argparse.Namespace) -> dict[str, Any]:
    fd = open_fuse()
    answer = ask_once([f"v={VERSION}", "op=mount", f"path={args.mountpoint}"], False, fd)
    if answer["status"] == "ok":
        never = frozenset({FUSE_FLUSH, FUSE_RELEASE}) \
            if args.no_flush or args.no_flush_from_outside else frozenset()
        if args.never_lookup:
            never |= {FUSE_LOOKUP}
        threading.Thread(target=serve_fuse,
                         args=(fd, args.record, never, args.no_flush_from_outside),
                         daemon=True).start()
    return answer


def cmd_swap_ask(args: argparse.Namespace) -> dict[str, Any]:
    """Name one fd number N as fuse_fd again and again while a thread swaps what N is
    (dup2) between this process's /dev/fuse and FILE (in a FUSE mount): a helper that
    judges N and then takes it may take FILE."""
    fuse, other = open_fuse(), os.open(args.file, os.O_RDWR)
    number = os.dup(fuse)
    done = threading.Event()
    swaps = 0

    def swap() -> None:
        nonlocal swaps
        while not done.is_set():
            os.dup2(other, number)
            os.dup2(fuse, number)
            swaps += 1

    swapper = threading.Thread(target=swap, daemon=True)
    swapper.start()
    results = []
    for i in range(args.n):
        point = os.path.join(args.dir, str(i))
        os.makedirs(point, exist_ok=True)
        results.append(ask_once([f"v={VERSION}", "op=mount", f"path={point}"], False,
                                number))
    done.set()
    swapper.join()
    out = tally(results)
    out["swaps"] = swaps
    return out


def cmd_pass_fd(args: argparse.Namespace) -> dict[str, Any]:
    """Open FILE (a file in a FUSE mount) and give it to every process that connects."""
    fd = os.open(args.file, os.O_RDWR)
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(args.socket)
    os.chmod(args.socket, 0o777)
    server.listen(16)

    def give() -> None:
        while True:
            conn, _ = server.accept()
            with conn:
                socket.send_fds(conn, [b"fd"], [fd])

    threading.Thread(target=give, daemon=True).start()
    globals()["_keep"] = (server, fd)
    return {"serving": True, "fd": fd}


def cmd_ask_with_fd(args: argparse.Namespace) -> dict[str, Any]:
    """Take a descriptor someone else opened, and name it as this caller's /dev/fuse."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.connect(args.socket)
        _, [fd], _, _ = socket.recv_fds(sock, 16, 1)
    results = [ask_once([f"v={VERSION}", *args.fields], False, fd) for _ in range(args.n)]
    out = tally(results)
    out["fd"] = fd
    return out


def cmd_mount_loop(args: argparse.Namespace) -> dict[str, Any]:
    """Mount one new directory after another while the broker is killed and restarted
    under it: a request the dying broker never answered is "closed"."""
    done = threading.Event()

    def watch() -> None:
        sys.stdin.read()
        done.set()

    threading.Thread(target=watch, daemon=True).start()
    results, unreachable, i = [], 0, 0
    while not done.is_set():
        point = os.path.join(args.dir, str(i))
        os.makedirs(point, exist_ok=True)
        try:
            results.append(ask_once([f"v={VERSION}", "op=mount", f"path={point}"], True,
                                    None))
            i += 1
        except OSError:  # no socket, or no one listening: the broker is restarting
            unreachable += 1
            done.wait(0.01)
    out = tally(results)
    out.update(unreachable=unreachable, asked=i)
    return out


def cmd_ask_later(args: argparse.Namespace) -> dict[str, Any]:
    """Connected first, asking later: whatever the broker opens at accept is open, and
    what it opens for the request is not yet, while the test changes the broker."""
    fd = open_fuse() if args.fuse else None
    sock = connect()
    print(json.dumps({"connected": True}), flush=True)
    sys.stdin.readline()
    with sock:
        return send(sock, with_fuse([f"v={VERSION}", *args.fields], fd))


def fuse_mounts_under(directory: str) -> list[str]:
    """The FUSE mounts below ``directory`` in this namespace's table, deepest first."""
    points = []
    with open("/proc/self/mountinfo") as table:
        for line in table:
            fields = line.split()
            point = fields[4].replace("\\040", " ")
            fstype = fields[fields.index("-") + 1]
            if point.startswith(directory.rstrip("/") + "/") and fstype.startswith("fuse"):
                points.append(point)
    return sorted(points, key=len, reverse=True)


def cmd_burst(args: argparse.Namespace) -> dict[str, Any]:
    """N mount requests in flight at once: all N connect before any sends, so the
    broker has every request before any helper of theirs has finished (admission must
    count them, not only finished mounts). ``mounted`` is what this namespace then holds
    under DIR, which only this command's requests put there; ``before`` what it held
    first (the last burst's, if they were not unmounted)."""
    points = [os.path.join(args.dir, str(i)) for i in range(args.n)]
    for point in points:
        os.makedirs(point, exist_ok=True)
    before = len(fuse_mounts_under(args.dir))
    fds = [open_fuse() for _ in points]
    print(json.dumps({"ready": args.n}), flush=True)
    sys.stdin.readline()
    socks = [connect() for _ in points]
    for sock, point, fd in zip(socks, points, fds, strict=True):
        with contextlib.suppress(BrokenPipeError):  # answered at accept: the answer waits
            sock.send(encode([f"v={VERSION}", "op=mount", f"path={point}", f"fuse_fd={fd}"]))
    results = [reply_of(sock) for sock in socks]
    for sock, fd in zip(socks, fds, strict=True):
        sock.close()
        os.close(fd)
    out = tally(results)
    out.update(before=before, mounted=len(fuse_mounts_under(args.dir)))

    def unmount() -> None:
        for point in fuse_mounts_under(args.dir):
            ask_once([f"v={VERSION}", "op=unmount", f"path={point}"], False, None)

    globals()["_cleanup"] = unmount
    return out


def mountpoint_of(mount_id: str) -> str:
    with open("/proc/self/mountinfo") as table:
        for line in table:
            fields = line.split()
            if fields[0] == mount_id:
                return fields[4].replace("\\040", " ")
    raise LookupError(f"mount {mount_id} is not in this namespace")


def _libc_call(name: str, *args: Any) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    if getattr(libc, name)(*args) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{name}: {os.strerror(err)}")


def in_namespaces(flags: int, outside: int, work: Any) -> dict[str, Any]:
    """``work()`` in a child that made a user namespace (with ``flags``' other
    namespaces, owned by it) whose root is the node's ``outside``, as the container's
    root may map it; the child's JSON result."""
    ready_r, ready_w = os.pipe()
    mapped_r, mapped_w = os.pipe()
    out_r, out_w = os.pipe()
    child = os.fork()
    if child == 0:
        try:
            _libc_call("unshare", CLONE_NEWUSER | flags)
            os.write(ready_w, b"u")
            os.read(mapped_r, 1)
            result = work()
        except Exception as err:  # reported, as every command reports its outcome
            result = {"status": "error", "message": str(err)}
        os.write(out_w, json.dumps(result).encode())
        os._exit(0)
    for fd in (ready_w, mapped_r, out_w):
        os.close(fd)
    os.read(ready_r, 1)
    for name in ("uid_map", "gid_map"):
        with open(f"/proc/{child}/{name}", "w") as text:
            text.write(f"0 {outside} 1")
    os.write(mapped_w, b"m")
    data = b""
    while chunk := os.read(out_r, 65536):
        data += chunk
    os.waitpid(child, 0)
    return json.loads(data) if data else {"status": "error", "message": "no result"}


def lxcfs_binds() -> list[str]:
    """The fuse.lxcfs mounts in this process's mount namespace."""
    with open("/proc/self/mountinfo") as table:
        return [line.split()[4] for line in table if " - fuse.lxcfs " in line]


def cmd_nested_ask(args: argparse.Namespace) -> dict[str, Any]:
    def work() -> dict[str, Any]:
        _libc_call("mount", args.source.encode(), args.target.encode(), None, MS_BIND, None)
        sock = connect()
        sock.settimeout(ANSWER_WAIT)
        try:
            sock.send(encode(args.fields))
            answer = reply_of(sock)
        except TimeoutError:
            answer = {"status": "no answer"}
        finally:
            sock.close()
        return {"answer": answer, "lxcfs_binds": lxcfs_binds()}

    return in_namespaces(CLONE_NEWNS, args.uid, work)


def cmd_split_cgroups(args: argparse.Namespace) -> dict[str, Any]:
    """The container's root makes cgroups below its own in a hierarchy it mounts in
    namespaces of its own, and moves one asking process into each."""
    askers = []
    for i in range(args.n):
        go_r, go_w = os.pipe()
        out_r, out_w = os.pipe()
        child = os.fork()
        if child == 0:
            os.read(go_r, 1)
            held, answers = [], []
            for j in range(args.m):
                path = f"{args.dir}/{i}-{j}"
                os.makedirs(path, exist_ok=True)
                held.append(open_fuse())
                answers.append(ask_once([f"v={VERSION}", "op=mount", f"path={path}"],
                                        False, held[-1]))
            with open("/proc/self/cgroup") as own:
                cgroup = own.read()
            os.write(out_w, json.dumps({"cgroup": cgroup, **tally(answers)}).encode())
            os._exit(0)
        os.close(go_r)
        os.close(out_w)
        askers.append((child, go_w, out_r))
    with open("/proc/self/cgroup") as own:
        unified = all(line.startswith("0::") for line in own.read().splitlines())
    hierarchy = f"{args.dir}/.cgroup"
    os.makedirs(hierarchy, exist_ok=True)

    def split() -> dict[str, Any]:
        if unified:
            _libc_call("mount", b"cgroup2", hierarchy.encode(), b"cgroup2", 0, None)
        else:
            _libc_call("mount", b"cgroup", hierarchy.encode(), b"cgroup", 0, b"devices")
        moved = []
        for i, (child, _, _) in enumerate(askers):
            os.mkdir(f"{hierarchy}/split{i}")
            with open(f"{hierarchy}/split{i}/cgroup.procs", "w") as procs:
                procs.write(str(child))
            moved.append(child)
        return {"moved": moved}

    result = in_namespaces(CLONE_NEWNS | CLONE_NEWCGROUP, 0, split)
    found = []
    for child, go_w, out_r in askers:
        os.write(go_w, b"g")
        data = b""
        while chunk := os.read(out_r, 65536):
            data += chunk
        os.waitpid(child, 0)
        found.append(json.loads(data))
    return {"split": result, "askers": found}


def add_fuse_commands(sub: Any) -> None:
    """The commands around a FUSE stub and descriptors handed between tenants."""
    serve = sub.add_parser("serve")
    serve.add_argument("mountpoint")
    serve.add_argument("record")
    serve.add_argument("--no-flush", action="store_true")
    serve.add_argument("--no-flush-from-outside", action="store_true")
    serve.add_argument("--never-lookup", action="store_true")
    nested = sub.add_parser("nested-ask")
    nested.add_argument("uid", type=int)
    nested.add_argument("source")
    nested.add_argument("target")
    nested.add_argument("fields", nargs="+")
    split = sub.add_parser("split-cgroups")
    split.add_argument("n", type=int)
    split.add_argument("m", type=int)
    split.add_argument("dir")
    swap_ask = sub.add_parser("swap-ask")
    swap_ask.add_argument("dir")
    swap_ask.add_argument("n", type=int)
    swap_ask.add_argument("file")
    pass_fd = sub.add_parser("pass-fd")
    pass_fd.add_argument("file")
    pass_fd.add_argument("socket")
    loop = sub.add_parser("mount-loop")
    loop.add_argument("dir")
    later = sub.add_parser("ask-later")
    later.add_argument("--fuse", action="store_true")
    later.add_argument("fields", nargs="+")
    with_fd = sub.add_parser("ask-with-fd")
    with_fd.add_argument("socket")
    with_fd.add_argument("n", type=int)
    with_fd.add_argument("fields", nargs="+")
    burst = sub.add_parser("burst")
    burst.add_argument("n", type=int)
    burst.add_argument("dir")


def main() -> int:
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers(dest="command", required=True)
    ask = sub.add_parser("ask")
    ask.add_argument("--fuse", action="store_true")
    ask.add_argument("--fd", type=int)
    ask.add_argument("--repeat", type=int, default=0)
    ask.add_argument("--mkdir", action="store_true")
    ask.add_argument("--orphan", action="store_true")
    ask.add_argument("--one-fuse", action="store_true")
    ask.add_argument("fields", nargs="+")
    chroot_ask = sub.add_parser("chroot-ask")
    chroot_ask.add_argument("dir")
    chroot_ask.add_argument("fields", nargs="+")
    race = sub.add_parser("chroot-race")
    race.add_argument("dir")
    race.add_argument("iterations", type=int)
    race.add_argument("fields", nargs="+")
    rename = sub.add_parser("rename-race")
    rename.add_argument("a")
    rename.add_argument("b")
    rename.add_argument("iterations", type=int)
    rename.add_argument("paths", nargs="+")
    hold = sub.add_parser("hold")
    hold.add_argument("mountpoint")
    silent = sub.add_parser("silent")
    silent.add_argument("n", type=int)
    silent.add_argument("--settle", action="store_true")
    keep = sub.add_parser("keep")
    keep.add_argument("n", type=int)
    sub.add_parser("descriptors")
    pin = sub.add_parser("pin-and-hide")
    pin.add_argument("n", type=int)
    pin.add_argument("dir")
    race_swap = sub.add_parser("swap-race")
    race_swap.add_argument("dir")
    race_swap.add_argument("iterations", type=int)
    add_fuse_commands(sub)
    args = parser.parse_args()
    if args.command == "keep":
        cmd_keep(args)  # runs until killed
        return 0
    commands = {"ask": cmd_ask, "chroot-ask": cmd_chroot_ask, "chroot-race": cmd_chroot_race,
                "rename-race": cmd_rename_race, "hold": cmd_hold, "silent": cmd_silent,
                "descriptors": cmd_descriptors, "pin-and-hide": cmd_pin_and_hide,
                "swap-race": cmd_swap_race, "serve": cmd_serve, "pass-fd": cmd_pass_fd,
                "ask-with-fd": cmd_ask_with_fd, "ask-later": cmd_ask_later,
                "mount-loop": cmd_mount_loop, "swap-ask": cmd_swap_ask,
                "burst": cmd_burst, "nested-ask": cmd_nested_ask,
                "split-cgroups": cmd_split_cgroups}
    print(json.dumps(commands[args.command](args)), flush=True)
    if args.command in ("hold", "silent", "descriptors", "pin-and-hide", "serve", "pass-fd",
                        "ask-with-fd", "burst"):
        sys.stdin.read()  # hold until the test closes our stdin
        globals().get("_cleanup", lambda: None)()
    return 0


if __name__ == "__main__":
    sys.exit(main())
