"""Shares that hold on a full node (issue 34, fuse_plugin/broker/shares.py): each
node-wide cap is a pod's share times --max-pods, so on a node of at most --max-pods pods
a pod within its own share is never refused by a node-wide cap, whatever the others do.

First the caps and their sizes, then the count of open requests (the rule itself, at
the default --max-pods and at the edge of a smaller one), then the loop: a request's
place among the open requests is given back however the request ends, and the broker
says at start where its settings give the guarantee up. The attack in real containers
is tests/containers/test_broker_full_node.py; which containers are one pod,
tests/unit/test_broker_shares.py."""

from __future__ import annotations

import argparse
import logging
import os
import resource
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from fuse_plugin.broker import policy, protocol, requests, server, shares
from fuse_plugin.broker.server import Broker
from fuse_plugin.broker.settings import BrokerSettings, add_flags
from fuse_plugin.broker.shares import NodeCaps, OpenRequests

CONTAINERS = shares.PER_POD // shares.PER_CONTAINER  # a pod's share needs this many


def pod(n: int) -> str:
    """A pod cgroup as the kubelet names one (cgroupfs)."""
    return f"/kubepods/besteffort/pod{n:08x}-0000-4000-8000-000000000000"


def containers(n: int) -> list[str]:
    """The containers of pod ``n`` that hold its share together."""
    return [f"{pod(n)}/c{i}" for i in range(CONTAINERS)]


def fill(requests: OpenRequests, pods: range) -> None:
    """Every container of these pods at its share: each pod at its own."""
    for n in pods:
        for container in containers(n):
            for _ in range(shares.PER_CONTAINER):
                requests.admit(container)


# -- the caps ------------------------------------------------------------------------------


def test_each_node_cap_is_a_pods_share_times_max_pods() -> None:
    caps = BrokerSettings().caps
    assert (caps.max_pods, caps.requests, caps.helpers, caps.mounts) == (110, 1760, 220, 7040)
    assert caps.short == []
    wide = NodeCaps.for_pods(250, mounts_pod=8)
    assert (wide.requests, wide.helpers, wide.mounts) == (4000, 500, 2000)


def test_a_node_mount_cap_below_the_product_is_said_to_give_the_guarantee_up() -> None:
    assert NodeCaps.for_pods(110, 64, mounts=7040).short == []
    [reason] = NodeCaps.for_pods(110, 64, mounts=1000).short
    assert reason == ("--max-mounts-node 1000 is less than --max-mounts-pod 64 x --max-pods "
                      "110 = 7040: 15 pods at their share fill it")


def test_the_descriptors_needed_follow_the_caps() -> None:
    caps = NodeCaps.for_pods(110, 64)
    assert caps.descriptors == 4 * 1760 + 2 * 220 + shares.FDS_BESIDE
    assert caps.pods_within(caps.descriptors) == 110
    assert caps.pods_within(1024) == 13
    assert caps.pods_within(10) == 0


def parse(*argv: str) -> BrokerSettings:
    parser = argparse.ArgumentParser()
    add_flags(parser)
    args = parser.parse_args(argv)
    return BrokerSettings(max_mounts_node=args.max_mounts_node,
                          max_mounts_pod=args.max_mounts_pod, max_pods=args.max_pods)


def test_the_flags_set_the_caps() -> None:
    assert parse().caps == BrokerSettings().caps
    caps = parse("--max-pods", "250", "--max-mounts-pod", "8").caps
    assert (caps.requests, caps.helpers, caps.mounts) == (4000, 500, 2000)
    assert parse("--max-mounts-node", "500").caps.mounts == 500


@pytest.mark.parametrize("value", ["0", "10001", "-1", "1e3", "\u0661\u0662"])
def test_a_bad_max_pods_is_a_usage_error(value: str, capsys: pytest.CaptureFixture[str]
                                         ) -> None:
    with pytest.raises(SystemExit) as exited:
        parse("--max-pods", value)
    assert exited.value.code == 2
    assert "--max-pods: must be a whole number from 1 to 10000" in capsys.readouterr().err


# -- the rule on open requests ---------------------------------------------------------------


