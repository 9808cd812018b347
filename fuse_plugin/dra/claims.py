"""What the scheduler allocated to a ResourceClaim, as the API server holds it.

The kubelet's NodePrepareResources names a claim (namespace, name, UID) and nothing
else: the devices and their configuration are in the claim's ``status.allocation``,
which the driver reads from the API server. ``ClaimSource`` is that one read, so the
tests can serve claims from a fake API server (over real HTTP) or from a dict.

Parsing turns the claim into an ``Allocation`` or a ``ClaimError`` whose message ends up
in the pod's events (the kubelet copies the per-claim error there): every way a claim
can be unusable says which claim and what to change.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

MODES = ("direct", "broker")
CONFIG_KEYS = ("mode",)


class ClaimError(Exception):
    """A claim this driver cannot prepare; the message is for the pod's owner."""


class ClaimGone(ClaimError):
    """The API server says the claim does not exist (404)."""


class ClaimSource(Protocol):
    def get(self, namespace: str, name: str) -> Mapping[str, Any]:
        """The ResourceClaim as JSON (a dict); raise ClaimError when it cannot be read."""


@dataclass(frozen=True)
class AllocatedDevice:
    request: str
    pool: str
    device: str
    share_id: str | None


@dataclass(frozen=True)
class Allocation:
    """Our driver's devices in one claim, and the mode its configs chose: None when no
    config of ours chose one (the node's default decides: ``prepare.Preparer``)."""

    devices: tuple[AllocatedDevice, ...]
    mode: str | None


def parse_mode(parameters: object, where: str) -> str:
    """``{"mode": "direct"|"broker"}``; anything else is refused, naming what is wrong."""
    expected = 'expected {"mode": "direct"} or {"mode": "broker"}'
    if not isinstance(parameters, dict):
        kind = type(parameters).__name__
        raise ClaimError(f"{where}: parameters must be a JSON object, got {kind}: {expected}")
    unknown = sorted(set(parameters) - set(CONFIG_KEYS))
    if unknown:
        raise ClaimError(f"{where}: unknown field(s) {', '.join(map(repr, unknown))}: "
                         f"{expected}")
    mode = parameters.get("mode", "direct")
    if mode not in MODES:
        raise ClaimError(f"{where}: mode {json.dumps(mode)[:60]} is not direct or broker")
    return str(mode)


def _applies(requests: Sequence[str], request: str) -> bool:
    """A config with no requests applies to all; "req" also covers its subrequests."""
    return not requests or request in requests or request.partition("/")[0] in requests


def _mode_for(configs: Sequence[Mapping[str, Any]], driver: str, request: str,
              claim: str) -> str | None:
    """The last of our opaque configs that applies to ``request`` (None: none does): the
    class's configs come before the claim's, so the claim's own choice wins."""
    ordered = sorted(configs, key=lambda c: 0 if c.get("source") == "FromClass" else 1)
    mode: str | None = None
    for index, config in enumerate(ordered):
        opaque = config.get("opaque") or {}
        if opaque.get("driver") != driver or not _applies(config.get("requests") or [],
                                                          request):
            continue
        where = (f"claim {claim}: opaque config for {driver} "
                 f"({config.get('source', 'FromClaim')}, #{index})")
        mode = parse_mode(opaque.get("parameters"), where)
    return mode


def allocation(claim: Mapping[str, Any], driver: str, uid: str) -> Allocation:
    """Our devices in ``claim`` and their mode; ClaimError when it cannot be prepared."""
    meta = claim.get("metadata") or {}
    name = f"{meta.get('namespace', '?')}/{meta.get('name', '?')}"
    if meta.get("uid") != uid:
        raise ClaimError(f"claim {name} has UID {meta.get('uid')!r}, the kubelet asked for "
                         f"{uid!r}: the claim was deleted and made again")
    alloc = (claim.get("status") or {}).get("allocation")
    if not alloc:
        raise ClaimError(f"claim {name} is not allocated")
    devices_part = alloc.get("devices") or {}
    ours = [r for r in devices_part.get("results") or [] if r.get("driver") == driver]
    if not ours:
        raise ClaimError(f"claim {name} has no device of driver {driver}")
    configs = devices_part.get("config") or []
    found: list[AllocatedDevice] = []
    modes: set[str | None] = set()
    for result in ours:
        request = str(result.get("request", ""))
        modes.add(_mode_for(configs, driver, request, name))
        found.append(AllocatedDevice(request=request, pool=str(result.get("pool", "")),
                                     device=str(result.get("device", "")),
                                     share_id=result.get("shareID")))
    if len(modes) > 1:
        what = "both direct and broker mode" if {"direct", "broker"} <= modes \
            else "a mode for some requests and none for others"
        raise ClaimError(f"claim {name}: its configs choose {what}; one claim is "
                         "prepared in one mode (use two claims)")
    return Allocation(tuple(found), modes.pop())


class ApiClaims:
    """Claims read with GET from the API server (``resourceclaims get`` in the RBAC), as
    the JSON the server sent: no typed model stands between a claim and its checks, so
    a value of an unexpected type is a refusal with a message, not a decoding error."""

    def __init__(self, client: Any) -> None:
        self._client = client

    def get(self, namespace: str, name: str) -> Mapping[str, Any]:
        import httpx2
        from lightkube import ApiError, ConfigError

        from fuse_plugin.dra.resources import ResourceClaim

        try:
            claim = self._client.get(ResourceClaim, name, namespace=namespace)
        except ApiError as err:
            kind = ClaimGone if err.status.code == 404 else ClaimError
            raise kind(f"cannot read claim {namespace}/{name} from the API server: "
                       f"{err.status.code} {err.status.message}") from None
        except (httpx2.HTTPError, OSError, ConfigError) as err:  # unreachable, timed out,
            # a bad answer, the service account's token file gone
            raise ClaimError(f"cannot read claim {namespace}/{name} from the API server: "
                             f"{type(err).__name__}: {err}") from None
        return dict(claim)
