"""The one planner (planner.plan): table tests of its restart decisions, and a property test that drives it through
random event sequences (pods failing, probes flapping, health verdicts, spec edits, passes that die half-way, the
clock) in a small simulated world and checks the pair's invariants after every pass."""

from __future__ import annotations

import copy
import dataclasses
import functools
from dataclasses import dataclass, field
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pdpair.contract import PHASE_FAILED, ROLE_DECODE, ROLE_PREFILL, ROLE_ROUTER
from pdpair.operator.decide import recreate as d
from pdpair.operator.decide import health
from pdpair.operator.decide import leases
from pdpair.operator.decide import planner
from pdpair.operator.decide import surge
from pdpair.operator.model.config import PortPool
from pdpair.operator.model.pair_spec import spec_fingerprint
from pdpair.operator.model.observed import Finding, NodeView, Observed, PodView
from pdpair.operator.decide.restart_policy import RestartPolicy, restarts_in_window
from tests.crd_defaults import with_crd_defaults

POLICY = {"maxRestarts": 3, "windowSeconds": 600, "backoffSeconds": 10, "maxBackoffSeconds": 40}
SPEC = {"model": "m", "image": "img:1", "router": {"enabled": True, "replicas": 1}, "restartPolicy": POLICY}
H = spec_fingerprint(SPEC)
NOW = 1_000_000.0
POOL = PortPool(20000, 29999)
NODES = ("n1", "n2")
NODE_LOST_SECONDS = 30.0


def raw(name, phase="Running", restarts=0, deleting=False, node="n1"):
    meta = {"name": name, **({"deletionTimestamp": "2026-12-01T00:00:00Z"} if deleting else {})}
    return {"metadata": meta, "spec": {"nodeName": node},
            "status": {"phase": phase, "containerStatuses": [{"name": "engine", "restartCount": restarts}]}}


def pod(role, gen=1, phase="Running", ready=True, restarts=0, deleting=False, spec_hash=H):
    name = f"p-{role}-{gen}"
    return PodView(name, role, gen, spec_hash, phase, ready, "10.0.0.1" if phase == "Running" else None, deleting,
                   True, restarts, f"uid-{name}", raw=raw(name, phase, restarts, deleting))


READY_PODS = (pod("decode"), pod("prefill"), pod("router"))


def observed(pods=READY_PODS, **kw):
    return Observed(pods, ports_complete=True, decode_listening=True, meta_generation=1, **kw)


def hung(gen=1):
    return Finding(health.REASON_HUNG, "decode hung: 3 signals missing", gen)