def test_a_neighbour_gets_its_whole_share_on_a_node_full_of_pods_at_theirs() -> None:
    """The node at the default --max-pods: 109 pods hold 16 each, and the 110th pod's
    containers get all of theirs; only their own shares refuse them."""
    caps = BrokerSettings().caps
    requests = OpenRequests(caps)
    fill(requests, range(caps.max_pods - 1))
    fill(requests, range(caps.max_pods - 1, caps.max_pods))
    assert len(requests) == caps.requests
    neighbour = containers(caps.max_pods - 1)
    with pytest.raises(policy.Refused, match="this container has 4 requests open"):
        requests.admit(neighbour[0])
    with pytest.raises(policy.Refused, match="this pod has 16 requests open"):
        requests.admit(f"{pod(caps.max_pods - 1)}/one-more")


@pytest.mark.parametrize("max_pods", [1, 2, 7])
def test_only_a_pod_past_max_pods_meets_the_nodes_cap(max_pods: int) -> None:
    requests = OpenRequests(NodeCaps.for_pods(max_pods, 64))
    fill(requests, range(max_pods))
    with pytest.raises(policy.Refused) as refused:
        requests.admit(containers(max_pods)[0])
    assert str(refused.value) == (f"the broker is busy ({16 * max_pods} requests open, 16 "
                                  f"for each of --max-pods {max_pods} pods); try again")
    assert refused.value.kind == "busy"


def test_pods_coming_and_going_never_refuse_one_within_its_share() -> None:
    """Nine pods take and give back places in a shifting order, never more than
    --max-pods (5) at once: each tops its share up again after giving some back, and a
    new pod comes when the oldest has left whole. Every admission succeeds."""
    caps = NodeCaps.for_pods(5, 64)
    requests = OpenRequests(caps)
    held: dict[int, list[shares.Ticket]] = {}
    for step in range(300):
        n = step * 7 % 9
        if n not in held and len(held) == caps.max_pods:
            for ticket in held.pop(min(held)):
                requests.release(ticket)
        mine = held.setdefault(n, [])
        for ticket in mine[: step % 5]:
            requests.release(ticket)
        del mine[: step % 5]
        have = {c: sum(1 for t in mine if t.container == c) for c in containers(n)}
        mine += [requests.admit(c) for c, count in have.items()
                 for _ in range(shares.PER_CONTAINER - count)]
        assert len(mine) == shares.PER_POD
    assert len(requests) == shares.PER_POD * len(held)


def test_a_place_is_given_back_once() -> None:
    requests = OpenRequests(NodeCaps.for_pods(1, 64))
    first = requests.admit("/lone")
    for _ in range(shares.PER_CONTAINER - 1):
        requests.admit("/lone")
    requests.release(first)
    requests.release(first)
    requests.release(None)
    requests.admit("/lone")
    with pytest.raises(policy.Refused, match="this container has 4"):
        requests.admit("/lone")


def test_a_container_outside_any_pod_is_a_pod_of_its_own() -> None:
    requests = OpenRequests(NodeCaps.for_pods(2, 64))
    for name in ("/system.slice/a", "/system.slice/b"):
        for _ in range(shares.PER_CONTAINER):
            requests.admit(name)
    assert len(requests) == 2 * shares.PER_CONTAINER


# -- the descriptors ---------------------------------------------------------------------------


def limits_after(soft: int, hard: int, needed: int) -> tuple[int, int, int]:
    """(what raise_fd_limit returned, soft, hard) in a child started at these limits."""
    code = ("import resource; from fuse_plugin.broker.shares import raise_fd_limit; "
            f"got = raise_fd_limit({needed}); "
            "print(got, *resource.getrlimit(resource.RLIMIT_NOFILE))")
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True,
        preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard)))
    got, now_soft, now_hard = (int(word) for word in out.stdout.split())
    return got, now_soft, now_hard


def test_the_soft_fd_limit_is_raised_to_what_the_caps_need() -> None:
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    needed = NodeCaps.for_pods(110, 64).descriptors
    if hard < needed + 1:
        pytest.skip(f"this session's hard RLIMIT_NOFILE ({hard}) is below {needed + 1}")
    assert limits_after(1024, needed + 1, needed) == (needed, needed, needed + 1)
    assert limits_after(1024, 4096, needed) == (4096, 4096, 4096)  # as far as it goes
    assert limits_after(needed + 1, needed + 1, needed) == (needed + 1,) * 3  # never lower


# -- the loop ---------------------------------------------------------------------------------


