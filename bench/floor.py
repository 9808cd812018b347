"""The floor: the least a grpcio device plugin can be, to measure the plugin against.

A sync grpcio server on a unix socket that answers every DevicePlugin RPC with constant
bytes the benchmark serialised beforehand (so not even protobuf is imported here), and
registers with the kubelet once at start. With ``--watch`` it also does the least that
re-registration and health need: a 1 ms polling loop on ``kubelet.sock`` and the device
node (a CPU cost the real plugin, which uses inotify, does not pay), re-creating its
socket and re-registering when the kubelet restarts, and pushing the prebuilt list to
every open ListAndWatch stream when the node's health flips.

Run by ``bench.run`` as ``python bench/floor.py SOCKET CONSTS_DIR [--watch DEVICE]``.
CONSTS_DIR holds options.bin, allocate.bin, healthy.bin, unhealthy.bin, register.bin.
"""

from __future__ import annotations

import os
import signal
import stat
import sys
import threading
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path

import grpc

WORKERS = 24
POLL = 0.001
FUSE = os.makedev(10, 229)


def _identity(path: str) -> tuple[int, int] | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_ino, st.st_ctime_ns


class Floor:
    def __init__(self, sock: str, consts: Path, device: str) -> None:
        self.sock = sock
        self.device = device
        self.kubelet = os.path.join(os.path.dirname(sock), "kubelet.sock")
        self.blobs = {name: (consts / f"{name}.bin").read_bytes()
                      for name in ("options", "allocate", "healthy", "unhealthy", "register")}
        self.cond = threading.Condition()
        self.version = 0
        self.healthy = True
        self.stop = threading.Event()
        self.executor = futures.ThreadPoolExecutor(max_workers=WORKERS)
        self.handlers: dict[str, grpc.RpcMethodHandler[bytes, bytes]] = {
            "GetDevicePluginOptions": grpc.unary_unary_rpc_method_handler(self.options),
            "Allocate": grpc.unary_unary_rpc_method_handler(self.allocate),
            "GetPreferredAllocation": grpc.unary_unary_rpc_method_handler(self.empty),
            "PreStartContainer": grpc.unary_unary_rpc_method_handler(self.empty),
            "ListAndWatch": grpc.unary_stream_rpc_method_handler(self.list_and_watch),
        }

    # -- the RPCs: constants --------------------------------------------------------------

    def options(self, _request: bytes, _context: grpc.ServicerContext) -> bytes:
        return self.blobs["options"]

    def allocate(self, _request: bytes, _context: grpc.ServicerContext) -> bytes:
        return self.blobs["allocate"]

    def empty(self, _request: bytes, _context: grpc.ServicerContext) -> bytes:
        return b""

    def _wake(self) -> None:
        with self.cond:
            self.cond.notify_all()

    def list_and_watch(self, _request: bytes, context: grpc.ServicerContext) -> Iterator[bytes]:
        context.add_callback(self._wake)
        with self.cond:
            seen, healthy = self.version, self.healthy
        yield self.blobs["healthy" if healthy else "unhealthy"]
        while True:
            with self.cond:
                while self.version == seen and context.is_active():
                    self.cond.wait()
                if not context.is_active():
                    return
                seen, healthy = self.version, self.healthy
            yield self.blobs["healthy" if healthy else "unhealthy"]

    # -- serving and registering ----------------------------------------------------------

    def serve(self) -> grpc.Server:
        if os.path.exists(self.sock):
            os.unlink(self.sock)
        server = grpc.server(self.executor, options=[("grpc.so_reuseport", 0)])
        server.add_generic_rpc_handlers(
            (grpc.method_handlers_generic_handler("v1beta1.DevicePlugin", self.handlers),))
        server.add_insecure_port(f"unix://{self.sock}")
        server.start()
        return server

    def register(self) -> None:
        try:
            with grpc.insecure_channel(f"unix://{self.kubelet}") as channel:
                register: grpc.UnaryUnaryMultiCallable[bytes, bytes] = channel.unary_unary(
                    "/v1beta1.Registration/Register")
                register(self.blobs["register"], timeout=5)
        except grpc.RpcError as err:
            print(f"floor: register failed: {err}", file=sys.stderr)

    def device_healthy(self) -> bool:
        try:
            st = os.stat(self.device)
        except OSError:
            return False
        return stat.S_ISCHR(st.st_mode) and st.st_rdev == FUSE

    def run(self) -> int:
        signal.signal(signal.SIGTERM, lambda *_: self.stop.set())
        server = self.serve()
        seen = _identity(self.kubelet)
        if seen is not None:
            self.register()
        while self.device and not self.stop.wait(POLL):
            now = _identity(self.kubelet)
            if now is not None and now != seen:
                seen = now
                if not os.path.exists(self.sock):
                    server.stop(grace=None)
                    server = self.serve()
                self.register()
            healthy = self.device_healthy()
            if healthy != self.healthy:
                with self.cond:
                    self.healthy = healthy
                    self.version += 1
                    self.cond.notify_all()
        self.stop.wait()
        server.stop(grace=None)
        return 0


def main(argv: list[str]) -> int:
    device = argv[3] if len(argv) > 3 and argv[2] == "--watch" else ""
    return Floor(argv[0], Path(argv[1]), device).run()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
