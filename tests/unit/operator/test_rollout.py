"""Surge rollouts (surge.py): table tests of the pure planner and whole rollouts simulated pass by pass.

The simulation applies each plan the way the executor does (status fields, creates on the rollout's port set,
deletes, port-set releases) and checks at every pass that the generation the router Service selects still has a
Ready router until the switch, i.e. that no request finds nobody to serve it.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field, replace
from typing import Any

import pytest

from pdpair.contract import COND_PROGRESSING, ROLE_DECODE, ROLE_PREFILL, ROLE_ROUTER
from pdpair.operator.decide import recreate as d
from pdpair.operator.decide import surge as r
from pdpair.operator.model import timestamps
from pdpair.operator.decide import instances
from pdpair.operator.model.pair_spec import spec_fingerprint
from pdpair.operator.model.observed import NodeView, Observed, PodView
from pdpair.operator.decide.planner import next_step
from tests.crd_defaults import with_crd_defaults


def make_spec(**extra: Any) -> dict[str, Any]:
    """One router replica unless `extra` says otherwise: the worlds below name one pod per role and generation."""
    extra.setdefault("router", {"replicas": 1})
    pair = with_crd_defaults({"metadata": {"name": "p"}, "spec": {"model": "m", "image": "img:1", **extra}})
    return pair["spec"]


SURGE = make_spec(rolloutStrategy="Surge", rollout={"drainSeconds": 30, "progressDeadlineSeconds": 600})
SURGE_V2 = {**SURGE, "decode": {**SURGE["decode"], "args": ["--seed", "1"]}}
SURGE_V3 = {**SURGE, "decode": {**SURGE["decode"], "args": ["--seed", "2"]}}
T0 = 1_700_000_000.0


def pod(role, gen, spec=SURGE, phase="Running", ready=True, deleting=False, restarts=0):
    return PodView(f"p-{role}-g{gen}", role, gen, spec_fingerprint(spec), phase, ready,
                   "10.0.0.1" if phase == "Running" else None, deleting, True, restarts, uid=f"uid-{role}-{gen}")


def serving(gen=1, spec=SURGE):
    return tuple(pod(role, gen, spec) for role in (ROLE_DECODE, ROLE_PREFILL, ROLE_ROUTER))


def condition(plan: d.Plan, type_: str):
    return next((c for c in plan.conditions if c.type == type_), None)


@dataclass
class World:
    """The executor's effects on the outside world, without an apiserver: pods appear Running/Ready when made (or
    as `make_pod` says), deletes mark a pod terminating and `settle` removes it, leases are port-set names."""

    spec: dict[str, Any]
    status: dict[str, Any] = field(default_factory=lambda: {"pairGeneration": 1, "phase": "Ready"})
    pods: dict[str, PodView] = field(default_factory=dict)
    slots: set[str] = field(default_factory=lambda: {"a"})
    now: float = T0
    log: list[str] = field(default_factory=list)
    events: list[str] = field(default_factory=list)
    make_pod: Any = None  # (role, generation) -> PodView | None to override
    nodes: dict[str, Any] = field(default_factory=dict)  # node name -> NodeView

    def observe(self, restart_reason: str | None = None) -> Observed:
        active = r.active_rollout(self.status)
        progressing = bool(active) and active["phase"] == r.PHASE_PROGRESSING
        if progressing:
            self.slots.add(active["portSlot"])  # the executor leases the rollout's port set first
        return Observed(pods=tuple(self.pods.values()), ports_complete=True, decode_listening=True,
                        restart_reason=restart_reason, rollout_ports_complete=progressing,
                        rollout_decode_listening=progressing, leased_slots=frozenset(self.slots), nodes=self.nodes)

    def apply(self, plan: d.Plan, dies_before_release: bool = False) -> None:
        """`dies_before_release`: the pass dies after its status write and pod actions, before Plan.release_slot
        (an API error on a lease delete, a SIGKILL, lost leadership)."""
        self.status["pairGeneration"] = plan.pair_generation
        self.status["phase"] = plan.phase
        for key, value in plan.status_fields.items():
            if value is None:
                self.status.pop(key, None)
            else:
                self.status[key] = copy.deepcopy(dict(value)) if isinstance(value, dict) else value
        self.events += [reason for _, reason, _ in plan.events]
        for name in plan.delete:
            self.log.append(f"delete {name}")
            self.pods[name] = replace(self.pods[name], deleting=True)
        if plan.create:
            gen = plan.create_generation if plan.create_generation is not None else plan.pair_generation
            name = f"p-{plan.create}-g{gen}"
            self.log.append(f"create {name}" + (f" on {plan.create_slot}" if plan.create_slot else ""))
            made = self.make_pod(plan.create, gen) if self.make_pod else None
            self.pods[name] = made or pod(plan.create, gen, self.spec)
        if plan.release_slot and not dies_before_release:
            self.log.append(f"release {plan.release_slot}")
            self.slots.discard(plan.release_slot)

    def settle(self) -> None:
        for name in [n for n, p in self.pods.items() if p.deleting]:
            del self.pods[name]

    def service_target_ready(self) -> bool:
        gen = self.status["pairGeneration"]
        return any(p.role == ROLE_ROUTER and p.generation == gen and p.ready and not p.deleting
                   for p in self.pods.values())

    def run(self, until, max_passes: int = 80, tick: float = 5.0, restart_at: int | None = None) -> list[d.Plan]:
        plans = []
        for i in range(max_passes):
            plan = next_step(self.spec, self.status, self.observe("hang" if i == restart_at else None), self.now)
            plans.append(plan)
            self.apply(plan)
            if until(plan, self):
                return plans
            self.settle()
            self.now += tick
        raise AssertionError(f"not done after {max_passes} passes: {[p.step for p in plans]}")


def ready_without_rollout(plan: d.Plan, world: World) -> bool:
    return plan.step == d.STEP_READY and "rollout" not in world.status


def test_surge_rollout_keeps_the_old_generation_serving_until_the_new_one_is_ready():
    world = World(SURGE_V2, pods={p.name: p for p in serving(1)})
    checks = []

    def until(plan, w):
        checks.append((plan.step, w.service_target_ready()))
        return ready_without_rollout(plan, w)

    plans = world.run(until)
    assert all(ok for _, ok in checks), checks  # at every pass the Service's generation had a Ready router
    assert world.log == [
        "create p-decode-g2 on b", "create p-prefill-g2 on b", "create p-router-g2 on b",
        "delete p-router-g1", "delete p-prefill-g1", "delete p-decode-g1", "release a",
    ]
    assert world.events == [r.EVENT_ROLLING_OUT, r.EVENT_SWITCHED, r.EVENT_DRAINED]
    assert world.status["pairGeneration"] == 2 and world.status["portSlot"] == "b" and world.slots == {"b"}
    assert all(p.generation == 2 for p in world.pods.values()) and len(world.pods) == 3
    steps = [p.step for p in plans]
    assert steps.index(r.STEP_ROLLOUT_SWITCH) < steps.index(r.STEP_ROLLOUT_DELETE)
    # the phase stays Ready (the pair serves) all along, and the status named both generations meanwhile
    assert {p.phase for p in plans} == {"Ready"}
    assert any(p.status_fields.get("rollout", {}) and p.status_fields["rollout"].get("toGeneration") == 2
               for p in plans)


def test_old_generation_drains_for_drain_seconds_after_the_switch():
    world = World(SURGE_V2, pods={p.name: p for p in serving(1)})
    plans = world.run(lambda plan, w: plan.step == r.STEP_ROLLOUT_SWITCH)
    switch = plans[-1]
    assert switch.switch_ports and switch.pair_generation == 2 and switch.wait_seconds == 30
    assert world.status["rollout"]["phase"] == r.PHASE_DRAINING
    world.settle()
    world.now += 29
    wait = next_step(world.spec, world.status, world.observe(), world.now)
    assert wait.step == r.STEP_ROLLOUT_DRAIN and not wait.delete and 0 < wait.wait_seconds <= 1
    world.now += 1
    go = next_step(world.spec, world.status, world.observe(), world.now)
    assert go.step == r.STEP_ROLLOUT_DELETE and go.delete == ("p-router-g1", "p-prefill-g1")


def test_switch_keeps_the_service_port_clients_know():
    status = {"pairGeneration": 1, "phase": "Ready",
              "ports": [{"name": "router-http-0", "role": "router", "purpose": "http", "rank": 0, "port": 20007}]}
    world = World(SURGE_V2, status=status, pods={p.name: p for p in serving(1)})
    world.run(lambda plan, w: plan.step == r.STEP_ROLLOUT_SWITCH)
    assert world.status["servicePort"] == 20007


def test_a_failing_new_generation_is_rolled_back_and_the_old_one_keeps_serving():
    def make_pod(role, gen):
        return pod(role, gen, SURGE_V2, phase="Failed", ready=False) if role == ROLE_PREFILL else None

    world = World(SURGE_V2, pods={p.name: p for p in serving(1)}, make_pod=make_pod)
    plans = world.run(lambda plan, w: plan.step == r.STEP_ROLLOUT_DONE)
    assert world.log == ["create p-decode-g2 on b", "create p-prefill-g2 on b",
                         "delete p-prefill-g2", "delete p-decode-g2", "release b"]
    assert world.events == [r.EVENT_ROLLING_OUT, r.EVENT_FAILED, r.EVENT_ROLLED_BACK]
    assert world.status["failedRollout"]["specHash"] == spec_fingerprint(SURGE_V2)
    assert "failed" in world.status["failedRollout"]["reason"]
    assert all(p.phase == "Ready" for p in plans)  # serving all along
    assert condition(plans[-1], COND_PROGRESSING).status == "False"
    assert condition(plans[-1], COND_PROGRESSING).reason == "RolloutFailed"
    # the same spec is not tried again (a restarted operator reads failedRollout from status) ...
    world.settle()
    hold = next_step(world.spec, world.status, world.observe(), world.now + 5)
    assert hold.step == d.STEP_READY and hold.pair_generation == 1 and not hold.create and not hold.status_fields
    assert condition(hold, COND_PROGRESSING).reason == "RolloutFailed"
    assert {p.generation for p in world.pods.values()} == {1}
    # ... until the spec changes again
    world.spec = SURGE_V3
    again = next_step(world.spec, world.status, world.observe(), world.now + 10)
    assert again.step == r.STEP_ROLLOUT_START and again.status_fields["failedRollout"] is None


def test_a_new_generation_not_ready_within_the_deadline_is_rolled_back():
    world = World(SURGE_V2, pods={p.name: p for p in serving(1)},
                  make_pod=lambda role, gen: pod(role, gen, SURGE_V2, ready=False) if role == ROLE_DECODE else None)
    plans = world.run(lambda plan, w: bool(w.status.get("failedRollout")), tick=60)
    assert "not Ready within 600s" in world.status["failedRollout"]["reason"]
    assert plans[-1].pair_generation == 1 and plans[-1].phase == "Ready"
    waiting = [p for p in plans if p.step == d.STEP_WAIT_DECODE_READY]
    assert waiting and all(0 < p.wait_seconds <= 600 for p in waiting)  # the deadline bounds the pass delay


def test_a_restarted_new_container_fails_the_rollout():
    world = World(SURGE_V2, pods={p.name: p for p in serving(1)})
    world.run(lambda plan, w: plan.step == r.STEP_ROLLOUT_START)
    world.pods["p-decode-g2"] = pod(ROLE_DECODE, 2, SURGE_V2, restarts=1)
    plan = next_step(world.spec, world.status, world.observe(), world.now)
    assert world.status["rollout"]["phase"] == r.PHASE_PROGRESSING
    assert plan.status_fields["rollout"]["phase"] == r.PHASE_ROLLING_BACK
    assert "restarted" in plan.status_fields["failedRollout"]["reason"]


def test_a_second_spec_change_mid_rollout_rolls_back_without_recording_a_failure_then_rolls_out_again():
    world = World(SURGE_V2, pods={p.name: p for p in serving(1)})
    world.run(lambda plan, w: "p-prefill-g2" in w.pods)
    world.spec = SURGE_V3
    world.run(lambda plan, w: plan.step == r.STEP_ROLLOUT_DONE)
    assert "failedRollout" not in world.status
    world.settle()
    world.run(ready_without_rollout)
    assert {p.spec_hash for p in world.pods.values()} == {spec_fingerprint(SURGE_V3)}
    assert world.status["pairGeneration"] == 2 and world.slots == {"b"}


def test_a_restart_of_the_serving_generation_abandons_the_rollout_and_recreates():
    world = World(SURGE_V2, pods={p.name: p for p in serving(1)})
    world.run(lambda plan, w: "p-decode-g2" in w.pods)
    plans = world.run(ready_without_rollout, restart_at=0)
    assert plans[0].pair_generation == 3  # past the rollout's generation 2
    assert world.status["pairGeneration"] == 3 and {p.generation for p in world.pods.values()} == {3}
    assert "release b" in world.log and world.slots == {"a"}  # the abandoned generation's port set went
    assert world.log.index("delete p-decode-g2") < world.log.index("create p-decode-g3")


def test_a_restart_while_draining_finishes_off_the_old_port_set():
    world = World(SURGE_V2, pods={p.name: p for p in serving(1)})
    world.run(lambda plan, w: plan.step == r.STEP_ROLLOUT_SWITCH)
    world.run(ready_without_rollout, restart_at=0)
    assert world.status["pairGeneration"] == 3 and {p.generation for p in world.pods.values()} == {3}
    assert world.slots == {"b"} and world.status["portSlot"] == "b"


def test_serving_generation_broken_during_a_rollout_is_reported_for_the_restart_policy():
    world = World(SURGE_V2, pods={p.name: p for p in serving(1)})
    world.run(lambda plan, w: "p-decode-g2" in w.pods)
    world.pods["p-prefill-g1"] = pod(ROLE_PREFILL, 1, SURGE, phase="Failed", ready=False)
    plan = next_step(world.spec, world.status, world.observe(), world.now)
    assert plan.step == d.STEP_BROKEN and plan.pair_generation == 1 and "prefill" in plan.broken_reason


@pytest.mark.parametrize("name, spec, pods, status", [
    ("Recreate strategy", {**SURGE_V2, "rolloutStrategy": "Recreate"}, serving(1), {"pairGeneration": 1}),
    ("the old generation is not Ready: nothing to protect", SURGE_V2,
     (pod(ROLE_DECODE, 1), pod(ROLE_PREFILL, 1, ready=False)), {"pairGeneration": 1}),
])
def test_recreate_when_surge_does_not_apply(name, spec, pods, status):
    plan = next_step(spec, status, Observed(pods=pods, ports_complete=True, decode_listening=True), T0)
    assert plan.step == d.STEP_DELETE_PREFILL and plan.pair_generation == 2 and plan.rolled_out
    assert "rollout" not in plan.status_fields


def test_start_records_the_rollout_in_status_before_any_pod():
    plan = next_step(SURGE_V2, {"pairGeneration": 4, "portSlot": "b"},
                         Observed(pods=serving(4), ports_complete=True, decode_listening=True), T0)
    assert plan.step == r.STEP_ROLLOUT_START and plan.create is None and not plan.delete
    rollout = plan.status_fields["rollout"]
    assert (rollout["fromGeneration"], rollout["toGeneration"], rollout["portSlot"]) == (4, 5, "a")
    assert rollout["specHash"] == spec_fingerprint(SURGE_V2) and timestamps.epoch(rollout["startedAt"]) == T0
    assert condition(plan, COND_PROGRESSING).status == "True"


def test_no_room_for_a_second_port_set_fails_the_rollout():
    world = World(SURGE_V2, pods={p.name: p for p in serving(1)})
    world.run(lambda plan, w: plan.step == r.STEP_ROLLOUT_START)
    observed = replace(world.observe(), rollout_ports_complete=False, rollout_pool_exhausted=True,
                       rollout_pool_message="no 1 free port(s)")
    plan = next_step(world.spec, world.status, observed, world.now)
    assert plan.status_fields["rollout"]["phase"] == r.PHASE_ROLLING_BACK
    assert "no 1 free port(s)" in plan.status_fields["failedRollout"]["reason"]


def test_the_new_prefill_starts_beside_the_new_decode_and_the_switch_waits_for_its_listener():
    """Parallel start in a Surge rollout: the new prefill is created in the pass after the new decode (beside it,
    before it runs: the push brings its address); the new generation does not take over until the operator saw the
    new decode's listener accept."""
    world = World(SURGE_V2, pods={p.name: p for p in serving(1)})
    world.run(lambda plan, w: "p-decode-g2" in w.pods)
    plan = next_step(world.spec, world.status, replace(world.observe(), rollout_decode_listening=False), world.now)
    assert plan.create == ROLE_PREFILL and plan.create_generation == 2
    for role in (ROLE_PREFILL, ROLE_ROUTER):
        world.pods[f"p-{role}-g2"] = pod(role, 2, SURGE_V2)
    plan = next_step(world.spec, world.status, replace(world.observe(), rollout_decode_listening=False), world.now)
    assert plan.step == d.STEP_WAIT_LISTENER and plan.probe_decode and not plan.switch_ports