CASES = [
    # name, status, observed, now, outcome, restart reason code, next step
    ("healthy and Ready: nothing to do", {"pairGeneration": 1}, observed(), NOW,
     planner.OUTCOME_STEP, None, d.STEP_READY),
    ("hung: restart now, generation bumped, prefill stopped first", {"pairGeneration": 1},
     observed(health=hung()), NOW, planner.OUTCOME_STEP, health.REASON_HUNG, d.STEP_DELETE_PREFILL),
    ("a verdict about an older generation is no reason", {"pairGeneration": 2},
     observed(pods=(pod("decode", 2), pod("prefill", 2), pod("router", 2)), health=hung(1)), NOW,
     planner.OUTCOME_STEP, None, d.STEP_READY),
    ("decode Failed: restart for pod_failed", {"pairGeneration": 1},
     observed(pods=(pod("decode", phase="Failed"), pod("prefill"), pod("router"))), NOW,
     planner.OUTCOME_STEP, health.REASON_POD_FAILED, d.STEP_DELETE_PREFILL),
    ("container restarted: restart for container_restart", {"pairGeneration": 1},
     observed(pods=(pod("decode", restarts=1), pod("prefill"), pod("router"))), NOW,
     planner.OUTCOME_STEP, health.REASON_CONTAINER_RESTART, d.STEP_DELETE_PREFILL),
    ("decode vanished under prefill", {"pairGeneration": 1},
     observed(pods=(pod("prefill"), pod("router"))), NOW,
     planner.OUTCOME_STEP, health.REASON_POD_VANISHED, d.STEP_DELETE_PREFILL),
    ("inside the backoff after a restart: wait", {"pairGeneration": 1},
     observed(health=hung(), restart_times=(NOW - 5,)), NOW, planner.OUTCOME_BACKOFF, None, None),
    ("backoff over: restart", {"pairGeneration": 1},
     observed(health=hung(), restart_times=(NOW - 11,)), NOW, planner.OUTCOME_STEP, health.REASON_HUNG,
     d.STEP_DELETE_PREFILL),
    ("budget spent: Failed", {"pairGeneration": 1},
     observed(health=hung(), restart_times=(NOW - 300, NOW - 200, NOW - 100)), NOW, planner.OUTCOME_FAILED, None,
     None),
    ("restarts older than the window do not count", {"pairGeneration": 1},
     observed(health=hung(), restart_times=(NOW - 900, NOW - 800, NOW - 700)), NOW, planner.OUTCOME_STEP,
     health.REASON_HUNG, d.STEP_DELETE_PREFILL),
    ("a pod Pending for scheduling: never restart", {"pairGeneration": 1},
     observed(pods=(pod("decode"), pod("prefill", phase="Failed"),
                    dataclasses.replace(pod("router", phase="Pending", ready=False), scheduled=False)),
              restart_times=()), NOW, planner.OUTCOME_BACKOFF, None, None),
    ("Failed at this spec: halted", {"pairGeneration": 1, "phase": PHASE_FAILED, "observedGeneration": 1},
     observed(health=hung()), NOW, planner.OUTCOME_HALTED, None, None),
    ("Failed, then the spec changed: planned again", {"pairGeneration": 1, "phase": PHASE_FAILED,
                                                      "observedGeneration": 1},
     dataclasses.replace(observed(), meta_generation=2), NOW, planner.OUTCOME_STEP, None, d.STEP_READY),
    ("broken on busy ports that were re-leased: restart outside the budget", {"pairGeneration": 1},
     observed(pods=(pod("decode", phase="Failed"), pod("prefill"), pod("router")),
              restart_times=(NOW - 300, NOW - 200, NOW - 100), ports_replaced="decode port 20001 busy"), NOW,
     planner.OUTCOME_STEP, health.REASON_PORT_IN_USE, d.STEP_DELETE_PREFILL),
]


@pytest.mark.parametrize("name, status, obs, now, outcome, reason, step", CASES, ids=[c[0] for c in CASES])
def test_plan(name, status, obs, now, outcome, reason, step):
    decided = planner.plan(SPEC, status, obs, now)
    assert decided.outcome == outcome
    assert (decided.restart.reason if decided.restart else None) == reason
    assert (decided.steps.step if decided.steps else None) == step
    if decided.restart is not None:
        assert decided.steps.pair_generation == status["pairGeneration"] + 1
        assert decided.steps.phase == "Restarting"
        if decided.restart.counted:
            assert decided.restart_times[-1] == now
        else:
            assert decided.restart_times is None  # the record is untouched
    if outcome == planner.OUTCOME_BACKOFF:
        assert decided.phase == "Restarting" and {c.type: c.reason for c in decided.conditions} == {
            "Ready": "RestartBackoff", "NodeLost": "NodesReady"}


def test_backoff_says_when_the_restart_may_happen():
    decided = planner.plan(SPEC, {"pairGeneration": 1}, observed(health=hung(), restart_times=(NOW - 5,)), NOW)
    assert decided.retry_at == NOW - 5 + 10


def test_restart_times_keep_only_the_window():
    decided = planner.plan(SPEC, {"pairGeneration": 1}, observed(health=hung(), restart_times=(NOW - 700, NOW - 30)),
                           NOW)
    assert decided.restart_times == (NOW - 30, NOW)


