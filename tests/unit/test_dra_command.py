"""The real ``fuse-device-plugin dra`` process: flags checked before anything starts,
the Kubernetes API found through KUBECONFIG (a fake API server over real HTTP), JSON
log lines, SIGTERM ending it cleanly; and ``serve`` never loading the Kubernetes client."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from fuse_plugin.dra.settings import DRIVER_NAME
from tests.lib.apiserver import FakeApiServer
from tests.lib.dra import NODE, Kubelet, node_api_fixture, settings_in, short_dir
from tests.lib.servers import stop_process
from tests.lib.waiting import wait_for

COMMAND = [sys.executable, "-m", "fuse_plugin", "dra"]


def run_command(*flags: str, env: dict[str, str] | None = None
                ) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*COMMAND, *flags], capture_output=True, text=True, timeout=60,
                          env={**os.environ, **(env or {})}, check=False)


@pytest.mark.parametrize(("flags", "env", "complaint"), [
    ((), {}, "--node-name is required"),
    (("--node-name", "Node_1"), {}, "is not a node name"),
    (("--node-name", "n", "--driver-name", "github.com/fuse"), {}, "is not a DRA driver name"),
    (("--node-name", "n", "--sharing", "maybe"), {}, "must be one of auto, shared, counted"),
    (("--node-name", "n", "--plugins-dir", "/" + "p" * 120), {}, "use a shorter --plugins-dir"),
    ((), {"FUSE_DEVICE_PLUGIN_NODE_NAME": "bad name"}, "FUSE_DEVICE_PLUGIN_NODE_NAME"),
    (("--node-name", "n", "--instance", "Pod_1"), {}, "is not an instance name"),
])
def test_bad_flags_are_one_line_and_exit_2(flags: tuple[str, ...], env: dict[str, str],
                                           complaint: str) -> None:
    env = {"FUSE_DEVICE_PLUGIN_NODE_NAME": "", **env}
    done = run_command(*flags, env=env)
    assert done.returncode == 2, done.stderr
    assert complaint in done.stderr
    assert "Traceback" not in done.stderr
    assert len(done.stderr.strip().splitlines()) <= 2


def test_no_api_configuration_is_one_line_and_exit_1(tmp_path: Path) -> None:
    done = run_command("--node-name", NODE, env={
        "KUBECONFIG": str(tmp_path / "missing"), "HOME": str(tmp_path),
        "KUBERNETES_SERVICE_HOST": ""})
    assert done.returncode == 1, done.stderr
    assert "no Kubernetes API configuration" in done.stderr
    assert "Traceback" not in done.stderr


api = node_api_fixture


def test_runs_registers_publishes_and_stops_on_sigterm(api: FakeApiServer,
                                                       tmp_path: Path) -> None:
    root = short_dir()
    settings = settings_in(root)
    kubeconfig = api.kubeconfig(tmp_path / "kubeconfig")
    proc = subprocess.Popen(
        [*COMMAND, "--node-name", NODE, "--log-format", "json",
         "--plugins-dir", str(settings.plugins_dir),
         "--registry-dir", str(settings.registry_dir), "--cdi-dir", str(settings.cdi_dir),
         "--fuse-device", str(settings.fuse_device), "--broker-dir", str(settings.broker_dir),
         "--probe-port", "0"],
        env={**os.environ, "KUBECONFIG": str(kubeconfig)}, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE)
    try:
        wait_for(settings.registration_socket.exists, 30, "the registration socket",
                 detail=lambda: f"exit code {proc.poll()}")
        kubelet = Kubelet(settings)
        assert kubelet.get_info().name == DRIVER_NAME
        kubelet.notify(True)
        # No FUSE device at --fuse-device: published, with no device in the pool.
        published = api.slices[f"{NODE}-{DRIVER_NAME}"]
        assert published["spec"]["devices"] == []
        stop_process(proc, signal.SIGTERM)
        assert proc.returncode == 0
        assert proc.stderr is not None
        lines = [json.loads(line) for line in proc.stderr.read().decode().splitlines()]
        events = [line["event"] for line in lines]
        for expected in ("slice.created", "serving", "registered", "signal", "stopping"):
            assert expected in events, events
        assert all(line["driver"] == DRIVER_NAME for line in lines)
        assert not settings.registration_socket.exists()
        assert not settings.service_socket.exists()
    finally:
        stop_process(proc, signal.SIGKILL, grace=0)
        shutil.rmtree(root, ignore_errors=True)


def test_serve_never_loads_the_kubernetes_client() -> None:
    code = ("import sys; from fuse_plugin import cli; from fuse_plugin.deviceplugin import plugin; "
            "cli.build_parser(['serve']); "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in "
            "('lightkube', 'httpx2', 'fuse_plugin') and "
            "(m.startswith('fuse_plugin.dra') or not m.startswith('fuse_plugin'))))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          check=True, timeout=60)
    assert done.stdout.strip() == "[]"


def test_every_dra_flag_and_its_environment_twin_is_documented() -> None:
    from dataclasses import fields

    from fuse_plugin.args import env_name
    from fuse_plugin.dra import settings

    doc = (Path(__file__).resolve().parents[2] / "docs" / "dra.md").read_text()
    for flag, _, _ in settings.FLAGS:
        default = next(f.default for f in fields(settings.DraSettings)
                       if f.name == flag.lstrip("-").replace("-", "_"))
        row = f"| `{flag}` | `{env_name(flag)}` | `{default}` |"
        assert row in doc, f"docs/dra.md's flag table lacks {row}"