def test_a_new_pod_the_api_server_refuses_fails_the_rollout():
    world = World(SURGE_V2, pods={p.name: p for p in serving(1)})
    world.run(lambda plan, w: plan.step == r.STEP_ROLLOUT_START)
    observed = replace(world.observe(), rollout_rejection="the API server refused decode pod p-decode-g2 (422)")
    plan = next_step(world.spec, world.status, observed, world.now)
    assert plan.status_fields["rollout"]["phase"] == r.PHASE_ROLLING_BACK and plan.pair_generation == 1
    assert "refused decode pod" in plan.status_fields["failedRollout"]["reason"]
    assert condition(plan, "Ready").status == "True"  # the serving generation is not touched


# --- a port set left behind: the pass that ended the rollout died before releasing it -------------------------
def plan_for(spec, status, pods, slots, now=T0) -> d.Plan:
    return next_step(spec, status, Observed(pods=pods, ports_complete=True, decode_listening=True,
                                                leased_slots=frozenset(slots)), now)


@pytest.mark.parametrize("name, failing, serving_slot, left_slot", [
    ("drained: the old generation's set", None, "b", "a"),
    ("rolled back: the failed generation's set",
     lambda role, gen: pod(role, gen, SURGE_V2, phase="Failed", ready=False) if role == ROLE_PREFILL else None,
     "a", "b"),
])
def test_a_port_set_whose_release_died_after_the_status_write_is_released_by_the_next_pass(
        name, failing, serving_slot, left_slot):
    world = World(SURGE_V2, pods={p.name: p for p in serving(1)}, make_pod=failing)
    for _ in range(80):
        plan = next_step(world.spec, world.status, world.observe(), world.now)
        world.apply(plan, dies_before_release=plan.step == r.STEP_ROLLOUT_DONE)
        if plan.step == r.STEP_ROLLOUT_DONE:
            break
        world.settle()
        world.now += 5
    # what that pass left: the rollout is over in status, yet both port sets are leased
    assert "rollout" not in world.status and world.status.get("portSlot", "a") == serving_slot
    assert world.slots == {"a", "b"} and "release" not in " ".join(world.log)
    world.now += 5
    redo = next_step(world.spec, world.status, world.observe(), world.now)
    assert redo.step == d.STEP_READY and redo.release_slot == left_slot
    assert not redo.delete and not redo.create and "rollout" not in redo.status_fields
    world.apply(redo)
    assert world.slots == {serving_slot}
    after = next_step(world.spec, world.status, world.observe(), world.now + 5)
    assert after.step == d.STEP_READY and after.release_slot is None