# --- the property test -----------------------------------------------------------------------------------------
class Violation(AssertionError):
    pass


@dataclass
class World:
    """The apiserver and kubelet as the planner sees them, one pass at a time. Pods are PodViews (with the raw
    fields pod facts read); the executor here does what reconciler.py does with a PairPlan."""

    spec: dict[str, Any]
    meta_generation: int = 1
    status: dict[str, Any] = field(default_factory=dict)
    restart_times: tuple[float, ...] = ()
    pods: dict[str, PodView] = field(default_factory=dict)
    accepting: set[str] = field(default_factory=set)  # decode pods whose listener accepts
    health: Finding | None = None
    now: float = NOW
    restarts: list[float] = field(default_factory=list)  # when counted restarts happened
    failed_at_generation: int | None = None  # metadata.generation the pair went Failed at
    creates: int = 0
    slots: set[str] = field(default_factory=set)  # port sets leased (the serving one; a rollout's while Progressing)
    pod_slots: dict[str, str] = field(default_factory=dict)  # pod name -> the port set it was built on
    # Lost nodes: the ports each port set holds now (replacements come from a counter, as the leaser claims free
    # ones), the ports fenced to pods on lost nodes, and which nodes are lost (unreachable) now
    held: dict[str, set[int]] = field(default_factory=dict)
    fenced: set[int] = field(default_factory=set)
    next_port: int = 20000
    lost: set[str] = field(default_factory=set)
    cordoned: set[str] = field(default_factory=set)  # nodes cordoned (kubectl cordon / drain) now

    def _lease(self, slot: str) -> None:
        if slot not in self.held:
            self.held[slot] = set()
        while len(self.held[slot]) < 3:  # decode, prefill, router: one port each is enough to follow them
            self.held[slot].add(self.next_port)
            self.next_port += 1

    def node_views(self) -> dict[str, NodeView]:
        return {n: NodeView(n, "Unknown" if n in self.lost else "True", self.now - 5, n in self.lost,
                            n in self.cordoned) for n in NODES}

    def listening(self, generation: int | None) -> bool:
        decode = next((p for p in self.pods.values() if p.role == ROLE_DECODE and p.generation == generation
                       and not p.deleting), None)
        return bool(decode and decode.running and decode.name in self.accepting)

    def observe(self) -> Observed:
        pods = tuple(self.pods.values())
        active = surge.active_rollout(self.status)
        self.slots.add(surge.serving_slot(self.status))  # the executor leases first (ensure_*_ports)
        if active and active["phase"] == surge.PHASE_PROGRESSING:
            self.slots.add(active["portSlot"])
        for slot in self.slots:
            self._lease(slot)
        # then fences the ports of pods on lost nodes, and leases replacements (lease_steps.fence_lost)
        lease_plan = planner.prepare(self.spec, self.status, pods, self.node_views(), self.now, NODE_LOST_SECONDS)
        held = [{"port": p} for ports in self.held.values() for p in ports]
        for fence in leases.fences(lease_plan.lost, held, POOL):
            for ports in self.held.values():
                ports -= set(fence.ports)
            self.fenced |= set(fence.ports)
        for slot in self.slots:
            self._lease(slot)
        return Observed(pods, ports_complete=True, leased_slots=frozenset(self.slots),
                        nodes=self.node_views(), node_lost_seconds=NODE_LOST_SECONDS,
                        held_pool_ports=frozenset(p for ports in self.held.values() for p in ports),
                        decode_listening=self.listening(surge.serving_generation(self.status, pods)),
                        meta_generation=self.meta_generation, restart_times=self.restart_times, health=self.health,
                        rollout_ports_complete=True,
                        rollout_decode_listening=bool(active) and self.listening(int(active["toGeneration"])))

    def run_pass(self, crash_after_status: bool = False) -> None:
        obs = self.observe()
        decided = planner.plan(self.spec, self.status, obs, self.now)
        halted = self.failed_at_generation == self.meta_generation
        if halted and decided.outcome != planner.OUTCOME_HALTED:
            raise Violation(f"a Failed pair was planned again at the same spec: {decided}")
        if decided.outcome == planner.OUTCOME_HALTED:
            return
        self.status["observedGeneration"] = self.meta_generation
        if decided.outcome in (planner.OUTCOME_FAILED, planner.OUTCOME_BACKOFF):
            self.status["phase"] = decided.phase
            if decided.outcome == planner.OUTCOME_FAILED:
                self.failed_at_generation = self.meta_generation
            return
        plan = decided.steps
        active = surge.active_rollout(self.status)
        serving = int(self.status.get("pairGeneration") or 0)
        if (decided.restart is None and active and active["phase"] in (surge.PHASE_PROGRESSING,
                                                                       surge.PHASE_ROLLING_BACK)
                and int(active["fromGeneration"]) == serving):  # (after a restart, Recreate replaces every generation)
            hit = [n for n in plan.delete if n in self.pods and self.pods[n].generation == serving]
            if hit:
                raise Violation(f"a {active['phase']} rollout deleted serving generation {serving}'s pods {hit}")
        was_ready = self.status.get("phase") == "Ready" and self.status.get("pairGeneration") == plan.pair_generation
        if plan.step == d.STEP_READY and not was_ready and not self.listening(plan.pair_generation):
            raise Violation(f"generation {plan.pair_generation} Ready before the operator saw its decode listen")
        if decided.restart is not None:
            self.health = None
            if decided.restart.counted:
                self.restarts.append(self.now)
                self.restart_times = decided.restart_times
        # intent first: status before pods
        self.status.update(pairGeneration=plan.pair_generation, phase=plan.phase)
        for key, value in plan.status_fields.items():  # merge patch: None deletes
            if value is None:
                self.status.pop(key, None)
            else:
                self.status[key] = value
        if crash_after_status:
            return
        for name in plan.delete:
            if name in self.pods:
                self.pods[name] = _deleting(self.pods[name])
        if plan.create:
            self._create(plan, obs)
        if plan.release_slot:  # after the status write and the pod actions, as the executor does
            users = [n for n, p in self.pods.items() if self.pod_slots[n] == plan.release_slot
                     and not set(p.ports) <= self.fenced]  # a pod whose ports are all fenced uses none of the set's
            if plan.release_slot == surge.serving_slot(self.status) or users:
                raise Violation(f"port set {plan.release_slot} released while it serves ({self.status.get('portSlot')}) "
                                f"or pods use it: {users}")
            self.slots.discard(plan.release_slot)
            self.held.pop(plan.release_slot, None)

    def _create(self, plan: d.Plan, obs: Observed) -> None:
        role = plan.create
        gen = plan.create_generation if plan.create_generation is not None else plan.pair_generation
        twins = [p.name for p in self.pods.values() if p.role == role and p.generation == gen]
        if twins:
            raise Violation(f"second {role} pod for generation {gen} while {twins} exist")
        if role == ROLE_PREFILL:  # parallel start: beside decode (its address comes by push), never before it
            decode = next((p for p in obs.pods if p.role == ROLE_DECODE and p.generation == gen), None)
            if decode is None:
                raise Violation(f"prefill of generation {gen} created before its decode exists")
        name = f"p-{role}-{gen}-{self.creates}"
        self.creates += 1
        slot = plan.create_slot or surge.serving_slot(self.status)
        self.pod_slots[name] = slot
        ports = tuple(sorted(self.held.get(slot, ())))
        stranded = {p for q in self.pods.values() if q.node in self.lost for p in q.ports}
        if set(ports) & (stranded | self.fenced):
            raise Violation(f"{name} created on ports {ports} that a pod on a lost node may still hold "
                            f"({sorted(stranded | self.fenced)})")
        self.pods[name] = PodView(name, role, gen, spec_fingerprint(self.spec), "Pending", False, None, False, False,
                                  0, f"uid-{name}", ports=ports, raw=raw(name, "Pending", node=""))

    def check_budget(self) -> None:
        policy = RestartPolicy.from_spec(self.spec["restartPolicy"])
        for t in self.restarts:  # the window ending at a restart is the fullest
            if len(restarts_in_window(policy, [r for r in self.restarts if r <= t], t)) > policy.max_restarts:
                raise Violation(f"{len(self.restarts)} restarts {self.restarts} exceed {policy.max_restarts} per "
                                f"{policy.window_seconds}s")


