"""Lost nodes: which nodes count as lost for planning, and which of a pair's pods sit on one. Pure: no client, the
clock only as `now` (epoch seconds).

A node is lost when
  - it carries the `node.kubernetes.io/unreachable` taint (the node lifecycle controller puts it there once the
    node's heartbeats stop for its node-monitor-grace-period: a partition, a dead or hung kubelet), or
  - its Ready condition is not True (False or Unknown) for longer than `lost_after` seconds
    (PDPAIR_NODE_LOST_SECONDS; the wait rides out a kubelet restart or a short blip).
A node the operator has not seen (no Node object in its index) is not judged: the pod garbage collector ends pods
bound to a deleted node, and an index still filling must not look like a lost cluster.

A node is cordoned when spec.unschedulable is set (`kubectl cordon`, `kubectl drain`) and it is still Ready: the
pair's PodDisruptionBudget (disruption.py) refuses the drain's evictions of its Ready pods, and the planner moves
the pair off the node itself, in order (surge.py: a Surge re-home; planner.failure: a Recreate pair's ordered
restart), after which the drain finds the pods gone (docs/design.md, "Drained nodes").

What the planner does with a lost node (planner.py, docs/design.md "Lost nodes"): a pod on a lost node is treated as gone for
the ordering of a restart once it is being deleted and the pair no longer holds any of its ports (they are fenced to
it: leases.fence_ports), never sooner; the current generation with a pod there restarts (NodeLost).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, Mapping

from pdpair.operator.model.observed import TAINT_UNREACHABLE, NodeView


def lost_reason(node: NodeView | None, now: float, lost_after: float) -> str | None:
    """Why `node` counts as lost now, or None."""
    if node is None:
        return None
    if node.unreachable:
        return f"node {node.name} is unreachable (taint {TAINT_UNREACHABLE})"
    if node.ready in ("False", "Unknown"):
        # A Ready condition with no transition time cannot say how long: it counts from now (not lost yet).
        down = now - node.since if node.since is not None else 0.0
        if down >= lost_after:
            return f"node {node.name} Ready={node.ready} for {down:.0f}s (lost after {lost_after:.0f}s)"
    return None


def recheck_in(node: NodeView | None, now: float, lost_after: float) -> float | None:
    """Seconds until a not-Ready node counts as lost (nothing else wakes the pair then), or None."""
    if node is None or node.unreachable or node.ready not in ("False", "Unknown") or node.since is None:
        return None
    left = node.since + lost_after - now
    return left if left > 0 else None


@dataclass(frozen=True)
class LostPods:
    """The pair's pods on lost nodes, with why, and when to look again at nodes that are not Ready yet lost."""

    pods: tuple[Any, ...] = ()  # observed.PodView
    reasons: Mapping[str, str] | None = None  # node -> why it is lost
    recheck_seconds: float | None = None

    @property
    def names(self) -> frozenset[str]:
        return frozenset(p.name for p in self.pods)

    def describe(self) -> str:
        return _describe(self.pods, lambda node: (self.reasons or {}).get(node, f"node {node} is lost"))


def lost_pods(pods: Iterable[Any], nodes: Mapping[str, NodeView], now: float, lost_after: float) -> LostPods:
    """The pods (observed.PodView, bound to a node) whose node is lost."""
    found, reasons, recheck = [], {}, None
    for pod in pods:
        if not pod.node:
            continue
        node = nodes.get(pod.node)
        why = lost_reason(node, now, lost_after)
        if why is not None:
            found.append(pod)
            reasons[pod.node] = why
            continue
        left = recheck_in(node, now, lost_after)
        if left is not None:
            recheck = left if recheck is None else min(recheck, left)
    return LostPods(tuple(found), reasons, recheck)


def cordoned(node: NodeView | None) -> bool:
    """`node` is cordoned (spec.unschedulable: `kubectl cordon`, the first step of `kubectl drain`) and still
    reachable: its pods are to move before an eviction takes them. A lost node is the NodeLost path's, not this."""
    return node is not None and node.unschedulable and not node.unreachable and node.ready == "True"


def cordoned_pods(pods: Iterable[Any], nodes: Mapping[str, NodeView]) -> tuple[Any, ...]:
    """The pods (observed.PodView, bound to a node, not being deleted) on a cordoned node."""
    return tuple(p for p in pods if p.node and not p.deleting and cordoned(nodes.get(p.node)))


def describe_cordoned(pods: Iterable[Any]) -> str:
    return _describe(pods, lambda node: f"node {node} is cordoned")


def _describe(pods: Iterable[Any], why) -> str:
    """`<why(node)>: <role> pod <name>, ...` per node, nodes and pods sorted."""
    by_node: dict[str, list[str]] = {}
    for pod in pods:
        by_node.setdefault(pod.node, []).append(f"{pod.role} pod {pod.name}")
    return "; ".join(f"{why(node)}: {', '.join(sorted(names))}" for node, names in sorted(by_node.items()))
