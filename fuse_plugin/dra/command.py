"""``fuse-device-plugin dra``: the DRA driver on this node (manifests/dra runs it).

Follow a run: the flags become ``DraSettings``, a Kubernetes client (lightkube; its
configuration from the pod's service account, or ``KUBECONFIG`` outside a cluster) serves
the claim reads and the ResourceSlice, ``driver.assembled`` builds the rest, and the
loop runs until SIGTERM.
"""

from __future__ import annotations

import argparse
from typing import Any

from fuse_plugin import logs
from fuse_plugin.dra import settings as dra_settings
from fuse_plugin.errors import Failure


def add_flags(parser: argparse.ArgumentParser) -> None:
    dra_settings.add_flags(parser)


def client(field_manager: str) -> Any:
    """A lightkube client from the environment; ``Failure`` when there is none."""
    from lightkube import Client, ConfigError

    try:
        return Client(field_manager=field_manager)
    except KeyError as err:  # a service account token without the service's address
        raise Failure(f"no Kubernetes API address: ${err.args[0]} is not set") from None
    except ConfigError as err:
        raise Failure(f"no Kubernetes API configuration (in-cluster service account or "
                      f"KUBECONFIG): {err}") from None


def run(parsed: argparse.Namespace) -> int:
    from fuse_plugin.dra import driver
    from fuse_plugin.dra.claims import ApiClaims
    from fuse_plugin.dra.slices import LightkubeSlices
    from fuse_plugin.signals import stop_on_signals

    settings = dra_settings.from_args(parsed)
    log = logs.setup(settings.log_format, settings.log_level, driver=settings.driver_name)
    api = client(settings.driver_name)
    with driver.assembled(settings, log, ApiClaims(api), LightkubeSlices(api)) as running:
        stop_on_signals(log, running.stop)
        return running.run()
