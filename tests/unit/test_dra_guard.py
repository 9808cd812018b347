"""The DRA driver's guard (manifests/dra/admission-policy.yaml), its CEL evaluated case by
case as the API server evaluates a ValidatingAdmissionPolicy: the match condition, then
the variables in order, then each validation; any false validation refuses the request
with its message. The cluster stage proves the same policy in the real API server with the
driver's own token; this shows every case, including ones that stage cannot make (a token
without a node, an update that moves a slice between nodes)."""

from __future__ import annotations

from typing import Any

import celpy
import pytest
from celpy.adapter import json_to_cel

from fuse_plugin.dra.settings import DRIVER_NAME
from tests.lib.manifests import MANIFESTS, one

POLICY = one(MANIFESTS / "dra" / "admission-policy.yaml", "ValidatingAdmissionPolicy")["spec"]
DRIVER_ACCOUNT = "system:serviceaccount:fuse-device-plugin:fuse-dra-driver"
NODE_KEY = "authentication.kubernetes.io/node-name"
_ENV = celpy.Environment()


def _eval(expression: str, activation: dict[str, Any]) -> Any:
    return _ENV.program(_ENV.compile(expression)).evaluate(activation)


def verdict(operation: str, *, user: str = DRIVER_ACCOUNT, node: str | None = "node-a",
            obj: dict[str, Any] | None = None, old: dict[str, Any] | None = None
            ) -> str | None:
    """None when the policy does not apply or admits; else the refusal's message."""
    extra = {NODE_KEY: [node]} if node is not None else {}
    activation: dict[str, Any] = {
        "request": json_to_cel({"operation": operation,
                                      "userInfo": {"username": user, "extra": extra}}),
        "object": json_to_cel(obj), "oldObject": json_to_cel(old)}
    if not all(_eval(c["expression"], activation) for c in POLICY["matchConditions"]):
        return None
    variables: dict[Any, Any] = {}
    for variable in POLICY["variables"]:
        activation["variables"] = celpy.celtypes.MapType(variables)
        variables[celpy.celtypes.StringType(variable["name"])] = _eval(
            variable["expression"], activation)
    activation["variables"] = celpy.celtypes.MapType(variables)
    for validation in POLICY["validations"]:
        if not _eval(validation["expression"], activation):
            if "messageExpression" in validation:
                return str(_eval(validation["messageExpression"], activation))
            return str(validation["message"])
    return None


def a_slice(node: str | None, driver: str = DRIVER_NAME) -> dict[str, Any]:
    spec: dict[str, Any] = {"driver": driver, "pool": {"name": "p"}}
    if node is not None:
        spec["nodeName"] = node
    return {"metadata": {"name": "s"}, "spec": spec}


OWN, OTHER = a_slice("node-a"), a_slice("node-b")


@pytest.mark.parametrize(("operation", "obj", "old"), [
    ("CREATE", OWN, None), ("UPDATE", OWN, OWN), ("DELETE", None, OWN)])
def test_its_own_nodes_slice_of_its_own_driver_is_admitted(
        operation: str, obj: dict[str, Any] | None, old: dict[str, Any] | None) -> None:
    assert verdict(operation, obj=obj, old=old) is None


@pytest.mark.parametrize(("what", "operation", "obj", "old"), [
    ("create another node's", "CREATE", OTHER, None),
    ("update another node's", "UPDATE", OTHER, OTHER),
    ("move another node's onto its own", "UPDATE", OWN, OTHER),
    ("move its own onto another node", "UPDATE", OTHER, OWN),
    ("delete another node's", "DELETE", None, OTHER),
    ("a slice for no node (all nodes, a node selector)", "CREATE", a_slice(None), None),
])
def test_another_nodes_slice_is_refused(what: str, operation: str,
                                        obj: dict[str, Any] | None,
                                        old: dict[str, Any] | None) -> None:
    message = verdict(operation, obj=obj, old=old)
    assert message == "the DRA driver on node node-a may write only that node's " \
                      "ResourceSlices", what


@pytest.mark.parametrize(("operation", "obj", "old"), [
    ("CREATE", a_slice("node-a", "gpu.example.com"), None),
    ("UPDATE", OWN, a_slice("node-a", "gpu.example.com")),
    ("DELETE", None, a_slice("node-a", "gpu.example.com"))])
def test_another_drivers_slice_is_refused_even_on_its_own_node(
        operation: str, obj: dict[str, Any] | None, old: dict[str, Any] | None) -> None:
    message = verdict(operation, obj=obj, old=old)
    assert message is not None
    assert message.startswith("the DRA driver may write only ResourceSlices of")


def test_a_token_that_names_no_node_is_refused() -> None:
    message = verdict("CREATE", node=None, obj=OWN)
    assert message is not None
    assert "names no node" in message


@pytest.mark.parametrize("user", [
    "system:serviceaccount:team-a:fuse-dra-driver",   # the component moved: still guarded
    DRIVER_ACCOUNT])
def test_the_account_is_matched_in_any_namespace(user: str) -> None:
    assert verdict("CREATE", user=user, obj=OTHER) is not None


@pytest.mark.parametrize("user", [
    "system:node:node-a", "kubernetes-admin", "system:serviceaccount:kube-system:gpu-driver",
    "system:serviceaccount:x:fuse-dra-driver-other"])
def test_other_users_are_not_this_policys_business(user: str) -> None:
    assert verdict("CREATE", user=user, obj=OTHER) is None
