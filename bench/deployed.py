"""What a DaemonSet manifest deploys, read the way the benchmarks run each component:
with the flags, CPU request and grace period its manifest gives it."""

from __future__ import annotations

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
