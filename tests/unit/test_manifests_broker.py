"""Broker mode's manifests (manifests/broker/, a kustomize component, and its examples):
Kubernetes schemas, the component built onto manifests/, the broker's privileges exactly
as its header justifies them, agreement with the CLI, and the example pod against the Pod
Security `baseline` rules (the one-line pod's whole point)."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import kubernetes_validate  # type: ignore[import-untyped]
import pytest
import yaml

from fuse_plugin import cli, config
from fuse_plugin.broker import protocol, server
from tests.unit.test_manifests import (
    EXAMPLES,
    MANIFESTS,
    VERSIONS,
    Doc,
    containers,
    docs,
    host_paths,
    one,
    pod_spec,
)

BROKER = MANIFESTS / "broker"
BROKER_EXAMPLES = BROKER / "examples"
DAEMONSET = one(BROKER / "broker-daemonset.yaml", "DaemonSet")
PATCH = one(BROKER / "plugin-broker-mode.yaml", "DaemonSet")
BROKER_DIR = "/var/lib/fuse-device-plugin/broker"

# Pod Security Standards, `baseline`: the capabilities a container may add.
BASELINE_CAPABILITIES = {"AUDIT_WRITE", "CHOWN", "DAC_OVERRIDE", "FOWNER", "FSETID", "KILL",
                         "MKNOD", "NET_BIND_SERVICE", "SETFCAP", "SETGID", "SETPCAP",
                         "SETUID", "SYS_CHROOT"}


def baseline_violations(doc: Doc) -> list[str]:
    """The Pod Security `baseline` rules (kubernetes.io/docs/concepts/security/
    pod-security-standards) that a pod spec can break, each broken one named."""
    spec = pod_spec(doc)
    found = [f"host namespace {k}" for k in ("hostNetwork", "hostPID", "hostIPC")
             if spec.get(k)]
    found += [f"hostPath volume {v['name']}" for v in spec.get("volumes", [])
              if "hostPath" in v]
    contexts = [spec.get("securityContext", {})]
    for container in containers(doc):
        context = container.get("securityContext", {})
        contexts.append(context)
        if context.get("privileged"):
            found.append(f"{container['name']}: privileged")
        added = set(context.get("capabilities", {}).get("add", [])) - BASELINE_CAPABILITIES
        found += [f"{container['name']}: adds {cap}" for cap in sorted(added)]
        found += [f"{container['name']}: hostPort" for p in container.get("ports", [])
                  if p.get("hostPort")]
        if context.get("procMount") not in (None, "Default"):
            found.append(f"{container['name']}: procMount")
    for context in contexts:
        if context.get("seccompProfile", {}).get("type") == "Unconfined":
            found.append("seccomp Unconfined")
        if context.get("appArmorProfile", {}).get("type") == "Unconfined":
            found.append("AppArmor Unconfined")
        if context.get("seLinuxOptions", {}).get("type") not in (
                None, "container_t", "container_init_t", "container_kvm_t",
                "container_engine_t"):
            found.append("SELinux type")
    return found


def built_with_component(tmp_path: Path, how: str) -> list[Doc]:
    """manifests/ with the component: from a kustomization of one's own ("outside"), or
    with `kustomize edit add component broker` done in a copy of manifests/ ("inside")."""
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl is not installed: `kubectl kustomize` not checked here")
    if how == "outside":
        root = tmp_path
        (root / "kustomization.yaml").write_text(yaml.safe_dump({
            "resources": [os.path.relpath(MANIFESTS, root)],
            "components": [os.path.relpath(BROKER, root)]}))
    else:
        root = tmp_path / "manifests"
        shutil.copytree(MANIFESTS, root)
        kustomization = yaml.safe_load((root / "kustomization.yaml").read_text())
        kustomization["components"] = ["broker"]
        (root / "kustomization.yaml").write_text(yaml.safe_dump(kustomization))
    built = subprocess.run([kubectl, "kustomize", str(root)], capture_output=True,
                           text=True, check=False, timeout=60)
    assert built.returncode == 0, built.stderr
    return [doc for doc in yaml.safe_load_all(built.stdout) if doc]


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("path", [BROKER / "broker-daemonset.yaml",
                                  *sorted(BROKER_EXAMPLES.glob("*.yaml"))],
                         ids=lambda p: str(p.relative_to(BROKER)))
def test_broker_manifests_validate_strictly(path: Path, version: str) -> None:
    for doc in docs(path):
        if doc.get("kind") != "Kustomization":
            kubernetes_validate.validate(doc, version, strict=True)


@pytest.mark.parametrize("how", ["outside", "inside"])
def test_component_builds_onto_manifests_and_validates(tmp_path: Path, how: str) -> None:
    objects = built_with_component(tmp_path, how)
    for doc in objects:
        for version in VERSIONS:
            kubernetes_validate.validate(doc, version, strict=True)
    daemonsets = {d["metadata"]["name"]: d for d in objects if d["kind"] == "DaemonSet"}
    assert set(daemonsets) == {"fuse-device-plugin", "fuse-profile-installer",
                               "fuse-mount-broker"}
    broker = daemonsets["fuse-mount-broker"]
    assert broker["metadata"]["namespace"] == "fuse-device-plugin"
    # The plugin, as built: its args and env make a serve in broker mode on the
    # broker's directory, and nothing else about the plugin pod changed.
    [plugin] = containers(daemonsets["fuse-device-plugin"])
    env = {e["name"]: e["value"] for e in plugin["env"]}
    args = cli.build_parser().parse_args(plugin["args"])
    assert env == {config.env_name("--broker-dir"): BROKER_DIR}
    assert str(config.optional_path(env[config.env_name("--broker-dir")])) == BROKER_DIR
    assert args.command == "serve"
    plain = one(MANIFESTS / "plugin-daemonset.yaml", "DaemonSet")
    assert host_paths(daemonsets["fuse-device-plugin"]) == host_paths(plain)
    assert plugin["securityContext"] == containers(plain)[0]["securityContext"]


def test_component_is_opt_in() -> None:
    plain = yaml.safe_load((MANIFESTS / "kustomization.yaml").read_text())
    assert "broker" not in plain.get("components", []) + plain["resources"]
    component = yaml.safe_load((BROKER / "kustomization.yaml").read_text())
    assert component["kind"] == "Component"
    assert sorted(component["resources"] + [p["path"] for p in component["patches"]]) == \
        sorted(p.name for p in BROKER.glob("*.yaml") if p.name != "kustomization.yaml")


def test_broker_has_exactly_the_privileges_its_header_justifies() -> None:
    spec = pod_spec(DAEMONSET)
    header = (BROKER / "broker-daemonset.yaml").read_text().split("apiVersion:")[0]
    assert spec["hostPID"] is True
    assert not spec.get("hostNetwork")
    assert not spec.get("hostIPC")
    assert spec["automountServiceAccountToken"] is False
    assert spec["priorityClassName"] == "system-node-critical"
    [container] = containers(DAEMONSET)
    context = container["securityContext"]
    assert context.get("privileged") is False
    assert context["readOnlyRootFilesystem"] is True
    assert context["capabilities"] == {"drop": ["ALL"],
                                       "add": ["SYS_ADMIN", "SYS_CHROOT", "SYS_PTRACE"]}
    assert context["appArmorProfile"] == {"type": "Unconfined"}
    assert context["seccompProfile"] == {"type": "Unconfined"}
    for privilege in ("hostPID", "CAP_SYS_ADMIN", "CAP_SYS_CHROOT", "CAP_SYS_PTRACE",
                      "AppArmor Unconfined", "seccomp Unconfined", "github.com/fuse: 1",
                      f"hostPath {BROKER_DIR}"):
        assert privilege in header, f"the header does not justify {privilege}"
    assert container["resources"]["limits"]["github.com/fuse"] == 1
    assert host_paths(DAEMONSET) == {BROKER_DIR: {"path": BROKER_DIR,
                                                  "type": "DirectoryOrCreate"}}
    assert sorted(baseline_violations(DAEMONSET)) == sorted([
        "host namespace hostPID", "hostPath volume broker", "broker: adds SYS_ADMIN",
        "broker: adds SYS_PTRACE", "seccomp Unconfined", "AppArmor Unconfined"])


def test_broker_args_match_the_cli_and_the_plugin_patch() -> None:
    [container] = containers(DAEMONSET)
    args = cli.build_parser().parse_args(container["args"])
    assert args.command == "broker"
    assert str(args.dir) == BROKER_DIR
    [patched] = containers(PATCH)
    assert patched["env"] == [{"name": "FUSE_DEVICE_PLUGIN_BROKER_DIR", "value": BROKER_DIR}]
    mounts = {m["mountPath"] for m in container["volumeMounts"]}
    assert {BROKER_DIR, str(args.staging_dir)} == mounts
    # Its own allocation binds the shim over every place below: the real one lives apart.
    assert str(args.fusermount) not in protocol.SHIM_TARGETS
    assert args.fusermount != args.shim
    assert args.shim == server.DEFAULT_SHIM


def test_broker_example_pod_is_one_line_and_baseline() -> None:
    namespace = one(BROKER_EXAMPLES / "namespace.yaml", "Namespace")
    assert namespace["metadata"]["labels"]["pod-security.kubernetes.io/enforce"] == \
        "baseline"
    pod = one(BROKER_EXAMPLES / "sshfs-pod.yaml", "Pod")
    assert baseline_violations(pod) == []
    [container] = containers(pod)
    assert container["resources"]["limits"]["github.com/fuse"] == 1
    # Nothing about FUSE: RuntimeDefault seccomp makes mount(2) fail with EPERM, the
    # errno on which libfuse asks fusermount3 (docs/broker.md).
    assert container["securityContext"] == {"readOnlyRootFilesystem": True,
                                            "seccompProfile": {"type": "RuntimeDefault"}}


def test_baseline_check_has_teeth() -> None:
    """Today's sshfs example (SYS_ADMIN) breaks baseline: the check can fail."""
    today = one(EXAMPLES / "sshfs-pod.yaml", "Pod")
    assert baseline_violations(today) == ["sshfs: adds SYS_ADMIN"]


def test_image_ships_the_shim_and_a_real_fusermount3_where_the_broker_looks() -> None:
    from tests.unit.test_dockerfile import BUILDER, RUNTIME

    assert BUILDER is not None
    assert RUNTIME is not None
    [build] = [r.value for r in BUILDER.all("RUN") if "scripts/build-native" in r.value]
    built = build.split()[-1]
    [copy] = [c.value for c in RUNTIME.all("COPY") if built in c.value]
    source, target = copy.split()[1:]
    assert (source.rstrip("/"), target.rstrip("/")) == (built, str(server.DEFAULT_SHIM.parent))
    [container] = containers(DAEMONSET)
    args = cli.build_parser().parse_args(container["args"])
    [install] = [r.value for r in RUNTIME.all("RUN") if " fuse3" in r.value]
    assert f"/usr/bin/fusermount3 {args.fusermount}" in " ".join(install.split())
    packages = (Path(__file__).parents[2] / "scripts" / "apt-packages.txt").read_text()
    assert {"gcc", "musl-tools"} <= set(packages.split())
