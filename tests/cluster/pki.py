"""Certificates and kubeconfigs for the one-machine cluster, made with the openssl CLI
(Debian's openssl): one CA, a serving certificate for the API server and the kubelet, a
client certificate per identity, and the service-account signing key.

Identities are what the 1.20 authorizers expect: ``system:masters`` for the admin and for
the API server calling the kubelet; ``system:node:<name>`` in ``system:nodes`` for the
kubelet (the Node authorizer and NodeRestriction key on that);
``system:kube-controller-manager`` and ``system:kube-scheduler`` for the controllers, which
RBAC's bootstrap roles cover. P-256 keys: each takes milliseconds to make.
"""

from __future__ import annotations

import json
import subprocess
from dataclasses import dataclass
from pathlib import Path

DAYS = "3"
EC = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]


def _openssl(*args: str, stdin: bytes | None = None) -> bytes:
    r = subprocess.run(["openssl", *args], input=stdin, capture_output=True, check=False)
    if r.returncode != 0:
        raise RuntimeError(f"openssl {args[0]} failed: {r.stderr.decode().strip()}")
    return r.stdout


@dataclass(frozen=True)
class Cert:
    crt: Path
    key: Path


class Pki:
    """Everything lives in ``root``; made anew by ``create`` at each bring-up."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.ca = Cert(root / "ca.crt", root / "ca.key")
        self.sa_key = root / "sa.key"
        self.sa_pub = root / "sa.pub"

    def create(self) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        self.root.chmod(0o700)
        _openssl(
            "req", "-x509", *EC, "-keyout", str(self.ca.key), "-out", str(self.ca.crt),
            "-days", DAYS, "-subj", "/CN=fdp-cluster-ca",
            "-addext", "basicConstraints=critical,CA:TRUE",
            "-addext", "keyUsage=critical,keyCertSign,cRLSign",
        )
        _openssl("ecparam", "-name", "prime256v1", "-genkey", "-noout", "-out", str(self.sa_key))
        _openssl("ec", "-in", str(self.sa_key), "-pubout", "-out", str(self.sa_pub))

    def issue(
        self,
        name: str,
        cn: str,
        orgs: tuple[str, ...] = (),
        sans: tuple[str, ...] = (),
        server: bool = False,
    ) -> Cert:
        """A leaf certificate signed by the CA: client auth, plus server auth with SANs."""
        cert = Cert(self.root / f"{name}.crt", self.root / f"{name}.key")
        subj = "".join(f"/O={o}" for o in orgs) + f"/CN={cn}"
        csr = _openssl("req", "-new", *EC, "-keyout", str(cert.key), "-subj", subj)
        ext = self.root / f"{name}.ext"
        lines = [
            "basicConstraints=CA:FALSE",
            "keyUsage=critical,digitalSignature,keyEncipherment",
            "extendedKeyUsage=" + ("serverAuth,clientAuth" if server else "clientAuth"),
        ]
        if sans:
            lines.append("subjectAltName=" + ",".join(sans))
        ext.write_text("\n".join(lines) + "\n")
        _openssl(
            "x509", "-req", "-CA", str(self.ca.crt), "-CAkey", str(self.ca.key),
            "-set_serial", str(int.from_bytes(_openssl("rand", "8"), "big")),
            "-days", DAYS, "-extfile", str(ext), "-out", str(cert.crt), stdin=csr,
        )
        return cert

    def kubeconfig(self, name: str, server: str, cert: Cert) -> Path:
        """A kubeconfig naming files (JSON is YAML): the CA, and the identity's key pair."""
        path = self.root / f"{name}.kubeconfig"
        path.write_text(json.dumps({
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [{"name": "fdp", "cluster": {
                "server": server, "certificate-authority": str(self.ca.crt)}}],
            "users": [{"name": name, "user": {
                "client-certificate": str(cert.crt), "client-key": str(cert.key)}}],
            "contexts": [{"name": "fdp", "context": {"cluster": "fdp", "user": name}}],
            "current-context": "fdp",
        }, indent=1))
        return path
