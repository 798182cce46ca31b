"""Lost nodes (nodes.py) and the fences of their pods' ports (leases.fences, leases.fenced_pods): which node counts
as lost when, what is fenced, what counts as gone. Pure; a few milliseconds."""

from __future__ import annotations

from datetime import datetime, timezone

import pytest

from pdpair.operator.decide import leases
from pdpair.operator.decide import nodes
from pdpair.operator.model.config import PortPool
from pdpair.operator.model.observed import TAINT_UNREACHABLE, NodeView, PodView

NOW = 1_800_000_000.0
POOL = PortPool(20000, 20099)


def node(name="n2", ready="True", since=NOW - 100, taints=()):
    stamp = datetime.fromtimestamp(since, timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    return {"metadata": {"name": name}, "spec": {"taints": [{"key": k, "effect": "NoExecute"} for k in taints]},
            "status": {"conditions": [{"type": "MemoryPressure", "status": "False"},
                                      {"type": "Ready", "status": ready, "lastTransitionTime": stamp}]}}


def pod(name, node_name="n2", ports=(20001, 20002), deleting=False, role="decode", gen=1):
    return PodView(name, role, gen, deleting=deleting, uid=f"uid-{name}", node=node_name, ports=tuple(ports),
                   raw={"metadata": {"name": name, "namespace": "ns"}})


def test_node_view_reads_the_ready_condition_its_transition_and_the_unreachable_taint():
    view = NodeView.from_node(node(ready="Unknown", since=NOW - 42, taints=(TAINT_UNREACHABLE,)))
    assert view == NodeView("n2", "Unknown", NOW - 42, True)
    assert NodeView.from_node({"metadata": {"name": "bare"}}) == NodeView("bare")


def test_a_pod_view_knows_its_node_and_every_port_it_declares():
    raw = {"metadata": {"name": "p", "labels": {}}, "spec": {
        "nodeName": "n1",
        "initContainers": [{"name": "preflight", "ports": [{"containerPort": 20007}]}],
        "containers": [{"name": "engine", "ports": [{"containerPort": 20003}, {"containerPort": 20001}]}]}}
    view = PodView.from_pod(raw)
    assert view.node == "n1" and view.ports == (20001, 20003, 20007)


def test_unreachable_is_lost_at_once_not_ready_only_after_the_wait():
    assert "unreachable" in nodes.lost_reason(NodeView.from_node(node(taints=(TAINT_UNREACHABLE,))), NOW, 30)
    assert nodes.lost_reason(NodeView.from_node(node(ready="True")), NOW, 30) is None
    fresh = NodeView.from_node(node(ready="False", since=NOW - 10))
    assert nodes.lost_reason(fresh, NOW, 30) is None
    assert nodes.recheck_in(fresh, NOW, 30) == 20  # nothing else wakes the pair when the wait is over
    old = NodeView.from_node(node(ready="Unknown", since=NOW - 31))
    assert "Ready=Unknown for 31s" in nodes.lost_reason(old, NOW, 30)
    assert nodes.recheck_in(old, NOW, 30) is None


def test_an_unseen_node_or_one_with_no_transition_time_is_not_judged_lost():
    assert nodes.lost_reason(None, NOW, 30) is None
    assert nodes.lost_reason(NodeView("n2", "Unknown", None, False), NOW, 30) is None
    assert nodes.recheck_in(NodeView("n2", "Unknown", None, False), NOW, 30) is None


def test_lost_pods_names_the_node_and_the_pods_and_when_to_look_again():
    views = {"n1": NodeView("n1", "True", NOW - 500), "n2": NodeView("n2", "Unknown", NOW - 60, True),
             "n3": NodeView("n3", "False", NOW - 5)}
    found = nodes.lost_pods([pod("d", "n2"), pod("p", "n1", role="prefill"), pod("r", "n3", role="router"),
                             pod("pending", "")], views, NOW, 30)
    assert found.names == {"d"}
    assert found.recheck_seconds == 25
    assert "node n2 is unreachable" in found.describe() and "decode pod d" in found.describe()


def test_fences_take_only_held_pool_ports_of_pods_on_lost_nodes():
    lost = nodes.LostPods((pod("d", ports=(20001, 20002, 30000)), pod("r", ports=(20050,), role="router")),
                          {"n2": "node n2 is unreachable"})
    held = [{"port": 20001}, {"port": 20002}, {"port": 30000}, {"port": 20010}]  # 30000: a fixed router port
    (fence,) = leases.fences(lost, held, POOL)  # r holds none of the pair's ports any more: fenced before
    assert fence.ports == (20001, 20002) and fence.pod_ref == "ns/d/uid-d" and "unreachable" in fence.why


def test_a_lost_pod_counts_as_gone_only_once_deleted_and_fenced():
    deleting_fenced = pod("a", ports=(20001,), deleting=True)
    deleting_held = pod("b", ports=(20002,), deleting=True)
    running_fenced = pod("c", ports=(20003,))
    lost = nodes.LostPods((deleting_fenced, deleting_held, running_fenced))
    assert leases.fenced_pods(lost, {20002, 20010}) == {"a"}


@pytest.mark.parametrize("view, want", [
    (NodeView("n", "True", unschedulable=True), True),
    (NodeView("n", "True"), False),
    (NodeView("n", "Unknown", unschedulable=True), False),  # not Ready: the lost-node rule's, not a move
    (NodeView("n", "True", unreachable=True, unschedulable=True), False),
    (None, False),  # a node not seen is not judged
])
def test_cordoned(view, want):
    assert nodes.cordoned(view) is want


def test_cordoned_pods_skips_pods_being_deleted_and_unbound_ones():
    views = {"n1": NodeView("n1", "True", unschedulable=True), "n2": NodeView("n2", "True")}
    pods = [PodView("a", "decode", 1, node="n1"), PodView("b", "prefill", 1, node="n2"),
            PodView("c", "router", 1, node="n1", deleting=True), PodView("d", "router", 1)]
    assert [p.name for p in nodes.cordoned_pods(pods, views)] == ["a"]
    assert nodes.describe_cordoned(nodes.cordoned_pods(pods, views)) == "node n1 is cordoned: decode pod a"


def test_the_pair_budget_selects_every_pod_of_the_pair_and_allows_no_disruption():
    from pdpair.contract import LABEL_PAIR_UID
    from pdpair.operator.build import disruption

    pair = {"metadata": {"name": "p", "namespace": "ns", "uid": "u-1"}}
    budget = disruption.pair_budget(pair)
    assert budget["metadata"]["name"] == "p" and budget["metadata"]["namespace"] == "ns"
    assert budget["metadata"]["ownerReferences"][0]["uid"] == "u-1"
    assert budget["spec"] == {"selector": {"matchLabels": {LABEL_PAIR_UID: "u-1"}},
                              "minAvailable": disruption.NO_READY_POD_EVICTED,
                              "unhealthyPodEvictionPolicy": "AlwaysAllow"}


def test_a_budget_of_an_older_operator_is_patched_back_and_a_current_one_is_left_alone():
    from pdpair.operator.build import disruption

    pair = {"metadata": {"name": "p", "namespace": "ns", "uid": "u-1"}}
    current = disruption.budget_shape(disruption.pair_budget(pair)["spec"])
    assert disruption.budget_outdated(current, pair) is None
    older = disruption.budget_shape({"maxUnavailable": 0, "unhealthyPodEvictionPolicy": "AlwaysAllow"})
    patch = disruption.budget_outdated(older, pair)
    # a merge patch: maxUnavailable null removes it (both set is refused by the apiserver)
    assert patch == {"spec": {"minAvailable": disruption.NO_READY_POD_EVICTED, "maxUnavailable": None,
                              "unhealthyPodEvictionPolicy": "AlwaysAllow"}}
    edited = disruption.budget_shape({"minAvailable": 1, "unhealthyPodEvictionPolicy": "IfHealthyBudget"})
    assert disruption.budget_outdated(edited, pair) == patch
