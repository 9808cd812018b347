"""Broker mode's manifests (manifests/broker/, a kustomize component, and its examples):
Kubernetes schemas, the component built onto manifests/, the broker's privileges exactly
as its header justifies them, agreement with the CLI, and the example pods against the
Pod Security `baseline` and `restricted` rules (the one-line pod's whole point)."""

from __future__ import annotations

import copy
import os
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import yaml

from fuse_plugin import cli
from fuse_plugin.args import env_name, optional_path
from fuse_plugin.broker import lxcfs, protocol, settings
from tests.lib.dockerfile import BUILDER, RUNTIME
from tests.lib.manifests import (
    COMPLETE_RESTRICTED,
    EXAMPLES,
    MANIFESTS,
    VERSIONS,
    Doc,
    baseline_violations,
    containers,
    docs,
    host_paths,
    kustomize,
    one,
    pod_spec,
    restricted_violations,
    validate_strictly,
)

BROKER = MANIFESTS / "broker"
BROKER_EXAMPLES = BROKER / "examples"
DAEMONSET = one(BROKER / "broker-daemonset.yaml", "DaemonSet")
PATCH = one(BROKER / "plugin-broker-mode.yaml", "DaemonSet")
BROKER_DIR = "/var/lib/fuse-device-plugin/broker"
STATE_DIR = "/run/fuse-device-plugin/broker"
CGROUP_DIR = "/sys/fs/cgroup"  # the node's, writable: helpers run in callers' cgroups
LXCFS_DIR = "/run/fuse-device-plugin/lxcfs"
LXCFS = one(BROKER / "lxcfs-daemonset.yaml", "DaemonSet")

def built_with_component(tmp_path: Path, how: str) -> list[Doc]:
    """manifests/ with the component: from a kustomization of one's own ("outside"), or
    with `kustomize edit add component broker` done in a copy of manifests/ ("inside")."""
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
    return kustomize(root)


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("path", [BROKER / "broker-daemonset.yaml",
                                  *sorted(BROKER_EXAMPLES.glob("*.yaml"))],
                         ids=lambda p: str(p.relative_to(BROKER)))
def test_broker_manifests_validate_strictly(path: Path, version: str) -> None:
    for doc in docs(path):
        if doc.get("kind") != "Kustomization":
            validate_strictly(doc, version, f"{path.relative_to(BROKER)}:{doc['kind']}")


@pytest.mark.parametrize("how", ["outside", "inside"])
def test_component_builds_onto_manifests_and_validates(tmp_path: Path, how: str) -> None:
    objects = built_with_component(tmp_path, how)
    for doc in objects:
        for version in VERSIONS:
            validate_strictly(doc, version)
    daemonsets = {d["metadata"]["name"]: d for d in objects if d["kind"] == "DaemonSet"}
    assert set(daemonsets) == {"fuse-device-plugin", "fuse-profile-installer",
                               "fuse-mount-broker", "fuse-lxcfs"}
    broker = daemonsets["fuse-mount-broker"]
    assert broker["metadata"]["namespace"] == "fuse-device-plugin"
    # The plugin, as built: its args and env make a serve in broker mode on the
    # broker's directory, and nothing else about the plugin pod changed.
    [plugin] = containers(daemonsets["fuse-device-plugin"])
    env = {e["name"]: e.get("value", e.get("valueFrom")) for e in plugin["env"]}
    args = cli.build_parser(plugin["args"]).parse_args(plugin["args"])
    assert env == {env_name("--broker-dir"): BROKER_DIR,
                   env_name("--instance"): {"fieldRef": {"fieldPath": "metadata.uid"}}}
    assert str(optional_path(env[env_name("--broker-dir")])) == BROKER_DIR
    assert args.command == "serve"
    plain = one(MANIFESTS / "plugin-daemonset.yaml", "DaemonSet")
    # One more hostPath, read-only: the plugin reads whether the broker's shim is there.
    assert host_paths(daemonsets["fuse-device-plugin"]) == {
        **host_paths(plain), BROKER_DIR: {"path": BROKER_DIR, "type": "DirectoryOrCreate"}}
    assert {m["mountPath"]: m.get("readOnly") for m in plugin["volumeMounts"]}[
        BROKER_DIR] is True
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
    added = context["capabilities"]["add"]
    assert context["capabilities"]["drop"] == ["ALL"]
    assert sorted(added) == ["DAC_OVERRIDE", "SETGID", "SETUID", "SYS_ADMIN", "SYS_CHROOT",
                             "SYS_PTRACE"]
    assert context["appArmorProfile"] == {"type": "Unconfined"}
    assert context["seccompProfile"] == {"type": "Unconfined"}
    for privilege in ("hostPID", *(f"CAP_{cap}" for cap in added), "AppArmor Unconfined",
                      "seccomp Unconfined", f"hostPath {BROKER_DIR}",
                      f"hostPath {STATE_DIR}", f"hostPath {CGROUP_DIR}",
                      f"hostPath {LXCFS_DIR}"):
        assert privilege in header, f"the header does not justify {privilege}"
    # A caller brings its own /dev/fuse: the broker asks for no slot, so it never waits
    # on the plugin's Allocate, nor gets the shim bound over its own files.
    assert "github.com/fuse" not in container["resources"].get("limits", {})
    assert host_paths(DAEMONSET) == {
        BROKER_DIR: {"path": BROKER_DIR, "type": "DirectoryOrCreate"},
        STATE_DIR: {"path": STATE_DIR, "type": "DirectoryOrCreate"},
        CGROUP_DIR: {"path": CGROUP_DIR, "type": "Directory"},
        LXCFS_DIR: {"path": LXCFS_DIR, "type": "DirectoryOrCreate"}}
    assert not any(m.get("readOnly") for m in container["volumeMounts"]
                   if m["mountPath"] == CGROUP_DIR)
    assert sorted(baseline_violations(DAEMONSET)) == sorted([
        "host namespace hostPID", "hostPath volume broker", "hostPath volume state",
        "hostPath volume cgroup", "hostPath volume lxcfs-socket",
        "broker: adds SYS_ADMIN", "broker: adds SYS_PTRACE", "seccomp Unconfined",
        "AppArmor Unconfined"])


