"""A small Kubernetes API server over real HTTP, for the DRA driver's unit tests.

It serves only what the driver calls, as the real one answers it: ResourceClaims (GET),
Nodes (GET), and ResourceSlices (list with field selectors, GET, POST, PUT with
resourceVersion checks, DELETE, and watch: chunked JSON lines, ADDED for what exists
unless a resourceVersion is given, then each change, ended after ``timeoutSeconds``), with
Status bodies for errors. Every write is recorded and wakes ``wait_for_write``, so tests
wait on events, not on time.

``drop_fields`` mimics an API server whose feature gate for a field is off (it drops the
field on write, as the real one does); ``fail`` makes the next calls of a kind answer an
error code.
"""

from __future__ import annotations

import copy
import functools
import json
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

RESOURCE = "/apis/resource.k8s.io/v1"
# A held request is answered after this even when its test never releases it.
HOLD_LIMIT = 60.0
SLICES = f"{RESOURCE}/resourceslices"


class FakeApiServer:
    def __init__(self) -> None:
        self.claims: dict[tuple[str, str], dict[str, Any]] = {}
        self.nodes: dict[str, dict[str, Any]] = {}
        self.slices: dict[str, dict[str, Any]] = {}
        self.requests: list[tuple[str, str]] = []
        self.writes: list[tuple[str, str, dict[str, Any] | None]] = []
        self.events: list[tuple[str, dict[str, Any]]] = []  # what watches are sent
        self.watches = 0  # watch requests answered
        self.drop_fields: set[str] = set()
        self.fail: dict[str, int] = {}  # "GET node" / "list slices" / ... -> HTTP code
        # "GET claim" / ... -> an event the request waits for before it is answered
        self.hold: dict[str, threading.Event] = {}
        self._version = 0
        self._closing = False
        self._cond = threading.Condition()
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, args=(0.05,),
                                        daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def start(self) -> FakeApiServer:
        self._thread.start()
        return self

    def stop(self) -> None:
        with self._cond:
            self._closing = True
            self._cond.notify_all()
        self._server.shutdown()
        self._server.server_close()

    def kubeconfig_dict(self) -> dict[str, Any]:
        """A kubeconfig naming this server, with a user that has no credentials."""
        return {
            "apiVersion": "v1", "kind": "Config", "current-context": "fake",
            "clusters": [{"name": "fake", "cluster": {"server": self.url}}],
            "users": [{"name": "fake", "user": {}}],
            "contexts": [{"name": "fake", "context": {"cluster": "fake", "user": "fake"}}]}

    def kubeconfig(self, path: Path) -> Path:
        """The kubeconfig as a file (JSON is YAML), for the real command's KUBECONFIG."""
        path.write_text(json.dumps(self.kubeconfig_dict()))
        return path

    # -- state the tests set and read ----------------------------------------------------

    def add_node(self, name: str) -> str:
        uid = str(uuid.uuid4())
        self.nodes[name] = {"apiVersion": "v1", "kind": "Node",
                            "metadata": {"name": name, "uid": uid}}
        return uid

    def add_claim(self, claim: dict[str, Any]) -> None:
        meta = claim["metadata"]
        self.claims[(meta["namespace"], meta["name"])] = claim

    def writes_since(self, count: int) -> list[tuple[str, str, dict[str, Any] | None]]:
        with self._cond:
            return list(self.writes[count:])

    def wait_for_write(self, count: int, timeout: float = 10.0) -> bool:
        """Until more than ``count`` writes have been made."""
        with self._cond:
            return self._cond.wait_for(lambda: len(self.writes) > count, timeout)

    # -- the HTTP side -------------------------------------------------------------------

    def _next_version(self) -> str:
        self._version += 1
        return str(self._version)

    def _record(self, verb: str, name: str, body: dict[str, Any] | None,
                obj: dict[str, Any] | None = None) -> None:
        self.writes.append((verb, name, copy.deepcopy(body)))
        event = {"create": "ADDED", "update": "MODIFIED", "delete": "DELETED"}[verb]
        self.events.append((event, copy.deepcopy(obj if obj is not None else body or {})))
        self._cond.notify_all()

    def delete_slice(self, name: str) -> None:
        """As another client would (the kubelet wiping it, an admin): watches see it."""
        with self._cond:
            gone = self.slices.pop(name)
            self._record("delete", name, None, gone)

    def _news(self, position: int) -> bool:
        return len(self.events) > position or self._closing

    def _watch_events(self, query: dict[str, list[str]], wfile: Any) -> None:
        """Stream slice events as the API server does, until ``timeoutSeconds`` pass or
        the server stops (the caller sent the headers)."""
        wanted = _selector(query)
        seconds = float((query.get("timeoutSeconds") or ["30"])[0])
        deadline = time.monotonic() + seconds
        with self._cond:
            self.watches += 1
            position = len(self.events)
            batch = [] if query.get("resourceVersion") else [
                ("ADDED", copy.deepcopy(s)) for s in self.slices.values()]
        while True:
            for kind, obj in batch:
                if all(_field(obj, k) == v for k, v in wanted.items()):
                    line = json.dumps({"type": kind, "object": obj}).encode() + b"\n"
                    wfile.write(b"%x\r\n%s\r\n" % (len(line), line))
                    wfile.flush()
            with self._cond:
                self._cond.wait_for(functools.partial(self._news, position),
                                    max(0.0, deadline - time.monotonic()))
                batch = self.events[position:]
                position = len(self.events)
                if not batch and (self._closing or time.monotonic() >= deadline):
                    break
        wfile.write(b"0\r\n\r\n")
        wfile.flush()

    def _drop(self, body: dict[str, Any]) -> None:
        """What the real server does to a slice it stores: quantities in canonical form
        ("1000" is stored and returned as "1k"), fields of disabled features dropped."""
        for device in (body.get("spec") or {}).get("devices") or []:
            for capacity in (device.get("capacity") or {}).values():
                capacity["value"] = _canonical(capacity["value"])
            for field in self.drop_fields:
                device.pop(field, None)
            if "allowMultipleAllocations" in self.drop_fields:
                for capacity in (device.get("capacity") or {}).values():
                    capacity.pop("requestPolicy", None)

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        server = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"
            # Headers and body are two writes: with Nagle's algorithm the body waits for
            # the client's delayed ACK (40 ms), which no real API server makes a client do.
            disable_nagle_algorithm = True

            def log_message(self, format: str, *args: Any) -> None:
                """Quiet: the tests read ``requests``."""

            def _send(self, code: int, body: dict[str, Any]) -> None:
                data = json.dumps(body).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def _status(self, code: int, message: str) -> None:
                self._send(code, {"apiVersion": "v1", "kind": "Status", "status": "Failure",
                                  "message": message, "reason": HTTPStatus(code).phrase,
                                  "code": code})

            def _body(self) -> dict[str, Any]:
                length = int(self.headers.get("Content-Length") or 0)
                data: dict[str, Any] = json.loads(self.rfile.read(length) or b"{}")
                return data

            def _route(self, method: str) -> None:
                parts = urlsplit(self.path)
                kind = _kind(method, parts.path)
                with server._cond:
                    server.requests.append((method, self.path))
                    gate = server.hold.get(kind)
                if gate is not None:
                    gate.wait(HOLD_LIMIT)
                with server._cond:
                    code = server.fail.get(kind)
                    if code is not None:
                        self._status(code, f"injected failure for {kind}")
                        return
                    answer = server._answer(method, parts.path, parse_qs(parts.query),
                                            self._body() if method in ("POST", "PUT") else None)
                if isinstance(answer, tuple):
                    self._status(*answer)
                else:
                    self._send(201 if method == "POST" else 200, answer)

            def do_GET(self) -> None:
                parts = urlsplit(self.path)
                query = parse_qs(parts.query)
                if parts.path == SLICES and query.get("watch") == ["true"]:
                    with server._cond:
                        server.requests.append(("WATCH", self.path))
                        code = server.fail.get("watch slices")
                    if code is not None:
                        self._status(code, "injected failure for watch slices")
                        return
                    self.send_response(200)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Transfer-Encoding", "chunked")
                    self.end_headers()
                    server._watch_events(query, self.wfile)
                    return
                self._route("GET")

            def do_POST(self) -> None:
                self._route("POST")

            def do_PUT(self) -> None:
                self._route("PUT")

            def do_DELETE(self) -> None:
                self._route("DELETE")

        return Handler

    def _answer(self, method: str, path: str, query: dict[str, list[str]],
                body: dict[str, Any] | None) -> dict[str, Any] | tuple[int, str]:
        """Answer one request; the caller holds the lock."""
        parts = path.strip("/").split("/")
        if path.startswith(f"{RESOURCE}/namespaces/") and len(parts) == 7 \
                and parts[5] == "resourceclaims" and method == "GET":
            claim = self.claims.get((parts[4], parts[6]))
            return claim if claim is not None else (
                404, f'resourceclaims.resource.k8s.io "{parts[6]}" not found')
        if path.startswith("/api/v1/nodes/") and method == "GET":
            node = self.nodes.get(parts[-1])
            return node if node is not None else (404, f'nodes "{parts[-1]}" not found')
        if path == SLICES or path.startswith(SLICES + "/"):
            return self._slices(method, path, query, body)
        return 404, f"the fake API server does not serve {method} {path}"

    def _slices(self, method: str, path: str, query: dict[str, list[str]],
                body: dict[str, Any] | None) -> dict[str, Any] | tuple[int, str]:
        name = path[len(SLICES) + 1:]
        answer: dict[str, Any] | tuple[int, str] = (
            405, f"the fake API server does not serve {method} {path}")
        if not name and method == "GET":
            answer = self._list(query)
        elif not name and method == "POST" and body is not None:
            answer = self._create(body)
        elif name and method == "GET":
            found = self.slices.get(name)
            answer = found if found is not None else (404, f"{name} not found")
        elif name and method == "PUT" and body is not None:
            answer = self._replace(name, body)
        elif name and method == "DELETE":
            gone = self.slices.pop(name, None)
            if gone is None:
                return 404, f"{name} not found"
            self._record("delete", name, None, gone)
            answer = {"apiVersion": "v1", "kind": "Status", "status": "Success"}
        return answer

    def _list(self, query: dict[str, list[str]]) -> dict[str, Any]:
        wanted = _selector(query)
        items = [s for s in self.slices.values()
                 if all(_field(s, key) == value for key, value in wanted.items())]
        return {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceSliceList",
                "metadata": {"resourceVersion": str(self._version)},
                "items": copy.deepcopy(items)}

    def _create(self, body: dict[str, Any]) -> dict[str, Any] | tuple[int, str]:
        name = body["metadata"]["name"]
        if name in self.slices:
            return 409, f'resourceslices.resource.k8s.io "{name}" already exists'
        stored = copy.deepcopy(body)
        self._drop(stored)
        stored["metadata"].update(uid=str(uuid.uuid4()), resourceVersion=self._next_version())
        self.slices[name] = stored
        self._record("create", name, stored)
        return copy.deepcopy(stored)

    def _replace(self, name: str, body: dict[str, Any]) -> dict[str, Any] | tuple[int, str]:
        current = self.slices.get(name)
        if current is None:
            return 404, f'resourceslices.resource.k8s.io "{name}" not found'
        if body["metadata"].get("resourceVersion") != current["metadata"]["resourceVersion"]:
            return 409, "the object has been modified; please apply your changes to the " \
                        "latest version and try again"
        stored = copy.deepcopy(body)
        self._drop(stored)
        stored["metadata"].update(uid=current["metadata"]["uid"],
                                  resourceVersion=self._next_version())
        self.slices[name] = stored
        self._record("update", name, stored)
        return copy.deepcopy(stored)


