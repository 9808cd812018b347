"""Logs bounded per tenant (issue 26).

A tenant sending refused requests as fast as it could made the broker write a line for
each: about 7,000 lines a second, 80-160 MB/s with long paths or options. Now a
container gets ``budget.BURST`` lines per kind of refusal per ``budget.INTERVAL``; past
that its refusals are counted and summed up in one line per kind when the interval
ends, every text field is cut to ``budget.FIELD_MAX`` bytes with a marker, and the
metrics count every refusal.

Here a tenant (containerd's default capabilities, the real RuntimeDefault rules) floods
the broker with requests whose path is 64 KiB (too large a message), 15 KiB (too long a
path) or whose options are 3,000 bytes, from three processes at once.
"""

from __future__ import annotations

import json
import re
import subprocess
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest

from fuse_plugin.api import api_pb2 as api
from fuse_plugin.broker import budget
from tests.lib import broker as broker_rig
from tests.lib import oci, profiles, waiting, workloads
from tests.lib.broker import ATTACKER_IN_CONTAINER, BrokerProcess
from tests.lib.probes import get
from tests.lib.servers import free_port

PER_SHAPE = 1000
SHAPES = {
    "message": ["op=mount", "path=/" + "m" * 65536, "fuse_fd=0"],
    "path": ["op=mount", "path=/" + "p" * 15000, "fuse_fd=0"],
    "option": ["op=mount", "path=/mnt/x", "options=" + "o" * 3000, "fuse_fd=0"],
}
LINE_MAX = 4096  # bytes: a line's text fields are each at most budget.FIELD_MAX


@pytest.fixture
def logged(broker_dir: Path, tmp_path: Path) -> Iterator[tuple[BrokerProcess, int]]:
    port = free_port()
    broker = BrokerProcess(broker_dir, tmp_path / "broker", broker_rig.shim(),
                           "--metrics-port", str(port), "--metrics-address", "127.0.0.1")
    broker.start()
    try:
        yield broker, port
    finally:
        broker.stop()


def refusals_counted(port: int) -> int:
    code, text = get(port, "/metrics")
    assert code == 200
    return sum(int(float(n)) for n in
               re.findall(r'^fuse_mount_broker_refusals_total\{kind="\w+"\} (\S+)$', text,
                          re.MULTILINE))


def test_a_flood_of_long_refused_requests_is_summed_up_not_logged_line_by_line(
        logged: tuple[BrokerProcess, int],
        broker_allocation: api.ContainerAllocateResponse) -> None:
    broker, port = logged
    request = oci.ContainerRequest(args=workloads.HOLD, allocation=broker_allocation,
                                   seccomp=profiles.runtime_default(),
                                   binds=[broker_rig.attacker_bind()])
    with oci.Runc() as runc:
        tenant = runc.create(oci.build_spec(request), "shouter").start()
        before = len(broker.log().splitlines())
        floods = [subprocess.Popen(
            tenant.runc.command("exec", tenant.id, "python3", ATTACKER_IN_CONTAINER, "ask",
                                "--repeat", str(PER_SHAPE), *fields),
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT) for fields in SHAPES.values()]
        outputs = [f.communicate(timeout=300)[0] for f in floods]
    assert [f.returncode for f in floods] == [0] * len(SHAPES), outputs
    for output in outputs:
        assert json.loads(output)["counts"] == {"error": PER_SHAPE}
    total = PER_SHAPE * len(SHAPES)
    assert refusals_counted(port) == total  # the metrics count every one

    def lines() -> list[str]:
        return broker.log().splitlines()[before:]

    def accounted() -> int:
        events = [json.loads(line) for line in lines()]
        return sum(int(e.get("suppressed", 1)) for e in events
                   if e.get("event") in ("broker.refused", "broker.refused_summary"))

    waiting.wait_for(lambda: accounted() >= total, budget.INTERVAL * 3,
                     "the summaries of the interval to account for every refusal",
                     detail=lambda: f"{accounted()} of {total}")
    assert accounted() == total
    events = [json.loads(line) for line in lines()]
    refused = Counter(e["kind"] for e in events if e.get("event") == "broker.refused")
    summaries = Counter(e["kind"] for e in events
                        if e.get("event") == "broker.refused_summary")
    assert set(refused) == {"request", "path", "option"}
    for kind, count in refused.items():
        # At most BURST lines in each interval, and each interval that went past its
        # budget ends in a summary.
        assert count <= budget.BURST * (summaries[kind] + 1), (kind, count, summaries)
        assert summaries[kind] >= 1
    assert len(events) < total / 10
    assert max(len(line.encode()) for line in lines()) < LINE_MAX
    assert any("more bytes]" in line for line in lines())