def test_lxcfs_has_exactly_the_privileges_its_header_justifies() -> None:
    """The node's lxcfs: what lxcfs needs, none of the broker's other powers, and the
    broker's lxcfs socket as its one hostPath (tenants never get it)."""
    spec = pod_spec(LXCFS)
    header = (BROKER / "lxcfs-daemonset.yaml").read_text().split("apiVersion:")[0]
    assert spec["hostPID"] is True
    assert not spec.get("hostNetwork")
    assert not spec.get("hostIPC")
    assert spec["automountServiceAccountToken"] is False
    [container] = containers(LXCFS)
    context = container["securityContext"]
    assert context.get("privileged") is False
    assert context["readOnlyRootFilesystem"] is True
    assert context["capabilities"]["drop"] == ["ALL"]
    added = context["capabilities"]["add"]
    assert sorted(added) == ["DAC_READ_SEARCH", "SYS_ADMIN", "SYS_CHROOT", "SYS_PTRACE"]
    for privilege in ("hostPID", *added, "github.com/fuse", "lxcfs-socket"):
        assert privilege in header, f"the header does not justify {privilege}"
    assert container["resources"]["limits"]["github.com/fuse"] == 1
    assert host_paths(LXCFS) == {LXCFS_DIR: {"path": LXCFS_DIR, "type": "DirectoryOrCreate"}}
    args = cli.build_parser(container["args"]).parse_args(container["args"])
    assert args.command == "lxcfs"
    assert str(args.lxcfs_dir) == LXCFS_DIR
    mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
    assert mounts[lxcfs.MOUNTPOINT] == "lxcfs"  # an emptyDir: fresh in every container
    assert {v["name"]: v for v in spec["volumes"]}["lxcfs"] == {"name": "lxcfs",
                                                                 "emptyDir": {}}
    assert "mountPropagation" not in str(container)  # the mount never reaches the host


def test_broker_args_match_the_cli_and_the_plugin_patch() -> None:
    [container] = containers(DAEMONSET)
    args = cli.build_parser(container["args"]).parse_args(container["args"])
    assert args.command == "broker"
    assert str(args.directory) == BROKER_DIR
    [patched] = containers(PATCH)
    assert patched["env"] == [{"name": "FUSE_DEVICE_PLUGIN_BROKER_DIR", "value": BROKER_DIR}]
    mounts = {m["mountPath"] for m in container["volumeMounts"]}
    assert {BROKER_DIR, str(args.state), CGROUP_DIR, str(args.lxcfs_dir)} == mounts
    assert str(args.lxcfs_dir) == LXCFS_DIR
    assert str(args.state) == STATE_DIR
    assert args.shim == settings.DEFAULT_SHIM
    # The probes read the port the broker serves.
    [port] = container["ports"]
    assert port["containerPort"] == args.metrics_port
    assert container["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": port["name"]}
    assert container["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": port["name"]}


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


