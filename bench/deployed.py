"""What a DaemonSet manifest deploys, read the way the benchmarks run each component:
with the flags, CPU request and grace period its manifest gives it."""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

import yaml


def daemonset(path: Path) -> dict[str, Any]:
    for doc in yaml.safe_load_all(path.read_text()):
        if doc and doc.get("kind") == "DaemonSet":
            found: dict[str, Any] = doc
            return found
    raise ValueError(f"{path} holds no DaemonSet")


def container(path: Path) -> dict[str, Any]:
    """The DaemonSet's first container: the component itself."""
    first: dict[str, Any] = daemonset(path)["spec"]["template"]["spec"]["containers"][0]
    return first


def flags(path: Path, command: str) -> list[str]:
    """The component's flags after its subcommand, as the manifest passes them."""
    args: list[str] = container(path)["args"]
    if args[:1] != [command]:
        raise ValueError(f"{path}: the container's args do not start with {command}")
    return args[1:]


def env_flags(path: Path, prefix: str) -> list[str]:
    """The flags the container's environment twins (``<prefix><FLAG>``) set, as
    ``--flag=value``: a value as written; the pod UID (downward API) as a fresh UUID,
    which is what each pod gets."""
    found = []
    for entry in container(path).get("env", []):
        name: str = entry["name"]
        if not name.startswith(prefix):
            continue
        flag = "--" + name[len(prefix):].lower().replace("_", "-")
        if "value" in entry:
            found.append(f"{flag}={entry['value']}")
        elif entry.get("valueFrom") == {"fieldRef": {"fieldPath": "metadata.uid"}}:
            found.append(f"{flag}={uuid.uuid4()}")
        else:
            raise ValueError(f"{path}: {name} comes from {entry.get('valueFrom')}, "
                             "which the benchmarks cannot stand in for")
    return found
