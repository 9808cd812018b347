"""The device plugin: ``fuse-device-plugin serve``.

Follow it from the command down: ``serve`` (flags, logging, signals) builds the running
plugin in ``plugin`` (device state, the servicer, the lifecycle, the optional CDI spec
and metrics port); ``lifecycle`` serves our socket and registers with the kubelet, again
after every kubelet restart; ``servicer`` answers the kubelet's RPCs, an ``Allocate``
from socket to response in one file; ``metrics`` serves /metrics, /healthz and /readyz.
What a container is given lives in ``fuse_plugin.allocation``, the device's health in
``fuse_plugin.devices``: the DRA driver shares both.
"""
