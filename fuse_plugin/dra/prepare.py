"""Claims to CDI specs: what NodePrepareResources and NodeUnprepareResources do.

Each claim gets one CDI spec file of its own (``<kind>_<claim UID>.json`` under the CDI
directory) holding one device named after the claim's UID: ``/dev/fuse`` with mode 0666
(a container running as any uid can open it; the node's own mode does not matter), and in
broker mode the broker's socket directory and its fusermount shim as read-only binds
(the same binds the device plugin's Allocate adds in broker mode). The kubelet hands the
fully qualified name (``fuse-device-plugin.github.com/fuse=<uid>``) to the runtime.

Both calls are idempotent, as the kubelet retries them: preparing writes the same file
again (atomically), unpreparing a claim whose spec is gone is done. Errors are per
claim, as text for the pod's events, never an exception out of here.
"""

from __future__ import annotations

import logging
import re
import threading
from dataclasses import dataclass
from pathlib import Path

from fuse_plugin import cdi, devices, logs
from fuse_plugin.allocation import broker_binds
from fuse_plugin.devices import Health, Prober
from fuse_plugin.dra.claims import Allocation, ClaimError, ClaimSource, allocation

CDI_CLASS = "fuse"
# rw for everyone: the pod's own securityContext decides who runs in it, and FUSE's
# own checks (allow_other, the mount's owner) still apply.
FILE_MODE = 0o666
# What the API server allows for a namespace and a claim's name: they become the path of
# the GET, so nothing else is sent.
_NAMESPACE = re.compile(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?")
_NAME = re.compile(r"[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?")


@dataclass(frozen=True)
class Prepared:
    """One device of a prepared claim, as the kubelet's response needs it."""

    request: str
    pool: str
    device: str
    cdi_ids: tuple[str, ...]
    share_id: str | None


class Preparer:
    def __init__(self, driver: str, source: ClaimSource, *, cdi_dir: Path,
                 fuse_device: Path, broker_dir: Path, log: logging.Logger,
                 prober: Prober = devices.probe) -> None:
        self.driver = driver
        self.kind = f"{driver}/{CDI_CLASS}"
        cdi.check_kind(self.kind)
        self._source = source
        self._cdi_dir = cdi_dir
        self._device = fuse_device
        self._broker_dir = broker_dir
        self._log = log
        self._prober = prober
        from fuse_plugin.broker import protocol

        self._shim = broker_dir / protocol.SHIM_NAME
        self._broker_mounts = broker_binds(broker_dir)
        # One claim's file is written by one call at a time (the kubelet may retry while
        # a slow call still runs); different claims proceed in parallel.
        self._locks: dict[str, threading.Lock] = {}
        self._locks_guard = threading.Lock()

    def spec_path(self, uid: str) -> Path:
        return self._cdi_dir / f"{cdi.spec_file_name(self.kind)[:-5]}_{uid}.json"

    def cdi_id(self, uid: str) -> str:
        return f"{self.kind}={uid}"

    def _lock(self, uid: str) -> threading.Lock:
        with self._locks_guard:
            return self._locks.setdefault(uid, threading.Lock())

    def prepare(self, namespace: str, name: str, uid: str) -> list[Prepared]:
        """The claim's devices with their CDI IDs; ClaimError says why it cannot be."""
        try:
            cdi.check_device_name(uid)
        except ValueError as err:
            raise ClaimError(f"claim {namespace}/{name}: UID {err}") from None
        if not _NAMESPACE.fullmatch(namespace) or not _NAME.fullmatch(name):
            raise ClaimError(f"claim {namespace[:70]!r}/{name[:260]!r}: not a namespace and "
                             "a ResourceClaim name the API server would accept")
        try:
            found = allocation(self._source.get(namespace, name), self.driver, uid)
        except (AttributeError, TypeError, KeyError, ValueError) as err:
            # The API server validates claims; this is a claim it did not write.
            raise ClaimError(f"claim {namespace}/{name}: malformed allocation "
                             f"({type(err).__name__}: {err})") from None
        self._check_node(found, f"{namespace}/{name}")
        mounts = self._broker_mounts if found.mode == "broker" else []
        with self._lock(uid):
            try:
                path = cdi.write_spec(self._cdi_dir, self._device, self.kind, name=uid,
                                      file_mode=FILE_MODE, mounts=mounts,
                                      file_name=self.spec_path(uid).name)
            except OSError as err:
                raise ClaimError(f"claim {namespace}/{name}: cannot write its CDI spec in "
                                 f"{self._cdi_dir}: {err.strerror or err}") from None
        logs.event(self._log, "claim.prepared", claim=f"{namespace}/{name}", uid=uid,
                   mode=found.mode, spec=str(path),
                   devices=[d.device for d in found.devices])
        # Every device of the claim is the same node. The kubelet gives a container the
        # CDI IDs of the devices of each request it names, so each request's first device
        # carries the ID (every container gets /dev/fuse) and a request's further devices
        # none (a container is not handed the same CDI device twice for one request).
        named: set[str] = set()
        prepared = []
        for d in found.devices:
            first = d.request not in named
            named.add(d.request)
            prepared.append(Prepared(d.request, d.pool, d.device,
                                     (self.cdi_id(uid),) if first else (), d.share_id))
        return prepared

    def _check_node(self, found: Allocation, claim: str) -> None:
        """Refuse now what would fail the container later: no FUSE device on the node,
        or broker mode on a node whose broker has not installed its shim (a bind of a
        missing file makes the runtime create a directory there)."""
        prober = devices.with_shim(self._prober, self._shim) if found.mode == "broker" \
            else self._prober
        result = prober(self._device)
        if result.health is not Health.HEALTHY:
            hint = " (deploy manifests/broker on this node)" \
                if result.reason.startswith("broker mode") else ""
            raise ClaimError(f"claim {claim}: {result.reason}{hint}")

    def unprepare(self, uid: str) -> None:
        """Remove the claim's spec; already gone is done. ClaimError on failure."""
        try:
            cdi.check_device_name(uid)
        except ValueError as err:
            raise ClaimError(f"UID {err}") from None
        path = self.spec_path(uid)
        with self._lock(uid):
            existed = path.exists()
            try:
                cdi.remove_spec(path)
            except OSError as err:
                raise ClaimError(f"cannot remove {path}: {err.strerror or err}") from None
        with self._locks_guard:
            self._locks.pop(uid, None)
        logs.event(self._log, "claim.unprepared", uid=uid, spec=str(path),
                   removed=existed)
