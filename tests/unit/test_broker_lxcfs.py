"""LXCFS views without containers: the files and the mount point are one list in Python
(``broker/lxcfs.py``) and in C (``native/lxcfs.c``), the shim's ``later`` field is the
broker's, and the request takes no field a caller could aim with."""

from __future__ import annotations

import re

import pytest

from fuse_plugin.broker import lxcfs, policy, protocol
from tests.lib import broker as broker_rig

TOOL_SOURCE = broker_rig.NATIVE / "lxcfs.c"


def test_the_tool_binds_exactly_the_listed_files() -> None:
    source = TOOL_SOURCE.read_text()
    targets = re.findall(r'^\t\{ "([^"]+)", "([^"]+)", "[^"]+", "[^"]+" \},$', source,
                         re.MULTILINE)
    assert tuple(f"{d}/{n}" for d, n in targets) == lxcfs.FILES
    assert re.search(rf'^#define LXCFS_DIR "{lxcfs.MOUNTPOINT}"$', source, re.MULTILINE)


def test_the_shim_reads_the_later_field() -> None:
    source = broker_rig.SHIM_SOURCE.read_text()
    assert f'#define LATER_FIELD "{lxcfs.LATER_FIELD}"' in source


def test_a_request_is_v_and_op_only() -> None:
    assert lxcfs.asks(protocol.encode(v=protocol.VERSION, op=lxcfs.OP))
    assert not lxcfs.asks(protocol.encode(v=protocol.VERSION, op="mount", path="/x"))
    assert not lxcfs.asks(b"not a message")
    lxcfs.check_request(protocol.encode(v=protocol.VERSION, op=lxcfs.OP))


@pytest.mark.parametrize(("fields", "words"), [
    ({"v": protocol.VERSION, "op": lxcfs.OP, "path": "/etc"}, "no field but v and op"),
    ({"v": protocol.VERSION, "op": lxcfs.OP, "fuse_fd": "3"}, "no field but v and op"),
    ({"v": "1", "op": lxcfs.OP}, "different releases"),
    ({"op": lxcfs.OP}, "different releases"),
])
def test_a_request_with_more_is_refused(fields: dict[str, str], words: str) -> None:
    with pytest.raises(policy.Refused, match=words) as refused:
        lxcfs.check_request(protocol.encode(**fields))
    assert refused.value.kind == "request"
