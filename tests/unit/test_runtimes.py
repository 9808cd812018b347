"""tests/lib/runtimes.py: the one variable that picks the runtime, the tenant's default
capabilities on each runtime (CRI-O's read against CRI-O's own source when the stack's
Go module cache has it), and CRI-O's change to the RuntimeDefault seccomp rules, applied
to containers-common's file and resolved as libseccomp would."""

from __future__ import annotations

import json
import re

import pytest

from fuse_plugin.demo.container import ContainerRequest
from tests.lib import oci, runtimes
from tests.lib import runtime_default as converter

HOST = converter.Host("amd64", "SCMP_ARCH_X86_64", (6, 18))


def test_unset_means_containerd_and_a_wrong_name_is_refused_by_name(
    monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(runtimes.VARIABLE, raising=False)
    assert runtimes.name() == "containerd"
    assert runtimes.default_capabilities() == oci.DEFAULT_CAPABILITIES
    monkeypatch.setenv(runtimes.VARIABLE, "cri-o")
    with pytest.raises(runtimes.RuntimeChoiceError, match=r"FUSE_E2E_RUNTIME='cri-o'.*crio"):
        runtimes.name()


def test_crio_defaults_lack_sys_chroot_and_are_within_containerds() -> None:
    """oci.build_spec narrows containerd's set to CRI-O's: that needs a subset."""
    assert "CAP_SYS_CHROOT" not in runtimes.CRIO_CAPABILITIES
    assert set(runtimes.CRIO_CAPABILITIES) < set(oci.DEFAULT_CAPABILITIES)


def test_crio_defaults_are_what_crio_source_says() -> None:
    """The list is CRI-O's ``capabilities.Default()`` at the pinned version, read from
    the module source tests/stack/build.sh downloaded."""
    cache = runtimes.stack_gomodcache()
    src = (cache / f"{runtimes.CRIO_MODULE}@{runtimes.crio_version()}" / "internal"
           / "config" / "capabilities" / "capabilities_linux.go")
    if not src.is_file():
        pytest.skip(f"{src} absent: FUSE_E2E_RUNTIME=crio tests/stack/build.sh fetches it")
    body = src.read_text().split("func Default() Capabilities {", 1)[1].split("}", 1)[0]
    assert tuple(f"CAP_{c}" for c in re.findall(r'"([A-Z_]+)"', body)) == \
        runtimes.CRIO_CAPABILITIES


def test_the_tenant_container_on_crio_has_crios_set_plus_its_own_additions(
    monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(runtimes.VARIABLE, "crio")
    plain = oci.build_spec(oci.ContainerRequest(args=("true",)))
    admin = oci.build_spec(oci.ContainerRequest(args=("true",),
                                                add_capabilities=("CAP_SYS_ADMIN",)))
    assert plain["process"]["capabilities"]["bounding"] == list(runtimes.CRIO_CAPABILITIES)
    assert admin["process"]["capabilities"]["bounding"] == [
        *runtimes.CRIO_CAPABILITIES, "CAP_SYS_ADMIN"]
    # The demo's own container (not the tests' request) stays containerd's.
    demo = oci.build_spec(ContainerRequest(args=("true",)))
    assert "CAP_SYS_CHROOT" in demo["process"]["capabilities"]["bounding"]


def crio_profile(capabilities: tuple[str, ...]) -> dict[str, object]:
    source = runtimes.with_namespace_rules(converter.read_source())
    return converter.resolve(converter.convert(source, capabilities, HOST))


def test_crio_refuses_namespace_calls_without_sys_admin_and_allows_them_with_it() -> None:
    """CRI-O's change: unshare and clone3 fall to the refusals without CAP_SYS_ADMIN
    (containers-common's file alone allows them to everyone), clone stays conditional on
    its flags; with CAP_SYS_ADMIN all three are allowed."""
    plain = crio_profile(runtimes.CRIO_CAPABILITIES)
    admin = crio_profile((*runtimes.CRIO_CAPABILITIES, "CAP_SYS_ADMIN"))
    common = converter.resolve(converter.convert(
        converter.read_source(), runtimes.CRIO_CAPABILITIES, HOST))
    assert converter.outcome(common, "unshare") == ("SCMP_ACT_ALLOW", None)
    assert converter.outcome(plain, "unshare")[0] == "SCMP_ACT_ERRNO"
    assert converter.outcome(plain, "clone3") == ("SCMP_ACT_ERRNO", 38)
    assert converter.outcome(plain, "clone") == ("conditional", None)
    for call in runtimes.NAMESPACE_CALLS:
        assert converter.outcome(admin, call) == ("SCMP_ACT_ALLOW", None), call
    assert json.dumps(plain) != json.dumps(common)
