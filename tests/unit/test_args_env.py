"""A flag's environment twin gives the same value as the flag: a plain ``str``. The DRA
driver's node name came from FUSE_DEVICE_PLUGIN_NODE_NAME as argparse's default wrapper,
a ``str`` subclass that msgspec refused to encode into the ResourceSlice ("Encoding objects
of type _FromEnv is unsupported"): the driver never published its device in a cluster."""

from __future__ import annotations

import argparse

import msgspec
import pytest

from fuse_plugin import args


def test_a_value_from_the_environment_is_a_plain_str(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(args.env_name("--node-name"), "node-a")
    parser = argparse.ArgumentParser()
    args.add(parser, "--node-name", lambda text: text, "", "the node")  # returns what it got
    value = parser.parse_args([]).node_name
    assert type(value) is str
    assert msgspec.json.encode({"nodeName": value}) == b'{"nodeName":"node-a"}'
