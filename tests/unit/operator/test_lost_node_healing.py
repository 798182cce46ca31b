"""A lost node in a serving xPyD pair, through planner.plan (nodes, fences, the healer): only what ran there is
replaced, alone, and the pair keeps its generation; a pair that cannot serve without that node is re-homed whole.

Cost: under a second (pure; no cluster, no engine)."""

from __future__ import annotations

import dataclasses

from pdpair.operator.decide import planner
from pdpair.operator.decide import recreate as d
from pdpair.operator.decide.health import REASON_NODE_LOST
from pdpair.operator.model.observed import NodeView
from tests.unit.operator.sim import SimWorld, simulate_until_ready
from tests.unit.operator.test_instances import spec

NOW = 5000.0
UP = NodeView("n1", ready="True")
LOST = NodeView("n2", ready="Unknown", since=NOW - 60, unreachable=True)


def _placed(world: SimWorld, on_n2: set[str]) -> dict[str, int]:
    """Binds every pod to n1 or n2 with two ports of its own; returns each pod's first port."""
    first = {}
    for i, (name, pod) in enumerate(sorted(world.pods.items())):
        first[name] = 30000 + 2 * i
        world.pods[name] = dataclasses.replace(pod, node="n2" if name in on_n2 else "n1", uid=f"uid-{name}",
                                               ports=(30000 + 2 * i, 30001 + 2 * i))
    return first


def _observed(world: SimWorld, held: set[int]):
    return dataclasses.replace(world.observe(), nodes={"n1": UP, "n2": LOST}, node_lost_seconds=30.0,
                               held_pool_ports=frozenset(held), meta_generation=1)


def _serving_2p2d(routers: int = 1) -> SimWorld:
    world = SimWorld(spec(prefill=2, decode=2, routers=routers))
    simulate_until_ready(world)
    world.status["observedGeneration"] = 1
    return world


def test_a_lost_node_takes_only_its_instances_and_the_router_and_they_come_back_alone():
    """2P2D with the router, prefill 0 and decode 0 on n2, which is lost: until their ports are fenced the healer
    waits (no restart, no delete); then it force-deletes those three at once, outside any budget, and re-creates
    them (decode 0, prefill 0, the router) on the same generation, while prefill 1 and decode 1 serve throughout."""
    world = _serving_2p2d()
    gone = {"p-router-1", "p-prefill-1", "p-decode-1"}
    _placed(world, gone)
    every = {p for name in world.pods for p in world.pods[name].ports}
    unfenced = planner.plan(world.spec, world.status, _observed(world, every), NOW)
    assert unfenced.outcome == planner.OUTCOME_STEP and unfenced.restart is None
    assert not unfenced.steps.force_delete and not unfenced.steps.delete and unfenced.steps.phase == "Ready"
    assert "wait for their ports to be fenced" in unfenced.steps.message
    held = every - {p for name in gone for p in world.pods[name].ports}
    decided = planner.plan(world.spec, world.status, _observed(world, held), NOW)
    steps = decided.steps
    assert decided.restart is None and steps.pair_generation == 1 and steps.phase == "Ready"
    assert set(steps.force_delete) == gone and not steps.delete and not steps.create
    assert steps.replaced_instance[1] == REASON_NODE_LOST and steps.instance_restart_times is None
    ready = next(c for c in steps.conditions if c.type == "Ready")
    assert (ready.status, ready.reason) == ("False", "RouterReplacing")
    world.apply(steps)
    made = []
    for _ in range(8):
        plan = planner.plan(world.spec, world.status, _observed(world, held), NOW).steps
        assert plan.pair_generation == 1 and plan.phase == "Ready" and not plan.delete, plan
        if plan.step == d.STEP_READY:
            break
        world.apply(plan)
        made.append(plan.create)
    assert sorted(made) == ["decode", "prefill", "router"]
    assert all(not p.deleting for p in world.pods.values()) and len(world.pods) == 5


def test_a_lost_node_that_held_a_whole_role_re_homes_the_pair():
    """Both prefills on the lost node: nothing could serve without it, so the generation restarts in order on
    Ready nodes (outside the budget), as a 1P1D pair always does."""
    world = _serving_2p2d()
    gone = {"p-prefill-1", "p-prefill-1-1"}
    _placed(world, gone)
    held = {p for name in world.pods if name not in gone for p in world.pods[name].ports}
    decided = planner.plan(world.spec, world.status, _observed(world, held), NOW)
    assert decided.restart is not None and decided.restart.reason == REASON_NODE_LOST
    assert not decided.restart.counted and decided.steps.pair_generation == 2


def test_a_lost_node_under_a_starting_generation_re_homes_it():
    """Before the generation served there is nothing to keep serving: the whole pair is re-homed."""
    world = _serving_2p2d()
    world.status["phase"] = "PrefillStarting"
    gone = {"p-decode-1-1"}
    _placed(world, gone)
    held = {p for name in world.pods if name not in gone for p in world.pods[name].ports}
    decided = planner.plan(world.spec, world.status, _observed(world, held), NOW)
    assert decided.restart is not None and decided.restart.reason == REASON_NODE_LOST


def test_with_two_router_replicas_the_pair_stays_ready_through_the_loss():
    """The same loss with spec.router.replicas 2, router 1 on the node that stays: the Ready condition never turns
    False (router 1 serves while router 0, prefill 0 and decode 0 are replaced)."""
    world = _serving_2p2d(routers=2)
    gone = {"p-router-1", "p-prefill-1", "p-decode-1"}
    _placed(world, gone)
    held = {p for name in world.pods if name not in gone for p in world.pods[name].ports}
    made = []
    for _ in range(10):
        plan = planner.plan(world.spec, world.status, _observed(world, held), NOW).steps
        assert plan.pair_generation == 1 and plan.phase == "Ready", plan
        assert next(c for c in plan.conditions if c.type == "Ready").status == "True", plan
        if plan.step == d.STEP_READY and not plan.force_delete:
            break
        world.apply(plan)
        made.append(plan.create)
    assert sorted(m for m in made if m) == ["decode", "prefill", "router"] and len(world.pods) == 6
