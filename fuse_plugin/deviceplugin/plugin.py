"""The one place that assembles the running plugin from its ``Settings``.

``serve``, ``demo`` and the tests all build the plugin here, so "the plugin as serve runs
it" means one thing: device state, stats, the servicer, the lifecycle, and the optional
CDI spec and metrics endpoint. Everything started is undone in reverse order on the way
out (``ExitStack``), whether the loop ended on SIGTERM or something failed half-way.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass

from fuse_plugin import logs
from fuse_plugin.allocation import Grant
from fuse_plugin.config import Settings
from fuse_plugin.deviceplugin.lifecycle import Lifecycle
from fuse_plugin.deviceplugin.servicer import FuseServicer
from fuse_plugin.devices import DeviceState, Prober, probe, with_shim
from fuse_plugin.errors import EXIT_USAGE, Failure
from fuse_plugin.stats import Stats

JOIN_TIMEOUT = 15.0


@dataclass(frozen=True)
class Plugin:
    lifecycle: Lifecycle
    stats: Stats
    metrics_port: int | None


@contextmanager
def assembled(settings: Settings, log: logging.Logger, prober: Prober = probe
              ) -> Iterator[Plugin]:
    """Build the plugin; raise ``Failure`` (one line) when a part cannot start."""
    with ExitStack() as stack:
        stats = Stats()
        device_files = [settings.fuse_device]
        if settings.broker_dir is not None:
            from fuse_plugin.broker import protocol

            device_files.append(settings.broker_dir / protocol.SHIM_NAME)
            prober = with_shim(prober, device_files[-1])
        state = DeviceState(settings.fuse_device, settings.slots, prober)
        cdi_device = None
        if settings.cdi:
            from fuse_plugin import cdi

            try:
                cdi_device = cdi.cdi_device_name(settings.resource_name)
            except ValueError as err:
                raise Failure(f"--cdi: {err}", EXIT_USAGE) from None
            try:
                spec = cdi.write_spec(settings.cdi_dir, settings.fuse_device,
                                      settings.resource_name)
            except OSError as err:
                raise Failure(f"cannot write the CDI spec in {settings.cdi_dir}: "
                              f"{err.strerror or err}") from None
            logs.event(log, "cdi.spec_written", path=str(spec), device=cdi_device)
            stack.callback(logs.event, log, "cdi.spec_removed", path=str(spec))
            stack.callback(cdi.remove_spec, spec)
        grant = Grant(settings.fuse_device, cdi_device, settings.broker_dir)
        servicer = FuseServicer(state, log, stats, grant)
        lifecycle = Lifecycle(settings, state, servicer, log, stats,
                              device_files=device_files)
        port = None
        if settings.metrics_port:
            from fuse_plugin.deviceplugin import metrics

            port = stack.enter_context(metrics.serving(
                lifecycle, stats, settings.metrics_address, settings.metrics_port, log)).port
        yield Plugin(lifecycle, stats, port)


@contextmanager
def in_background(settings: Settings, log: logging.Logger, prober: Prober = probe
                  ) -> Iterator[Plugin]:
    """The assembled plugin with its loop on a thread: for ``demo`` and the tests."""
    with assembled(settings, log, prober) as plugin:
        thread = threading.Thread(target=plugin.lifecycle.run, name="plugin", daemon=True)
        thread.start()
        try:
            yield plugin
        finally:
            plugin.lifecycle.stop()
            thread.join(JOIN_TIMEOUT)
