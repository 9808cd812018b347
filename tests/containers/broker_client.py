"""A hostile client of the broker, run inside a test container (stdlib only): it speaks
the protocol directly, as an attacker who owns the container would, instead of going
through the shim. Prints one JSON object.

    broker_client.py [--repeat N] [--mkdir] [--orphan] FIELD=VALUE...

``{i}`` in a field is replaced by the request's number. ``--orphan`` sends on a socket
whose connecting process has exited. File descriptors received are closed at once.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import socket
import sys

SOCKET = os.environ.get("FUSE_BROKER_SOCKET", "/run/fuse-broker/broker.sock")


def encode(fields: list[str]) -> bytes:
    return b"".join(f.encode() + b"\0" for f in fields)


def reply_of(sock: socket.socket) -> dict[str, object]:
    data, fds, _, _ = socket.recv_fds(sock, 65536, 4)
    for fd in fds:
        os.close(fd)
    fields = dict(f.split("=", 1) for f in data.decode().split("\0") if "=" in f)
    return {"status": fields.get("status", "closed"), "message": fields.get("message", ""),
            "fd": bool(fds)}


def ask(fields: list[str]) -> dict[str, object]:
    with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as sock:
        sock.connect(SOCKET)
        sock.send(encode(fields))
        return reply_of(sock)


def orphan(fields: list[str]) -> dict[str, object]:
    """A child connects the shared socket and exits; this process then sends on it, so
    the process the kernel names as the peer is gone (or its pid could be reused)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as sock:
        child = os.fork()
        if child == 0:
            sock.connect(SOCKET)
            os._exit(0)
        os.waitpid(child, 0)
        sock.send(encode(fields))
        return reply_of(sock)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeat", type=int, default=0)
    parser.add_argument("--mkdir", action="store_true")
    parser.add_argument("--orphan", action="store_true")
    parser.add_argument("fields", nargs="+")
    args = parser.parse_args()
    if args.orphan:
        print(json.dumps(orphan(args.fields)), flush=True)
        return 0
    if not args.repeat:
        print(json.dumps(ask(args.fields)))
        return 0
    counts: collections.Counter[str] = collections.Counter()
    messages: collections.Counter[str] = collections.Counter()
    for i in range(args.repeat):
        fields = [f.replace("{i}", str(i)) for f in args.fields]
        if args.mkdir:
            path = next(f.split("=", 1)[1] for f in fields if f.startswith("path="))
            os.makedirs(path, exist_ok=True)
        answer = ask(fields)
        counts[str(answer["status"])] += 1
        messages[str(answer["message"])] += 1
    print(json.dumps({"counts": counts, "messages": messages}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
