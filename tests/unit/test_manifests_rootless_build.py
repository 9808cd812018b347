"""manifests/examples/rootless-build/: the rootless image build (issue 36), and
manifests/examples/rootless-build-users/: the same with more than one uid (issue 48), as a
reader applies them. Their scripts, ConfigMaps and security contexts run for real in
tests/containers/test_rootless_build.py; here, what admission and the profiles decide."""

from __future__ import annotations

import copy
import re

import pytest
import yaml

from fuse_plugin import profiles
from tests.lib.manifests import (
    EXAMPLES,
    VERSIONS,
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

HERE = EXAMPLES / "rootless-build"
NAMESPACE = one(HERE / "namespace.yaml", "Namespace")
POD = one(HERE / "build-pod.yaml", "Pod")
CONFIGMAP = one(HERE / "build-pod.yaml", "ConfigMap")
[CONTAINER] = containers(POD)
PRESET = "rootless-build"


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("name", ["namespace.yaml", "build-pod.yaml"])
def test_every_document_validates_strictly(name: str, version: str) -> None:
    for doc in docs(HERE / name):
        validate_strictly(doc, version, f"{name}:{doc['kind']}")


def test_kustomize_builds_it() -> None:
    kinds = sorted(doc["kind"] for doc in kustomize(HERE))
    assert kinds == ["ConfigMap", "Namespace", "Pod"]


def test_kustomization_applies_the_namespace_and_the_pod_into_it() -> None:
    kustomization = yaml.safe_load((HERE / "kustomization.yaml").read_text())
    assert kustomization["resources"] == ["namespace.yaml", "build-pod.yaml"]
    name = NAMESPACE["metadata"]["name"]
    assert {doc["metadata"]["namespace"] for doc in docs(HERE / "build-pod.yaml")} == {name}
    assert CONTAINER["image"] in (HERE / "Dockerfile").read_text().split("docker build")[1]


def test_namespace_enforces_baseline_and_warns_at_restricted() -> None:
    labels = NAMESPACE["metadata"]["labels"]
    assert labels["pod-security.kubernetes.io/enforce"] == "baseline"
    assert labels["pod-security.kubernetes.io/warn"] == "restricted"
    assert labels["pod-security.kubernetes.io/enforce-version"] == "latest"


def test_baseline_admits_the_pod_and_restricted_refuses_only_its_proc_mount() -> None:
    assert baseline_violations(POD) == []
    assert restricted_violations(POD) == ["build: procMount"]
    # Without it, the pod would be restricted-clean: nothing else keeps it out.
    default = copy.deepcopy(POD)
    default["spec"]["containers"][0]["securityContext"]["procMount"] = "Default"
    assert restricted_violations(default) == []


def test_proc_mount_unmasked_is_baseline_only_in_a_user_namespace() -> None:
    host_users = copy.deepcopy(POD)
    host_users["spec"]["hostUsers"] = True
    assert baseline_violations(host_users) == ["build: procMount"]


def test_the_pod_holds_nothing_but_its_profiles() -> None:
    spec = pod_spec(POD)
    assert spec["hostUsers"] is False
    assert not host_paths(POD)
    context = CONTAINER["securityContext"]
    assert context["runAsUser"] == context["runAsGroup"] == 1000
    assert context["runAsNonRoot"] is True
    assert context["allowPrivilegeEscalation"] is False
    assert context["capabilities"] == {"drop": ["ALL"]}
    assert context["procMount"] == "Unmasked"
    assert "privileged" not in context
    # No /dev/fuse and no broker: the kernel's overlay in the build's user namespace.
    assert "github.com/fuse" not in str(CONTAINER.get("resources"))
    assert context["seccompProfile"] == {
        "type": "Localhost", "localhostProfile": profiles.seccomp_localhost_profile(PRESET)}
    assert context["appArmorProfile"] == {
        "type": "Localhost", "localhostProfile": profiles.apparmor_name(PRESET)}
    assert profiles.PRESETS[PRESET].capabilities == ()


def test_storage_is_overlay_on_the_empty_dir() -> None:
    storage = CONFIGMAP["data"]["storage.conf"]
    env = {e["name"]: e["value"] for e in CONTAINER["env"]}
    assert env["CONTAINERS_STORAGE_CONF"] == "/mnt/context/storage.conf"
    assert 'driver = "overlay"' in storage
    assert "mount_program" not in storage
    empty_dirs = {m["mountPath"] for m in CONTAINER["volumeMounts"]
                  if "emptyDir" in next(v for v in pod_spec(POD)["volumes"]
                                        if v["name"] == m["name"])}
    assert "/var/lib/build" in empty_dirs
    written = [*re.findall(r'= "(/[^"]*)"', storage), env["HOME"], env["TMPDIR"],
               env["XDG_RUNTIME_DIR"]]
    for path in written:
        assert path.startswith("/var/lib/build/"), path
    assert CONTAINER["securityContext"]["readOnlyRootFilesystem"] is True


def test_every_build_and_run_uses_the_pods_network_and_cgroup_namespaces() -> None:
    """The profile lets no build make a network or cgroup namespace."""
    script = CONFIGMAP["data"]["build.sh"]
    commands = re.findall(r"\b(?:buildah|podman) (?:build|run)\b[^\n]*", script)
    assert len(commands) == 4
    for command in commands:
        assert "--network host" in command, command
        assert "--cgroupns host" in command, command


@pytest.mark.parametrize("word", ["FROM localhost/base AS builder", "COPY hello.txt",
                                  "COPY --from=builder", "RUN "])
def test_containerfile_has_from_copy_run_and_two_stages(word: str) -> None:
    assert word in CONFIGMAP["data"]["Containerfile"]
    assert CONFIGMAP["data"]["Containerfile"].count("FROM ") == 2


def test_image_runs_as_the_pods_user_with_the_tools_the_script_uses() -> None:
    dockerfile = (HERE / "Dockerfile").read_text()
    assert "useradd --uid 1000 " in dockerfile
    assert "USER 1000:1000" in dockerfile
    [install] = re.findall(r"apt-get install -y --no-install-recommends ([^&]*)&&",
                           dockerfile.replace("\\\n", " "))
    assert set(install.split()) == {"buildah", "podman", "runc", "busybox-static",
                                    "ca-certificates", "libcap2-bin"}


# -- rootless-build-users: more than one uid (issue 48) -------------------------------------

USERS = EXAMPLES / "rootless-build-users"
USERS_NAMESPACE = one(USERS / "namespace.yaml", "Namespace")
USERS_POD = one(USERS / "build-pod.yaml", "Pod")
USERS_CONFIGMAP = one(USERS / "build-pod.yaml", "ConfigMap")
[USERS_CONTAINER] = containers(USERS_POD)
POD_IDS = 65536  # what the kubelet maps for a hostUsers: false pod


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("name", ["namespace.yaml", "build-pod.yaml"])
def test_users_documents_validate_strictly(name: str, version: str) -> None:
    for doc in docs(USERS / name):
        validate_strictly(doc, version, f"rootless-build-users/{name}:{doc['kind']}")


def test_users_kustomize_builds_it_into_its_own_baseline_namespace() -> None:
    kinds = sorted(doc["kind"] for doc in kustomize(USERS))
    assert kinds == ["ConfigMap", "Namespace", "Pod"]
    kustomization = yaml.safe_load((USERS / "kustomization.yaml").read_text())
    assert kustomization["resources"] == ["namespace.yaml", "build-pod.yaml"]
    name = USERS_NAMESPACE["metadata"]["name"]
    assert name != NAMESPACE["metadata"]["name"]
    assert {doc["metadata"]["namespace"] for doc in docs(USERS / "build-pod.yaml")} == {name}
    assert USERS_NAMESPACE["metadata"]["labels"] == NAMESPACE["metadata"]["labels"]


def test_users_example_uses_the_first_examples_image_and_profiles() -> None:
    assert USERS_CONTAINER["image"] == CONTAINER["image"]
    assert not (USERS / "Dockerfile").exists()
    context = USERS_CONTAINER["securityContext"]
    assert context["seccompProfile"] == CONTAINER["securityContext"]["seccompProfile"]
    assert context["appArmorProfile"] == CONTAINER["securityContext"]["appArmorProfile"]


def test_baseline_admits_the_users_pod_and_restricted_names_what_it_adds() -> None:
    assert baseline_violations(USERS_POD) == []
    assert restricted_violations(USERS_POD) == [
        "build: allowPrivilegeEscalation not false", "build: procMount", "build: adds SETGID",
        "build: adds SETUID"]


def test_users_pod_adds_setuid_setgid_and_privilege_escalation_and_nothing_else() -> None:
    assert pod_spec(USERS_POD)["hostUsers"] is False
    assert not host_paths(USERS_POD)
    context = USERS_CONTAINER["securityContext"]
    assert context["runAsUser"] == context["runAsGroup"] == 1000
    assert context["runAsNonRoot"] is True
    assert context["allowPrivilegeEscalation"] is True
    assert context["capabilities"] == {"drop": ["ALL"], "add": ["SETUID", "SETGID"]}
    assert "privileged" not in context
    assert "github.com/fuse" not in str(USERS_CONTAINER.get("resources"))
    # The profiles are the preset's, which needs no capability of its own.
    assert profiles.PRESETS[PRESET].capabilities == ()


def ranges(text: str) -> list[tuple[str, int, int]]:
    return [(owner, int(start), int(count)) for owner, start, count in
            (line.split(":") for line in text.splitlines())]


def test_subordinate_ids_are_the_pods_own_and_never_its_root() -> None:
    """newuidmap maps only what /etc/subuid and /etc/subgid say; every id there must be
    one of the pod's 65536, and the pod's root none of them."""
    data = USERS_CONFIGMAP["data"]
    uid = USERS_CONTAINER["securityContext"]["runAsUser"]
    assert data["subuid"] == data["subgid"]
    found = ranges(data["subuid"])
    assert {owner for owner, _, _ in found} == {str(uid)}
    ids = [i for _, start, count in found for i in range(start, start + count)]
    assert len(ids) == len(set(ids))
    assert 0 not in ids
    assert uid not in ids  # the build's root already
    assert max(ids) < POD_IDS
    # With uid 1000 as the build's root: the build's 0-65534, nobody (65534) included.
    assert len(ids) + 1 == POD_IDS - 1
    mounts = {m["mountPath"]: m for m in USERS_CONTAINER["volumeMounts"]}
    for key in ("subuid", "subgid"):
        assert mounts[f"/etc/{key}"]["subPath"] == key
        assert mounts[f"/etc/{key}"]["readOnly"] is True


def test_users_containerfile_makes_a_user_chowns_to_it_and_switches_to_it() -> None:
    containerfile = USERS_CONFIGMAP["data"]["Containerfile"]
    assert "chown -R app:app" in containerfile
    assert "COPY --chown=app:app" in containerfile
    assert "\nUSER app\n" in containerfile
    assert "ignore_chown_errors" not in USERS_CONFIGMAP["data"]["storage.conf"]
    script = USERS_CONFIGMAP["data"]["build.sh"]
    commands = re.findall(r"\b(?:buildah|podman) (?:build|run)\b[^\n]*", script)
    assert len(commands) == 4
    for command in commands:
        assert "--network host" in command, command
        assert "--cgroupns host" in command, command


def test_image_gives_newuidmap_and_newgidmap_one_file_capability_and_nothing_set_uid() -> None:
    """Debian's set-uid root newuidmap cannot open the build's uid_map in a pod whose root
    has no CAP_DAC_OVERRIDE; with a file capability it runs as the caller."""
    dockerfile = (HERE / "Dockerfile").read_text()
    assert "setcap cap_setuid=ep /usr/bin/newuidmap" in dockerfile
    assert "setcap cap_setgid=ep /usr/bin/newgidmap" in dockerfile
    assert "find / -xdev -type f -perm /6000 -exec chmod ug-s {} +" in dockerfile
    steps = dockerfile.replace("\\\n", " ")
    assert steps.index("chmod ug-s") < steps.index("setcap cap_setuid")
