"""Checks that say (ok, why), for ``http_port.probe``, and the two the plugin and the
DRA driver share: both register with the kubelet and hand out the one device, so a
pod that is not ready says why in the same words whichever wing it runs."""

from __future__ import annotations

from fuse_plugin.devices import DeviceState, Health

Check = tuple[bool, str]
READY: Check = (True, "ready")


def first_failing(*checks: Check) -> Check:
    """The first check that fails, in the order given, else ``READY``."""
    return next((check for check in checks if not check[0]), READY)


def registered(done: bool, error: str) -> Check:
    """Registered with the kubelet; if not, its last error (if any) says why."""
    if done:
        return READY
    return False, f"not registered with the kubelet {error}".rstrip()


def device(state: DeviceState) -> Check:
    if state.health is Health.HEALTHY:
        return READY
    return False, f"device unhealthy: {state.reason}"
