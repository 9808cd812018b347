"""The daemons' command lines as the manifests write them: every container of ours in
manifests/ (with its environment twins, and with the env a component patches in) parses
and makes valid settings, and the broker's flags, now on the args table, keep the names
and defaults the manifests and operators use."""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable
from pathlib import Path

import pytest

from fuse_plugin import args, cli, config
from fuse_plugin.broker import settings as broker_settings
from fuse_plugin.dra import settings as dra_settings
from tests.lib.manifests import MANIFESTS, Doc, containers, docs

IMAGE = "fuse-device-plugin"
# What the kubelet puts in a fieldRef env: any valid value of the field will do.
FIELDS = {"spec.nodeName": "node-1", "metadata.name": "pod-1",
          "metadata.uid": "0d9c6a3e-2a34-4f5f-9d7e-5b2f1f0c1a2b"}
# The commands whose settings have checks beyond one flag's: run them too.
SETTINGS: dict[str, Callable[[argparse.Namespace], object]] = {
    "serve": config.from_args, "dra": dra_settings.from_args,
    "broker": broker_settings.from_args}

Key = tuple[str, str, str]  # the workload's kind and name, the container's name


def _ours(path: Path) -> list[tuple[Key, Doc]]:
    return [((doc["kind"], doc["metadata"]["name"], c["name"]), c)
            for doc in docs(path) if doc.get("kind") in ("DaemonSet", "Deployment", "Pod")
            for c in containers(doc)]


def _manifests() -> tuple[dict[Key, Doc], list[tuple[str, Key, Doc]]]:
    """Our containers by workload, and the patches (a component's containers without an
    image) with the file they come from."""
    bases: dict[Key, Doc] = {}
    patches: list[tuple[str, Key, Doc]] = []
    for path in sorted(MANIFESTS.rglob("*.yaml")):
        if path.name == "kustomization.yaml":
            continue
        for key, container in _ours(path):
            if container.get("image") == IMAGE:
                bases[key] = container
            elif "image" not in container:
                patches.append((str(path.relative_to(MANIFESTS)), key, container))
    return bases, patches


BASES, PATCHES = _manifests()


def _env(container: Doc) -> dict[str, str]:
    values = {}
    for var in container.get("env", []):
        if "value" in var:
            values[var["name"]] = var["value"]
        else:
            values[var["name"]] = FIELDS[var["valueFrom"]["fieldRef"]["fieldPath"]]
    return values


def _parse(argv: list[str], env: dict[str, str], monkeypatch: pytest.MonkeyPatch) -> object:
    for name in os.environ:
        if name.startswith(args.ENV_PREFIX):
            monkeypatch.delenv(name)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    parsed = cli.build_parser(argv).parse_args(argv)
    make = SETTINGS.get(argv[0])
    return make(parsed) if make else parsed


def test_the_manifests_run_the_daemons_of_ours() -> None:
    commands = {c["args"][0] for c in BASES.values()}
    assert {"serve", "broker", "lxcfs", "dra", "install-profiles"} <= commands
    assert {path for path, _, _ in PATCHES} >= {"broker/plugin-broker-mode.yaml",
                                               "cdi/plugin-cdi.yaml"}


@pytest.mark.parametrize("key", sorted(BASES), ids=["/".join(k) for k in sorted(BASES)])
def test_every_container_of_ours_parses_its_args(
        key: Key, monkeypatch: pytest.MonkeyPatch) -> None:
    container = BASES[key]
    _parse(container["args"], _env(container), monkeypatch)


@pytest.mark.parametrize(("path", "key", "patch"), PATCHES, ids=[p for p, _, _ in PATCHES])
def test_every_component_patch_parses_with_its_base(
        path: str, key: Key, patch: Doc, monkeypatch: pytest.MonkeyPatch) -> None:
    assert key in BASES, f"{path} patches {key}, which no manifest declares"
    base = BASES[key]
    alone = _parse(base["args"], _env(base), monkeypatch)
    patched = _parse(base["args"], {**_env(base), **_env(patch)}, monkeypatch)
    assert patched != alone, f"{path}'s env changes no setting of {key}"


def test_a_bad_value_in_a_manifest_is_one_usage_line(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """What a typo in the broker's DaemonSet does: exit 2, naming the flag and the value."""
    with pytest.raises(SystemExit) as exited:
        _parse(["broker", "--max-pods=11O"], {}, monkeypatch)
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert "--max-pods" in err
    assert "'11O'" in err
    assert "Traceback" not in err


BROKER_FLAGS = ["--dir", "--state-dir", "--shim", "--lxcfs-dir", "--max-mounts",
                "--max-mounts-node", "--max-mounts-pod", "--max-pods", "--allow-other",
                "--metrics-port", "--metrics-address", "--log-format", "--log-level"]


def test_the_broker_keeps_its_flags_and_defaults(monkeypatch: pytest.MonkeyPatch) -> None:
    parser = cli.build_parser(["broker"])
    [sub] = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    flags = [o for a in sub.choices["broker"]._actions for o in a.option_strings]
    assert flags == ["-h", "--help", *BROKER_FLAGS]
    made = _parse(["broker"], {}, monkeypatch)
    assert made == broker_settings.BrokerSettings()
    assert made == broker_settings.BrokerSettings(
        directory=Path("/var/lib/fuse-device-plugin/broker"),
        state=Path("/run/fuse-device-plugin/broker"),
        shim=Path("/usr/local/libexec/fuse-device-plugin/fusermount3"),
        lxcfs_dir=Path("/run/fuse-device-plugin/lxcfs"), max_mounts=32,
        max_mounts_node=None, max_mounts_pod=64, max_pods=110, allow_other=False,
        metrics_port=0, metrics_address="0.0.0.0", log_format="text", log_level="info")
    twin = _parse(["broker", "--allow-other"], {"FUSE_DEVICE_PLUGIN_STATE_DIR": "/run/b"},
                  monkeypatch)
    assert twin == broker_settings.BrokerSettings(state=Path("/run/b"), allow_other=True)


def test_the_broker_and_its_lxcfs_meet_at_one_default(monkeypatch: pytest.MonkeyPatch) -> None:
    lxcfs = _parse(["lxcfs"], {}, monkeypatch)
    assert isinstance(lxcfs, argparse.Namespace)
    assert lxcfs.lxcfs_dir == broker_settings.BrokerSettings().lxcfs_dir
