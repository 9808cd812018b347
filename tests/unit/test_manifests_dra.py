"""The DRA component (manifests/dra/, a kustomize component) and its examples: Kubernetes
schemas for the versions that have resource.k8s.io/v1, the component built onto
manifests/ (alone and after broker mode's), the RBAC exactly as its header justifies it,
the DaemonSet's paths and flags agreeing with the command, the DeviceClass and the claim
template agreeing with the driver, and the example pod at Pod Security `restricted`."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import kubernetes_validate  # type: ignore[import-untyped]
import pytest
import yaml

from fuse_plugin import __version__, cli
from fuse_plugin.args import env_name
from fuse_plugin.config import DEFAULT_RESOURCE_NAME
from fuse_plugin.dra import claims
from fuse_plugin.dra.settings import DRIVER_NAME, DraSettings
from tests.lib.manifests import (
    COMPLETE_RESTRICTED,
    MANIFESTS,
    Doc,
    containers,
    host_paths,
    kustomize,
    named_docs,
    one,
    pod_spec,
    resource_files,
    restricted_violations,
    validate_strictly,
)

DRA = MANIFESTS / "dra"
DRA_EXAMPLES = DRA / "examples"
# resource.k8s.io/v1 is GA from 1.34; extendedResourceName's mapping is GA in 1.37.
DRA_VERSIONS = ("1.34", kubernetes_validate.latest_version())
DAEMONSET = one(DRA / "driver-daemonset.yaml", "DaemonSet")
CLASS = one(DRA / "deviceclass.yaml", "DeviceClass")
TEMPLATE = one(DRA_EXAMPLES / "claim-template.yaml", "ResourceClaimTemplate")
POD = one(DRA_EXAMPLES / "sshfs-claim-pod.yaml", "Pod")


ALL_DOCS = named_docs(DRA, DRA_EXAMPLES)


@pytest.mark.parametrize("version", DRA_VERSIONS)
@pytest.mark.parametrize(("name", "doc"), ALL_DOCS, ids=[n for n, _ in ALL_DOCS])
def test_every_manifest_validates_strictly(name: str, doc: Doc, version: str) -> None:
    validate_strictly(doc, version, name)


@pytest.mark.parametrize("directory", [DRA, DRA_EXAMPLES], ids=["dra", "examples"])
def test_kustomization_lists_every_resource_file(directory: Path) -> None:
    kustomization = yaml.safe_load((directory / "kustomization.yaml").read_text())
    assert sorted(kustomization["resources"]) == [p.name for p in resource_files(directory)]


def built(tmp_path: Path, components: list[str]) -> list[Doc]:
    """manifests/ with the components, from a kustomization of one's own (the way the
    component's header gives)."""
    (tmp_path / "kustomization.yaml").write_text(yaml.safe_dump({
        "resources": [os.path.relpath(MANIFESTS, tmp_path)],
        "components": [os.path.relpath(MANIFESTS / c, tmp_path) for c in components]}))
    return kustomize(tmp_path)


@pytest.mark.parametrize("components", [["dra"], ["broker", "dra"]])
def test_component_replaces_the_device_plugin_with_the_driver(
        tmp_path: Path, components: list[str]) -> None:
    objects = {(d["kind"], d["metadata"]["name"]): d
               for d in built(tmp_path, components)}
    daemonsets = sorted(name for kind, name in objects if kind == "DaemonSet")
    expected = ["fuse-dra-driver", "fuse-profile-installer"]
    if "broker" in components:
        expected.insert(1, "fuse-mount-broker")
    assert daemonsets == expected
    assert objects[("DaemonSet", "fuse-dra-driver")]["spec"]["template"]["spec"][
        "containers"][0]["image"] == f"fuse-device-plugin:{__version__}"
    # Cluster-scoped objects get no namespace from the kustomization.
    for kind in ("DeviceClass", "ClusterRole", "ClusterRoleBinding",
                 "ValidatingAdmissionPolicy", "ValidatingAdmissionPolicyBinding"):
        (doc,) = [d for (k, _), d in objects.items() if k == kind]
        assert "namespace" not in doc["metadata"], kind
    binding = objects[("ClusterRoleBinding", "fuse-dra-driver")]
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "fuse-dra-driver",
                                    "namespace": "fuse-device-plugin"}]


