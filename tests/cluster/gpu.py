"""The GPU point, on the cluster: stand-in GPU nodes on the host (/dev/nvidia0..3 and
/dev/nvidiactl, char 195:N as the NVIDIA driver makes them), and three pods side by side:
a privileged one lists every GPU (what `privileged: true` hands a FUSE pod), a plain one,
and one that asks `github.com/fuse: 1` in the mode deployed. The FUSE pod's /dev is the
plain pod's plus `fuse`, and of its character devices it opens exactly the plain pod's
plus /dev/fuse: no GPU, in any mode. Each cluster module (default, broker, DRA) runs it
against its own deployment."""

from __future__ import annotations

import json
import os
import stat
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from tests.cluster.cluster import Api, Kubectl
from tests.cluster.kube import APPLY, RESOURCE, delete_pod, evidence, exec_in, wait_ready

NAMESPACE = "fdp-e2e-gpu"
GPUS = {**{f"nvidia{i}": (195, i) for i in range(4)}, "nvidiactl": (195, 255)}
# Lists /dev, then every character device this container can open for reading and writing.
PROBE = ("ls /dev | tr '\\n' ' '; echo; for d in /dev/*; do [ -c \"$d\" ] && "
         "( exec 3<>\"$d\" ) 2>/dev/null && printf '%s ' \"$d\"; done; echo")


@contextmanager
def stand_in_gpus() -> Iterator[list[Path]]:
    """The GPU nodes on the host's /dev (those already there are left as they are)."""
    made = []
    try:
        for name, (major, minor) in GPUS.items():
            path = Path("/dev") / name
            if not path.exists():
                os.mknod(path, 0o666 | stat.S_IFCHR, os.makedev(major, minor))
                made.append(path)
        yield [Path("/dev") / name for name in GPUS]
    finally:
        for path in made:
            path.unlink(missing_ok=True)


def _pod(name: str, image: str, *, fuse: bool = False, privileged: bool = False
         ) -> dict[str, Any]:
    container: dict[str, Any] = {
        "name": "c", "image": image, "imagePullPolicy": "IfNotPresent",
        "command": ["/bin/sh", "-c", "exec sleep 3600"]}
    if fuse:
        container["resources"] = {"limits": {RESOURCE: "1"}}
    if privileged:
        container["securityContext"] = {"privileged": True}
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "namespace": NAMESPACE},
            "spec": {"automountServiceAccountToken": False, "enableServiceLinks": False,
                     "terminationGracePeriodSeconds": 1, "containers": [container]}}


def _seen(kubectl: Kubectl, pod: str) -> tuple[set[str], set[str]]:
    """(names in /dev, character devices it opens read-write)."""
    listed, opened = [*exec_in(kubectl, NAMESPACE, pod, PROBE).splitlines(), "", ""][:2]
    return set(listed.split()), set(opened.split())


def prove_isolation(kubectl: Kubectl, api: Api, image: str, mode: str) -> None:
    """Privileged, plain and FUSE pods on a node with stand-in GPUs; asserts the FUSE pod
    gets /dev/fuse and nothing else, with the evidence in the stage's log."""
    pods = {"privileged": _pod("gpu-privileged", image, privileged=True),
            "plain": _pod("gpu-plain", image),
            "fuse": _pod("gpu-fuse", image, fuse=True)}
    with stand_in_gpus():
        kubectl(*APPLY, "-f", "-", stdin=json.dumps({"apiVersion": "v1", "kind": "List",
                                                     "items": [
            {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NAMESPACE}},
            *pods.values()]}))
        try:
            for pod in pods.values():
                wait_ready(api, NAMESPACE, pod["metadata"]["name"])
            seen = {role: _seen(kubectl, pod["metadata"]["name"])
                    for role, pod in pods.items()}
        finally:
            for pod in pods.values():
                delete_pod(kubectl, api, NAMESPACE, pod["metadata"]["name"])
    gpus = set(GPUS)
    proof = evidence(f"gpu-{mode}", *(f"{role}: /dev {sorted(listed)}; opens {sorted(opened)}"
                                      for role, (listed, opened) in seen.items()))
    assert gpus <= seen["privileged"][0], proof
    assert not gpus & seen["fuse"][0], proof
    assert seen["fuse"][0] == seen["plain"][0] | {"fuse"}, proof
    assert seen["fuse"][1] == seen["plain"][1] | {"/dev/fuse"}, proof