def _with(pod_: PodView, **kw) -> PodView:
    new = dataclasses.replace(pod_, **kw)
    return dataclasses.replace(new, raw=raw(new.name, new.phase, new.restarts, new.deleting, node=new.node))


def _deleting(pod_: PodView) -> PodView:
    return _with(pod_, deleting=True, ready=False)


# Events: (kind, which pod, a number). Each sequence draws its own fault rate: calm ones reach Ready and then
# hang, restart and spend their budgets; stormy ones fail pods mid-startup.
GOOD = ["pass"] * 4 + ["progress"] * 3 + ["listen", "gone"]
FAULTS = ["unlisten", "fail", "container_restart", "external_delete", "hung", "healthy", "spec_edit", "crash_pass",
          "operator_restart", "tick", "tick", "node_lost", "node_back", "cordon", "uncordon"]


@st.composite
def event_sequences(draw):
    calm = draw(st.sampled_from([1, 4, 16, 64]))
    event = st.tuples(st.sampled_from(GOOD * calm + FAULTS), st.integers(0, 7), st.floats(0, 400, allow_nan=False))
    return draw(st.lists(event, min_size=60, max_size=300))


def apply_event(world: World, event) -> None:
    kind, index, number = event
    names = sorted(world.pods)
    target = world.pods[names[index % len(names)]] if names else None
    if kind == "pass":
        world.run_pass()
    elif kind == "crash_pass":
        world.run_pass(crash_after_status=True)
    elif kind == "operator_restart":
        pass  # the planner holds nothing: a new operator sees the same status, annotation and pods
    elif kind == "tick":
        world.now += number
    elif kind == "spec_edit":
        world.spec = {**world.spec, "image": f"img:{world.meta_generation + 1}"}
        world.meta_generation += 1
    elif kind == "hung":
        gen = int(world.status.get("pairGeneration") or 1)
        world.health = Finding(health.REASON_HUNG, "hung", gen)
    elif kind == "healthy":
        world.health = None  # a healthy verdict holds no restart finding
    elif kind == "node_lost":  # a partition: the node's pods keep running, no deletion there is confirmed
        world.lost.add(NODES[index % len(NODES)])
    elif kind == "node_back":  # its kubelet is back: it ends the pods deleted meanwhile
        back = NODES[index % len(NODES)]
        world.lost.discard(back)
        for name in [n for n, p in world.pods.items() if p.deleting and p.node == back]:
            del world.pods[name]
            world.accepting.discard(name)
    elif kind == "cordon":  # kubectl cordon / the first step of kubectl drain (its evictions are refused: PDB)
        world.cordoned.add(NODES[index % len(NODES)])
    elif kind == "uncordon":
        world.cordoned.discard(NODES[index % len(NODES)])
    elif kind == "progress":  # every live pod one step: Pending -> scheduled -> Running -> Ready
        for name, p in list(world.pods.items()):
            if p.deleting or p.failed or p.ready or p.node in world.lost:
                continue
            if not p.scheduled:
                ready_nodes = [n for n in NODES if n not in world.lost | world.cordoned]  # it skips tainted nodes
                if ready_nodes:
                    prefer = "n2" if p.role == ROLE_DECODE else "n1"
                    world.pods[name] = _with(p, scheduled=True, node=prefer if prefer in ready_nodes else ready_nodes[0])
            elif p.phase == "Pending":
                world.pods[name] = _with(p, phase="Running", ip="10.0.0.2")
            elif p.role != ROLE_PREFILL or world.listening(p.generation):  # prefill's /readyz: paired
                world.pods[name] = _with(p, ready=True)
    elif kind == "listen":  # every running decode accepts
        world.accepting |= {p.name for p in world.pods.values() if p.role == ROLE_DECODE and p.running}
    elif kind == "gone":  # the kubelets finish every deletion they can see (not on a lost node)
        for name in [n for n, p in world.pods.items() if p.deleting and p.node not in world.lost]:
            del world.pods[name]
            world.accepting.discard(name)
    elif target is None:
        return
    elif kind == "unlisten":
        world.accepting.discard(target.name)
    elif kind == "fail" and target.scheduled:
        world.pods[target.name] = _with(target, phase="Failed", ready=False, ip=None)
    elif kind == "container_restart" and target.phase == "Running":
        world.pods[target.name] = _with(target, restarts=target.restarts + 1)
    elif kind == "external_delete":
        world.pods[target.name] = _deleting(target)


