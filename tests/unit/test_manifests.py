"""The manifests: Kubernetes schemas (offline, kubernetes-validate), the invariants the
deploy issue promises, agreement with the CLI and the profile generator, and the lxcfs
example's script run for real in an unprivileged runc container where the machine can."""

from __future__ import annotations

import importlib.util
import os
import shutil
import uuid
from pathlib import Path
from types import ModuleType

import pytest
import yaml

from fuse_plugin import __version__, cli, profiles, sockets
from fuse_plugin.api import api_pb2 as api
from fuse_plugin.args import env_name
from fuse_plugin.config import DEFAULT_DEVICE_PLUGIN_DIR, DEFAULT_RESOURCE_NAME, Settings
from fuse_plugin.devices import Health, probe
from tests.lib import oci
from tests.lib.manifests import (
    EXAMPLES,
    MANIFESTS,
    ROOT,
    VERSIONS,
    Doc,
    containers,
    docs,
    host_paths,
    kustomize,
    named_docs,
    one,
    pod_spec,
    resource_files,
    validate_strictly,
)

SECCOMP_ROOT = "/var/lib/kubelet/seccomp"


def load_gen_manifests() -> ModuleType:
    spec = importlib.util.spec_from_file_location("gen_manifests",
                                                  ROOT / "scripts" / "gen_manifests.py")
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


PLUGIN = one(MANIFESTS / "plugin-daemonset.yaml", "DaemonSet")
INSTALLER = one(MANIFESTS / "profile-installer.yaml", "DaemonSet")


# -- schemas -------------------------------------------------------------------------

ALL_DOCS = named_docs(MANIFESTS, EXAMPLES)


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize(("name", "doc"), ALL_DOCS, ids=[n for n, _ in ALL_DOCS])
def test_every_manifest_validates_strictly(name: str, doc: Doc, version: str) -> None:
    validate_strictly(doc, version, name)


@pytest.mark.parametrize("directory", [MANIFESTS, EXAMPLES], ids=["manifests", "examples"])
def test_kustomization_lists_every_resource_file(directory: Path) -> None:
    kustomization = yaml.safe_load((directory / "kustomization.yaml").read_text())
    listed = kustomization["resources"]
    assert sorted(listed) == [p.name for p in resource_files(directory)]
    assert "examples" not in listed  # the examples are never applied by default


@pytest.mark.parametrize("directory", [MANIFESTS, EXAMPLES], ids=["manifests", "examples"])
def test_kustomize_builds_and_the_result_validates(directory: Path) -> None:
    objects = kustomize(directory)
    assert objects
    for doc in objects:
        for version in VERSIONS:
            validate_strictly(doc, version)
        if doc["kind"] != "Namespace":
            assert doc["metadata"]["namespace"] == (
                "fuse-device-plugin" if directory == MANIFESTS else "fuse-examples")
    if directory == MANIFESTS:
        images = {c["image"] for doc in objects if doc["kind"] == "DaemonSet"
                  for c in containers(doc)}
        assert images == {f"fuse-device-plugin:{__version__}"}


def test_namespaces_declare_their_pod_security_level() -> None:
    for path in (MANIFESTS / "namespace.yaml", EXAMPLES / "namespace.yaml"):
        labels = one(path, "Namespace")["metadata"]["labels"]
        assert labels["pod-security.kubernetes.io/enforce"] == "privileged"


# -- the plugin DaemonSet --------------------------------------------------------------

