"""Claims to CDI specs: what NodePrepareResources and NodeUnprepareResources do.

Each claim gets one CDI spec file of its own (``<kind>_<claim UID>.json`` under the CDI
directory) holding one device named after the claim's UID: ``/dev/fuse`` with mode 0666
(a container running as any uid can open it; the node's own mode does not matter), and in
broker mode the broker's socket directory and its fusermount shim as read-only binds
(the same binds the device plugin's Allocate adds in broker mode). The kubelet hands the
fully qualified name (``fuse-device-plugin.github.com/fuse=<uid>``) to the runtime. The
spec also records the claim and the answer (``checkpoint``).

**The mode.** A claim's own opaque config wins, then its class's; a claim that names no
mode (the claim the scheduler makes for ``github.com/fuse: 1``) is prepared in the node's
mode: broker when the node's broker has installed its shim, direct when it has not. The
device plugin works the same way (``serve --broker-dir`` on broker nodes), and broker
mode takes nothing from a pod that mounts by itself: the binds only add the shim, and
libfuse calls ``mount(2)`` first, falling back to fusermount3 only when that is refused.

Both calls are idempotent, as the kubelet retries them: preparing a recorded claim
answers from the record, unpreparing a claim whose spec is gone is done. Errors are per
claim, as text for the pod's events, never an exception out of here.
"""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path

from fuse_plugin import cdi, devices, files, logs, names
from fuse_plugin.allocation import broker_binds
from fuse_plugin.devices import Health, Prober
from fuse_plugin.dra import checkpoint
from fuse_plugin.dra.checkpoint import Prepared, Record
from fuse_plugin.dra.claims import Allocation, ClaimError, ClaimGone, ClaimSource, allocation

