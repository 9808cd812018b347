"""A small HTTP/1.0 port for probes and scrapes that no client can starve.

The kubelet restarts a pod after a few failed liveness probes, so a port that anyone can
fill is a way to keep a node component restarting: a thread per connection with a cap of
16 and a 5 s socket timeout was starved by 16 idle connections renewed every 4 s. Here
one thread multiplexes every connection with ``selectors`` over non-blocking sockets:

- each connection has ``DEADLINE`` seconds to send its whole request head (request line
  and headers, sizes bounded), and as long again to take its answer;
- at most ``max_connections`` are open; a new one closes the oldest connection of the
  address that holds the most to make room, so a flood of idle or half-sent connections
  can never keep a fresh probe out, and a flood from one pod cannot even push out a
  probe from the node that is slow to send its request. A request that has already
  arrived is answered as its connection is accepted;
- answers are written without blocking; a reader that stops reading meets its deadline.

It speaks only what probes and Prometheus send: HTTP/1.0, GET, one request per
connection, paths looked up in a table (400, 405 and 404 otherwise). An idle port costs
nothing: the thread waits on the listening socket and a stop pipe, with no timeout while
no connection is open. ``http.server`` is not used: it pulls in ``http.client`` and the
``email`` package (memory on every node: bench/README.md) to parse headers nobody here
reads.

The plugin's metrics port (``fuse_plugin.deviceplugin.metrics``) and the mount broker's use it.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import selectors
import socket
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping
from http import HTTPStatus

from fuse_plugin import logs
from fuse_plugin.errors import Failure

# What a route answers: status, body, Content-Type.
Answer = tuple[HTTPStatus, bytes, str]
Route = Callable[[], Answer]

TEXT = "text/plain; charset=utf-8"


def probe(check: Callable[[], tuple[bool, str]]) -> Route:
    """A probe's route from a check that says (ok, why): 200 or 503 with the reason as
    its one line, so the kubelet's event and a curl show why a pod is not ready."""
    def answer() -> Answer:
        ok, reason = check()
        return (HTTPStatus.OK if ok else HTTPStatus.SERVICE_UNAVAILABLE,
                f"{reason}\n".encode(), TEXT)
    return answer
# Probes and scrapes send their request at once and read a few KiB: nothing legitimate
# takes this long for either half.
DEADLINE = 5.0
MAX_CONNECTIONS = 64
# A request line or header longer than this, or more headers, is not a probe (400).
MAX_LINE = 8192
MAX_HEADERS = 100
# Connections the kernel completes before we accept them; a flood waits here, in order.
BACKLOG = 128
RECV_SIZE = 16384
# accept() failing for want of descriptors: dropping our oldest connection frees one.
_OUT_OF_FDS = (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM)
ACCEPT_PAUSE = 1.0  # seconds without accepting when out of fds with nothing to close


def where(address: str, port: int) -> str:
    """``address:port`` as a URL writes it: an IPv6 address in brackets, without which
    its last group reads as the port."""
    return f"[{address}]:{port}" if ":" in address else f"{address}:{port}"


@contextlib.contextmanager
def serving(routes: Mapping[str, Route], address: str, port: int, *, name: str,
            log: logging.Logger, max_connections: int = MAX_CONNECTIONS
            ) -> Iterator[HttpPort]:
    """Serve ``routes`` until the block ends, for the plugin's, the broker's and the DRA
    driver's ports alike. A port that cannot be bound is a one-line ``Failure`` (exit 1)
    naming the port (``name``: metrics, probes), since it is a setting to fix, not a
    bug; the event ``<name>.serving`` gives the port bound (``port`` 0 picks one)."""
    try:
        http = HttpPort(routes, address, port, name=name, max_connections=max_connections,
                        log=log)
    except OSError as err:
        raise Failure(f"cannot serve {name} on {where(address, port)}: "
                      f"{err.strerror or err}") from None
    http.start()
    logs.event(log, f"{name}.serving", address=address, port=http.port)
    try:
        yield http
    finally:
        http.stop()


class _TooLong(Exception):
    """The request head broke a size bound."""


class _Connection:
    """One client: its socket, when it must be done by, and its request or answer."""

    __slots__ = ("deadline", "headers", "out", "pending", "request_line", "sock", "source")

    def __init__(self, sock: socket.socket, source: str, deadline: float) -> None:
        self.sock = sock
        self.source = source
        self.deadline = deadline
        self.pending = bytearray()  # the part of a line not yet ended
        self.request_line: bytes | None = None
        self.headers = 0
        self.out: memoryview | None = None  # the answer left to write, once answering

    def feed(self, data: bytes) -> bytes | None:
        """Take more of the request head; the request line once the head has ended.

        Header lines are counted and dropped as they end, so a connection holds at most
        two lines whatever it sends; a line or a head over the bounds raises ``_TooLong``.
        """
        self.pending += data
        while True:
            end = self.pending.find(b"\n")
            if end < 0:
                if len(self.pending) > MAX_LINE:
                    raise _TooLong
                return None
            line = bytes(self.pending[:end + 1])
            del self.pending[:end + 1]
            if len(line) > MAX_LINE:
                raise _TooLong
            if self.request_line is None:
                self.request_line = line
            elif line in (b"\r\n", b"\n"):
                return self.request_line
            else:
                self.headers += 1
                if self.headers > MAX_HEADERS:
                    raise _TooLong


