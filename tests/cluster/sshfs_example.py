"""manifests/examples/sshfs-pod.yaml as a user fills it in (the key, the server's host key
line, REMOTE, the tool image), and variants of it (another name, a patched pod spec)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import yaml

from tests.cluster.cluster import Api, Kubectl
from tests.cluster.kube import APPLY, EXAMPLES_NS, delete_pod, example_doc, example_overlay
from tests.cluster.servers import Servers

SSHFS_FILE = "sshfs-pod.yaml"
SSHFS_POD = "sshfs-example"


def apply_sshfs_example(kubectl: Kubectl, servers: Servers, images: dict[str, str],
                        tmp_path: Path, *, name: str = SSHFS_POD,
                        spec: dict[str, Any] | None = None, apparmor: bool = False,
                        container: dict[str, Any] | None = None) -> None:
    """manifests/examples/sshfs-pod.yaml with its placeholders filled in (the key, the
    server's host key line, REMOTE) and the tool image named, applied; ``name`` and
    ``spec`` (a strategic-merge patch of the pod's spec) make a variant of it;
    ``apparmor`` keeps its `appArmorProfile` (an AppArmor node), and ``container`` is a
    strategic-merge patch of its container."""
    pod = example_doc(SSHFS_FILE, "Pod")
    secret_name = example_doc(SSHFS_FILE, "Secret")["metadata"]["name"]
    name_of_container = pod["spec"]["containers"][0]["name"]
    patches: list[dict[str, Any]] = [
        {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": secret_name},
         "stringData": {"id_ed25519": servers.client_key,
                        "known_hosts": f"{servers.sshd_ip} {servers.host_key_pub}\n"}},
        {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": SSHFS_POD},
         "spec": {**(spec or {}), "containers": [{"name": name_of_container, "env": [
             {"name": "REMOTE", "value": f"root@{servers.sshd_ip}:/srv/data"}],
             **(container or {})}]}},
    ]
    ov = example_overlay(tmp_path, SSHFS_FILE, "fuse-example-sshfs",
                         images["EXAMPLE_SSHFS_IMAGE"], patches, apparmor=apparmor)
    if name != SSHFS_POD:
        kustomization = ov / "kustomization.yaml"
        k = yaml.safe_load(kustomization.read_text())
        k["patches"].append({"target": {"kind": "Pod", "name": SSHFS_POD}, "patch": json.dumps(
            [{"op": "replace", "path": "/metadata/name", "value": name}])})
        kustomization.write_text(json.dumps(k, indent=1))
    kubectl(*APPLY, "-k", str(ov))


def delete_sshfs_example(kubectl: Kubectl, api: Api, name: str = SSHFS_POD) -> None:
    delete_pod(kubectl, api, EXAMPLES_NS, name)
    if not [p for p in api.pods(EXAMPLES_NS) if p["metadata"]["name"] != name
            and p["metadata"]["name"].startswith("sshfs")]:
        kubectl("-n", EXAMPLES_NS, "delete", "secret",
                example_doc(SSHFS_FILE, "Secret")["metadata"]["name"], "--ignore-not-found")
