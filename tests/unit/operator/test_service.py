"""The router Service manifest and the action planner (pure; the e2e test runs it on the real control plane)."""

import pytest

from pdpair import contract as c
from pdpair.operator.decide.port_blocks import assign, status_ports
from tests.port_blocks_support import spec_blocks
from pdpair.operator.build.service import (
    ACTION_CREATE,
    ACTION_DELETE,
    ACTION_PATCH,
    ServiceView,
    plan_service,
    router_service,
)

UID = "uid-1"


def pair(router=None):
    spec = {"model": "m", "image": "img:1"}
    if router is not None:
        spec["router"] = router
    return {"metadata": {"name": "demo", "namespace": "ns1", "uid": UID}, "spec": spec}


def leased(spec):
    ports, nxt = [], 20000
    for block in spec_blocks(spec):
        ports += assign(block, block.fixed or nxt)  # as PortLeaser does: a fixed port is leased as given
        nxt += block.count
    return status_ports(ports)


def router_port(ports):
    return next(p["port"] for p in ports if p["role"] == c.ROLE_ROUTER and p["purpose"] == c.PURPOSE_HTTP)


def test_manifest_selects_the_router_on_its_leased_port():
    p = pair()
    ports = leased(p["spec"])
    svc = router_service(p, ports)
    assert svc["metadata"]["name"] == "demo" and svc["metadata"]["namespace"] == "ns1"
    assert svc["spec"]["type"] == "ClusterIP"
    assert svc["spec"]["selector"] == {c.LABEL_PAIR: "demo", c.LABEL_ROLE: c.ROLE_ROUTER}
    assert svc["spec"]["ports"] == [{"name": c.HTTP_PORT_NAME, "protocol": "TCP", "port": router_port(ports),
                                     "targetPort": c.HTTP_PORT_NAME}]
    labels = svc["metadata"]["labels"]
    assert labels[c.LABEL_PAIR_UID] == UID and labels[c.LABEL_PAIR] == "demo" and labels[c.LABEL_ROLE] == c.ROLE_ROUTER
    [owner] = svc["metadata"]["ownerReferences"]
    assert (owner["apiVersion"], owner["kind"], owner["uid"], owner["controller"]) == (c.API_VERSION, c.KIND, UID, True)


def test_fixed_router_port_is_the_service_port():
    p = pair({"enabled": True, "port": 8123})
    assert router_service(p, leased(p["spec"]))["spec"]["ports"][0]["port"] == 8123


def test_during_a_surge_rollout_the_selector_pins_the_serving_generation_and_the_port_stays():
    p = pair()
    ports = leased(p["spec"])
    svc = router_service(p, ports, generation=3, service_port=20100)
    assert svc["spec"]["selector"] == {c.LABEL_PAIR: "demo", c.LABEL_ROLE: c.ROLE_ROUTER, c.LABEL_GENERATION: "3"}
    # the port clients know (status.servicePort), while targetPort (by name) follows the new router's leased port
    assert svc["spec"]["ports"] == [{"name": c.HTTP_PORT_NAME, "protocol": "TCP", "port": 20100,
                                     "targetPort": c.HTTP_PORT_NAME}]
    switched = ServiceView.from_service(svc)
    assert plan_service(router_service(p, ports, generation=4, service_port=20100), switched, UID) == ACTION_PATCH
    ours = {**svc, "metadata": {**svc["metadata"], "uid": "s1"}}
    assert plan_service(router_service(p, ports, generation=3, service_port=20100),
                        ServiceView.from_service(ours), UID) is None


def test_no_service_when_router_disabled_or_port_not_leased():
    p = pair({"enabled": False})
    assert router_service(p, leased(p["spec"])) is None
    assert router_service(pair(), None) is None
    assert router_service(pair(), []) is None


def view(svc, owner=UID, deleting=False, **overrides):
    base = ServiceView.from_service({**svc, "metadata": {**svc["metadata"], "uid": "svc-uid",
                                                          "ownerReferences": [{"uid": owner}]}})
    fields = {**base.__dict__, "deleting": deleting, **overrides}
    return ServiceView(**fields)


DESIRED = router_service(pair(), leased(pair()["spec"]))


@pytest.mark.parametrize(
    "desired, observed, action",
    [
        (DESIRED, None, ACTION_CREATE),
        (DESIRED, view(DESIRED), None),  # already as wanted: no call
        (DESIRED, view(DESIRED, ports=(("http", 1, "http"),)), ACTION_PATCH),  # router port changed
        (DESIRED, view(DESIRED, selector=(("app", "x"),)), ACTION_PATCH),
        (DESIRED, view(DESIRED, owner="someone-else"), None),  # never touch a Service we don't own
        (DESIRED, view(DESIRED, deleting=True), ACTION_CREATE),  # 409 until it is gone, then created
        (None, view(DESIRED), ACTION_DELETE),  # router disabled
        (None, view(DESIRED, owner="someone-else"), None),
        (None, view(DESIRED, deleting=True), None),
        (None, None, None),
    ],
    ids=["absent", "same", "port-changed", "selector-changed", "foreign", "deleting", "disabled", "disabled-foreign",
         "disabled-deleting", "disabled-absent"],
)
def test_plan_service(desired, observed, action):
    assert plan_service(desired, observed, UID) == action


def test_view_of_an_api_object_matches_its_manifest():
    """What the apiserver returns (extra fields, int targetPort stays as given) compares equal to the manifest."""
    api_object = {
        "metadata": {**DESIRED["metadata"], "uid": "svc-uid", "resourceVersion": "7"},
        "spec": {**DESIRED["spec"], "clusterIP": "10.96.0.12", "sessionAffinity": "None",
                 "ports": [{**DESIRED["spec"]["ports"][0]}]},
    }
    assert plan_service(DESIRED, ServiceView.from_service(api_object), UID) is None


def test_the_service_keeps_the_port_clients_know_when_the_routers_changes():
    """A restart whose router port was fenced (lost node) or found busy gets a new router port: the existing
    Service keeps its port (clients know it), only targetPort (by name) follows. A fixed spec.router.port wins."""
    from pdpair.operator.build.service import kept_service_port

    p = pair()
    first = router_service(p, leased(p["spec"]))
    ours = ServiceView.from_service({**first, "metadata": {**first["metadata"], "uid": "s1"}})
    known = first["spec"]["ports"][0]["port"]
    assert kept_service_port(p["spec"], {}, ours, UID) == known
    assert kept_service_port(p["spec"], {"servicePort": 20100}, ours, UID) == 20100  # a Surge switch recorded it
    assert kept_service_port(p["spec"], {}, None, UID) is None  # none yet: the router's leased port
    assert kept_service_port(p["spec"], {}, ours, "someone-else") is None
    moved = [{**q, "port": q["port"] + 50} if q["role"] == c.ROLE_ROUTER else q for q in leased(p["spec"])]
    again = router_service(p, moved, service_port=kept_service_port(p["spec"], {}, ours, UID))
    assert again["spec"]["ports"][0]["port"] == known and plan_service(again, ours, UID) is None
    fixed = pair({"enabled": True, "port": 8123})
    assert kept_service_port(fixed["spec"], {"servicePort": 20100}, ours, UID) is None
