"""The kubelet stage's fixtures: the node (containerd, the real kubelet, the plugin),
set up once per module, and an sshd for the sshfs pods."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.kubelet import node as nodemod
from tests.kubelet.static_pods import (
    EVIDENCE,
    HERE,
    SETUP_TIMEOUT,
    SLOTS,
    _skip_reason,
    command_output,
    evidence,
    wait_registered,
)
from tests.lib.servers import sshd_config


@pytest.fixture(scope="module")
def kube_node(udev_fuse: None) -> Iterator[Any]:
    reason = _skip_reason()
    if reason:
        print(f"SKIPPED real-kubelet stage: {reason}", file=sys.stderr)
        pytest.skip(reason)
    nodemod.LOGDIR.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    setup_log = nodemod.LOGDIR / "setup.log"
    with open(setup_log, "w") as out:
        r = subprocess.run(
            [str(HERE / "setup.sh"), "all"],
            stdout=out,
            stderr=subprocess.STDOUT,
            timeout=SETUP_TIMEOUT,
            check=False,
        )
    assert r.returncode == 0, f"setup.sh failed ({r.returncode}):\n{nodemod.tail(setup_log, 60)}"
    setup_s = time.monotonic() - t0
    node = nodemod.Node()
    assert node.kubelet_bin.is_file(), f"no kubelet binary at {node.kubelet_bin}"
    assert node.plugin_bin.exists(), (
        f"no fuse-device-plugin at {node.plugin_bin}: pip install -e '.[dev]' into the venv first"
    )
    EVIDENCE.write_text("")
    version = subprocess.run(
        [str(node.kubelet_bin), "--version"], capture_output=True, text=True, check=False
    ).stdout.strip()
    evidence(
        "setup",
        [
            f"setup.sh took {setup_s:.0f}s; kubelet {node.kubelet_bin}: {version}",
            "containerd: " + command_output(str(node.bins / "containerd"), "--version"),
            "runc: " + command_output(str(node.bins / "runc"), "--version"),
        ],
    )
    try:
        t1 = time.monotonic()
        # Start the plugin first: a pod admitted while no plugin is registered fails for good.
        node.up(slots=SLOTS)
        wait_registered(node, 0, "node start")
        evidence("setup", f"containerd + kubelet + plugin up in {time.monotonic() - t1:.1f}s")
        yield node
    finally:
        node.down()
        node.unlock()


@pytest.fixture(scope="module")
def sshd(kube_node: Any) -> Iterator[dict[str, Any]]:
    """An sshd on 127.0.0.1 (private port, test-made keys): the sshfs server. hostNetwork
    pods reach it on the loopback."""
    d = nodemod.STATE / "sshd"
    shutil.rmtree(d, ignore_errors=True)
    (d / "keys").mkdir(parents=True)
    os.chmod(d, 0o700)
    export = d / "export"
    export.mkdir()
    for key in ["hostkey", "keys/client"]:
        subprocess.run(
            ["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(d / key)], check=True
        )
    shutil.copy(d / "keys/client.pub", d / "authorized_keys")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    (d / "sshd_config").write_text(sshd_config(port, d / "hostkey", d / "authorized_keys",
                                               "none", "internal-sftp", "LogLevel VERBOSE"))
    Path("/run/sshd").mkdir(exist_ok=True)  # sshd's privilege-separation dir
    kube_node.spawn("sshd", ["/usr/sbin/sshd", "-D", "-e", "-f", str(d / "sshd_config")])

    def banner() -> bool:
        with socket.create_connection(("127.0.0.1", port), timeout=2) as c:
            return c.recv(64).startswith(b"SSH-2.0")

    nodemod.wait_for(
        banner,
        20,
        f"sshd on 127.0.0.1:{port}",
        detail=lambda: nodemod.tail(nodemod.LOGDIR / "sshd.log"),
    )
    yield {"dir": d, "export": export, "port": port, "log": nodemod.LOGDIR / "sshd.log"}
    kube_node.stop("sshd")