def test_the_state_a_rollback_left_plans_the_release_of_set_b():
    # status says: generation 1 serves on set a, no rollout; leases in a and b; only generation 1's pods exist
    plan = plan_for(SURGE, {"pairGeneration": 1, "phase": "Ready"}, serving(1), {"a", "b"})
    assert plan.step == d.STEP_READY and plan.release_slot == "b"


PROGRESSING_TO_B = {"fromGeneration": 1, "toGeneration": 2, "phase": r.PHASE_PROGRESSING, "portSlot": "b",
                    "specHash": spec_fingerprint(SURGE_V2), "startedAt": timestamps.rfc3339(T0)}


@pytest.mark.parametrize("name, spec, status, pods, slots", [
    ("a rollout is progressing on set b", SURGE_V2,
     {"pairGeneration": 1, "phase": "Ready", "rollout": PROGRESSING_TO_B},
     serving(1) + (pod(ROLE_DECODE, 2, SURGE_V2),), {"a", "b"}),
    ("a rollout is progressing, set b leased, no pod of it yet", SURGE_V2,
     {"pairGeneration": 1, "phase": "Ready", "rollout": PROGRESSING_TO_B}, serving(1), {"a", "b"}),
    ("the old generation drains on set a", SURGE_V2,
     {"pairGeneration": 2, "phase": "Ready", "portSlot": "b",
      "rollout": {**PROGRESSING_TO_B, "phase": r.PHASE_DRAINING, "switchedAt": timestamps.rfc3339(T0)}},
     serving(1) + serving(2, SURGE_V2), {"a", "b"}),
    ("an old-generation pod is still terminating", SURGE_V2,
     {"pairGeneration": 2, "phase": "Ready", "portSlot": "b"},
     serving(2, SURGE_V2) + (pod(ROLE_DECODE, 1, deleting=True),), {"a", "b"}),
    ("an old-generation pod still runs (status lost the rollout)", SURGE_V2,
     {"pairGeneration": 2, "phase": "Ready", "portSlot": "b"},
     serving(2, SURGE_V2) + (pod(ROLE_DECODE, 1),), {"a", "b"}),
    ("this pass starts a rollout: the set is its to adopt", SURGE_V2,
     {"pairGeneration": 1, "phase": "Ready"}, serving(1), {"a", "b"}),
    ("only the serving set a is leased", SURGE, {"pairGeneration": 1, "phase": "Ready"}, serving(1), {"a"}),
    ("only the serving set b is leased", SURGE_V2, {"pairGeneration": 2, "phase": "Ready", "portSlot": "b"},
     serving(2, SURGE_V2), {"b"}),
])
def test_no_port_set_is_released_while_it_may_be_in_use_or_serves(name, spec, status, pods, slots):
    plan = plan_for(spec, status, pods, slots, now=T0 + 1)
    assert plan.release_slot is None, plan.step