def test_image_ships_the_shim_and_its_helper_where_the_broker_looks() -> None:
    assert BUILDER is not None
    assert RUNTIME is not None
    [build] = [r.value for r in BUILDER.all("RUN") if "scripts/build-native" in r.value]
    built = build.split()[-1]
    [copy] = [c.value for c in RUNTIME.all("COPY") if built in c.value]
    source, target = copy.split()[1:]
    assert (source.rstrip("/"), target.rstrip("/")) == (built, str(settings.DEFAULT_SHIM.parent))
    script = (Path(__file__).parents[2] / "scripts" / "build-native").read_text()
    assert f"{protocol.SHIM_NAME}:" in script
    assert "fuse-broker-helper:" in script
    packages = (Path(__file__).parents[2] / "scripts" / "apt-packages.txt").read_text()
    assert {"gcc", "musl-tools"} <= set(packages.split())


# -- Pod Security `restricted` (issue 21: non-root callers through the broker) ----------

RESTRICTED_NAMESPACE = one(BROKER_EXAMPLES / "namespace-restricted.yaml", "Namespace")
RESTRICTED_POD = one(BROKER_EXAMPLES / "sshfs-restricted-pod.yaml", "Pod")
USERNS_POD = one(BROKER_EXAMPLES / "sshfs-userns-pod.yaml", "Pod")
def test_restricted_example_is_one_line_and_restricted() -> None:
    labels = RESTRICTED_NAMESPACE["metadata"]["labels"]
    assert labels["pod-security.kubernetes.io/enforce"] == "restricted"
    assert RESTRICTED_POD["metadata"]["namespace"] == RESTRICTED_NAMESPACE["metadata"]["name"]
    assert restricted_violations(RESTRICTED_POD) == []
    [container] = containers(RESTRICTED_POD)
    assert container["securityContext"] == COMPLETE_RESTRICTED
    assert container["resources"]["limits"]["github.com/fuse"] == 1
    # The Secret's files are readable by the pod's group (fsGroup), not by others.
    assert pod_spec(RESTRICTED_POD)["securityContext"] == {"fsGroup": 1000}
    [key] = [v for v in pod_spec(RESTRICTED_POD)["volumes"] if "secret" in v]
    assert key["secret"]["defaultMode"] == 0o440


def test_userns_variant_is_the_restricted_pod_in_a_user_namespace() -> None:
    spec = dict(pod_spec(USERNS_POD))
    assert spec.pop("hostUsers") is False
    assert spec == pod_spec(RESTRICTED_POD)
    assert USERNS_POD["metadata"]["namespace"] == RESTRICTED_POD["metadata"]["namespace"]
    assert restricted_violations(USERNS_POD) == []
    # Left out of the kustomization: API servers before 1.25 refuse the field.
    listed = yaml.safe_load((BROKER_EXAMPLES / "kustomization.yaml").read_text())["resources"]
    assert "sshfs-userns-pod.yaml" not in listed
    assert {"namespace-restricted.yaml", "sshfs-restricted-pod.yaml"} <= set(listed)


def test_restricted_example_image_has_the_pods_user() -> None:
    """ssh refuses to start for a uid without a passwd entry: the image made from the
    Dockerfile beside the example has one for the uid and gid the pod runs as."""
    dockerfile = (BROKER_EXAMPLES / "Dockerfile").read_text()
    [container] = containers(RESTRICTED_POD)
    uid, gid = container["securityContext"]["runAsUser"], container["securityContext"][
        "runAsGroup"]
    assert f"useradd --uid {uid} --gid {gid} " in dockerfile
    assert f"groupadd --gid {gid} " in dockerfile
    assert f"\nUSER {uid}:{gid}\n" in dockerfile
    assert container["image"] == "fuse-example-sshfs-nonroot"


def test_broker_examples_build_into_namespaces_of_their_level() -> None:
    objects = kustomize(BROKER_EXAMPLES)
    levels = {d["metadata"]["name"]: d["metadata"]["labels"]["pod-security.kubernetes.io/enforce"]
              for d in objects if d["kind"] == "Namespace"}
    pods = {d["metadata"]["name"]: d for d in objects if d["kind"] == "Pod"}
    assert {name: levels[p["metadata"]["namespace"]] for name, p in pods.items()} == {
        "sshfs-broker-example": "baseline", "sshfs-restricted-example": "restricted"}
    assert baseline_violations(pods["sshfs-broker-example"]) == []
    assert restricted_violations(pods["sshfs-restricted-example"]) == []
    for doc in objects:
        for version in VERSIONS:
            validate_strictly(doc, version)


