"""The one place that assembles the running DRA driver from its settings.

``command`` (the CLI) and the tests build it here: the device's state (the same prober
as the device plugin's health), the preparer (which reads the claims prepared before
from their CDI specs), the gRPC sockets, the ResourceSlice publisher and a watch of the
slice in the API server, the probe and metrics port, and an inotify watch on the device's
directory (put back by the loop when that directory is made anew). The loop removes the
specs of claims the API server no longer has once at start, and re-checks the device and
the slice when either watch fires and every ``--resync-seconds``; everything started is
undone in reverse order on the way out, whether the loop ended on SIGTERM or something
failed half-way.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from http import HTTPStatus
from pathlib import Path

from watchdog.events import FileSystemEvent, FileSystemEventHandler
from watchdog.observers import Observer

from fuse_plugin import http_port, logs, readiness
from fuse_plugin.devices import DeviceState, Health, Prober, probe
from fuse_plugin.dra.claims import ClaimSource
from fuse_plugin.dra.metrics import DraStats, State, exposition
from fuse_plugin.dra.prepare import Preparer
from fuse_plugin.dra.service import (
    DraServicer,
    InFlight,
    Registered,
    RegistrationServicer,
    Sockets,
    clear_other_instances,
)
from fuse_plugin.dra.settings import DraSettings
from fuse_plugin.dra.slices import ApiFailure, Publisher, SliceApi
from fuse_plugin.errors import Failure
from fuse_plugin.exposition import CONTENT_TYPE
from fuse_plugin.watches import DirectoryWatches, event_paths

JOIN_TIMEOUT = 15.0
# The loop's heartbeat for /healthz: it wakes at least this often.
HEARTBEAT = 5.0
# A failed slice watch is started again after this, doubling up to the most.
WATCH_RETRY = (1.0, 60.0)


class _DeviceEvents(FileSystemEventHandler):
    """Wakes the loop when the device node is removed, replaced or made, or its
    directory is deleted (the loop then puts the watch on the one made anew)."""

    def __init__(self, device: Path, wake: threading.Event) -> None:
        self._paths = {str(device), str(device.parent)}
        self._wake = wake

    def on_any_event(self, event: FileSystemEvent) -> None:
        if self._paths & event_paths(event):
            self._wake.set()


@dataclass
class Driver:
    settings: DraSettings
    state: DeviceState
    preparer: Preparer
    sockets: Sockets
    registered: Registered
    publisher: Publisher | None
    log: logging.Logger
    stats: DraStats
    probe_port: int | None = None
    watches: DirectoryWatches | None = None

    def __post_init__(self) -> None:
        self._wake = threading.Event()
        self._stopping = threading.Event()
        self._slice_changed = threading.Event()
        self._beat = time.monotonic()

    def wake(self) -> None:
        self._wake.set()

    def slice_changed(self) -> None:
        """The slice watch saw a change: check the slice at the loop's next turn."""
        self._slice_changed.set()
        self._wake.set()

    def watch_slices(self, api: SliceApi) -> None:
        """Wake the loop on every event of this node's slices; start the watch again
        after a failure, backing off. Runs on its own thread until ``stop()``."""
        retry = WATCH_RETRY[0]
        while not self._stopping.is_set():
            try:
                for _ in api.watch(self.settings.driver_name, self.settings.node_name):
                    self.slice_changed()
                    retry = WATCH_RETRY[0]
                    if self._stopping.is_set():
                        return
            except ApiFailure as err:
                logs.event(self.log, "slice.watch_failed", logging.WARNING, error=str(err),
                           retry_seconds=retry)
            except Exception as err:  # an odd answer or a closed client: retry, never die
                if self._stopping.is_set():
                    return
                logs.event(self.log, "slice.watch_failed", logging.ERROR,
                           error=f"{type(err).__name__}: {err}", retry_seconds=retry)
            else:
                logs.event(self.log, "slice.watch_ended", logging.DEBUG)
            self._stopping.wait(retry)
            retry = min(retry * 2, WATCH_RETRY[1])

    def stop(self) -> None:
        self._stopping.set()
        self._wake.set()

    def run(self) -> int:
        """Re-check the device and the slice until ``stop()``; exit code 0."""
        resync = self.settings.resync_seconds
        synced = self.publisher is not None and self.publisher.published is not None \
            and not self.publisher.last_error
        next_sync = time.monotonic() + resync if synced else 0.0
        self.preparer.collect_orphans()
        while not self._stopping.is_set():
            now = time.monotonic()
            self._beat = now
            if self.watches is not None:
                self.watches.rearm([self.settings.fuse_device.parent])
            changed = self.state.refresh()
            if changed is not None:
                level = logging.INFO if changed.health is Health.HEALTHY else logging.WARNING
                logs.event(self.log, "device.health", level, health=changed.health.value,
                           reason=changed.reason)
            watched = self._slice_changed.is_set()
            self._slice_changed.clear()
            if self.publisher is not None and (changed is not None or watched
                                               or now >= next_sync):
                self.publisher.sync()
                next_sync = now + (resync if not self.publisher.last_error
                                   else min(resync, HEARTBEAT))
            self._wake.wait(HEARTBEAT if self.publisher is None
                            else max(0.0, min(HEARTBEAT, next_sync - time.monotonic())))
            self._wake.clear()
        logs.event(self.log, "stopping")
        return 0

    def alive(self) -> tuple[bool, str]:
        if time.monotonic() - self._beat > 6 * HEARTBEAT:
            return False, "loop stuck"
        for path in (self.sockets.service, self.sockets.registration):
            if not path.exists():
                return False, f"{path} is gone"
        return True, "ok"

    def ready(self) -> tuple[bool, str]:
        return readiness.first_failing(
            self.alive(), readiness.registered(self.registered.registered, self.registered.error),
            readiness.device(self.state), self._published())

    def _published(self) -> tuple[bool, str]:
        if self.publisher is not None and (self.publisher.published is None
                                           or self.publisher.last_error):
            return False, f"ResourceSlice not published {self.publisher.last_error}".rstrip()
        return readiness.READY


    def metrics(self) -> bytes:
        publisher = self.publisher
        return exposition(self.stats, State(
            registered=self.registered.registered,
            device_healthy=self.state.health is Health.HEALTHY,
            claims_prepared=self.preparer.prepared,
            slice_writes=publisher.writes if publisher is not None else 0,
            slice_failures=publisher.failures if publisher is not None else 0))