@functools.cache
def admitted_spec(strategy: str) -> dict[str, Any]:
    """SPEC as the apiserver stores it (the CRD's defaults filled in); parsed once, the CRD is large."""
    return with_crd_defaults({"spec": {**SPEC, "rolloutStrategy": strategy}})["spec"]


@pytest.mark.parametrize("strategy", ["Recreate", "Surge"])
@settings(derandomize=True, suppress_health_check=[HealthCheck.too_slow])  # count: the hypothesis profile's
@given(events=event_sequences())
def test_invariants_hold_over_random_event_sequences(strategy, events):
    """The pair's invariants after every event of a random sequence. 100 derandomized sequences per strategy in CI,
    3000 with PDPAIR_FULL_PROPERTY_TESTS=1 (tests/property_counts.py)."""
    world = World(copy.deepcopy(admitted_spec(strategy)))
    for event in events:
        apply_event(world, event)
        world.check_budget()


def test_the_property_world_reaches_ready_and_restarts_in_order():
    """The simulated world is capable of the good path (so the property test is not vacuous): a pair comes up
    decode-first, hangs, restarts in order (prefill and router deleted before decode), and is Ready again."""
    world = World(dict(SPEC))

    def settle(max_passes=60):
        for _ in range(max_passes):
            world.run_pass()
            for name, p in list(world.pods.items()):
                if p.deleting:
                    del world.pods[name]
                elif not p.ready:
                    world.pods[name] = _with(p, scheduled=True, phase="Running", ip="10.0.0.2", ready=True,
                                             node=p.node or ("n2" if p.role == ROLE_DECODE else "n1"))
                    if p.role == ROLE_DECODE:
                        world.accepting.add(name)
            if world.status.get("phase") == "Ready":
                return
        raise AssertionError(f"not Ready: {world.status}")

    settle()
    assert sorted(p.role for p in world.pods.values()) == [ROLE_DECODE, ROLE_PREFILL, ROLE_ROUTER]
    world.health = Finding(health.REASON_HUNG, "hung", 1)
    world.run_pass()
    deleting = sorted(p.role for p in world.pods.values() if p.deleting)
    assert deleting == [ROLE_PREFILL, ROLE_ROUTER] and world.status["pairGeneration"] == 2
    settle()
    assert {p.generation for p in world.pods.values()} == {2} and world.restarts == [NOW]