def test_plugin_is_not_privileged_and_has_no_capabilities() -> None:
    spec = pod_spec(PLUGIN)
    assert not spec.get("hostPID")
    assert not spec.get("hostNetwork")
    assert not spec.get("hostIPC")
    assert spec["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    assert spec["securityContext"]["runAsUser"] == 0  # owner of the device-plugin dir
    for container in containers(PLUGIN):
        context = container["securityContext"]
        assert context.get("privileged") is not True
        assert context["allowPrivilegeEscalation"] is False
        assert context["readOnlyRootFilesystem"] is True
        assert context["capabilities"] == {"drop": ["ALL"]}
        assert context["seccompProfile"] == {"type": "RuntimeDefault"}


def test_plugin_mounts_the_device_plugin_dir_and_dev_fuse_only() -> None:
    paths = host_paths(PLUGIN)
    assert paths == {
        str(DEFAULT_DEVICE_PLUGIN_DIR): {"path": str(DEFAULT_DEVICE_PLUGIN_DIR),
                                         "type": "Directory"},
        "/dev/fuse": {"path": "/dev/fuse", "type": "CharDevice"},
    }
    assert not any(p.rstrip("/") == "/dev" for p in paths)
    mounts = {m["mountPath"]: m for c in containers(PLUGIN) for m in c["volumeMounts"]}
    assert mounts["/dev/fuse"]["readOnly"] is True
    assert "mountPropagation" not in mounts[str(DEFAULT_DEVICE_PLUGIN_DIR)]


def test_plugin_has_requests_limits_probes_priority_and_tolerations() -> None:
    spec = pod_spec(PLUGIN)
    assert spec["priorityClassName"] == "system-node-critical"
    assert {"operator": "Exists"} in spec["tolerations"]
    (container,) = spec["containers"]
    resources = container["resources"]
    assert set(resources["requests"]) == {"cpu", "memory"}
    # The Go plugins' users are OOM-killed at 15-20 MiB; ours measures 37-39 MiB as
    # deployed (python -m bench), 117 MiB at 100,000 slots: room above both.
    request = _mebibytes(resources["requests"]["memory"])
    assert request >= 40
    assert _mebibytes(resources["limits"]["memory"]) >= 3 * request
    port = next(p["containerPort"] for p in container["ports"] if p["name"] == "metrics")
    assert container["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "metrics"}
    assert container["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "metrics"}
    args = cli.build_parser(container["args"]).parse_args(container["args"])
    assert args.command == "serve"
    assert args.metrics_port == port


def test_plugin_rolls_out_new_pod_first_on_a_socket_of_its_own() -> None:
    """Issue 35: the kubelet keeps one endpoint per socket and marks the slots unhealthy
    only when the last goes, so the new pod must register, on its own socket, before
    the old one stops: surge, an instance per pod, and a hand-off that fits the grace."""
    spec = pod_spec(PLUGIN)
    (container,) = spec["containers"]
    strategy = PLUGIN["spec"]["updateStrategy"]
    assert strategy == {"type": "RollingUpdate",
                        "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}}
    env = {e["name"]: e for e in container["env"]}
    assert env[env_name("--instance")]["valueFrom"] == {
        "fieldRef": {"fieldPath": "metadata.uid"}}
    args = cli.build_parser(container["args"]).parse_args(container["args"])
    assert args.handoff_wait > 0
    # The hand-off and the gRPC server's grace both end before the kubelet's SIGKILL.
    assert spec["terminationGracePeriodSeconds"] >= args.handoff_wait + 5
    # A surge pod on the same node must not fight the old one for a host port.
    assert not spec.get("hostNetwork")
    assert all("hostPort" not in p for p in container["ports"])
    # A pod UID is 36 characters: the socket still fits sockaddr_un.
    settings = Settings(instance=str(uuid.UUID(int=0)))
    assert sockets.too_long(settings.socket_path) is None


def test_plugin_args_keep_the_defaults_the_manifest_relies_on() -> None:
    (container,) = pod_spec(PLUGIN)["containers"]
    args = cli.build_parser(container["args"]).parse_args(container["args"])
    assert args.device_plugin_dir == DEFAULT_DEVICE_PLUGIN_DIR
    assert str(args.fuse_device) == "/dev/fuse"
    assert args.resource_name == DEFAULT_RESOURCE_NAME


def _mebibytes(quantity: str) -> int:
    assert quantity.endswith("Mi"), quantity
    return int(quantity[:-2])


# -- the network policy ------------------------------------------------------------------

POLICY = one(MANIFESTS / "network-policy.yaml", "NetworkPolicy")
BROKER = one(MANIFESTS / "broker" / "broker-daemonset.yaml", "DaemonSet")
READER = "fuse-device-plugin.github.com/metrics-reader"
NAMESPACE = "fuse-device-plugin"


def selects(selector: Doc, labels: dict[str, str]) -> bool:
    """A Kubernetes label selector (matchLabels and matchExpressions) applied to labels."""
    if any(labels.get(key) != value for key, value in selector.get("matchLabels", {}).items()):
        return False
    for expression in selector.get("matchExpressions", []):
        key, operator = expression["key"], expression["operator"]
        values = expression.get("values", [])
        held = {"In": key in labels and labels[key] in values,
                "NotIn": key not in labels or labels[key] not in values,
                "Exists": key in labels, "DoesNotExist": key not in labels}[operator]
        if not held:
            return False
    return True


def admits(namespace: str, namespace_labels: dict[str, str], pod_labels: dict[str, str],
           port: int) -> bool:
    """Whether the policy lets a pod (its namespace and labels) in on ``port``: what a
    network plugin enforces, for the peer kinds the policy may use."""
    for rule in POLICY["spec"].get("ingress", []):
        if port not in {p["port"] for p in rule.get("ports", [])}:
            continue
        for peer in rule.get("from", []):
            assert "ipBlock" not in peer, "an address range admits whatever hides behind it"
            assert peer, "an empty peer admits every pod"
            if "namespaceSelector" in peer:
                if not selects(peer["namespaceSelector"], namespace_labels):
                    continue
            elif namespace != NAMESPACE:
                continue
            if "podSelector" in peer and not selects(peer["podSelector"], pod_labels):
                continue
            return True
    return False


def metrics_port(daemonset: Doc) -> int:
    (container,) = pod_spec(daemonset)["containers"]
    return int(next(p["containerPort"] for p in container["ports"] if p["name"] == "metrics"))


def test_network_policy_selects_our_pods_and_denies_other_ingress() -> None:
    spec = POLICY["spec"]
    assert spec["policyTypes"] == ["Ingress"]
    selector = spec["podSelector"]
    for daemonset in (PLUGIN, BROKER, INSTALLER):
        assert selects(selector, daemonset["spec"]["template"]["metadata"]["labels"])
    assert not selects(selector, {"app.kubernetes.io/name": "something-else"})
    assert not selects(selector, {})
    # One rule, on the plugin's and the broker's metrics ports only, over TCP.
    (rule,) = spec["ingress"]
    assert {(p["protocol"], p["port"]) for p in rule["ports"]} == {
        ("TCP", metrics_port(PLUGIN)), ("TCP", metrics_port(BROKER))}


@pytest.mark.parametrize(("namespace", "namespace_labels", "pod_labels", "admitted"), [
    ("monitoring", {READER: "true"}, {}, True),  # a labelled namespace: all its pods
    ("monitoring", {}, {READER: "true"}, True),  # a labelled pod, in any namespace
    (NAMESPACE, {}, {READER: "true"}, True),
    ("monitoring", {}, {"app": "prometheus"}, False),  # unlabelled: refused
    ("tenant", {READER: "false"}, {READER: "yes"}, False),  # "true" only
    (NAMESPACE, {}, {"app.kubernetes.io/name": "fuse-device-plugin"}, False),
])
def test_network_policy_admits_metrics_readers_only(
        namespace: str, namespace_labels: dict[str, str], pod_labels: dict[str, str],
        admitted: bool) -> None:
    for port in (metrics_port(PLUGIN), metrics_port(BROKER)):
        assert admits(namespace, namespace_labels, pod_labels, port) is admitted
    assert not admits("monitoring", {READER: "true"}, {READER: "true"}, 22)


def test_readme_says_how_to_let_prometheus_in() -> None:
    readme = (ROOT / "README.md").read_text()
    assert f"{READER}=true" in readme
    assert "network-policy.yaml" in readme


# -- the profile installer --------------------------------------------------------------

def test_installer_has_only_what_loading_apparmor_needs() -> None:
    spec = pod_spec(INSTALLER)
    assert not spec.get("hostPID")
    assert not spec.get("hostNetwork")
    assert not spec.get("hostIPC")
    assert spec["priorityClassName"] == "system-node-critical"
    assert {"operator": "Exists"} in spec["tolerations"]
    (container,) = spec["containers"]
    context = container["securityContext"]
    assert context.get("privileged") is not True
    assert context["allowPrivilegeEscalation"] is False
    assert context["readOnlyRootFilesystem"] is True
    assert context["capabilities"] == {"drop": ["ALL"], "add": ["MAC_ADMIN"]}
    assert context["appArmorProfile"] == {"type": "Unconfined"}
    assert context["seccompProfile"] == {"type": "RuntimeDefault"}
    assert "memory" in container["resources"]["limits"]
    seccomp_dir = f"{SECCOMP_ROOT}/{profiles.SECCOMP_SUBDIR}"
    assert set(host_paths(INSTALLER)) == {"/sys/kernel/security", "/etc/apparmor.d",
                                          seccomp_dir}


def test_installer_args_and_volumes_match_the_cli_and_the_configmap() -> None:
    (container,) = pod_spec(INSTALLER)["containers"]
    args = cli.build_parser(container["args"]).parse_args(container["args"])
    assert args.command == "install-profiles"
    mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    volumes = {v["name"]: v for v in pod_spec(INSTALLER)["volumes"]}
    source = next(name for name, v in volumes.items() if "configMap" in v)
    assert str(args.source) == mounts[source]
    assert volumes[source]["configMap"]["name"] == load_gen_manifests().CONFIGMAP_NAME
    for flag, path in (("apparmor_dir", "/etc/apparmor.d"),
                       ("seccomp_dir", f"{SECCOMP_ROOT}/{profiles.SECCOMP_SUBDIR}")):
        assert str(getattr(args, flag)) == path
        assert path in mounts.values()


def test_committed_profiles_configmap_is_what_the_generator_makes() -> None:
    gen = load_gen_manifests()
    committed = (MANIFESTS / "profiles-configmap.yaml").read_text()
    assert committed == gen.render_configmap(), (
        "manifests/profiles-configmap.yaml is stale: run "
        ".venv/bin/python scripts/gen_manifests.py")
    data = one(MANIFESTS / "profiles-configmap.yaml", "ConfigMap")["data"]
    assert data == gen.profile_files()  # the YAML round-trips to the exact file texts
    assert set(data) == {name for preset in profiles.PRESETS for name in
                         (profiles.apparmor_name(preset), profiles.seccomp_file(preset))}


# -- the examples ------------------------------------------------------------------------

EXAMPLE_FILES = [p for p in resource_files(EXAMPLES) if p.name != "namespace.yaml"]


def workloads(path: Path) -> list[Doc]:
    return [doc for doc in docs(path) if doc["kind"] in ("Pod", "DaemonSet", "Deployment")]


def preset_of(container: Doc) -> str:
    """The preset both Localhost profiles name; they must agree."""
    context = container["securityContext"]
    seccomp = context["seccompProfile"]
    apparmor = context["appArmorProfile"]
    assert seccomp["type"] == apparmor["type"] == "Localhost"
    prefix = f"{profiles.SECCOMP_SUBDIR}/"
    assert seccomp["localhostProfile"].startswith(prefix)
    preset = str(seccomp["localhostProfile"])[len(prefix):].removesuffix(".json")
    assert preset in profiles.PRESETS
    return preset


@pytest.mark.parametrize("path", EXAMPLE_FILES, ids=lambda p: p.name)
def test_example_profiles_are_the_generated_ones(path: Path) -> None:
    from fuse_plugin.profiles.apparmor import profile_name_of

    for doc in workloads(path):
        for container in containers(doc):
            preset = preset_of(container)
            context = container["securityContext"]
            name = context["appArmorProfile"]["localhostProfile"]
            assert name == profiles.apparmor_name(preset)
            assert profile_name_of(profiles.render_apparmor(preset)) == name
            assert context["seccompProfile"]["localhostProfile"] == \
                profiles.seccomp_localhost_profile(preset)


@pytest.mark.parametrize("path", EXAMPLE_FILES, ids=lambda p: p.name)
def test_example_asks_for_the_device_and_only_its_presets_capabilities(path: Path) -> None:
    text = path.read_text()
    assert "Pod Security" in text
    assert "`privileged` level" in text
    for doc in workloads(path):
        assert not host_paths(doc), "examples need no hostPath"
        for container in containers(doc):
            assert container["resources"]["limits"][DEFAULT_RESOURCE_NAME] == 1
            context = container["securityContext"]
            assert context.get("privileged") is not True
            preset = profiles.PRESETS[preset_of(container)]
            assert context["capabilities"] == {"drop": ["ALL"],
                                               "add": list(preset.capabilities)}
            if "SYS_ADMIN" in preset.capabilities:
                # The API server refuses allowPrivilegeEscalation: false with SYS_ADMIN.
                assert context.get("allowPrivilegeEscalation") is not False
            for mount in container.get("volumeMounts", []):
                assert mount.get("mountPropagation") != "Bidirectional"


def test_examples_cover_s3fs_sshfs_and_an_lxcfs_daemonset() -> None:
    found = {(doc["kind"], preset_of(c)) for path in EXAMPLE_FILES
             for doc in workloads(path) for c in containers(doc)}
    assert found >= {("Pod", "s3fs"), ("Pod", "sshfs"), ("DaemonSet", "lxcfs")}


def test_lxcfs_example_binds_what_the_lxcfs_profile_allows() -> None:
    """Step 2's files are the preset's proc_binds: one more would fail on AppArmor nodes."""
    daemonset = one(EXAMPLES / "lxcfs-daemonset.yaml", "DaemonSet")
    (container,) = containers(daemonset)
    script = container["command"][2]
    loops = [line.split(" in ", 1)[1].split(";")[0].split() for line in script.splitlines()
             if line.strip().startswith("for f in ")]
    assert loops == [list(profiles.PRESETS["lxcfs"].proc_binds)]
    assert 'mount --bind "/var/lib/lxcfs/proc/$f" "/proc/$f"' in script


# -- the lxcfs example, for real -----------------------------------------------------------

def lxcfs_blockers() -> list[str]:
    blockers = []
    if os.geteuid() != 0:
        blockers.append("needs root (runc)")
    if probe(Path("/dev/fuse")).health is not Health.HEALTHY:
        blockers.append("no /dev/fuse")
    blockers += [f"{tool} is not installed" for tool in ("runc", "lxcfs", "bash", "unshare")
                 if shutil.which(tool) is None]
    return blockers


@pytest.mark.slow
def test_lxcfs_example_script_serves_its_own_container_unprivileged() -> None:
    blockers = lxcfs_blockers()
    if blockers:
        pytest.skip("cannot run the lxcfs example here: " + "; ".join(blockers))
    daemonset = one(EXAMPLES / "lxcfs-daemonset.yaml", "DaemonSet")
    (container,) = containers(daemonset)
    preset = preset_of(container)
    empty_dirs = {v["name"] for v in pod_spec(daemonset)["volumes"] if "emptyDir" in v}
    workload = ("/bin/sh", "-c", "grep ' /proc/meminfo ' /proc/self/mountinfo; "
                                 "cut -d' ' -f1 /proc/uptime")
    run = oci.Container(
        args=(*container["command"], *workload),
        devices=(api.DeviceSpec(container_path="/dev/fuse", host_path="/dev/fuse",
                                permissions="rw"),),
        seccomp=oci.seccomp_profile(preset),
        capabilities=tuple(f"CAP_{cap}" for cap in container["securityContext"][
            "capabilities"]["add"]),
        tmpfs=tuple(m["mountPath"] for m in container["volumeMounts"]
                    if m["name"] in empty_dirs),
    )
    proc = oci.run_container(run, timeout=90)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = proc.stdout.strip().splitlines()
    assert "fuse.lxcfs" in lines[0]  # the workload's /proc/meminfo is served by lxcfs
    host_uptime = float(Path("/proc/uptime").read_text().split()[0])
    assert float(lines[-1]) < min(30.0, host_uptime)  # lxcfs: the container's own uptime
