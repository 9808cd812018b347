"""The driver's record of the claims it prepared: kept in each claim's own CDI spec.

A prepared claim already has one file of its own (``<kind>_<claim UID>.json``, written
whole with a rename), and the runtime needs exactly that file for as long as the claim is
prepared. So the record is that file: the spec's annotations (CDI 0.6.0; runtimes apply
nothing from them) name the claim and hold the answer the kubelet got. There is no second
file to keep in step, and so no crash between two writes to reconcile: a SIGKILL leaves
either the old spec, the new one, or a hidden temp file that ``scan`` finds and removes.

What the record buys:
- a repeated NodePrepareResources is answered from it, without reading the claim from the
  API server or probing the node again (the kubelet retries after a timeout, and after it
  restarts);
- at start the driver knows every claim it prepared before (the ``claims_prepared``
  gauge) and can ask the API server which of them are gone (``orphans`` in
  ``prepare.Preparer.collect_orphans``);
- a claim prepared before a restart still unprepares after it (by UID, as before).

Specs written by a release without records carry no annotations: they stay prepared and
unpreparable, and a repeated prepare of one reads the claim as before and records it.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# The keys live under the driver's own domain, as Kubernetes annotation keys do.
CLAIM_KEY = "claim"
MODE_KEY = "mode"
DEVICES_KEY = "devices"
# A spec larger than this was not written by us (ours are well under 4 KiB).
READ_LIMIT = 64 * 1024


@dataclass(frozen=True)
class Prepared:
    """One device of a prepared claim, as the kubelet's response needs it."""

    request: str
    pool: str
    device: str
    cdi_ids: tuple[str, ...]
    share_id: str | None


@dataclass(frozen=True)
class Record:
    """What was prepared for one claim, and the answer the kubelet got."""

    uid: str
    namespace: str
    name: str
    mode: str
    devices: tuple[Prepared, ...]

    @property
    def claim(self) -> str:
        return f"{self.namespace}/{self.name}"


def as_annotations(driver: str, record: Record) -> dict[str, str]:
    """The record as the spec's annotations (string values, as CDI requires)."""
    devices = [{"request": d.request, "pool": d.pool, "device": d.device,
                "cdiIDs": list(d.cdi_ids), "shareID": d.share_id} for d in record.devices]
    return {f"{driver}/{CLAIM_KEY}": record.claim, f"{driver}/{MODE_KEY}": record.mode,
            f"{driver}/{DEVICES_KEY}": json.dumps(devices, separators=(",", ":"))}


def _device(item: Mapping[str, Any]) -> Prepared:
    share = item.get("shareID")
    ids = item["cdiIDs"]
    if not isinstance(ids, list) or not all(isinstance(i, str) for i in ids):
        raise ValueError("cdiIDs is not a list of strings")
    return Prepared(request=str(item["request"]), pool=str(item["pool"]),
                    device=str(item["device"]), cdi_ids=tuple(ids),
                    share_id=share if isinstance(share, str) else None)


def read(driver: str, uid: str, path: Path) -> Record | None:
    """The record in the spec at ``path``; None when the file is gone, is not a spec
    with our record (an older release's), or does not parse (never an exception: a
    record that cannot be read is one the driver rebuilds from the API server)."""
    try:
        with path.open("rb") as spec_file:
            text = spec_file.read(READ_LIMIT + 1)
        if len(text) > READ_LIMIT:
            return None
        data = json.loads(text)
        notes = data.get("annotations") or {}
        claim = notes.get(f"{driver}/{CLAIM_KEY}")
        if not isinstance(claim, str) or "/" not in claim:
            return None
        namespace, _, name = claim.partition("/")
        devices = json.loads(notes[f"{driver}/{DEVICES_KEY}"])
        return Record(uid=uid, namespace=namespace, name=name,
                      mode=str(notes[f"{driver}/{MODE_KEY}"]),
                      devices=tuple(_device(item) for item in devices))
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None


@dataclass(frozen=True)
class Scan:
    """What the CDI directory holds of ours: specs by claim UID (with their record, or
    None for a spec without one) and temp files a killed write left behind."""

    specs: dict[str, Record | None]
    leftovers: tuple[Path, ...]


def scan(driver: str, cdi_dir: Path, file_prefix: str) -> Scan:
    """Our specs (``<file_prefix>_<uid>.json``) and our hidden temp files in ``cdi_dir``."""
    specs: dict[str, Record | None] = {}
    leftovers: list[Path] = []
    try:
        entries = sorted(cdi_dir.iterdir())
    except FileNotFoundError:
        return Scan({}, ())
    for path in entries:
        if path.name.startswith(f".{file_prefix}_") and path.name.endswith(".tmp"):
            leftovers.append(path)
        elif path.name.startswith(f"{file_prefix}_") and path.suffix == ".json":
            uid = path.name[len(file_prefix) + 1:-len(".json")]
            specs[uid] = read(driver, uid, path)
    return Scan(specs, tuple(leftovers))