def _settle(world: World, max_passes: int = 80) -> None:
    """Passes and a cooperative cluster until the pair is Ready: kubelets finish deletions on nodes that are not
    lost, pods are scheduled onto Ready nodes (decode prefers n2), run, become Ready, decode listens."""
    for _ in range(max_passes):
        world.run_pass()
        apply_event(world, ("gone", 0, 0.0))
        for _ in range(3):
            apply_event(world, ("progress", 0, 0.0))
        apply_event(world, ("listen", 0, 0.0))
        if world.status.get("phase") == "Ready" and not any(
                p.generation == world.status["pairGeneration"] and p.node in world.lost for p in world.pods.values()):
            return
    raise AssertionError(f"not Ready: {world.status}, pods {world.pods}")


@pytest.mark.parametrize("strategy", ["Recreate", "Surge"])
@pytest.mark.parametrize("lose_after_passes", [0, 1, 2, 3, 4, 6, 9, None])
def test_a_lost_node_never_blocks_the_pair_and_its_pods_ports_are_never_reused(strategy, lose_after_passes):
    """Node n2 (where decode runs) is cut off at some step of the startup (None: once Ready): its pods keep running
    and their deletion is never confirmed while the partition lasts. The pair must still reach Ready on n1, once,
    with no pod ever created on a port a pod on n2 may hold (World._create checks it); after the partition heals,
    the old pods go and their fences with them."""
    world = World(copy.deepcopy(admitted_spec(strategy)))
    if lose_after_passes is None:
        _settle(world)
    else:
        for _ in range(lose_after_passes):
            world.run_pass()
            for _ in range(2):
                apply_event(world, ("progress", 0, 0.0))
            apply_event(world, ("listen", 0, 0.0))
    before = world.status.get("pairGeneration")
    world.lost.add("n2")
    stranded = {n for n, p in world.pods.items() if p.node == "n2"}
    _settle(world)
    serving = [p for p in world.pods.values() if p.generation == world.status["pairGeneration"]]
    assert sorted(p.role for p in serving) == [ROLE_DECODE, ROLE_PREFILL, ROLE_ROUTER]
    assert all(p.node == "n1" for p in serving), serving
    if stranded:
        assert world.status["pairGeneration"] > (before or 0)
        assert stranded <= set(world.pods), "a pod on the lost node vanished without its kubelet"
        assert world.fenced >= {port for n in stranded for port in world.pods[n].ports}
        conditions = {c.type: c.status for c in planner.plan(world.spec, world.status, world.observe(), world.now)
                      .steps.conditions}
        assert conditions["NodeLost"] == "True"
    assert not world.restarts, "a node-lost restart took from the restart budget"
    apply_event(world, ("node_back", 1, 0.0))
    _settle(world)
    assert not any(p.node == "n2" for p in world.pods.values() if p.generation != world.status["pairGeneration"])


def test_a_recreate_pair_on_a_cordoned_node_restarts_off_it_outside_the_budget():
    pods = tuple(dataclasses.replace(p, node="n1") for p in READY_PODS)
    decided = planner.plan(SPEC, {"pairGeneration": 1}, observed(pods, nodes={"n1": NodeView("n1", "True", NOW, False,
                                                                                                True)}), NOW)
    assert decided.outcome == planner.OUTCOME_STEP and decided.restart is not None
    assert decided.restart.reason == health.REASON_NODE_DRAIN and not decided.restart.counted
    assert "node n1 is cordoned" in decided.restart.message and decided.steps.pair_generation == 2
    assert decided.restart_times is None  # outside the budget: no restart time recorded
    # Schedulable, or a Surge pair (surge.py re-homes it instead): no restart.
    calm = planner.plan(SPEC, {"pairGeneration": 1}, observed(pods, nodes={"n1": NodeView("n1", "True", NOW)}), NOW)
    assert calm.restart is None
    surge = planner.plan({**SPEC, "rolloutStrategy": "Surge"}, {"pairGeneration": 1},
                         observed(pods, nodes={"n1": NodeView("n1", "True", NOW, False, True)}), NOW)
    assert surge.restart is None