def _canonical(text: str) -> str:
    """A whole-number decimal quantity as the API server serializes it."""
    if not text.isdigit():
        return text
    number, suffixes = int(text), ["", "k", "M", "G", "T", "P", "E"]
    while number and number % 1000 == 0 and len(suffixes) > 1:
        number //= 1000
        suffixes.pop(0)
    return f"{number}{suffixes[0]}"


def _kind(method: str, path: str) -> str:
    if "/resourceclaims/" in path:
        return "GET claim"
    if path.startswith("/api/v1/nodes/"):
        return "GET node"
    if path == SLICES:
        return "list slices" if method == "GET" else "create slice"
    return f"{method} slice"


def _selector(query: dict[str, list[str]]) -> dict[str, str]:
    """``fieldSelector=a=b,c=d`` as {a: b, c: d}."""
    wanted: dict[str, str] = {}
    for selector in query.get("fieldSelector", []):
        for term in selector.split(","):
            key, _, value = term.partition("=")
            wanted[key] = value
    return wanted


def _field(obj: dict[str, Any], dotted: str) -> str | None:
    value: Any = obj
    for key in dotted.split("."):
        if not isinstance(value, dict):
            return None
        value = value.get(key)
    return value if isinstance(value, str) else None


@contextmanager
def running() -> Iterator[FakeApiServer]:
    server = FakeApiServer().start()
    try:
        yield server
    finally:
        server.stop()


def claim(namespace: str, name: str, uid: str, driver: str, *,
          results: list[dict[str, Any]] | None = None,
          config: list[dict[str, Any]] | None = None,
          allocated: bool = True) -> dict[str, Any]:
    """A ResourceClaim as the scheduler leaves it: one device of ``driver`` by default."""
    if results is None:
        results = [{"request": "fuse", "driver": driver, "pool": "node-1", "device": "fuse"}]
    status: dict[str, Any] = {}
    if allocated:
        status["allocation"] = {"devices": {"results": results, "config": config or []}}
    return {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
            "metadata": {"namespace": namespace, "name": name, "uid": uid},
            "spec": {"devices": {"requests": [{"name": "fuse", "exactly": {
                "deviceClassName": f"fuse.{driver}"}}]}},
            "status": status}


def opaque(driver: str, parameters: object, *, source: str = "FromClaim",
           requests: list[str] | None = None) -> dict[str, Any]:
    config: dict[str, Any] = {"source": source,
                              "opaque": {"driver": driver, "parameters": parameters}}
    if requests is not None:
        config["requests"] = requests
    return config
