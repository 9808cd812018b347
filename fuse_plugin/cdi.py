"""A CDI (Container Device Interface) spec for the FUSE device, for runtimes that prefer it.

With CDI, Allocate also answers ``cdi_devices: ["github.com/fuse=fuse"]`` and the
container runtime (containerd 1.7+, CRI-O) edits the container from the spec file
written here instead of from the DeviceSpec. The kind is the resource name itself
(vendor ``github.com``, class ``fuse``), so one name means the same thing to the kubelet
and to the runtime.

The runtime watches the spec directory and reads every ``*.json`` in it, so the file is
written to a temp name without that suffix, synced, and renamed into place: a runtime
never reads half a spec, and a crash leaves no spec that names the wrong device.

The DRA driver (``fuse_plugin.dra``) writes its per-claim specs with the same functions:
a device named after the claim, the node with a ``fileMode`` (so a non-root container can
open it whatever the host node's mode), and in broker mode the broker's read-only binds.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from fuse_plugin import files
from fuse_plugin.config import DEFAULT_RESOURCE_NAME
from fuse_plugin.devices import FUSE_MAJOR, FUSE_MINOR

DEVICE_NAME = "fuse"
CONTAINER_PATH = "/dev/fuse"
# The oldest spec version that has deviceNodes[].hostPath. Declaring the oldest version
# that says what we need keeps older runtimes working: containerd 1.7.0 vendors a CDI
# library that rejects any version newer than 0.5.0.
CDI_VERSION = "0.5.0"
# A dot in the class ("vendor.com/fuse.v2") and a spec's annotations are 0.6.0 features.
CDI_VERSION_DOTTED_CLASS = "0.6.0"
CDI_VERSION_ANNOTATIONS = "0.6.0"

# CDI is stricter than Kubernetes: vendor and class start with a letter.
_VENDOR_OR_CLASS = re.compile(r"^[A-Za-z]([A-Za-z0-9_.-]*[A-Za-z0-9])?$")
# A device name (CDI 0.5.0+ allows a leading digit, as a claim's UID may have).
_DEVICE = re.compile(r"^[A-Za-z0-9]([A-Za-z0-9_.:-]*[A-Za-z0-9])?$")
# Read-only binds: nosuid and nodev also keep them valid inside a user namespace, where a
# bind may not drop those flags from its source.
BIND_OPTIONS = ("ro", "nosuid", "nodev", "rbind", "rprivate")


def check_kind(resource: str) -> None:
    """Raise ValueError when ``resource`` cannot double as a CDI kind (``vendor/class``)."""
    vendor, sep, cls = resource.partition("/")
    if not sep or not _VENDOR_OR_CLASS.match(vendor) or not _VENDOR_OR_CLASS.match(cls):
        raise ValueError(
            f"resource {resource!r} is not a CDI kind: vendor and class must start with a "
            "letter, end with a letter or digit, and hold only letters, digits, '_', '-', '.'")


def spec_version(resource: str) -> str:
    _, _, cls = resource.partition("/")
    return CDI_VERSION_DOTTED_CLASS if "." in cls else CDI_VERSION


def cdi_device_name(resource: str = DEFAULT_RESOURCE_NAME) -> str:
    """The fully qualified name Allocate returns in ``cdi_devices``: ``github.com/fuse=fuse``."""
    check_kind(resource)
    return f"{resource}={DEVICE_NAME}"


def spec_file_name(resource: str) -> str:
    return resource.replace("/", "-") + ".json"


def check_device_name(name: str) -> None:
    """Raise ValueError when ``name`` cannot be a CDI device name (or a file name part)."""
    if not _DEVICE.match(name) or len(name) > 253:
        raise ValueError(f"{name[:100]!r} is not a CDI device name: letters, digits, '_', "
                         "'.', ':', '-', starting and ending with a letter or digit")


def build_spec(device: Path, resource: str, *, name: str = DEVICE_NAME,
               file_mode: int | None = None,
               mounts: Sequence[tuple[str, str]] = (),
               annotations: Mapping[str, str] | None = None) -> dict[str, Any]:
    """The spec: one device whose edits are the FUSE node, read-write, no mknod, and
    ``mounts`` ((container path, host path) pairs) as read-only binds.

    ``annotations`` are the spec's own (CDI 0.6.0+): runtimes carry them and apply
    nothing from them, so the DRA driver keeps its record of a prepared claim there, in
    the one file that already says the claim is prepared.

    ``file_mode`` sets the mode of the node the runtime creates in the container (runc
    makes a new node unless the container has a user namespace of its own, where it
    binds the host's node and its mode); None leaves the runtime's choice.
    """
    check_kind(resource)
    check_device_name(name)
    node: dict[str, Any] = {"path": CONTAINER_PATH, "hostPath": str(device), "type": "c",
                            "major": FUSE_MAJOR, "minor": FUSE_MINOR, "permissions": "rw"}
    if file_mode is not None:
        node["fileMode"] = file_mode
    edits: dict[str, Any] = {"deviceNodes": [node]}
    if mounts:
        edits["mounts"] = [{"hostPath": host, "containerPath": inside,
                            "options": list(BIND_OPTIONS), "type": "bind"}
                           for inside, host in mounts]
    spec: dict[str, Any] = {"cdiVersion": spec_version(resource), "kind": resource}
    if annotations:
        spec["cdiVersion"] = max(spec["cdiVersion"], CDI_VERSION_ANNOTATIONS,
                                 key=lambda v: tuple(map(int, v.split("."))))
        spec["annotations"] = dict(annotations)
    spec["devices"] = [{"name": name, "containerEdits": edits}]
    return spec


def write_spec(directory: Path, device: Path, resource: str, *, name: str = DEVICE_NAME,
               file_mode: int | None = None, mounts: Sequence[tuple[str, str]] = (),
               file_name: str | None = None,
               annotations: Mapping[str, str] | None = None) -> Path:
    """Write the spec atomically into ``directory`` (created if missing); return its path.

    ``file_name`` defaults to one derived from the kind (the device plugin's one spec).
    Raises ValueError for a resource that is not a CDI kind and OSError when the
    directory cannot be written; no temp file is left behind either way. The temp
    name ends in ``.tmp``, not ``.json``, so a runtime scanning the directory skips it.
    """
    spec = build_spec(device, resource, name=name, file_mode=file_mode, mounts=mounts,
                      annotations=annotations)
    text = json.dumps(spec, indent=2) + "\n"
    directory.mkdir(parents=True, exist_ok=True)
    target = directory / (file_name or spec_file_name(resource))
    files.write_atomic(target, text.encode(), mode=0o644)
    return target


def remove_spec(path: Path) -> None:
    """Remove the spec at shutdown; already gone is fine (a restart may race us)."""
    path.unlink(missing_ok=True)
    files.fsync_dir(path.parent)