@pytest.mark.parametrize("status, pods", [
    ({"pairGeneration": 1, "phase": "Ready"}, serving(1)),
    ({"pairGeneration": 2, "phase": "Ready", "portSlot": "b"}, serving(2, SURGE_V2)),
    ({"pairGeneration": 3, "phase": "Restarting", "portSlot": "b"}, ()),  # a restart deleted every pod
])
def test_the_serving_port_set_is_never_released(status, pods):
    serving_slot = status.get("portSlot", "a")
    spec = SURGE_V2 if serving_slot == "b" else SURGE
    assert plan_for(spec, status, pods, {serving_slot}).release_slot is None
    assert plan_for(spec, status, pods, {"a", "b"}).release_slot == ({"a", "b"} - {serving_slot}).pop()


# --- a cordoned node (kubectl cordon / drain): the pair moves off it (docs/design.md, "Drained nodes") ---------------
CORDONED = NodeView("n1", ready="True", unschedulable=True)


def on_node(pods, node="n1"):
    return {p.name: replace(p, node=node) for p in pods}


def test_a_pod_on_a_cordoned_node_is_re_homed_by_a_surge_of_the_same_spec():
    """Same spec: the rollout's new generation is scheduled elsewhere (the node is unschedulable), switched, then
    the old one drained and deleted, with a Ready router behind the Service at every pass."""
    world = World(SURGE, pods=on_node(serving(1)), nodes={"n1": CORDONED})
    checks = []

    def until(plan, w):
        checks.append(w.service_target_ready())
        return ready_without_rollout(plan, w)

    plans = world.run(until)
    assert all(checks), checks
    assert world.log == [
        "create p-decode-g2 on b", "create p-prefill-g2 on b", "create p-router-g2 on b",
        "delete p-router-g1", "delete p-prefill-g1", "delete p-decode-g1", "release a",
    ]
    assert world.events == [r.EVENT_ROLLING_OUT, r.EVENT_SWITCHED, r.EVENT_DRAINED]
    assert {p.phase for p in plans} == {"Ready"}
    start = next(p for p in plans if p.step == r.STEP_ROLLOUT_START)
    assert "node n1 is cordoned" in start.events[0][2] and "re-homing" in start.message
    assert world.status["rollout" if "rollout" in world.status else "pairGeneration"] == 2
    assert all(p.generation == 2 and p.node != "n1" for p in world.pods.values())
    # Off the node, nothing more to do: the next pass is Ready with no rollout.
    assert next_step(world.spec, world.status, world.observe(), world.now).step == d.STEP_READY