def test_rbac_is_exactly_what_the_driver_calls() -> None:
    role = one(DRA / "rbac.yaml", "ClusterRole")
    granted = {(group, resource, verb) for rule in role["rules"]
               for group in rule["apiGroups"] for resource in rule["resources"]
               for verb in rule["verbs"]}
    assert granted == {
        ("resource.k8s.io", "resourceclaims", "get"),      # claims.ApiClaims.get
        ("resource.k8s.io", "resourceslices", "list"),     # slices: list_slices
        ("resource.k8s.io", "resourceslices", "watch"),    # watch
        ("resource.k8s.io", "resourceslices", "create"),   # create
        ("resource.k8s.io", "resourceslices", "update"),   # replace
        ("resource.k8s.io", "resourceslices", "delete"),   # delete
        ("", "nodes", "get"),                              # node_uid (owner reference)
    }
    header = (DRA / "rbac.yaml").read_text().split("apiVersion:")[0]
    for _, resource, verb in granted:
        assert resource in header
        assert f" {verb} " in header or f" {verb}\n" in header


def parsed_args(container: Doc) -> argparse.Namespace:
    args = container["args"]
    return cli.build_parser(args).parse_args(args)


def test_daemonset_flags_parse_and_mounts_cover_every_path_the_driver_uses() -> None:
    spec = pod_spec(DAEMONSET)
    (driver,) = containers(DAEMONSET)
    parsed = parsed_args(driver)
    assert parsed.command == "dra"
    assert parsed.probe_port == driver["ports"][0]["containerPort"]
    env = {e["name"]: e for e in driver["env"]}
    assert env[env_name("--node-name")]["valueFrom"]["fieldRef"]["fieldPath"] == \
        "spec.nodeName"
    # A rolling update starts the new pod beside the old one, under its own socket names.
    assert env[env_name("--instance")]["valueFrom"]["fieldRef"]["fieldPath"] == \
        "metadata.name"
    assert DAEMONSET["spec"]["updateStrategy"]["rollingUpdate"] == {
        "maxSurge": 1, "maxUnavailable": 0}
    defaults = DraSettings()
    assert (defaults.plugins_dir / DRIVER_NAME) == defaults.service_socket.parent
    mounts = {m["mountPath"]: m for m in driver["volumeMounts"]}
    needed = {str(defaults.service_socket.parent): False,
              str(defaults.registration_socket.parent): False,
              str(defaults.cdi_dir): False, str(defaults.fuse_device): True,
              str(defaults.broker_dir): True}
    for path, read_only in needed.items():
        assert path in mounts, path
        assert bool(mounts[path].get("readOnly")) == read_only, path
    volumes = {v["name"]: v for v in spec["volumes"]}
    for path, mount in mounts.items():
        # Each at its host path: CDI specs name host paths the driver also checks.
        assert volumes[mount["name"]]["hostPath"]["path"] == path
    assert host_paths(DAEMONSET)["/dev/fuse"]["type"] == "CharDevice"
    assert spec["serviceAccountName"] == one(DRA / "rbac.yaml", "ServiceAccount")[
        "metadata"]["name"]
    context = driver["securityContext"]
    assert context["capabilities"] == {"drop": ["ALL"]}
    assert context["readOnlyRootFilesystem"] is True
    assert context["allowPrivilegeEscalation"] is False
    assert not spec.get("hostNetwork")
    assert not spec.get("hostPID")