def _set(path: str, value: object) -> Callable[[Doc], None]:
    """A change to the restricted pod: the dotted path's last key set (None: removed);
    a path starting with "c." is in its container."""
    def change(pod: Doc) -> None:
        node = containers(pod)[0] if path.startswith("c.") else pod_spec(pod)
        *parents, last = path.removeprefix("c.").split(".")
        for key in parents:
            node = node.setdefault(key, {})
        if value is None:
            node.pop(last, None)
        else:
            node[last] = value
    return change


def _moved(key: str) -> Callable[[Doc], None]:
    """A change that moves a field from the container's securityContext to the pod's."""
    def change(pod: Doc) -> None:
        value = containers(pod)[0]["securityContext"].pop(key)
        pod_spec(pod)["securityContext"][key] = value
    return change


@pytest.mark.parametrize(("change", "broken"), [
    (_set("volumes", [{"name": "host", "hostPath": {"path": "/srv"}}]),
     ["hostPath volume host", "volume host: type hostPath"]),
    (_set("volumes", [{"name": "disk", "gcePersistentDisk": {"pdName": "d"}}]),
     ["volume disk: type gcePersistentDisk"]),
    (_set("c.securityContext.allowPrivilegeEscalation", None),
     ["sshfs: allowPrivilegeEscalation not false"]),
    (_set("c.securityContext.allowPrivilegeEscalation", True),
     ["sshfs: allowPrivilegeEscalation not false"]),
    (_set("c.securityContext.runAsNonRoot", None), ["sshfs: runAsNonRoot not true"]),
    (_set("securityContext.runAsNonRoot", False), ["pod: runAsNonRoot false"]),
    (_set("c.securityContext.runAsUser", 0), ["sshfs: runAsUser 0"]),
    (_set("securityContext.runAsUser", 0), ["pod: runAsUser 0"]),
    (_set("c.securityContext.seccompProfile", None), ["sshfs: seccomp not set"]),
    (_set("c.securityContext.seccompProfile", {"type": "Unconfined"}),
     ["seccomp Unconfined", "sshfs: seccomp Unconfined"]),
    (_set("c.securityContext.capabilities", {}), ["sshfs: capabilities do not drop ALL"]),
    (_set("c.securityContext.capabilities.add", ["CHOWN"]), ["sshfs: adds CHOWN"]),
    (_set("c.securityContext.capabilities.add", ["SYS_ADMIN"]), ["sshfs: adds SYS_ADMIN"]),
    (_set("hostNetwork", True), ["host namespace hostNetwork"]),
], ids=lambda v: None if callable(v) else "; ".join(v))
def test_restricted_check_has_teeth(change: Callable[[Doc], None], broken: list[str]) -> None:
    """Each restricted rule broken alone in the example is named, and nothing else."""
    pod = copy.deepcopy(RESTRICTED_POD)
    change(pod)
    assert restricted_violations(pod) == broken


@pytest.mark.parametrize("change", [
    _set("c.securityContext.capabilities.add", ["NET_BIND_SERVICE"]),
    _set("c.securityContext.seccompProfile", {"type": "Localhost",
                                                "localhostProfile": "profile.json"}),
    # Fields left out of the container are judged by the pod's.
    _moved("runAsNonRoot"),
    _moved("seccompProfile"),
], ids=["NET_BIND_SERVICE", "Localhost seccomp", "pod runAsNonRoot", "pod seccomp"])
def test_restricted_check_allows_what_restricted_allows(
        change: Callable[[Doc], None]) -> None:
    pod = copy.deepcopy(RESTRICTED_POD)
    change(pod)
    assert restricted_violations(pod) == []


def test_baseline_example_is_baseline_but_not_restricted() -> None:
    """The root sshfs example passes baseline and breaks restricted exactly where its
    restricted twin differs: the two checks tell the levels apart."""
    pod = one(BROKER_EXAMPLES / "sshfs-pod.yaml", "Pod")
    assert baseline_violations(pod) == []
    assert restricted_violations(pod) == ["sshfs: allowPrivilegeEscalation not false",
                                          "sshfs: runAsNonRoot not true",
                                          "sshfs: capabilities do not drop ALL"]