@pytest.mark.parametrize("name, node, pods", [
    ("the node is schedulable", NodeView("n1", ready="True"), serving(1)),
    ("the node is cordoned but not Ready (the lost-node path's)", NodeView("n1", ready="Unknown", unschedulable=True),
     serving(1)),
    ("the node is cordoned and unreachable", NodeView("n1", ready="True", unschedulable=True, unreachable=True),
     serving(1)),
    ("the pair is not Ready: nothing to protect", CORDONED,
     (pod(ROLE_DECODE, 1), pod(ROLE_PREFILL, 1, ready=False))),
])
def test_no_re_home(name, node, pods):
    plan = next_step(SURGE, {"pairGeneration": 1},
                     Observed(pods=tuple(on_node(pods).values()), ports_complete=True, decode_listening=True,
                              nodes={"n1": node}), T0)
    assert plan.step != r.STEP_ROLLOUT_START and "rollout" not in plan.status_fields, (name, plan.step)


# --- xPyD: a Surge rollout of a 2P2D pair --------------------------------------------------
SURGE_2P2D = make_spec(rolloutStrategy="Surge", rollout={"drainSeconds": 30, "progressDeadlineSeconds": 600},
                       prefill={"replicas": 2}, decode={"replicas": 2})
SURGE_2P2D_V2 = {**SURGE_2P2D, "decode": {**SURGE_2P2D["decode"], "args": ["--seed", "1"]}}


