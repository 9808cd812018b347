"""The node's FUSE device in a ResourceSlice, kept current.

One slice per node (``<node>-<driver>``, one pool named after the node, one slice in
the pool), owned by the Node so that deleting the node deletes it. What it lists:

- ``shared``: one device ``fuse`` that allows multiple allocations (KEP-5075,
  ``DRAConsumableCapacity``, beta and on by default since 1.36), with a capacity
  ``claims`` of ``--slots`` of which each allocation takes 1: any number of claims up
  to that share the node's one ``/dev/fuse``, which is what it is.
- ``counted``: devices ``fuse-0`` ... ``fuse-<N-1>`` (at most 128, a slice's limit),
  one claim each, as the device plugin's slots are; for API servers without that
  feature. ``auto`` (the default) publishes ``shared`` and switches to ``counted`` when
  the API server's answer shows it dropped ``allowMultipleAllocations``.
- nothing while ``/dev/fuse`` is not the FUSE device: no new claim lands on the node;
  claims already prepared keep working.

The publisher compares what it wants with what the API server holds at start, when the
device changes, when a watch on this node's slices of this driver reports any change
(someone deleted or edited the slice: it is put back within a second), and every
``--resync-seconds`` as a backstop for a watch that is down; it writes only a difference,
raising the pool's generation each time. At rest that is one long-lived watch request
(resumed from its last version when the API server closes it) and one list per resync.
It never deletes its slice at shutdown: a restarting driver keeps its pool, and the
kubelet wipes the slices of a driver that stays away.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator, Mapping
from typing import Any, Protocol

from fuse_plugin import logs
from fuse_plugin.devices import DeviceState, Health

MAX_DEVICES = 128
CAPACITY = "claims"
# The API server ends a watch after this long; lightkube resumes it from the last
# version it saw, so at rest this is one request per WATCH_SECONDS.
WATCH_SECONDS = 300


class SliceApi(Protocol):
    """The few API calls publishing needs (``resourceslices`` create, get, list, update,
    delete; ``nodes`` get), as JSON dicts; errors raise ``ApiFailure``."""

    def node_uid(self, node: str) -> str | None: ...
    def list_slices(self, driver: str, node: str) -> list[dict[str, Any]]: ...
    def create(self, body: Mapping[str, Any]) -> dict[str, Any]: ...
    def replace(self, body: Mapping[str, Any]) -> dict[str, Any]: ...
    def delete(self, name: str) -> None: ...
    def watch(self, driver: str, node: str) -> Iterator[str]:
        """Event types (ADDED, MODIFIED, DELETED, ...) of this node's slices of this
        driver, as they happen, until the watch fails (``ApiFailure``)."""
        ...


class ApiFailure(Exception):
    """An API call failed; the message says which and why, in one line."""


_SUFFIXES = ("", "k", "M", "G", "T", "P", "E")


def quantity(count: int) -> str:
    """``count`` as the API server writes a quantity back (canonical decimal SI: 1000 is
    "1k", 1500 stays "1500"), so a slice read back compares equal to the one written."""
    exponent = 0
    while count and count % 1000 == 0 and exponent < len(_SUFFIXES) - 1:
        count //= 1000
        exponent += 1
    return f"{count}{_SUFFIXES[exponent]}"


def shared_devices(slots: int) -> list[dict[str, Any]]:
    return [{"name": "fuse", "allowMultipleAllocations": True,
             "capacity": {CAPACITY: {"value": quantity(slots), "requestPolicy": {
                 "default": "1", "validValues": ["1"]}}}}]


def counted_devices(slots: int) -> list[dict[str, Any]]:
    return [{"name": f"fuse-{index}"} for index in range(min(slots, MAX_DEVICES))]


def slice_name(node: str, driver: str) -> str:
    return f"{node}-{driver}"[:253].rstrip(".-")


def spec(driver: str, node: str, generation: int, devices: list[dict[str, Any]]
         ) -> dict[str, Any]:
    return {"driver": driver, "nodeName": node,
            "pool": {"name": node, "generation": generation, "resourceSliceCount": 1},
            "devices": devices}


def _comparable(spec_: Mapping[str, Any]) -> tuple[Any, ...]:
    """What decides whether the slice must be written: not the generation."""
    devices = spec_.get("devices") or []
    return (spec_.get("driver"), spec_.get("nodeName"),
            (spec_.get("pool") or {}).get("name"),
            (spec_.get("pool") or {}).get("resourceSliceCount"),
            [_normal(d) for d in devices])


def _normal(device: Mapping[str, Any]) -> dict[str, Any]:
    """A device as the API server returns it: quantities as strings, no nulls."""
    out: dict[str, Any] = {}
    for key, value in device.items():
        if value is None or value in ({}, []):
            continue
        out[key] = _normal(value) if isinstance(value, Mapping) else value
    return out


class Publisher:
    def __init__(self, api: SliceApi, *, driver: str, node: str, slots: int, sharing: str,
                 state: DeviceState, log: logging.Logger) -> None:
        self._api = api
        self.driver = driver
        self.node = node
        self.name = slice_name(node, driver)
        self._slots = slots
        self.sharing = "shared" if sharing == "auto" else sharing
        self._fallback = sharing == "auto"
        self._state = state
        self._log = log
        self._owner: list[dict[str, Any]] | None = None
        self.published: dict[str, Any] | None = None  # the slice as last written or read
        self.last_error = ""
        self.writes = 0  # creations and updates made (the slice_writes_total counter)
        self.failures = 0
        self._syncing = threading.Lock()  # the loop and a caller never sync at once

    def devices(self) -> list[dict[str, Any]]:
        if self._state.health is not Health.HEALTHY:
            return []
        if self.sharing == "shared":
            return shared_devices(self._slots)
        return counted_devices(self._slots)

    def sync(self) -> bool:
        """Make the API server hold the slice we want; False (and ``last_error``) when a
        call failed, to be retried at the next sync."""
        try:
            with self._syncing:
                self._sync()
        except ApiFailure as err:
            self.last_error = str(err)
            self.failures += 1
            logs.event(self._log, "slice.sync_failed", logging.WARNING, slice=self.name,
                       error=str(err))
            ok = False
        except Exception as err:  # a bug or an odd answer: the loop must go on, retrying
            self.failures += 1
            self.last_error = f"internal error: {type(err).__name__}: {err}"
            logs.event(self._log, "slice.sync_failed", logging.ERROR, slice=self.name,
                       error=self.last_error)
            ok = False
        else:
            self.last_error = ""
            ok = True
        return ok

    def _owner_references(self) -> list[dict[str, Any]]:
        if self._owner is None:
            uid = self._api.node_uid(self.node)
            self._owner = [] if uid is None else [{
                "apiVersion": "v1", "kind": "Node", "name": self.node, "uid": uid,
                "controller": True}]
        return self._owner

    def _sync(self) -> None:
        existing = self._api.list_slices(self.driver, self.node)
        ours = next((s for s in existing if s["metadata"]["name"] == self.name), None)
        generation = max([(s.get("spec") or {}).get("pool", {}).get("generation", 0)
                          for s in existing] or [0])
        for other in existing:  # an older release's or a renamed driver's slices
            if other is not ours:
                self._api.delete(other["metadata"]["name"])
                logs.event(self._log, "slice.deleted", slice=other["metadata"]["name"],
                           reason="not this driver's current slice")
        wanted = spec(self.driver, self.node, generation, self.devices())
        if ours is not None and _comparable(ours.get("spec") or {}) == _comparable(wanted):
            self.published = ours
            return
        wanted["pool"]["generation"] = generation + 1
        body: dict[str, Any] = {
            "apiVersion": "resource.k8s.io/v1", "kind": "ResourceSlice",
            "metadata": {"name": self.name, "ownerReferences": self._owner_references()},
            "spec": wanted}
        if ours is None:
            written = self._api.create(body)
            verb = "slice.created"
        else:
            body["metadata"]["resourceVersion"] = ours["metadata"].get("resourceVersion")
            written = self._api.replace(body)
            verb = "slice.updated"
        self.published = written
        self.writes += 1
        names = [d["name"] for d in wanted["devices"]]
        shown = names if len(names) <= 4 else f"{names[0]}..{names[-1]} ({len(names)})"
        logs.event(self._log, verb, slice=self.name, generation=wanted["pool"]["generation"],
                   devices=shown, sharing=self.sharing)
        if self._dropped_sharing(written):
            self.sharing = "counted"
            self._fallback = False
            logs.event(self._log, "slice.sharing_fallback", logging.WARNING, slice=self.name,
                       reason="the API server dropped allowMultipleAllocations (feature "
                              "DRAConsumableCapacity off): publishing counted devices")
            self._sync()

    def _dropped_sharing(self, written: Mapping[str, Any]) -> bool:
        if not (self._fallback and self.sharing == "shared"):
            return False
        devices = (written.get("spec") or {}).get("devices") or []
        return bool(devices) and not devices[0].get("allowMultipleAllocations")


class LightkubeSlices:
    """``SliceApi`` through lightkube's generic resources: JSON dicts in and out."""

    def __init__(self, client: Any) -> None:
        self._client = client

    def _call(self, what: str, call: Any) -> Any:
        import httpx2
        from lightkube import ApiError, ConfigError

        try:
            return call()
        except ApiError as err:
            raise ApiFailure(f"{what}: {err.status.code} {err.status.message}") from None
        except (httpx2.HTTPError, OSError, ConfigError) as err:
            raise ApiFailure(f"{what}: {type(err).__name__}: {err}") from None

    def node_uid(self, node: str) -> str | None:
        from fuse_plugin.dra.resources import Node

        try:
            found = self._call(f"get node {node}", lambda: self._client.get(Node, node))
        except ApiFailure as err:
            logs.event(logs.get(), "slice.no_owner", logging.WARNING, error=str(err),
                       reason="the slice is published without the Node as its owner")
            return None
        uid = (found.get("metadata") or {}).get("uid")
        return uid if isinstance(uid, str) else None

    def list_slices(self, driver: str, node: str) -> list[dict[str, Any]]:
        from fuse_plugin.dra.resources import ResourceSlice

        found = self._call("list resourceslices", lambda: list(self._client.list(
            ResourceSlice, fields={"spec.driver": driver, "spec.nodeName": node})))
        return [dict(item) for item in found]

    def create(self, body: Mapping[str, Any]) -> dict[str, Any]:
        from fuse_plugin.dra.resources import ResourceSlice

        created = self._call(f"create resourceslice {body['metadata']['name']}",
                             lambda: self._client.create(ResourceSlice.from_dict(dict(body))))
        return dict(created)

    def replace(self, body: Mapping[str, Any]) -> dict[str, Any]:
        from fuse_plugin.dra.resources import ResourceSlice

        replaced = self._call(f"update resourceslice {body['metadata']['name']}",
                              lambda: self._client.replace(ResourceSlice.from_dict(dict(body))))
        return dict(replaced)

    def delete(self, name: str) -> None:
        from fuse_plugin.dra.resources import ResourceSlice

        self._call(f"delete resourceslice {name}",
                   lambda: self._client.delete(ResourceSlice, name))

    def watch(self, driver: str, node: str) -> Iterator[str]:
        import httpx2
        from lightkube import ApiError, ConfigError

        from fuse_plugin.dra.resources import ResourceSlice

        events = self._client.watch(
            ResourceSlice, fields={"spec.driver": driver, "spec.nodeName": node},
            server_timeout=WATCH_SECONDS)
        try:
            for kind, _ in events:
                yield str(kind)
        except ApiError as err:
            raise ApiFailure(f"watch resourceslices: {err.status.code} "
                             f"{err.status.message}") from None
        except (httpx2.HTTPError, OSError, ConfigError) as err:
            raise ApiFailure(f"watch resourceslices: {type(err).__name__}: {err}") from None