@pytest.fixture
def loop(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Broker]:
    """A broker listening in a temp directory; its loop is driven by the test."""
    monkeypatch.setattr(server, "STOP_GRACE", 0.0)
    broker = Broker(BrokerSettings(directory=tmp_path / "dir", state=tmp_path / "state"),
                    logging.getLogger("test"))
    broker.settings.directory.mkdir()
    broker._listen()
    yield broker
    broker._close()


def accepted(broker: Broker) -> socket.socket:
    """This process connects and the loop accepts it (it is a container of its own: the
    test's cgroup)."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    sock.connect(str(broker.socket_path))
    broker._accept()
    return sock


def said(sock: socket.socket) -> str:
    sock.settimeout(5)
    return protocol.decode(sock.recv(protocol.MAX_MESSAGE)).get("message", "")


def test_every_end_of_a_request_gives_its_place_back(loop: Broker) -> None:
    """Refused by the rules, dropped unsaid, silent past its deadline, refused while
    queued as the broker stops: the count is back to nothing each time, and a container
    at its share is refused at accept without taking a place."""
    if os.geteuid() != 0:
        pytest.skip("needs root: the broker reads the caller's /proc entries")
    refused = accepted(loop)
    refused.send(protocol.encode(v="2", op="mount", path="/proc/x", fuse_fd="3"))
    loop.requests.receive(loop.requests._waiting[next(iter(loop.requests._waiting))])
    assert "broker refused" in said(refused)
    assert len(loop.open) == 0
    dropped = accepted(loop)
    dropped.close()
    loop.requests.receive(loop.requests._waiting[next(iter(loop.requests._waiting))])
    assert len(loop.open) == 0
    silent = [accepted(loop) for _ in range(shares.PER_CONTAINER)]
    assert len(loop.open) == shares.PER_CONTAINER
    extra = accepted(loop)
    assert "this container has 4 requests open" in said(extra)
    assert len(loop.open) == shares.PER_CONTAINER
    loop._expire(time.monotonic() + requests.REQUEST_DEADLINE + 1)
    assert {said(s) for s in silent} == {
        f"broker refused: no complete request within {requests.REQUEST_DEADLINE:g}s"}
    assert len(loop.open) == 0
    last = accepted(loop)
    loop._close()
    assert "the broker is stopping" in said(last)
    assert len(loop.open) == 0
    loop._listener = None  # closed already: the fixture's close has nothing left to do


def test_silent_connections_are_answered_at_their_own_deadlines(loop: Broker) -> None:
    """The loop looks only at the soonest deadline, whatever the number open
    (``Broker._soonest``): each connection is still answered at its own."""
    if os.geteuid() != 0:
        pytest.skip("needs root: the broker reads the caller's /proc entries")
    socks = [accepted(loop) for _ in range(shares.PER_CONTAINER)]
    deadlines = [w.deadline for w in loop.requests._waiting.values()]
    assert deadlines == sorted(deadlines)
    assert loop._soonest() == [deadlines[0]]
    loop._expire(deadlines[1])
    assert len(loop.open) == 2
    assert loop._soonest() == [deadlines[2]]
    for sock in socks[:2]:
        assert "no complete request" in said(sock)
    for sock in socks[2:]:
        sock.setblocking(False)
        with pytest.raises(BlockingIOError):
            sock.recv(protocol.MAX_MESSAGE)
    loop._expire(deadlines[3])
    assert len(loop.open) == 0
    assert loop._soonest() == []


def test_the_broker_says_where_its_settings_give_the_shares_up(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    broker = Broker(BrokerSettings(directory=tmp_path / "dir", state=tmp_path / "state",
                                   max_mounts_node=1000), logging.getLogger("test.shares"))
    with caplog.at_level(logging.WARNING, logger="test.shares"):
        broker._say_short(broker.caps, 1024)
    assert [r.getMessage() for r in caplog.records] == ["broker.shares_short"] * 2
    reasons = [r.__dict__["fields"]["reason"] for r in caplog.records]
    assert reasons[0].endswith("15 pods at their share fill it")
    assert reasons[1] == ("the open-file limit is 1024 (its hard limit), enough for 13 pods "
                          "at their share; --max-pods 110 needs 7608")
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="test.shares"):
        quiet = Broker(BrokerSettings(directory=tmp_path / "d2", state=tmp_path / "s2"),
                       logging.getLogger("test.shares"))
        quiet._say_short(quiet.caps, quiet.caps.descriptors)
    assert caplog.records == []