@dataclass
class InstanceWorld(World):
    """World with instance-numbered pods (`p-<role>-g<gen>-<i>` for i >= 1, as pods.pod_name names them)."""

    def apply(self, plan: d.Plan, dies_before_release: bool = False) -> None:
        if plan.create and plan.create_instance:
            gen = plan.create_generation if plan.create_generation is not None else plan.pair_generation
            name = f"p-{plan.create}-g{gen}-{plan.create_instance}"
            self.log.append(f"create {name}")
            self.pods[name] = replace(pod(plan.create, gen, self.spec), name=name, instance=plan.create_instance,
                                      uid=f"uid-{name}")
            plan = replace(plan, create=None)
        super().apply(plan, dies_before_release)


def test_a_surge_rollout_of_a_2p2d_pair_switches_only_once_every_new_instance_serves():
    """Revision coherence: the old generation serves with all its instances until the switch; the new generation
    starts all of its instances (decodes first, then the prefills, all at once) on the other port set; no
    prefill or router is ever given an instance of another generation; then the old one drains and goes.
    Cost: pure, well under a second."""
    old = {}
    for role in (ROLE_DECODE, ROLE_PREFILL):
        for i in range(2):
            p = pod(role, 1, SURGE_2P2D)
            p = replace(p, name=p.name + (f"-{i}" if i else ""), instance=i, uid=f"uid-{role}-1-{i}")
            old[p.name] = p
    router = pod(ROLE_ROUTER, 1, SURGE_2P2D)
    old[router.name] = router
    world = InstanceWorld(SURGE_2P2D_V2, pods=dict(old))
    switched = []

    def until(plan, w):
        pods = list(w.pods.values())
        for gen in (1, 2):
            assert {p.generation for p in instances.prefill_peers(pods, gen)} <= {gen}
            assert {p.generation for p in instances.router_members(pods, gen)} <= {gen}
        if plan.step == r.STEP_ROLLOUT_SWITCH:
            switched.append(sorted((p.role, p.instance) for p in pods if p.generation == 2 and p.ready))
        else:
            assert not switched or plan.pair_generation == 2
        if not switched:  # before the switch every old instance is still there and serving
            assert all(n in w.pods and not w.pods[n].deleting for n in old), (plan.step, w.log)
        return ready_without_rollout(plan, w)

    plans = world.run(until, max_passes=120)
    assert switched == [[(ROLE_DECODE, 0), (ROLE_DECODE, 1), (ROLE_PREFILL, 0), (ROLE_PREFILL, 1),
                         (ROLE_ROUTER, 0)]]
    creates = [line for line in world.log if line.startswith("create")]
    assert sorted(creates) == sorted(["create p-decode-g2 on b", "create p-decode-g2-1", "create p-prefill-g2 on b",
                                      "create p-prefill-g2-1", "create p-router-g2 on b"]), creates
    assert creates.index("create p-prefill-g2 on b") > creates.index("create p-decode-g2 on b")
    assert {p.phase for p in plans} == {"Ready"}
    assert sorted(world.pods) == ["p-decode-g2", "p-decode-g2-1", "p-prefill-g2", "p-prefill-g2-1", "p-router-g2"]


