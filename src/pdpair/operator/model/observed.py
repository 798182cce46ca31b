"""What one reconcile pass observed of a pair: its pods (PodView), the nodes they run on (NodeView), the lease and
probe results, the health finding, the restart record (Observed). Pure data, read by every planner (planner.py, recreate.py, surge.py,
restart_policy.py) and filled by the executor (reconciler.py) and the health watch (health.py); it decides
nothing, so none of those imports a planner for it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Mapping

from pdpair.contract import ANNOTATION_DRAINING_SINCE, ANNOTATION_PEERS_DIGEST, ANNOTATION_SPEC_HASH, LABEL_GENERATION, LABEL_INSTANCE, LABEL_ROLE
from pdpair.operator.model import timestamps


def url_host(address: str) -> str:
    """An address as the host part of a URL or `host:port`: an IPv6 address in brackets."""
    return f"[{address}]" if ":" in address else address


def _plain(value: Any) -> Any:
    return dict(value) if isinstance(value, Mapping) else list(value)


PENDING_SCHEDULING = "Pending for scheduling"  # how messages name a pod the scheduler has not placed yet


def is_scheduled(pod: Mapping[str, Any]) -> bool:
    """Bound to a node (API JSON): spec.nodeName set or the PodScheduled condition True."""
    conditions = (pod.get("status") or {}).get("conditions") or []
    return bool((pod.get("spec") or {}).get("nodeName")) or any(
        c.get("type") == "PodScheduled" and c.get("status") == "True" for c in conditions)


def pending_for_scheduling(pod: Mapping[str, Any] | None) -> bool:
    """Pending and not yet bound to a node. Such a pod never blocks on the pair and never triggers a restart: a
    Pending pod that is already scheduled (pulling images, starting containers) has started as far as the scheduler
    is concerned. The one definition; PodView.pending_scheduling is the same rule on the parsed view."""
    return bool(pod) and (pod.get("status") or {}).get("phase") == "Pending" and not is_scheduled(pod)


@dataclass(frozen=True)
class PodView:
    name: str
    role: str
    generation: int
    spec_hash: str = ""
    phase: str = "Pending"  # Pending | Running | Succeeded | Failed | Unknown
    ready: bool = False
    ip: str | None = None
    deleting: bool = False
    scheduled: bool = False
    restarts: int = 0
    uid: str = ""
    node: str = ""  # spec.nodeName ("" until scheduled)
    ports: tuple[int, ...] = ()  # every containerPort it declares: on the host network, the ports it binds there
    instance: int = 0  # index within its role and generation (label pdpair.io/instance; absent: 0)
    draining_since: float | None = None  # a scale-down chose it (annotation pdpair.io/draining-since): epoch seconds
    peers_digest: str | None = None  # the peer set a prefill or router was told (pdpair.io/peers-digest; None: never)
    # What health.py reads of the API object (pod_fact, pending_for_scheduling): metadata name/uid/deletion, spec
    # nodeName, status. Not the whole pod: the pod index holds one per pod, and a whole pod (managedFields, env,
    # probes) costs ~150 dicts, most of the operator's memory at 1000 pairs.
    raw: Mapping[str, Any] | None = field(default=None, compare=False, repr=False)

    @property
    def running(self) -> bool:
        return self.phase == "Running" and bool(self.ip) and not self.deleting

    @property
    def pending_scheduling(self) -> bool:
        return self.phase == "Pending" and not self.scheduled

    @property
    def failed(self) -> bool:
        return self.phase in ("Failed", "Succeeded")

    @classmethod
    def from_pod(cls, pod: Mapping[str, Any]) -> "PodView":
        meta = pod.get("metadata") or {}
        labels = meta.get("labels") or {}
        annotations = meta.get("annotations") or {}
        status = pod.get("status") or {}
        conditions = status.get("conditions") or []
        cond = {c.get("type"): c.get("status") for c in conditions}
        try:
            generation = int(labels.get(LABEL_GENERATION, "0"))
        except ValueError:
            generation = 0
        try:
            instance = int(labels.get(LABEL_INSTANCE, "0"))
        except ValueError:
            instance = 0
        try:
            draining_since = float(annotations[ANNOTATION_DRAINING_SINCE]) if ANNOTATION_DRAINING_SINCE in annotations else None
        except ValueError:
            draining_since = 0.0  # unreadable: it was marked, so it drains (as if long ago)
        restarts = sum(int(cs.get("restartCount") or 0) for cs in status.get("containerStatuses") or [])
        spec = pod.get("spec") or {}
        ports = sorted({int(p["containerPort"]) for c in (spec.get("initContainers") or []) + (spec.get("containers") or [])
                        for p in c.get("ports") or [] if p.get("containerPort")})
        return cls(
            name=meta.get("name", ""),
            role=labels.get(LABEL_ROLE, ""),
            generation=generation,
            spec_hash=annotations.get(ANNOTATION_SPEC_HASH, ""),
            instance=instance,
            draining_since=draining_since,
            peers_digest=annotations.get(ANNOTATION_PEERS_DIGEST),
            phase=status.get("phase") or "Pending",
            ready=cond.get("Ready") == "True",
            ip=status.get("podIP") or None,
            deleting=bool(meta.get("deletionTimestamp")),
            scheduled=is_scheduled(pod),
            restarts=restarts,
            uid=meta.get("uid", ""),
            node=str(spec.get("nodeName") or ""),
            ports=tuple(ports),
            raw=_health_view(pod),
        )


def _health_view(pod: Mapping[str, Any]) -> dict[str, Any]:
    meta = pod.get("metadata") or {}
    return json.loads(json.dumps({
        "metadata": {k: meta[k] for k in ("name", "namespace", "uid", "deletionTimestamp") if meta.get(k) is not None},
        "spec": {"nodeName": (pod.get("spec") or {}).get("nodeName")},
        "status": pod.get("status") or {},
    }, default=_plain))


@dataclass(frozen=True)
class Finding:
    """Why one generation of the pair needs an ordered restart. The one shape a restart cause has from where it is
    found (a pod's failure, the health watch's verdict in status.health, busy ports re-leased) through the planner's
    decision (planner.PairPlan.restart) to the Restarting Event, status.lastRestart and the restart metric."""

    reason: str  # one of health.RESTART_REASONS (the metric label)
    message: str
    generation: int  # the pair generation it is about: a finding about an older one never restarts the new one
    counted: bool = True  # against the restart budget (busy-port restarts are not: each consumed a quarantined port)
    # The pod it is about ("" = the pair as a whole): in an xPyD pair that has been serving, a finding about one
    # engine instance replaces that instance alone when its role has another serving instance (instances.py).
    pod: str = ""
    pod_uid: str = ""  # that pod's uid when the finding knows it: a finding about a pod since replaced (the same
    # name comes back) must not replace the new one


@dataclass(frozen=True)
class Observed:
    pods: tuple[PodView, ...] = ()
    ports_complete: bool = False  # the leases cover every required block
    pool_exhausted: bool = False
    pool_message: str = ""
    decode_listening: bool = False  # the current decode pod accepted on every rank
    probe_message: str = ""
    restart_reason: str | None = None  # set by planner.plan only: the restart it decided to do now
    # What planner.plan decides restarts from (planner.next_step itself ignores these):
    meta_generation: int = 0  # the pair's metadata.generation
    restart_times: tuple[float, ...] = ()  # earlier restarts (epoch seconds), from the pair's annotation
    # xPyD: earlier replacements of single instances of the generation `instance_restarts_generation`, by
    # "<role>-<index>" (the pair's annotation pdpair.io/instance-restart-times); each instance has its own budget
    instance_restart_times: Mapping[str, tuple[float, ...]] = field(default_factory=dict)
    instance_restarts_generation: int = 0
    health: Finding | None = None  # the health watch's restart finding (health_status.restart_finding), if any
    ports_replaced: str | None = None  # busy ports the pair no longer holds were re-leased: restart on the new ones
    # A Surge rollout's new generation (surge.py): its port set and its decode's listener
    rollout_ports_complete: bool = False
    rollout_pool_exhausted: bool = False
    rollout_pool_message: str = ""
    rollout_decode_listening: bool = False
    rollout_probe_message: str = ""
    rollout_rejection: str = ""  # the API server refused one of its pods (the message)
    # Every port set the pair holds leases in, as the executor last read them (surge.release_left_slot)
    leased_slots: frozenset[str] = frozenset()
    # Lost nodes (nodes.py): the nodes of the pair's pods as the node index has them, how long a not-Ready node
    # waits before it counts as lost (PDPAIR_NODE_LOST_SECONDS; infinite: never judged), and the pool ports the pair
    # holds after this pass's lease steps (a pod on a lost node none of whose ports it holds is fenced)
    nodes: Mapping[str, "NodeView"] = field(default_factory=dict)  # node name -> NodeView (below)
    node_lost_seconds: float = float("inf")
    held_pool_ports: frozenset[int] = frozenset()
    fenced: frozenset[str] = frozenset()  # set by planner.plan only: pods on lost nodes that count as gone
    # set by planner.plan only: the pods on lost nodes (whatever their state), and those of them none of whose pool
    # ports the pair holds any more (fenced to them): instances.heal replaces a serving xPyD generation's alone
    stranded: frozenset[str] = frozenset()
    stranded_fenced: frozenset[str] = frozenset()
    now: float = 0.0  # set by planner.plan only: epoch seconds of the pass (a scale-down's drain clock)
    # The instances whose port blocks the serving set holds, per role, when the pool could not lease them all (a
    # scale-up past the pool: the serving blocks are kept, ports.ensure hoard_nothing=False); None: every block held
    leased_instances: Mapping[str, frozenset[int]] | None = None
    # What the router of each generation last answered about its instances (RouterDrainView, by the router pod's
    # generation), while an instance of the pair drains: instances.instance_step ends a drain early on it
    router_views: Mapping[int, "RouterDrainView"] = field(default_factory=dict)


@dataclass(frozen=True)
class RouterDrainView:
    """What the router of `generation` answered about its instances (`PUT` or `GET /pdpair/v1/peers`, router/peer_push.py),
    as the executor last read it, by pod: the planner's evidence that a draining instance is done
    (instances.router_drained). It records the answer and decides nothing.

    The executor keeps it in memory only: a restarted operator has none until its first read of the router (one pass;
    the drain deadline, spec.rollout.drainSeconds, holds meanwhile). Nothing is lost by that: a drain's evidence is
    the router's state now, not a history."""

    generation: int  # the generation of the router pod that answered
    answered_generation: int | None  # the answer's "generation" (None: nothing pushed yet, the router's flags' set)
    read_at: float  # epoch seconds (the operator's clock, like pdpair.io/draining-since) when the answer came
    choosable: frozenset[str] = frozenset()  # pods the router may still choose (a member not marked draining)
    involved: Mapping[str, int] = field(default_factory=dict)  # pods with requests in flight involving them (> 0)

    @classmethod
    def merged(cls, views: "list[RouterDrainView]") -> "RouterDrainView":
        """One view of a generation's router replicas, as the planner needs it (router_drained): a pod is choosable
        if any replica may still choose it, its requests in flight are the sum over the replicas, the answer is as
        old as the oldest, and about a generation only when every replica answered about that one."""
        first = views[0]
        answered = {v.answered_generation for v in views}
        involved: dict[str, int] = {}
        for view in views:
            for name, count in view.involved.items():
                involved[name] = involved.get(name, 0) + count
        return cls(first.generation, answered.pop() if len(answered) == 1 else None, min(v.read_at for v in views),
                   frozenset().union(*(v.choosable for v in views)), involved)

    @classmethod
    def from_answer(cls, generation: int, answer: Any, read_at: float,
                    urls: Mapping[str, tuple[str, str]]) -> "RouterDrainView | None":
        """The view of a router's answer `{"epoch", "generation", "prefills": [{"index", "url", "outstanding",
        "involved", "draining"}], "decodes": [...], "leaving": [{"role", "url", "outstanding", "involved"}]}` for the
        pods `urls` names (pod name -> (role, the engine URL the router is pushed for it)); None for an answer that is
        malformed or lacks `involved` (a router from before that count: its prefill `outstanding` ends before the KV
        push does, so the drain keeps its deadline)."""
        if not isinstance(answer, Mapping):
            return None
        answered = answer.get("generation")
        if answered is not None and (isinstance(answered, bool) or not isinstance(answered, int)):
            return None
        by_url: dict[tuple[str, str], str] = {role_url: name for name, role_url in urls.items()}
        choosable: set[str] = set()
        involved: dict[str, int] = {}
        entries: list[tuple[str, Any, bool]] = []
        for key, role in (("prefills", "prefill"), ("decodes", "decode")):
            items = answer.get(key)
            if not isinstance(items, list):
                return None
            entries += [(role, item, True) for item in items]
        leaving = answer.get("leaving", [])
        if not isinstance(leaving, list):
            return None
        entries += [(item.get("role") if isinstance(item, Mapping) else "", item, False) for item in leaving]
        for role, item, member in entries:
            if not isinstance(item, Mapping):
                return None
            count = item.get("involved")
            if isinstance(count, bool) or not isinstance(count, int) or count < 0:
                return None
            name = by_url.get((str(role), str(item.get("url"))))
            if name is None:
                continue
            if member and item.get("draining") is not True:
                choosable.add(name)
            if count:
                involved[name] = involved.get(name, 0) + count
        return cls(generation, answered, read_at, frozenset(choosable), involved)


TAINT_UNREACHABLE = "node.kubernetes.io/unreachable"


@dataclass(frozen=True)
class NodeView:
    """What the operator keeps of a Node (the node index holds one per node)."""

    name: str
    ready: str = ""  # the Ready condition's status: True | False | Unknown | "" (none reported yet)
    since: float | None = None  # epoch seconds of the Ready condition's lastTransitionTime
    unreachable: bool = False  # carries the node.kubernetes.io/unreachable taint (any effect)
    unschedulable: bool = False  # spec.unschedulable: cordoned (kubectl cordon, or the first step of kubectl drain)

    @classmethod
    def from_node(cls, node: Mapping[str, Any]) -> "NodeView":
        meta = node.get("metadata") or {}
        spec = node.get("spec") or {}
        conditions = (node.get("status") or {}).get("conditions") or []
        ready = next((c for c in conditions if c.get("type") == "Ready"), None) or {}
        return cls(
            name=str(meta.get("name") or ""),
            ready=str(ready.get("status") or ""),
            since=timestamps.epoch(ready.get("lastTransitionTime")),
            unreachable=any(t.get("key") == TAINT_UNREACHABLE for t in spec.get("taints") or []),
            unschedulable=bool(spec.get("unschedulable")),
        )