class HttpPort:
    """Serve ``routes`` (path -> callable returning an ``Answer``) on ``address:port``.

    Routes run on the port's own thread and must answer from memory at once: while one
    runs, no other connection is served. Binding happens here, so a port in use is an
    ``OSError`` before anything starts; ``start()`` serves, ``stop()`` returns once the
    thread has ended and every socket is closed.
    """

    def __init__(self, routes: Mapping[str, Route], address: str, port: int, *,
                 name: str = "http", max_connections: int = MAX_CONNECTIONS,
                 log: logging.Logger | None = None) -> None:
        self._routes = dict(routes)
        self._name = name
        self._max = max(1, max_connections)
        self._log = log or logs.get()
        paths = list(self._routes)
        listed = " or ".join([", ".join(paths[:-1]), paths[-1]] if len(paths) > 1 else paths)
        self._not_found = f"try {listed}\n".encode() if paths else b"not found\n"
        family = socket.AF_INET6 if ":" in address else socket.AF_INET
        self._listener = socket.socket(family, socket.SOCK_STREAM)
        try:
            # A restarted process binds at once, as http.server does.
            self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            self._listener.bind((address, port))
            self._listener.listen(BACKLOG)
            self._listener.setblocking(False)
        except OSError:
            self._listener.close()
            raise
        self._stop_read, self._stop_write = os.pipe()
        # Open connections, oldest first; a connection that starts answering moves to the
        # end. Every deadline is "last move + DEADLINE", so this is deadline order too.
        self._open: OrderedDict[_Connection, None] = OrderedDict()
        self._per_source: dict[str, int] = {}  # open connections by client address
        self._paused_until = 0.0
        self._selector = selectors.DefaultSelector()
        self._thread = threading.Thread(target=self._serve, name=name, daemon=True)

    @property
    def port(self) -> int:
        return int(self._listener.getsockname()[1])

    def start(self) -> HttpPort:
        self._thread.start()
        return self

    def stop(self) -> None:
        """End the thread (it is woken through the pipe, never polled) and close all."""
        if self._thread.ident is not None:
            os.write(self._stop_write, b"x")
            self._thread.join()
        for conn in list(self._open):
            self._close(conn)
        self._selector.close()
        self._listener.close()
        os.close(self._stop_read)
        os.close(self._stop_write)

    # -- the loop ------------------------------------------------------------------------

    def _serve(self) -> None:
        """Wait for the listener, the stop pipe and open connections, and for nothing at
        all while none is open: an idle port does not wake."""
        self._selector.register(self._listener, selectors.EVENT_READ)
        self._selector.register(self._stop_read, selectors.EVENT_READ)
        while True:
            for key, _ in self._selector.select(self._timeout()):
                if key.fileobj == self._stop_read:
                    return
                if key.fileobj is self._listener:
                    self._accept()
                elif key.data in self._open:  # not closed earlier in this round
                    self._serve_one(key.data)
            self._expire()

    def _serve_one(self, conn: _Connection) -> None:
        """Read or write, as the connection is at; a bug met here costs that connection
        and one log line, never the port (whose silence would restart the process)."""
        try:
            if conn.out is None:
                self._read(conn)
            else:
                self._write(conn)
        except Exception as err:
            logs.event(self._log, f"{self._name}.error", logging.WARNING, error=repr(err))
            self._close(conn)

    def _pause(self) -> None:
        """The process is out of fds: stop watching the listener for a moment (the
        kernel's queue holds the clients) instead of spinning on the same error."""
        self._selector.unregister(self._listener)
        self._paused_until = time.monotonic() + ACCEPT_PAUSE

    def _timeout(self) -> float | None:
        ends = [next(iter(self._open)).deadline] if self._open else []
        ends += [self._paused_until] if self._paused_until else []
        return max(0.0, min(ends) - time.monotonic()) if ends else None

    def _expire(self) -> None:
        now = time.monotonic()
        if self._paused_until and now >= self._paused_until:
            self._paused_until = 0.0
            self._selector.register(self._listener, selectors.EVENT_READ)
        while self._open:
            oldest = next(iter(self._open))
            if oldest.deadline > now:
                return
            self._close(oldest)

    def _accept(self) -> None:
        """Take what the kernel has queued, a quarter of the cap per turn at most: a
        flood does not fill the kernel's queue (where a probe's SYN would be dropped),
        and a newcomer whose request is still on its way is served on a later turn before
        enough others come to make it the oldest."""
        for _ in range(max(1, self._max // 4)):
            try:
                sock, peer = self._listener.accept()
            except BlockingIOError:
                return
            except OSError as err:
                if err.errno in _OUT_OF_FDS and self._open:
                    self._close(self._victim())
                elif err.errno in _OUT_OF_FDS:
                    self._pause()  # nothing of ours to free: do not spin on the error
                return
            self._take(sock, str(peer[0]))

    def _take(self, sock: socket.socket, source: str) -> None:
        """Track a new connection; over the cap, another makes room for it."""
        sock.setblocking(False)
        if len(self._open) >= self._max:
            self._close(self._victim())
        conn = _Connection(sock, source, time.monotonic() + DEADLINE)
        self._open[conn] = None
        self._per_source[source] = self._per_source.get(source, 0) + 1
        self._selector.register(sock, selectors.EVENT_READ, conn)
        self._serve_one(conn)  # a probe's request is usually here already: answer it now

    def _victim(self) -> _Connection:
        """The oldest connection of the address holding the most: from one address (the
        common case, and every test's) simply the oldest, and a flood from one pod only
        ever pushes out its own connections, never a probe from the node."""
        most = max(self._per_source.values())
        return next(conn for conn in self._open if self._per_source[conn.source] == most)

    # -- one connection ------------------------------------------------------------------

    def _read(self, conn: _Connection) -> None:
        try:
            data = conn.sock.recv(RECV_SIZE)
        except BlockingIOError:
            return
        except OSError:
            self._close(conn)
            return
        try:
            line = conn.feed(data) if data else self._at_eof(conn)
        except _TooLong:
            self._reply(conn, (HTTPStatus.BAD_REQUEST, b"bad request\n", TEXT))
            return
        if line is not None:
            self._reply(conn, self._answer(line))
        elif not data:
            self._close(conn)  # gone before saying anything

    @staticmethod
    def _at_eof(conn: _Connection) -> bytes | None:
        """A client that half-closes after its request (``nc -N``) is answered on what it
        sent, as a blocking server reading lines would; one that sent nothing is not."""
        if conn.request_line is None and conn.pending:
            conn.request_line = bytes(conn.pending)
        return conn.request_line

    def _answer(self, line: bytes) -> Answer:
        parts = line.split()
        if len(parts) != 3 or not parts[2].startswith(b"HTTP/"):
            return HTTPStatus.BAD_REQUEST, b"bad request\n", TEXT
        if parts[0] != b"GET":
            return HTTPStatus.METHOD_NOT_ALLOWED, b"GET only\n", TEXT
        route = self._routes.get(parts[1].split(b"?", 1)[0].decode("latin-1"))
        if route is None:
            return HTTPStatus.NOT_FOUND, self._not_found, TEXT
        try:
            return route()
        except Exception as err:  # one log line and a 500, never a dead port
            logs.event(self._log, f"{self._name}.error", logging.WARNING, error=repr(err))
            return HTTPStatus.INTERNAL_SERVER_ERROR, b"internal error\n", TEXT

    def _reply(self, conn: _Connection, answer: Answer) -> None:
        code, body, content_type = answer
        head = (f"HTTP/1.0 {code.value} {code.phrase}\r\nContent-Type: {content_type}"
                f"\r\nContent-Length: {len(body)}\r\n\r\n").encode("latin-1")
        conn.out = memoryview(head + body)
        conn.deadline = time.monotonic() + DEADLINE
        self._open.move_to_end(conn)
        self._write(conn)

    def _write(self, conn: _Connection) -> None:
        """Send what the socket takes now; the rest when it is writable again."""
        assert conn.out is not None
        try:
            sent = conn.sock.send(conn.out)
        except BlockingIOError:
            sent = 0
        except OSError:  # the client hung up (a probe timing out): routine
            self._close(conn)
            return
        conn.out = conn.out[sent:]
        if not conn.out:
            self._finish(conn)
        else:
            self._selector.modify(conn.sock, selectors.EVENT_WRITE, conn)

    def _finish(self, conn: _Connection) -> None:
        """Close after a whole answer. Unread input (a body we never read) is drained
        first: closing over it sends a reset, which can discard our answer at the client
        before it reads it."""
        with contextlib.suppress(OSError):
            conn.sock.recv(RECV_SIZE)
        self._close(conn)

    def _close(self, conn: _Connection) -> None:
        if conn in self._open:
            del self._open[conn]
            left = self._per_source.pop(conn.source) - 1
            if left:
                self._per_source[conn.source] = left
            self._selector.unregister(conn.sock)
            conn.sock.close()
