"""Kubernetes' name rules, in one place: what the API server accepts as a DNS label (a
namespace, a pod's name), a DNS subdomain (a node, a ResourceClaim, a DRA driver) and a
qualified name's last part (a resource name's). The wings check names before anything
touches the node or the API server, so that a bad flag is one line and a name from the
kubelet becomes a request path only when the API server could have made it."""

from __future__ import annotations

import re

LABEL_MAX = 63
SUBDOMAIN_MAX = 253
_LABEL = r"[a-z0-9]([-a-z0-9]*[a-z0-9])?"
# Used with fullmatch: `$` would also match before a trailing newline.
_DNS_LABEL = re.compile(_LABEL)
_DNS_SUBDOMAIN = re.compile(rf"{_LABEL}(\.{_LABEL})*")
# The part after a qualified name's slash; also what a socket's instance suffix may be.
QUALIFIED = r"[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?"
_QUALIFIED = re.compile(QUALIFIED)


def dns_label(text: str) -> bool:
    return len(text) <= LABEL_MAX and _DNS_LABEL.fullmatch(text) is not None


def dns_subdomain(text: str, most: int = SUBDOMAIN_MAX) -> bool:
    return len(text) <= most and _DNS_SUBDOMAIN.fullmatch(text) is not None


def qualified_name(text: str) -> bool:
    """The part after the slash of a qualified name (a label key, a resource name)."""
    return len(text) <= LABEL_MAX and _QUALIFIED.fullmatch(text) is not None