def test_a_surge_rollout_with_two_router_replicas_ends_with_both_on_the_new_generation():
    """spec.router.replicas 2: the old generation's two routers serve until the switch, the new generation gets two
    of its own (router 1 once router 0 exists), no router is given another generation's instance, and only the
    new generation's pods are left. Cost: pure, well under a second."""
    spec_v1 = make_spec(rolloutStrategy="Surge", rollout={"drainSeconds": 30, "progressDeadlineSeconds": 600},
                        prefill={"replicas": 2}, decode={"replicas": 2}, router={"replicas": 2})
    spec_v2 = {**spec_v1, "decode": {**spec_v1["decode"], "args": ["--seed", "1"]}}
    old = {}
    for role, count in ((ROLE_DECODE, 2), (ROLE_PREFILL, 2), (ROLE_ROUTER, 2)):
        for i in range(count):
            p = pod(role, 1, spec_v1)
            p = replace(p, name=p.name + (f"-{i}" if i else ""), instance=i, uid=f"uid-{role}-1-{i}")
            old[p.name] = p
    world = InstanceWorld(spec_v2, pods=dict(old))

    def until(plan, w):
        pods = list(w.pods.values())
        for gen in (1, 2):
            assert {p.generation for p in instances.router_members(pods, gen)} <= {gen}
        return ready_without_rollout(plan, w)

    plans = world.run(until, max_passes=120)
    assert {p.phase for p in plans} == {"Ready"}
    assert sorted(world.pods) == ["p-decode-g2", "p-decode-g2-1", "p-prefill-g2", "p-prefill-g2-1", "p-router-g2",
                                  "p-router-g2-1"]
