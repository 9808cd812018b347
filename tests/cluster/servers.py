"""The servers the FUSE examples talk to, as pods inside the cluster (image built from
servers.Dockerfile): Debian's sshd with test-made keys, and moto's S3 server. Example pods
reach them by pod IP over the cluster's bridge; the test reaches moto the same way."""

from __future__ import annotations

import json
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tests.cluster.cluster import Api, Kubectl
from tests.cluster.kube import APPLY, wait_ready

NAMESPACE = "fdp-e2e-servers"
MOTO_PORT = 5000
S3_KEY = "AKIAFDPCLUSTERE2E"
S3_SECRET = "fdp-cluster-e2e-secret-not-a-real-one"
S3_REGION = "us-east-1"

SSHD_CONFIG = """\
Port 22
HostKey /cfg/hostkey
AuthorizedKeysFile /cfg/authorized_keys
PermitRootLogin prohibit-password
PasswordAuthentication no
KbdInteractiveAuthentication no
UsePAM no
# The Secret volume's files are symlinks into a directory the kubelet owns.
StrictModes no
Subsystem sftp internal-sftp
PidFile /run/sshd.pid
"""


def keygen(path: Path) -> str:
    """A new ed25519 key pair at path (and path.pub); returns the public key line."""
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", path.name,
                    "-f", str(path)], check=True, capture_output=True)
    return (path.parent / f"{path.name}.pub").read_text().strip()


def _pod(name: str, image: str, command: list[str], port: int, *,
         volumes: list[dict[str, Any]] | None = None,
         mounts: list[dict[str, Any]] | None = None,
         capabilities: tuple[str, ...] = ()) -> dict[str, Any]:
    return {
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": name, "namespace": NAMESPACE, "labels": {"app": name}},
        "spec": {
            "automountServiceAccountToken": False,
            "enableServiceLinks": False,
            "terminationGracePeriodSeconds": 1,
            "containers": [{
                "name": name, "image": image, "imagePullPolicy": "IfNotPresent",
                "command": command,
                "readinessProbe": {"tcpSocket": {"port": port}, "periodSeconds": 1},
                "volumeMounts": mounts or [],
                "securityContext": {"capabilities": {"add": list(capabilities)}},
            }],
            "volumes": volumes or [],
        },
    }


@dataclass
class Servers:
    sshd_ip: str
    moto_ip: str
    client_key: str  # private key text for the sshfs example's Secret
    host_key_pub: str  # "ssh-ed25519 AAAA..." for its known_hosts

    @property
    def moto_url(self) -> str:
        return f"http://{self.moto_ip}:{MOTO_PORT}"

    def s3(self) -> Any:
        import boto3  # type: ignore[import-untyped]

        return boto3.client("s3", endpoint_url=self.moto_url, region_name=S3_REGION,
                            aws_access_key_id=S3_KEY, aws_secret_access_key=S3_SECRET)


def start(kubectl: Kubectl, api: Api, image: str, keys: Path) -> Servers:
    keys.mkdir(parents=True, exist_ok=True)
    host_pub = keygen(keys / "hostkey")
    client_pub = keygen(keys / "client")
    objs: list[dict[str, Any]] = [
        {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NAMESPACE}},
        {"apiVersion": "v1", "kind": "Secret",
         "metadata": {"name": "sshd", "namespace": NAMESPACE},
         "stringData": {"sshd_config": SSHD_CONFIG,
                        "hostkey": (keys / "hostkey").read_text(),
                        "authorized_keys": client_pub + "\n"}},
        _pod("sshd", image,
             ["/bin/sh", "-c",
              "mkdir -p /srv/data && exec /usr/sbin/sshd -D -e -f /cfg/sshd_config"],
             22,
             volumes=[{"name": "cfg", "secret": {"secretName": "sshd", "defaultMode": 0o400}}],
             mounts=[{"name": "cfg", "mountPath": "/cfg", "readOnly": True}],
             # sshd's privilege separation chroots each session: containerd's default set
             # has SYS_CHROOT, CRI-O's has not (without it sshd resets every connection).
             capabilities=("SYS_CHROOT",)),
        _pod("moto", image, ["moto_server", "-H", "0.0.0.0", "-p", str(MOTO_PORT)], MOTO_PORT),
    ]
    kubectl(*APPLY, "-f", "-", stdin=json.dumps({"apiVersion": "v1", "kind": "List",
                                                 "items": objs}))
    sshd = wait_ready(api, NAMESPACE, "sshd")
    moto = wait_ready(api, NAMESPACE, "moto")
    return Servers(sshd_ip=sshd["status"]["podIP"], moto_ip=moto["status"]["podIP"],
                   client_key=(keys / "client").read_text(),
                   host_key_pub=" ".join(host_pub.split()[:2]))
