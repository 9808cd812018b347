"""The real servers the FUSE workloads talk to, on 127.0.0.1 only: moto's S3 server and a
private sshd. Each records its PID and is stopped by it (never by name)."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

LOOPBACK = "127.0.0.1"
START_TIMEOUT = 30.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind((LOOPBACK, 0))
        port: int = s.getsockname()[1]
        return port


def stop_process(proc: subprocess.Popen[bytes] | None, sig: int = signal.SIGTERM,
                 grace: float = 10.0) -> None:
    """``sig`` (SIGTERM), then SIGKILL after ``grace`` seconds: a process we started, by
    its recorded Popen."""
    if proc is None or proc.poll() is not None:
        return
    proc.send_signal(sig)
    try:
        proc.wait(grace)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(10)


def _answers(port: int, greeting: bytes = b"") -> bool:
    try:
        with socket.create_connection((LOOPBACK, port), timeout=1) as s:
            if greeting:
                s.settimeout(2)
                return s.recv(64).startswith(greeting)
            return True
    except OSError:
        return False


class Moto:
    """``moto_server`` on a free loopback port, and a boto3 client for it."""

    ACCESS_KEY = "AKIAFUSEE2E0000TEST"
    SECRET_KEY = "fuse-e2e-secret-key-not-a-real-one"
    REGION = "us-east-1"

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.port = 0
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://{LOOPBACK}:{self.port}"

    @staticmethod
    def executable() -> str | None:
        beside = Path(sys.executable).parent / "moto_server"
        return str(beside) if beside.exists() else shutil.which("moto_server")

    def start(self) -> Moto:
        exe = self.executable()
        if exe is None:
            raise FileNotFoundError("moto_server not found: pip install 'moto[server]' "
                                    "(the dev extras of pyproject.toml)")
        self.workdir.mkdir(parents=True, exist_ok=True)
        log = (self.workdir / "moto.log").open("wb")
        for _attempt in range(3):  # the free port can be taken between probe and bind
            self.port = free_port()
            self.proc = subprocess.Popen([exe, "-H", LOOPBACK, "-p", str(self.port)],
                                         stdout=log, stderr=subprocess.STDOUT)
            deadline = time.monotonic() + START_TIMEOUT
            while self.proc.poll() is None and time.monotonic() < deadline:
                if _answers(self.port):
                    log.close()
                    return self
                time.sleep(0.05)
            stop_process(self.proc)
        log.close()
        raise RuntimeError(f"moto_server did not start: {(self.workdir / 'moto.log').read_text()}")

    def client(self) -> Any:
        import boto3  # type: ignore[import-untyped]

        return boto3.client("s3", endpoint_url=self.url, region_name=self.REGION,
                            aws_access_key_id=self.ACCESS_KEY,
                            aws_secret_access_key=self.SECRET_KEY)

    def passwd_file(self, path: Path, owner: int | None = None) -> Path:
        """s3fs's credentials file (ACCESS:SECRET, mode 0600)."""
        path.write_text(f"{self.ACCESS_KEY}:{self.SECRET_KEY}\n")
        path.chmod(0o600)
        if owner is not None:
            os.chown(path, owner, owner)
        return path

    def stop(self) -> None:
        stop_process(self.proc)


def sshd_config(port: int, host_key: Path, authorized_keys: Path, pid_file: str,
                sftp: str = "internal-sftp", *extra: str) -> str:
    """An sshd_config for the sshfs tests: on the loopback only, the test's keys only, root
    by key and nothing else, no PAM; ``extra`` lines at the end."""
    return "\n".join([
        f"Port {port}",
        f"ListenAddress {LOOPBACK}",
        f"HostKey {host_key}",
        f"AuthorizedKeysFile {authorized_keys}",
        f"PidFile {pid_file}",
        "PermitRootLogin prohibit-password",
        "PasswordAuthentication no",
        "KbdInteractiveAuthentication no",
        "UsePAM no",
        "StrictModes no",  # the keys live in the tests' own directories (often under /tmp)
        f"Subsystem sftp {sftp}",
        *extra,
        "",
    ])


class Sshd:
    """A private sshd on a free loopback port: its own host key, config and one
    authorized user key (root, key only), serving ``export`` over SFTP."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.port = 0
        self.proc: subprocess.Popen[bytes] | None = None
        self.export = workdir / "export"
        self.host_key = workdir / "ssh_host_ed25519_key"
        self.user_key = workdir / "id_ed25519"
        self.known_hosts = workdir / "known_hosts"

    def _keygen(self, path: Path, comment: str) -> None:
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", comment,
                        "-f", str(path)], check=True, capture_output=True)

    def start(self) -> Sshd:
        sshd = shutil.which("sshd") or "/usr/sbin/sshd"
        if not Path(sshd).exists():
            raise FileNotFoundError("sshd not found: apt-get install openssh-server")
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.export.mkdir(exist_ok=True)
        self._keygen(self.host_key, "fuse-e2e host")
        self._keygen(self.user_key, "fuse-e2e user")
        authorized = self.workdir / "authorized_keys"
        authorized.write_text((self.workdir / "id_ed25519.pub").read_text())
        # sshd refuses to start without its privilege-separation directory.
        Path("/run/sshd").mkdir(mode=0o755, exist_ok=True)
        sftp = next((p for p in ("/usr/lib/openssh/sftp-server",
                                 "/usr/libexec/openssh/sftp-server") if Path(p).exists()),
                    "internal-sftp")
        log = (self.workdir / "sshd.log").open("wb")
        for _attempt in range(3):
            self.port = free_port()
            config = self.workdir / "sshd_config"
            config.write_text(sshd_config(self.port, self.host_key, authorized,
                                          str(self.workdir / "sshd.pid"), sftp))
            self.proc = subprocess.Popen([sshd, "-D", "-e", "-f", str(config)],
                                         stdout=log, stderr=subprocess.STDOUT)
            deadline = time.monotonic() + START_TIMEOUT
            while self.proc.poll() is None and time.monotonic() < deadline:
                if _answers(self.port, b"SSH-2.0"):
                    log.close()
                    host_pub = (self.workdir / "ssh_host_ed25519_key.pub").read_text().split()
                    self.known_hosts.write_text(
                        f"[{LOOPBACK}]:{self.port} {host_pub[0]} {host_pub[1]}\n")
                    return self
                time.sleep(0.05)
            stop_process(self.proc)
        log.close()
        raise RuntimeError(f"sshd did not start: {(self.workdir / 'sshd.log').read_text()}")

    def client_files(self, directory: Path, owner: int | None = None) -> Path:
        """The user key and known_hosts for a container, copied into ``directory``."""
        directory.mkdir(parents=True, exist_ok=True)
        for src in (self.user_key, self.known_hosts):
            dst = directory / src.name
            shutil.copyfile(src, dst)
            dst.chmod(0o600)
            if owner is not None:
                os.chown(dst, owner, owner)
        return directory

    def stop(self) -> None:
        stop_process(self.proc)
        with contextlib.suppress(FileNotFoundError):
            (self.workdir / "sshd.pid").unlink()