def _routes(driver: Driver) -> dict[str, http_port.Route]:
    return {"/healthz": http_port.probe(driver.alive),
            "/readyz": http_port.probe(driver.ready),
            "/metrics": lambda: (HTTPStatus.OK, driver.metrics(), CONTENT_TYPE)}


@contextmanager
def assembled(settings: DraSettings, log: logging.Logger, claims: ClaimSource,
              slices: SliceApi | None, prober: Prober = probe) -> Iterator[Driver]:
    """Build and start the driver's parts; raise ``Failure`` (one line) when one cannot."""
    with ExitStack() as stack:
        state = DeviceState(settings.fuse_device, 1, prober)
        try:
            preparer = Preparer(settings.driver_name, claims, cdi_dir=settings.cdi_dir,
                                fuse_device=settings.fuse_device,
                                broker_dir=settings.broker_dir, log=log, prober=prober)
        except ValueError as err:
            raise Failure(f"--driver-name: {err}") from None
        registered = Registered()
        stats = DraStats()
        sockets = Sockets(settings.service_socket, settings.registration_socket,
                          DraServicer(preparer, stats, InFlight(log), log),
                          RegistrationServicer(settings.driver_name, settings.service_socket,
                                               registered, log), log)
        publisher = None
        if settings.publish and slices is not None:
            publisher = Publisher(slices, driver=settings.driver_name,
                                  node=settings.node_name, slots=settings.slots,
                                  sharing=settings.sharing, state=state, log=log)
        driver = Driver(settings, state, preparer, sockets, registered, publisher, log,
                        stats)
        observer = Observer()
        driver.watches = DirectoryWatches(
            observer, _DeviceEvents(settings.fuse_device, driver._wake), log)
        driver.watches.rearm([settings.fuse_device.parent])
        observer.daemon = True
        observer.start()
        stack.callback(observer.join, JOIN_TIMEOUT)
        stack.callback(observer.stop)
        # Publish before serving: a kubelet that registers us finds the pool in place.
        if publisher is not None and slices is not None:
            publisher.sync()
            threading.Thread(target=driver.watch_slices, args=(slices,), name="slice-watch",
                             daemon=True).start()
            stack.callback(driver.stop)
        clear_other_instances(
            [(settings.registry_dir, f"{settings.driver_name}-reg.sock"),
             (settings.registry_dir, f"{settings.driver_name}-*-reg.sock"),
             (settings.service_socket.parent, "dra*.sock")],
            {settings.service_socket, settings.registration_socket}, log)
        sockets.start()
        stack.callback(sockets.stop)
        if settings.probe_port:
            driver.probe_port = stack.enter_context(http_port.serving(
                _routes(driver), settings.probe_address, settings.probe_port, name="probes",
                log=log)).port
        yield driver


@contextmanager
def in_background(settings: DraSettings, log: logging.Logger, claims: ClaimSource,
                  slices: SliceApi | None, prober: Prober = probe) -> Iterator[Driver]:
    """The assembled driver with its loop on a thread: for the tests."""
    with assembled(settings, log, claims, slices, prober) as driver:
        thread = threading.Thread(target=driver.run, name="dra", daemon=True)
        thread.start()
        try:
            yield driver
        finally:
            driver.stop()
            thread.join(JOIN_TIMEOUT)
