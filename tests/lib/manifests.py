"""The manifests as the tests read them: every document of a file, one of a kind, a
workload's pod spec, containers and hostPath volumes; each document checked strictly
against the Kubernetes schemas, and a directory as ``kubectl kustomize`` builds it; and
the Pod Security Standards (``baseline``, ``restricted``) checked the way admission
checks them, each broken rule named."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path
from typing import Any

import kubernetes_validate  # type: ignore[import-untyped]
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
MANIFESTS = ROOT / "manifests"
EXAMPLES = MANIFESTS / "examples"
VERSIONS = ("1.30", kubernetes_validate.latest_version())

Doc = dict[str, Any]


def docs(path: Path) -> list[Doc]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc]


def resource_files(directory: Path) -> list[Path]:
    """The files a kustomization directory's resources may list: every ``*.yaml`` but
    ``kustomization.yaml``."""
    return sorted(p for p in directory.glob("*.yaml") if p.name != "kustomization.yaml")


def named_docs(*directories: Path) -> list[tuple[str, Doc]]:
    """Every document of the directories' resource files, each named
    ``FILE:Kind/name`` (FILE below manifests/), for test ids and failures."""
    return [(f"{path.relative_to(MANIFESTS)}:{doc['kind']}/{doc['metadata']['name']}", doc)
            for directory in directories for path in resource_files(directory)
            for doc in docs(path)]


def validate_strictly(doc: Doc, version: str, name: str = "") -> None:
    """``doc`` against Kubernetes ``version``'s schema, strictly: unknown fields (a typo
    such as ``readOnlyRootFileSystem``) fail too; the failure names the document and
    the field's path."""
    try:
        kubernetes_validate.validate(doc, version, strict=True)
    except kubernetes_validate.ValidationError as err:
        name = name or f"{doc.get('kind')}/{doc.get('metadata', {}).get('name')}"
        pytest.fail(f"{name} does not validate against Kubernetes {version}: "
                    f"{'.'.join(str(p) for p in err.path)}: {err.message}")


def kustomize(directory: Path) -> list[Doc]:
    """The documents ``kubectl kustomize DIRECTORY`` builds (the test skips without
    kubectl, fails with kustomize's own error)."""
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl is not installed: `kubectl kustomize` not checked here")
    built = subprocess.run([kubectl, "kustomize", str(directory)], capture_output=True,
                           text=True, check=False, timeout=120)
    assert built.returncode == 0, built.stderr
    return [doc for doc in yaml.safe_load_all(built.stdout) if doc]


def one(path: Path, kind: str) -> Doc:
    found = [doc for doc in docs(path) if doc["kind"] == kind]
    assert len(found) == 1, f"{path.name}: expected one {kind}"
    return found[0]


def pod_spec(doc: Doc) -> Doc:
    spec: Doc = doc["spec"] if doc["kind"] == "Pod" else doc["spec"]["template"]["spec"]
    return spec


def containers(doc: Doc) -> list[Doc]:
    spec = pod_spec(doc)
    return [*spec.get("initContainers", []), *spec["containers"]]


def host_paths(doc: Doc) -> dict[str, Doc]:
    return {v["hostPath"]["path"]: v["hostPath"] for v in pod_spec(doc).get("volumes", [])
            if "hostPath" in v}


# Pod Security Standards, `baseline`: the capabilities a container may add.
BASELINE_CAPABILITIES = {"AUDIT_WRITE", "CHOWN", "DAC_OVERRIDE", "FOWNER", "FSETID", "KILL",
                         "MKNOD", "NET_BIND_SERVICE", "SETFCAP", "SETGID", "SETPCAP",
                         "SETUID", "SYS_CHROOT"}


def user_namespaced(doc: Doc) -> bool:
    """``hostUsers: false``: since policy version 1.35 (k8s.io/pod-security-admission,
    ``relaxPolicyForUserNamespacePod``) baseline allows any procMount in such a pod, and
    restricted waives runAsNonRoot and runAsUser; restricted still refuses procMount."""
    return pod_spec(doc).get("hostUsers") is False


def baseline_violations(doc: Doc) -> list[str]:
    """The Pod Security `baseline` rules (kubernetes.io/docs/concepts/security/
    pod-security-standards, policy version latest) that a pod spec can break, each broken
    one named."""
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
        if context.get("procMount") not in (None, "Default") and not user_namespaced(doc):
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


# Pod Security Standards, `restricted`: the volume types allowed, and the one capability
# a container may add (after dropping ALL).
RESTRICTED_VOLUMES = {"configMap", "csi", "downwardAPI", "emptyDir", "ephemeral",
                      "persistentVolumeClaim", "projected", "secret"}
RESTRICTED_CAPABILITIES = {"NET_BIND_SERVICE"}
RESTRICTED_SECCOMP = {"RuntimeDefault", "Localhost"}


def restricted_violations(doc: Doc) -> list[str]:
    """The Pod Security `restricted` rules (kubernetes.io/docs/concepts/security/
    pod-security-standards): every `baseline` rule, then the volume types, privilege
    escalation, non-root, seccomp and capabilities, each broken one named. A field left
    out of a container is judged by the pod's, as admission does."""
    spec = pod_spec(doc)
    found = baseline_violations(doc)
    for volume in spec.get("volumes", []):
        found += [f"volume {volume['name']}: type {kind}"
                  for kind in sorted(set(volume) - {"name"} - RESTRICTED_VOLUMES)]
    pod = spec.get("securityContext", {})
    userns = user_namespaced(doc)
    if pod.get("runAsNonRoot") is False and not userns:
        found.append("pod: runAsNonRoot false")
    if pod.get("runAsUser") == 0 and not userns:
        found.append("pod: runAsUser 0")
    pod_seccomp = pod.get("seccompProfile", {}).get("type")
    if pod_seccomp not in (None, *RESTRICTED_SECCOMP):
        found.append(f"pod: seccomp {pod_seccomp}")
    for container in containers(doc):
        name, context = container["name"], container.get("securityContext", {})
        if context.get("allowPrivilegeEscalation") is not False:
            found.append(f"{name}: allowPrivilegeEscalation not false")
        if context.get("runAsNonRoot", pod.get("runAsNonRoot")) is not True and not userns:
            found.append(f"{name}: runAsNonRoot not true")
        if context.get("runAsUser") == 0 and not userns:
            found.append(f"{name}: runAsUser 0")
        if context.get("procMount") not in (None, "Default") and userns:
            found.append(f"{name}: procMount")  # baseline named it for other pods
        seccomp = context.get("seccompProfile", {}).get("type", pod_seccomp)
        if seccomp not in RESTRICTED_SECCOMP:
            found.append(f"{name}: seccomp {seccomp or 'not set'}")
        capabilities = context.get("capabilities", {})
        if "ALL" not in capabilities.get("drop", []):
            found.append(f"{name}: capabilities do not drop ALL")
        # Those beyond baseline's list are named by baseline_violations already.
        added = set(capabilities.get("add", [])) & BASELINE_CAPABILITIES
        found += [f"{name}: adds {cap}" for cap in sorted(added - RESTRICTED_CAPABILITIES)]
    return found


# The whole restricted security context, spelled out on the container.
COMPLETE_RESTRICTED = {
    "runAsNonRoot": True, "runAsUser": 1000, "runAsGroup": 1000,
    "allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True,
    "capabilities": {"drop": ["ALL"]}, "seccompProfile": {"type": "RuntimeDefault"}}