CDI_CLASS = "fuse"
# rw for everyone: the pod's own securityContext decides who runs in it, and FUSE's
# own checks (allow_other, the mount's owner) still apply.
FILE_MODE = 0o666



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
        self._prefix = cdi.spec_file_name(self.kind)[:-len(".json")]
        # One claim's file is written by one call at a time (the kubelet may retry while
        # a slow call still runs); different claims proceed in parallel.
        self._locks: dict[str, threading.Lock] = {}
        self._guard = threading.Lock()
        # Every claim with a spec on disk: its record, or None for a spec an older
        # release wrote without one. Read from the directory once, at start.
        found = checkpoint.scan(driver, cdi_dir, self._prefix)
        for leftover in found.leftovers:
            files.discard(leftover)
            logs.event(log, "claim.leftover_removed", file=str(leftover))
        self._records: dict[str, Record | None] = dict(found.specs)
        if found.specs:
            logs.event(log, "claims.found", prepared=len(found.specs),
                       without_record=sum(r is None for r in found.specs.values()))

    def spec_path(self, uid: str) -> Path:
        return self._cdi_dir / f"{self._prefix}_{uid}.json"

    def cdi_id(self, uid: str) -> str:
        return f"{self.kind}={uid}"

    @property
    def prepared(self) -> int:
        """How many claims have a spec on this node now (the ``claims_prepared`` gauge)."""
        with self._guard:
            return len(self._records)

    def recorded(self) -> dict[str, Record | None]:
        with self._guard:
            return dict(self._records)

    def _lock(self, uid: str) -> threading.Lock:
        with self._guard:
            return self._locks.setdefault(uid, threading.Lock())

    def node_mode(self) -> str:
        """The mode of a claim that chose none: broker where the broker has installed
        its shim (it does so at start and leaves it through restarts), else direct."""
        return "broker" if self._shim.is_file() else "direct"

    def prepare(self, namespace: str, name: str, uid: str) -> tuple[list[Prepared], bool]:
        """The claim's devices with their CDI IDs, and whether they came from the record
        (no API call); ClaimError says why the claim cannot be prepared."""
        try:
            cdi.check_device_name(uid)
        except ValueError as err:
            raise ClaimError(f"claim {namespace}/{name}: UID {err}") from None
        # They become the path of the GET: only names the API server could have made.
        if not names.dns_label(namespace) or not names.dns_subdomain(name):
            raise ClaimError(f"claim {namespace[:70]!r}/{name[:260]!r}: not a namespace and "
                             "a ResourceClaim name the API server would accept")
        with self._lock(uid):
            with self._guard:
                record = self._records.get(uid)
            if record is not None and (record.namespace, record.name) == (namespace, name) \
                    and self.spec_path(uid).is_file():
                return list(record.devices), True
            return self._prepare_anew(namespace, name, uid), False

    def _prepare_anew(self, namespace: str, name: str, uid: str) -> list[Prepared]:
        began = time.monotonic()
        try:
            found = allocation(self._source.get(namespace, name), self.driver, uid)
        except (AttributeError, TypeError, KeyError, ValueError) as err:
            # The API server validates claims; this is a claim it did not write.
            raise ClaimError(f"claim {namespace}/{name}: malformed allocation "
                             f"({type(err).__name__}: {err})") from None
        read = time.monotonic() - began
        mode = found.mode or self.node_mode()
        self._check_node(mode, f"{namespace}/{name}")
        record = Record(uid=uid, namespace=namespace, name=name, mode=mode,
                        devices=tuple(self._answer(found, uid)))
        mounts = self._broker_mounts if mode == "broker" else []
        try:
            path = cdi.write_spec(self._cdi_dir, self._device, self.kind, name=uid,
                                  file_mode=FILE_MODE, mounts=mounts,
                                  file_name=self.spec_path(uid).name,
                                  annotations=checkpoint.as_annotations(self.driver, record))
        except OSError as err:
            raise ClaimError(f"claim {namespace}/{name}: cannot write its CDI spec in "
                             f"{self._cdi_dir}: {err.strerror or err}") from None
        with self._guard:
            self._records[uid] = record
        logs.event(self._log, "claim.prepared", claim=f"{namespace}/{name}", uid=uid,
                   mode=mode, chosen_by="claim" if found.mode else "node", spec=str(path),
                   devices=[d.device for d in found.devices], read_seconds=round(read, 3),
                   seconds=round(time.monotonic() - began, 3))
        return list(record.devices)

    def _answer(self, found: Allocation, uid: str) -> list[Prepared]:
        """Every device of the claim is the same node. The kubelet gives a container the
        CDI IDs of the devices of each request it names, so each request's first device
        carries the ID (every container gets /dev/fuse) and a request's further devices
        none (a container is not handed the same CDI device twice for one request)."""
        named: set[str] = set()
        prepared = []
        for d in found.devices:
            first = d.request not in named
            named.add(d.request)
            prepared.append(Prepared(d.request, d.pool, d.device,
                                     (self.cdi_id(uid),) if first else (), d.share_id))
        return prepared

    def _check_node(self, mode: str, claim: str) -> None:
        """Refuse now what would fail the container later: no FUSE device on the node,
        or broker mode on a node whose broker has not installed its shim (a bind of a
        missing file makes the runtime create a directory there)."""
        prober = devices.with_shim(self._prober, self._shim) if mode == "broker" \
            else self._prober
        result = prober(self._device)
        if result.health is not Health.HEALTHY:
            hint = " (deploy manifests/broker on this node)" \
                if result.reason.startswith("broker mode") else ""
            raise ClaimError(f"claim {claim}: {result.reason}{hint}")

    def unprepare(self, uid: str) -> bool:
        """Remove the claim's spec (and with it the record); already gone is done.
        True when there was one. ClaimError on failure."""
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
            with self._guard:
                self._records.pop(uid, None)
        with self._guard:
            self._locks.pop(uid, None)
        logs.event(self._log, "claim.unprepared", uid=uid, spec=str(path),
                   removed=existed)
        return existed

    def collect_orphans(self) -> int:
        """Remove the specs of recorded claims the API server no longer has (or has
        under a new UID): a claim is deleted only once no pod uses it, so such a spec is
        one whose unprepare never reached this driver (it was away, or killed first).
        Claims that cannot be read now are kept; so are specs without a record, whose
        claim is unknown. Returns how many were removed."""
        removed = 0
        for uid, record in self.recorded().items():
            if record is None:
                continue
            try:
                claim = self._source.get(record.namespace, record.name)
            except ClaimGone:
                gone = "the claim is deleted"
            except ClaimError as err:
                logs.event(self._log, "claim.orphan_check_failed", logging.WARNING,
                           claim=record.claim, uid=uid, error=str(err))
                continue
            else:
                current = (claim.get("metadata") or {}).get("uid")
                if current == uid:
                    continue
                gone = f"the claim now has UID {current}"
            with self._lock(uid):
                self.spec_path(uid).unlink(missing_ok=True)
                with self._guard:
                    self._records.pop(uid, None)
            files.fsync_dir(self._cdi_dir)
            removed += 1
            logs.event(self._log, "claim.orphan_removed", claim=record.claim, uid=uid,
                       reason=gone)
        return removed
