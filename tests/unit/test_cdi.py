"""The CDI spec: valid against the CDI schema, named as Allocate names it, written atomically
and removed cleanly."""

from __future__ import annotations

import json
import os
from pathlib import Path

import jsonschema  # type: ignore[import-untyped]
import pytest

from fuse_plugin import cdi

SCHEMA = json.loads((Path(__file__).parent / "data" / "cdi-spec.schema.json").read_text())
VALIDATOR = jsonschema.Draft7Validator(SCHEMA)


def errors(document: object) -> list[str]:
    return [error.message for error in VALIDATOR.iter_errors(document)]


def minimum_version(spec: dict[str, object]) -> str:
    """The oldest CDI version with every feature the spec uses (from the spec's changelog)."""
    devices = spec["devices"]
    assert isinstance(devices, list)
    kind = spec["kind"]
    assert isinstance(kind, str)
    if spec.get("annotations") or any(d.get("annotations") for d in devices) \
            or "." in kind.partition("/")[2]:
        return "0.6.0"
    nodes = [n for d in devices for n in d["containerEdits"].get("deviceNodes", [])]
    if any("hostPath" in n for n in nodes) or any(not d["name"][0].isalpha() for d in devices):
        return "0.5.0"
    return "0.3.0"


def test_schema_fixture_is_a_valid_draft7_schema() -> None:
    jsonschema.Draft7Validator.check_schema(SCHEMA)


def test_spec_validates_and_describes_the_fuse_node() -> None:
    spec = cdi.build_spec(Path("/dev/fuse"), "github.com/fuse")
    assert errors(spec) == []
    assert spec["kind"] == "github.com/fuse"
    (device,) = spec["devices"]
    assert device["name"] == "fuse"
    assert device["containerEdits"] == {"deviceNodes": [{
        "path": "/dev/fuse", "hostPath": "/dev/fuse", "type": "c", "major": 10, "minor": 229,
        "permissions": "rw"}]}


def test_spec_declares_the_oldest_version_that_has_its_features() -> None:
    plain = cdi.build_spec(Path("/dev/fuse"), "github.com/fuse")
    assert plain["cdiVersion"] == minimum_version(plain) == "0.5.0"
    dotted = cdi.build_spec(Path("/dev/fuse"), "example.com/fuse.v2")
    assert dotted["cdiVersion"] == minimum_version(dotted) == "0.6.0"
    assert errors(dotted) == []


def test_host_path_follows_the_configured_device() -> None:
    spec = cdi.build_spec(Path("/run/fuse-alt/fuse"), "example.com/fuse")
    node = spec["devices"][0]["containerEdits"]["deviceNodes"][0]
    assert (node["path"], node["hostPath"]) == ("/dev/fuse", "/run/fuse-alt/fuse")
    assert errors(spec) == []


@pytest.mark.parametrize(("change", "complaint"), [
    (lambda s: s.pop("kind"), "'kind' is a required property"),
    (lambda s: s.update(kind="fuse"), "does not match"),
    (lambda s: s.update(kind="github.com/fuse/x"), "does not match"),
    (lambda s: s["devices"][0].update(name="-fuse"), "does not match"),
    (lambda s: s.update(devices=[]), "should be non-empty"),
    (lambda s: s["devices"][0]["containerEdits"]["deviceNodes"][0].update(permissions="rwx"),
     "does not match"),
    (lambda s: s["devices"][0]["containerEdits"]["deviceNodes"][0].update(path="dev/fuse"),
     "does not match"),
    (lambda s: s.update(cdiVersion="0.9"), "is not one of"),
    (lambda s: s.update(extra=1), "Additional properties"),
])
def test_schema_has_teeth(change: object, complaint: str) -> None:
    spec = cdi.build_spec(Path("/dev/fuse"), "github.com/fuse")
    assert callable(change)
    change(spec)
    assert any(complaint in message for message in errors(spec)), errors(spec)


def test_device_name_is_what_allocate_returns() -> None:
    assert cdi.cdi_device_name() == "github.com/fuse=fuse"
    assert cdi.cdi_device_name("example.com/fuse") == "example.com/fuse=fuse"
    spec = cdi.build_spec(Path("/dev/fuse"), "example.com/fuse")
    assert cdi.cdi_device_name("example.com/fuse") == f"{spec['kind']}={spec['devices'][0]['name']}"


@pytest.mark.parametrize("resource", ["1example.com/fuse", "example.com/9p", "example.com/fuse-",
                                      "nodomain"])
def test_resource_names_cdi_refuses_are_refused_early(resource: str, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="not a CDI kind"):
        cdi.cdi_device_name(resource)
    with pytest.raises(ValueError, match="not a CDI kind"):
        cdi.write_spec(tmp_path, Path("/dev/fuse"), resource)
    assert list(tmp_path.iterdir()) == []


def test_write_is_complete_and_leaves_no_temp_file(tmp_path: Path) -> None:
    directory = tmp_path / "run" / "cdi"
    path = cdi.write_spec(directory, Path("/dev/fuse"), "github.com/fuse")
    assert path == directory / "github.com-fuse.json"
    assert sorted(os.listdir(directory)) == ["github.com-fuse.json"]
    assert json.loads(path.read_text()) == cdi.build_spec(Path("/dev/fuse"), "github.com/fuse")
    assert path.stat().st_mode & 0o777 == 0o644


def test_rewrite_replaces_the_file_in_one_step(tmp_path: Path) -> None:
    first = cdi.write_spec(tmp_path, Path("/dev/fuse"), "github.com/fuse")
    inode = first.stat().st_ino
    second = cdi.write_spec(tmp_path, Path("/run/other/fuse"), "github.com/fuse")
    assert second == first
    assert second.stat().st_ino != inode  # a new file renamed over, never rewritten in place
    spec = json.loads(second.read_text())
    assert spec["devices"][0]["containerEdits"]["deviceNodes"][0]["hostPath"] == "/run/other/fuse"
    assert os.listdir(tmp_path) == ["github.com-fuse.json"]


def test_failed_write_keeps_the_old_spec_and_no_temp_file(tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    path = cdi.write_spec(tmp_path, Path("/dev/fuse"), "github.com/fuse")
    before = path.read_text()

    def broken_fsync(fd: int) -> None:
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(os, "fsync", broken_fsync)
    with pytest.raises(OSError, match="Input/output error"):
        cdi.write_spec(tmp_path, Path("/run/other/fuse"), "github.com/fuse")
    assert path.read_text() == before
    assert os.listdir(tmp_path) == ["github.com-fuse.json"]


def test_temp_name_is_not_one_a_runtime_would_load(tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[str] = []
    real_replace = os.replace

    def spy(src: str, dst: str) -> None:
        seen.append(os.path.basename(src))
        real_replace(src, dst)

    monkeypatch.setattr(os, "replace", spy)
    cdi.write_spec(tmp_path, Path("/dev/fuse"), "github.com/fuse")
    (temp,) = seen
    assert temp.startswith(".")
    assert not temp.endswith((".json", ".yaml"))


def test_remove_spec(tmp_path: Path) -> None:
    path = cdi.write_spec(tmp_path, Path("/dev/fuse"), "github.com/fuse")
    cdi.remove_spec(path)
    assert not path.exists()
    cdi.remove_spec(path)  # twice is fine: shutdown may race a restart
    cdi.remove_spec(tmp_path / "gone" / "github.com-fuse.json")