def test_network_policy_admits_only_metrics_readers_to_the_probe_port() -> None:
    policy = one(DRA / "network-policy.yaml", "NetworkPolicy")
    selected = policy["spec"]["podSelector"]["matchLabels"]
    labels = DAEMONSET["spec"]["template"]["metadata"]["labels"]
    assert selected.items() <= labels.items()
    assert policy["spec"]["policyTypes"] == ["Ingress"]
    (rule,) = policy["spec"]["ingress"]
    (driver,) = containers(DAEMONSET)
    assert rule["ports"] == [{"protocol": "TCP",
                              "port": parsed_args(driver).probe_port}]
    main = one(MANIFESTS / "network-policy.yaml", "NetworkPolicy")
    assert rule["from"] == main["spec"]["ingress"][0]["from"]


def guard() -> tuple[Doc, Doc]:
    return (one(DRA / "admission-policy.yaml", "ValidatingAdmissionPolicy"),
            one(DRA / "admission-policy.yaml", "ValidatingAdmissionPolicyBinding"))


def test_admission_policy_guards_every_slice_write_of_the_drivers_account() -> None:
    """What the CEL says is proven against the API server in the cluster stage
    (test_cluster_dra); here: it covers every write, binds with Deny, matches the
    service account of rbac.yaml, and names the driver the DaemonSet runs."""
    policy, binding = guard()
    (rule,) = policy["spec"]["matchConstraints"]["resourceRules"]
    assert rule["resources"] == ["resourceslices"]
    assert sorted(rule["operations"]) == ["CREATE", "DELETE", "UPDATE"]
    assert policy["spec"]["failurePolicy"] == "Fail"
    assert binding["spec"]["policyName"] == policy["metadata"]["name"]
    assert binding["spec"]["validationActions"] == ["Deny"]
    account = one(DRA / "rbac.yaml", "ServiceAccount")["metadata"]["name"]
    (match,) = policy["spec"]["matchConditions"]
    assert f'endsWith(":{account}")' in match["expression"]
    text = " ".join(v["expression"] for v in policy["spec"]["validations"])
    assert f'"{DRIVER_NAME}"' in text
    assert "authentication.kubernetes.io/node-name" in " ".join(
        v["expression"] for v in policy["spec"]["variables"])


def test_device_class_selects_the_driver_and_serves_the_resource_name() -> None:
    assert CLASS["spec"]["extendedResourceName"] == DEFAULT_RESOURCE_NAME
    (selector,) = CLASS["spec"]["selectors"]
    assert selector["cel"]["expression"] == f'device.driver == "{DRIVER_NAME}"'
    assert CLASS["metadata"]["name"] == f"fuse.{DRIVER_NAME}"


def test_claim_template_chooses_broker_mode_the_driver_accepts() -> None:
    devices = TEMPLATE["spec"]["spec"]["devices"]
    (request,) = devices["requests"]
    assert request["exactly"]["deviceClassName"] == CLASS["metadata"]["name"]
    (config,) = devices["config"]
    assert config["requests"] == [request["name"]]
    assert config["opaque"]["driver"] == DRIVER_NAME
    assert claims.parse_mode(config["opaque"]["parameters"], "template") == "broker"


def test_example_pod_uses_the_claim_and_is_restricted() -> None:
    assert restricted_violations(POD) == []
    (claim,) = pod_spec(POD)["resourceClaims"]
    assert claim["resourceClaimTemplateName"] == TEMPLATE["metadata"]["name"]
    (container,) = containers(POD)
    assert container["resources"]["claims"] == [{"name": claim["name"]}]
    assert DEFAULT_RESOURCE_NAME not in container["resources"].get("limits", {})
    for key, value in COMPLETE_RESTRICTED.items():
        assert container["securityContext"][key] == value
    namespace = one(DRA_EXAMPLES / "namespace.yaml", "Namespace")
    assert namespace["metadata"]["labels"]["pod-security.kubernetes.io/enforce"] == \
        "restricted"
    assert POD["metadata"]["namespace"] == namespace["metadata"]["name"]
